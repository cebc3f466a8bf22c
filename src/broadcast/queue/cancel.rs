//! [`Canceller`]: ends one side's blocked calls from any thread, without its lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::super::ring::Ring;

/// Ends one side's blocked calls from any thread, now and from then on: sets a flag the
/// waits check and wakes sleepers on the ring. Cheap to clone; needs no lock on the side.
#[derive(Clone, Debug)]
pub struct Canceller {
    flag: Arc<AtomicBool>,
    ring: Option<Arc<Ring>>,
    writer: bool,
}

impl Canceller {
    pub(super) fn new(ring: Option<Arc<Ring>>, writer: bool) -> Canceller {
        Canceller {
            flag: Arc::new(AtomicBool::new(false)),
            ring,
            writer,
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
