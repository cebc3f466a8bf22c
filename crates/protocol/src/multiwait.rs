//! One sleep on several doorbells at once: "until any of these rings has a message, or
//! this private wake word changes, or a timeout". What lets one thread wait for many
//! queues (an event loop's waiter, a collector of several writers' queues) without a
//! thread per queue and without polling.
//!
//! The handshake is each [`Doorbell`](crate::doorbell)'s, done on all of them before
//! one sleep (see `doorbell`'s module docs for why no wake-up is lost with one bell):
//! - the sleeper increments `sleepers` of every bell, fences (SeqCst), loads every
//!   `seq`, then checks its condition over all of them;
//! - a publisher on any bell stores its data, fences, loads that bell's `sleepers`; if it
//!   sees the sleeper it bumps `seq` and wakes it.
//!
//! A publisher whose load misses the sleeper's increment is ordered before the
//! sleeper's fence, so the sleeper's check sees its data; one that sees it changes
//! `seq`, which the sleeper read earlier, so the sleep (one atomic compare of every
//! word, in the kernel: `futex_waitv`) returns at once. The wake word is the sleeper's
//! own: whoever changes what the sleeper waits for bumps it and wakes it (see
//! [`WakeWord`]); the sleeper read it before it looked at what to wait for.
//! Model-checked in `crates/protocol/tests/loom.rs` (`multiwait_loses_no_wake_up`,
//! `multiwait_wake_word_loses_no_wake_up`).

use std::time::Duration;

use crate::doorbell::DoorbellWords;
use crate::sync::{fence, AtomicU32, Ordering};

/// How a sleeper sleeps on several words at once; [`OsFutexMany`] in production
/// (`futex_waitv`), a model in the loom tests.
pub trait FutexMany {
    /// Sleep while every `*word == expected` (at most `timeout`); may return spuriously.
    /// `Err` only when the kernel cannot do it at all (see [`Unsupported`]).
    ///
    /// # Errors
    ///
    /// [`Unsupported`] when the kernel has no `futex_waitv` (Linux before 5.16) or a
    /// seccomp filter refuses it.
    fn wait_any(
        &self,
        words: &[(&AtomicU32, u32)],
        timeout: Option<Duration>,
    ) -> Result<(), Unsupported>;
    /// Wake every sleeper of `word` (one that sleeps on it among others included).
    fn wake_all(&self, word: &AtomicU32);
}

/// This kernel has no `futex_waitv` (Linux before 5.16, or a seccomp filter that refuses
/// it): one thread cannot sleep on several queues' doorbells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "this kernel cannot wait on several queues at once (futex_waitv: {0}; it needs Linux 5.16 \
     or later, and no seccomp filter that refuses it)"
)]
pub struct Unsupported(pub &'static str);

/// The most words one [`FutexMany::wait_any`] takes (the kernel's `FUTEX_WAITV_MAX`),
/// the wake word included.
pub const MAX_WORDS: usize = 128;

/// A sleeper's private wake word: bumped and woken by whoever changes what the sleeper
/// waits for (a queue added, the waiter told to stop).
#[derive(Debug, Default)]
pub struct WakeWord(pub AtomicU32);

impl WakeWord {
    /// What the sleeper reads *before* it looks at what to wait for, and passes to
    /// [`sleep_any`].
    pub fn current(&self) -> u32 {
        // Acquire: pairs with the Release bump in `wake`, so the sleeper that sees the
        // bump also sees what the waker changed before it (its list of queues).
        self.0.load(Ordering::Acquire)
    }

    /// Make a sleeper that read [`current`](Self::current) before now return (at once if
    /// it has not gone to sleep yet).
    pub fn wake(&self, futex: &impl FutexMany) {
        // Release: pairs with the Acquire load in `current` (see there).
        self.0.fetch_add(1, Ordering::Release);
        futex.wake_all(&self.0);
    }
}

/// Sleep until a publisher rings one of `bells` (or `wake` is no longer `wake_seen`, or
/// `timeout`, or spuriously) unless `ready()` is already true. Returns `ready()`'s answer
/// (taken after the sleeper counted itself on every bell); the caller loops. At most
/// `MAX_WORDS - 1` bells.
///
/// # Errors
///
/// [`Unsupported`] when the kernel cannot sleep on several words at once (see
/// [`FutexMany::wait_any`]).
pub fn sleep_any<F: FutexMany>(
    futex: &F,
    bells: &[&DoorbellWords],
    wake: &WakeWord,
    wake_seen: u32,
    ready: impl FnOnce() -> bool,
    timeout: Option<Duration>,
) -> Result<bool, Unsupported> {
    assert!(bells.len() < MAX_WORDS, "at most {} bells", MAX_WORDS - 1);
    for b in bells {
        // Relaxed RMW, then the SeqCst fence below: pairs with the fence in
        // `Doorbell::ring` (see the module docs).
        b.sleepers.fetch_add(1, Ordering::Relaxed);
    }
    fence(Ordering::SeqCst);
    let mut words: Vec<(&AtomicU32, u32)> = Vec::with_capacity(bells.len() + 1);
    for b in bells {
        // Acquire: pairs with the Release bump in `Doorbell::wake`.
        words.push((&b.seq, b.seq.load(Ordering::Acquire)));
    }
    words.push((&wake.0, wake_seen));
    let ready_now = ready();
    let slept = if ready_now {
        Ok(())
    } else {
        futex.wait_any(&words, timeout)
    };
    for b in bells {
        // Relaxed: a late decrement only costs a publisher one needless wake.
        b.sleepers.fetch_sub(1, Ordering::Relaxed);
    }
    slept.map(|()| ready_now)
}

/// `futex_waitv(2)` on process-shared words (no `FUTEX_PRIVATE_FLAG`, so a wake from
/// another process that maps the same page reaches it).
#[cfg(not(loom))]
#[derive(Clone, Copy, Debug, Default)]
pub struct OsFutexMany;

/// The kernel's `struct futex_waitv` (linux/futex.h).
#[cfg(not(loom))]
#[repr(C)]
struct FutexWaitv {
    val: u64,
    uaddr: u64,
    flags: u32,
    reserved: u32,
}

/// `FUTEX2_SIZE_U32`: the words are 32 bits.
#[cfg(not(loom))]
const FUTEX2_SIZE_U32: u32 = 2;

#[cfg(not(loom))]
impl FutexMany for OsFutexMany {
    fn wait_any(
        &self,
        words: &[(&AtomicU32, u32)],
        timeout: Option<Duration>,
    ) -> Result<(), Unsupported> {
        let waiters: Vec<FutexWaitv> = words
            .iter()
            .map(|(w, expected)| FutexWaitv {
                val: u64::from(*expected),
                uaddr: w.as_ptr() as u64,
                flags: FUTEX2_SIZE_U32,
                reserved: 0,
            })
            .collect();
        // futex_waitv's timeout is absolute, on the clock given.
        let deadline = timeout.map(|t| {
            let mut now = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: `now` is a live timespec the call writes; CLOCK_MONOTONIC exists.
            unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
            let t = t.min(Duration::from_secs(1 << 32));
            let nsec = now.tv_nsec as u64 + u64::from(t.subsec_nanos());
            libc::timespec {
                tv_sec: now.tv_sec
                    + t.as_secs() as libc::time_t
                    + (nsec / 1_000_000_000) as libc::time_t,
                tv_nsec: (nsec % 1_000_000_000) as libc::c_long,
            }
        });
        let ts_ptr = deadline
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `waiters` is a live array of `words.len()` kernel `futex_waitv` structs
        // (at most MAX_WORDS, checked by the caller) whose addresses are valid, aligned
        // u32 words that outlive the call (borrowed from `words`); the kernel only reads
        // them (compares each with its `val` atomically). The timeout pointer is null or
        // points to a live absolute timespec on CLOCK_MONOTONIC, as the call expects. A
        // peer process can change the words' values at any time: that is what the call
        // compares, never a memory-safety matter.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex_waitv,
                waiters.as_ptr(),
                waiters.len() as libc::c_uint,
                0u32,
                ts_ptr,
                libc::CLOCK_MONOTONIC,
            )
        };
        if r < 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::ENOSYS) => return Err(Unsupported("ENOSYS, no such system call")),
                Some(libc::EPERM) => return Err(Unsupported("EPERM, refused")),
                // EAGAIN (a word differs), ETIMEDOUT, EINTR: the caller re-checks.
                _ => {}
            }
        }
        Ok(())
    }

    fn wake_all(&self, word: &AtomicU32) {
        crate::futex::wake_all(word)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_ring_on_any_bell_ends_the_sleep() {
        let bells: Vec<DoorbellWords> = (0..3).map(|_| DoorbellWords::default()).collect();
        let data = crate::sync::local::AtomicBool::new(false);
        let wake = WakeWord::default();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                data.store(true, std::sync::atomic::Ordering::Release);
                bells[2].doorbell().ring();
            });
            let refs: Vec<&DoorbellWords> = bells.iter().collect();
            let t = Instant::now();
            loop {
                let seen = wake.current();
                let ready = sleep_any(
                    &OsFutexMany,
                    &refs,
                    &wake,
                    seen,
                    || data.load(std::sync::atomic::Ordering::Acquire),
                    Some(Duration::from_secs(20)),
                )
                .expect("futex_waitv (Linux 5.16+)");
                if ready {
                    break;
                }
            }
            assert!(t.elapsed() < Duration::from_secs(10));
        });
        assert!(bells
            .iter()
            .all(|b| b.sleepers.load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn the_wake_word_ends_the_sleep_and_a_stale_one_returns_at_once() {
        let bell = DoorbellWords::default();
        let wake = WakeWord::default();
        let stale = wake.current();
        wake.wake(&OsFutexMany);
        let t = Instant::now();
        let ready = sleep_any(
            &OsFutexMany,
            &[&bell],
            &wake,
            stale,
            || false,
            Some(Duration::from_secs(20)),
        )
        .expect("futex_waitv");
        assert!(!ready && t.elapsed() < Duration::from_secs(10));
        std::thread::scope(|s| {
            let seen = wake.current();
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                wake.wake(&OsFutexMany);
            });
            let t = Instant::now();
            while wake.current() == seen {
                sleep_any(
                    &OsFutexMany,
                    &[&bell],
                    &wake,
                    seen,
                    || false,
                    Some(Duration::from_secs(20)),
                )
                .expect("futex_waitv");
            }
            assert!(t.elapsed() < Duration::from_secs(10));
        });
    }

    #[test]
    fn it_times_out() {
        let bell = DoorbellWords::default();
        let wake = WakeWord::default();
        let t = Instant::now();
        let ready = sleep_any(
            &OsFutexMany,
            &[&bell],
            &wake,
            wake.current(),
            || false,
            Some(Duration::from_millis(30)),
        )
        .expect("futex_waitv");
        assert!(!ready && t.elapsed() >= Duration::from_millis(25));
    }
}
