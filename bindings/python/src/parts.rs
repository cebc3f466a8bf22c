//! Messages and objects made of several bytes-like parts: their buffer exports and the
//! bytes those exports pin, shared by the queue, the object store and the encoder cache.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// Buffer exports of a list of parts, and where each one's bytes are (address, length):
/// valid while the exports are held.
pub(super) type Exports = (Vec<PyUntypedBuffer>, Vec<(usize, usize)>);

/// Contiguous buffers of `parts`, and their spans; `not_contiguous(i)` words the error
/// for part `i` if it is not C-contiguous.
pub(super) fn buffers(
    parts: &Bound<'_, PyList>,
    not_contiguous: impl FnOnce(usize) -> String,
) -> PyResult<Exports> {
    let bufs = parts
        .iter()
        .map(|p| PyUntypedBuffer::get(&p))
        .collect::<PyResult<Vec<_>>>()?;
    if let Some(i) = bufs.iter().position(|b| !b.is_c_contiguous()) {
        return Err(PyValueError::new_err(not_contiguous(i)));
    }
    let spans = bufs
        .iter()
        .map(|b| (b.buf_ptr() as usize, b.len_bytes()))
        .collect();
    Ok((bufs, spans))
}

/// The bytes of `spans`.
///
/// # Safety
/// Each span must be a live, contiguous buffer export, held for as long as the slices
/// are used.
pub(super) unsafe fn slices<'a>(spans: &[(usize, usize)]) -> Vec<&'a [u8]> {
    spans
        .iter()
        // SAFETY: the caller's contract; an exporter cannot free or resize a buffer while
        // an export is held. (Another thread may still write into it: then the bytes sent
        // or saved are whatever it wrote, as with any buffer being sent or saved.)
        .map(|&(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) })
        .collect()
}
