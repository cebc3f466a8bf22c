//! Bindings for `shmq::names`: queues and stores by name, the protocol Python's
//! `shmq._names` (`MessageQueue.open`, `ObjectStorage.open`) and Rust's
//! `Reader::open_by_name` share. Records go in and out as JSON text; `shmq._names` turns
//! them into dicts.

use std::sync::Mutex;

use pyo3::prelude::*;

use shmq::names::{self, Kind};

use crate::errors::OrRaise;

/// A name held by this process (`shmq::names::NameClaim`): its record is removed and the
/// name let go by `release()`, or when the process ends. As the Python package has
/// always done, a claim collected without `release()` keeps the name until the process
/// ends (its descriptor is left open: the kernel lets the lock go at exit, and the dead
/// record is removed by the next writer of the user); `MessageQueue` and `ObjectStorage`
/// release theirs when shut down or collected.
#[pyclass(module = "shmq._core", frozen, weakref)]
pub struct NameClaim {
    /// `None` once released.
    claim: Mutex<Option<names::NameClaim>>,
    kind: &'static str,
    name: String,
    path: String,
}

impl NameClaim {
    fn claim(&self) -> std::sync::MutexGuard<'_, Option<names::NameClaim>> {
        self.claim.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for NameClaim {
    fn drop(&mut self) {
        let held = self
            .claim
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        // Held until the process ends (see the type's docs): its descriptor and lock are
        // left to the kernel.
        std::mem::forget(held);
    }
}

#[pymethods]
impl NameClaim {
    /// Remove the record (if it is still this one) and let the name go. Idempotent; a
    /// no-op in a forked child.
    fn release(&self) {
        let held = self.claim().take();
        drop(held); // `names::NameClaim`'s drop releases it
    }

    /// Whether the name is still held by this process.
    #[getter]
    fn is_held(&self) -> bool {
        self.claim().as_ref().is_some_and(|c| c.is_held())
    }

    /// `"queue"` or `"store"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// The name held.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Where its record is.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    fn __repr__(&self) -> String {
        format!("NameClaim({} {:?}, {})", self.kind, self.name, self.path)
    }
}

/// This user's directory of names (made if missing and `create`); `None` when there is
/// none yet.
#[pyfunction]
#[pyo3(signature = (create = false))]
pub fn names_directory(py: Python<'_>, create: bool) -> PyResult<Option<String>> {
    py.detach(|| names::directory(create)).or_raise()
}

/// Where the record of the `kind` named `name` is (or would be); `None` when this user
/// has no directory of names yet and `create` is false.
#[pyfunction]
#[pyo3(signature = (kind, name, create = false))]
pub fn names_record_path(
    py: Python<'_>,
    kind: &str,
    name: &str,
    create: bool,
) -> PyResult<Option<String>> {
    let kind = Kind::parse(kind).or_raise()?;
    py.detach(|| names::record_path(kind, name, create))
        .or_raise()
}

/// Hold `name` for this process, recording `details` (a JSON object's text) under it.
#[pyfunction]
pub fn names_claim(py: Python<'_>, kind: &str, name: &str, details: &str) -> PyResult<NameClaim> {
    let kind = Kind::parse(kind).or_raise()?;
    let claim = py.detach(|| names::claim(kind, name, details)).or_raise()?;
    Ok(NameClaim {
        kind: kind.as_str(),
        name: claim.name().to_owned(),
        path: claim.path().to_owned(),
        claim: Mutex::new(Some(claim)),
    })
}

/// The record of the live writer of the `kind` named `name`, as JSON text.
#[pyfunction]
pub fn names_lookup(py: Python<'_>, kind: &str, name: &str) -> PyResult<String> {
    let kind = Kind::parse(kind).or_raise()?;
    Ok(py
        .detach(|| names::lookup(kind, name))
        .or_raise()?
        .to_json())
}

/// Add the names' classes, functions and constants to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NameClaim>()?;
    m.add_function(wrap_pyfunction!(names_directory, m)?)?;
    m.add_function(wrap_pyfunction!(names_record_path, m)?)?;
    m.add_function(wrap_pyfunction!(names_claim, m)?)?;
    m.add_function(wrap_pyfunction!(names_lookup, m)?)?;
    m.add("NAMES_DIRECTORY_ENV", names::DIRECTORY_ENV)?;
    Ok(())
}
