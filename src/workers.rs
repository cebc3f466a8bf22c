//! Worker processes for Rust serving stacks: start them, wait until they are ready under a
//! deadline, notice at once when one dies, and shut them all down. The Rust side of the
//! Python package's `WorkerProcesses` (same behaviour, same messages), without Python.
//!
//! [`Workers::spawn`] starts one process per [`Command`]. Each worker
//! - has a **ready pipe**: it calls [`report_ready`] once its set-up is done (the pipe's
//!   fd is in [`READY_FD_ENV`], its rank in [`RANK_ENV`]);
//! - **dies with the parent**, even a SIGKILLed one (`PR_SET_PDEATHSIG`, set between fork
//!   and exec, then the parent is checked again in case it died in between). The kernel
//!   sends that signal when the *thread* that forked the worker exits: spawn workers from
//!   a thread that lives as long as they do (the main thread);
//! - **leads its own process group**, so its descendants are signalled with it and a
//!   terminal's Ctrl-C reaches only the parent, which then shuts the workers down;
//! - writes **stderr through a pipe**: forwarded to the parent's stderr prefixed
//!   `(worker 2 pid=...)`, its last lines kept for the error that names it.
//!
//! [`Workers::wait_until_ready`] fails with [`Error::WorkerDied`] as soon as a worker
//! exits first (rank, pid, exit code or signal, its last stderr lines), and with
//! [`Error::WorkersNotReady`] naming the stragglers when the deadline passes.
//! [`Workers::wait_any`] waits for the first exit; [`Workers::check`] reports a failure.
//! [`Workers::close`] (also on drop) sends SIGTERM to every worker's process group, waits
//! one shared grace period, SIGKILLs what remains (including descendants found in each
//! worker's process tree before the SIGTERM), reaps, and removes the shared-memory
//! segments the dead workers left.
//!
//! Exits are read with `waitid(WNOWAIT)`, without reaping: while a worker is an unreaped
//! child (a zombie at worst), its pid, which is also its process group's id, cannot be
//! reused, so signalling the group can only reach the worker's own descendants. Workers
//! are reaped last, in [`Workers::close`].
//!
//! ```no_run
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
//!     let mut workers = Workers::spawn((0..4).map(|_| Command::new(&exe)), WorkerOptions::default())?;
//!     workers.wait_until_ready(Duration::from_secs(60))?; // names a worker that died first
//!     // ... broadcast to them; workers.check()? between steps ...
//!     workers.close();
//! }
//! # Ok::<(), shmq::Error>(())
//! ```

use std::collections::{HashSet, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStderr, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::process::{self, ProcessId};
use crate::{liveness, segment};

/// Environment variable: the fd of a worker's ready pipe (see [`report_ready`]).
pub const READY_FD_ENV: &str = "SHMQ_READY_FD";
/// Environment variable: a worker's rank (its index in [`Workers::spawn`]'s commands).
pub const RANK_ENV: &str = "SHMQ_WORKER_RANK";
/// The grace period between SIGTERM and SIGKILL of [`WorkerOptions::default`].
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// In a worker: tell the parent that this worker's set-up is done. Only the first call
/// writes; later ones do nothing.
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
            Error::WrongRole(format!(
                "report_ready() is for worker processes started by shmq::workers::Workers \
                 ({READY_FD_ENV} is not set)"
            ))
        })?;
    // SAFETY: the parent left this fd open across exec for exactly this (`pre_exec` in
    // `Workers::spawn`), and this is its only user: `REPORTED` makes it used once, and
    // the `OwnedFd` closes it after the write.
    let pipe = unsafe { OwnedFd::from_raw_fd(fd) };
    std::fs::File::from(pipe)
        .write_all(b"R")
        .map_err(|e| Error::os("reporting ready to the parent", e))?;
    *reported = true;
    Ok(())
}

/// In a worker: watch process `pid` (its parent) from a thread of this process: once it
/// has exited, kill this process's descendants, remove what this process created (as
/// [`segment::remove_created`]) and die of SIGKILL. All of it without Python's GIL, so
/// that a worker whose main thread never lets go of it (a long call into native code)
/// still goes, and leaves neither memory nor processes behind. If `pid` is gone already,
/// that happens now. Err only if pidfds are not available (Linux before 5.3).
// Only the Python bindings (workers' bootstrap) call it.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn exit_with_process(pid: u32) -> Result<()> {
    let pidfd = match liveness::pidfd_open(pid) {
        Ok(fd) => Some(fd),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => None,
        Err(e) => return Err(Error::os(format!("watching process {pid} (pidfd_open)"), e)),
    };
    let watch = move || {
        if let Some(fd) = &pidfd {
            liveness::wait_for_exit(fd);
        }
        liveness::kill_descendants();
        segment::remove_created();
        // SAFETY: kill(2) of this process; no memory is passed.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    };
    std::thread::Builder::new()
        .name("shmq-exit-with".into())
        .spawn(watch)
        .map_err(|e| Error::os("starting the thread that watches the parent", e))?;
    Ok(())
}

/// How [`Workers`] run their processes.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// The signal a worker gets when the parent dies (default SIGKILL); `None`: workers
    /// may outlive the parent.
    pub death_signal: Option<i32>,
    /// Between SIGTERM and SIGKILL in [`Workers::close`] and on drop.
    pub grace: Duration,
    /// Copy each worker's stderr to the parent's, prefixed `(worker N pid=...)`.
    pub forward_stderr: bool,
    /// How many of its last stderr lines [`Error::WorkerDied`] shows.
    pub stderr_tail_lines: usize,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        WorkerOptions {
            death_signal: Some(libc::SIGKILL),
            grace: DEFAULT_GRACE,
            forward_stderr: true,
            stderr_tail_lines: 20,
        }
    }
}

/// How a worker ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerExit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

struct Worker {
    rank: usize,
    child: Child,
    pid: u32,
    /// Read end of the ready pipe, until the worker reported ready (or closed it).
    ready_pipe: Option<std::fs::File>,
    ready: bool,
    /// Readable when the worker exits; `None` on kernels without pidfds (then polled).
    pidfd: Option<OwnedFd>,
    exit: Option<WorkerExit>,
    reaped: bool,
    tail: Arc<Mutex<VecDeque<String>>>,
    stderr_thread: Option<JoinHandle<()>>,
}

/// A group of worker processes; see the [module documentation](self).
pub struct Workers {
    workers: Vec<Worker>,
    options: WorkerOptions,
    /// Ranks in the order they exited.
    exit_order: Vec<usize>,
    closed: bool,
}

/// How child `pid` ended, without reaping it; `None` while it runs (or if it is not our
/// unreaped child).
fn exit_status(pid: u32) -> Option<WorkerExit> {
    // SAFETY: siginfo_t is plain data; all-zero is a valid value for waitid to fill.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid(2) writes only into `info`, which outlives the call.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    // SAFETY: after a successful waitid, si_pid tells whether a child was found (0: none
    // has exited) and si_status is set for CLD_* codes.
    let (found, status) = unsafe { (info.si_pid(), info.si_status()) };
    if rc != 0 || found == 0 {
        return None;
    }
    Some(if info.si_code == libc::CLD_EXITED {
        WorkerExit::Code(status)
    } else {
        WorkerExit::Signal(status)
    })
}

/// `sig` to the process group that worker `pid` leads, or to the worker alone if it has
/// no group yet. Only while `pid` is our unreaped child (see the module documentation).
fn signal_group(pid: u32, sig: i32) {
    // SAFETY: kill(2)/killpg(2) take plain integers; an unreaped child's pid (and group id)
    // cannot name another process.
    unsafe {
        if libc::killpg(pid as libc::pid_t, sig) != 0 {
            libc::kill(pid as libc::pid_t, sig);
        }
    }
}

/// A thread that forwards a worker's stderr line by line and keeps its last lines.
fn spawn_stderr_thread(
    stderr: ChildStderr,
    prefix: String,
    tail: Arc<Mutex<VecDeque<String>>>,
    keep: usize,
    forward: bool,
) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("shmq-worker-stderr".into())
        .spawn(move || {
            let mut reader = BufReader::new(stderr);
            let mut line = Vec::new();
            while matches!(reader.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                let text = String::from_utf8_lossy(&line)
                    .trim_end_matches(['\n', '\r'])
                    .to_owned();
                line.clear();
                if forward {
                    let _ = writeln!(std::io::stderr().lock(), "{prefix}{text}");
                }
                let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                if tail.len() == keep {
                    tail.pop_front();
                }
                if keep > 0 {
                    tail.push_back(text);
                }
            }
        })
        .map_err(|e| Error::os("starting a worker's stderr thread", e))
}

impl Workers {
    /// Start one worker per command (ranks in order). If one cannot start, those already
    /// started are shut down and the error is returned.
    pub fn spawn(
        commands: impl IntoIterator<Item = Command>,
        options: WorkerOptions,
    ) -> Result<Workers> {
        let mut workers = Workers {
            workers: Vec::new(),
            options,
            exit_order: Vec::new(),
            closed: false,
        };
        for (rank, command) in commands.into_iter().enumerate() {
            let worker = workers.spawn_one(rank, command)?; // drop closes the others
            workers.workers.push(worker);
        }
        Ok(workers)
    }

    fn spawn_one(&self, rank: usize, mut command: Command) -> Result<Worker> {
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
        let death_signal = self.options.death_signal;
        command
            .env(READY_FD_ENV, ready_w_fd.to_string())
            .env(RANK_ENV, rank.to_string())
            .stderr(Stdio::piped());
        // SAFETY: the closure runs in the forked child before exec and makes only
        // async-signal-safe calls (setpgid, prctl, getppid, fcntl), allocating nothing.
        unsafe {
            command.pre_exec(move || {
                if libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(sig) = death_signal {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, sig as libc::c_ulong, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // The parent died between fork and prctl: nobody would send the signal.
                    if libc::getppid() != parent {
                        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                    }
                }
                // Keep the ready pipe's write end open across exec (in this child only).
                if libc::fcntl(ready_w_fd, libc::F_SETFD, 0) != 0 {
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
        drop(ready_w); // the child has its copy; the parent's would hide the child's EOF
        let pid = child.id();
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let stderr_thread = match child.stderr.take() {
            Some(stderr) => Some(spawn_stderr_thread(
                stderr,
                format!("(worker {rank} pid={pid}) "),
                tail.clone(),
                self.options.stderr_tail_lines,
                self.options.forward_stderr,
            )?),
            None => None,
        };
        Ok(Worker {
            rank,
            child,
            pid,
            ready_pipe: Some(std::fs::File::from(ready_r)),
            ready: false,
            pidfd: liveness::pidfd_open(pid).ok(),
            exit: None,
            reaped: false,
            tail,
            stderr_thread,
        })
    }

    /// Every worker's pid, by rank.
    pub fn pids(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.pid).collect()
    }

    /// How each worker ended, by rank (`None`: still running, as far as seen).
    pub fn exits(&self) -> Vec<Option<WorkerExit>> {
        self.workers.iter().map(|w| w.exit).collect()
    }

    /// Wait up to `timeout` for readiness reports and exits, and record them.
    fn poll(&mut self, timeout: Duration) -> Result<()> {
        let mut fds = Vec::new();
        let mut owners = Vec::new(); // (worker index, is the ready pipe)
        for (i, w) in self.workers.iter().enumerate() {
            if let Some(pipe) = &w.ready_pipe {
                fds.push(libc::pollfd {
                    fd: pipe.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
                owners.push((i, true));
            }
            if let (Some(pidfd), None) = (&w.pidfd, w.exit) {
                fds.push(libc::pollfd {
                    fd: pidfd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
                owners.push((i, false));
            }
        }
        // Without pidfds, exits are polled: wake at least every 50 ms.
        let slice = if self
            .workers
            .iter()
            .any(|w| w.pidfd.is_none() && w.exit.is_none())
        {
            timeout.min(Duration::from_millis(50))
        } else {
            timeout
        };
        let ms = slice.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs for the whole call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::os("waiting for workers", e));
            }
        }
        for (fd, &(i, is_ready_pipe)) in fds.iter().zip(&owners) {
            if fd.revents != 0 && is_ready_pipe {
                let w = &mut self.workers[i];
                let mut byte = [0u8; 1];
                // EOF (0 bytes) or an error: the worker closed it without a word; its exit
                // tells the rest.
                w.ready = matches!(
                    std::io::Read::read(w.ready_pipe.as_mut().unwrap(), &mut byte),
                    Ok(1)
                );
                w.ready_pipe = None;
            }
        }
        for i in 0..self.workers.len() {
            if self.workers[i].exit.is_none() {
                if let Some(exit) = exit_status(self.workers[i].pid) {
                    self.record_exit(i, exit);
                }
            }
        }
        Ok(())
    }

    fn record_exit(&mut self, i: usize, exit: WorkerExit) {
        let w = &mut self.workers[i];
        w.exit = Some(exit);
        w.pidfd = None;
        self.exit_order.push(i);
        if !self.closed {
            // Its descendants are orphans now: they go down with it (safe: unreaped).
            signal_group(w.pid, libc::SIGKILL);
        }
    }

    /// The error that names worker `i`, with its last stderr lines (all of them: its
    /// stderr thread gets up to a second to read what is still in the pipe).
    fn died(&mut self, i: usize) -> Error {
        let w = &mut self.workers[i];
        let deadline = Instant::now() + Duration::from_secs(1);
        while w.stderr_thread.as_ref().is_some_and(|t| !t.is_finished())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let (code, signal) = match w.exit {
            Some(WorkerExit::Code(c)) => (Some(c), None),
            Some(WorkerExit::Signal(s)) => (None, Some(s)),
            None => (None, None),
        };
        Error::WorkerDied {
            rank: w.rank,
            pid: w.pid,
            code,
            signal,
            before_ready: !w.ready,
            stderr_tail: w
                .tail
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .cloned()
                .collect(),
        }
    }

    /// Wait until every worker has called [`report_ready`]. [`Error::WorkerDied`] as soon
    /// as one exits first; [`Error::WorkersNotReady`] naming those not ready when
    /// `timeout` passes.
    pub fn wait_until_ready(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(&i) = self.exit_order.first() {
                return Err(self.died(i));
            }
            if self.workers.iter().all(|w| w.ready) {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::WorkersNotReady {
                    waited,
                    not_ready: self
                        .workers
                        .iter()
                        .filter(|w| !w.ready)
                        .map(|w| (w.rank, w.pid))
                        .collect(),
                });
            }
            self.poll(timeout - waited)?;
        }
    }

    /// Wait up to `timeout` (`None`: no limit) until a worker exits, or one already has:
    /// the first to exit, with how it ended.
    pub fn wait_any(&mut self, timeout: Option<Duration>) -> Result<Option<(usize, WorkerExit)>> {
        let start = Instant::now();
        loop {
            if let Some(&i) = self.exit_order.first() {
                return Ok(Some((i, self.workers[i].exit.unwrap())));
            }
            // One reading of the clock: two could straddle the deadline (t - elapsed
            // then underflows: it panicked in CI).
            let left = match timeout {
                Some(t) => match t.checked_sub(start.elapsed()) {
                    Some(left) if !left.is_zero() => left,
                    _ => return Ok(None),
                },
                None => Duration::from_secs(3600),
            };
            self.poll(left)?;
        }
    }

    /// [`Error::WorkerDied`] for the first worker that exited with a non-zero code or a
    /// signal (or exited before it was ready); `Ok` while none has. Does not block.
    pub fn check(&mut self) -> Result<()> {
        self.poll(Duration::ZERO)?;
        let failed = self.exit_order.iter().copied().find(|&i| {
            let w = &self.workers[i];
            !w.ready || w.exit != Some(WorkerExit::Code(0))
        });
        match failed {
            Some(i) => Err(self.died(i)),
            None => Ok(()),
        }
    }

    /// Shut every worker down with the grace period of the options; see
    /// [`Workers::close_with`].
    pub fn close(&mut self) {
        self.close_with(self.options.grace)
    }

    /// Shut every worker down: SIGTERM to each worker's process group, one shared deadline
    /// `grace` away, then SIGKILL of what remains, including the descendants found in each
    /// worker's process tree before the SIGTERM; reap; remove the shared-memory segments
    /// the dead workers and their descendants created. Idempotent.
    pub fn close_with(&mut self, grace: Duration) {
        if self.closed {
            return;
        }
        self.closed = true;
        let _ = self.poll(Duration::ZERO);
        let running: Vec<u32> = self
            .workers
            .iter()
            .filter(|w| w.exit.is_none())
            .map(|w| w.pid)
            .collect();
        // Whole trees, before anyone is signalled: once a worker exits, its children are
        // reparented and can no longer be found from it.
        let trees: Vec<ProcessId> = running
            .iter()
            .flat_map(|&pid| process::descendants(pid))
            .collect();
        for &pid in &running {
            signal_group(pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while self.workers.iter().any(|w| w.exit.is_none()) {
            let now = Instant::now();
            if now >= deadline || self.poll(deadline - now).is_err() {
                break;
            }
        }
        for w in &self.workers {
            if !w.reaped {
                signal_group(w.pid, libc::SIGKILL);
            }
        }
        for p in &trees {
            if p.is_alive() {
                // SAFETY: kill(2) with plain integers; `is_alive` checked the start time, so
                // the pid still names the descendant found above.
                unsafe { libc::kill(p.pid as libc::pid_t, libc::SIGKILL) };
            }
        }
        for w in &mut self.workers {
            if let Ok(status) = w.child.wait() {
                use std::os::unix::process::ExitStatusExt;
                w.reaped = true;
                w.exit.get_or_insert(match status.signal() {
                    Some(s) => WorkerExit::Signal(s),
                    None => WorkerExit::Code(status.code().unwrap_or(-1)),
                });
            }
        }
        // Descendants outside a worker's group may take a moment to die; then their stderr
        // copies close and the forwarding threads end.
        let until = Instant::now() + Duration::from_secs(5);
        while trees.iter().any(ProcessId::is_alive) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        for w in &mut self.workers {
            if w.stderr_thread.as_ref().is_some_and(|t| t.is_finished()) {
                let _ = w.stderr_thread.take().map(JoinHandle::join);
            }
        }
        let pids: HashSet<u32> = self
            .workers
            .iter()
            .map(|w| w.pid)
            .chain(trees.iter().map(|p| p.pid))
            .collect();
        if let Ok(segments) = crate::admin::list_segments() {
            for s in segments {
                let dead = s.creator_liveness == liveness::Liveness::Dead;
                if dead && s.creator.is_some_and(|c| pids.contains(&c.pid)) {
                    let path = format!("{}/{}", segment::SHM_DIR, s.name);
                    let _ = std::fs::remove_file(&path);
                    // A ring's local socket lives in a directory beside it.
                    let _ = std::fs::remove_dir_all(format!(
                        "{path}{}",
                        crate::transport::SOCKET_DIR_SUFFIX
                    ));
                }
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.close();
    }
}
