//! The one place where core errors become Python exceptions.

use pyo3::exceptions::{
    PyConnectionError, PyFileNotFoundError, PyKeyError, PyMemoryError, PyOSError,
    PyPermissionError, PyRuntimeError, PyTimeoutError, PyValueError,
};
use pyo3::{PyErr, PyResult};

use shmq::error::Error;

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

/// `result.or_raise()?`: a core result as PyO3's, its error the Python exception that
/// [`exception`] makes. Every core call's `?` in this crate goes through it
/// (`From<shmq::Error> for PyErr` cannot be written here: both types are other crates').
pub trait OrRaise<T> {
    fn or_raise(self) -> PyResult<T>;
}

impl<T> OrRaise<T> for shmq::Result<T> {
    fn or_raise(self) -> PyResult<T> {
        self.map_err(exception)
    }
}

/// The Python exception for a core error: its type by the error's variant, its message the
/// error's text.
pub fn exception(err: Error) -> PyErr {
    let msg = err.to_string();
    match err {
        Error::Timeout { .. } | Error::WorkersNotReady { .. } => PyTimeoutError::new_err(msg),
        Error::Cancelled => PyRuntimeError::new_err("cancelled"),
        Error::NoSpace { .. } | Error::Full(_) | Error::CacheFull { .. } => {
            PyMemoryError::new_err(msg)
        }
        Error::UnknownKey(key) => PyKeyError::new_err(key),
        Error::StaleObject { .. }
        | Error::BadSignature { .. }
        | Error::KeyExists(_)
        | Error::TooLarge { .. } => PyValueError::new_err(msg),
        Error::SegmentNotFound { .. } => PyFileNotFoundError::new_err(msg),
        Error::BadSegment { .. } | Error::SegmentExists { .. } | Error::InvalidArgument(_) => {
            PyValueError::new_err(msg)
        }
        Error::WrongRole(_) | Error::WorkerDied { .. } => PyRuntimeError::new_err(msg),
        Error::Os { ref source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => {
            PyPermissionError::new_err(msg)
        }
        Error::Os { .. } | Error::Transport { .. } => PyOSError::new_err(msg),
        Error::Remote(_) | Error::ReaderDropped { .. } => PyConnectionError::new_err(msg),
        Error::DeadReader { .. } | Error::DeadWriter { .. } | Error::RemoteWriterGone { .. } => {
            PeerDiedError::new_err(msg)
        }
        Error::ShutDown | Error::WriterShutDown { .. } | Error::WriterGoneMidMessage => {
            QueueShutDownError::new_err(msg)
        }
        // A variant added to the core after this list: a RuntimeError until it has a
        // line of its own here.
        _ => PyRuntimeError::new_err(msg),
    }
}
