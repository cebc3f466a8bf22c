//! Process-shared futex on a 32-bit word in shared memory (Linux).
//!
//! Uses the raw `futex(2)` syscall *without* `FUTEX_PRIVATE_FLAG`: the kernel then keys
//! waiters by the physical page, so a wake from one process reaches a waiter in another
//! process that maps the same segment. (`atomic-wait` and std's parking use private
//! futexes, which cannot do that.)

use crate::sync::AtomicU32;
use std::time::Duration;

/// Sleep while `*word == expected`, for at most `timeout`. Returns early on a wake, a
/// signal, a spurious wake-up, or if the value already differs; callers re-check.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call; the kernel
    // only reads it (FUTEX_WAIT compares it atomically with `expected`). The timeout
    // pointer is null or points to a live timespec (relative, as FUTEX_WAIT expects).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            ts_ptr,
            0usize,
            0u32,
        );
    }
}

/// Wake every process and thread sleeping in [`wait`] on `word`.
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE does not access its value.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    #[test]
    fn wait_times_out_and_returns_on_mismatch() {
        let w = AtomicU32::new(5);
        let t = Instant::now();
        wait(&w, 5, Some(Duration::from_millis(30)));
        assert!(t.elapsed() >= Duration::from_millis(25));
        let t = Instant::now();
        wait(&w, 4, Some(Duration::from_secs(10)));
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn wake_reaches_a_sleeper() {
        let w = AtomicU32::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                w.store(1, Ordering::SeqCst);
                wake_all(&w);
            });
            let t = Instant::now();
            while w.load(Ordering::SeqCst) == 0 {
                wait(&w, 0, Some(Duration::from_secs(10)));
            }
            assert!(t.elapsed() < Duration::from_secs(5));
        });
    }
}
