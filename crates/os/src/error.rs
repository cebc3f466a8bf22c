//! The operating-system layer's errors: segments (no room, missing, taken, not shmq's),
//! arguments it refuses, what a fork forbids, and failed system calls. The layers above
//! have their own error types that wrap this one (`shmq_core::Error::Os`); the Python
//! binding maps every layer's errors to builtin exceptions in one place
//! (`bindings/python/src/errors.rs`).

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error of the operating-system layer, one variant per shape of failure. It is
/// `#[non_exhaustive]`: later versions may add variants, so a `match` on it outside the
/// crate needs a `_` arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
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

    /// The segment's file is another user's, or others may read or write it: never
    /// opened (`crate::segment_file` says why).
    #[error("{0}")]
    NotOwned(crate::segment_file::ForeignSegment),

    /// This user's directory of names cannot be used: another user's, open to others, or
    /// every fallback taken (see [`crate::names_dir`]).
    #[error("{0}")]
    NamesDirRefused(crate::names_dir::DirRefusal),

    /// An argument is out of its allowed range.
    #[error("{0}")]
    InvalidArgument(String),

    /// A shared-memory object made before a `fork()` was used in the forked child (see
    /// [`crate::fork`]).
    #[error("{0}")]
    Forked(String),

    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Os {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os {
            context: context.into(),
            source,
        }
    }

    /// The error of opening a segment file: [`Error::NotOwned`] for a file refused as
    /// another user's ([`crate::segment_file::SegmentFile::try_open`]), else
    /// [`Error::os`] with `context`.
    pub fn from_open(context: impl Into<String>, source: std::io::Error) -> Self {
        match source
            .get_ref()
            .and_then(|e| e.downcast_ref::<crate::segment_file::ForeignSegment>())
        {
            Some(foreign) => Error::NotOwned(foreign.clone()),
            None => Error::os(context, source),
        }
    }
}

/// This layer's error inside an error of a layer above (for calls here, such as
/// [`crate::segment::with_unique_name`], that take a closure returning the caller's error).
pub trait AsOsError {
    /// The operating-system layer's error, if it is one.
    fn as_os_error(&self) -> Option<&Error>;
}

impl AsOsError for Error {
    fn as_os_error(&self) -> Option<&Error> {
        Some(self)
    }
}
