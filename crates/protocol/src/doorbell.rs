//! The sleep/wake handshake between the two sides of a ring.
//!
//! A doorbell is two 32-bit words in shared memory ([`DoorbellWords`], alone in a cache
//! line): `seq`, the futex word, and `sleepers`, how many waiters are asleep or about to
//! be; a [`Doorbell`] is those words with the futex that sleeps on them. The side that publishes
//! something (a chunk written, a chunk freed) calls [`Doorbell::ring`]: a fence and one
//! load when nobody sleeps, a futex wake when someone does. A waiter that found nothing
//! calls [`Doorbell::sleep`].
//!
//! No wake-up is lost (model-checked in `crates/protocol/tests/loom.rs`). This is Dekker's pattern, with
//! the two SeqCst fences pairing:
//! - the publisher stores its data, fences, then loads `sleepers`;
//! - the sleeper increments `sleepers`, fences, loads `seq`, then checks its condition.
//!
//! If the publisher's load misses the sleeper, the sleeper's check sees the data. If it
//! sees the sleeper, it bumps `seq` before waking, so a sleeper that read `seq` earlier
//! finds it changed and the futex wait returns at once.

use std::time::Duration;

use crate::sync::{fence, AtomicU32, Ordering};

/// How a sleeper waits on a word and a publisher wakes it; [`OsFutex`] in production, a
/// model in the loom tests.
pub trait Futex {
    /// Sleep while `*word == expected` (at most `timeout`); may return spuriously.
    fn wait(&self, word: &AtomicU32, expected: u32, timeout: Option<Duration>);
    fn wake_all(&self, word: &AtomicU32);
}

/// The process-shared Linux futex.
#[cfg(not(loom))]
#[derive(Clone, Copy, Debug, Default)]
pub struct OsFutex;

#[cfg(not(loom))]
impl Futex for OsFutex {
    fn wait(&self, word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
        crate::futex::wait(word, expected, timeout)
    }
    fn wake_all(&self, word: &AtomicU32) {
        crate::futex::wake_all(word)
    }
}

/// A doorbell's two words, as they lie in shared memory (`#[repr(C)]`, pointer-free,
/// alone in a cache line so that ringing it bounces no other data).
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct DoorbellWords {
    pub(crate) seq: AtomicU32,
    pub(crate) sleepers: AtomicU32,
}

impl DoorbellWords {
    /// The doorbell on these words, sleeping on `futex` (a model's, in loom tests).
    pub fn with<F: Futex>(&self, futex: F) -> Doorbell<'_, F> {
        Doorbell {
            seq: &self.seq,
            sleepers: &self.sleepers,
            futex,
        }
    }
}

#[cfg(not(loom))]
impl DoorbellWords {
    /// The doorbell on these words, sleeping on the process-shared futex.
    pub fn doorbell(&self) -> Doorbell<'_, OsFutex> {
        Doorbell {
            seq: &self.seq,
            sleepers: &self.sleepers,
            futex: OsFutex,
        }
    }

    /// How many processes sleep on the doorbell now (tests, reports).
    pub fn sleepers_now(&self) -> u32 {
        // SeqCst: a test that waits for a sleeper, then rings, wants the latest value;
        // nothing is read through it.
        self.sleepers.load(Ordering::SeqCst)
    }
}

/// See the module docs.
pub struct Doorbell<'a, F: Futex> {
    pub(crate) seq: &'a AtomicU32,
    pub(crate) sleepers: &'a AtomicU32,
    pub futex: F,
}

impl<F: Futex> Doorbell<'_, F> {
    /// After publishing: wake sleepers, if there are any.
    pub fn ring(&self) {
        // SeqCst fence: pairs with the one in `sleep` (see the module docs).
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence above.
        if self.sleepers.load(Ordering::Relaxed) != 0 {
            self.wake();
        }
    }

    /// Wake every sleeper now (e.g. to deliver a shutdown).
    pub fn wake(&self) {
        // Release: a woken sleeper that sees the new `seq` also sees what was published
        // before (its own check re-reads that anyway).
        self.seq.fetch_add(1, Ordering::Release);
        self.futex.wake_all(self.seq);
    }

    /// Sleep until rung (or `timeout`, or spuriously) unless `ready()` is already true.
    /// Returns `ready()`'s last answer; the caller loops.
    pub fn sleep(&self, mut ready: impl FnMut() -> bool, timeout: Option<Duration>) -> bool {
        // Relaxed RMW, then the SeqCst fence: pairs with the fence in `ring`.
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        // Acquire: pairs with the Release bump in `wake`.
        let seq = self.seq.load(Ordering::Acquire);
        let ready_now = ready();
        if !ready_now {
            self.futex.wait(self.seq, seq, timeout);
        }
        // Relaxed: a late decrement only costs a publisher one needless wake.
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        ready_now
    }
}
