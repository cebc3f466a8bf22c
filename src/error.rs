//! One error type for the crate. Each variant is one shape of failure that a caller may
//! want to handle differently; the Python bindings map each to one builtin exception
//! type in one place (`src/python/errors.rs`).

use std::time::Duration;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A blocking call reached its deadline. `what` says who waited for what.
    #[error("timed out after {waited:.3?}: {what}")]
    Timeout { what: String, waited: Duration },

    /// The wait was cancelled (`shutdown()` or a cancel event).
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
    /// never have room for a chunk that large (see `full_message`).
    #[error("{}", full_message(.0))]
    Full(#[from] crate::alloc::Full),

    /// An object handle `(address, id)` does not name a live object: evicted, reused,
    /// cleared, forged or out of range.
    #[error("{}", stale_object_message(address, id))]
    StaleObject { address: u64, id: u64 },

    /// A handle's signature is missing or does not match (vLLM 0.33's messages).
    #[error(
        "{} SHM handle signature for cache key.",
        if *missing { "Missing" } else { "Invalid" }
    )]
    BadSignature { missing: bool },

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

    /// A local reader died while the writer waited for it to free a chunk. The ring
    /// that reports it does not name its queue: see [`Error::naming_queue`].
    #[error("{}", dead_reader_message(*reader, *pid, *chunk, None))]
    DeadReader {
        reader: usize,
        pid: u32,
        chunk: usize,
    },

    /// The writer died while a reader waited for its next message (see
    /// [`Error::naming_queue`]).
    #[error("{}", dead_writer_message(*pid, None))]
    DeadWriter { pid: u32 },

    /// A call on a queue writer that was shut down (its `shutdown()`, or the writer
    /// closed): it sends nothing more. Also how an `enqueue` blocked in another thread
    /// ends when the writer is shut down.
    #[error(
        "the queue was shut down: this writer's shutdown() was called (or the writer was \
         closed), so it sends no more messages"
    )]
    ShutDown,

    /// The writer shut the queue down (its `shutdown()`, or its normal end): the reader
    /// has received every message sent before, and no more will come. Not a death: see
    /// [`Error::DeadWriter`] (see [`Error::naming_queue`]).
    #[error("{}", writer_shut_down_message(None))]
    WriterShutDown,

    /// The writer shut the queue down and went away before the last message it had sent
    /// over the overflow socket reached this reader (its process exited at once, before
    /// ZeroMQ delivered it): that message is lost.
    #[error(
        "the writer shut down and went away before its last message (sent over the overflow \
         socket) reached this reader: that message is lost"
    )]
    WriterGoneMidMessage,

    /// A worker process (see `workers`) exited before it was ready, or failed while it
    /// ran: a non-zero exit `code` or a `signal`.
    #[error("{}", worker_died_message(*rank, *pid, *code, *signal, *before_ready, stderr_tail))]
    WorkerDied {
        rank: usize,
        pid: u32,
        code: Option<i32>,
        signal: Option<i32>,
        before_ready: bool,
        /// The last lines it wrote to stderr.
        stderr_tail: Vec<String>,
    },

    /// Workers had not reported ready when the deadline passed: `(rank, pid)` of each.
    #[error(
        "{} worker(s) not ready after {waited:.1?}: {}",
        not_ready.len(),
        not_ready.iter().map(|(r, p)| format!("worker {r} (pid {p})")).collect::<Vec<_>>().join(", ")
    )]
    WorkersNotReady {
        waited: Duration,
        not_ready: Vec<(usize, u32)>,
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
/// buffer, try calling free_buf() ..."), except for a chunk that no freeing can ever make
/// room for (larger than the whole ring, or than a chunk header's 4-byte size can say):
/// then that, so that nobody frees (or waits) in vain. Both start alike (vLLM 0.33's
/// wording, which callers match).
fn full_message(full: &crate::alloc::Full) -> String {
    if full.needed > full.capacity {
        format!(
            "Not enough space in the data buffer: a chunk of {} bytes (the data with its 8-byte \
             header and, for an object, its framing) can never fit in this ring of {} bytes, \
             however much is freed; store smaller objects or make the ring (data_buffer_size) \
             larger",
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
         cannot go on without losing its messages (create the queue with \
         on_dead_reader=\"drop\" to go on without dead readers)"
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

/// vLLM 0.33's message for a missing or invalid handle signature ("Missing SHM handle
/// signature for cache key", which its callers and tests match), then which key (as the
/// caller wrote it, e.g. a Python repr; `None` when no key was given) and what was wrong.
/// [`Error::BadSignature`] says vLLM's sentence alone.
pub fn bad_signature_message(missing: bool, key: Option<&str>, why: &str) -> String {
    let what = if missing { "Missing" } else { "Invalid" };
    match key {
        Some(key) => format!("{what} SHM handle signature for cache key {key}: {why}"),
        None => format!("{what} SHM handle signature for cache key: {why}"),
    }
}

/// A signal's name ("SIGBUS"), or "signal N" for one without a common name.
pub fn signal_name(signal: i32) -> String {
    const NAMES: [(i32, &str); 15] = [
        (1, "SIGHUP"),
        (2, "SIGINT"),
        (3, "SIGQUIT"),
        (4, "SIGILL"),
        (5, "SIGTRAP"),
        (6, "SIGABRT"),
        (7, "SIGBUS"),
        (8, "SIGFPE"),
        (9, "SIGKILL"),
        (10, "SIGUSR1"),
        (11, "SIGSEGV"),
        (12, "SIGUSR2"),
        (13, "SIGPIPE"),
        (14, "SIGALRM"),
        (15, "SIGTERM"),
    ];
    NAMES.iter().find(|(n, _)| *n == signal).map_or_else(
        || format!("signal {signal}"),
        |(_, name)| (*name).to_owned(),
    )
}

/// The message of [`Error::WorkerDied`]: the same wording as the Python package's
/// `WorkerDiedError`.
fn worker_died_message(
    rank: usize,
    pid: u32,
    code: Option<i32>,
    signal: Option<i32>,
    before_ready: bool,
    stderr_tail: &[String],
) -> String {
    let how = match (code, signal) {
        (_, Some(s)) => format!("was killed by {}", signal_name(s)),
        (Some(c), None) => format!("exited with code {c}"),
        (None, None) => "exited (exit code unknown)".to_owned(),
    };
    let when = if before_ready {
        "before it was ready"
    } else {
        "while it was running"
    };
    let mut message = format!("worker {rank} (pid {pid}) {how} {when}");
    if stderr_tail.is_empty() {
        message.push_str(" (it wrote nothing to stderr)");
    } else {
        message.push_str("; the last lines of its stderr:");
        for line in stderr_tail {
            message.push_str("\n    ");
            message.push_str(line);
        }
    }
    message
}

// The loom build leaves out the modules that use these.
#[cfg_attr(loom, allow(dead_code))]
impl Error {
    pub(crate) fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn transport(context: impl Into<String>) -> impl FnOnce(zmq::Error) -> Self {
        let context = context.into();
        move |source| Error::Transport { context, source }
    }

    /// For a peer's death ([`Error::DeadReader`], [`Error::DeadWriter`]) or the writer's
    /// end ([`Error::WriterShutDown`]), the message
    /// naming the queue whose ring segment is `queue`; `None` for other errors. The ring
    /// that reports a death names only the peer, but a process may hold several queues.
    pub fn naming_queue(&self, queue: &str) -> Option<String> {
        match *self {
            Error::DeadReader { reader, pid, chunk } => {
                Some(dead_reader_message(reader, pid, chunk, Some(queue)))
            }
            Error::DeadWriter { pid } => Some(dead_writer_message(pid, Some(queue))),
            Error::WriterShutDown => Some(writer_shut_down_message(Some(queue))),
            _ => None,
        }
    }
}
