//! Telling a live peer from a dead one — also across pid namespaces.
//!
//! A pid says nothing in another pid namespace (Docker with `--ipc=host`, the containers
//! of one Kubernetes pod): the peer's pid is not visible there, or names someone else.
//! So a process that takes a *role* in a segment — its creator, the writer of a ring,
//! reader `r` — holds a [`RoleLock`]: an open-file-description lock (`F_OFD_SETLK`) on
//! one byte of the segment's file in `/dev/shm`, for as long as it holds the role. The
//! kernel drops it when the process dies (its descriptors close), and every process that
//! can open the file sees it (`F_OFD_GETLK`), whatever its pid namespace. Taking a lock
//! that is held fails: that is how a second owner of a reader rank is refused.
//!
//! A check has three answers ([`Liveness`]): **alive** (the lock is held), **dead** (it
//! is not: proved, the holder is gone), **unknown** (the lock cannot be tested: no file
//! to open, no permission). Only "dead" may make shmq drop a peer, report it dead or
//! remove its segments; "unknown" never does.
//!
//! "Alive" proves less than "dead": any process that can open the file can lock its
//! bytes, so a peer holding a read lock on a dead reader's byte makes that reader look
//! alive (the writer then waits for it until its timeout, and `drop` does not drop it).
//! What shmq guarantees against the same user's processes, and what it cannot, is in
//! `crate::sigbus`.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::error::{Error, Result};
use crate::fork;
use crate::segment_file::{path, Access, SegmentFile};

pub use crate::segment_file::SHM_DIR;

/// What is known about the holder of a role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    /// Proved: nobody holds the role's lock.
    Dead,
    /// Cannot be told (the lock cannot be tested from here).
    Unknown,
}

/// The lock byte of a segment's creator; roles of a ring use `1 + slot`.
pub const CREATOR_BYTE: u64 = 0;

fn flock(kind: i32, byte: u64) -> libc::flock {
    // SAFETY: `flock` is a plain C struct for which all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte as libc::off_t;
    fl.l_len = 1;
    fl
}

/// Set (`F_WRLCK`, `F_RDLCK`) or release (`F_UNLCK`) this open file description's lock on
/// byte `byte` of `file`, without waiting (`F_OFD_SETLK`): roles here, pins in `pins`,
/// name records in `names_dir`.
///
/// # Errors
///
/// The system's error when another open file description holds a conflicting lock on the
/// byte (`EAGAIN` or `EACCES`), or `fcntl` fails otherwise (a descriptor not open for the
/// lock's kind: `EBADF`).
pub fn lock_byte(file: &impl AsFd, kind: i32, byte: u64) -> std::io::Result<()> {
    let fl = flock(kind, byte);
    // SAFETY: a valid descriptor (`file` owns it for the call) and a pointer to a valid
    // flock for the call. The lock is this open file description's; a peer can only
    // hold conflicting locks on the same byte, which makes this fail, never misbehave.
    if unsafe { libc::fcntl(file.as_fd().as_raw_fd(), libc::F_OFD_SETLK, &fl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether another open file description holds a lock on byte `byte` of `file`
/// (`F_OFD_GETLK`): [`Liveness::Alive`] if one does, [`Liveness::Dead`] if none does,
/// [`Liveness::Unknown`] if the kernel cannot tell. `file`'s own locks never show (the
/// probes of this module and `names_dir` hold none on the bytes they test).
pub fn byte_liveness(file: &impl AsFd, byte: u64) -> Liveness {
    let mut fl = flock(libc::F_WRLCK, byte);
    // SAFETY: a valid descriptor (`file` owns it for the call) and a pointer to a valid
    // flock for the call, which the kernel fills. A peer's locks only change the answer
    // (see the module docs), never make the call unsafe.
    if unsafe { libc::fcntl(file.as_fd().as_raw_fd(), libc::F_OFD_GETLK, &mut fl) } != 0 {
        return Liveness::Unknown;
    }
    if fl.l_type == libc::F_UNLCK as libc::c_short {
        Liveness::Dead
    } else {
        Liveness::Alive
    }
}

/// A role held in a segment: a lock on one byte of its file, released when dropped (or
/// when the process dies). A forked child does not inherit it (see `crate::fork`).
#[derive(Debug)]
pub struct RoleLock {
    file: Option<SegmentFile>,
    generation: u64,
}

impl RoleLock {
    /// Take byte `byte` of segment `segment`'s file. `Ok(None)` if a live process holds
    /// it already.
    ///
    /// # Errors
    ///
    /// An [`Error`] naming the segment when its file cannot be opened (gone, not this
    /// user's) or the lock fails for another reason than a holder (`Ok(None)`).
    pub fn acquire(segment: &str, byte: u64) -> Result<Option<RoleLock>> {
        Self::take(segment, byte, libc::F_WRLCK)
    }

    /// Hold byte `byte` of segment `segment`'s file *shared* (a read lock): any number of
    /// processes hold it at once, and it shows the segment is in use to whoever waits
    /// for no lock at all to be held on the file (a janitor removing a named segment once
    /// its last holder is gone). `Ok(None)` if a process holds it exclusively.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire).
    pub fn acquire_shared(segment: &str, byte: u64) -> Result<Option<RoleLock>> {
        Self::take(segment, byte, libc::F_RDLCK)
    }

    fn take(segment: &str, byte: u64, kind: i32) -> Result<Option<RoleLock>> {
        // A descriptor of its own (its own open file description), so that this lock is
        // independent of any other lock or probe of this process on the same file.
        let access = if kind == libc::F_RDLCK {
            Access::ReadOnly
        } else {
            Access::ReadWrite
        };
        let file = SegmentFile::open_to(segment, access, "lock a role in it")?;
        if let Err(e) = lock_byte(&file, kind, byte) {
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(None),
                _ => Err(Error::os(
                    format!("locking byte {byte} of {}", path(segment)),
                    e,
                )),
            };
        }
        fork::close_in_children(file.as_raw_fd());
        Ok(Some(RoleLock {
            file: Some(file),
            generation: fork::generation(),
        }))
    }
}

impl Drop for RoleLock {
    fn drop(&mut self) {
        let Some(file) = self.file.take() else { return };
        if fork::is_inherited(self.generation) {
            // The fork handler closed this descriptor number in the child already; it
            // may name another file by now: do not close it again.
            std::mem::forget(file);
        } else {
            fork::forget_fd(file.as_raw_fd());
            drop(file); // releases the lock
        }
    }
}

/// Tests the role locks of one segment (through a descriptor that holds no lock, so
/// that every lock, also this process's own roles, shows).
#[derive(Debug)]
pub struct LockProbe {
    file: Option<SegmentFile>,
}

impl LockProbe {
    /// A probe of segment `segment`; one that cannot open the file answers `Unknown`.
    pub fn open(segment: &str) -> LockProbe {
        LockProbe {
            file: SegmentFile::try_open(segment, Access::ReadOnly).ok(),
        }
    }

    /// Whether the role of lock byte `byte` is held.
    pub fn liveness(&self, byte: u64) -> Liveness {
        match &self.file {
            Some(file) => byte_liveness(file, byte),
            None => Liveness::Unknown,
        }
    }
}

/// Whether the creator of segment `segment` is alive (its creator lock is held).
pub fn creator_liveness(segment: &str) -> Liveness {
    LockProbe::open(segment).liveness(CREATOR_BYTE)
}

// ---------------------------------------------------------------------------------
// Process trees: what a worker does when the process it serves is gone.

/// `pidfd_open(pid)`: a descriptor (close-on-exec) that becomes readable once process
/// `pid` has exited, and that names that process only, whatever reuses its pid later.
///
/// # Errors
///
/// The system's error: `ESRCH` when no process `pid` exists (it has exited and been
/// reaped), `ENOSYS` on a kernel before Linux 5.3, `EMFILE` when out of descriptors.
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1; no
    // memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just made for us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Wait (this thread) until the process of `pidfd` has exited.
pub fn wait_for_exit(pidfd: &OwnedFd) {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut p, 1, -1) };
        if rc > 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
    }
}

/// `(pid, parent pid)` of every running process (zombies left out: they cannot be
/// signalled, and have no children), from `/proc/<pid>/stat`.
fn running_processes() -> Vec<(i32, i32)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, running_parent(pid)?)))
        .collect()
}

/// The parent of process `pid`, if it runs (not a zombie).
fn running_parent(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold anything, up to the last ')'.
    let mut rest = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = rest.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    rest.next()?.parse().ok()
}

/// SIGKILL every running descendant of this process (children, theirs, ...), in rounds
/// until none is left (one forked meanwhile shows in the next round); returns how many
/// were signalled. Each is signalled through a pidfd opened before its parent is checked
/// again, so a pid reused meanwhile is never hit. Descendants that were orphaned reach
/// this process only if it is a child subreaper (`PR_SET_CHILD_SUBREAPER`): workers are.
pub fn kill_descendants() -> usize {
    let me = std::process::id() as i32;
    let mut signalled = 0;
    for round in 0..50 {
        let procs = running_processes();
        let mut tree = vec![me];
        let mut found = Vec::new();
        while let Some(parent) = tree.pop() {
            for &(pid, ppid) in &procs {
                if ppid == parent && pid != me {
                    tree.push(pid);
                    found.push((pid, ppid));
                }
            }
        }
        if found.is_empty() {
            break;
        }
        if round > 0 {
            // Those signalled last round may not be zombies yet: give the kills a moment
            // to land before looking again.
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        for (pid, ppid) in found {
            let Ok(fd) = pidfd_open(pid as u32) else {
                continue; // gone already
            };
            if running_parent(pid) != Some(ppid) {
                continue; // not the process found above any more
            }
            // SAFETY: pidfd_send_signal(2) with a valid pidfd, no siginfo, no flags.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
            if rc == 0 {
                signalled += 1;
            }
        }
    }
    signalled
}

#[cfg(test)]
mod tests {
    use super::*;
    use shmq_protocol::sync::local::{AtomicU32, Ordering};

    /// A file in `SHM_DIR` to hold roles on, as a segment's file is; removed on drop.
    struct LockFile(String);

    impl LockFile {
        fn new() -> LockFile {
            // Relaxed: only makes the names of one process's test files unique.
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let name = format!("shmq_test_liveness_{}_{n}", std::process::id());
            // Owner-only, as every segment: openers refuse any other (`segment_file`).
            crate::segment_file::SegmentFile::create(&name).unwrap();
            LockFile(name)
        }
        fn name(&self) -> &str {
            &self.0
        }
    }

    impl Drop for LockFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(path(&self.0));
        }
    }

    #[test]
    fn a_role_is_held_once_and_seen_by_probes() {
        let seg = LockFile::new();
        let probe = LockProbe::open(seg.name());
        assert_eq!(probe.liveness(5), Liveness::Dead);
        let lock = RoleLock::acquire(seg.name(), 5).unwrap().expect("free");
        assert_eq!(
            probe.liveness(5),
            Liveness::Alive,
            "seen from this very process too"
        );
        assert!(
            RoleLock::acquire(seg.name(), 5).unwrap().is_none(),
            "taken twice"
        );
        assert!(RoleLock::acquire(seg.name(), 6).unwrap().is_some());
        drop(lock);
        assert_eq!(probe.liveness(5), Liveness::Dead);
        assert!(
            RoleLock::acquire(seg.name(), 5).unwrap().is_some(),
            "free again"
        );
        assert_eq!(
            LockProbe::open("shmq_test_missing_0_0").liveness(0),
            Liveness::Unknown
        );
    }

    #[test]
    fn a_killed_holder_releases_its_role() {
        let seg = LockFile::new();
        // A child takes the role, then is killed with SIGKILL (no destructors run).
        // SAFETY: the child only takes the lock and then sleeps until killed.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let lock = RoleLock::acquire(seg.name(), 3);
            let ok = matches!(lock, Ok(Some(_)));
            std::mem::forget(lock);
            if !ok {
                // SAFETY: ends the child at once.
                unsafe { libc::_exit(1) };
            }
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
        let probe = LockProbe::open(seg.name());
        let t = std::time::Instant::now();
        while probe.liveness(3) != Liveness::Alive && t.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(probe.liveness(3), Liveness::Alive);
        // SAFETY: our own child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        assert_eq!(probe.liveness(3), Liveness::Dead);
    }
}
