//! One thread waiting for several local readers at once (`shmq::broadcast::wait_any`):
//! `ReadyTarget` (what to watch for one reader's next message), `WakeWord` (the waiter's
//! own word, to end its sleep from another thread) and `wait_any()`, which sleeps with
//! the GIL released. `shmq._aio` (an event loop's waiter) and `shmq.Gather` build on it.

use std::sync::Arc;

use pyo3::prelude::*;

use shmq::broadcast::wait_any as core;

use crate::broadcast::Reader;
use crate::errors::OrRaise;
use crate::wait::{duration, Timeout};

/// What tells whether a local reader's next call returns at once, watched without the
/// reader: taken with `ready_target(reader)` before each wait (it names the chunk the
/// reader reads next).
#[pyclass(module = "shmq._core", frozen)]
pub struct ReadyTarget {
    inner: core::ReadyTarget,
}

#[pymethods]
impl ReadyTarget {
    /// Whether the reader's next call returns at once (a message, the writer's shutdown,
    /// or the reader cancelled).
    fn ready(&self) -> bool {
        self.inner.ready()
    }

    /// Raise the reader's `PeerDiedError` if its writer is proved dead.
    fn check_writer(&self) -> PyResult<()> {
        self.inner.check_writer().or_raise()
    }

    /// The ring's segment name.
    #[getter]
    fn queue(&self) -> &str {
        self.inner.queue()
    }
}

/// A waiter's wake word: `wake()` ends a `wait_any` given a value `current()` returned
/// before.
#[pyclass(module = "shmq._core", frozen)]
pub struct WakeWord {
    word: Arc<core::WakeWord>,
}

#[pymethods]
impl WakeWord {
    #[new]
    fn new() -> WakeWord {
        WakeWord {
            word: Arc::default(),
        }
    }

    fn current(&self) -> u32 {
        self.word.current()
    }

    fn wake(&self) {
        core::wake(&self.word)
    }
}

/// The target of `reader`'s next message; `None` for a remote reader. A reader that
/// another thread is using (in a blocking call) is waited for at most `timeout` seconds
/// (`TimeoutError`; 0: not at all, for an event loop's thread, which must not block).
#[pyfunction]
#[pyo3(signature = (reader, timeout=None))]
pub(crate) fn ready_target(
    py: Python<'_>,
    reader: PyRef<'_, Reader>,
    timeout: Option<Timeout>,
) -> PyResult<Option<ReadyTarget>> {
    Ok(reader
        .ready_target(py, timeout)?
        .map(|inner| ReadyTarget { inner }))
}

/// Sleep (GIL released) until one of `targets` is ready or its writer is proved dead,
/// `wake` no longer holds `wake_seen`, or `timeout` seconds pass. Returns the indices of
/// the targets ready (empty: woken, or timed out). `OSError` where the kernel has no
/// `futex_waitv` (Linux before 5.16).
#[pyfunction]
#[pyo3(signature = (targets, wake, wake_seen, timeout=None))]
pub(crate) fn wait_any(
    py: Python<'_>,
    targets: Vec<PyRef<'_, ReadyTarget>>,
    wake: PyRef<'_, WakeWord>,
    wake_seen: u32,
    timeout: Option<Timeout>,
) -> PyResult<Vec<usize>> {
    let targets: Vec<core::ReadyTarget> = targets.iter().map(|t| t.inner.clone()).collect();
    let word = wake.word.clone();
    let timeout = duration(timeout);
    py.detach(move || {
        let refs: Vec<&core::ReadyTarget> = targets.iter().collect();
        core::wait_any(&refs, &word, wake_seen, timeout)
    })
    .or_raise()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ReadyTarget>()?;
    m.add_class::<WakeWord>()?;
    m.add_function(wrap_pyfunction!(ready_target, m)?)?;
    m.add_function(wrap_pyfunction!(wait_any, m)?)?;
    Ok(())
}
