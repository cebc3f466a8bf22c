//! Pins: shared locks on bytes of a segment's file, held while this process uses memory
//! that the segment's writer must not reuse (the object store's zero-copy views).
//!
//! A pin is an open-file-description read lock (`F_OFD_SETLK`, `F_RDLCK`) on one byte of
//! the segment's file in `/dev/shm`: any number of processes may hold it at once, the
//! writer sees it with a probe ([`crate::liveness::LockProbe`]), and the kernel drops it
//! when the holder dies. A dead reader's views therefore never keep memory from reuse,
//! which a count in shared memory could not promise.
//!
//! One descriptor per [`Pins`] holds all of this process's pins of the segment, one lock
//! per byte however many views share it (a per-byte count here; the lock goes with the
//! last view). Read locks conflict only with write locks, which nobody takes on these
//! bytes: pinning never fails because of a peer.
//!
//! # Why a pin and a probe cannot miss each other
//! The holder takes its lock, then checks that the memory is still its object; the
//! writer marks the memory as no longer the object, then probes. Both lock calls go
//! through the kernel's lock list for the file, under one spinlock: whichever comes
//! second sees the other's earlier store (the unlock/lock pair orders them), so either
//! the holder sees the mark (and drops its pin, copying instead) or the writer sees the
//! pin (and keeps the memory).

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::fork;
use crate::liveness::lock_byte;
use crate::segment_file::{Access, SegmentFile};

/// This process's pins in one segment.
#[derive(Debug)]
pub struct Pins {
    segment: String,
    state: Mutex<PinState>,
}

#[derive(Debug, Default)]
struct PinState {
    /// The descriptor that holds the locks (opened at the first pin).
    file: Option<SegmentFile>,
    /// The fork generation `file` was opened in: a forked child opens its own.
    generation: u64,
    /// Views per pinned byte.
    held: HashMap<u64, u32>,
}

impl Pins {
    pub fn new(segment: &str) -> Pins {
        Pins {
            segment: segment.to_owned(),
            state: Mutex::new(PinState::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PinState> {
        // A panic while holding the lock leaves consistent counts (each update is one
        // statement): keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pin byte `byte` until the returned [`Pin`] is dropped.
    ///
    /// # Errors
    ///
    /// An [`Error`] when the segment's file cannot be opened (gone, not this user's) or the
    /// byte's lock cannot be taken (a process holds it exclusively, or `fcntl` fails).
    pub fn pin(self: &Arc<Self>, byte: u64) -> Result<Pin> {
        let mut s = self.state();
        if s.file.is_some() && fork::is_inherited(s.generation) {
            // The fork handler closed the parent's descriptor in this child; its pins
            // are the parent's. Start afresh (never close that descriptor number again).
            std::mem::forget(s.file.take());
            s.held.clear();
        }
        if s.file.is_none() {
            let file = SegmentFile::open_to(&self.segment, Access::ReadOnly, "pin memory in it")?;
            fork::close_in_children(file.as_raw_fd());
            s.file = Some(file);
            s.generation = fork::generation();
        }
        let generation = s.generation;
        let s = &mut *s;
        let count = s.held.entry(byte).or_insert(0);
        if *count == 0 {
            let file = s.file.as_ref().expect("opened above");
            if let Err(e) = lock_byte(file, libc::F_RDLCK, byte) {
                s.held.remove(&byte);
                return Err(Error::os(
                    format!("pinning byte {byte} of segment '{}'", self.segment),
                    e,
                ));
            }
        }
        *count += 1;
        Ok(Pin {
            pins: self.clone(),
            byte,
            generation,
        })
    }

    fn unpin(&self, byte: u64, generation: u64) {
        let mut s = self.state();
        if s.generation != generation || fork::is_inherited(generation) {
            return; // a pin inherited through a fork: its lock is the parent's
        }
        let Some(count) = s.held.get_mut(&byte) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            s.held.remove(&byte);
            if let Some(file) = &s.file {
                // Cannot fail for a lock we hold; if it did, the lock goes with the
                // descriptor (at exit at the latest): the memory is kept longer, no harm.
                let _ = lock_byte(file, libc::F_UNLCK, byte);
            }
        }
    }

    /// Number of bytes this process pins.
    #[cfg(test)]
    pub fn pinned(&self) -> usize {
        self.state().held.len()
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let s = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(file) = s.file.take() {
            if fork::is_inherited(s.generation) {
                std::mem::forget(file); // closed by the fork handler already
            } else {
                fork::forget_fd(file.as_raw_fd());
            }
        }
    }
}

/// One view's pin of a byte; unpinned when dropped (a forked child's copy unpins nothing).
#[derive(Debug)]
pub struct Pin {
    pins: Arc<Pins>,
    byte: u64,
    generation: u64,
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.pins.unpin(self.byte, self.generation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::{Liveness, LockProbe};
    use crate::segment::{unique_name, Segment};

    #[test]
    fn pins_are_counted_per_byte_and_seen_by_probes() {
        let name = unique_name("pins");
        let _seg = Segment::create(&name, 4096).unwrap();
        let pins = Arc::new(Pins::new(&name));
        let probe = LockProbe::open(&name);
        assert_eq!(probe.liveness(100), Liveness::Dead);
        let a = pins.pin(100).unwrap();
        let b = pins.pin(100).unwrap();
        let c = pins.pin(200).unwrap();
        assert_eq!(probe.liveness(100), Liveness::Alive);
        assert_eq!(probe.liveness(200), Liveness::Alive);
        assert_eq!(probe.liveness(150), Liveness::Dead);
        drop(a);
        assert_eq!(
            probe.liveness(100),
            Liveness::Alive,
            "one view still holds it"
        );
        drop(b);
        assert_eq!(probe.liveness(100), Liveness::Dead);
        assert_eq!(pins.pinned(), 1);
        drop(c);
        assert_eq!(probe.liveness(200), Liveness::Dead);
    }
}
