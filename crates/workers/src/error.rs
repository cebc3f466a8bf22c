//! The workers' errors, and how a worker ended.

use std::time::Duration;

/// Result alias of the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error of worker supervision: a worker that died, workers not ready in time, or an
/// error of the layers below ([`Error::Core`], whose text it keeps).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A worker process exited before it was ready, or failed while it
    /// ran: who, how, and its last stderr lines.
    #[error("{0}")]
    WorkerDied(Box<WorkerDeath>),

    /// Workers had not reported ready when the deadline passed: the `(name, description)`
    /// of each, out of `total`.
    #[error(
        "{} of {total} worker(s) not ready after {} s: {}",
        not_ready.len(),
        waited.as_secs_f64(),
        not_ready.iter().map(|(_, d)| d.as_str()).collect::<Vec<_>>().join(", ")
    )]
    WorkersNotReady {
        waited: Duration,
        total: usize,
        not_ready: Vec<(String, String)>,
    },

    /// The core (or the operating-system layer below it) failed.
    #[error(transparent)]
    Core(#[from] shmq_core::Error),

    /// A worker link ([`crate::link`]) failed, was lost, or refused its peer.
    #[error(transparent)]
    Link(#[from] crate::link::LinkError),
}

/// An error of the operating-system layer, through the core's.
impl From<shmq_os::Error> for Error {
    fn from(e: shmq_os::Error) -> Error {
        Error::Core(e.into())
    }
}

impl Error {
    /// An operating-system call failed ([`shmq_os::Error::Os`]).
    pub fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        shmq_os::Error::os(context, source).into()
    }
}

/// A signal's name ("SIGBUS"), or "signal N" for one without a name (Linux's numbering;
/// the same names as Python's `signal.Signals`).
pub fn signal_name(signal: i32) -> String {
    const NAMES: [&str; 31] = [
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    match usize::try_from(signal)
        .ok()
        .and_then(|s| NAMES.get(s.checked_sub(1)?))
    {
        Some(name) => (*name).to_owned(),
        None => format!("signal {signal}"),
    }
}

/// How a worker process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerExit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl WorkerExit {
    /// As Python's `multiprocessing` reports it: the code, or minus the signal.
    pub fn exitcode(self) -> i32 {
        match self {
            WorkerExit::Code(c) => c,
            WorkerExit::Signal(s) => -s,
        }
    }

    /// From `multiprocessing`'s exit code (negative: the signal that killed it).
    pub fn from_exitcode(exitcode: i32) -> WorkerExit {
        if exitcode < 0 {
            WorkerExit::Signal(-exitcode)
        } else {
            WorkerExit::Code(exitcode)
        }
    }
}

/// What was captured of a worker's stderr (it decides what an empty tail means).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StderrCapture {
    /// Not captured (or a remote worker, which sends its own lines).
    No,
    /// From the worker's first instruction on.
    FromStart,
    /// From the Python bootstrap on: what a fork server's child or a forked interpreter
    /// wrote while it started went to the stderr it inherited.
    FromBootstrap,
}

/// A worker that exited when it should not have ([`Error::WorkerDied`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerDeath {
    pub name: String,
    pub rank: usize,
    /// `None`: a remote worker that never said.
    pub pid: Option<u32>,
    /// `""` for a local worker.
    pub host: String,
    /// `None`: unknown (a remote worker that left without saying).
    pub exit: Option<WorkerExit>,
    pub before_ready: bool,
    /// Replaces the exit in the message ("lost its connection to the parent").
    pub how: Option<String>,
    /// The last lines it wrote to stderr.
    pub stderr_tail: Vec<String>,
    pub stderr: StderrCapture,
}

impl std::fmt::Display for WorkerDeath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut place = format!("rank {}", self.rank);
        if let Some(pid) = self.pid {
            place.push_str(&format!(", pid {pid}"));
        }
        if !self.host.is_empty() {
            place.push_str(&format!(" on {}", self.host));
        }
        let how = match (&self.how, self.exit) {
            (Some(how), _) => how.clone(),
            (None, None) => "exited (exit code unknown)".to_owned(),
            (None, Some(WorkerExit::Signal(s))) => format!("was killed by {}", signal_name(s)),
            (None, Some(WorkerExit::Code(c))) if c > 128 && c - 128 <= 64 => format!(
                // Python workers turn SIGTERM into SystemExit(128 + SIGTERM), as shells say.
                "exited with code {c} (128 + {}: it was asked to stop)",
                signal_name(c - 128)
            ),
            (None, Some(WorkerExit::Code(c))) => format!("exited with code {c}"),
        };
        let when = if self.before_ready {
            "before it was ready"
        } else {
            "while it was running"
        };
        write!(f, "{} ({place}) {how} {when}", self.name)?;
        if !self.stderr_tail.is_empty() {
            f.write_str("; the last lines of its stderr:")?;
            for line in &self.stderr_tail {
                write!(f, "\n    {line}")?;
            }
        } else if self.host.is_empty() {
            match self.stderr {
                StderrCapture::No => {}
                StderrCapture::FromStart => f.write_str(" (it wrote nothing to stderr)")?,
                StderrCapture::FromBootstrap => f.write_str(
                    " (it wrote nothing to stderr after shmq's bootstrap took it over; what it \
                     wrote while starting, e.g. while re-importing the main module, went to the \
                     parent's stderr)",
                )?,
            }
        }
        Ok(())
    }
}
