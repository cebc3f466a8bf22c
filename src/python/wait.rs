//! Running a core wait from Python: the GIL is released for the wait, and every few
//! milliseconds the wait re-takes it to check for signals (Ctrl-C) and the caller's
//! cancel event.

use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::error::{Error, Result};
use crate::wait::Wait;

/// Seconds (float or None) to a Duration; negative or NaN is a `ValueError`.
pub(crate) fn timeout_arg(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Some(Duration::from_secs_f64(t))),
        Some(t) if t == f64::INFINITY => Ok(None),
        Some(t) => Err(PyValueError::new_err(format!(
            "timeout must be a non-negative number of seconds, got {t}"
        ))),
    }
}

/// What may end a blocking call early, besides its timeout.
pub(crate) struct Interrupts<'a, 'py> {
    pub timeout: Option<f64>,
    pub cancel: Option<&'a Bound<'py, PyAny>>,
    pub shutdown: &'a AtomicBool,
    pub quiet: bool,
}

/// Run `f` with the GIL released, under a [`Wait`] built from `what` and `interrupts`.
pub(crate) fn blocking<T, F>(
    py: Python<'_>,
    what: &str,
    interrupts: Interrupts<'_, '_>,
    f: F,
) -> PyResult<T>
where
    T: Send,
    F: FnOnce(&mut Wait<'_>) -> Result<T> + Send,
{
    let timeout = timeout_arg(interrupts.timeout)?;
    let cancel: Option<Py<PyAny>> = interrupts
        .cancel
        .filter(|c| !c.is_none())
        .map(|c| c.clone().unbind());
    let shutdown = interrupts.shutdown;
    let quiet = interrupts.quiet;
    let mut raised: Option<PyErr> = None;
    let result = py.detach(|| {
        let mut hook = || -> Result<()> {
            Python::attach(|py| {
                let checked = py.check_signals().and_then(|()| match &cancel {
                    Some(c) => c.bind(py).call_method0("is_set")?.is_truthy(),
                    None => Ok(false),
                });
                match checked {
                    Ok(false) => Ok(()),
                    Ok(true) => Err(Error::Cancelled),
                    Err(e) => {
                        raised = Some(e);
                        Err(Error::Cancelled)
                    }
                }
            })
        };
        let mut wait = Wait::new(what, timeout)
            .cancel_on(shutdown)
            .with_hook(&mut hook);
        if quiet {
            wait = wait.quiet();
        }
        f(&mut wait)
    });
    match raised {
        Some(e) => Err(e),
        None => result.map_err(PyErr::from),
    }
}

/// Lock `m` without ever blocking while holding the GIL: another thread may hold the
/// lock while it waits for the GIL.
pub(crate) fn lock<'a, T: Send>(py: Python<'_>, m: &'a Mutex<T>) -> MutexGuard<'a, T> {
    loop {
        match m.try_lock() {
            Ok(g) => return g,
            Err(TryLockError::Poisoned(p)) => return p.into_inner(),
            Err(TryLockError::WouldBlock) => py.detach(|| drop(m.lock())),
        }
    }
}
