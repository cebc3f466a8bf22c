//! What a forked child inherits, and what it must not do with it.
//!
//! `fork()` copies a process's memory but only the calling thread: a child inherits
//! shmq's queues, their ZeroMQ contexts (whose I/O threads it does not have, and whose
//! descriptors it shares with the parent) and their role locks. Tearing such a context
//! down in the child hangs the child and can abort the parent (`mailbox.cpp` assertions);
//! sending from the child interleaves with the parent's stream. So:
//!
//! - [`generation`] counts the forks that led to this process (0 in the process that
//!   started; a `pthread_atfork` child handler bumps it). An object records the
//!   generation it was made in; [`check`] refuses to use it in a later one, with a
//!   clear error, and its `Drop` leaks what it cannot tear down safely there
//!   ([`is_inherited`]).
//! - Role locks (see [`crate::liveness`]) are open-file-description locks: the child's
//!   copy of the descriptor would keep the parent's role "alive" after the parent died.
//!   Their descriptors are registered here, and the child handler closes them (the
//!   parent's lock stays: it is shared by the parent's own descriptor).

use shmq_protocol::sync::local::{AtomicI32, AtomicU64, Ordering};
use std::os::fd::RawFd;
use std::sync::Once;

use crate::error::{Error, Result};

static GENERATION: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();

/// Descriptors closed in a forked child (role locks); -1 marks a free entry.
const MAX_INHERITED_FDS: usize = 256;
static CLOSE_IN_CHILD: [AtomicI32; MAX_INHERITED_FDS] =
    [const { AtomicI32::new(-1) }; MAX_INHERITED_FDS];

extern "C" fn in_child() {
    // Only async-signal-safe work here (atomics and close), as after any fork.
    // Relaxed: the child has a single thread now; nothing else orders against this.
    GENERATION.fetch_add(1, Ordering::Relaxed);
    for entry in &CLOSE_IN_CHILD {
        // Relaxed: single-threaded child (see above).
        let fd = entry.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: the descriptor was registered by a `RoleLock` of the parent, which
            // owns it; in the child nothing else uses it (the child's copy of the
            // `RoleLock` sees the new generation and leaves the descriptor alone).
            unsafe { libc::close(fd) };
        }
    }
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: registers a handler with the C signature pthread_atfork expects; the
        // handler only touches statics and calls close().
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    });
}

/// The fork generation of this process (see the module docs).
pub fn generation() -> u64 {
    install();
    // Relaxed: only a fork changes it, and a fork makes a new process.
    GENERATION.load(Ordering::Relaxed)
}

/// Whether an object made in generation `made_in` was inherited through a fork.
pub fn is_inherited(made_in: u64) -> bool {
    // Relaxed: see `generation`.
    GENERATION.load(Ordering::Relaxed) != made_in
}

/// Fails with a clear error if an object made in generation `made_in` (a `what`) is used
/// in a forked child.
pub fn check(made_in: u64, what: &str) -> Result<()> {
    if is_inherited(made_in) {
        return Err(Error::Forked(format!(
            "this {what} was made before a fork() and cannot be used in the forked child \
             (pid {}); make a new one in the child, or start children with the 'spawn' method",
            std::process::id()
        )));
    }
    Ok(())
}

/// Have `fd` closed in forked children. Returns whether it was registered (if the table
/// is full, a child keeps the descriptor, and the lock it holds lives as long as either).
pub fn close_in_children(fd: RawFd) -> bool {
    install();
    CLOSE_IN_CHILD.iter().any(|entry| {
        // Relaxed: the table is only read in the single-threaded child after a fork,
        // which sees every store made before the fork.
        entry
            .compare_exchange(-1, fd, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    })
}

/// Stop closing `fd` in forked children (it is being closed here).
pub fn forget_fd(fd: RawFd) {
    for entry in &CLOSE_IN_CHILD {
        // Relaxed: see `close_in_children`.
        if entry
            .compare_exchange(fd, -1, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
}

/// A value that is dropped normally in the process that made it, and leaked in a forked
/// child (for ZeroMQ contexts and sockets: tearing the parent's down in a child hangs the
/// child and can abort the parent).
pub struct LeakInChild<T> {
    value: Option<T>,
    made_in: u64,
}

impl<T> LeakInChild<T> {
    pub fn new(value: T) -> Self {
        LeakInChild {
            value: Some(value),
            made_in: generation(),
        }
    }

    /// The fork generation the value was made in.
    pub fn made_in(&self) -> u64 {
        self.made_in
    }
}

impl<T> std::ops::Deref for LeakInChild<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.value.as_ref().expect("taken only in drop")
    }
}

impl<T> std::ops::DerefMut for LeakInChild<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.value.as_mut().expect("taken only in drop")
    }
}

impl<T> Drop for LeakInChild<T> {
    fn drop(&mut self) {
        if is_inherited(self.made_in) {
            std::mem::forget(self.value.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_sees_a_new_generation_and_its_registered_fds_closed() {
        let here = generation();
        let file = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsRawFd;
        let fd = file.as_raw_fd();
        assert!(close_in_children(fd));
        // SAFETY: the child only calls async-signal-safe functions before _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: fcntl on a descriptor number; EBADF if it was closed.
            let closed = unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1;
            let ok = is_inherited(here) && check(here, "queue").is_err() && closed;
            // SAFETY: _exit ends the child without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "{status}"
        );
        assert!(!is_inherited(here));
        forget_fd(fd);
        drop(file);
    }
}
