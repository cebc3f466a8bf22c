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
//! - Until the child runs that handler, its copies still hold the locks: a parent that
//!   died meanwhile would look alive (its queue's name still taken, its readers still
//!   waiting), for as long as the child is not scheduled. So a fork in a process that
//!   holds role locks waits, in its parent handler, for the child to say (a byte on a
//!   pipe made in the prepare handler) that it closed them, or to end, for at most
//!   [`CHILD_LET_GO_PATIENCE_MS`]: `fork()` returns to the parent once no copy of its
//!   locks is left in the child. A fork of a process with no role lock makes no pipe and
//!   waits for nothing; `vfork` and `posix_spawn` run no handler (their child execs, and
//!   the descriptors are close-on-exec).

use shmq_protocol::sync::local::{AtomicI32, AtomicU64, Ordering};
use std::cell::Cell;
use std::os::fd::RawFd;
use std::sync::Once;

use crate::error::{Error, Result};

static GENERATION: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();

/// Descriptors closed in a forked child (role locks); -1 marks a free entry.
const MAX_INHERITED_FDS: usize = 256;
static CLOSE_IN_CHILD: [AtomicI32; MAX_INHERITED_FDS] =
    [const { AtomicI32::new(-1) }; MAX_INHERITED_FDS];

/// How long a parent's `fork()` waits at most for its child to close its copies of the
/// role locks (see the module docs): a child stopped or starved longer than this keeps
/// them until it runs.
pub const CHILD_LET_GO_PATIENCE_MS: i32 = 2000;

thread_local! {
    /// The pipe of the fork this thread is making (read end, write end), -1 when none:
    /// made by [`before_fork`], written by the child's [`in_child`], waited on and closed
    /// by the parent's [`in_parent`]. Per thread, as two threads may fork at once. A
    /// `Cell` of plain numbers: no allocation and no destructor, so it may be used in
    /// the handlers.
    static FORK_PIPE: Cell<[RawFd; 2]> = const { Cell::new([-1, -1]) };
}

/// The prepare handler: a pipe for the child to say it let go of the role locks, if this
/// process holds any.
extern "C" fn before_fork() {
    // Relaxed: the registering thread's own stores are seen; one registered by another
    // thread while this one forks may be missed, and its lock is then the one the child
    // may hold a little longer, as before this handshake.
    if !CLOSE_IN_CHILD
        .iter()
        .any(|e| e.load(Ordering::Relaxed) >= 0)
    {
        return;
    }
    let mut fds: [RawFd; 2] = [-1, -1];
    // SAFETY: pipe2 writes two descriptors into the two-element array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0 {
        let _ = FORK_PIPE.try_with(|p| p.set(fds));
    }
}

/// The parent handler: wait until the child closed its copies of the role locks (its
/// byte on the pipe) or ended (the pipe's end of file), at most
/// [`CHILD_LET_GO_PATIENCE_MS`]; then close the pipe.
extern "C" fn in_parent() {
    let Ok([read, write]) = FORK_PIPE.try_with(|p| p.replace([-1, -1])) else {
        return;
    };
    if read < 0 {
        return;
    }
    // SAFETY: the parent's copy of the write end, made by `before_fork` for this fork and
    // used by nothing else; closed so that the child's end is the last (its end of file
    // when the child dies before writing).
    unsafe { libc::close(write) };
    let deadline = std::time::Instant::now()
        + std::time::Duration::from_millis(CHILD_LET_GO_PATIENCE_MS as u64);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut pfd = libc::pollfd {
            fd: read,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, valid for the call; `read` is this fork's pipe, open.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) };
        if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        break;
    }
    // SAFETY: this fork's read end, used by nothing else.
    unsafe { libc::close(read) };
}

extern "C" fn in_child() {
    // Only async-signal-safe work here (atomics, close, write), as after any fork.
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
    // Tell the parent, which waits in `in_parent` (the thread that forked is this one,
    // so its pipe is in this thread's slot).
    if let Ok([read, write]) = FORK_PIPE.try_with(|p| p.replace([-1, -1])) {
        if write >= 0 {
            let byte = 1u8;
            // SAFETY: this fork's pipe, inherited from the parent's `before_fork`; one
            // byte from a live local. A failed write is the parent's wait running to
            // its end of file or its patience, no worse.
            unsafe {
                libc::write(write, (&byte as *const u8).cast(), 1);
                libc::close(write);
                libc::close(read);
            }
        }
    }
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: registers handlers with the C signature pthread_atfork expects; they
        // touch only statics and a thread-local cell of numbers, and call pipe2, poll,
        // write and close.
        unsafe { libc::pthread_atfork(Some(before_fork), Some(in_parent), Some(in_child)) };
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
///
/// # Errors
///
/// [`Error::Forked`] when this process is a forked child of the one that made the object
/// (generation `made_in` is older than this process's).
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

    /// The parent's `fork()` returns only once the child let go of the role locks: with
    /// parent and child on one CPU, the parent goes on running after the fork (the
    /// child waits for the CPU), so without the handshake the child would still hold
    /// the lock when the parent, having dropped its own, probes it.
    #[test]
    fn a_fork_returns_to_the_parent_once_the_child_let_go_of_its_role_locks() {
        use crate::liveness::{byte_liveness, lock_byte, Liveness};
        use std::os::fd::AsRawFd;
        let path = std::env::temp_dir().join(format!("shmq-fork-lock-{}", std::process::id()));
        #[allow(clippy::disallowed_methods, reason = "a scratch file, not a segment")]
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .unwrap()
        };
        let probe = open();
        for _ in 0..20 {
            let held = open();
            lock_byte(&held, libc::F_WRLCK, 0).unwrap();
            assert!(close_in_children(held.as_raw_fd()));
            // One CPU for both (the child inherits the mask).
            // SAFETY: a zeroed cpu_set_t is valid; CPU_SET and sched_setaffinity take
            // pointers to this live local.
            let (pid, old) = unsafe {
                let mut old: libc::cpu_set_t = std::mem::zeroed();
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut old);
                let mut one: libc::cpu_set_t = std::mem::zeroed();
                let cpu = (0..libc::CPU_SETSIZE as usize)
                    .find(|&c| libc::CPU_ISSET(c, &old))
                    .unwrap();
                libc::CPU_SET(cpu, &mut one);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one);
                // The child only sleeps and exits (async-signal-safe calls).
                (libc::fork(), old)
            };
            assert!(pid >= 0);
            if pid == 0 {
                // SAFETY: async-signal-safe calls only, then _exit.
                unsafe {
                    libc::usleep(300_000);
                    libc::_exit(0);
                }
            }
            // The parent drops its own lock at once: no copy may be left in the child.
            forget_fd(held.as_raw_fd());
            drop(held);
            let liveness = byte_liveness(&probe, 0);
            // SAFETY: restoring this thread's mask from the live local; reaping our child.
            unsafe {
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &old);
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            assert_eq!(
                liveness,
                Liveness::Dead,
                "the forked child still held the lock"
            );
        }
        let _ = std::fs::remove_file(&path);
    }
}
