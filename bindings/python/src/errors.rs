//! The one place where errors of every layer (operating system, core, workers) become
//! Python exceptions.

use pyo3::exceptions::{
    PyConnectionError, PyEOFError, PyFileExistsError, PyFileNotFoundError, PyKeyError,
    PyMemoryError, PyOSError, PyPermissionError, PyRuntimeError, PyTimeoutError, PyValueError,
};
use pyo3::{PyErr, PyResult};

use shmq::error::{
    CacheError, CreateError, DequeueError, EnqueueError, Error, FinishReadError, NameError,
    OpenError, OsError, QueueError, RemoteError, StoreError, TryDequeueError, WriteChunkError,
};
use shmq::workers::link::LinkError;
use shmq::workers::Error as WorkersError;

pyo3::create_exception!(
    shmq,
    PeerDiedError,
    pyo3::exceptions::PyRuntimeError,
    "A process on the other side of a queue died (a reader the writer waits for, or the writer a reader waits for)."
);

pyo3::create_exception!(
    shmq,
    QueueShutDownError,
    pyo3::exceptions::PyRuntimeError,
    "The queue was shut down by its writer (shutdown(), or the writer's normal end): raised by the writer's later calls, and by a reader's dequeue once it has received every message sent before. Not a death (that is PeerDiedError)."
);

pyo3::create_exception!(
    shmq,
    MessageLostError,
    pyo3::exceptions::PyRuntimeError,
    "A message sent to this reader was lost: the writer's process ended before the message (one too large for the ring and for the tensor arena, sent over the queue's socket) reached it. The reader's next dequeue returns the messages after it. Neither a clean end (QueueShutDownError) nor a death (PeerDiedError)."
);

/// `result.or_raise()?`: a result of any layer (the core's, the operating-system
/// layer's, the workers') as PyO3's, its error the Python exception that [`exception`]
/// makes. Every call's `?` in this crate goes through it (`From<shmq::Error> for PyErr`
/// cannot be written here: both types are other crates').
pub trait OrRaise<T> {
    fn or_raise(self) -> PyResult<T>;
}

impl<T, E: Into<AnyError>> OrRaise<T> for Result<T, E> {
    fn or_raise(self) -> PyResult<T> {
        self.map_err(|e| exception(e.into()))
    }
}

/// An error of any layer, each with its own type: what [`exception`] maps.
pub enum AnyError {
    Os(OsError),
    Core(Error),
    Workers(WorkersError),
}

impl From<OsError> for AnyError {
    fn from(e: OsError) -> Self {
        AnyError::Os(e)
    }
}

impl From<Error> for AnyError {
    fn from(e: Error) -> Self {
        AnyError::Core(e)
    }
}

/// The queue's per-operation errors ([`OpenError`], [`DequeueError`], [`CreateError`],
/// [`EnqueueError`], [`TryDequeueError`], [`FinishReadError`], [`WriteChunkError`]) as
/// the core's [`Error`] they convert into, with the same text: the same exception as
/// before they had types of their own.
macro_rules! as_core_error {
    ($($t:ty),*) => {$(
        impl From<$t> for AnyError {
            fn from(e: $t) -> Self {
                AnyError::Core(e.into())
            }
        }
    )*};
}

as_core_error!(
    OpenError,
    CreateError,
    DequeueError,
    EnqueueError,
    TryDequeueError,
    FinishReadError,
    WriteChunkError
);

/// A core `try_take`'s result with nothing here as `None`, its failure as the exception
/// [`exception`] makes.
pub fn taken_now<T>(taken: Result<T, TryDequeueError>) -> PyResult<Option<T>> {
    match taken {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.is_empty() => Ok(None),
        Err(e) => Err(exception(e)),
    }
}

impl From<WorkersError> for AnyError {
    fn from(e: WorkersError) -> Self {
        AnyError::Workers(e)
    }
}

/// The Python exception for an error of any layer: its type by the error's variant (the
/// layers' errors nested as they wrap each other), its message the error's text.
pub fn exception(err: impl Into<AnyError>) -> PyErr {
    match err.into() {
        AnyError::Os(e) => os_exception(e),
        AnyError::Core(e) => core_exception(e),
        AnyError::Workers(WorkersError::Core(e)) => core_exception(e),
        AnyError::Workers(e @ WorkersError::WorkersNotReady { .. }) => {
            PyTimeoutError::new_err(e.to_string())
        }
        AnyError::Workers(WorkersError::Link(e)) => link_exception(e),
        AnyError::Workers(e) => PyRuntimeError::new_err(e.to_string()),
    }
}

fn link_exception(err: LinkError) -> PyErr {
    let msg = err.to_string();
    match err {
        LinkError::Io { source, .. } => PyOSError::new_err((source.raw_os_error(), msg)),
        LinkError::Closed => PyEOFError::new_err(msg),
        LinkError::TimedOut => PyTimeoutError::new_err(msg),
        // Not a shmq worker link on the other end (no shmq peer sends either).
        LinkError::Malformed(_) | LinkError::HandshakeFrameTooLong { .. } => {
            PyConnectionError::new_err(msg)
        }
        LinkError::Refused(_) => PyPermissionError::new_err(msg),
        // A frame that is not the peer's (length, seal, turn, kind): the link is over.
        _ => PyValueError::new_err(msg),
    }
}

fn core_exception(err: Error) -> PyErr {
    let msg = err.to_string();
    match err {
        Error::Os(e) => os_exception(e),
        Error::Queue(e) => queue_exception(e),
        Error::Store(e) => store_exception(e),
        Error::Cache(e) => cache_exception(e),
        Error::Remote(e) => remote_exception(e),
        Error::Name(e) => name_exception(e),
        Error::Timeout { .. } => PyTimeoutError::new_err(msg),
        Error::Cancelled => PyRuntimeError::new_err("cancelled"),
        Error::InvalidArgument(_) => PyValueError::new_err(msg),
        Error::WrongRole(_) => PyRuntimeError::new_err(msg),
        Error::Transport { .. } => PyOSError::new_err(msg),
        // A variant added to the core after this list: a RuntimeError until it has a
        // line of its own here.
        _ => PyRuntimeError::new_err(msg),
    }
}

fn os_exception(err: OsError) -> PyErr {
    let msg = err.to_string();
    match err {
        OsError::NoSpace { .. } => PyMemoryError::new_err(msg),
        OsError::SegmentNotFound { .. } => PyFileNotFoundError::new_err(msg),
        OsError::BadSegment { .. }
        | OsError::SegmentExists { .. }
        | OsError::InvalidArgument(_) => PyValueError::new_err(msg),
        OsError::Forked(_) => PyRuntimeError::new_err(msg),
        OsError::NotOwned(_) | OsError::NamesDirRefused(_) => PyPermissionError::new_err(msg),
        OsError::Os { ref source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => {
            PyPermissionError::new_err(msg)
        }
        OsError::Os { .. } => PyOSError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

fn queue_exception(err: QueueError) -> PyErr {
    let msg = err.to_string();
    match err {
        QueueError::DeadReader { .. }
        | QueueError::DeadWriter { .. }
        | QueueError::GatherWriterDied { .. } => PeerDiedError::new_err(msg),
        QueueError::ShutDown
        | QueueError::WriterShutDown { .. }
        | QueueError::GatherEnded { .. } => QueueShutDownError::new_err(msg),
        QueueError::WriterGoneMidMessage => MessageLostError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

fn store_exception(err: StoreError) -> PyErr {
    let msg = err.to_string();
    match err {
        StoreError::Full(_) => PyMemoryError::new_err(msg),
        StoreError::StaleObject { .. }
        | StoreError::BadSignature { .. }
        | StoreError::KeyExists(_)
        | StoreError::TooLarge { .. } => PyValueError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

fn cache_exception(err: CacheError) -> PyErr {
    let msg = err.to_string();
    match err {
        CacheError::Full { .. } => PyMemoryError::new_err(msg),
        CacheError::UnknownKey(key) => PyKeyError::new_err(key),
        CacheError::TooLarge { .. } => PyValueError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

fn remote_exception(err: RemoteError) -> PyErr {
    let msg = err.to_string();
    match err {
        RemoteError::WriterGone { .. } | RemoteError::LostReaders { .. } => {
            PeerDiedError::new_err(msg)
        }
        RemoteError::Refused(_) | RemoteError::ReaderDropped { .. } => {
            PyConnectionError::new_err(msg)
        }
        _ => PyRuntimeError::new_err(msg),
    }
}

fn name_exception(err: NameError) -> PyErr {
    let msg = err.to_string();
    match err {
        NameError::NotFound { .. } | NameError::Gone { .. } => PyFileNotFoundError::new_err(msg),
        NameError::Taken { .. } | NameError::Undecidable { .. } | NameError::Contended { .. } => {
            PyFileExistsError::new_err(msg)
        }
        _ => PyRuntimeError::new_err(msg),
    }
}
