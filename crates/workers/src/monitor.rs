//! A worker's failure, told to the others and to the parent's blocked calls: the
//! parent's [`Monitor`] ([`Workers::monitor`]) and the worker's [`sibling_failure`].
//!
//! As the Python package's `WorkerProcesses.monitor(...)`: when a worker fails (a
//! non-zero exit code or a signal, an exit before it was ready, a remote worker's lost
//! link; not a worker that finished with code 0 after it was ready), the group's first
//! failure is told to every other worker *first*, then the monitor runs what it was
//! given (a queue writer's [`Canceller`]: its blocked calls end with
//! `QueueError::ShutDown`, and its local readers get the queue's end), so that a worker
//! whose queue ends can tell why.
//!
//! How a worker is told: a worker of [`Workers::spawn`] has a **notice pipe**, whose
//! read end's fd is in [`NOTICE_FD_ENV`]; the parent writes one frame into it, a 4-byte
//! big-endian length and a JSON payload (the same frame and payload as a Python
//! parent's, see [`SiblingFailure::notice`]), in one write of at most `PIPE_BUF` bytes.
//! A remote worker admitted with [`WorkerListener::accept_into`](crate::link::WorkerListener::accept_into)
//! hears the same payload on its link ([`ParentMessage::SiblingFailed`](crate::link::ParentMessage::SiblingFailed)).
//! In the worker, [`sibling_failure`] (Rust) or `shmq.workers.sibling_failure()`
//! (Python) reads it.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};
use shmq_core::broadcast::Canceller;

use crate::link::{Kind, LinkSender};
use crate::watch::Shared;
use crate::{Error, Result, WorkerDeath, WorkerExit, Workers};

/// Environment variable: the fd of the read end of a worker's notice pipe (workers of
/// [`Workers::spawn`]), on which the parent tells of a sibling's failure.
pub const NOTICE_FD_ENV: &str = "SHMQ_NOTICE_FD";

/// The longest notice the parent writes: one write of at most `PIPE_BUF` (4096) bytes,
/// its 4-byte length included, is atomic and never waits on an empty pipe (as the
/// Python parent's).
pub const NOTICE_LIMIT: usize = 4000;

/// Another worker's failure, as the parent told it ([`sibling_failure`],
/// [`SiblingFailure::from_notice`]). Its text is the parent's own message (a
/// [`WorkerDeath`]'s).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiblingFailure {
    pub name: String,
    pub rank: usize,
    /// `None`: a remote worker that never said.
    pub pid: Option<u32>,
    /// `""` for a local worker.
    pub host: String,
    /// `None`: unknown.
    pub exit: Option<WorkerExit>,
    pub before_ready: bool,
    /// Its last stderr lines (the oldest left out where the notice would be too long).
    pub stderr_tail: Vec<String>,
    /// The parent's message (cut where the notice would be too long).
    pub message: String,
}

impl std::fmt::Display for SiblingFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SiblingFailure {}

impl SiblingFailure {
    /// The notice of `death` as the parent sends it, at most `limit` bytes: JSON of its
    /// fields and message, the oldest stderr lines left out first, then the message cut
    /// (the Python package's `failure_notice`).
    pub fn notice(death: &WorkerDeath, limit: usize) -> Vec<u8> {
        let mut tail = death.stderr_tail.clone();
        let mut message = death.to_string();
        loop {
            let payload = json!({
                "name": death.name,
                "rank": death.rank,
                "pid": death.pid,
                "exitcode": death.exit.map(WorkerExit::exitcode),
                "host": death.host,
                "before_ready": death.before_ready,
                "stderr_tail": tail,
                "message": message,
            })
            .to_string()
            .into_bytes();
            if payload.len() <= limit {
                return payload;
            }
            if !tail.is_empty() {
                tail.remove(0);
            } else if message.is_empty() {
                return payload; // a name longer than the limit: nothing left to cut
            } else {
                let over = payload.len() - limit;
                let mut keep = message.len().saturating_sub(over + 1);
                while !message.is_char_boundary(keep) {
                    keep -= 1;
                }
                message.truncate(keep);
            }
        }
    }

    /// The failure a notice carries (from a Rust or a Python parent); `None` for one
    /// that is not.
    pub fn from_notice(payload: &[u8]) -> Option<SiblingFailure> {
        let f: Value = serde_json::from_slice(payload).ok()?;
        let int = |key: &str| -> Option<Option<i64>> {
            match f.get(key)? {
                Value::Null => Some(None),
                v => v.as_i64().map(Some),
            }
        };
        let exit = int("exitcode")?
            .map(|c| i32::try_from(c).ok().map(WorkerExit::from_exitcode))
            .map_or(Some(None), |e| e.map(Some))?;
        let pid = int("pid")?
            .map(|p| u32::try_from(p).ok())
            .map_or(Some(None), |p| p.map(Some))?;
        Some(SiblingFailure {
            name: f.get("name")?.as_str()?.to_owned(),
            rank: usize::try_from(f.get("rank")?.as_u64()?).ok()?,
            pid,
            host: f.get("host")?.as_str()?.to_owned(),
            exit,
            before_ready: f.get("before_ready")?.as_bool()?,
            stderr_tail: f
                .get("stderr_tail")?
                .as_array()?
                .iter()
                .map(|l| l.as_str().map_or_else(|| l.to_string(), str::to_owned))
                .collect(),
            message: f.get("message")?.as_str()?.to_owned(),
        })
    }
}

// -- the worker's side ------------------------------------------------------------------

struct Told {
    /// The notice pipe, once taken from the environment (`None` inside: none, or closed).
    pipe: Option<Option<OwnedFd>>,
    failure: Option<SiblingFailure>,
}

static TOLD: Mutex<Told> = Mutex::new(Told {
    pipe: None,
    failure: None,
});

/// In a worker of [`Workers::spawn`]: the failure of another worker of its group, as the
/// parent told it (the group's first), or `None` while it has told of none (and in any
/// other process). Does not block.
///
/// The parent tells when a [`Monitor`] is open (or [`Workers::tell_siblings`] is
/// called), before the monitor shuts its writers down: a worker whose `dequeue` ends
/// with `QueueError::ShutDown` calls this to tell "the parent stopped because `Worker_2`
/// died" from a plain shutdown. The first call takes the notice pipe ([`NOTICE_FD_ENV`],
/// made close-on-exec from then on, so a child this worker starts later does not
/// inherit it); a descriptor there that is not the read end of a pipe is left alone.
pub fn sibling_failure() -> Option<SiblingFailure> {
    let mut told = TOLD.lock().unwrap_or_else(|e| e.into_inner());
    if told.failure.is_some() {
        return told.failure.clone();
    }
    let pipe = told.pipe.get_or_insert_with(take_notice_pipe);
    let fd = pipe.as_ref()?;
    let mut poll = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll(2) of one pollfd we own, not waiting.
    if unsafe { libc::poll(&mut poll, 1, 0) } != 1 {
        return None;
    }
    // The frame came in one write (at most PIPE_BUF bytes): all of it is there.
    let mut file = std::mem::ManuallyDrop::new(
        // SAFETY: a File over our fd, never dropped (the OwnedFd keeps owning it).
        unsafe { std::fs::File::from_raw_fd(fd.as_raw_fd()) },
    );
    let mut length = [0u8; 4];
    let read = file.read_exact(&mut length).and_then(|()| {
        let n = u32::from_be_bytes(length) as usize;
        if n > 64 << 10 {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        let mut payload = vec![0; n];
        file.read_exact(&mut payload).map(|()| payload)
    });
    match read {
        Ok(payload) => {
            told.failure = SiblingFailure::from_notice(&payload);
            told.failure.clone()
        }
        Err(_) => {
            // The parent closed its end (or sent what is no notice): nothing more comes.
            told.pipe = Some(None);
            None
        }
    }
}

/// The read end of the notice pipe named by [`NOTICE_FD_ENV`], made close-on-exec; `None`
/// without one.
fn take_notice_pipe() -> Option<OwnedFd> {
    let fd: RawFd = std::env::var(NOTICE_FD_ENV).ok()?.parse().ok()?;
    // SAFETY: fstat(2) and fcntl(2) of an integer fd, writing only `stat`.
    unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut stat) != 0 || stat.st_mode & libc::S_IFMT != libc::S_IFIFO {
            return None;
        }
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || flags & libc::O_ACCMODE != libc::O_RDONLY {
            return None;
        }
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        // The parent left this fd open across exec for this (`Workers::spawn`), and this
        // is its only taker (`TOLD` takes it once).
        Some(OwnedFd::from_raw_fd(fd))
    }
}

// -- the parent's side ------------------------------------------------------------------

/// Where the parent tells of a failure: the write ends of its spawned workers' notice
/// pipes, and its admitted remote workers' links.
#[derive(Default)]
pub(crate) struct Notices {
    pub(crate) pipes: Vec<(usize, OwnedFd)>,
    pub(crate) links: Vec<(usize, LinkSender)>,
    told: bool,
}

/// Every failure so far, in order.
fn failures(shared: &Shared) -> Vec<WorkerDeath> {
    let state = shared.lock();
    state
        .failures
        .iter()
        .filter_map(|&i| state.members[i].death.clone())
        .collect()
}

/// [`Workers::tell_siblings`], for the monitor's thread.
pub(crate) fn tell_siblings(shared: &Shared, notices: &Mutex<Notices>) -> Vec<WorkerDeath> {
    let deaths = failures(shared);
    let Some(first) = deaths.first() else {
        return deaths;
    };
    let payload = SiblingFailure::notice(first, NOTICE_LIMIT);
    let mut frame = u32::try_from(payload.len())
        .unwrap_or(u32::MAX)
        .to_be_bytes()
        .to_vec();
    frame.extend_from_slice(&payload);
    let links: Vec<LinkSender> = {
        let mut n = notices.lock().unwrap_or_else(|e| e.into_inner());
        if n.told {
            return deaths;
        }
        n.told = true;
        for (rank, fd) in &n.pipes {
            if *rank != first.rank {
                write_without_sigpipe(fd.as_raw_fd(), &frame);
            }
        }
        n.links
            .iter()
            .filter(|(rank, _)| *rank != first.rank)
            .map(|(_, link)| link.clone())
            .collect()
    };
    // Outside the lock: a link's write may wait on its connection.
    for link in links {
        let _ = link.send(Kind::SiblingFailed.byte(), &payload);
    }
    deaths
}

/// Write `frame` into the non-blocking write end `fd` of a notice pipe, at most once,
/// never raising `SIGPIPE` in the host process: a worker that has exited closed the read
/// end, and a write then raises `SIGPIPE`, which kills a host program that did not ignore
/// it (Rust programs and Python do; a C program embedding this library need not). The
/// signal is blocked in this thread around the write and, if the write raised it, taken
/// (`sigtimedwait` with a zero timeout) before the thread's mask is restored: no
/// process-wide change, nothing left pending.
fn write_without_sigpipe(fd: std::os::fd::RawFd, frame: &[u8]) {
    // SAFETY: sigset_t is plain data; all-zero bytes are valid storage for sigemptyset.
    let mut pipe_only: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: sigemptyset/sigaddset write into our own set; pthread_sigmask changes only
    // this thread's mask and saves the old one, restored below on every path.
    let blocked = unsafe {
        libc::sigemptyset(&mut pipe_only);
        libc::sigaddset(&mut pipe_only, libc::SIGPIPE);
        libc::pthread_sigmask(libc::SIG_BLOCK, &pipe_only, &mut old) == 0
    };
    // SAFETY: write(2) of a live buffer into our pipe's non-blocking write end, empty
    // (this is its one frame): it never waits. A worker gone: EPIPE, and SIGPIPE pending
    // on this thread (blocked above).
    let n = unsafe { libc::write(fd, frame.as_ptr().cast(), frame.len()) };
    let broken = n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPIPE);
    if blocked {
        if broken {
            let zero = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: takes the SIGPIPE this write left pending on this thread (if the
            // thread's own mask had not blocked it before, nothing else could have taken
            // it); a zero timeout never waits.
            unsafe { libc::sigtimedwait(&pipe_only, std::ptr::null_mut(), &zero) };
        }
        // SAFETY: restores this thread's mask saved above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
}

type Action = Box<dyn FnOnce(&WorkerDeath) + Send>;

#[derive(Default)]
struct Fired {
    error: Option<WorkerDeath>,
    actions: Vec<Action>,
}

struct MonitorInner {
    fired: Mutex<Fired>,
    /// Set (under the group's lock) to end the thread.
    stop: Mutex<bool>,
}

impl MonitorInner {
    fn fire(&self, death: &WorkerDeath) {
        let actions = {
            let mut fired = self.fired.lock().unwrap_or_else(|e| e.into_inner());
            if fired.error.is_some() {
                return;
            }
            fired.error = Some(death.clone());
            std::mem::take(&mut fired.actions)
        };
        for action in actions {
            action(death);
        }
    }
}

/// Watches a [`Workers`] group from a thread of its own while it lives
/// ([`Workers::monitor`]): at the group's first failure it tells the other workers
/// ([`Workers::tell_siblings`]), then shuts down what it was given
/// ([`shut_down`](Self::shut_down), [`on_failure`](Self::on_failure)), so that the
/// parent's blocked calls end instead of waiting on a dead worker. Dropping it (or
/// [`finish`](Self::finish)) stops and joins its thread; it borrows the group, so it
/// never outlives it. A failure recorded before the monitor was made fires it at once.
///
/// ```no_run
/// # mod shmq { pub mod workers { pub use shmq_workers::*; } pub use shmq_core::*; }
/// use std::process::Command;
/// use std::time::Duration;
/// use shmq::broadcast::{QueueOptions, Writer};
/// use shmq::workers::{WorkerOptions, Workers};
///
/// let exe = std::env::current_exe().unwrap();
/// let workers = Workers::spawn((0..3).map(|_| Command::new(&exe)), WorkerOptions::default())?;
/// let mut steps = Writer::new(QueueOptions::local(3))?;
/// let monitor = workers.monitor()?;
/// monitor.shut_down(&steps.canceller()); // a worker's death ends the writer's waits
/// // ... hand the workers `steps.handle()`, then:
/// let sent = steps.wait_until_ready(Duration::from_secs(60));
/// // The group's first failure, if one ended the wait (the surviving workers were told:
/// // their `sibling_failure()` names it, and their queue ends).
/// monitor.finish()?;
/// sent?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Monitor<'w> {
    workers: &'w Workers,
    inner: Arc<MonitorInner>,
    thread: Option<JoinHandle<()>>,
}

impl Workers {
    /// A [`Monitor`] of this group: from now until it is dropped, the group's first
    /// failure is told to the other workers and shuts down what the monitor was given.
    /// Err only if its thread cannot start.
    ///
    /// # Errors
    ///
    /// [`Error::Core`] with `Os` when the monitor's thread cannot start.
    pub fn monitor(&self) -> Result<Monitor<'_>> {
        let inner = Arc::new(MonitorInner {
            fired: Mutex::new(Fired::default()),
            stop: Mutex::new(false),
        });
        let (shared, notices, for_thread) =
            (self.shared.clone(), self.notices.clone(), inner.clone());
        let thread = std::thread::Builder::new()
            .name("shmq-workers-monitor".into())
            .spawn(move || watch(&shared, &notices, &for_thread))
            .map_err(|e| Error::os("starting the workers' monitor thread", e))?;
        Ok(Monitor {
            workers: self,
            inner,
            thread: Some(thread),
        })
    }

    /// Tell every worker but the failed one of the group's first failure, once (later
    /// calls tell nothing); every failure so far, in order. A worker of
    /// [`spawn`](Self::spawn) hears it on its notice pipe, a remote worker admitted with
    /// [`accept_into`](crate::link::WorkerListener::accept_into) on its link; in the
    /// worker, [`sibling_failure`] returns it. A [`Monitor`] calls this before it shuts
    /// anything down.
    pub fn tell_siblings(&self) -> Vec<WorkerDeath> {
        tell_siblings(&self.shared, &self.notices)
    }

    /// Tell remote worker `rank` of a sibling's failure on `link` too (what
    /// [`accept_into`](crate::link::WorkerListener::accept_into) does; for a worker
    /// admitted otherwise).
    pub fn add_link(&self, rank: usize, link: LinkSender) {
        self.notices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .links
            .push((rank, link));
    }
}

fn watch(shared: &Shared, notices: &Mutex<Notices>, inner: &MonitorInner) {
    let mut seen = 0;
    loop {
        let (n, closing) = {
            let mut state = shared.lock();
            loop {
                if *inner.stop.lock().unwrap_or_else(|e| e.into_inner()) {
                    return;
                }
                if state.failures.len() > seen || state.closing {
                    break (state.failures.len(), state.closing);
                }
                state = shared
                    .changed
                    .wait_timeout(state, Duration::from_secs(3600))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        };
        if n > seen {
            seen = n;
            // The workers first, so that a worker whose queue ends can tell why.
            if let Some(first) = tell_siblings(shared, notices).first() {
                inner.fire(first);
            }
        }
        if closing {
            return;
        }
    }
}

impl Monitor<'_> {
    /// At the failure, end `canceller`'s side's blocked calls ([`Canceller::cancel`]) and,
    /// for a writer's, tell its local readers the queue is shut down
    /// ([`Canceller::close_ring`]: they get the messages sent before, then the end).
    /// Now, if the monitor has fired already.
    pub fn shut_down(&self, canceller: &Canceller) {
        let canceller = canceller.clone();
        self.on_failure(move |_| {
            canceller.cancel();
            canceller.close_ring();
        });
    }

    /// Run `action` with the failure, once, on the monitor's thread (after the workers
    /// were told); now, on this thread, if the monitor has fired already.
    pub fn on_failure(&self, action: impl FnOnce(&WorkerDeath) + Send + 'static) {
        let mut fired = self.inner.fired.lock().unwrap_or_else(|e| e.into_inner());
        match fired.error.clone() {
            Some(death) => {
                drop(fired);
                action(&death);
            }
            None => fired.actions.push(Box::new(action)),
        }
    }

    /// The failure that fired the monitor, or `None`.
    pub fn error(&self) -> Option<WorkerDeath> {
        self.inner
            .fired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .error
            .clone()
    }

    /// [`Error::WorkerDied`] once the monitor has fired; `Ok` before. Does not block.
    ///
    /// # Errors
    ///
    /// [`Error::WorkerDied`] for the failure that fired the monitor.
    pub fn check(&self) -> Result<()> {
        match self.error() {
            Some(death) => Err(Error::WorkerDied(Box::new(death))),
            None => Ok(()),
        }
    }

    /// Stop watching: the thread is joined; a failure the group recorded meanwhile
    /// fires the monitor now (the workers told first). [`Error::WorkerDied`] if it fired.
    ///
    /// # Errors
    ///
    /// [`Error::WorkerDied`] when the monitor fired (before or while it stopped).
    pub fn finish(mut self) -> Result<()> {
        self.stop();
        if !self.workers.closing() {
            if let Some(first) = self.workers.tell_siblings().first() {
                self.inner.fire(first);
            }
        }
        self.check()
    }

    fn stop(&mut self) {
        if let Some(thread) = self.thread.take() {
            {
                // Under the group's lock, which the thread checks the flag under: it
                // cannot miss the wake-up.
                let _state = self.workers.shared.lock();
                *self.inner.stop.lock().unwrap_or_else(|e| e.into_inner()) = true;
                self.workers.shared.changed.notify_all();
            }
            let _ = thread.join();
        }
    }
}

impl Drop for Monitor<'_> {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StderrCapture;

    fn death(tail: usize) -> WorkerDeath {
        WorkerDeath {
            name: "Worker_2".into(),
            rank: 2,
            pid: Some(4741),
            host: String::new(),
            exit: Some(WorkerExit::Signal(libc::SIGBUS)),
            before_ready: false,
            how: None,
            stderr_tail: (0..tail).map(|i| format!("line {i} é")).collect(),
            stderr: StderrCapture::FromStart,
        }
    }

    #[test]
    fn a_notice_carries_the_death_and_its_message() {
        let d = death(3);
        let told = SiblingFailure::from_notice(&SiblingFailure::notice(&d, NOTICE_LIMIT)).unwrap();
        assert_eq!(
            (told.name.as_str(), told.rank, told.pid, told.exit),
            (
                "Worker_2",
                2,
                Some(4741),
                Some(WorkerExit::Signal(libc::SIGBUS))
            )
        );
        assert_eq!(told.stderr_tail, d.stderr_tail);
        assert_eq!(told.to_string(), d.to_string());
        assert!(told.message.contains("was killed by SIGBUS"), "{told}");
    }

    #[test]
    fn a_long_notice_keeps_within_its_limit() {
        let d = death(2000);
        let payload = SiblingFailure::notice(&d, NOTICE_LIMIT);
        assert!(payload.len() <= NOTICE_LIMIT, "{}", payload.len());
        let told = SiblingFailure::from_notice(&payload).unwrap();
        // As the Python parent's: the tail's lines go first (oldest first), then the
        // message (which holds them too) is cut; its start names the worker.
        assert!(told.stderr_tail.len() < 2000);
        assert!(told
            .message
            .starts_with("Worker_2 (rank 2, pid 4741) was killed by SIGBUS"));
        let short = death(3);
        let kept = SiblingFailure::from_notice(&SiblingFailure::notice(&short, 600)).unwrap();
        assert_eq!(kept.stderr_tail.last(), short.stderr_tail.last());
        // Even the message is cut, at a character's boundary, when nothing else is left.
        let tiny = SiblingFailure::notice(&death(0), 150);
        assert!(tiny.len() <= 150, "{}", tiny.len());
        assert!(SiblingFailure::from_notice(&tiny).is_some());
    }

    #[test]
    fn what_is_no_notice_is_none() {
        for bad in [&b"not json"[..], b"{}", b"[1]", br#"{"name": 1}"#] {
            assert_eq!(SiblingFailure::from_notice(bad), None);
        }
    }

    #[test]
    fn outside_a_worker_there_is_no_sibling_failure() {
        assert_eq!(sibling_failure(), None);
    }
}
