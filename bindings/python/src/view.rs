//! `ShmView`: a buffer-protocol object over a range of a mapped segment, so Python gets
//! zero-copy `memoryview`s. The view holds the segment (`Arc`), so the memory stays
//! mapped as long as any memoryview of it exists.

use shmq_protocol::sync::local::{AtomicBool, AtomicUsize, Ordering};
use std::os::raw::{c_int, c_void};
use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use shmq::private_map::SharedView;

use crate::errors::OrRaise;

/// Anything that keeps a mapping alive.
pub(crate) type Owner = Arc<dyn Send + Sync>;

/// Where a view's bytes lie in this process's shared read-only mapping of their segment
/// (`PrivateFile::shared`): what a device registers once and copies from.
pub(crate) type SharedSource =
    Box<dyn Fn() -> shmq::Result<(Arc<SharedView>, usize)> + Send + Sync>;

/// A window into mapped memory; use `memoryview(view)`. Writable (a private view, a
/// frame, a chunk being written), except a whole shared mapping's (`shared_source()`),
/// which is exported read-only.
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
    /// Exported read-only (a shared mapping made `PROT_READ`).
    readonly: bool,
    /// See [`SharedSource`]; `None` for memory that has no shared mapping to copy from.
    shared: Option<SharedSource>,
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
            readonly: false,
            shared: None,
            _owner: owner,
        }
    }

    /// This view, telling where its bytes lie in a shared mapping (`shared_source()`).
    pub(crate) fn with_shared(mut self, source: SharedSource) -> ShmView {
        self.shared = Some(source);
        self
    }

    /// A read-only view of a whole shared mapping. The pointer stays valid while the view
    /// lives: the view holds the mapping's `Arc` (`_owner`), which unmaps only when the last
    /// holder drops it; exports are read-only (`readonly`), as the mapping is `PROT_READ`.
    fn of_shared(mapping: Arc<SharedView>) -> ShmView {
        let (ptr, len) = (mapping.as_ptr() as *mut u8, mapping.len());
        ShmView {
            ptr: ptr as usize,
            len,
            exports: AtomicUsize::new(0),
            revoked: AtomicBool::new(false),
            readonly: true,
            shared: None,
            _owner: mapping,
        }
    }
}

#[pymethods]
impl ShmView {
    fn __len__(&self) -> usize {
        self.len
    }

    /// `(mapping, offset)`: this process's shared read-only mapping of the segment these
    /// bytes lie in (a read-only view of all of it; the same mapping on every call) and
    /// where they lie in it, or None for bytes that have none (a frame, a copy). What a
    /// device registers once and copies from (`shmq._device_reader`); the bytes there are
    /// the segment's own, so they stay as sent only while this view lives.
    fn shared_source(&self, py: Python<'_>) -> PyResult<Option<(ShmView, usize)>> {
        let Some(source) = self.shared.as_ref() else {
            return Ok(None);
        };
        let (mapping, offset) = py.detach(source).or_raise()?;
        Ok(Some((ShmView::of_shared(mapping), offset)))
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
                // A read-only view refuses a writable export (PyBUF_WRITABLE).
                c_int::from(slf.get().readonly),
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
