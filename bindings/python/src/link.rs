//! Bindings for `shmq::workers::link`: the worker link's handshake messages and seals,
//! which `shmq.workers.protocol` sends over Python's sockets (the deadlines and the
//! parent's handshake slots are the Python supervisor's).

use std::sync::Mutex;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use shmq::auth::{secret_from_text, to_hex, SECRET_BYTES};
use shmq::workers::link::{self, Hello, SealIn, SealOut, Side};

use crate::errors::OrRaise;

fn token(text: &str) -> PyResult<[u8; SECRET_BYTES]> {
    secret_from_text(text).ok_or_else(|| {
        PyValueError::new_err(format!(
            "a token is {} hexadecimal digits ({SECRET_BYTES} bytes)",
            2 * SECRET_BYTES
        ))
    })
}

fn kind(kind: &[u8]) -> PyResult<u8> {
    match kind {
        [k] => Ok(*k),
        _ => Err(PyValueError::new_err(format!(
            "a frame's kind is 1 byte, got {}",
            kind.len()
        ))),
    }
}

/// The worker's proof of the token (`link::hello_mac`), as hexadecimal digits.
#[pyfunction]
fn link_hello_mac(
    token_text: &str,
    parent_nonce: &str,
    rank: u64,
    pid: u64,
    host: &str,
    worker_nonce: &str,
) -> PyResult<String> {
    let mac = link::hello_mac(
        &token(token_text)?,
        parent_nonce,
        rank,
        pid,
        host,
        worker_nonce,
    );
    Ok(to_hex(&mac))
}

/// The parent's proof of the token (`link::welcome_mac`), as hexadecimal digits.
#[pyfunction]
fn link_welcome_mac(
    token_text: &str,
    worker_nonce: &str,
    parent_nonce: &str,
    rank: u64,
) -> PyResult<String> {
    let mac = link::welcome_mac(&token(token_text)?, worker_nonce, parent_nonce, rank);
    Ok(to_hex(&mac))
}

/// Whether `claimed` (hexadecimal digits) is the 32-byte MAC `want` (hexadecimal
/// digits), compared in constant time.
#[pyfunction]
fn link_proof_eq(want: &str, claimed: &str) -> bool {
    match (secret_from_text(want), secret_from_text(claimed)) {
        (Some(want), Some(claimed)) => shmq::auth::mac_eq(&want, &claimed),
        _ => false,
    }
}

/// The length in a frame's 4-byte `header`, if it is 1 to `max` (`link::frame_length`):
/// over `max`, `ConnectionError` for a handshake frame (`handshake`), else `ValueError`,
/// both naming `peer` and the limit; 0: `ValueError`.
#[pyfunction]
fn link_frame_length(header: &[u8], max: usize, peer: &str, handshake: bool) -> PyResult<usize> {
    let word: [u8; 4] = header.try_into().map_err(|_| {
        PyValueError::new_err(format!("a frame's header is 4 bytes, got {}", header.len()))
    })?;
    link::frame_length(word, max, peer, handshake)
        .map_err(shmq::workers::Error::from)
        .or_raise()
}

/// The parent's challenge's payload.
#[pyfunction]
fn link_challenge<'py>(py: Python<'py>, nonce: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &link::challenge_payload(nonce))
}

/// The parent's nonce from its challenge; `ConnectionError` for no shmq parent's,
/// `PermissionError` for another protocol version's.
#[pyfunction]
fn link_read_challenge(frame_kind: &[u8], payload: &[u8], peer: &str) -> PyResult<String> {
    link::read_challenge(kind(frame_kind)?, payload, peer)
        .map_err(shmq::workers::Error::from)
        .or_raise()
}

/// A worker's hello: (its payload, its fresh nonce).
#[pyfunction]
fn link_hello<'py>(
    py: Python<'py>,
    token_text: &str,
    parent_nonce: &str,
    rank: u32,
    pid: u32,
    host: &str,
) -> PyResult<(Bound<'py, PyBytes>, String)> {
    let hello = Hello::new(&token(token_text)?, parent_nonce, rank, pid, host).or_raise()?;
    Ok((PyBytes::new(py, &hello.encode()), hello.nonce))
}

/// The hello in a frame, checked (`link::Hello::check`): (rank, pid, host, nonce);
/// `ValueError` with the reason it is refused.
#[pyfunction]
fn link_check_hello(
    token_text: &str,
    parent_nonce: &str,
    frame_kind: &[u8],
    payload: &[u8],
) -> PyResult<(u32, u32, String, String)> {
    let hello = Hello::check(
        kind(frame_kind)?,
        payload,
        &token(token_text)?,
        parent_nonce,
    )
    .map_err(PyValueError::new_err)?;
    Ok((hello.rank, hello.pid, hello.host, hello.nonce))
}

/// The parent's answer admitting worker `rank`.
#[pyfunction]
fn link_welcome<'py>(
    py: Python<'py>,
    token_text: &str,
    worker_nonce: &str,
    parent_nonce: &str,
    rank: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let payload = link::welcome_payload(&token(token_text)?, worker_nonce, parent_nonce, rank);
    Ok(PyBytes::new(py, &payload))
}

/// The parent's answer refusing a worker.
#[pyfunction]
fn link_refusal<'py>(py: Python<'py>, error: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &link::refusal_payload(error))
}

/// Check the parent's answer (`link::read_answer`): `PermissionError` if it refused
/// the worker or cannot prove the token.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn link_read_answer(
    frame_kind: &[u8],
    payload: &[u8],
    token_text: &str,
    worker_nonce: &str,
    parent_nonce: &str,
    rank: u32,
    peer: &str,
) -> PyResult<()> {
    let token = token(token_text)?;
    link::read_answer(
        kind(frame_kind)?,
        payload,
        &token,
        worker_nonce,
        parent_nonce,
        rank,
        peer,
    )
    .map_err(shmq::workers::Error::from)
    .or_raise()
}

/// The seals of one end of a link (`link::SealOut`, `link::SealIn`): `seal` for the
/// frames it sends, `open` for those it receives (`ValueError` for one that is not the
/// peer's or out of turn).
#[pyclass(module = "shmq._core", frozen)]
pub struct LinkSeal {
    out: Mutex<SealOut>,
    into: Mutex<SealIn>,
}

#[pymethods]
impl LinkSeal {
    #[new]
    fn new(key: &[u8], session: &[u8], parent: bool) -> PyResult<Self> {
        let key: [u8; SECRET_BYTES] = key.try_into().map_err(|_| {
            PyValueError::new_err(format!(
                "a secret is {SECRET_BYTES} bytes, got {}",
                key.len()
            ))
        })?;
        let side = if parent { Side::Parent } else { Side::Worker };
        Ok(LinkSeal {
            out: Mutex::new(SealOut::new(&key, session, side)),
            into: Mutex::new(SealIn::new(&key, session, side)),
        })
    }

    /// The body of the next frame of `kind` sent: its number, its seal, `payload`.
    fn seal<'py>(
        &self,
        py: Python<'py>,
        frame_kind: &[u8],
        payload: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let k = kind(frame_kind)?;
        let body = self
            .out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .seal(k, payload);
        Ok(PyBytes::new(py, &body))
    }

    /// The payload of a frame received with `kind` and `body` (any contiguous bytes-like
    /// object: the receiver reads a frame into a `bytearray`), if it is the peer's next.
    fn open<'py>(
        &self,
        py: Python<'py>,
        frame_kind: &[u8],
        body: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let k = kind(frame_kind)?;
        let export = PyUntypedBuffer::get(body)?;
        if !export.is_c_contiguous() {
            return Err(PyValueError::new_err("a frame's body must be contiguous"));
        }
        // SAFETY: the export is held (and the GIL with it, never released here) until the
        // slice's last use below: its exporter can neither free nor resize the memory
        // meanwhile, and no Python thread runs to write into it; it is C-contiguous, so
        // its `len_bytes()` bytes from `buf_ptr()` are its data.
        let body = unsafe {
            std::slice::from_raw_parts(export.buf_ptr() as *const u8, export.len_bytes())
        };
        let mut into = self.into.lock().unwrap_or_else(|e| e.into_inner());
        let payload = into
            .open(k, body)
            .map_err(shmq::workers::Error::from)
            .or_raise()?;
        Ok(PyBytes::new(py, payload))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("LINK_PROTOCOL_VERSION", link::PROTOCOL_VERSION)?;
    m.add("LINK_MAX_FRAME", link::MAX_FRAME)?;
    m.add("LINK_MAX_HELLO_FRAME", link::MAX_HELLO_FRAME)?;
    m.add("LINK_SEAL_BYTES", link::SEAL_BYTES)?;
    m.add(
        "LINK_HANDSHAKE_TIMEOUT",
        link::HANDSHAKE_TIMEOUT.as_secs_f64(),
    )?;
    m.add_class::<LinkSeal>()?;
    m.add_function(wrap_pyfunction!(link_hello_mac, m)?)?;
    m.add_function(wrap_pyfunction!(link_welcome_mac, m)?)?;
    m.add_function(wrap_pyfunction!(link_proof_eq, m)?)?;
    m.add_function(wrap_pyfunction!(link_frame_length, m)?)?;
    m.add_function(wrap_pyfunction!(link_challenge, m)?)?;
    m.add_function(wrap_pyfunction!(link_read_challenge, m)?)?;
    m.add_function(wrap_pyfunction!(link_hello, m)?)?;
    m.add_function(wrap_pyfunction!(link_check_hello, m)?)?;
    m.add_function(wrap_pyfunction!(link_welcome, m)?)?;
    m.add_function(wrap_pyfunction!(link_refusal, m)?)?;
    m.add_function(wrap_pyfunction!(link_read_answer, m)?)?;
    Ok(())
}
