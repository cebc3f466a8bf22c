//! One error type for the crate. Each variant is one shape of failure that a caller may
//! want to handle differently; the Python bindings map each to one builtin exception
//! type in one place (`bindings/python/src/errors.rs`).

use std::time::Duration;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error of the crate, one variant per shape of failure. It is
/// `#[non_exhaustive]`: later versions may add variants, so a `match` on it outside the
/// crate needs a `_` arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A blocking call reached its deadline. `what` says who waited for what.
    #[error("timed out after {waited:.3?}: {what}")]
    Timeout { what: String, waited: Duration },

    /// The wait was cancelled: `shmq::Reader::shutdown`, a
    /// `shmq::broadcast::Canceller`'s `cancel()` from another thread, or a
    /// cancel flag of the caller's (Python: `shutdown()` or a `cancel` event).
    #[error("cancelled")]
    Cancelled,

    /// `/dev/shm` does not have room for a new segment.
    #[error(
        "not enough shared memory for segment '{name}': it needs {needed} bytes but /dev/shm has \
         {available} bytes free (in a container, raise it with `docker run --shm-size=...` or \
         use `--ipc=host`)"
    )]
    NoSpace {
        name: String,
        needed: u64,
        available: u64,
    },

    /// The named segment does not exist on this machine (for example, a handle made on
    /// another node).
    #[error(
        "shared memory segment '{name}' does not exist on this machine (was the handle made on \
         another node, or has its creator exited?)"
    )]
    SegmentNotFound { name: String },

    /// A segment was to be made under a name a file in `/dev/shm` already has. Made
    /// under a fresh name ([`crate::segment::with_unique_name`]), another is drawn.
    #[error("shared memory segment '{name}' already exists")]
    SegmentExists { name: String },

    /// The segment exists but is not a shmq segment of the expected kind and layout.
    #[error("shared memory segment '{name}' cannot be used: {reason}")]
    BadSegment { name: String, reason: String },

    /// An argument is out of its allowed range.
    #[error("{0}")]
    InvalidArgument(String),

    /// The operation is not allowed for this side of the queue (e.g. the writer dequeues).
    #[error("{0}")]
    WrongRole(String),

    /// The object store's ring has no room (after freeing what could be freed), or can
    /// never have room for a block that large (see `full_message`).
    #[error("{}", full_message(.0))]
    Full(#[from] shmq_protocol::alloc::Full),

    /// An object handle `(address, id)` does not name a live object: evicted, reused,
    /// cleared, forged or out of range.
    #[error("{}", stale_object_message(address, id))]
    StaleObject { address: u64, id: u64 },

    /// A handle's signature is missing or does not match (vLLM 0.33's messages); `why`,
    /// when known, says what was wrong (the Python store adds the key's repr).
    #[error("{}", bad_signature_message(*missing, None, why.map(|w| w.to_string()).as_deref()))]
    BadSignature {
        missing: bool,
        why: Option<HandleRefusal>,
    },

    /// `put` of a key the store already has.
    #[error("Key '{0}' already exists in the storage.")]
    KeyExists(String),

    /// `put` of an object larger than the store's `max_object_size`.
    #[error("Serialized object size ({size} bytes) exceeds max object size ({max} bytes)")]
    TooLarge { size: u64, max: u64 },

    /// The encoder cache has no room for an entry and nothing could be evicted before the
    /// deadline; `reason` says what holds the room.
    #[error(
        "encoder cache '{name}' is full: no room for an entry of {needed} bytes (capacity \
         {capacity} bytes, {held} entries held) after waiting {waited:.3?}: {reason}"
    )]
    CacheFull {
        name: String,
        needed: u64,
        capacity: u64,
        held: usize,
        waited: Duration,
        reason: String,
    },

    /// A key the encoder cache does not hold (and did not hold until every consumer had
    /// loaded it).
    #[error("{0:?} is not held by this encoder cache")]
    UnknownKey(String),

    /// A local reader died while the writer waited for it to free a chunk. `queue`: the
    /// queue's ring segment, which the message names (one process may hold several
    /// queues).
    #[error("{}", dead_reader_message(*reader, *pid, *chunk, queue.as_deref()))]
    DeadReader {
        reader: usize,
        pid: u32,
        chunk: usize,
        queue: Option<String>,
    },

    /// The writer died while a reader waited for its next message; `queue` as for
    /// [`Error::DeadReader`].
    #[error("{}", dead_writer_message(*pid, queue.as_deref()))]
    DeadWriter { pid: u32, queue: Option<String> },

    /// A call on a queue writer that was shut down (`shmq::Writer::close`,
    /// or its `shmq::broadcast::Canceller`'s `cancel()` from another thread;
    /// Python's `shutdown()`): it sends nothing more. Also how an `enqueue` blocked in
    /// another thread ends when the writer is shut down.
    #[error(
        "the queue was shut down: this writer's shutdown() was called (or the writer was \
         closed), so it sends no more messages"
    )]
    ShutDown,

    /// The writer shut the queue down (`shmq::Writer::close`, Python's
    /// `shutdown()`, or its normal end: dropped): the reader
    /// has received every message sent before, and no more will come. Not a death: see
    /// [`Error::DeadWriter`]. `queue`: the queue's ring segment, which the message names
    /// (`None` for a remote stream's reader, which has none).
    #[error("{}", writer_shut_down_message(queue.as_deref()))]
    WriterShutDown { queue: Option<String> },

    /// A remote reader's writer is gone without shutting the queue down: the connection
    /// that carried the stream ended (the writer died, hangs, or the network failed: see
    /// `remote`), or before the start no connection to it could be made. The reader has
    /// every message that arrived before (`received` of them).
    #[error(
        "the writer at {endpoint} is gone: {reason}; {received} messages received from it; \
         no more will come"
    )]
    RemoteWriterGone {
        endpoint: String,
        received: u64,
        reason: String,
    },

    /// The writer stopped sending to this remote reader because it fell behind
    /// (`slow_remote_reader="drop"`), and said so after the messages it had sent to it
    /// (`received` of them).
    #[error(
        "remote reader rank {rank} was dropped by the writer at {endpoint}: it fell behind the \
         queue's bounds (slow_remote_reader=\"drop\"); {received} messages received before; no \
         more will come (make the queue with slow_remote_reader=\"block\", or raise \
         remote_hwm / remote_max_queued_bytes; in Rust, QueueOptions::remote's slow_reader \
         (SlowReaderPolicy::Block), hwm and max_queued_bytes)"
    )]
    ReaderDropped {
        rank: u64,
        endpoint: String,
        received: u64,
    },

    /// The writer shut the queue down and went away before the last message it had sent
    /// over the overflow socket reached this reader (its process exited at once, before
    /// ZeroMQ delivered it): that message is lost.
    #[error(
        "the writer shut down and went away before its last message (sent over the overflow \
         socket) reached this reader: that message is lost"
    )]
    WriterGoneMidMessage,

    /// A worker process (see `workers`) exited before it was ready, or failed while it
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

    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Os {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// The remote stream refused something: a writer that does not prove it holds the
    /// queue's secret, a message that fails authentication or comes out of order, a
    /// reader the writer refused.
    #[error("{0}")]
    Remote(String),

    /// A ZeroMQ call failed.
    #[error("ZeroMQ error while {context}: {source}")]
    Transport {
        context: String,
        #[source]
        source: zmq::Error,
    },
}

/// The message of [`Error::StaleObject`], also for handles that are not even integers of
/// the right range (the Python bindings report those the same way).
pub fn stale_object_message(address: impl std::fmt::Display, id: impl std::fmt::Display) -> String {
    format!("Data for address:id '{address}:{id}' has been modified or is invalid.")
}

/// The message of [`Error::Full`]: the allocator's ("Not enough space in the data
/// buffer, try calling free_buf() to free up space (...; Rust: free_while)"), except for
/// a block that no freeing can ever make room for (larger than the whole ring, or than a
/// block header's 4-byte size can say): then that, so that nobody frees (or waits) in
/// vain. Both start alike (vLLM 0.33's wording, which callers match); each names the
/// Python spelling and the Rust one, since both languages show the same text.
fn full_message(full: &shmq_protocol::alloc::Full) -> String {
    if full.needed > full.capacity {
        format!(
            "Not enough space in the data buffer: a chunk of {} bytes (the data with its 8-byte \
             header and, for an object, its framing) can never fit in this ring of {} bytes, \
             however much is freed; store smaller objects or make the ring (data_buffer_size; \
             Rust: BlockFifo::create's capacity) larger",
            full.needed, full.capacity
        )
    } else if full.needed > u64::from(u32::MAX) {
        format!(
            "Not enough space in the data buffer: a chunk of {} bytes can never be stored (a \
             chunk's size field holds at most {} bytes); store smaller objects",
            full.needed,
            u32::MAX
        )
    } else {
        match &full.held_by {
            Some(held) => format!("{full}; {held}"),
            None => full.to_string(),
        }
    }
}

/// The message of [`Error::DeadReader`], naming the queue (its ring segment) if known.
fn dead_reader_message(reader: usize, pid: u32, chunk: usize, queue: Option<&str>) -> String {
    let of_queue = queue.map_or_else(String::new, |q| format!(" of queue '{q}'"));
    format!(
        "reader {reader} (pid {pid}) died before reading chunk {chunk}{of_queue}; the writer \
         cannot go on without losing its messages (to go on without dead readers, make the \
         queue with on_dead_reader=\"drop\" in Python, or with QueueOptions::on_dead_reader \
         set to DeadReaderPolicy::Drop in Rust)"
    )
}

/// The message of [`Error::DeadWriter`], naming the queue (its ring segment) if known.
fn dead_writer_message(pid: u32, queue: Option<&str>) -> String {
    let on_queue = queue.map_or_else(String::new, |q| format!(" on queue '{q}'"));
    format!("the writer (pid {pid}) died; no more messages will come{on_queue}")
}

/// The message of [`Error::WriterShutDown`], naming the queue (its ring segment) if known.
fn writer_shut_down_message(queue: Option<&str>) -> String {
    let of_queue = queue.map_or_else(String::new, |q| format!(" of queue '{q}'"));
    format!(
        "the writer{of_queue} shut down: every message it sent before has been received, and \
         no more will come"
    )
}

/// Why a store refuses a handle a request brings back: the words after vLLM's "Invalid SHM
/// handle signature for cache key ...:" (readers: the signature; the writer also checks
/// that the handle is the key's current object, see `storage::StoreRole`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HandleRefusal {
    /// The writer was given no key to look the handle up under.
    #[error("no key was given")]
    NoKey,
    /// The writer has no object under the key.
    #[error("no object is stored under this key")]
    NoEntry,
    /// The writer's object under the key is another one.
    #[error(
        "the handle (address {}, id {}) is not this key's current object (address {}, id {})",
        handle.0, handle.1, current.0, current.1
    )]
    NotCurrent {
        handle: (u64, u32),
        current: (u64, u32),
    },
    /// The signature was not made for this key and handle by this store.
    #[error(
        "the signature does not match this key, address {address} and id {id} (was it made \
         for another key or object, or by another store?)"
    )]
    Mismatch { address: u64, id: u32 },
}

/// A key or an insertion the encoder cache's key index refuses (`shmq-protocol`).
impl From<shmq_protocol::key_index::IndexError> for Error {
    fn from(e: shmq_protocol::key_index::IndexError) -> Error {
        Error::InvalidArgument(e.0)
    }
}

impl From<HandleRefusal> for Error {
    fn from(why: HandleRefusal) -> Error {
        Error::BadSignature {
            missing: false,
            why: Some(why),
        }
    }
}

/// vLLM 0.33's message for a missing or invalid handle signature ("Missing SHM handle
/// signature for cache key", which its callers and tests match), then which key (as the
/// caller wrote it, e.g. a Python repr; `None` when no key was given) and what was wrong.
/// Without a key or a reason (`None`), vLLM's sentence alone.
pub fn bad_signature_message(missing: bool, key: Option<&str>, why: Option<&str>) -> String {
    let what = if missing { "Missing" } else { "Invalid" };
    match (key, why) {
        (Some(key), Some(why)) => format!("{what} SHM handle signature for cache key {key}: {why}"),
        (Some(key), None) => format!("{what} SHM handle signature for cache key {key}."),
        (None, Some(why)) => format!("{what} SHM handle signature for cache key: {why}"),
        (None, None) => format!("{what} SHM handle signature for cache key."),
    }
}

/// The value of `choices` named `value`, for the option `argument`; `InvalidArgument`
/// naming the choices otherwise (`on_dead_reader must be "raise" or "drop", got "x"`).
pub fn parse_choice<T: Copy>(argument: &str, value: &str, choices: &[(&str, T)]) -> Result<T> {
    if let Some(&(_, v)) = choices.iter().find(|(name, _)| *name == value) {
        return Ok(v);
    }
    let names: Vec<String> = choices.iter().map(|(n, _)| format!("{n:?}")).collect();
    Err(Error::InvalidArgument(format!(
        "{argument} must be {}, got {value:?}",
        names.join(" or ")
    )))
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

impl Error {
    pub fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os {
            context: context.into(),
            source,
        }
    }

    pub fn transport(context: impl Into<String>) -> impl FnOnce(zmq::Error) -> Self {
        let context = context.into();
        move |source| Error::Transport { context, source }
    }
}
