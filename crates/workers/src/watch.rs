//! The supervisor's side of [`Workers`](super::Workers): the state under its lock, the
//! thread that polls every worker's fds, and what it does with what they say (ready
//! frames, stderr lines, exits), plus the process calls the shutdown needs.

use std::collections::{HashSet, VecDeque};
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::{StderrCapture, WorkerDeath, WorkerExit, WorkerStatus, EXIT_POLL, MAX_READY_PAYLOAD};
use shmq_os::process::{self, ProcessId};
use shmq_os::{liveness, segment_file};

/// What a worker's ready pipe carries: frames of a 4-byte big-endian word and a payload.
/// A word without [`NOTICE_FLAG`] is the ready report (its payload's length, once); one
/// with it is a death notice (the payload's length in the other bits), after which the
/// worker writes nothing more. A notice's payload is UTF-8 text: the exit code the
/// worker is about to exit with, a newline, and the last lines of its traceback.
#[derive(Default)]
pub(super) struct ReadyFrame {
    pub(super) bytes: Vec<u8>,
}

/// The bit of a frame's length word that makes it a death notice (a ready report's
/// length, at most [`MAX_READY_PAYLOAD`], never has it).
pub(super) const NOTICE_FLAG: u32 = 1 << 31;
/// The longest death notice's payload; a longer one is ignored (the exit still tells).
pub(super) const MAX_NOTICE: usize = 64 << 10;

/// A frame read whole from a worker's ready pipe.
enum Frame {
    Ready(Vec<u8>),
    Notice(Vec<u8>),
    /// Longer than the protocol allows: the pipe is closed, the frame ignored.
    TooLong,
}

impl ReadyFrame {
    /// The next whole frame, taken out of the buffer; `None` until one has come whole.
    fn take(&mut self) -> Option<Frame> {
        let word = u32::from_be_bytes(self.bytes.get(..4)?.try_into().ok()?);
        let notice = word & NOTICE_FLAG != 0;
        let len = (word & !NOTICE_FLAG) as usize;
        let limit = if notice {
            MAX_NOTICE
        } else {
            MAX_READY_PAYLOAD
        };
        if len > limit {
            return Some(Frame::TooLong);
        }
        let payload = self.bytes.get(4..4 + len)?.to_vec();
        self.bytes.drain(..4 + len);
        Some(if notice {
            Frame::Notice(payload)
        } else {
            Frame::Ready(payload)
        })
    }
}

/// A worker's death notice: it raised, printed its traceback, and is exiting with `exit`
/// (its interpreter's teardown, which can take a while, has yet to run).
#[derive(Clone, Debug)]
pub(super) struct Notice {
    pub(super) exit: WorkerExit,
    /// The traceback's last lines (the error's tail when its stderr pipe had none).
    pub(super) lines: Vec<String>,
}

impl Notice {
    fn parse(payload: &[u8], keep: usize) -> Notice {
        let text = String::from_utf8_lossy(payload);
        let mut lines = text.lines();
        let code = lines
            .next()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or(1);
        let lines: Vec<String> = lines.map(str::to_owned).collect();
        let skip = lines.len().saturating_sub(keep);
        Notice {
            exit: WorkerExit::from_exitcode(code),
            lines: lines.into_iter().skip(skip).collect(),
        }
    }
}

/// One worker, as the supervisor knows it.
pub(super) struct Member {
    pub(super) rank: usize,
    pub(super) name: String,
    pub(super) pid: Option<u32>,
    pub(super) host: String,
    pub(super) remote: bool,
    pub(super) own_child: bool,
    pub(super) own_group: bool,
    pub(super) reap: bool,
    pub(super) reaped: bool,
    pub(super) ready: bool,
    pub(super) ready_payload: Option<Vec<u8>>,
    pub(super) exited: bool,
    pub(super) exit: Option<WorkerExit>,
    /// Set by [`super::Workers::report_exit`] until the supervisor thread takes it.
    pub(super) reported_exit: Option<Option<WorkerExit>>,
    pub(super) lost: Option<String>,
    pub(super) death: Option<WorkerDeath>,
    pub(super) tail: VecDeque<String>,
    pub(super) partial: Vec<u8>,
    pub(super) capture: StderrCapture,
    pub(super) ready_fd: Option<OwnedFd>,
    pub(super) ready_frame: ReadyFrame,
    /// Its death notice, once it has sent one (before its exit).
    pub(super) notice: Option<Notice>,
    pub(super) stderr_fd: Option<OwnedFd>,
    /// Readable when the worker exits; `None` on kernels without pidfds (then polled),
    /// and for workers whose exit is reported.
    pub(super) exit_fd: Option<OwnedFd>,
}

impl Member {
    pub(super) fn describe(&self) -> String {
        match (self.remote, self.pid) {
            (false, Some(pid)) => format!("{} (rank {}, pid {pid})", self.name, self.rank),
            (false, None) => format!("{} (rank {}, not started)", self.name, self.rank),
            (true, Some(pid)) => format!("{} (rank {}, remote, pid {pid})", self.name, self.rank),
            (true, None) => format!("{} (rank {}, remote, not connected)", self.name, self.rank),
        }
    }

    pub(super) fn status(&self) -> WorkerStatus {
        WorkerStatus {
            name: self.name.clone(),
            rank: self.rank,
            pid: self.pid,
            host: self.host.clone(),
            ready: self.ready,
            exited: self.exited,
            exit: self.exit,
        }
    }

    pub(super) fn local_pid(&self) -> Option<u32> {
        self.pid.filter(|_| !self.remote)
    }

    /// Whether signalling its pid (or group) can only reach its processes.
    pub(super) fn may_signal(&self) -> bool {
        match self.local_pid() {
            None => false,
            Some(_) if self.reaped => false,
            Some(pid) if self.own_child => unreaped(pid),
            Some(_) => !self.exited,
        }
    }

    pub(super) fn signal(&self, sig: i32) {
        if let Some(pid) = self.local_pid() {
            signal_group(pid, sig, self.own_group);
        }
    }
}

pub(super) struct State {
    pub(super) members: Vec<Member>,
    /// Ranks in the order they exited.
    pub(super) exit_order: Vec<usize>,
    /// Ranks of the failures, in the order they were recorded.
    pub(super) failures: Vec<usize>,
    pub(super) closing: bool,
    pub(super) closed: bool,
    pub(super) stopping: bool,
    /// Pids of descendants captured by close (their segments are removed too).
    pub(super) captured: Vec<ProcessId>,
}

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    pub(super) changed: Condvar,
    /// Wakes the supervisor thread (an eventfd).
    pub(super) wake: OwnedFd,
    pub(super) forward_stderr: bool,
    pub(super) tail_lines: usize,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: write(2) of 8 bytes from a live u64 into our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

/// How child `pid` ended, without reaping it: `Ok(None)` while it runs; `Err` if it is
/// not our unreaped child.
pub(super) fn exit_status(pid: u32) -> std::io::Result<Option<WorkerExit>> {
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
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: after a successful waitid, si_pid tells whether a child was found (0: none
    // has exited) and si_status is set for CLD_* codes.
    let (found, status) = unsafe { (info.si_pid(), info.si_status()) };
    if found == 0 {
        return Ok(None);
    }
    Ok(Some(if info.si_code == libc::CLD_EXITED {
        WorkerExit::Code(status)
    } else {
        WorkerExit::Signal(status)
    }))
}

/// Whether `pid` is our child and not reaped yet (running, or a zombie).
pub(super) fn unreaped(pid: u32) -> bool {
    exit_status(pid).is_ok()
}

/// `sig` to the process group that worker `pid` leads (when `own_group`), or to the
/// worker alone (also when it has no group yet). Only while `pid` is our unreaped child,
/// or a running one (see the module documentation).
pub(super) fn signal_group(pid: u32, sig: i32, own_group: bool) {
    // SAFETY: kill(2)/killpg(2) take plain integers; an unreaped child's pid (and group id)
    // cannot name another process.
    unsafe {
        if !own_group || libc::killpg(pid as libc::pid_t, sig) != 0 {
            libc::kill(pid as libc::pid_t, sig);
        }
    }
}

pub(super) fn set_nonblocking(fd: &OwnedFd) {
    // SAFETY: fcntl(2) on a descriptor we own; no memory is passed.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
    }
}

/// One `read(2)` of a non-blocking fd: `Some(n)` bytes (0: EOF or an error), `None`:
/// nothing there now.
pub(super) fn read_some(fd: &OwnedFd, buf: &mut [u8]) -> Option<usize> {
    loop {
        // SAFETY: read(2) into `buf`, which is valid for `buf.len()` bytes.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            return Some(n as usize);
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return None,
            _ => return Some(0),
        }
    }
}

/// Every descendant of the local workers still running (whole trees: once a worker
/// exits, its children are reparented and can no longer be found from it).
pub(super) fn running_trees(state: &State) -> Vec<ProcessId> {
    state
        .members
        .iter()
        .filter(|m| !m.exited)
        .filter_map(Member::local_pid)
        .flat_map(process::descendants)
        .collect()
}

/// Remove the shmq segments (and rings' socket directories) created by dead processes
/// in `pids`; their names.
pub(super) fn remove_segments_of(pids: &HashSet<u32>) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(segments) = shmq_core::admin::list_segments() else {
        return removed;
    };
    for s in segments {
        let dead = s.creator_liveness == liveness::Liveness::Dead;
        if dead && s.creator.is_some_and(|c| pids.contains(&c.pid)) {
            let path = segment_file::path(&s.name);
            match segment_file::unlink(&s.name) {
                Ok(()) => removed.push(s.name.clone()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => warn_user!("could not remove {path}: {e}"),
            }
            // A ring's local socket lives in a directory beside it.
            shmq_core::admin::remove_socket_dirs_of(&s.name);
        }
    }
    removed
}

pub(super) fn push_line(tail: &mut VecDeque<String>, keep: usize, line: String) {
    if keep == 0 {
        return;
    }
    if tail.len() == keep {
        tail.pop_front();
    }
    tail.push_back(line);
}

/// Read what member `i` wrote to stderr and is in the pipe now (the whole pipe: the
/// caller reads again when the fd is readable), keep its lines, and add them, prefixed,
/// to `forward`. At EOF (every copy of the write end closed) the fd is closed; then, and
/// when the worker has exited (`last`), a last partial line is kept too.
pub(super) fn drain_stderr(
    state: &mut State,
    i: usize,
    keep: usize,
    forward: &mut Vec<u8>,
    last: bool,
) {
    let m = &mut state.members[i];
    let mut buf = [0u8; 65536];
    let mut eof = false;
    while let Some(fd) = &m.stderr_fd {
        match read_some(fd, &mut buf) {
            None => break,
            Some(0) => {
                m.stderr_fd = None;
                eof = true;
            }
            Some(n) => m.partial.extend_from_slice(&buf[..n]),
        }
    }
    let prefix = format!("({} pid={}) ", m.name, m.pid.unwrap_or(0));
    let mut lines: Vec<Vec<u8>> = Vec::new();
    while let Some(nl) = m.partial.iter().position(|&b| b == b'\n') {
        let rest = m.partial.split_off(nl + 1);
        lines.push(std::mem::replace(&mut m.partial, rest));
    }
    if (eof || last) && !m.partial.is_empty() {
        lines.push(std::mem::take(&mut m.partial));
    }
    for line in lines {
        let text = String::from_utf8_lossy(&line)
            .trim_end_matches('\n')
            .trim_end_matches('\r')
            .to_owned();
        forward.extend_from_slice(prefix.as_bytes());
        forward.extend_from_slice(text.as_bytes());
        forward.push(b'\n');
        push_line(&mut m.tail, keep, text);
    }
}

/// Copy forwarded lines to this process's fd 2 (one write per batch: lines of workers
/// do not interleave).
pub(super) fn forward_lines(forward: bool, bytes: &[u8]) {
    if forward && !bytes.is_empty() {
        let _ = std::io::stderr().lock().write_all(bytes);
    }
}

/// Read member `i`'s ready pipe as far as it has come: its ready report, then (if it
/// raises) its death notice, after which the pipe is closed; also at EOF, or at a frame
/// too long. Whether it became ready. `keep`: how many of a notice's lines to keep.
pub(super) fn read_ready(state: &mut State, i: usize, keep: usize) -> bool {
    let m = &mut state.members[i];
    let mut changed = false;
    let mut buf = [0u8; 65536];
    while let Some(fd) = &m.ready_fd {
        match read_some(fd, &mut buf) {
            None => break,
            Some(0) => {
                // Closed without a (whole) word: its exit tells the rest.
                m.ready_fd = None;
            }
            Some(n) => m.ready_frame.bytes.extend_from_slice(&buf[..n]),
        }
        while let Some(frame) = m.ready_frame.take() {
            match frame {
                Frame::Ready(payload) if !m.ready => {
                    m.ready_payload = Some(payload);
                    m.ready = true;
                    changed = true;
                }
                Frame::Ready(_) => {} // a second report says nothing new
                Frame::Notice(payload) => {
                    m.notice = Some(Notice::parse(&payload, keep));
                    m.ready_fd = None;
                    break;
                }
                Frame::TooLong => {
                    m.ready_fd = None;
                    break;
                }
            }
        }
        if m.ready_fd.is_none() {
            m.ready_frame.bytes = Vec::new();
        }
    }
    changed
}

/// The death of member `m`, as it stands.
pub(super) fn death(m: &Member, failed: bool) -> WorkerDeath {
    WorkerDeath {
        name: m.name.clone(),
        rank: m.rank,
        pid: m.pid,
        host: m.host.clone(),
        // Before its exit, a death notice says what the exit will be.
        exit: m.exit.or(m.notice.as_ref().map(|n| n.exit)),
        before_ready: failed && !m.ready,
        how: m.lost.clone(),
        stderr_tail: match &m.notice {
            // Nothing in its stderr pipe (not captured; or the traceback went to a
            // `sys.stderr` that is not fd 2): the traceback it sent is the tail.
            Some(n) if m.tail.is_empty() => n.lines.clone(),
            _ => m.tail.iter().cloned().collect(),
        },
        stderr: if m.remote {
            StderrCapture::FromStart
        } else {
            m.capture
        },
    }
}

pub(super) fn set_exited(state: &mut State, i: usize, exit: Option<WorkerExit>) {
    let m = &mut state.members[i];
    if !m.exited {
        m.exited = true;
        m.exit = m.exit.or(exit);
        m.exit_fd = None;
        state.exit_order.push(i);
    }
}

/// Record the exits of local own children that have exited (never reaps): for close,
/// whose waits must not depend on the supervisor thread.
pub(super) fn poll_exits(state: &mut State) {
    for i in 0..state.members.len() {
        let m = &state.members[i];
        if m.exited || !m.own_child {
            continue;
        }
        let Some(pid) = m.local_pid() else { continue };
        match exit_status(pid) {
            Ok(None) => {}
            Ok(Some(exit)) => set_exited(state, i, Some(exit)),
            Err(_) => set_exited(state, i, None), // reaped by someone else
        }
    }
}

/// Member `i` has exited: take what it wrote, its ready report if it came in the same
/// round, its status; its descendants go down with it; the failure is recorded (with the
/// exit, in one locked step, so that a waiter sees the error with its whole tail).
pub(super) fn on_exit(
    shared: &Shared,
    state: &mut State,
    i: usize,
    exit: Option<WorkerExit>,
    forward: &mut Vec<u8>,
) {
    drain_stderr(state, i, shared.tail_lines, forward, true);
    // Its ready report and its exit came in one poll: the report was sent first.
    read_ready(state, i, shared.tail_lines);
    let m = &state.members[i];
    if !state.closing && m.own_child && m.own_group && m.local_pid().is_some_and(unreaped) {
        // Its descendants are orphans now: they go down with it. Safe while it is our
        // unreaped zombie (its pid, the group's id, cannot be reused meanwhile).
        m.signal(libc::SIGKILL);
    }
    set_exited(state, i, exit);
    let m = &mut state.members[i];
    m.ready_fd = None;
    if state.closing || m.death.is_some() {
        return;
    }
    if m.ready && m.exit == Some(WorkerExit::Code(0)) && m.lost.is_none() {
        return; // a worker that finished its work
    }
    m.death = Some(death(m, true));
    state.failures.push(i);
}

/// Member `i` has sent a death notice (it raised, and its interpreter is tearing down):
/// its failure is recorded now, with the traceback it wrote to stderr before the notice
/// (so already in the pipe), instead of when its exit comes. Nothing while closing, or
/// once its failure or exit is recorded.
pub(super) fn on_notice(shared: &Shared, state: &mut State, i: usize, forward: &mut Vec<u8>) {
    let m = &state.members[i];
    if state.closing || m.exited || m.death.is_some() || m.notice.is_none() {
        return;
    }
    drain_stderr(state, i, shared.tail_lines, forward, false);
    let m = &mut state.members[i];
    m.death = Some(death(m, true));
    state.failures.push(i);
}

/// The supervisor thread: one poll over every worker's fds, until close stops it.
pub(super) fn supervise(shared: &Shared) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut owners: Vec<(usize, u8)> = Vec::new(); // (member, 0 ready / 1 stderr / 2 exit)
    loop {
        fds.clear();
        owners.clear();
        fds.push(libc::pollfd {
            fd: shared.wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        let poll_exits_too;
        {
            let state = shared.lock();
            if state.stopping {
                return;
            }
            for (i, m) in state.members.iter().enumerate() {
                for (kind, fd) in [(0u8, &m.ready_fd), (1, &m.stderr_fd), (2, &m.exit_fd)] {
                    if let Some(fd) = fd {
                        fds.push(libc::pollfd {
                            fd: fd.as_raw_fd(),
                            events: libc::POLLIN,
                            revents: 0,
                        });
                        owners.push((i, kind));
                    }
                }
            }
            poll_exits_too = state.members.iter().any(|m| {
                !m.exited && m.own_child && m.exit_fd.is_none() && m.local_pid().is_some()
            });
        }
        let ms = if poll_exits_too {
            EXIT_POLL.as_millis() as i32
        } else {
            -1
        };
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs for the whole call.
        // Its descriptors stay open meanwhile: only this thread closes members' fds while
        // it runs (close_finish closes them after joining it).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            shmq_log!(
                error,
                "worker supervisor: poll failed: {}",
                std::io::Error::last_os_error()
            );
            std::thread::sleep(EXIT_POLL);
            continue;
        }
        if fds[0].revents != 0 {
            let mut count = 0u64;
            // SAFETY: read(2) of 8 bytes into a live u64 from our eventfd.
            unsafe { libc::read(shared.wake.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        }
        let mut forward = Vec::new();
        let mut state = shared.lock();
        let mut changed = false;
        let mut exited: Vec<usize> = Vec::new();
        let mut notices: Vec<usize> = Vec::new();
        for (fd, &(i, kind)) in fds[1..].iter().zip(&owners) {
            if fd.revents == 0 {
                continue;
            }
            match kind {
                0 => {
                    changed |= read_ready(&mut state, i, shared.tail_lines);
                    notices.push(i);
                }
                1 => drain_stderr(&mut state, i, shared.tail_lines, &mut forward, false),
                _ => exited.push(i),
            }
        }
        // After every fd of the round was read: a notice's traceback is in its stderr pipe.
        for i in notices {
            let failures = state.failures.len();
            on_notice(shared, &mut state, i, &mut forward);
            changed |= state.failures.len() > failures;
        }
        for i in 0..state.members.len() {
            let m = &state.members[i];
            if m.exited {
                continue;
            }
            let polled = m.own_child && m.exit_fd.is_none() && m.local_pid().is_some();
            if exited.contains(&i) || polled {
                match m.local_pid().map(exit_status) {
                    Some(Ok(None)) => {
                        // A pidfd is readable only at exit; should one say so early, poll.
                        state.members[i].exit_fd = None;
                        continue;
                    }
                    Some(Ok(Some(exit))) => {
                        on_exit(shared, &mut state, i, Some(exit), &mut forward)
                    }
                    _ => on_exit(shared, &mut state, i, None, &mut forward),
                }
                changed = true;
            } else if let Some(exit) = state.members[i].reported_exit.take() {
                on_exit(shared, &mut state, i, exit, &mut forward);
                changed = true;
            }
        }
        if changed {
            shared.changed.notify_all();
        }
        drop(state);
        forward_lines(shared.forward_stderr, &forward);
    }
}
