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

    /// The object store's ring has no room (after freeing what could be freed).
    #[error(transparent)]
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

    /// A local reader died while the writer waited for it to free a chunk.
    #[error(
        "reader {reader} (pid {pid}) died before reading chunk {chunk}; the writer cannot go \
         on without losing its messages (create the queue with on_dead_reader=\"drop\" to go on \
         without dead readers)"
    )]
    DeadReader {
        reader: usize,
        pid: u32,
        chunk: usize,
    },

    /// The writer died while a reader waited for its next message.
    #[error("the writer (pid {pid}) died; no more messages will come")]
    DeadWriter { pid: u32 },

    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Os {
        context: String,
        #[source]
        source: std::io::Error,
    },

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
}
