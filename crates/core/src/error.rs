//! The core's error type: the errors of its waits ([`Error::Timeout`],
//! [`Error::Cancelled`]), of the arguments and roles its calls refuse, and of ZeroMQ;
//! each module's own errors ([`QueueError`], [`StoreError`], [`CacheError`],
//! [`RemoteError`], [`NameError`]) and the operating-system layer's ([`OsError`]) as a variant each,
//! which `?` converts into. `shmq::Error` is this type; the Python binding maps it to
//! builtin exceptions in one place (`bindings/python/src/errors.rs`). The queue's
//! operations return an error type each ([`OpenError`], [`DequeueError`],
//! [`TryDequeueError`], [`FinishReadError`], [`CreateError`], [`EnqueueError`],
//! [`TryEnqueueError`], [`WriteChunkError`], [`NewGatherError`], [`GatherRecvError`]), whose variants are exactly the ways that operation fails; each
//! converts into this type, as the variant with the same text (`?` works).
//!
//! ```
//! use shmq_core::error::{Error, OsError, QueueError};
//! fn describe(e: &Error) -> &'static str {
//!     match e {
//!         Error::Queue(QueueError::DeadWriter { .. }) => "the writer died",
//!         Error::Os(OsError::SegmentNotFound { .. }) => "no such segment here",
//!         Error::Timeout { .. } => "timed out",
//!         _ => "something else",
//!     }
//! }
//! # let _ = describe;
//! ```

use std::time::Duration;

pub use crate::broadcast::{
    CreateError, DequeueError, EnqueueError, FinishReadError, GatherRecvError, NewGatherError,
    OpenError, QueueError, TryDequeueError, TryEnqueueError, WriteChunkError,
};
pub use crate::encoder_cache::CacheError;
pub use crate::names::NameError;
pub use crate::remote::RemoteError;
pub use crate::storage::{HandleRefusal, StoreError};
pub use shmq_os::error::Error as OsError;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error of the core, one variant per shape of failure or per layer or module that
/// has its own. It is `#[non_exhaustive]`: later versions may add variants, so a `match`
/// on it outside the crate needs a `_` arm. Its text is the inner error's.
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

    /// An argument is out of its allowed range: the core's refusals and the
    /// operating-system layer's ([`OsError::InvalidArgument`] converts into this one), so
    /// a caller matches one variant.
    #[error("{0}")]
    InvalidArgument(String),

    /// The operation is not allowed for this side of the queue (e.g. the writer dequeues).
    #[error("{0}")]
    WrongRole(String),

    /// The operating-system layer failed: a segment (no room, missing, taken, not
    /// shmq's), a fork, a system call. An argument it refused is
    /// [`Error::InvalidArgument`], not this.
    #[error(transparent)]
    Os(OsError),

    /// The queue (and the remote stream's reader) ended: a dead peer, or shut down.
    #[error(transparent)]
    Queue(#[from] QueueError),

    /// The object store refused: full, a stale handle, a bad signature, a key it has, an
    /// object too large.
    #[error(transparent)]
    Store(#[from] StoreError),

    /// The encoder cache refused: full, a key it does not hold, an entry too large.
    #[error(transparent)]
    Cache(#[from] CacheError),

    /// The remote stream ended or refused something.
    #[error(transparent)]
    Remote(#[from] RemoteError),

    /// A name could not be taken or found (see [`crate::names`]).
    #[error(transparent)]
    Name(#[from] NameError),

    /// A ZeroMQ call failed.
    #[error("ZeroMQ error while {context}: {source}")]
    Transport {
        context: String,
        #[source]
        source: zmq::Error,
    },
}

/// The operating-system layer's error as [`Error::Os`], except an argument it refused:
/// that is [`Error::InvalidArgument`], the same variant as the core's own refusals.
impl From<OsError> for Error {
    fn from(e: OsError) -> Error {
        match e {
            OsError::InvalidArgument(why) => Error::InvalidArgument(why),
            e => Error::Os(e),
        }
    }
}

/// The store's allocator found no room (see [`StoreError::Full`]).
impl From<shmq_protocol::alloc::Full> for Error {
    fn from(full: shmq_protocol::alloc::Full) -> Error {
        Error::Store(full.into())
    }
}

/// A handle a store refused (see [`StoreError::BadSignature`]).
impl From<HandleRefusal> for Error {
    fn from(why: HandleRefusal) -> Error {
        Error::Store(why.into())
    }
}

/// A key or an insertion the encoder cache's key index refuses (`shmq-protocol`).
impl From<shmq_protocol::key_index::IndexError> for Error {
    fn from(e: shmq_protocol::key_index::IndexError) -> Error {
        Error::InvalidArgument(e.0)
    }
}

impl shmq_os::error::AsOsError for Error {
    fn as_os_error(&self) -> Option<&OsError> {
        match self {
            Error::Os(e) => Some(e),
            _ => None,
        }
    }
}

impl Error {
    /// [`OsError::Os`]: an operating-system call failed.
    pub fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os(OsError::os(context, source))
    }

    pub fn transport(context: impl Into<String>) -> impl FnOnce(zmq::Error) -> Self {
        let context = context.into();
        move |source| Error::Transport { context, source }
    }
}

/// The value of `choices` named `value`, for the option `argument`; `InvalidArgument`
/// naming the choices otherwise (`on_dead_reader must be "raise" or "drop", got "x"`).
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming `argument` and the choices when `value` is none of
/// them.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A segment name the operating-system layer refuses reaches a core caller as the
    /// core's `InvalidArgument`, with the OS layer's text.
    #[test]
    fn an_argument_the_os_layer_refuses_is_the_cores_invalid_argument() {
        let e = Error::from(OsError::InvalidArgument("bad".into()));
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m == "bad"),
            "{e:?}"
        );

        let e = crate::storage::BlockFifo::open("a/b", None).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("'/'")),
            "{e:?}"
        );

        let e = Error::from(OsError::SegmentExists { name: "x".into() });
        assert!(
            matches!(e, Error::Os(OsError::SegmentExists { .. })),
            "{e:?}"
        );
    }
}
