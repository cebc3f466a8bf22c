//! The broadcast ring: `max_chunks` fixed-size chunks in one segment, each with a state
//! block holding one *written* flag and one *read* flag per reader, plus what the two
//! sides need to sleep, wake each other and notice that the other has died.
//!
//! # Layout (offsets from the start of the segment; everything is `#[repr(C)]`,
//! pointer-free and addressed by offset, so every process can map it anywhere)
//! ```text
//! 0                 RingHeader: geometry; `magic` is stored last, with Release
//! 64                doorbell "data ready": readers sleep on it, the writer rings it
//! 128               doorbell "chunk freed": the writer sleeps on it, readers ring it
//! 192               creator (pid, start time), the overflow-message count and the
//!                   queue writer's part counters (`stats`)
//! 256               the queue's name (64 bytes of UTF-8, NUL-padded; `QueueOptions::name`)
//! 320               slots: the writer's, then one per reader (64 bytes each):
//!                     who holds it (pid + start time), state, and its statistics:
//!                     messages and bytes handled, waits, whether it waits now, when
//!                     it last handled a message
//! states_offset     chunk state blocks, `state_stride` bytes each (a multiple of 64):
//!                     +0  len: u64      bytes of the message in the chunk
//!                     +8  kind: u32     INLINE / OVERFLOW / RAW / FRAMED
//!                     +16 written: u8, then read[0..n_reader]: u8  (the "metadata")
//! data_offset       chunk data, `data_stride` bytes each (max_chunk_bytes rounded up
//!                   to 64, so every chunk starts on a cache line)
//! ```
//! Every line that one side writes on each message (a chunk's state, a slot's counter,
//! a doorbell) is its own cache line, so work on different chunks or by different
//! readers never bounces a line needlessly.
//!
//! The flag protocol itself is in `shmq_protocol::ring` (model-checked with loom); the
//! sleep/wake handshake is in `shmq_protocol::doorbell`.
//!
//! Files: `layout` (the `#[repr(C)]` structures and the geometry), `slots` (who
//! holds each side), `writer` and `reader` (the two sides' state machines); the ring
//! mapping itself ([`Ring`]) is here.

mod layout;
mod reader;
mod slots;
mod stats;
#[cfg(test)]
mod tests;
mod writer;

use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::wait::RingPeers;
use shmq_os::liveness::{Liveness, LockProbe};
use shmq_os::process::ProcessId;
use shmq_os::segment::{HeaderCheck, Segment, name_trouble, with_unique_name};
use shmq_protocol::doorbell::DoorbellWords;
use shmq_protocol::ring::{self as protocol, ChunkFlag, ChunkFlags};
use shmq_protocol::word::{FieldU32, FieldU64};

use layout::*;
pub use layout::{ChunkKind, LABEL_BYTES, LAYOUT_VERSION, MAX_READERS, RING_MAGIC, RingHandle};

/// Whether `label` can name a queue: 1 to `LABEL_BYTES - 1` bytes of UTF-8, with none
/// of the characters [`name_trouble`] refuses (control, bidirectional-text and
/// zero-width characters; a leading `-`).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a label that is empty, [`LABEL_BYTES`] bytes or longer,
/// or has a character [`name_trouble`] refuses.
pub fn check_label(label: &str) -> Result<()> {
    let trouble = name_trouble(label);
    if label.is_empty() || label.len() >= LABEL_BYTES || trouble.is_some() {
        return Err(Error::InvalidArgument(format!(
            "a queue's name must be 1 to {} bytes of text with no control characters \
             (nor bidirectional-text controls or zero-width characters), not starting with \
             '-', got {label:?}{}",
            LABEL_BYTES - 1,
            trouble.map_or_else(String::new, |t| format!(": {t}"))
        )));
    }
    Ok(())
}
pub use reader::{ChunkInfo, RingReader};
pub use slots::SlotInfo;
pub use stats::{PartCounter, RingStats, SideStats};
pub use writer::{DeadReaderPolicy, RingWriter};

/// A mapped broadcast ring (either side). Shared by `Arc` between the writer or reader
/// state and any views handed out of it.
pub struct Ring {
    segment: Segment,
    base: NonNull<u8>,
    geo: Geometry,
    /// Tests the role locks of the ring's slots (see `slots`).
    probe: LockProbe,
}

// SAFETY: `base` points into `segment`'s mapping, which lives as long as `self`. All
// shared mutable state is reached through atomics; chunk data is only written by the
// one writer while the protocol keeps readers away from it.
unsafe impl Send for Ring {}
// SAFETY: as for Send; `&Ring` exposes atomics and raw pointers, no `&mut` data.
unsafe impl Sync for Ring {}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("name", &self.name())
            .field("geometry", &self.geo)
            .finish()
    }
}

/// One chunk's flags, for the protocol functions.
struct ChunkState<'a> {
    ring: &'a Ring,
    index: usize,
}

impl ChunkFlags for ChunkState<'_> {
    fn n_reader(&self) -> usize {
        self.ring.geo.n_reader
    }
    fn written(&self) -> &ChunkFlag {
        // SAFETY: in bounds (the block has room for 1 + n_reader flags); u8 needs no
        // alignment. shmq accesses the flags only atomically; `get_metadata` hands Python
        // a writable view of them, whose byte stores are single-byte and so cannot tear.
        unsafe { &*(self.ring.state_ptr(self.index).add(STATE_FLAGS_OFFSET) as *const ChunkFlag) }
    }
    fn read(&self, reader: usize) -> &ChunkFlag {
        debug_assert!(reader < self.ring.geo.n_reader);
        // SAFETY: reader < n_reader, so the flag is inside the state block.
        unsafe {
            &*(self
                .ring
                .state_ptr(self.index)
                .add(STATE_FLAGS_OFFSET + 1 + reader) as *const ChunkFlag)
        }
    }
}

impl Ring {
    /// Create a ring in a new segment with a fresh `shmq_ring_*` name (drawn again while
    /// a file has the one drawn: see `with_unique_name`).
    ///
    /// # Errors
    ///
    /// As [`create_named`](Self::create_named), a name taken 16 times in a row included.
    pub fn create(n_reader: usize, max_chunk_bytes: usize, max_chunks: usize) -> Result<Ring> {
        with_unique_name("ring", |name| {
            Self::create_named(name, n_reader, max_chunk_bytes, max_chunks)
        })
    }

    /// Create a ring in a new segment called `name`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a geometry out of range (no reader, more readers than
    /// a ring has slots, chunks of 0 bytes or too many); [`Error::Os`] when the segment
    /// cannot be made (the name taken, no room in `/dev/shm`).
    pub fn create_named(
        name: &str,
        n_reader: usize,
        max_chunk_bytes: usize,
        max_chunks: usize,
    ) -> Result<Ring> {
        let geo = Geometry::new(n_reader, max_chunk_bytes, max_chunks)?;
        // Sparse: the header, slots and chunk states are reserved now, chunk data as the
        // writer uses it (see `writer`).
        let segment = Segment::create_sparse(name, geo.total, geo.data_offset)?;
        let base = NonNull::new(segment.as_ptr()).expect("mmap never returns null");
        let probe = LockProbe::open(name);
        let ring = Ring {
            segment,
            base,
            geo,
            probe,
        };
        // SAFETY: the segment is new, at least SLOTS_OFFSET bytes long, page-aligned, and
        // no other process can use it before `magic` is set below.
        unsafe {
            let h = ring.base.as_ptr() as *mut RingHeader;
            (*h).version = LAYOUT_VERSION;
            (*h).n_reader = n_reader as u32;
            (*h).max_chunk_bytes = max_chunk_bytes as u64;
            (*h).max_chunks = max_chunks as u64;
            (*h).state_stride = geo.state_stride as u64;
            (*h).states_offset = geo.states_offset as u64;
            (*h).data_stride = geo.data_stride as u64;
            (*h).data_offset = geo.data_offset as u64;
        }
        let me = ProcessId::current();
        // Relaxed: published by the Release store of the magic below.
        ring.shared().creator_pid.set(me.pid);
        ring.shared().creator_start_time.set(me.start_time);
        // Release: pairs with the Acquire load in `Ring::open`; an opener that sees the
        // magic sees the whole header (the rest is zero from the kernel).
        ring.header().magic.publish(RING_MAGIC);
        Ok(ring)
    }

    /// Open an existing ring by name, checking that it is a finished shmq ring of this
    /// layout version.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the segment cannot be opened (gone, not this user's), or is not a
    /// finished shmq ring of this layout version
    /// ([`OsError::BadSegment`](crate::error::OsError::BadSegment)).
    pub fn open(name: &str) -> Result<Ring> {
        let segment = Segment::open(name)?;
        let check = HeaderCheck {
            min_len: SLOTS_OFFSET,
            magic: RING_MAGIC,
            version: LAYOUT_VERSION,
            not_this_kind: "it is not a shmq broadcast ring (or its creator has not finished setting it up)",
        };
        // SAFETY: the mapping is page-aligned and at least SLOTS_OFFSET bytes long, which
        // covers the header; RingHeader is repr(C) plain integers and an atomic (any bit
        // pattern is valid). The magic is an atomic that the creator stores last; its
        // Acquire load pairs with the Release store in `create_named`, making the header
        // fields written before it visible.
        let (base, header) =
            unsafe { segment.checked_header(&check, |h: &RingHeader| (&h.magic, &h.version)) }?;
        let geo = Geometry::new(
            header.n_reader as usize,
            header.max_chunk_bytes as usize,
            header.max_chunks as usize,
        )?;
        let stored = (
            header.state_stride,
            header.states_offset,
            header.data_stride,
            header.data_offset,
        );
        let expected = (
            geo.state_stride as u64,
            geo.states_offset as u64,
            geo.data_stride as u64,
            geo.data_offset as u64,
        );
        if stored != expected || segment.len() < geo.total {
            return Err(segment.header_mismatch().into());
        }
        let probe = LockProbe::open(name);
        Ok(Ring {
            segment,
            base,
            geo,
            probe,
        })
    }

    fn header(&self) -> &RingHeader {
        // SAFETY: see `open`/`create_named`: the header is in bounds and aligned.
        unsafe { &*(self.base.as_ptr() as *const RingHeader) }
    }

    fn shared(&self) -> &RingShared {
        // SAFETY: 64..SLOTS_OFFSET is inside the mapping (checked at open/create), the
        // offset is 64-aligned, and the words are only accessed atomically.
        unsafe { &*(self.base.as_ptr().add(64) as *const RingShared) }
    }

    pub fn name(&self) -> &str {
        self.segment.name()
    }

    /// An error once a peer truncated the segment under this process (see
    /// `shmq_os::sigbus`): one atomic load, at each call's start and end.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::BadSegment`](crate::error::OsError::BadSegment) once
    /// another process truncated the segment.
    #[inline]
    pub fn check_intact(&self) -> Result<()> {
        Ok(self.segment.check_intact()?)
    }

    /// [`check_intact`](Self::check_intact), and whether the file is still as long (a
    /// `stat`): for the liveness steps of waits.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::BadSegment`](crate::error::OsError::BadSegment) once
    /// the segment was truncated (seen by a fault, or its file is shorter now).
    pub fn check_length(&self) -> Result<()> {
        Ok(self.segment.check_length()?)
    }
    pub fn n_reader(&self) -> usize {
        self.geo.n_reader
    }
    pub fn max_chunk_bytes(&self) -> usize {
        self.geo.max_chunk_bytes
    }
    pub fn max_chunks(&self) -> usize {
        self.geo.max_chunks
    }
    /// Whether this process created the segment (and unlinks it when the ring drops).
    pub fn is_creator(&self) -> bool {
        self.segment.is_creator()
    }
    /// The process that created the segment.
    pub fn creator(&self) -> ProcessId {
        // Relaxed: written before the magic, which `open` loaded with Acquire.
        let s = self.shared();
        ProcessId {
            pid: s.creator_pid.get(),
            start_time: s.creator_start_time.get(),
        }
    }
    /// Messages the writer has sent over the overflow socket.
    /// Give the ring its queue's name (see [`LABEL_BYTES`]): by its creator, once, before
    /// the queue's handle exists.
    pub(crate) fn set_label(&self, label: &str) -> Result<()> {
        check_label(label)?;
        let bytes = label.as_bytes();
        for (i, b) in self.shared().label.iter().enumerate() {
            // Relaxed: written once, before any reader can have the handle; a concurrent
            // `inspect` (which finds segments by listing /dev/shm) may see a label half
            // written, which only shows, for that one look, part of a name.
            b.set(bytes.get(i).copied().unwrap_or(0));
        }
        Ok(())
    }

    /// The queue as messages name it: its name in quotes followed by its segment, where
    /// its writer named it (`'results-1' (segment shmq_ring_…)`), else its segment in
    /// quotes (`'shmq_ring_…'`).
    pub fn queue_words(&self) -> String {
        match self.label() {
            Some(label) => format!("'{label}' (segment {})", self.name()),
            None => format!("'{}'", self.name()),
        }
    }

    /// The queue's name its writer gave it, if any. Any process that can write the
    /// segment can write these bytes: what is not UTF-8 is replaced, control characters
    /// dropped.
    pub fn label(&self) -> Option<String> {
        // Relaxed: see `set_label`.
        let bytes: Vec<u8> = self
            .shared()
            .label
            .iter()
            .map(|b| b.get())
            .take_while(|&b| b != 0)
            .collect();
        let text: String = String::from_utf8_lossy(&bytes)
            .chars()
            .filter(|c| !c.is_control())
            .collect();
        (!text.is_empty()).then_some(text)
    }

    pub fn overflow_count(&self) -> u64 {
        // Relaxed: a statistic.
        self.shared().overflow_count.get()
    }

    pub fn handle(&self) -> RingHandle {
        RingHandle {
            n_reader: self.geo.n_reader,
            max_chunk_bytes: self.geo.max_chunk_bytes,
            max_chunks: self.geo.max_chunks,
            name: self.name().to_owned(),
        }
    }

    /// Remove the segment's name now (the mapping stays valid for everyone who has it).
    /// For a creator that must clean up before its objects are dropped (interpreter exit).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the file cannot be removed for another reason than being gone
    /// already.
    pub fn unlink(&self) -> Result<()> {
        Ok(self.segment.unlink()?)
    }

    /// Mark the queue shut down by its writer (after its last chunk) and wake the readers:
    /// a reader takes what is left and then gets
    /// [`QueueError::WriterShutDown`](crate::broadcast::QueueError::WriterShutDown) (see
    /// `RingReader::wait`). Needs no room in the ring, so it never waits.
    pub fn close_writer(&self) {
        protocol::slot_close(&self.slot(0).word);
        self.data_ready().doorbell().wake();
    }

    /// Whether the writer shut the queue down ([`close_writer`](Self::close_writer)).
    pub fn writer_closed(&self) -> bool {
        protocol::slot_is_closed(&self.slot(0).word)
    }

    /// Whether the writer object is proved gone (dropped, or its process ended): its
    /// role lock is free. Read off the lock (byte 1, the writer slot's: see `slots`),
    /// because a closed slot no longer names its holder.
    pub fn writer_gone(&self) -> bool {
        self.probe.liveness(1) == Liveness::Dead
    }

    /// Whether chunk `index` is readable by local reader `reader` now (the check of
    /// [`RingReader::poll`], for a waiter that does not hold the reader: see
    /// `broadcast::wait_any`). `false` for an index or reader out of range.
    pub fn is_readable_by(&self, index: usize, reader: usize) -> bool {
        index < self.max_chunks()
            && reader < self.n_reader()
            && protocol::is_readable(&self.chunk(index), reader)
    }

    /// Readers sleep here; the writer rings it after publishing a chunk.
    pub fn data_ready(&self) -> &DoorbellWords {
        &self.shared().data_ready
    }

    /// The writer sleeps here; readers ring it after finishing a chunk.
    pub fn chunk_freed(&self) -> &DoorbellWords {
        &self.shared().chunk_freed
    }

    /// The ring's processes (its writer and readers) and its doorbells, for a waiter
    /// that asks whether the machine is full of other work ([`RingPeers`]). The
    /// doorbells' sleeper counts are shared memory: a peer that writes nonsense there
    /// makes a waiter count more or fewer processes awake, so that it sleeps at once, or
    /// spins and yields as its policy says (never past that policy's phases: as with the
    /// load check off, `SHMQ_LOAD_CHECK=0`), and no more.
    pub fn peers(&self) -> RingPeers<'_> {
        RingPeers {
            processes: u32::try_from(self.geo.n_reader + 1).unwrap_or(u32::MAX),
            doorbells: [self.data_ready(), self.chunk_freed()],
        }
    }

    fn check_chunk(&self, i: usize) -> Result<()> {
        if i >= self.geo.max_chunks {
            return Err(self.chunk_out_of_range(i));
        }
        Ok(())
    }

    /// The error for a chunk index outside `0..max_chunks` (also negative ones, which
    /// only the bindings can see).
    pub fn chunk_out_of_range(&self, i: impl std::fmt::Display) -> Error {
        Error::InvalidArgument(format!(
            "chunk index {i} out of range: the ring has {} chunks",
            self.geo.max_chunks
        ))
    }

    fn state_ptr(&self, i: usize) -> *mut u8 {
        debug_assert!(i < self.geo.max_chunks);
        // SAFETY: i < max_chunks, so the block lies inside the mapping (Geometry::new).
        unsafe {
            self.base
                .as_ptr()
                .add(self.geo.states_offset + i * self.geo.state_stride)
        }
    }

    fn chunk(&self, index: usize) -> ChunkState<'_> {
        ChunkState { ring: self, index }
    }

    /// Chunk `i`'s length, published by its `written` flag (`shmq_protocol::ring`).
    fn len_of(&self, i: usize) -> &FieldU64 {
        // SAFETY: in bounds (state_ptr), 8-aligned (stride and offset are multiples of
        // 64), and only ever accessed atomically by shmq.
        unsafe { &*(self.state_ptr(i).add(STATE_LEN_OFFSET) as *const FieldU64) }
    }

    /// Chunk `i`'s kind, published as its length is.
    fn kind_of(&self, i: usize) -> &FieldU32 {
        // SAFETY: as in `len_of`; offset 8 is 4-aligned.
        unsafe { &*(self.state_ptr(i).add(STATE_KIND_OFFSET) as *const FieldU32) }
    }

    /// The segment's length in bytes.
    pub fn segment_len(&self) -> usize {
        self.segment.len()
    }

    /// Start and length of the whole segment in this process (what Python's
    /// `ShmRingBuffer.shared_memory.buf` shows), all of it reserved in `/dev/shm` first, so
    /// that touching any byte cannot fault (`OsError::NoSpace` when there is no room).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::NoSpace`](crate::error::OsError::NoSpace) when
    /// `/dev/shm` has no room for the whole segment.
    pub fn segment_bytes(&self) -> Result<(*mut u8, usize)> {
        self.segment.reserve_whole()?;
        Ok((self.segment.as_ptr(), self.segment.len()))
    }

    /// Start and length of chunk `i`'s data in this process.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `i` is not below the ring's number of chunks.
    pub fn data_ptr(&self, i: usize) -> Result<(*mut u8, usize)> {
        self.check_chunk(i)?;
        // SAFETY: i < max_chunks: the data lies inside the mapping.
        let p = unsafe {
            self.base
                .as_ptr()
                .add(self.geo.data_offset + i * self.geo.data_stride)
        };
        Ok((p, self.geo.max_chunk_bytes))
    }

    /// Where chunk `i`'s data starts in the segment's file (to map it on its own).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `i` is not below the ring's number of chunks.
    pub fn data_file_offset(&self, i: usize) -> Result<u64> {
        self.check_chunk(i)?;
        Ok((self.geo.data_offset + i * self.geo.data_stride) as u64)
    }

    /// Start and length of chunk `i`'s metadata: `[written, read_0, .., read_{n-1}]`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `i` is not below the ring's number of chunks.
    pub fn metadata_ptr(&self, i: usize) -> Result<(*mut u8, usize)> {
        self.check_chunk(i)?;
        // SAFETY: as in `Chunk::written`.
        Ok((
            unsafe { self.state_ptr(i).add(STATE_FLAGS_OFFSET) },
            1 + self.geo.n_reader,
        ))
    }

    /// A snapshot of chunk `i`'s flags (for inspection and tests).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `i` is not below the ring's number of chunks.
    pub fn metadata(&self, i: usize) -> Result<Vec<u8>> {
        self.check_chunk(i)?;
        let c = self.chunk(i);
        // Relaxed: a diagnostic snapshot; it orders nothing.
        let mut v = vec![c.written().peek()];
        v.extend((0..self.geo.n_reader).map(|r| c.read(r).peek()));
        Ok(v)
    }
}
