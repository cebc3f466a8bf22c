//! Frames on the wire, and the seal of each one after the handshake.

use std::io::{Read, Write};

use shmq_core::auth::{mac_eq, message_mac, SECRET_BYTES};

use super::LinkError;

/// Bytes in front of a sealed frame's payload: its 8-byte number and its 32-byte seal.
pub const SEAL_BYTES: usize = 8 + 32;

const PARENT_TO_WORKER: &[u8] = b"shmq worker link: parent to worker";
const WORKER_TO_PARENT: &[u8] = b"shmq worker link: worker to parent";

/// Which end of the link this is (each direction seals in a domain of its own, so a
/// frame reflected back to its sender fails).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The parent, which admits workers.
    Parent,
    /// A worker.
    Worker,
}

impl Side {
    fn tags(self) -> (&'static [u8], &'static [u8]) {
        match self {
            Side::Parent => (PARENT_TO_WORKER, WORKER_TO_PARENT),
            Side::Worker => (WORKER_TO_PARENT, PARENT_TO_WORKER),
        }
    }
}

/// The session of a link: both nonces' bytes, the parent's first.
pub(crate) fn session(
    parent_nonce: &[u8; SECRET_BYTES],
    worker_nonce: &[u8; SECRET_BYTES],
) -> Vec<u8> {
    [&parent_nonce[..], &worker_nonce[..]].concat()
}

/// Seals the frames one side sends: each carries its number (from 0) and the core's
/// message MAC over the session, the number, the kind and the payload.
#[derive(Clone)]
pub struct SealOut {
    key: [u8; SECRET_BYTES],
    session: Vec<u8>,
    tag: &'static [u8],
    next: u64,
}

/// Checks the frames one side receives: their seal, and that each is the one due next.
#[derive(Clone)]
pub struct SealIn {
    key: [u8; SECRET_BYTES],
    session: Vec<u8>,
    tag: &'static [u8],
    due: u64,
}

impl SealOut {
    /// The sealer of `side`'s frames under `key` in `session` (both nonces, see
    /// [`SealIn::new`]).
    pub fn new(key: &[u8; SECRET_BYTES], session: &[u8], side: Side) -> SealOut {
        SealOut {
            key: *key,
            session: session.to_vec(),
            tag: side.tags().0,
            next: 0,
        }
    }

    /// The body of the next frame of `kind`: its number, its seal, then `payload`.
    pub fn seal(&mut self, kind: u8, payload: &[u8]) -> Vec<u8> {
        let seq = self.next;
        let seal = message_mac(
            &self.key,
            self.tag,
            &self.session,
            seq,
            [&[kind][..], payload],
        );
        let mut body = Vec::with_capacity(SEAL_BYTES + payload.len());
        body.extend_from_slice(&seq.to_be_bytes());
        body.extend_from_slice(&seal);
        body.extend_from_slice(payload);
        self.next += 1;
        body
    }
}

impl SealIn {
    /// The checker of the frames `side` receives under `key` in `session`: the parent's
    /// nonce's bytes, then the worker's.
    pub fn new(key: &[u8; SECRET_BYTES], session: &[u8], side: Side) -> SealIn {
        SealIn {
            key: *key,
            session: session.to_vec(),
            tag: side.tags().1,
            due: 0,
        }
    }

    /// The payload of a received frame of `kind` whose body is `body`, if its seal is the
    /// peer's and it is the frame due next. Any error means the link is over.
    ///
    /// # Errors
    ///
    /// [`LinkError::Unsealed`] for a body shorter than a seal; [`LinkError::BadSeal`] when
    /// the seal is not the peer's (another key, or altered); [`LinkError::OutOfTurn`] for a
    /// frame not due next (replayed, dropped or reordered).
    pub fn open<'a>(&mut self, kind: u8, body: &'a [u8]) -> Result<&'a [u8], LinkError> {
        if body.len() < SEAL_BYTES {
            return Err(LinkError::Unsealed);
        }
        let seq = u64::from_be_bytes(body[..8].try_into().expect("8 bytes"));
        let (seal, payload) = (&body[8..SEAL_BYTES], &body[SEAL_BYTES..]);
        let want = message_mac(
            &self.key,
            self.tag,
            &self.session,
            seq,
            [&[kind][..], payload],
        );
        if !mac_eq(&want, seal) {
            return Err(LinkError::BadSeal);
        }
        if seq != self.due {
            return Err(LinkError::OutOfTurn {
                got: seq,
                due: self.due,
            });
        }
        self.due += 1;
        Ok(payload)
    }
}

/// Write one frame: `[4-byte big-endian length][kind][payload]`.
///
/// # Errors
///
/// [`LinkError::BadLength`] for a payload over `u32::MAX - 1` bytes; [`LinkError::Io`] when
/// the write fails (the peer gone).
pub fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> Result<(), LinkError> {
    let length = u32::try_from(payload.len() + 1).map_err(|_| LinkError::BadLength {
        length: payload.len() as u64 + 1,
        max: u32::MAX as usize,
    })?;
    let mut frame = Vec::with_capacity(5 + payload.len());
    frame.extend_from_slice(&length.to_be_bytes());
    frame.push(kind);
    frame.extend_from_slice(payload);
    w.write_all(&frame)
        .and_then(|()| w.flush())
        .map_err(|e| LinkError::io("sending a frame", e))
}

/// The length in a frame's 4-byte header `word` (its kind and payload), if it is 1 to
/// `max`. Over `max`: [`LinkError::HandshakeFrameTooLong`] with `handshake` (a challenge,
/// hello or answer), else [`LinkError::FrameTooLong`], both naming `peer` (the sender)
/// and the limit; 0: [`LinkError::BadLength`].
///
/// # Errors
///
/// [`LinkError::BadLength`] for a length of 0; over `max`,
/// [`LinkError::HandshakeFrameTooLong`] with `handshake`, else [`LinkError::FrameTooLong`],
/// each naming `peer`.
pub fn frame_length(
    word: [u8; 4],
    max: usize,
    peer: &str,
    handshake: bool,
) -> Result<usize, LinkError> {
    let length = u32::from_be_bytes(word);
    let (wide, peer) = (u64::from(length), peer.to_owned());
    match usize::try_from(length) {
        Ok(0) => Err(LinkError::BadLength { length: 0, max }),
        Ok(n) if n <= max => Ok(n),
        _ if handshake => Err(LinkError::HandshakeFrameTooLong {
            peer,
            length: wide,
            max,
        }),
        _ => Err(LinkError::FrameTooLong {
            peer,
            length: wide,
            max,
        }),
    }
}

/// Read one frame: its kind and payload. A length of 0 or over `max` is
/// [`LinkError::BadLength`], refused before anything more is read; see
/// [`read_frame_from`] for how the body is read.
///
/// # Errors
///
/// [`LinkError::BadLength`] for a length of 0 or over `max`; [`LinkError::Io`] (or the
/// connection's end, [`LinkError::Closed`]) when the header or body cannot be read whole.
pub fn read_frame(r: &mut impl Read, max: usize) -> Result<(u8, Vec<u8>), LinkError> {
    let mut word = [0u8; 4];
    r.read_exact(&mut word)
        .map_err(|e| LinkError::io("receiving a frame", e))?;
    let length = u32::from_be_bytes(word) as usize;
    if length == 0 || length > max {
        return Err(LinkError::BadLength {
            length: length as u64,
            max,
        });
    }
    read_body(r, length)
}

/// Read one frame from `peer`: its kind and payload. A length over `max` is refused as it
/// is read, before any of the body ([`frame_length`]: `handshake` for the handshake's
/// frames). The body is read as it comes: its buffer grows with the bytes that arrived
/// (at most doubling them, never to the claimed length up front), so a peer that claims
/// a long frame and sends little of it costs little; the payload is never copied.
///
/// # Errors
///
/// As [`frame_length`] for the header; [`LinkError::Io`] (or [`LinkError::Closed`]) when
/// the header or body cannot be read whole.
pub fn read_frame_from(
    r: &mut impl Read,
    max: usize,
    peer: &str,
    handshake: bool,
) -> Result<(u8, Vec<u8>), LinkError> {
    let mut word = [0u8; 4];
    r.read_exact(&mut word)
        .map_err(|e| LinkError::io("receiving a frame", e))?;
    let length = frame_length(word, max, peer, handshake)?;
    read_body(r, length)
}

/// The kind and the payload of a frame of `length` bytes (at least 1).
fn read_body(r: &mut impl Read, length: usize) -> Result<(u8, Vec<u8>), LinkError> {
    const FIRST: usize = 64 << 10;
    let mut kind = [0u8; 1];
    r.read_exact(&mut kind)
        .map_err(|e| LinkError::io("receiving a frame", e))?;
    let want = length - 1;
    let mut payload: Vec<u8> = Vec::new();
    let mut filled = 0;
    while filled < want {
        if filled == payload.len() {
            // Room for as much again as arrived (64 KiB at first), zeroed once here.
            let grow = (want - filled).min(filled.max(FIRST));
            payload.reserve_exact(grow);
            payload.resize(filled + grow, 0);
        }
        match r.read(&mut payload[filled..]) {
            Ok(0) => return Err(LinkError::Closed),
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(LinkError::io("receiving a frame", e)),
        }
    }
    Ok((kind[0], payload))
}
