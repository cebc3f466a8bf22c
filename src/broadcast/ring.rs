//! The broadcast ring: `max_chunks` fixed-size chunks in one segment, each with a state
//! block holding one *written* flag and one *read* flag per reader.
//!
//! # Layout (all offsets from the start of the segment; everything is `#[repr(C)]`,
//! pointer-free and addressed by offset, so every process can map it anywhere)
//! ```text
//! 0                 RingHeader (128 bytes; `magic` is stored last, with Release)
//! states_offset     chunk state blocks, `state_stride` bytes each (a multiple of 64):
//!                     +0  len: u64      bytes of the message in the chunk
//!                     +8  kind: u32     INLINE / OVERFLOW / RAW
//!                     +16 written: u8, then read[0..n_reader]: u8  (the "metadata")
//! data_offset       chunk data, `data_stride` bytes each (max_chunk_bytes rounded up
//!                   to 64, so every chunk starts on a cache line)
//! ```
//! Each chunk's state sits in its own cache line(s): the writer and the readers of one
//! chunk must share that line, but work on different chunks never bounces a line.
//!
//! # Protocol (spec §1)
//! Writer, for chunk `i`:
//! 1. wait until `written == 0` or every `read[r] == 1` (Acquire loads: the readers'
//!    reads of the old data happen before our writes);
//! 2. `written = 0`; copy the message; store `len` and `kind`;
//! 3. every `read[r] = 0` (Release), then `written = 1` (Release: publishes the data).
//!
//! Reader `r`, for chunk `i`:
//! 1. the chunk is readable when `read[r] == 0` and then `written == 1`, loaded in that
//!    order with Acquire. The order matters: if `read[r]` shows a reset of a new round
//!    (step 3 above), its Release makes the earlier `written = 0` visible, so a stale
//!    `written == 1` from the previous round can no longer be seen;
//! 2. use the data; then `read[r] = 1` (Release: our reads are done before the writer's
//!    Acquire load of this flag lets it overwrite the chunk).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::segment::{unique_name, Segment};
use crate::wait::Wait;

/// "SHMQRNG1" in little-endian: marks a finished broadcast-ring segment.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"SHMQRNG1");
/// Bumped whenever the layout changes; openers refuse any other version.
pub const LAYOUT_VERSION: u32 = 1;

const CACHE_LINE: usize = 64;
const HEADER_SIZE: usize = 128;
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
}

impl ChunkKind {
    fn from_u32(v: u32) -> ChunkKind {
        match v {
            1 => ChunkKind::Inline,
            2 => ChunkKind::Overflow,
            _ => ChunkKind::Raw,
        }
    }
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
    creator_pid: u32,
    _reserved: [u8; 60],
}
const _: () = assert!(std::mem::size_of::<RingHeader>() == HEADER_SIZE);

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
        let states_offset = HEADER_SIZE;
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
// one writer while the protocol in the module docs keeps readers away from it.
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
        // SAFETY: the segment is new, HEADER_SIZE bytes long at least, page-aligned, and
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
            (*h).creator_pid = std::process::id();
        }
        // Release: pairs with the Acquire load in `Ring::open`; an opener that sees the
        // magic sees the whole header (the state blocks are zero from the kernel).
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
        if segment.len() < HEADER_SIZE {
            return Err(bad(format!("it is only {} bytes long", segment.len())));
        }
        let base = NonNull::new(segment.as_ptr()).expect("mmap never returns null");
        // SAFETY: the mapping is at least HEADER_SIZE bytes and page-aligned; the magic is
        // an atomic that the creator stores last.
        let header = unsafe { &*(base.as_ptr() as *const RingHeader) };
        // Acquire: pairs with the Release store in `create_named`, making the header
        // fields written before it visible.
        let magic = header.magic.load(Ordering::Acquire);
        if magic != RING_MAGIC {
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
    /// Pid of the process that created the segment.
    pub fn creator_pid(&self) -> u32 {
        self.header().creator_pid
    }

    pub fn handle(&self) -> RingHandle {
        RingHandle {
            n_reader: self.geo.n_reader,
            max_chunk_bytes: self.geo.max_chunk_bytes,
            max_chunks: self.geo.max_chunks,
            name: self.name().to_owned(),
        }
    }

    fn check_chunk(&self, i: usize) -> Result<()> {
        if i >= self.geo.max_chunks {
            return Err(Error::InvalidArgument(format!(
                "chunk index {i} out of range: the ring has {} chunks",
                self.geo.max_chunks
            )));
        }
        Ok(())
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

    fn len_of(&self, i: usize) -> &AtomicU64 {
        // SAFETY: in bounds (state_ptr), 8-aligned (stride and offset are multiples of
        // 64), and only ever accessed atomically by shmq.
        unsafe { &*(self.state_ptr(i).add(STATE_LEN_OFFSET) as *const AtomicU64) }
    }

    fn kind_of(&self, i: usize) -> &AtomicU32 {
        // SAFETY: as in `len_of`; offset 8 is 4-aligned.
        unsafe { &*(self.state_ptr(i).add(STATE_KIND_OFFSET) as *const AtomicU32) }
    }

    fn written(&self, i: usize) -> &AtomicU8 {
        // SAFETY: in bounds (the block has room for 1 + n_reader flags); u8 needs no alignment.
        unsafe { &*(self.state_ptr(i).add(STATE_FLAGS_OFFSET) as *const AtomicU8) }
    }

    fn read_flag(&self, i: usize, reader: usize) -> &AtomicU8 {
        debug_assert!(reader < self.geo.n_reader);
        // SAFETY: reader < n_reader, so the flag is inside the state block.
        unsafe { &*(self.state_ptr(i).add(STATE_FLAGS_OFFSET + 1 + reader) as *const AtomicU8) }
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
        // SAFETY: as in `written`.
        Ok((
            unsafe { self.state_ptr(i).add(STATE_FLAGS_OFFSET) },
            1 + self.geo.n_reader,
        ))
    }

    /// A snapshot of chunk `i`'s flags (for inspection and tests).
    pub fn metadata(&self, i: usize) -> Result<Vec<u8>> {
        self.check_chunk(i)?;
        // Relaxed: a diagnostic snapshot; it orders nothing.
        let mut v = vec![self.written(i).load(Ordering::Relaxed)];
        v.extend((0..self.geo.n_reader).map(|r| self.read_flag(i, r).load(Ordering::Relaxed)));
        Ok(v)
    }

    fn is_free_for_writer(&self, i: usize) -> bool {
        // Relaxed: only the writer stores `written`, so it always sees its own value.
        if self.written(i).load(Ordering::Relaxed) == 0 {
            return true;
        }
        // Acquire: pairs with the Release store of the flag in `RingReader::finish`, so
        // each reader's reads of the old data happen before we overwrite it.
        (0..self.geo.n_reader).all(|r| self.read_flag(i, r).load(Ordering::Acquire) == 1)
    }

    fn is_readable_by(&self, i: usize, reader: usize) -> bool {
        // Acquire, and this load first: see "Protocol" in the module docs. Pairs with the
        // Release reset in `RingWriter::commit`.
        if self.read_flag(i, reader).load(Ordering::Acquire) != 0 {
            return false;
        }
        // Acquire: pairs with the Release store of `written = 1` in `RingWriter::commit`;
        // the chunk's data, len and kind are visible after it.
        self.written(i).load(Ordering::Acquire) == 1
    }
}

/// The writer's side of a ring: it fills chunks in order, 0, 1, .., max_chunks-1, 0, ..
#[derive(Debug)]
pub struct RingWriter {
    ring: Arc<Ring>,
    next: usize,
    /// The chunk acquired and not yet committed, if any.
    open: Option<usize>,
}

impl RingWriter {
    pub fn new(ring: Arc<Ring>) -> RingWriter {
        RingWriter {
            ring,
            next: 0,
            open: None,
        }
    }

    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }

    /// Index of the chunk the next message goes to.
    pub fn current_index(&self) -> usize {
        self.next
    }

    /// Whether the next chunk can be written without waiting.
    pub fn can_write(&self) -> bool {
        self.ring.is_free_for_writer(self.next)
    }

    /// Wait until the next chunk is free, mark it not-written, and return its index. The
    /// chunk stays acquired until [`commit`](Self::commit) (or another `acquire`).
    pub fn acquire(&mut self, wait: &mut Wait) -> Result<usize> {
        let i = self.next;
        let ring = &*self.ring;
        wait.until(|| ring.is_free_for_writer(i).then_some(()))?;
        // Relaxed: every reader has read this chunk (or it was never written), so none
        // will look at it until the Release store of `written = 1` in `commit`.
        ring.written(i).store(0, Ordering::Relaxed);
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
        // Relaxed: published by the Release store of `written` below.
        ring.len_of(i).store(len as u64, Ordering::Relaxed);
        ring.kind_of(i).store(kind as u32, Ordering::Relaxed);
        for r in 0..ring.n_reader() {
            // Release: pairs with the first Acquire load in `Ring::is_readable_by`; a
            // reader that sees this reset also sees `written = 0` from `acquire`.
            ring.read_flag(i, r).store(0, Ordering::Release);
        }
        // Release: pairs with the Acquire load of `written` in `Ring::is_readable_by`,
        // publishing the data, len and kind.
        ring.written(i).store(1, Ordering::Release);
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
}

impl RingReader {
    /// Reader number `reader` (0-based, below the ring's `n_reader`).
    pub fn new(ring: Arc<Ring>, reader: usize) -> Result<RingReader> {
        if reader >= ring.n_reader() {
            return Err(Error::InvalidArgument(format!(
                "reader index {reader} out of range: the ring has {} readers",
                ring.n_reader()
            )));
        }
        Ok(RingReader {
            ring,
            reader,
            next: 0,
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
        if !self.ring.is_readable_by(i, self.reader) {
            return None;
        }
        // Relaxed: ordered by the Acquire load of `written` in `is_readable_by`.
        let len = self.ring.len_of(i).load(Ordering::Relaxed) as usize;
        let kind = ChunkKind::from_u32(self.ring.kind_of(i).load(Ordering::Relaxed));
        // A peer that wrote a bogus length cannot make us read outside the chunk.
        let len = match kind {
            ChunkKind::Raw => self.ring.max_chunk_bytes(),
            ChunkKind::Inline => len.min(self.ring.max_chunk_bytes()),
            ChunkKind::Overflow => len,
        };
        Some(ChunkInfo {
            index: i,
            len,
            kind,
        })
    }

    /// Wait until the next chunk is readable.
    pub fn wait(&self, wait: &mut Wait) -> Result<ChunkInfo> {
        wait.until(|| self.poll())
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
        // Release: pairs with the Acquire loads in `Ring::is_free_for_writer`; our reads
        // of the chunk happen before the writer may overwrite it.
        self.ring
            .read_flag(self.next, self.reader)
            .store(1, Ordering::Release);
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
