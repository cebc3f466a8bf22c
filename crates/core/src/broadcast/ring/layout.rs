//! What a broadcast ring looks like in shared memory: the header, the shared words after
//! it, the geometry derived from `(n_reader, max_chunk_bytes, max_chunks)`, and what a
//! chunk can hold. Everything here is `#[repr(C)]`, pointer-free and addressed by offset
//! (see the layout in [`super`]); it uses nothing but the doorbell's words and the error
//! type.

use shmq_protocol::word::{FieldU8, FieldU32, FieldU64, PublishedU64, StatU64};

use crate::error::{Error, Result};
use shmq_os::segment::round_up;
use shmq_protocol::doorbell::DoorbellWords;

/// "SHMQRNG1" in little-endian: marks a finished broadcast-ring segment.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"SHMQRNG1");
/// Bumped whenever the layout changes; openers refuse any other version.
pub const LAYOUT_VERSION: u32 = 4;

pub(super) const CACHE_LINE: usize = 64;
pub(super) const SLOTS_OFFSET: usize = 320;
pub(super) const SLOT_SIZE: usize = 64;
pub(super) const STATE_LEN_OFFSET: usize = 0;
pub(super) const STATE_KIND_OFFSET: usize = 8;
pub(super) const STATE_FLAGS_OFFSET: usize = 16;
/// More readers than this would make the state blocks absurd; engines use a handful.
pub use shmq_os::segment::MAX_READERS;

/// What a chunk holds.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ChunkKind {
    /// Filled through the raw zero-copy API; `len` is the whole chunk.
    Raw = 0,
    /// A whole message of `len` bytes.
    Inline = 1,
    /// A mark: the message (`len` bytes) went over the overflow socket.
    Overflow = 2,
    /// A message of several parts (`len` bytes): part descriptors, then the parts copied
    /// inline; larger parts are in the tensor arena (see `super::framing`).
    Framed = 3,
    /// A message of one part, its body (`len` bytes, no part descriptors): a Python
    /// writer's pickled object with no out-of-band buffers (see `super::framing`).
    Body = 4,
}

impl ChunkKind {
    pub(super) fn from_u32(v: u32) -> ChunkKind {
        match v {
            1 => ChunkKind::Inline,
            2 => ChunkKind::Overflow,
            3 => ChunkKind::Framed,
            4 => ChunkKind::Body,
            _ => ChunkKind::Raw,
        }
    }
}

/// The segment header. Lives at offset 0 of the mapping.
#[repr(C)]
pub(super) struct RingHeader {
    pub(super) magic: PublishedU64,
    pub(super) version: u32,
    pub(super) n_reader: u32,
    pub(super) max_chunk_bytes: u64,
    pub(super) max_chunks: u64,
    pub(super) state_stride: u64,
    pub(super) states_offset: u64,
    pub(super) data_stride: u64,
    pub(super) data_offset: u64,
}
const _: () = assert!(std::mem::size_of::<RingHeader>() == 64);

/// Shared words after the header.
#[repr(C)]
pub(super) struct RingShared {
    pub(super) data_ready: DoorbellWords,
    pub(super) chunk_freed: DoorbellWords,
    pub(super) overflow_count: StatU64,
    /// Published by the magic (`Ring::create`).
    pub(super) creator_pid: FieldU32,
    pub(super) creator_start_time: FieldU64,
    /// The queue writer's statistics (see `super::stats`): parts copied into the tensor
    /// arena, parts sent from a loan without a copy, large parts copied inline for lack
    /// of arena room, messages sent to remote readers. Written by the writer only.
    pub(super) arena_parts: StatU64,
    pub(super) loaned_parts: StatU64,
    pub(super) fallback_parts: StatU64,
    pub(super) remote_sends: StatU64,
    /// The queue's name as its writer gave it (`QueueOptions::name`), UTF-8, NUL-padded;
    /// all zero for none. Written once by the creator, read by `inspect`, `top` and the
    /// metrics (see `Ring::label`).
    pub(super) label: [FieldU8; LABEL_BYTES],
}
const _: () = assert!(64 + std::mem::size_of::<RingShared>() <= SLOTS_OFFSET);

/// Bytes of a ring's label, its NUL padding included: a name is at most one less.
pub const LABEL_BYTES: usize = 64;

/// Sizes derived from the three parameters of a ring.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Geometry {
    pub(super) n_reader: usize,
    pub(super) max_chunk_bytes: usize,
    pub(super) max_chunks: usize,
    pub(super) state_stride: usize,
    pub(super) states_offset: usize,
    pub(super) data_stride: usize,
    pub(super) data_offset: usize,
    pub(super) total: usize,
}

impl Geometry {
    pub(super) fn new(
        n_reader: usize,
        max_chunk_bytes: usize,
        max_chunks: usize,
    ) -> Result<Geometry> {
        if n_reader == 0 || n_reader > MAX_READERS {
            return Err(Error::InvalidArgument(format!(
                "n_reader must be between 1 and {MAX_READERS}, got {n_reader}"
            )));
        }
        if max_chunk_bytes == 0 || max_chunks == 0 {
            return Err(Error::InvalidArgument(format!(
                "max_chunk_bytes and max_chunks must be positive, got {max_chunk_bytes} and {max_chunks}"
            )));
        }
        let too_large = || {
            Error::InvalidArgument(format!(
                "a ring of {max_chunks} chunks of {max_chunk_bytes} bytes is too large"
            ))
        };
        let state_stride =
            round_up(STATE_FLAGS_OFFSET + 1 + n_reader, CACHE_LINE).ok_or_else(too_large)?;
        let states_offset = SLOTS_OFFSET + SLOT_SIZE * (1 + n_reader);
        let data_stride = round_up(max_chunk_bytes, CACHE_LINE).ok_or_else(too_large)?;
        let data_offset = state_stride
            .checked_mul(max_chunks)
            .and_then(|s| s.checked_add(states_offset))
            .and_then(|s| round_up(s, CACHE_LINE))
            .ok_or_else(too_large)?;
        let total = data_stride
            .checked_mul(max_chunks)
            .and_then(|d| d.checked_add(data_offset))
            .filter(|&t| t <= isize::MAX as usize)
            .ok_or_else(too_large)?;
        Ok(Geometry {
            n_reader,
            max_chunk_bytes,
            max_chunks,
            state_stride,
            states_offset,
            data_stride,
            data_offset,
            total,
        })
    }
}

/// What another process needs to open a ring: `(n_reader, max_chunk_bytes, max_chunks, name)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RingHandle {
    pub n_reader: usize,
    pub max_chunk_bytes: usize,
    pub max_chunks: usize,
    pub name: String,
}
