//! Who holds each side of a ring: one slot for the writer and one per reader.
//!
//! A slot records its holder (pid and start time, to name it), a state and a message
//! count, under the generation-stamped seqlock of [`shmq_protocol::ring`] (`slot_*`). Holding
//! a slot also means holding its role lock (byte `1 + slot` of the ring's file, see
//! [`shmq_os::liveness`]): a second process cannot take a slot that a live one holds, and
//! whether a holder is alive is read off that lock — also from another pid namespace,
//! where its pid means nothing. Uses the ring's mapping ([`super::Ring`]).
//!
//! A reader that ends normally (its [`RingReader`](super::RingReader) dropped) *leaves*
//! first: its slot turns CLOSED (the state the writer's slot takes when it shuts the
//! queue down) while it still holds its lock, so the writer, which finds the lock free a
//! moment later, tells a reader that left from one that died (see [`SlotInfo::left`]).

use super::Ring;
use super::layout::{SLOT_SIZE, SLOTS_OFFSET};
use crate::error::{Error, Result};
use crate::wait::Wait;
use shmq_os::liveness::{Liveness, RoleLock};
use shmq_os::process::ProcessId;
use shmq_protocol::ring::SlotWord;
use shmq_protocol::ring::{self as protocol, SLOT_ATTACHED, SLOT_CLOSED, SLOT_DROPPED};
use shmq_protocol::word::{FieldU32, FieldU64, StatU32, StatU64};

/// Who holds a side of the ring, and what it has done: its statistics, written only by
/// the holder (Relaxed stores: other processes read them for reports and warnings, and
/// they order nothing).
#[repr(C, align(64))]
pub(super) struct Slot {
    /// `generation << 32 | state` (see [`shmq_protocol::ring`]).
    pub(super) word: SlotWord,
    /// The holder, published by `word` (its seqlock).
    pub(super) pid: FieldU32,
    /// Waits that had to block (the next chunk was not ready when the call came).
    pub(super) waits: StatU32,
    pub(super) start_time: FieldU64,
    /// Messages written (writer) or read (reader).
    pub(super) messages: StatU64,
    /// Bytes of those messages (as published in the chunks: for a framed message its
    /// descriptors and inline parts, not the arena parts it refers to).
    pub(super) bytes: StatU64,
    /// Time spent blocked in those waits, in ns.
    pub(super) wait_ns: StatU64,
    /// While the holder blocks in the queue waiting for the other side: when that wait
    /// began ([`coarse_now_ns`](shmq_os::process::coarse_now_ns)); 0 when it is not.
    pub(super) waiting_since: StatU64,
    /// When the holder last wrote or read a message (same clock); 0 before the first.
    pub(super) last_ns: StatU64,
}
const _: () = assert!(std::mem::size_of::<Slot>() == SLOT_SIZE);

/// The state of one slot, for inspection and liveness checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotInfo {
    /// The process that attached to it last, if any (and if read consistently).
    pub process: Option<ProcessId>,
    /// Dropped by the writer after its process died.
    pub dropped: bool,
    /// A reader's slot only: its holder left the queue (its reader was dropped, closed,
    /// or its process ended normally) rather than dying with it open. Its `process` still
    /// names who held it; its role lock is free once it has gone.
    pub left: bool,
    /// Messages written (writer) or read (reader).
    pub messages: u64,
    /// Bytes of those messages (see [`RingStats`](super::RingStats)).
    pub bytes: u64,
    /// Waits that blocked, and the time spent in them.
    pub waits: u64,
    pub wait_ns: u64,
    /// When the holder began the wait it is in now (`None`: it is not waiting in the
    /// queue), and when it last handled a message, both on
    /// [`coarse_now_ns`](shmq_os::process::coarse_now_ns)'s clock.
    pub waiting_since: Option<u64>,
    pub last_ns: Option<u64>,
    /// The slot word the fields were read under (to drop the holder with a CAS).
    pub(super) word: u64,
}

/// The role-lock byte of slot `index` in the ring's file (byte 0 is the creator's).
fn lock_byte(index: usize) -> u64 {
    1 + index as u64
}

impl Ring {
    /// Slot 0 is the writer's, slot `1 + r` reader `r`'s.
    pub(super) fn slot(&self, index: usize) -> &Slot {
        debug_assert!(index <= self.geo.n_reader);
        // SAFETY: index <= n_reader, so the slot lies below states_offset (Geometry::new);
        // 64-aligned; only accessed atomically. A peer can write garbage into it; that
        // only changes what is reported (and a CAS on a garbage word fails harmlessly).
        unsafe { &*(self.base.as_ptr().add(SLOTS_OFFSET + SLOT_SIZE * index) as *const Slot) }
    }

    fn slot_index(&self, reader: Option<usize>) -> Result<usize> {
        match reader {
            None => Ok(0),
            Some(r) if r < self.geo.n_reader => Ok(1 + r),
            Some(r) => Err(Error::InvalidArgument(format!(
                "no reader {r}: the ring has {}",
                self.geo.n_reader
            ))),
        }
    }

    /// The writer's (`None`) or reader `r`'s slot.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `reader` is not below the ring's number of readers.
    pub fn slot_info(&self, reader: Option<usize>) -> Result<SlotInfo> {
        let slot = self.slot(self.slot_index(reader)?);
        // Relaxed field loads inside the seqlock read (ordered by its Acquire load and
        // fence); a torn read (an attach under way) names nobody this time.
        let read = protocol::slot_read(&slot.word, || (slot.pid.get(), slot.start_time.get()));
        let (word, process) = match read {
            Some((w, (pid, start_time))) => {
                let state = protocol::slot_state(w);
                // A reader that left still names who held the slot (the writer's closed
                // slot does not: `writer_gone` reads its lock instead).
                let named = state == SLOT_ATTACHED
                    || state == SLOT_DROPPED
                    || (state == SLOT_CLOSED && reader.is_some());
                (w, named.then_some(ProcessId { pid, start_time }))
            }
            None => (0, None),
        };
        let state = protocol::slot_state(word);
        Ok(SlotInfo {
            process,
            dropped: state == SLOT_DROPPED,
            left: state == SLOT_CLOSED && reader.is_some(),
            // Relaxed: statistics, each written by one process only.
            messages: slot.messages.get(),
            bytes: slot.bytes.get(),
            waits: slot.waits.get().into(),
            wait_ns: slot.wait_ns.get(),
            waiting_since: Some(slot.waiting_since.get()).filter(|&t| t != 0),
            last_ns: Some(slot.last_ns.get()).filter(|&t| t != 0),
            word,
        })
    }

    /// Whether the holder of the writer's (`None`) or reader `r`'s slot is alive, read
    /// off its role lock; by its pid only where the lock cannot be tested (and then a pid
    /// that is not visible here is `Unknown`, never `Dead`). `Unknown` for an empty slot.
    pub fn holder_liveness(&self, reader: Option<usize>, info: &SlotInfo) -> Liveness {
        let Some(process) = info.process else {
            return Liveness::Unknown;
        };
        let index = self.slot_index(reader).expect("checked by slot_info");
        match self.probe.liveness(lock_byte(index)) {
            Liveness::Unknown => process.liveness(),
            known => known,
        }
    }

    /// Record in slot `index` that its holder handled a message of `len` bytes, its
    /// `messages`-th (called by the holder only).
    pub(super) fn record_message(&self, index: usize, messages: u64, len: usize) {
        let slot = self.slot(index);
        // Relaxed: statistics, written only by this slot's holder (so a load and a store
        // are not a lost update) and read by others for reports only.
        slot.messages.set(messages);
        let bytes = slot.bytes.get();
        slot.bytes.set(bytes.wrapping_add(len as u64));
        slot.last_ns.set(shmq_os::process::coarse_now_ns());
    }

    /// Mark slot `index`'s holder as blocked in the queue from now on, for `wait`, which
    /// may go on from an earlier call (see [`WaitClock`](crate::wait::WaitClock)): then
    /// the slot says since when the whole wait has been blocked. Returns the time to give
    /// [`Ring::end_wait`], and whether the wait is counted (once per wait).
    pub(super) fn begin_wait(&self, index: usize, wait: &mut Wait) -> (u64, bool) {
        let (blocked_since, first) = wait.blocked_since();
        let now = shmq_os::process::coarse_now_ns().max(1);
        let began = now
            .saturating_sub(blocked_since.elapsed().as_nanos() as u64)
            .max(1);
        // Relaxed: a statistic (see `record_message`).
        self.slot(index).waiting_since.set(began);
        (now, first)
    }

    /// The part of a wait begun at `since` (from [`Ring::begin_wait`]) is over (either
    /// way): count its time, and the wait itself if `counted`.
    pub(super) fn end_wait(&self, index: usize, (since, counted): (u64, bool)) {
        let slot = self.slot(index);
        let now = shmq_os::process::coarse_now_ns();
        // Relaxed: statistics written only by this slot's holder (see `record_message`).
        slot.waiting_since.set(0);
        let waits = slot.waits.get();
        slot.waits.set(waits.wrapping_add(u32::from(counted)));
        let total = slot.wait_ns.get();
        slot.wait_ns
            .set(total.wrapping_add(now.saturating_sub(since)));
    }

    /// Reader `r` leaves the queue (its holder calls it, still holding the slot's role
    /// lock): its slot turns CLOSED, so that the writer, which finds the lock free once
    /// the reader has gone, knows it left rather than died; and the writer, who may be
    /// waiting for this reader to free a chunk, is woken to see it.
    pub(super) fn leave(&self, r: usize) {
        // A plain store, as `slot_close` makes for the writer's slot: besides the holder
        // (us), only the writer changes a reader's slot once attached, and only with a
        // CAS on a holder proved dead (`drop_reader`), which we are not while we hold the
        // lock. Release (in `slot_close`): pairs with the Acquire load in `reader_left`
        // (and `slot_read`): a writer that sees CLOSED sees the reads we finished.
        protocol::slot_close(&self.slot(1 + r).word);
        self.chunk_freed().doorbell().ring();
    }

    /// Whether reader `r` left the queue (closed it, or its process ended normally) rather than died; a new
    /// holder of the slot (the rank opened again) is not.
    pub fn reader_left(&self, r: usize) -> bool {
        r < self.geo.n_reader && protocol::slot_is_closed(&self.slot(1 + r).word)
    }

    /// Drop reader `r`, judged dead from `info`; false if a new holder attached since.
    pub(super) fn drop_reader(&self, r: usize, info: &SlotInfo) -> bool {
        protocol::slot_drop(&self.slot(1 + r).word, info.word)
    }

    /// Record this process as the holder of slot `index`, taking its role lock (kept by
    /// the caller for as long as it holds the slot).
    pub(super) fn attach(&self, index: usize) -> Result<RoleLock> {
        let who = if index == 0 {
            "the writer's slot".to_owned()
        } else {
            format!("reader {}", index - 1)
        };
        let lock = RoleLock::acquire(self.name(), lock_byte(index))?.ok_or_else(|| {
            Error::WrongRole(format!(
                "{who} of ring '{}' is held by another live process; a rank can be opened only \
                 once at a time",
                self.name()
            ))
        })?;
        let me = ProcessId::current();
        let slot = self.slot(index);
        let Some(generation) = protocol::slot_begin_attach(&slot.word) else {
            return Err(Error::WrongRole(format!(
                "{who} was dropped by the writer after its process died; it cannot join this \
                 queue again"
            )));
        };
        // Relaxed: published by the Release store in `slot_end_attach`.
        slot.pid.set(me.pid);
        slot.start_time.set(me.start_time);
        protocol::slot_end_attach(&slot.word, generation);
        Ok(lock)
    }
}
