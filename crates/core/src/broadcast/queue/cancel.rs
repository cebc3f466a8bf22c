//! [`Canceller`]: ends one side's blocked calls from any thread, without its lock.

use shmq_protocol::sync::local::{AtomicBool, Ordering};
use std::sync::Arc;

use super::super::ring::Ring;

/// Ends one side's blocked calls from any thread, now and from then on: sets a flag the
/// waits check and wakes sleepers on the ring. Cheap to clone; needs no lock on the side.
#[derive(Clone, Debug)]
pub struct Canceller {
    flag: Arc<AtomicBool>,
    ring: Option<Arc<Ring>>,
    writer: bool,
    /// The fork generation it was made in (see [`Canceller::close_ring`]).
    made_in: u64,
}

impl Canceller {
    pub(super) fn new(ring: Option<Arc<Ring>>, writer: bool) -> Canceller {
        Canceller {
            flag: Arc::new(AtomicBool::new(false)),
            ring,
            writer,
            made_in: shmq_os::fork::generation(),
        }
    }

    /// A writer's canceller: tell the local readers that the queue is shut down (see
    /// `Ring::close_writer`), for when the writer itself cannot be locked to
    /// [`close`](super::Writer::close) it (a signal handler that runs inside one of its
    /// own waits, say). Remote readers are not told then. Nothing for a reader's, or in
    /// a forked child (the ring is its parent's).
    pub fn close_ring(&self) {
        if !self.writer || shmq_os::fork::is_inherited(self.made_in) {
            return;
        }
        if let Some(ring) = &self.ring {
            ring.close_writer();
        }
    }

    pub fn cancel(&self) {
        // Relaxed: the flag carries no data (see `Wait`); the wake below makes sleepers
        // look at it.
        self.flag.store(true, Ordering::Relaxed);
        if let Some(ring) = &self.ring {
            // This wakes every sleeper of that side, also in other processes; they find
            // nothing new and sleep again.
            let bell = if self.writer {
                ring.chunk_freed()
            } else {
                ring.data_ready()
            };
            bell.doorbell().wake();
        }
    }

    pub fn is_cancelled(&self) -> bool {
        // Relaxed: as in `cancel`.
        self.flag.load(Ordering::Relaxed)
    }

    /// The flag for [`Wait::cancel_on`](crate::wait::Wait::cancel_on).
    pub fn flag(&self) -> &AtomicBool {
        &self.flag
    }
}
