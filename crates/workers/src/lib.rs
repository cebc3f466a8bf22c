//! Worker processes: start them, wait until they are ready under a deadline, notice at
//! once when one dies, and shut them all down, process trees and shared-memory segments
//! included. The one implementation of worker supervision: Rust serving stacks use
//! [`Workers::spawn`]; the Python package's `WorkerProcesses` starts its interpreters
//! with `multiprocessing` and hands each one to [`Workers::adopt`] (the bindings'
//! `_core.WorkerGroup`), keeping only what is Python (pickling the target, the ready
//! report's payload, the remote workers' sockets, the public API). Workers on other
//! machines join over the authenticated [`link`], from Rust or Python alike.
//!
//! Each worker
//! - has a **ready pipe**: it sends one frame, a 4-byte big-endian length and a payload
//!   (Python: the pickled `info`; [`report_ready`] sends an empty one), once its set-up
//!   is done. The pipe's fd is in [`READY_FD_ENV`] and its rank in [`RANK_ENV`] for
//!   workers of [`Workers::spawn`]. The same pipe carries a **death notice**: a frame
//!   whose length word has its top bit set (a ready payload is never that long), whose
//!   payload is UTF-8 text, the exit code the worker is about to exit with, a newline,
//!   and the last lines of its traceback. The Python bootstrap sends one when the
//!   worker's target raises, after printing the traceback and before the interpreter's
//!   teardown (long with torch imported, see `docs/performance.md`; unbounded when an
//!   `atexit` handler or a non-daemon thread hangs); the failure is recorded when the notice arrives, not
//!   when the exit does;
//! - **dies with the parent**, even a SIGKILLed one (`PR_SET_PDEATHSIG`, set between fork
//!   and exec, then the parent is checked again in case it died in between). The kernel
//!   sends that signal when the *thread* that forked the worker exits: spawn workers from
//!   a thread that lives as long as they do (the main thread);
//! - **leads its own process group**, so its descendants are signalled with it and a
//!   terminal's Ctrl-C reaches only the parent, which then shuts the workers down;
//! - writes **stderr through a pipe**: forwarded to the parent's stderr (fd 2) prefixed
//!   `(Worker_2 pid=...)`, a line at a time, its last lines kept for the error that
//!   names it.
//!
//! One supervisor thread per group waits (one `poll`) on every worker's pidfd, ready
//! pipe and stderr pipe: it records readiness and exits under one lock, whose condition
//! variable the waits ([`Workers::wait_until_ready`], [`Workers::wait_any`],
//! [`Workers::wait_failures`], ...) wait on. A worker that exits early is named at
//! once ([`Error::WorkerDied`]: rank, pid, exit code or signal, its last stderr lines),
//! and so is one that sends a death notice, before it has exited (the error's exit code
//! is the one the notice announces); one that exits after it was ready with code 0 has
//! finished, not failed.
//! [`Workers::close`] (also on drop) sends SIGTERM to every worker's process group, waits
//! one shared grace period, SIGKILLs what remains (with the descendants found in each
//! worker's process tree before the SIGTERM and again before the SIGKILL), reaps, and
//! removes the shared-memory segments the dead workers left.
//!
//! Exits are read without reaping (`waitid(WNOWAIT)`); workers are reaped last, in
//! [`Workers::close`] (why: `docs/design.md`, "Worker processes").
//!
//! ```no_run
//! # mod shmq { pub mod workers { pub use shmq_workers::*; } } // the `shmq` crate
//! use std::process::Command;
//! use std::time::Duration;
//! use shmq::workers::{report_ready, WorkerOptions, Workers, RANK_ENV};
//!
//! if let Ok(rank) = std::env::var(RANK_ENV) {
//!     // In a worker: set up (open the queue, load the model), then:
//!     report_ready()?;
//!     // ... serve ...
//!     # let _ = rank;
//! } else {
//!     let exe = std::env::current_exe().unwrap();
//!     let workers = Workers::spawn((0..4).map(|_| Command::new(&exe)), WorkerOptions::default())?;
//!     workers.wait_until_ready(Duration::from_secs(60))?; // names a worker that died first
//!     // ... broadcast to them; workers.check()? between steps ...
//!     workers.close();
//! }
//! # Ok::<(), shmq::workers::Error>(())
//! ```

use std::collections::{HashSet, VecDeque};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

// `warn_user!`: report a warning to the user, from the layer below.
#[macro_use]
extern crate shmq_os;

mod admit;
pub mod link;
mod monitor;
mod watch;

mod error;
pub use error::{signal_name, Error, Result, StderrCapture, WorkerDeath, WorkerExit};
pub use monitor::{sibling_failure, Monitor, SiblingFailure, NOTICE_FD_ENV, NOTICE_LIMIT};
use shmq_core::Error as CoreError;
use shmq_os::process::ProcessId;
use shmq_os::{liveness, segment};
use watch::{
    death, drain_stderr, forward_lines, poll_exits, push_line, remove_segments_of, running_trees,
    set_nonblocking, supervise, Member, ReadyFrame, Shared, State,
};

/// Environment variable: the fd of a worker's ready pipe (see [`report_ready`]).
pub const READY_FD_ENV: &str = "SHMQ_READY_FD";
/// Environment variable: a worker's rank (its index in [`Workers::spawn`]'s commands).
pub const RANK_ENV: &str = "SHMQ_WORKER_RANK";
/// The grace period between SIGTERM and SIGKILL of [`WorkerOptions::default`].
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);
/// The largest ready report's payload; a longer one counts as no report.
pub const MAX_READY_PAYLOAD: usize = 64 << 20;
/// How long [`Workers::close`] waits for what SIGKILL hit to be gone.
/// The most workers one group supervises, local and remote together: as many as a
/// queue has readers at most (`segment::MAX_READERS`). A larger count is refused before
/// anything is allocated for it ([`Workers::new`]); the machine's own limits (processes,
/// file descriptors: three per local worker) usually stop a group well before.
pub const MAX_WORKERS: usize = 4096;
const KILL_WAIT: Duration = Duration::from_secs(5);
/// Without pidfds (Linux < 5.3) exits are polled this often.
const EXIT_POLL: Duration = Duration::from_millis(50);

/// In a worker: tell the parent that this worker's set-up is done (an empty ready
/// frame). Only the first call writes; later ones do nothing.
///
/// # Errors
///
/// [`Error::Core`] with `WrongRole` in a process that shmq's [`Workers`] did not start (no
/// ready descriptor in its environment); [`Error::Core`] with `Os` when writing the ready
/// frame fails (the parent closed its end).
pub fn report_ready() -> Result<()> {
    static REPORTED: Mutex<bool> = Mutex::new(false);
    let mut reported = REPORTED.lock().unwrap_or_else(|e| e.into_inner());
    if *reported {
        return Ok(());
    }
    let fd: RawFd = std::env::var(READY_FD_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            Error::Core(CoreError::WrongRole(format!(
                "report_ready() is for worker processes started by shmq::workers::Workers \
                 ({READY_FD_ENV} is not set)"
            )))
        })?;
    // SAFETY: the parent left this fd open across exec for exactly this (`pre_exec` in
    // `Workers::spawn`), and this is its only user: `REPORTED` makes it used once, and
    // the `OwnedFd` closes it after the write.
    let pipe = unsafe { OwnedFd::from_raw_fd(fd) };
    std::fs::File::from(pipe)
        .write_all(&0u32.to_be_bytes())
        .map_err(|e| Error::os("reporting ready to the parent", e))?;
    *reported = true;
    Ok(())
}

/// In a worker: watch process `pid` (its parent) from a thread of this process: once it
/// has exited, [end this process cleanly](exit_now): kill its descendants, remove what it
/// created (as [`segment::remove_created`]) and die of SIGKILL. All of it without
/// Python's GIL, so that a worker whose main thread never lets go of it (a long call into
/// native code) still goes, and leaves neither memory nor processes behind. If `pid` is
/// gone already, or is this process's parent and stops being it while the watch is set
/// up (it died and this process was handed to another), that happens now. Err only if
/// pidfds are not available (Linux before 5.3): see [`die_with_process`].
///
/// # Errors
///
/// [`Error::Core`] with `Os` when `pidfd_open` fails for another reason than `pid` being
/// gone already (a kernel before 5.3, out of descriptors), or the watching thread cannot
/// start.
pub fn exit_with_process(pid: u32) -> Result<()> {
    let direct = parent_pid() == pid;
    let pidfd = match liveness::pidfd_open(pid) {
        Ok(fd) => Some(fd),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => None,
        Err(e) => return Err(Error::os(format!("watching process {pid} (pidfd_open)"), e)),
    };
    if direct && parent_pid() != pid {
        // The parent died around pidfd_open: the pid watched may be another's by now.
        exit_now();
    }
    let watch = move || {
        if let Some(fd) = &pidfd {
            liveness::wait_for_exit(fd);
        }
        exit_now();
    };
    std::thread::Builder::new()
        .name("shmq-exit-with".into())
        .spawn(watch)
        .map_err(|e| Error::os("starting the thread that watches the parent", e))?;
    Ok(())
}

/// End this process now as a worker whose parent is gone: kill its descendants, remove
/// the segments it created ([`segment::remove_created`]), and die of SIGKILL. Runs no
/// exit hook or destructor (they could hang; SIGKILL is what a dead parent's worker would
/// get from the kernel).
pub fn exit_now() -> ! {
    liveness::kill_descendants();
    segment::remove_created();
    // SAFETY: kill(2) of this process; no memory is passed.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    // SIGKILL cannot be caught or blocked: the kill above does not return in practice.
    std::process::abort()
}

/// Make this process get `signal` when process `pid` exits, even by SIGKILL: the one way
/// shmq makes a process die with its parent (workers of [`Workers::spawn`] get the same
/// from [`set_parent_death_signal`] between fork and exec).
///
/// - `pid` is this process's parent: the kernel sends it (`PR_SET_PDEATHSIG`). The kernel
///   does so when the *thread* that forked this process exits: have a thread that lives
///   as long as its process start it. If the parent died before the signal was set, this
///   process gets it now.
/// - any other process (a fork server started this one), or where the kernel's way
///   failed: a thread of this process waits on `pid`'s pidfd and sends the signal; now,
///   if `pid` is gone already.
///
/// For a clean end with SIGKILL (descendants killed, segments removed), use
/// [`exit_with_process`]. Err for a `signal` that is no signal number
/// ([`CoreError::InvalidArgument`]), and where neither way is available (not Linux, or Linux
/// before 5.3 for a process that is not the parent).
///
/// # Errors
///
/// [`Error::Core`] with `InvalidArgument` for a `signal` outside 1 to `SIGRTMAX`; with `Os`
/// when `pid` cannot be watched (`pidfd_open` fails for another reason than `pid` being
/// gone already, when the signal is sent at once) or the watching thread cannot start.
pub fn die_with_process(pid: u32, signal: i32) -> Result<()> {
    // 0 would clear the parent-death signal and an invalid one would never be sent:
    // either way the process would silently outlive `pid`.
    if !(1..=libc::SIGRTMAX()).contains(&signal) {
        return Err(Error::Core(CoreError::InvalidArgument(format!(
            "signal must be a signal number from 1 to {}, got {signal}",
            libc::SIGRTMAX()
        ))));
    }
    if parent_pid() == pid {
        match set_parent_death_signal(signal, pid as libc::pid_t) {
            Ok(()) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                // The parent died between the check and prctl: nobody will send it.
                send_to_self(signal);
                return Ok(());
            }
            Err(_) => {} // watched below instead
        }
    }
    let pidfd = match liveness::pidfd_open(pid) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
            send_to_self(signal);
            return Ok(());
        }
        Err(e) => {
            return Err(Error::os(
                format!(
                    "making process {} die with process {pid}",
                    std::process::id()
                ),
                e,
            ))
        }
    };
    std::thread::Builder::new()
        .name("shmq-die-with".into())
        .spawn(move || {
            liveness::wait_for_exit(&pidfd);
            send_to_self(signal);
        })
        .map_err(|e| Error::os("starting the thread that watches the parent", e))?;
    Ok(())
}

/// Set this process's parent-death signal (`PR_SET_PDEATHSIG`), then check that its
/// parent is still `parent`: `ESRCH` if it died in between (nobody would send the signal).
/// Async-signal-safe (prctl, getppid; nothing allocated), so it also runs between fork and
/// exec.
///
/// # Errors
///
/// The system's error of `prctl`, or `ESRCH` when the parent is no longer `parent` (it died
/// before the signal was set).
pub fn set_parent_death_signal(signal: i32, parent: libc::pid_t) -> std::io::Result<()> {
    // SAFETY: prctl(2) with an integer signal number; no memory is passed.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: getppid(2) cannot fail and touches no memory.
    if unsafe { libc::getppid() } != parent {
        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
}

/// Make this process adopt its orphaned descendants (`PR_SET_CHILD_SUBREAPER`): a daemon
/// that double-forks stays in its process tree, where [`liveness::kill_descendants`]
/// finds it, instead of being handed to init.
///
/// # Errors
///
/// [`Error::Core`] with `Os` when `prctl(PR_SET_CHILD_SUBREAPER)` fails (a kernel before
/// 3.4).
pub fn become_subreaper() -> Result<()> {
    // SAFETY: prctl(2) with an integer flag; no memory is passed.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(Error::os(
            "adopting orphaned descendants (PR_SET_CHILD_SUBREAPER)",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

fn parent_pid() -> u32 {
    // SAFETY: getppid(2) cannot fail and touches no memory.
    unsafe { libc::getppid() as u32 }
}

fn send_to_self(signal: i32) {
    // SAFETY: kill(2) of this process with a signal number; no memory is passed. An
    // invalid number is EINVAL, nothing else.
    unsafe { libc::kill(libc::getpid(), signal) };
}

/// How [`Workers`] run their processes.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// The signal a worker of [`Workers::spawn`] gets when the parent dies (default
    /// SIGKILL); `None`: workers may outlive the parent.
    pub death_signal: Option<i32>,
    /// Between SIGTERM and SIGKILL in [`Workers::close`] and on drop.
    pub grace: Duration,
    /// Copy each worker's stderr to the parent's fd 2, prefixed `(Worker_N pid=...)`.
    pub forward_stderr: bool,
    /// How many of its last stderr lines [`Error::WorkerDied`] shows.
    pub stderr_tail_lines: usize,
    /// Workers are named `{name_prefix}_{rank}`.
    pub name_prefix: String,
    /// Each worker leads its own process group (signalled as a whole).
    pub new_process_group: bool,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        WorkerOptions {
            death_signal: Some(libc::SIGKILL),
            grace: DEFAULT_GRACE,
            forward_stderr: true,
            stderr_tail_lines: 20,
            name_prefix: "Worker".to_owned(),
            new_process_group: true,
        }
    }
}

/// A new pipe, both ends close-on-exec: (read, write).
fn pipe(what: &str) -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2(2) writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Error::os(
            format!("creating {what}"),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: both fds are new and owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A process started by someone else, for [`Workers::adopt`].
#[derive(Debug)]
pub struct StartedWorker {
    pub pid: u32,
    /// Our own child, watched and waited for here. `false`: another process's child (a
    /// fork server's), whose exit its owner reports with [`Workers::report_exit`].
    pub own_child: bool,
    /// The read end of its ready pipe.
    pub ready: Option<OwnedFd>,
    /// The read end of its stderr pipe, and from when on it holds the worker's stderr.
    pub stderr: Option<(OwnedFd, StderrCapture)>,
    /// Whether [`Workers::close`] reaps it (else its owner does).
    pub reap: bool,
}

/// A snapshot of one worker ([`Workers::status`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerStatus {
    pub name: String,
    pub rank: usize,
    /// `None`: not started, or a remote worker not connected yet.
    pub pid: Option<u32>,
    /// Where a remote worker runs (`""` for a local one).
    pub host: String,
    pub ready: bool,
    pub exited: bool,
    /// How it ended, when known.
    pub exit: Option<WorkerExit>,
}

/// What a wait ended with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    /// What was waited for happened.
    Done,
    /// This worker failed (its death is [`Workers::death_of`]).
    Failed(usize),
    /// The timeout passed first.
    TimedOut,
}

/// A group of worker processes; see the [module documentation](self).
pub struct Workers {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    grace: Duration,
    death_signal: Option<i32>,
    /// Serializes close.
    close_lock: Mutex<()>,
    /// The process that made the group: a forked copy of it (whose supervisor thread
    /// does not exist) never closes the parent's workers.
    owner: u32,
    /// Where a sibling's failure is told ([`Workers::tell_siblings`]).
    notices: Arc<Mutex<monitor::Notices>>,
    /// Remote workers admitted by [`Workers::admit_remote`].
    admission: Mutex<Option<admit::Admission>>,
}

impl Workers {
    /// A group of `n_local` local workers (ranks `0..n_local`, started later and given to
    /// [`adopt`](Self::adopt)) and `n_remote` remote ones (the ranks after those, which
    /// join through [`claim_remote`](Self::claim_remote)); its supervisor thread runs
    /// from now on. `InvalidArgument` for more than [`MAX_WORKERS`] in all.
    ///
    /// # Errors
    ///
    /// [`Error::Core`] with `InvalidArgument` when `n_local + n_remote` is over the most
    /// workers a group supervises ([`MAX_WORKERS`]); with `Os` when the group's wake-up
    /// `eventfd` cannot be made (out of descriptors).
    pub fn new(n_local: usize, n_remote: usize, options: WorkerOptions) -> Result<Workers> {
        let total = n_local.checked_add(n_remote).filter(|&n| n <= MAX_WORKERS);
        if total.is_none() {
            return Err(Error::Core(CoreError::InvalidArgument(format!(
                "too many workers: {n_local} local (n_workers) + {n_remote} remote (n_remote); \
                 a group supervises at most {MAX_WORKERS} workers in all"
            ))));
        }
        // SAFETY: eventfd(2) takes two integers and returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(Error::os(
                "creating the workers' wake-up eventfd",
                std::io::Error::last_os_error(),
            ));
        }
        let members = (0..n_local + n_remote)
            .map(|rank| Member {
                rank,
                name: format!("{}_{rank}", options.name_prefix),
                pid: None,
                host: String::new(),
                remote: rank >= n_local,
                own_child: true,
                own_group: options.new_process_group,
                reap: false,
                reaped: false,
                ready: false,
                ready_payload: None,
                exited: false,
                exit: None,
                reported_exit: None,
                lost: None,
                death: None,
                tail: VecDeque::new(),
                partial: Vec::new(),
                capture: StderrCapture::No,
                ready_fd: None,
                ready_frame: ReadyFrame::default(),
                notice: None,
                stderr_fd: None,
                exit_fd: None,
            })
            .collect();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                members,
                exit_order: Vec::new(),
                failures: Vec::new(),
                closing: false,
                closed: false,
                stopping: false,
                captured: Vec::new(),
            }),
            changed: Condvar::new(),
            // SAFETY: the descriptor was just made and nothing else owns it.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            forward_stderr: options.forward_stderr,
            tail_lines: options.stderr_tail_lines,
        });
        let for_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name("shmq-workers".into())
            .spawn(move || supervise(&for_thread))
            .map_err(|e| Error::os("starting the workers' supervisor thread", e))?;
        Ok(Workers {
            shared,
            thread: Mutex::new(Some(thread)),
            grace: options.grace,
            death_signal: options.death_signal,
            close_lock: Mutex::new(()),
            owner: std::process::id(),
            notices: Arc::default(),
            admission: Mutex::new(None),
        })
    }

    /// Start one worker per command (ranks in order). If one cannot start, those already
    /// started are shut down and the error is returned.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), and [`Error::Core`] with `Os` when a command cannot be
    /// started (no such program, no permission): the workers started before are shut down.
    pub fn spawn(
        commands: impl IntoIterator<Item = Command>,
        options: WorkerOptions,
    ) -> Result<Workers> {
        let commands: Vec<Command> = commands.into_iter().collect();
        let workers = Workers::new(commands.len(), 0, options)?;
        for (rank, command) in commands.into_iter().enumerate() {
            let (started, notice) = workers.spawn_one(rank, command)?; // drop closes the others
            workers.adopt(rank, started)?;
            workers.lock_notices().pipes.push((rank, notice));
        }
        Ok(workers)
    }

    fn lock_notices(&self) -> std::sync::MutexGuard<'_, monitor::Notices> {
        self.notices.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Start worker `rank`: the worker, and the write end of its notice pipe.
    fn spawn_one(&self, rank: usize, mut command: Command) -> Result<(StartedWorker, OwnedFd)> {
        let (notice_r, notice_w) = pipe("a notice pipe")?;
        let notice_r_fd = notice_r.as_raw_fd();
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2(2) writes two fds into the array. O_CLOEXEC: no other child that
        // this process starts meanwhile inherits them.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(Error::os(
                "creating a ready pipe",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: both fds are new and owned by nothing else.
        let (ready_r, ready_w) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let ready_w_fd = ready_w.as_raw_fd();
        let parent = std::process::id() as libc::pid_t;
        let death_signal = self.death_signal;
        let new_group = self.shared.lock().members[rank].own_group;
        command
            .env(READY_FD_ENV, ready_w_fd.to_string())
            .env(RANK_ENV, rank.to_string())
            .env(NOTICE_FD_ENV, notice_r_fd.to_string())
            .stderr(Stdio::piped());
        // SAFETY: the closure runs in the forked child before exec and makes only
        // async-signal-safe calls (setpgid, prctl, getppid, fcntl), allocating nothing.
        unsafe {
            command.pre_exec(move || {
                if new_group && libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(sig) = death_signal {
                    // ESRCH: the parent died between fork and prctl.
                    set_parent_death_signal(sig, parent)?;
                }
                // Keep the ready pipe's write end open across exec (in this child only).
                if libc::fcntl(ready_w_fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // And the notice pipe's read end (`sibling_failure`).
                if libc::fcntl(notice_r_fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command.spawn().map_err(|e| {
            Error::os(
                format!("starting worker {rank} ({:?})", command.get_program()),
                e,
            )
        })?;
        drop(notice_r);
        set_nonblocking(&notice_w); // a notice's write never waits
        drop(ready_w); // the child has its copy; the parent's would hide the child's EOF
                       // The child is waited for (and reaped) through its pid from here on; dropping
                       // `Child` neither waits nor kills.
        let stderr = child
            .stderr
            .take()
            .map(|s| (OwnedFd::from(s), StderrCapture::FromStart));
        Ok((
            StartedWorker {
                pid: child.id(),
                own_child: true,
                ready: Some(ready_r),
                stderr,
                reap: true,
            },
            notice_w,
        ))
    }

    /// Watch local worker `rank`, started by the caller. Err if `rank` is not a local
    /// rank not yet adopted, or the group is closing (then the worker is killed).
    ///
    /// # Errors
    ///
    /// [`Error::Core`] with `WrongRole` when `rank` is not a local rank waiting to be
    /// adopted (out of range, remote, adopted already) or the group is closing (the worker
    /// is then killed).
    pub fn adopt(&self, rank: usize, worker: StartedWorker) -> Result<()> {
        let exit_fd = if worker.own_child {
            liveness::pidfd_open(worker.pid).ok()
        } else {
            None
        };
        let mut state = self.shared.lock();
        let closing = state.closing;
        let m = match state.members.get_mut(rank) {
            Some(m) if !m.remote && m.pid.is_none() => m,
            _ => {
                return Err(Error::Core(CoreError::WrongRole(format!(
                    "rank {rank} is not a local worker waiting to be adopted"
                ))))
            }
        };
        m.pid = Some(worker.pid);
        m.own_child = worker.own_child;
        m.reap = worker.reap && worker.own_child;
        if let Some(fd) = &worker.ready {
            set_nonblocking(fd);
        }
        m.ready_fd = worker.ready;
        if let Some((fd, capture)) = worker.stderr {
            set_nonblocking(&fd);
            m.stderr_fd = Some(fd);
            m.capture = capture;
        }
        m.exit_fd = exit_fd;
        if closing {
            m.signal(libc::SIGKILL);
        }
        drop(state);
        self.shared.wake();
        Ok(())
    }

    /// A remote worker asks to join as `rank` with `pid`: `Ok` reserves the rank (so that
    /// two quick joins cannot both pass), `Err` says why it is refused.
    ///
    /// # Errors
    ///
    /// A message saying why the rank is refused: not one of the group's remote ranks,
    /// claimed already by another process, or the group is closing.
    pub fn claim_remote(&self, rank: usize, pid: u32) -> std::result::Result<(), String> {
        self.shared.claim_remote(rank, pid)
    }

    /// Remote worker `rank` (claimed) is connected from `host`. `false`: the group is
    /// closing (drop the connection).
    pub fn remote_connected(&self, rank: usize, host: &str) -> bool {
        self.shared.remote_connected(rank, host)
    }

    /// Remote worker `rank` reported ready with `payload`.
    pub fn remote_ready(&self, rank: usize, payload: Vec<u8>) {
        self.shared.remote_ready(rank, payload)
    }

    /// Worker `rank` has exited (a remote worker, or a local one that is not our own
    /// child: the caller learnt its exit), with `tail` as its last stderr lines (a
    /// remote worker sends them) and `how` replacing the exit in the message. The
    /// supervisor thread records it as it records the exits it sees.
    pub fn report_exit(
        &self,
        rank: usize,
        exit: Option<WorkerExit>,
        tail: Vec<String>,
        how: Option<String>,
    ) {
        self.shared.report_exit(rank, exit, tail, how)
    }

    /// Every worker's pid, by rank (`None`: not started or not connected).
    pub fn pids(&self) -> Vec<Option<u32>> {
        self.shared.lock().members.iter().map(|m| m.pid).collect()
    }

    /// How each worker ended, by rank (`None`: still running, as far as seen).
    pub fn exits(&self) -> Vec<Option<WorkerExit>> {
        self.shared.lock().members.iter().map(|m| m.exit).collect()
    }

    /// A snapshot of every worker, by rank.
    pub fn status(&self) -> Vec<WorkerStatus> {
        self.shared
            .lock()
            .members
            .iter()
            .map(Member::status)
            .collect()
    }

    /// The ranks that have exited, in order.
    pub fn exit_order(&self) -> Vec<usize> {
        self.shared.lock().exit_order.clone()
    }

    /// Each worker's ready payload, by rank (`None`: not ready).
    pub fn ready_payloads(&self) -> Vec<Option<Vec<u8>>> {
        let state = self.shared.lock();
        state
            .members
            .iter()
            .map(|m| m.ready_payload.clone())
            .collect()
    }

    /// Every failure so far, in the order they were recorded.
    pub fn failures(&self) -> Vec<WorkerDeath> {
        let state = self.shared.lock();
        state
            .failures
            .iter()
            .filter_map(|&i| state.members[i].death.clone())
            .collect()
    }

    /// The failure of worker `rank`, if it failed.
    pub fn death_of(&self, rank: usize) -> Option<WorkerDeath> {
        self.shared.lock().members.get(rank)?.death.clone()
    }

    /// Worker `rank` in words: "Worker_1 (rank 1, pid 123)".
    pub fn describe(&self, rank: usize) -> Option<String> {
        Some(self.shared.lock().members.get(rank)?.describe())
    }

    /// Whether close has begun.
    pub fn closing(&self) -> bool {
        self.shared.lock().closing
    }

    /// Whether close has finished.
    pub fn closed(&self) -> bool {
        self.shared.lock().closed
    }

    /// Whether a local worker is dead or dying but its exit is not recorded yet (a
    /// multi-threaded process shows as a zombie before it can be waited for).
    pub fn exit_unrecorded(&self) -> bool {
        let pids: Vec<u32> = {
            let state = self.shared.lock();
            state
                .members
                .iter()
                .filter(|m| !m.exited)
                .filter_map(Member::local_pid)
                .collect()
        };
        pids.into_iter().any(|pid| {
            !matches!(
                ProcessId { pid, start_time: 0 }.state(),
                Some(s) if s != 'Z' && s != 'X'
            )
        })
    }

    /// Wait on the condition variable until `done` says so or `timeout` passes (`None`:
    /// no limit); `done` returns `Some` to stop.
    fn wait_for<T>(
        &self,
        timeout: Option<Duration>,
        mut done: impl FnMut(&State) -> Option<T>,
    ) -> Option<T> {
        // `None` for a timeout too long to be a deadline (up to `Duration::MAX`).
        let deadline = timeout.and_then(|t| shmq_core::wait::deadline_after(Instant::now(), t));
        let mut state = self.shared.lock();
        loop {
            if let Some(out) = done(&state) {
                return Some(out);
            }
            let slice = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left,
                    _ => return None,
                },
                None => Duration::from_secs(3600),
            };
            state = self
                .shared
                .changed
                .wait_timeout(state, slice)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Wait up to `timeout` until every worker has reported ready ([`Waited::Done`]) or
    /// one has exited first, or failed ([`Waited::Failed`]). `Err` once closing.
    ///
    /// # Errors
    ///
    /// [`Error::Core`] with `WrongRole` once the group is closing (a worker's failure is
    /// [`Waited::Failed`], not an error).
    pub fn wait_ready_for(&self, timeout: Option<Duration>) -> Result<Waited> {
        let waited = self.wait_for(timeout, |state| {
            if state.closing {
                return Some(Err(Error::Core(CoreError::WrongRole(
                    "the worker processes have been closed".to_owned(),
                ))));
            }
            // A failure (also one a death notice told before the exit), or an exit
            // before ready.
            let dead = state.failures.first().copied().or_else(|| {
                state.exit_order.iter().copied().find(|&i| {
                    let m = &state.members[i];
                    !m.ready || m.death.is_some()
                })
            });
            if let Some(i) = dead {
                return Some(Ok(Waited::Failed(i)));
            }
            state
                .members
                .iter()
                .all(|m| m.ready)
                .then_some(Ok(Waited::Done))
        });
        waited.unwrap_or(Ok(Waited::TimedOut))
    }

    /// The error of a worker that exited before the others were ready: its recorded
    /// death, or (one that finished after it was ready) a death made now.
    pub fn death_or_exit(&self, rank: usize) -> WorkerDeath {
        let state = self.shared.lock();
        let m = &state.members[rank];
        m.death.clone().unwrap_or_else(|| death(m, false))
    }

    /// Wait until every worker has reported ready. [`Error::WorkerDied`] as soon as one
    /// exits first; [`Error::WorkersNotReady`] naming those not ready when `timeout`
    /// passes.
    ///
    /// # Errors
    ///
    /// [`Error::WorkerDied`] as soon as a worker exits (or fails) before it is ready;
    /// [`Error::WorkersNotReady`] naming those not ready when `timeout` passes;
    /// [`Error::Core`] with `WrongRole` once the group is closing.
    pub fn wait_until_ready(&self, timeout: Duration) -> Result<()> {
        match self.wait_ready_for(Some(timeout))? {
            Waited::Done => Ok(()),
            Waited::Failed(i) => Err(Error::WorkerDied(Box::new(self.death_or_exit(i)))),
            Waited::TimedOut => Err(self.not_ready(timeout)),
        }
    }

    /// [`Error::WorkersNotReady`] for the workers not ready now.
    pub fn not_ready(&self, waited: Duration) -> Error {
        let state = self.shared.lock();
        Error::WorkersNotReady {
            waited,
            total: state.members.len(),
            not_ready: state
                .members
                .iter()
                .filter(|m| !m.ready)
                .map(|m| (m.name.clone(), m.describe()))
                .collect(),
        }
    }

    /// Wait up to `timeout` (`None`: no limit) until a worker exits, or one already has:
    /// the first to exit, with how it ended (`None` if unknown).
    ///
    /// # Errors
    ///
    /// Never fails (the `Result` keeps room for a failed wait): `Ok` with the first exit,
    /// or `None` when `timeout` passes first.
    pub fn wait_any(
        &self,
        timeout: Option<Duration>,
    ) -> Result<Option<(usize, Option<WorkerExit>)>> {
        Ok(self.wait_for(timeout, |state| {
            let &i = state.exit_order.first()?;
            Some((i, state.members[i].exit))
        }))
    }

    /// Wait up to `timeout` until every worker has exited ([`Waited::Done`]) or one has
    /// failed ([`Waited::Failed`], the first failure).
    pub fn wait_all_exited(&self, timeout: Option<Duration>) -> Waited {
        self.wait_for(timeout, |state| {
            if let Some(&i) = state.failures.first() {
                return Some(Waited::Failed(i));
            }
            state
                .members
                .iter()
                .all(|m| m.exited)
                .then_some(Waited::Done)
        })
        .unwrap_or(Waited::TimedOut)
    }

    /// Wait up to `timeout` until more than `seen` failures are recorded or the group is
    /// closing; how many there are.
    pub fn wait_failures(&self, seen: usize, timeout: Option<Duration>) -> usize {
        self.wait_for(timeout, |state| {
            (state.failures.len() > seen || state.closing).then_some(state.failures.len())
        })
        .unwrap_or(seen)
    }

    /// [`Error::WorkerDied`] for the first worker that failed (exited with a non-zero code
    /// or a signal, or before it was ready); `Ok` while none has. Does not block.
    ///
    /// # Errors
    ///
    /// [`Error::WorkerDied`] for the first worker that exited with a non-zero code or a
    /// signal, or before it was ready.
    pub fn check(&self) -> Result<()> {
        match self.failures().into_iter().next() {
            Some(death) => Err(Error::WorkerDied(Box::new(death))),
            None => Ok(()),
        }
    }

    /// Shut every worker down with the grace period of the options; see
    /// [`Workers::close_with`].
    pub fn close(&self) {
        self.close_with(self.grace)
    }

    /// Shut every worker down: [`close_begin`](Self::close_begin), the remote workers
    /// admitted by [`admit_remote`](Self::admit_remote) or
    /// [`accept_into`](link::WorkerListener::accept_into) asked to stop within `grace`
    /// over their links, then wait until `grace` has passed or every worker has exited,
    /// then [`close_finish`](Self::close_finish). Idempotent.
    pub fn close_with(&self, grace: Duration) {
        if self.close_begin() {
            self.stop_remote(grace);
            // A grace of `Duration::MAX` (none given) waits as long as any deadline can.
            self.wait_exits(shmq_core::wait::saturating_deadline(Instant::now(), grace));
            self.close_finish();
        }
    }

    /// The first step of close: no more failures are reported, the whole process trees
    /// of running workers are captured (once a worker exits, its children are reparented
    /// and can no longer be found from it), and each gets SIGTERM (its group). Remote
    /// workers are the caller's to tell ([`close_with`](Self::close_with) tells those it
    /// admitted). `false` if close had begun already.
    pub fn close_begin(&self) -> bool {
        if std::process::id() != self.owner {
            return false;
        }
        let mut state = self.shared.lock();
        if state.closing {
            return false;
        }
        state.closing = true;
        self.shared.changed.notify_all();
        poll_exits(&mut state);
        let trees = running_trees(&state);
        state.captured.extend(trees);
        for m in &state.members {
            if !m.exited && m.may_signal() {
                m.signal(libc::SIGTERM);
            }
        }
        true
    }

    /// Whether the supervisor thread records exits: in the process that made the group,
    /// while the thread runs (a forked copy has none; one that ended cannot record).
    /// Never blocks: the handle's lock is held while close joins the thread (which may
    /// want the state lock its caller holds), and then the thread is stopping anyway.
    fn supervised(&self) -> bool {
        std::process::id() == self.owner
            && self
                .thread
                .try_lock()
                .is_ok_and(|t| t.as_ref().is_some_and(|t| !t.is_finished()))
    }

    /// Wait until every started worker has exited or `deadline` passes; whether all have.
    pub fn wait_exits(&self, deadline: Instant) -> bool {
        let mut state = self.shared.lock();
        loop {
            // Before close, exits are the supervisor thread's alone: it records each with
            // its failure (and tells the monitor) in one locked step, where an exit
            // recorded here would be one without its failure, and the monitor would never
            // fire. Once closing, failures are not reported and close's waits must not
            // depend on that thread; nor may a wait where it does not run.
            if state.closing || !self.supervised() {
                poll_exits(&mut state);
            }
            let running = state
                .members
                .iter()
                .any(|m| !m.exited && m.pid.is_some() && (!m.remote || !m.host.is_empty()));
            let now = Instant::now();
            if !running {
                return true;
            }
            if now >= deadline {
                return false;
            }
            // Woken by the supervisor on each exit; the slice covers the polled ones.
            state = self
                .shared
                .changed
                .wait_timeout(state, (deadline - now).min(EXIT_POLL))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The last step of close: SIGKILL of what remains (each worker's group, the trees
    /// captured at the start, and what running workers have started since), reaping
    /// (of the workers this group started), the supervisor thread stopped, the last
    /// stderr read, and the segments the dead workers and their descendants created
    /// removed. Idempotent.
    pub fn close_finish(&self) {
        if std::process::id() != self.owner {
            return;
        }
        let _serial = self.close_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut state = self.shared.lock();
        if state.closed {
            return;
        }
        if !state.closing {
            drop(state);
            self.close_begin();
            state = self.shared.lock();
        }
        poll_exits(&mut state);
        for p in running_trees(&state) {
            if !state.captured.contains(&p) {
                state.captured.push(p);
            }
        }
        for m in &state.members {
            if m.may_signal() {
                m.signal(libc::SIGKILL);
            }
        }
        for p in &state.captured {
            if p.is_alive() {
                // SAFETY: kill(2) with plain integers; `is_alive` checked the start time, so
                // the pid still names the descendant found before.
                unsafe { libc::kill(p.pid as libc::pid_t, libc::SIGKILL) };
            }
        }
        drop(state);
        self.wait_exits(Instant::now() + KILL_WAIT);
        let mut state = self.shared.lock();
        for m in &mut state.members {
            if let (true, false, Some(pid)) = (m.reap, m.reaped, m.local_pid()) {
                let mut status = 0;
                // SAFETY: waitpid(2) of our own child, writing only `status`.
                if unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) } == pid as i32 {
                    m.reaped = true;
                }
            }
        }
        state.stopping = true;
        drop(state);
        self.shared.wake();
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            if std::thread::current().id() != thread.thread().id() {
                let _ = thread.join();
            }
        }
        // Remote workers: no more admitted, every link ended (its serving thread ends).
        self.end_admission();
        for (_, link) in &self.notices.lock().unwrap_or_else(|e| e.into_inner()).links {
            link.shutdown();
        }
        let mut state = self.shared.lock();
        // Whatever the workers still had in the pipes, then every fd.
        let mut forward = Vec::new();
        for i in 0..state.members.len() {
            drain_stderr(&mut state, i, self.shared.tail_lines, &mut forward, true);
            let m = &mut state.members[i];
            m.ready_fd = None;
            m.stderr_fd = None;
            m.exit_fd = None;
        }
        let captured = state.captured.clone();
        let mut pids: HashSet<u32> = state.members.iter().filter_map(Member::local_pid).collect();
        drop(state);
        forward_lines(self.shared.forward_stderr, &forward);
        // SIGKILL lands asynchronously: wait until the descendants are gone (or zombies),
        // so that nothing of the group runs after close returns.
        let until = Instant::now() + KILL_WAIT;
        while captured.iter().any(ProcessId::is_alive) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        for p in captured.iter().filter(|p| p.is_alive()) {
            shmq_log!(
                error,
                "process {} (a worker's descendant) did not exit after SIGKILL",
                p.pid
            );
        }
        pids.extend(captured.iter().map(|p| p.pid));
        let removed = remove_segments_of(&pids);
        if !removed.is_empty() {
            shmq_log!(
                info,
                "removed {} shared-memory segment(s) left by workers: {removed:?}",
                removed.len()
            );
        }
        let mut state = self.shared.lock();
        state.closed = true;
        self.shared.changed.notify_all();
    }
}

/// What a remote worker's admission and link tell the group, also from threads that do
/// not borrow the [`Workers`] (their `Arc<Shared>`).
impl Shared {
    /// A remote worker asks to join as `rank` with `pid`: `Ok` reserves the rank (so that
    /// two quick joins cannot both pass), `Err` says why it is refused.
    pub(crate) fn claim_remote(&self, rank: usize, pid: u32) -> std::result::Result<(), String> {
        let mut state = self.lock();
        if state.closing {
            return Err("the worker group is shutting down".to_owned());
        }
        let remote: Vec<usize> = state
            .members
            .iter()
            .filter(|m| m.remote)
            .map(|m| m.rank)
            .collect();
        match state.members.get_mut(rank) {
            Some(m) if m.remote => {
                if m.pid.is_some() || m.exited {
                    return Err(format!("rank {rank} has already joined"));
                }
                m.pid = Some(pid);
                Ok(())
            }
            _ => Err(format!(
                "rank {rank} is not a remote rank of this group (remote ranks: {remote:?})"
            )),
        }
    }

    /// Remote worker `rank` (claimed) is connected from `host`. `false`: the group is
    /// closing (drop the connection).
    pub(crate) fn remote_connected(&self, rank: usize, host: &str) -> bool {
        let mut state = self.lock();
        if state.closing {
            return false;
        }
        if let Some(m) = state.members.get_mut(rank) {
            m.host = host.to_owned();
        }
        self.changed.notify_all();
        true
    }

    /// Remote worker `rank` reported ready with `payload`.
    pub(crate) fn remote_ready(&self, rank: usize, payload: Vec<u8>) {
        let mut state = self.lock();
        if let Some(m) = state.members.get_mut(rank).filter(|m| m.remote) {
            m.ready = true;
            m.ready_payload = Some(payload);
        }
        self.changed.notify_all();
    }

    /// Worker `rank` has exited (a remote worker, or a local one that is not our own
    /// child: the caller learnt its exit), with `tail` as its last stderr lines (a
    /// remote worker sends them) and `how` replacing the exit in the message. The
    /// supervisor thread records it as it records the exits it sees.
    pub(crate) fn report_exit(
        &self,
        rank: usize,
        exit: Option<WorkerExit>,
        tail: Vec<String>,
        how: Option<String>,
    ) {
        let mut state = self.lock();
        let keep = self.tail_lines;
        if let Some(m) = state.members.get_mut(rank) {
            if m.exited || m.reported_exit.is_some() {
                return;
            }
            for line in tail {
                push_line(&mut m.tail, keep, line);
            }
            m.lost = how;
            m.reported_exit = Some(exit);
        }
        drop(state);
        self.wake();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.close();
    }
}
