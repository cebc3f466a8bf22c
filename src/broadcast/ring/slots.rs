//! Who holds each side of a ring: one slot for the writer and one per reader, each with
//! the holder's pid and start time (to tell a live peer from a dead one), a state and a
//! message count. Uses the ring's mapping ([`super::Ring`]) and [`crate::process`].

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use super::layout::{SLOTS_OFFSET, SLOT_SIZE};
use super::Ring;
use crate::error::{Error, Result};
use crate::process::ProcessId;

/// Slot states (0, the state of a fresh segment: nobody has attached).
pub(super) const ATTACHED: u32 = 1;
pub(super) const DROPPED: u32 = 2;
/// A process is writing its pid and start time into the slot.
pub(super) const ATTACHING: u32 = 3;

/// Who holds a side of the ring, and how many messages it has handled.
#[repr(C, align(64))]
pub(super) struct Slot {
    pub(super) pid: AtomicU32,
    pub(super) state: AtomicU32,
    pub(super) start_time: AtomicU64,
    pub(super) messages: AtomicU64,
}
const _: () = assert!(std::mem::size_of::<Slot>() == SLOT_SIZE);

/// The state of one slot, for inspection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotInfo {
    /// The process that attached to it last, if any.
    pub process: Option<ProcessId>,
    /// Dropped by the writer after its process died.
    pub dropped: bool,
    /// Messages written (writer) or read (reader).
    pub messages: u64,
}

impl Ring {
    /// Slot 0 is the writer's, slot `1 + r` reader `r`'s.
    pub(super) fn slot(&self, index: usize) -> &Slot {
        debug_assert!(index <= self.geo.n_reader);
        // SAFETY: index <= n_reader, so the slot lies below states_offset (Geometry::new);
        // 64-aligned; only accessed atomically.
        unsafe { &*(self.base.as_ptr().add(SLOTS_OFFSET + SLOT_SIZE * index) as *const Slot) }
    }

    /// The writer's (`None`) or reader `r`'s slot.
    pub fn slot_info(&self, reader: Option<usize>) -> Result<SlotInfo> {
        let index = match reader {
            None => 0,
            Some(r) if r < self.geo.n_reader => 1 + r,
            Some(r) => {
                return Err(Error::InvalidArgument(format!(
                    "no reader {r}: the ring has {}",
                    self.geo.n_reader
                )))
            }
        };
        let slot = self.slot(index);
        // A seqlock on the state: Acquire pairs with the Release store in `attach`; the
        // state read again after the fence must be unchanged, or a re-attach was under
        // way and pid and start time may be torn (then nobody is named: liveness checks
        // skip the slot this time).
        let state = slot.state.load(Ordering::Acquire);
        // Relaxed: ordered by the Acquire load above and the fence below.
        let (pid, start_time) = (
            slot.pid.load(Ordering::Relaxed),
            slot.start_time.load(Ordering::Relaxed),
        );
        fence(Ordering::Acquire);
        // Relaxed: ordered after the reads above by the fence.
        let stable = slot.state.load(Ordering::Relaxed) == state;
        let process = (stable && (state == ATTACHED || state == DROPPED))
            .then_some(ProcessId { pid, start_time });
        // Relaxed: a statistic.
        Ok(SlotInfo {
            process,
            dropped: state == DROPPED,
            messages: slot.messages.load(Ordering::Relaxed),
        })
    }

    /// Record this process as the holder of slot `index`.
    pub(super) fn attach(&self, index: usize) -> Result<()> {
        let me = ProcessId::current();
        let slot = self.slot(index);
        // Relaxed: the state carries no data of its own here (see `slot_info`).
        if slot.state.load(Ordering::Relaxed) == DROPPED {
            return Err(Error::WrongRole(format!(
                "reader {} was dropped by the writer after its process died; it cannot join this queue again",
                index - 1
            )));
        }
        // Relaxed, then a Release fence: `slot_info` sees ATTACHING (or a changed state)
        // if it reads any of the new pid/start time before the final store.
        slot.state.store(ATTACHING, Ordering::Relaxed);
        fence(Ordering::Release);
        // Relaxed: published by the Release store of the state below.
        slot.pid.store(me.pid, Ordering::Relaxed);
        slot.start_time.store(me.start_time, Ordering::Relaxed);
        // Release: pairs with the Acquire load in `slot_info`.
        slot.state.store(ATTACHED, Ordering::Release);
        Ok(())
    }
}
