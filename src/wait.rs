//! Waiting for the other side of the ring: the one place that decides how a blocked
//! writer or reader spends its time.
//!
//! A wait polls a condition: first by spinning for a short window (a message usually
//! arrives within microseconds while a serving engine is busy), then by yielding the CPU
//! between polls. Deadlines, cancellation (`shutdown()`), a caller's periodic hook (the
//! Python bindings check signals and cancel events there) and the "still waiting"
//! warning are all handled here, so changing the strategy (e.g. sleeping on a futex once
//! the yield phase is over) is a change to this module only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Environment variable: seconds between "still waiting" warnings (default 60).
pub const WARNING_INTERVAL_ENV: &str = "SHMQ_RINGBUFFER_WARNING_INTERVAL";
/// Environment variable: microseconds a waiter spins before it starts yielding.
pub const SPIN_US_ENV: &str = "SHMQ_SPIN_US";

const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// How often the caller's hook runs while waiting.
const HOOK_INTERVAL: Duration = Duration::from_millis(2);

fn env_duration(name: &str, unit: fn(f64) -> Duration) -> Option<Duration> {
    let v: f64 = std::env::var(name).ok()?.trim().parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| unit(v))
}

/// Seconds between warnings while a wait goes on, from [`WARNING_INTERVAL_ENV`].
pub fn warning_interval() -> Duration {
    static V: OnceLock<Duration> = OnceLock::new();
    *V.get_or_init(|| {
        env_duration(WARNING_INTERVAL_ENV, Duration::from_secs_f64)
            .unwrap_or(Duration::from_secs(60))
    })
}

/// How long a waiter spins before yielding, from [`SPIN_US_ENV`].
pub fn default_spin() -> Duration {
    static V: OnceLock<Duration> = OnceLock::new();
    *V.get_or_init(|| {
        env_duration(SPIN_US_ENV, |us| Duration::from_secs_f64(us / 1e6)).unwrap_or(DEFAULT_SPIN)
    })
}

/// A function the waiter calls every few milliseconds while it waits; an error ends the
/// wait with that error (the Python bindings raise `KeyboardInterrupt` or "cancelled").
pub type Hook<'a> = &'a mut (dyn FnMut() -> Result<()> + Send);

/// The terms of one blocking call: what it waits for, until when, and what may cut it short.
pub struct Wait<'a> {
    what: &'a str,
    started: Instant,
    deadline: Option<Instant>,
    cancel: Option<&'a AtomicBool>,
    hook: Option<Hook<'a>>,
    spin: Duration,
    /// `None`: never warn (a wait the caller expects to be long).
    next_warning: Option<Instant>,
}

impl<'a> Wait<'a> {
    /// A wait described by `what` (used in warnings and timeout errors), ending after
    /// `timeout` if one is given.
    pub fn new(what: &'a str, timeout: Option<Duration>) -> Self {
        let started = Instant::now();
        Wait {
            what,
            started,
            deadline: timeout.map(|t| started + t),
            cancel: None,
            hook: None,
            spin: default_spin(),
            next_warning: Some(started + warning_interval()),
        }
    }

    /// End the wait with [`Error::Cancelled`] once `flag` is set.
    pub fn cancel_on(mut self, flag: &'a AtomicBool) -> Self {
        self.cancel = Some(flag);
        self
    }

    /// Call `hook` every few milliseconds while waiting.
    pub fn with_hook(mut self, hook: Hook<'a>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Spin for `spin` before yielding (overrides [`SPIN_US_ENV`]).
    pub fn spin_for(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// Do not log "still waiting" warnings (for waits expected to last, e.g. an idle
    /// worker waiting for the next request).
    pub fn quiet(mut self) -> Self {
        self.next_warning = None;
        self
    }

    /// Time since the wait began.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    fn cancelled(&self) -> bool {
        // Relaxed: the flag carries no data; seeing it a little late only delays the
        // cancellation by one poll.
        self.cancel.is_some_and(|c| c.load(Ordering::Relaxed))
    }

    /// Check cancellation, the deadline and the warning clock; `now` is the current time.
    fn check(&mut self, now: Instant) -> Result<()> {
        if self.cancelled() {
            return Err(Error::Cancelled);
        }
        if self.deadline.is_some_and(|d| now >= d) {
            return Err(Error::Timeout {
                what: self.what.to_owned(),
                waited: now - self.started,
            });
        }
        if self.next_warning.is_some_and(|t| now >= t) {
            log::warn!(
                "shmq: {} for {:.0?} (set {WARNING_INTERVAL_ENV} to change how often this is logged)",
                self.what,
                now - self.started
            );
            self.next_warning = Some(now + warning_interval());
        }
        Ok(())
    }

    /// Poll `ready` until it returns `Some`, then return its value. Ends early with
    /// `Timeout`, `Cancelled` or the hook's error; the condition is always polled at
    /// least once, so a ready result wins over an expired deadline.
    pub fn until<T>(&mut self, mut ready: impl FnMut() -> Option<T>) -> Result<T> {
        if let Some(v) = ready() {
            return Ok(v);
        }
        let spin_end = Instant::now() + self.spin;
        // Spin phase: poll back to back, looking at the clock only every 64 polls.
        loop {
            for _ in 0..64 {
                std::hint::spin_loop();
                if let Some(v) = ready() {
                    return Ok(v);
                }
            }
            let now = Instant::now();
            self.check(now)?;
            if now >= spin_end {
                break;
            }
        }
        // Yield phase: give the core to others between polls.
        let mut next_hook = Instant::now() + HOOK_INTERVAL;
        loop {
            std::thread::yield_now();
            if let Some(v) = ready() {
                return Ok(v);
            }
            let now = Instant::now();
            self.check(now)?;
            if now >= next_hook {
                if let Some(hook) = self.hook.as_mut() {
                    hook()?;
                }
                next_hook = now + HOOK_INTERVAL;
            }
        }
    }

    /// Time left before the deadline (`None`: no deadline), for blocking calls outside
    /// this module such as a socket receive.
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Run the checks of one wait step from outside `until` (a socket poll loop).
    pub fn step(&mut self) -> Result<()> {
        self.check(Instant::now())?;
        if let Some(hook) = self.hook.as_mut() {
            hook()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_value_is_returned() {
        let mut n = 0;
        let v = Wait::new("test", Some(Duration::from_secs(5)))
            .until(|| {
                n += 1;
                (n > 1000).then_some(n)
            })
            .unwrap();
        assert_eq!(v, 1001);
    }

    #[test]
    fn timeout_names_the_wait() {
        let err = Wait::new(
            "reader 0 waiting for the writer",
            Some(Duration::from_millis(20)),
        )
        .until(|| None::<()>)
        .unwrap_err();
        match err {
            Error::Timeout { what, waited } => {
                assert_eq!(what, "reader 0 waiting for the writer");
                assert!(waited >= Duration::from_millis(20));
            }
            e => panic!("unexpected {e}"),
        }
    }

    #[test]
    fn zero_timeout_still_polls_once() {
        assert_eq!(
            Wait::new("t", Some(Duration::ZERO))
                .until(|| Some(7))
                .unwrap(),
            7
        );
    }

    #[test]
    fn cancel_from_another_thread() {
        let flag = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                flag.store(true, Ordering::Relaxed);
            });
            let err = Wait::new("t", Some(Duration::from_secs(10)))
                .cancel_on(&flag)
                .until(|| None::<()>);
            assert!(matches!(err, Err(Error::Cancelled)));
        });
    }

    #[test]
    fn hook_error_ends_the_wait() {
        let mut calls = 0;
        let mut hook = || {
            calls += 1;
            if calls == 3 {
                Err(Error::Cancelled)
            } else {
                Ok(())
            }
        };
        let err = Wait::new("t", Some(Duration::from_secs(10)))
            .with_hook(&mut hook)
            .until(|| None::<()>);
        assert!(matches!(err, Err(Error::Cancelled)));
        assert_eq!(calls, 3);
    }
}
