//! How a message of several parts travels: a descriptor block that says where each part
//! is, followed (in a chunk) by the parts that are copied inline.
//!
//! A message of parts is a body (for Python: the pickle stream) and the out-of-band
//! buffers it refers to (tensor and array data). Each part is one of:
//! - **inline**: copied into the chunk after the descriptors (small parts);
//! - **frame**: a separate ZeroMQ frame of the same multipart message (over a socket);
//! - **arena**: a reference to bytes in the tensor arena (see [`crate::arena`]).
//!
//! ```text
//! 0   magic: u32 = "SQF1" (a body and its buffers) or "SQA1" (an array: its header and
//!     its data, see `super::array`)    4  n_parts: u32
//! 8   n_parts descriptors of 32 bytes:
//!       +0 kind: u32 (1 inline, 2 frame, 3 arena)   +4 lease: u32   +8 generation: u32
//!       +16 offset: u64 (inline: from the block's start; frame: frame number; arena:
//!           offset in the arena's data region)      +24 len: u64
//! ..  inline parts, each starting 8-aligned
//! ```
//! Everything a peer wrote is checked before use: counts and ranges are bounded by the
//! bytes (or frames) actually there.
//!
//! **Raw bytes or a message of parts** is never guessed from the bytes (a raw message may
//! start with anything, "SQF1" included): it is said outside them. In the ring, by the
//! chunk's kind in its metadata (`Framed` for parts, `Body` for a message of one part
//! copied as it is, with no descriptors, from `enqueue_body`; `Inline` / `Raw` for bytes
//! from `enqueue` / `acquire_write`). Over a socket (overflow, remote), by the frame count:
//! raw bytes are one frame, a message of parts is the descriptor block and at least one
//! more (the writer adds an empty frame, named by no descriptor, when all its parts are in
//! the arena; a body is a block naming the frame after it). Python's
//! `MessageQueue.enqueue` always sends a message of parts (the pickle stream is the body;
//! with no buffers, through `enqueue_body`), and `enqueue_bytes` raw bytes, so each side
//! tells a pickled object from raw bytes and refuses the one it was not asked for with an
//! error naming the mismatch (Rust `dequeue`: `InvalidArgument`; Python `dequeue`:
//! `shmq.MessageKindError`, a `ValueError`), the message consumed, the reader usable.

use crate::arena::ArenaRef;
use crate::error::{Error, Result};

const MAGIC: u32 = u32::from_le_bytes(*b"SQF1");
const MAGIC_ARRAY: u32 = u32::from_le_bytes(*b"SQA1");
const HEADER: usize = 8;
const DESC: usize = 32;
const KIND_INLINE: u32 = 1;
const KIND_FRAME: u32 = 2;
const KIND_ARENA: u32 = 3;

/// Where one part of a message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartRef {
    /// `len` bytes at `offset` from the start of the descriptor block.
    Inline { offset: usize, len: usize },
    /// ZeroMQ frame number `index` of the same multipart message.
    Frame { index: usize },
    /// Bytes in the tensor arena.
    Arena(ArenaRef),
}

/// Bytes of a descriptor block for `n` parts (inline data not included).
pub fn header_len(n: usize) -> usize {
    HEADER + DESC * n
}

/// Where inline data of `len` bytes goes after `at` (8-aligned).
pub fn align(at: usize) -> usize {
    at.div_ceil(8) * 8
}

/// What a message of parts is: a body and the buffers it refers to (for Python, a pickle
/// stream and its out-of-band buffers), or a typed array (its header and its data, see
/// `super::array`). Said by the descriptor block's magic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Parts,
    Array,
}

/// Write the descriptor block for `parts` into `out` (at least `header_len` long).
pub fn encode(parts: &[PartRef], out: &mut [u8]) {
    encode_as(Format::Parts, parts, out)
}

/// [`encode`] for a message of `format`.
pub fn encode_as(format: Format, parts: &[PartRef], out: &mut [u8]) {
    let magic = match format {
        Format::Parts => MAGIC,
        Format::Array => MAGIC_ARRAY,
    };
    out[0..4].copy_from_slice(&magic.to_le_bytes());
    out[4..8].copy_from_slice(&(parts.len() as u32).to_le_bytes());
    for (i, p) in parts.iter().enumerate() {
        let d = &mut out[HEADER + DESC * i..HEADER + DESC * (i + 1)];
        let (kind, lease, generation, offset, len) = match *p {
            PartRef::Inline { offset, len } => (KIND_INLINE, 0, 0, offset as u64, len as u64),
            PartRef::Frame { index } => (KIND_FRAME, 0, 0, index as u64, 0),
            PartRef::Arena(a) => (KIND_ARENA, a.lease, a.generation, a.offset, a.len),
        };
        d[0..4].copy_from_slice(&kind.to_le_bytes());
        d[4..8].copy_from_slice(&lease.to_le_bytes());
        d[8..12].copy_from_slice(&generation.to_le_bytes());
        d[12..16].fill(0);
        d[16..24].copy_from_slice(&offset.to_le_bytes());
        d[24..32].copy_from_slice(&len.to_le_bytes());
    }
}

/// The descriptor block `parts` as a new vector (for a frame of its own).
pub fn encode_vec(format: Format, parts: &[PartRef]) -> Vec<u8> {
    let mut v = vec![0; header_len(parts.len())];
    encode_as(format, parts, &mut v);
    v
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Read a descriptor block. `block` is the whole chunk data (inline parts must lie inside
/// it) or a frame of its own; `frames` is how many frames follow it.
///
/// # Errors
///
/// [`Error::InvalidArgument`] ("malformed message") for a block without the framing header,
/// a part count over the limit, a part that lies outside `block`, or a frame count other
/// than `frames`.
pub fn decode(block: &[u8], frames: usize) -> Result<Vec<PartRef>> {
    decode_as(block, frames).map(|(_, parts)| parts)
}

/// [`decode`], and what the message is.
pub fn decode_as(block: &[u8], frames: usize) -> Result<(Format, Vec<PartRef>)> {
    let bad = |why: &str| Error::InvalidArgument(format!("malformed message: {why}"));
    let format = match (block.len() >= HEADER).then(|| u32_at(block, 0)) {
        Some(MAGIC) => Format::Parts,
        Some(MAGIC_ARRAY) => Format::Array,
        _ => return Err(bad("no part descriptors")),
    };
    let n = u32_at(block, 4) as usize;
    if n == 0 || n > (block.len() - HEADER) / DESC {
        return Err(bad("bad part count"));
    }
    let parts = (0..n)
        .map(|i| {
            let d = HEADER + DESC * i;
            let (kind, offset, len) = (
                u32_at(block, d),
                u64_at(block, d + 16),
                u64_at(block, d + 24),
            );
            match kind {
                KIND_INLINE => {
                    let end = offset.checked_add(len).filter(|&e| e <= block.len() as u64);
                    if end.is_none() || offset < header_len(n) as u64 {
                        return Err(bad("an inline part outside the message"));
                    }
                    Ok(PartRef::Inline {
                        offset: offset as usize,
                        len: len as usize,
                    })
                }
                KIND_FRAME if (offset as usize) < frames && offset > 0 => Ok(PartRef::Frame {
                    index: offset as usize,
                }),
                KIND_ARENA => Ok(PartRef::Arena(ArenaRef {
                    lease: u32_at(block, d + 4),
                    generation: u32_at(block, d + 8),
                    offset,
                    len,
                })),
                _ => Err(bad("an unknown part kind or a missing frame")),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((format, parts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_hostile_blocks() {
        let parts = [
            PartRef::Inline {
                offset: 104,
                len: 3,
            },
            PartRef::Frame { index: 1 },
            PartRef::Arena(ArenaRef {
                lease: 7,
                generation: 9,
                offset: 4096,
                len: 100,
            }),
        ];
        let mut block = vec![0u8; 120];
        encode(&parts, &mut block);
        assert_eq!(decode(&block, 2).unwrap(), parts);
        let mut array = block.clone();
        encode_as(Format::Array, &parts, &mut array);
        assert_eq!(
            decode_as(&array, 2).unwrap(),
            (Format::Array, parts.to_vec())
        );
        // Too few frames, a short block, a bad magic, a huge count: errors, no panic.
        assert!(decode(&block, 1).is_err());
        assert!(decode(&block[..100], 2).is_err());
        let mut b = block.clone();
        b[0] = 0;
        assert!(decode(&b, 2).is_err());
        let mut b = block.clone();
        b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&b, 2).is_err());
        let mut b = block.clone();
        b[8 + 16..8 + 24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode(&b, 2).is_err());
        for len in 0..block.len() {
            let _ = decode(&block[..len], 3);
        }
    }
}
