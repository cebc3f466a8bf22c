//! Bindings for `shmq::auth`: the keyed MAC and the message seal that the worker link
//! (`shmq.workers.protocol`) shares with the queue's remote stream.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use shmq::auth;
use shmq::auth::{mac, mac_eq, message_mac, new_secret, secret_to_text, SECRET_BYTES};

use crate::errors::OrRaise;

fn key(secret: &[u8]) -> PyResult<[u8; SECRET_BYTES]> {
    secret.try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "a secret is {SECRET_BYTES} bytes ({} hexadecimal digits), got {}",
            2 * SECRET_BYTES,
            secret.len()
        ))
    })
}

/// The secret that `text` spells in its one text form (a queue handle's, a worker
/// ticket's: `shmq::auth::secret_to_text`).
#[pyfunction]
pub fn secret_from_text<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyBytes>> {
    let secret = auth::secret_from_text(text).ok_or_else(|| {
        PyValueError::new_err(format!(
            "a secret is {} hexadecimal digits ({SECRET_BYTES} bytes), got {} characters",
            2 * SECRET_BYTES,
            text.chars().count()
        ))
    })?;
    Ok(PyBytes::new(py, &secret))
}

/// A new secret from the kernel, in its text form.
#[pyfunction]
pub fn new_secret_text() -> PyResult<String> {
    Ok(secret_to_text(
        &new_secret("a worker ticket's token").or_raise()?,
    ))
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

/// The seal of message `seq` of `session` (`shmq::auth::message_mac`): the MAC of the
/// session, the number and the `body` parts under `secret`, in the domain `tag`.
#[pyfunction]
pub fn auth_message_mac<'py>(
    py: Python<'py>,
    secret: &[u8],
    tag: &[u8],
    session: &[u8],
    seq: u64,
    body: Vec<Vec<u8>>,
) -> PyResult<Bound<'py, PyBytes>> {
    Ok(PyBytes::new(py, &seal(secret, tag, session, seq, &body)?))
}

/// Whether `claimed` is the seal of message `seq` of `session` (compared in constant
/// time).
#[pyfunction]
pub fn auth_message_check(
    secret: &[u8],
    tag: &[u8],
    session: &[u8],
    seq: u64,
    body: Vec<Vec<u8>>,
    claimed: &[u8],
) -> PyResult<bool> {
    Ok(mac_eq(&seal(secret, tag, session, seq, &body)?, claimed))
}

fn seal(
    secret: &[u8],
    tag: &[u8],
    session: &[u8],
    seq: u64,
    body: &[Vec<u8>],
) -> PyResult<[u8; 32]> {
    let body = body.iter().map(Vec::as_slice);
    Ok(message_mac(&key(secret)?, tag, session, seq, body))
}
