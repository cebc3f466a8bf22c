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
//! 192               creator (pid, start time) and the overflow-message count
//! 256               slots: the writer's, then one per reader (64 bytes each):
//!                     who holds it (pid + start time), state, messages handled
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
//! The flag protocol itself is in [`super::protocol`] (model-checked with loom); the
//! sleep/wake handshake is in [`crate::doorbell`].

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use super::protocol::{self, ChunkFlags};
use crate::error::{Error, Result};
use crate::process::ProcessId;
use crate::segment::{unique_name, Segment};
use crate::wait::{Bell, Wait};

/// "SHMQRNG1" in little-endian: marks a finished broadcast-ring segment.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"SHMQRNG1");
/// Bumped whenever the layout changes; openers refuse any other version.
pub const LAYOUT_VERSION: u32 = 3;

const CACHE_LINE: usize = 64;
const SLOTS_OFFSET: usize = 256;
const SLOT_SIZE: usize = 64;
const STATE_LEN_OFFSET: usize = 0;
const STATE_KIND_OFFSET: usize = 8;
const STATE_FLAGS_OFFSET: usize = 16;
/// More readers than this would make the state blocks absurd; engines use a handful.
pub const MAX_READERS: usize = 4096;

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
}

impl ChunkKind {
    fn from_u32(v: u32) -> ChunkKind {
        match v {
            1 => ChunkKind::Inline,
            2 => ChunkKind::Overflow,
            3 => ChunkKind::Framed,
            _ => ChunkKind::Raw,
        }
    }
}

/// What a reader should do when the reader it waits for has died.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum DeadReaderPolicy {
    /// Fail the blocked call with [`Error::DeadReader`].
    #[default]
    Raise,
    /// Go on without that reader: it no longer holds chunks back.
    Drop,
}

/// The segment header. Lives at offset 0 of the mapping.
#[repr(C)]
struct RingHeader {
    magic: AtomicU64,
    version: u32,
    n_reader: u32,
    max_chunk_bytes: u64,
    max_chunks: u64,
    state_stride: u64,
    states_offset: u64,
    data_stride: u64,
    data_offset: u64,
}
const _: () = assert!(std::mem::size_of::<RingHeader>() == 64);

/// The two words of a doorbell, alone in a cache line.
#[repr(C, align(64))]
struct BellWords {
    seq: AtomicU32,
    sleepers: AtomicU32,
}

/// Shared words after the header.
#[repr(C)]
struct RingShared {
    data_ready: BellWords,
    chunk_freed: BellWords,
    overflow_count: AtomicU64,
    creator_pid: AtomicU32,
    creator_start_time: AtomicU64,
}
const _: () = assert!(64 + std::mem::size_of::<RingShared>() <= SLOTS_OFFSET);

/// Slot states (0, the state of a fresh segment: nobody has attached).
const ATTACHED: u32 = 1;
const DROPPED: u32 = 2;
/// A process is writing its pid and start time into the slot.
const ATTACHING: u32 = 3;

/// Who holds a side of the ring, and how many messages it has handled.
#[repr(C, align(64))]
struct Slot {
    pid: AtomicU32,
    state: AtomicU32,
    start_time: AtomicU64,
    messages: AtomicU64,
}
const _: () = assert!(std::mem::size_of::<Slot>() == SLOT_SIZE);

/// The state of one slot, for inspection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotInfo {
    /// The process that attached to it last, if any.
    pub process: Option<ProcessId>,
    /// Dropped by the writer after its process died.
    pub dropped: bool,
    /// Messages written (writer) or read (reader).
    pub messages: u64,
}

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

/// Sizes derived from the three parameters of a ring.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Geometry {
    n_reader: usize,
    max_chunk_bytes: usize,
    max_chunks: usize,
    state_stride: usize,
    states_offset: usize,
    data_stride: usize,
    data_offset: usize,
    total: usize,
}

impl Geometry {
    fn new(n_reader: usize, max_chunk_bytes: usize, max_chunks: usize) -> Result<Geometry> {
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

/// A mapped broadcast ring (either side). Shared by `Arc` between the writer or reader
/// state and any views handed out of it.
pub struct Ring {
    segment: Segment,
    base: NonNull<u8>,
    geo: Geometry,
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
struct Chunk<'a> {
    ring: &'a Ring,
    index: usize,
}

impl ChunkFlags for Chunk<'_> {
    fn n_reader(&self) -> usize {
        self.ring.geo.n_reader
    }
    fn written(&self) -> &AtomicU8 {
        // SAFETY: in bounds (the block has room for 1 + n_reader flags); u8 needs no
        // alignment. shmq accesses the flags only atomically; `get_metadata` hands Python
        // a writable view of them, whose byte stores are single-byte and so cannot tear.
        unsafe { &*(self.ring.state_ptr(self.index).add(STATE_FLAGS_OFFSET) as *const AtomicU8) }
    }
    fn read(&self, reader: usize) -> &AtomicU8 {
        debug_assert!(reader < self.ring.geo.n_reader);
        // SAFETY: reader < n_reader, so the flag is inside the state block.
        unsafe {
            &*(self
                .ring
                .state_ptr(self.index)
                .add(STATE_FLAGS_OFFSET + 1 + reader) as *const AtomicU8)
        }
    }
}

impl Ring {
    /// Create a ring in a new segment with a fresh `shmq_ring_*` name.
    pub fn create(n_reader: usize, max_chunk_bytes: usize, max_chunks: usize) -> Result<Ring> {
        Self::create_named(&unique_name("ring"), n_reader, max_chunk_bytes, max_chunks)
    }

    /// Create a ring in a new segment called `name`.
    pub fn create_named(
        name: &str,
        n_reader: usize,
        max_chunk_bytes: usize,
        max_chunks: usize,
    ) -> Result<Ring> {
        let geo = Geometry::new(n_reader, max_chunk_bytes, max_chunks)?;
        let segment = Segment::create(name, geo.total)?;
        let base = NonNull::new(segment.as_ptr()).expect("mmap never returns null");
        let ring = Ring { segment, base, geo };
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
        ring.shared().creator_pid.store(me.pid, Ordering::Relaxed);
        ring.shared()
            .creator_start_time
            .store(me.start_time, Ordering::Relaxed);
        // Release: pairs with the Acquire load in `Ring::open`; an opener that sees the
        // magic sees the whole header (the rest is zero from the kernel).
        ring.header().magic.store(RING_MAGIC, Ordering::Release);
        Ok(ring)
    }

    /// Open an existing ring by name, checking that it is a finished shmq ring of this
    /// layout version.
    pub fn open(name: &str) -> Result<Ring> {
        let segment = Segment::open(name)?;
        let bad = |reason: String| Error::BadSegment {
            name: name.to_owned(),
            reason,
        };
        if segment.len() < SLOTS_OFFSET {
            return Err(bad(format!("it is only {} bytes long", segment.len())));
        }
        let base = NonNull::new(segment.as_ptr()).expect("mmap never returns null");
        // SAFETY: the mapping is at least SLOTS_OFFSET bytes and page-aligned; the magic
        // is an atomic that the creator stores last.
        let header = unsafe { &*(base.as_ptr() as *const RingHeader) };
        // Acquire: pairs with the Release store in `create_named`, making the header
        // fields written before it visible.
        if header.magic.load(Ordering::Acquire) != RING_MAGIC {
            return Err(bad(
                "it is not a shmq broadcast ring (or its creator has not finished setting it up)"
                    .into(),
            ));
        }
        if header.version != LAYOUT_VERSION {
            return Err(bad(format!(
                "its layout version is {}, this shmq reads version {LAYOUT_VERSION}",
                header.version
            )));
        }
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
            return Err(bad("its header does not match its size".into()));
        }
        Ok(Ring { segment, base, geo })
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

    /// Slot 0 is the writer's, slot `1 + r` reader `r`'s.
    fn slot(&self, index: usize) -> &Slot {
        debug_assert!(index <= self.geo.n_reader);
        // SAFETY: index <= n_reader, so the slot lies below states_offset (Geometry::new);
        // 64-aligned; only accessed atomically.
        unsafe { &*(self.base.as_ptr().add(SLOTS_OFFSET + SLOT_SIZE * index) as *const Slot) }
    }

    pub fn name(&self) -> &str {
        self.segment.name()
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
            pid: s.creator_pid.load(Ordering::Relaxed),
            start_time: s.creator_start_time.load(Ordering::Relaxed),
        }
    }
    /// Messages the writer has sent over the overflow socket.
    pub fn overflow_count(&self) -> u64 {
        // Relaxed: a statistic.
        self.shared().overflow_count.load(Ordering::Relaxed)
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
    pub fn unlink(&self) -> Result<()> {
        self.segment.unlink()
    }

    /// The writer's (`None`) or reader `r`'s slot.
    pub fn slot_info(&self, reader: Option<usize>) -> Result<SlotInfo> {
        let index = match reader {
            None => 0,
            Some(r) if r < self.geo.n_reader => 1 + r,
            Some(r) => {
                return Err(Error::InvalidArgument(format!(
                    "no reader {r}: the ring has {}",
                    self.geo.n_reader
                )))
            }
        };
        let slot = self.slot(index);
        // A seqlock on the state: Acquire pairs with the Release store in `attach`; the
        // state read again after the fence must be unchanged, or a re-attach was under
        // way and pid and start time may be torn (then nobody is named: liveness checks
        // skip the slot this time).
        let state = slot.state.load(Ordering::Acquire);
        // Relaxed: ordered by the Acquire load above and the fence below.
        let (pid, start_time) = (
            slot.pid.load(Ordering::Relaxed),
            slot.start_time.load(Ordering::Relaxed),
        );
        fence(Ordering::Acquire);
        // Relaxed: ordered after the reads above by the fence.
        let stable = slot.state.load(Ordering::Relaxed) == state;
        let process = (stable && (state == ATTACHED || state == DROPPED))
            .then_some(ProcessId { pid, start_time });
        // Relaxed: a statistic.
        Ok(SlotInfo {
            process,
            dropped: state == DROPPED,
            messages: slot.messages.load(Ordering::Relaxed),
        })
    }

    /// Record this process as the holder of slot `index`.
    fn attach(&self, index: usize) -> Result<()> {
        let me = ProcessId::current();
        let slot = self.slot(index);
        // Relaxed: the state carries no data of its own here (see `slot_info`).
        if slot.state.load(Ordering::Relaxed) == DROPPED {
            return Err(Error::WrongRole(format!(
                "reader {} was dropped by the writer after its process died; it cannot join this queue again",
                index - 1
            )));
        }
        // Relaxed, then a Release fence: `slot_info` sees ATTACHING (or a changed state)
        // if it reads any of the new pid/start time before the final store.
        slot.state.store(ATTACHING, Ordering::Relaxed);
        fence(Ordering::Release);
        // Relaxed: published by the Release store of the state below.
        slot.pid.store(me.pid, Ordering::Relaxed);
        slot.start_time.store(me.start_time, Ordering::Relaxed);
        // Release: pairs with the Acquire load in `slot_info`.
        slot.state.store(ATTACHED, Ordering::Release);
        Ok(())
    }

    fn bell(words: &BellWords) -> Bell<'_> {
        Bell {
            seq: &words.seq,
            sleepers: &words.sleepers,
        }
    }

    /// Readers sleep here; the writer rings it after publishing a chunk.
    pub fn data_ready(&self) -> Bell<'_> {
        Self::bell(&self.shared().data_ready)
    }

    /// The writer sleeps here; readers ring it after finishing a chunk.
    pub fn chunk_freed(&self) -> Bell<'_> {
        Self::bell(&self.shared().chunk_freed)
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

    fn chunk(&self, index: usize) -> Chunk<'_> {
        Chunk { ring: self, index }
    }

    fn len_of(&self, i: usize) -> &AtomicU64 {
        // SAFETY: in bounds (state_ptr), 8-aligned (stride and offset are multiples of
        // 64), and only ever accessed atomically by shmq.
        unsafe { &*(self.state_ptr(i).add(STATE_LEN_OFFSET) as *const AtomicU64) }
    }

    fn kind_of(&self, i: usize) -> &AtomicU32 {
        // SAFETY: as in `len_of`; offset 8 is 4-aligned.
        unsafe { &*(self.state_ptr(i).add(STATE_KIND_OFFSET) as *const AtomicU32) }
    }

    /// Start and length of chunk `i`'s data in this process.
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

    /// Start and length of chunk `i`'s metadata: `[written, read_0, .., read_{n-1}]`.
    pub fn metadata_ptr(&self, i: usize) -> Result<(*mut u8, usize)> {
        self.check_chunk(i)?;
        // SAFETY: as in `Chunk::written`.
        Ok((
            unsafe { self.state_ptr(i).add(STATE_FLAGS_OFFSET) },
            1 + self.geo.n_reader,
        ))
    }

    /// A snapshot of chunk `i`'s flags (for inspection and tests).
    pub fn metadata(&self, i: usize) -> Result<Vec<u8>> {
        self.check_chunk(i)?;
        let c = self.chunk(i);
        // Relaxed: a diagnostic snapshot; it orders nothing.
        let mut v = vec![c.written().load(Ordering::Relaxed)];
        v.extend((0..self.geo.n_reader).map(|r| c.read(r).load(Ordering::Relaxed)));
        Ok(v)
    }
}

/// The writer's side of a ring: it fills chunks in order, 0, 1, .., max_chunks-1, 0, ..
#[derive(Debug)]
pub struct RingWriter {
    ring: Arc<Ring>,
    next: usize,
    /// The chunk acquired and not yet committed, if any.
    open: Option<usize>,
    /// Readers dropped after they died (see [`DeadReaderPolicy::Drop`]).
    dropped: Vec<AtomicBool>,
    on_dead_reader: DeadReaderPolicy,
    messages: u64,
}

impl RingWriter {
    /// The writer of `ring`; this process takes the writer's slot.
    pub fn new(ring: Arc<Ring>) -> RingWriter {
        // The writer's slot is never dropped, so attaching cannot fail.
        ring.attach(0).expect("the writer's slot is never dropped");
        let dropped = (0..ring.n_reader())
            .map(|_| AtomicBool::new(false))
            .collect();
        RingWriter {
            ring,
            next: 0,
            open: None,
            dropped,
            on_dead_reader: DeadReaderPolicy::Raise,
            messages: 0,
        }
    }

    /// What to do when a reader that holds a chunk back has died.
    pub fn on_dead_reader(&mut self, policy: DeadReaderPolicy) {
        self.on_dead_reader = policy;
    }

    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }

    /// Index of the chunk the next message goes to.
    pub fn current_index(&self) -> usize {
        self.next
    }

    /// Readers dropped so far.
    pub fn dropped_readers(&self) -> Vec<usize> {
        // Relaxed: only this writer stores these flags.
        (0..self.dropped.len())
            .filter(|&r| self.dropped[r].load(Ordering::Relaxed))
            .collect()
    }

    fn is_dropped(dropped: &[AtomicBool], r: usize) -> bool {
        // Relaxed: only this writer stores these flags.
        dropped[r].load(Ordering::Relaxed)
    }

    /// Whether reader `r` was dropped after it died.
    pub fn is_reader_dropped(&self, r: usize) -> bool {
        Self::is_dropped(&self.dropped, r)
    }

    /// Whether the next chunk can be written without waiting.
    pub fn can_write(&self) -> bool {
        protocol::is_free(&self.ring.chunk(self.next), |r| {
            Self::is_dropped(&self.dropped, r)
        })
    }

    /// Check the readers still holding chunk `i`: a dead one is an error or is dropped.
    fn check_readers(
        ring: &Ring,
        dropped: &[AtomicBool],
        policy: DeadReaderPolicy,
        i: usize,
    ) -> Result<()> {
        let chunk = ring.chunk(i);
        for r in 0..ring.n_reader() {
            // Relaxed: a read flag still 0 here can only be a slow or dead reader; either
            // way it is re-checked on the next poll.
            if Self::is_dropped(dropped, r) || chunk.read(r).load(Ordering::Relaxed) == 1 {
                continue;
            }
            let Some(process) = ring.slot_info(Some(r))?.process else {
                continue;
            };
            if process.is_alive() {
                continue;
            }
            match policy {
                DeadReaderPolicy::Raise => {
                    return Err(Error::DeadReader {
                        reader: r,
                        pid: process.pid,
                        chunk: i,
                    });
                }
                DeadReaderPolicy::Drop => {
                    log::warn!(
                        "shmq: reader {r} (pid {}) died; going on without it",
                        process.pid
                    );
                    // Relaxed: read only by this writer.
                    dropped[r].store(true, Ordering::Relaxed);
                    // Relaxed: informational (inspect); the writer's own flag decides.
                    ring.slot(1 + r).state.store(DROPPED, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }

    /// Wait until the next chunk is free, mark it not-written, and return its index. The
    /// chunk stays acquired until [`commit`](Self::commit) (or another `acquire`).
    pub fn acquire(&mut self, wait: &mut Wait) -> Result<usize> {
        let i = self.next;
        let (ring, dropped, policy) = (&*self.ring, &self.dropped[..], self.on_dead_reader);
        let chunk = ring.chunk(i);
        wait.until(
            Some(ring.chunk_freed()),
            &mut || Self::check_readers(ring, dropped, policy, i),
            || protocol::is_free(&chunk, |r| Self::is_dropped(dropped, r)).then_some(()),
        )?;
        protocol::begin_write(&chunk);
        self.open = Some(i);
        Ok(i)
    }

    /// The acquired chunk's data, to fill before `commit`.
    pub fn data_mut(&mut self) -> Option<&mut [u8]> {
        let i = self.open?;
        let (p, n) = self.ring.data_ptr(i).ok()?;
        // SAFETY: the chunk is acquired: per the protocol no reader reads it until the
        // commit, and `&mut self` keeps this the only reference in this process. (A
        // reader process that breaks the protocol could still read torn data; it cannot
        // make this process misbehave.)
        Some(unsafe { std::slice::from_raw_parts_mut(p, n) })
    }

    /// Publish the acquired chunk with `len` bytes of kind `kind` and move to the next one.
    pub fn commit(&mut self, len: usize, kind: ChunkKind) -> Result<()> {
        let i = self
            .open
            .take()
            .ok_or_else(|| Error::WrongRole("no chunk is acquired for writing".into()))?;
        let ring = &*self.ring;
        // Relaxed: published by the Release store of `written` in `protocol::publish`.
        ring.len_of(i).store(len as u64, Ordering::Relaxed);
        ring.kind_of(i).store(kind as u32, Ordering::Relaxed);
        if kind == ChunkKind::Overflow {
            // Relaxed: a statistic; only the writer stores it.
            ring.shared().overflow_count.fetch_add(1, Ordering::Relaxed);
        }
        protocol::publish(&ring.chunk(i), |r| Self::is_dropped(&self.dropped, r));
        self.messages += 1;
        // Relaxed: a statistic, stored (not added) since only the writer writes it.
        ring.slot(0)
            .messages
            .store(self.messages, Ordering::Relaxed);
        ring.data_ready().doorbell().ring();
        self.next = (i + 1) % ring.max_chunks();
        Ok(())
    }

    /// Copy `msg` into the next chunk and publish it (waiting for room).
    pub fn write(&mut self, msg: &[u8], wait: &mut Wait) -> Result<()> {
        if msg.len() > self.ring.max_chunk_bytes() {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes does not fit in a chunk of {} bytes",
                msg.len(),
                self.ring.max_chunk_bytes()
            )));
        }
        self.acquire(wait)?;
        self.data_mut().expect("acquired")[..msg.len()].copy_from_slice(msg);
        self.commit(msg.len(), ChunkKind::Inline)
    }
}

/// A message found in the ring by a reader.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ChunkInfo {
    pub index: usize,
    pub len: usize,
    pub kind: ChunkKind,
}

/// One reader's side of a ring; it reads chunks in the writer's order.
#[derive(Debug)]
pub struct RingReader {
    ring: Arc<Ring>,
    reader: usize,
    next: usize,
    messages: u64,
}

impl RingReader {
    /// Reader number `reader` (0-based, below the ring's `n_reader`); this process takes
    /// its slot.
    pub fn new(ring: Arc<Ring>, reader: usize) -> Result<RingReader> {
        if reader >= ring.n_reader() {
            return Err(Error::InvalidArgument(format!(
                "reader index {reader} out of range: the ring has {} readers",
                ring.n_reader()
            )));
        }
        ring.attach(1 + reader)?;
        Ok(RingReader {
            ring,
            reader,
            next: 0,
            messages: 0,
        })
    }

    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }
    pub fn reader_index(&self) -> usize {
        self.reader
    }
    /// Index of the chunk this reader reads next.
    pub fn current_index(&self) -> usize {
        self.next
    }

    /// The next chunk, if it is readable now.
    pub fn poll(&self) -> Option<ChunkInfo> {
        let i = self.next;
        if !protocol::is_readable(&self.ring.chunk(i), self.reader) {
            return None;
        }
        // Relaxed: ordered by the Acquire load of `written` in `is_readable`.
        let len = self.ring.len_of(i).load(Ordering::Relaxed) as usize;
        let kind = ChunkKind::from_u32(self.ring.kind_of(i).load(Ordering::Relaxed));
        // A peer that wrote a bogus length cannot make us read outside the chunk.
        let len = match kind {
            ChunkKind::Raw => self.ring.max_chunk_bytes(),
            ChunkKind::Inline | ChunkKind::Framed => len.min(self.ring.max_chunk_bytes()),
            ChunkKind::Overflow => len,
        };
        Some(ChunkInfo {
            index: i,
            len,
            kind,
        })
    }

    /// Fails if the writer has died.
    pub fn check_writer(ring: &Ring) -> Result<()> {
        match ring.slot_info(None)?.process {
            Some(w) if !w.is_alive() => Err(Error::DeadWriter { pid: w.pid }),
            _ => Ok(()),
        }
    }

    /// Wait until the next chunk is readable.
    pub fn wait(&self, wait: &mut Wait) -> Result<ChunkInfo> {
        let ring = &*self.ring;
        wait.until(
            Some(ring.data_ready()),
            &mut || Self::check_writer(ring),
            || self.poll(),
        )
    }

    /// The data of a chunk returned by `poll`/`wait`, valid until `finish`.
    pub fn data(&self, info: &ChunkInfo) -> &[u8] {
        let (p, n) = self.ring.data_ptr(info.index).expect("index from poll");
        let len = if info.kind == ChunkKind::Overflow {
            0
        } else {
            info.len.min(n)
        };
        // SAFETY: the chunk is readable by us and our read flag is still 0, so the writer
        // does not touch it until `finish` (which needs `&mut self`, ending this borrow).
        unsafe { std::slice::from_raw_parts(p, len) }
    }

    /// Mark the current chunk as read by this reader and move to the next one.
    pub fn finish(&mut self) {
        protocol::finish_read(&self.ring.chunk(self.next), self.reader);
        self.messages += 1;
        // Relaxed: a statistic in this reader's own slot.
        self.ring
            .slot(1 + self.reader)
            .messages
            .store(self.messages, Ordering::Relaxed);
        self.ring.chunk_freed().doorbell().ring();
        self.next = (self.next + 1) % self.ring.max_chunks();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn wait() -> Wait<'static> {
        Wait::new("test", Some(Duration::from_millis(50)))
    }

    #[test]
    fn geometry_is_aligned() {
        let g = Geometry::new(3, 1000, 5).unwrap();
        assert_eq!(g.state_stride, 64);
        assert_eq!(g.states_offset, SLOTS_OFFSET + 4 * SLOT_SIZE);
        assert_eq!(g.data_stride, 1024);
        assert_eq!(g.data_offset % 64, 0);
        assert_eq!(g.total, g.data_offset + 5 * 1024);
        assert_eq!(Geometry::new(100, 8, 1).unwrap().state_stride, 128);
        assert!(Geometry::new(0, 8, 1).is_err());
        assert!(Geometry::new(1, 0, 1).is_err());
        assert!(Geometry::new(1, usize::MAX / 2, 4).is_err());
    }

    #[test]
    fn state_machine_follows_the_spec() {
        let ring = Arc::new(Ring::create(2, 64, 2).unwrap());
        let mut w = RingWriter::new(ring.clone());
        let mut r0 = RingReader::new(ring.clone(), 0).unwrap();
        let mut r1 = RingReader::new(ring.clone(), 1).unwrap();
        // 1. not written: readers may not read, the writer may write.
        assert_eq!(ring.metadata(0).unwrap(), vec![0, 0, 0]);
        assert!(r0.poll().is_none());
        assert!(w.can_write());
        w.write(b"hello", &mut wait()).unwrap();
        // 2. written, nobody has read: readable.
        assert_eq!(ring.metadata(0).unwrap(), vec![1, 0, 0]);
        let info = r0.poll().unwrap();
        assert_eq!((info.index, info.len, info.kind), (0, 5, ChunkKind::Inline));
        assert_eq!(r0.data(&info), b"hello");
        r0.finish();
        // 3. read by some: the others may still read, the writer must wait.
        assert_eq!(ring.metadata(0).unwrap(), vec![1, 1, 0]);
        w.write(b"second", &mut wait()).unwrap(); // chunk 1 is free
        assert!(!w.can_write(), "chunk 0 is still unread by reader 1");
        assert!(matches!(w.acquire(&mut wait()), Err(Error::Timeout { .. })));
        assert_eq!(r1.data(&r1.poll().unwrap()), b"hello");
        r1.finish();
        // 4. read by all: the writer may write, nobody may read it again.
        assert_eq!(ring.metadata(0).unwrap(), vec![1, 1, 1]);
        assert!(w.can_write());
        assert_eq!(r0.data(&r0.poll().unwrap()), b"second");
        r0.finish();
        assert!(r0.poll().is_none(), "reader 0 has read everything");
        // A new round resets the read flags.
        w.write(b"third", &mut wait()).unwrap();
        assert_eq!(ring.metadata(0).unwrap(), vec![1, 0, 0]);
        assert_eq!(r0.data(&r0.poll().unwrap()), b"third");
    }

    #[test]
    fn slots_record_who_holds_each_side() {
        let ring = Arc::new(Ring::create(2, 64, 2).unwrap());
        assert!(ring.slot_info(None).unwrap().process.is_none());
        let mut w = RingWriter::new(ring.clone());
        let mut r1 = RingReader::new(ring.clone(), 1).unwrap();
        let me = ProcessId::current();
        assert_eq!(ring.slot_info(None).unwrap().process, Some(me));
        assert_eq!(ring.slot_info(Some(1)).unwrap().process, Some(me));
        assert!(ring.slot_info(Some(0)).unwrap().process.is_none());
        assert!(ring.slot_info(Some(2)).is_err());
        w.write(b"x", &mut wait()).unwrap();
        r1.poll().unwrap();
        r1.finish();
        assert_eq!(ring.slot_info(None).unwrap().messages, 1);
        assert_eq!(ring.slot_info(Some(1)).unwrap().messages, 1);
        assert_eq!(ring.creator(), me);
    }

    #[test]
    fn a_dead_reader_is_reported_or_dropped() {
        let ring = Arc::new(Ring::create(2, 64, 1).unwrap());
        let mut w = RingWriter::new(ring.clone());
        let mut r0 = RingReader::new(ring.clone(), 0).unwrap();
        // Reader 1's slot names a process that is gone (a pid that cannot exist).
        let slot = ring.slot(2);
        slot.pid.store(u32::MAX - 1, Ordering::Relaxed);
        slot.start_time.store(1, Ordering::Relaxed);
        slot.state.store(ATTACHED, Ordering::Release);
        w.write(b"one", &mut wait()).unwrap();
        r0.poll().unwrap();
        r0.finish();
        let long = || Wait::new("test", Some(Duration::from_secs(10)));
        match w.acquire(&mut long()) {
            Err(Error::DeadReader {
                reader: 1,
                chunk: 0,
                ..
            }) => {}
            other => panic!("expected DeadReader, got {other:?}"),
        }
        w.on_dead_reader(DeadReaderPolicy::Drop);
        w.acquire(&mut long()).unwrap();
        assert_eq!(w.dropped_readers(), vec![1]);
        assert!(ring.slot_info(Some(1)).unwrap().dropped);
        w.commit(3, ChunkKind::Inline).unwrap();
        // The dropped reader's flag is set, so it never holds the writer back.
        assert_eq!(ring.metadata(0).unwrap(), vec![1, 0, 1]);
    }

    #[test]
    fn a_dead_writer_is_reported() {
        let ring = Arc::new(Ring::create(1, 64, 1).unwrap());
        let r = RingReader::new(ring.clone(), 0).unwrap();
        let slot = ring.slot(0);
        slot.pid.store(u32::MAX - 1, Ordering::Relaxed);
        slot.state.store(ATTACHED, Ordering::Release);
        let err = r
            .wait(&mut Wait::new("test", Some(Duration::from_secs(10))))
            .unwrap_err();
        assert!(matches!(err, Error::DeadWriter { .. }), "{err}");
    }

    #[test]
    fn open_checks_the_header() {
        let ring = Ring::create(1, 16, 1).unwrap();
        let other = Ring::open(ring.name()).unwrap();
        assert_eq!(other.handle(), ring.handle());
        assert!(!other.is_creator());
        let seg = Segment::create(&unique_name("test"), 4096).unwrap();
        let err = Ring::open(seg.name()).unwrap_err();
        assert!(
            err.to_string().contains("not a shmq broadcast ring"),
            "{err}"
        );
    }

    #[test]
    fn too_large_message_and_bad_indices() {
        let ring = Arc::new(Ring::create(1, 16, 2).unwrap());
        let mut w = RingWriter::new(ring.clone());
        assert!(matches!(
            w.write(&[0; 17], &mut wait()),
            Err(Error::InvalidArgument(_))
        ));
        assert!(ring.data_ptr(2).is_err());
        assert!(ring.metadata_ptr(5).is_err());
        assert!(RingReader::new(ring, 1).is_err());
    }
}
