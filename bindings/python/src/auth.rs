//! Bindings for `shmq::auth`: the keyed MAC that the worker handshake
//! (`shmq.workers.protocol`) shares with the queue's remote stream.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use shmq::auth::{mac, mac_eq, SECRET_BYTES};

fn key(secret: &[u8]) -> PyResult<[u8; SECRET_BYTES]> {
    secret.try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "a secret is {SECRET_BYTES} bytes ({} hexadecimal digits), got {}",
            2 * SECRET_BYTES,
            secret.len()
        ))
    })
}

/// The MAC of `parts` under `secret` (32 bytes), in the domain `tag`.
#[pyfunction]
pub fn auth_mac<'py>(
    py: Python<'py>,
    secret: &[u8],
    tag: &[u8],
    parts: Vec<Vec<u8>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    Ok(PyBytes::new(py, &mac(&key(secret)?, tag, &parts)))
}

/// Whether `claimed` is the MAC of `parts` under `secret` in the domain `tag` (compared
/// in constant time).
#[pyfunction]
pub fn auth_check(
    secret: &[u8],
    tag: &[u8],
    parts: Vec<Vec<u8>>,
    claimed: &[u8],
) -> PyResult<bool> {
    let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    Ok(mac_eq(&mac(&key(secret)?, tag, &parts), claimed))
}
