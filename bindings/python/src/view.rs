//! `ShmView`: a buffer-protocol object over a range of a mapped segment, so Python gets
//! zero-copy `memoryview`s. The view holds the segment (`Arc`), so the memory stays
//! mapped as long as any memoryview of it exists.

use shmq_protocol::sync::local::{AtomicBool, AtomicUsize, Ordering};
use std::os::raw::{c_int, c_void};
use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// Anything that keeps a mapping alive.
pub(crate) type Owner = Arc<dyn Send + Sync>;

/// A writable window into shared memory; use `memoryview(view)`.
#[pyclass(module = "shmq._core", frozen)]
pub struct ShmView {
    ptr: usize,
    len: usize,
    /// Buffers exported and not yet released: memoryviews (and their slices, which
    /// share one export) and anything else holding the memory through the protocol.
    exports: AtomicUsize,
    /// Set once the memory may change under a new export (a chunk given back): new
    /// exports are refused.
    revoked: AtomicBool,
    _owner: Owner,
}

impl ShmView {
    /// Refuse new buffer exports from now on (existing ones are unaffected).
    pub(crate) fn revoke(&self) {
        // Relaxed: read with the GIL held, like the export count.
        self.revoked.store(true, Ordering::Relaxed);
    }

    /// Whether some object still holds this memory through the buffer protocol.
    pub(crate) fn is_exported(&self) -> bool {
        // Relaxed: the count is only changed and read with the GIL held.
        self.exports.load(Ordering::Relaxed) > 0
    }

    /// # Safety
    /// `ptr..ptr + len` must lie inside a mapping that `owner` keeps alive.
    pub(crate) unsafe fn new(owner: Owner, ptr: *mut u8, len: usize) -> ShmView {
        ShmView {
            ptr: ptr as usize,
            len,
            exports: AtomicUsize::new(0),
            revoked: AtomicBool::new(false),
            _owner: owner,
        }
    }
}

#[pymethods]
impl ShmView {
    fn __len__(&self) -> usize {
        self.len
    }

    /// # Safety
    /// Called by CPython with a valid `Py_buffer` to fill (the buffer protocol).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        // Relaxed: see `revoke`.
        if slf.get().revoked.load(Ordering::Relaxed) {
            return Err(PyBufferError::new_err(
                "this view was given back (its acquire_read block ended); views must not outlive it",
            ));
        }
        let (ptr, len) = (slf.get().ptr, slf.get().len);
        // SAFETY: `view` is the buffer struct CPython passes in; the memory range is
        // valid while `slf` is alive (constructor contract), and PyBuffer_FillInfo stores
        // a new reference to `slf` in the view, so the owner outlives every memoryview.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut c_void,
                len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::take(slf.py())
                .unwrap_or_else(|| PyBufferError::new_err("cannot export the buffer")));
        }
        // Relaxed: see `is_exported`.
        slf.get().exports.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// # Safety
    /// Called by CPython with a buffer this object filled.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        // Relaxed: see `is_exported`.
        self.exports.fetch_sub(1, Ordering::Relaxed);
    }
}
