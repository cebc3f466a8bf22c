//! The object store: a FIFO ring of variable-size chunks in one segment (one writer
//! allocates, any process reads by `(address, id)`), and on top of it a key → object
//! index whose objects carry an atomic reader count and whose handles are signed.
//!
//! # Segment layout
//! ```text
//! 0      StoreHeader: magic (stored last, Release), layout version, capacity, creator
//! 64     Published: what readers check a handle against, under a seqlock (`seq`)
//! 128    the handle-signing secret: 32 random bytes, written before the magic
//! 4096   the ring: `capacity` bytes of chunks packed tightly (vLLM 0.33's layout):
//!          +0 id: u32, +4 size: u32 (header included), +8 data: `size - 8` bytes
//! ```
//! Chunk boundaries are wherever the allocator ([`crate::alloc`]) puts them: any byte
//! offset. Header words are therefore read and written byte by byte through `AtomicU8`
//! (an `AtomicU32` needs 4-byte alignment), and whatever needs alignment inside a chunk
//! is padded *inside* the chunk. An object's data is
//! ```text
//! [0..3 pad][count: u32][n: u32][n × (offset: u32, len: u32)][parts ...]
//! ```
//! The pad puts the reader count on a 4-byte boundary (it is an `AtomicU32`); the frame
//! gives each part's offset from the start of the data and its length. Parts from
//! `align_from` on (the raw tensor and array buffers of the built-in serdes) start on
//! 64-byte boundaries of the ring, which is page-aligned in memory; the others follow
//! each other without gaps, so a custom serde's `[metadata][data...]` stays contiguous.
//! Chunks are sized exactly for the offset they land on ([`FifoAllocator::allocate_with`]).
//!
//! # Which handles are valid
//! The writer publishes, under a seqlock, the live ids `[id_start, id_end)` and the ids
//! `[cleared_start, cleared_end)` of the chunks that were live at the last `clear()`,
//! with `overwritten`: since that clear the writer has written only ring bytes
//! `[0, overwritten)` (chunks are placed from offset 0 on, each at 0 or right after the
//! previous one, so what they cover is always a prefix). A reader accepts `(address, id)`
//! only if the id is live, or cleared and its chunk starts at or after `overwritten`
//! (vLLM 0.33 lets requests that are still draining read their objects after a
//! `clear()`, until the memory is reused), and the header at the address holds that id.
//! It checks the same again after using the payload, so an object reused meanwhile is
//! reported as modified instead of returning torn data. The writer publishes a change
//! *before* it writes over the memory concerned.
//!
//! # Eviction
//! `put` hands an object out once; each `get_cached` hands it out again. Every reader
//! increments the count once per read (one atomic `fetch_add`, no lock), so the object
//! may be evicted when `count >= n_readers * handouts`, oldest first, unless the writer
//! `touch`ed it and has not yet handed it out again or released its touches.
//!
//! # Signed handles
//! `sign(key, address, id)` is HMAC-SHA256, under the segment's secret, of
//! `sha256(key) ‖ address (u64 LE) ‖ id (u32 LE)`, as in vLLM 0.33. Readers check it, in
//! constant time, before they read anything at the address. The secret is readable by
//! every process that can open the segment (mode 0600: the same user), and by nobody else.

use std::collections::{HashMap, HashSet};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::alloc::{Chunk, FifoAllocator, Freed, HEADER_BYTES, ID_MAX};
use crate::error::{Error, Result};
use crate::process::ProcessId;
use crate::segment::{unique_name, Segment};
use crate::seqlock;
use crate::sync::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};

/// "SHMQSTO2" little-endian: marks a finished object-store segment.
pub const STORE_MAGIC: u64 = u64::from_le_bytes(*b"SHMQSTO2");
pub const STORE_LAYOUT_VERSION: u32 = 2;
/// The ring starts one page into the segment.
const RING_OFFSET: usize = 4096;
const PUBLISHED_OFFSET: usize = 64;
const SECRET_OFFSET: usize = 128;
/// Bytes of the handle-signing secret (vLLM's `AUTH_SECRET_BYTES`).
pub const SECRET_BYTES: usize = 32;
/// Bytes of a handle signature (one SHA-256 digest).
pub const SIGNATURE_BYTES: usize = 32;
/// Stored in the header of a freed chunk: never a valid id (ids are below 2**31).
const INVALID_ID: u32 = u32::MAX;
/// Bytes of an object's reader count.
pub const COUNT_BYTES: usize = 4;
/// Parts of an object from `align_from` on start at multiples of this (ring offset).
pub const PART_ALIGN: u64 = 64;
/// How long a reader waits for a consistent view of the published state before it
/// gives up (only a writer that died in the middle of an update can make it wait).
const SNAPSHOT_PATIENCE: Duration = Duration::from_secs(1);

/// The handle-signing key, ready to sign (HMAC-SHA256 keyed once).
type Signer = Hmac<Sha256>;

#[repr(C)]
struct StoreHeader {
    magic: AtomicU64,
    version: u32,
    creator_pid: u32,
    capacity: u64,
    creator_start_time: u64,
}
const _: () = assert!(std::mem::size_of::<StoreHeader>() <= PUBLISHED_OFFSET);

/// What readers check handles against (see the module docs), in its own cache line.
/// `seq` is a seqlock: odd while the writer updates the fields below it.
#[repr(C, align(64))]
struct Published {
    seq: AtomicU64,
    id_start: AtomicU32,
    id_end: AtomicU32,
    cleared_start: AtomicU32,
    cleared_end: AtomicU32,
    overwritten: AtomicU64,
    /// Statistics for `inspect` (outside the seqlock: they order nothing).
    live_chunks: AtomicU64,
    live_bytes: AtomicU64,
}
const _: () = assert!(std::mem::size_of::<Published>() == 64);
const _: () = assert!(PUBLISHED_OFFSET + 64 <= SECRET_OFFSET);
const _: () = assert!(SECRET_OFFSET + SECRET_BYTES <= RING_OFFSET);

/// One consistent reading of [`Published`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Snapshot {
    id_start: u32,
    id_end: u32,
    cleared_start: u32,
    cleared_end: u32,
    overwritten: u64,
}

/// Whether `id` is in `[start, end)` on the ids' circle (they wrap at 2**31).
fn id_in(id: u32, start: u32, end: u32) -> bool {
    id < ID_MAX && id.wrapping_sub(start) % ID_MAX < end.wrapping_sub(start) % ID_MAX
}

impl Snapshot {
    /// Whether a chunk with this id at this ring offset may still hold its object.
    fn names(&self, id: u32, offset: u64) -> bool {
        id_in(id, self.id_start, self.id_end)
            || (id_in(id, self.cleared_start, self.cleared_end) && offset >= self.overwritten)
    }
}

/// The store's occupancy as its writer last published it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreOccupancy {
    pub live_chunks: u64,
    /// Bytes from the oldest live chunk to the end of the newest.
    pub live_bytes: u64,
    pub id_start: u32,
    pub id_end: u32,
}

/// A mapped store segment: the part of the ring every process can use (no allocator).
pub struct StoreSegment {
    segment: Segment,
    ring: NonNull<u8>,
    capacity: u64,
    signer: Signer,
}

// SAFETY: `ring` points into `segment`'s mapping, alive as long as `self`. Shared state
// in it is reached through atomics (headers, published state, reader counts) or, for
// payload bytes, only by the single writer before it publishes a chunk and by readers
// after; see the module docs for how a reader detects a chunk reused under it.
unsafe impl Send for StoreSegment {}
// SAFETY: as for Send: `&StoreSegment` exposes atomics and bounds-checked reads only.
unsafe impl Sync for StoreSegment {}

impl std::fmt::Debug for StoreSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreSegment")
            .field("name", &self.name())
            .field("capacity", &self.capacity)
            .finish()
    }
}

/// A chunk found at an address: its ring offset, id and size (header included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    pub offset: u64,
    pub id: u32,
    pub size: u32,
}

/// 32 bytes from the kernel's random source.
fn random_secret() -> Result<[u8; SECRET_BYTES]> {
    let mut secret = [0u8; SECRET_BYTES];
    let mut filled = 0;
    while filled < SECRET_BYTES {
        // SAFETY: the pointer and length describe the unfilled tail of `secret`.
        let n = unsafe {
            libc::getrandom(
                secret[filled..].as_mut_ptr().cast(),
                SECRET_BYTES - filled,
                0,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::os("getrandom for the store's signing secret", e));
            }
        } else {
            filled += n as usize;
        }
    }
    Ok(secret)
}

impl StoreSegment {
    fn create(name: &str, capacity: u64) -> Result<StoreSegment> {
        let total = usize::try_from(capacity)
            .ok()
            .and_then(|c| c.checked_add(RING_OFFSET))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("data_buffer_size {capacity} is too large"))
            })?;
        let secret = random_secret()?;
        let segment = Segment::create(name, total)?;
        let base = NonNull::new(segment.as_ptr()).expect("mmap never returns null");
        // SAFETY: the segment is new, page-aligned and longer than RING_OFFSET; nobody
        // else uses it before the magic is stored below (an opener refuses it until then).
        unsafe {
            let h = base.as_ptr() as *mut StoreHeader;
            (*h).version = STORE_LAYOUT_VERSION;
            let me = ProcessId::current();
            (*h).creator_pid = me.pid;
            (*h).creator_start_time = me.start_time;
            (*h).capacity = capacity;
            std::ptr::copy_nonoverlapping(
                secret.as_ptr(),
                base.as_ptr().add(SECRET_OFFSET),
                SECRET_BYTES,
            );
        }
        // SAFETY: RING_OFFSET < total.
        let ring = unsafe { NonNull::new_unchecked(base.as_ptr().add(RING_OFFSET)) };
        let s = StoreSegment {
            segment,
            ring,
            capacity,
            signer: Signer::new_from_slice(&secret).expect("HMAC takes keys of any length"),
        };
        // Release: pairs with the Acquire load in `open`: the header fields and the
        // secret are visible to an opener that sees the magic.
        s.header().magic.store(STORE_MAGIC, Ordering::Release);
        Ok(s)
    }

    fn open(name: &str) -> Result<StoreSegment> {
        let segment = Segment::open(name)?;
        let bad = |reason: String| Error::BadSegment {
            name: name.to_owned(),
            reason,
        };
        if segment.len() < RING_OFFSET {
            return Err(bad(format!("it is only {} bytes long", segment.len())));
        }
        let base = NonNull::new(segment.as_ptr()).expect("mmap never returns null");
        // SAFETY: the mapping is page-aligned and at least RING_OFFSET bytes long. The
        // header's plain fields are written once, before the magic, and never again; a
        // peer that scribbles on them can only make this open fail or mis-size the ring,
        // which the size check below catches.
        let header = unsafe { &*(base.as_ptr() as *const StoreHeader) };
        // Acquire: pairs with the Release store in `create`.
        if header.magic.load(Ordering::Acquire) != STORE_MAGIC {
            return Err(bad(
                "it is not a shmq object store of this version (or its creator has not \
                 finished setting it up)"
                    .into(),
            ));
        }
        if header.version != STORE_LAYOUT_VERSION {
            return Err(bad(format!(
                "its layout version is {}, this shmq reads version {STORE_LAYOUT_VERSION}",
                header.version
            )));
        }
        let capacity = header.capacity;
        if (segment.len() - RING_OFFSET) as u64 != capacity || capacity <= HEADER_BYTES {
            return Err(bad("its header does not match its size".into()));
        }
        let mut secret = [0u8; SECRET_BYTES];
        // SAFETY: SECRET_OFFSET + SECRET_BYTES <= RING_OFFSET <= len; the secret was
        // written before the magic (Acquire above) and shmq never writes it again. A peer
        // that rewrote it (it would need write access to this owner-only segment) could
        // only make this process refuse the writer's signatures: these are plain bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                base.as_ptr().add(SECRET_OFFSET),
                secret.as_mut_ptr(),
                SECRET_BYTES,
            )
        };
        // SAFETY: RING_OFFSET < segment.len().
        let ring = unsafe { NonNull::new_unchecked(base.as_ptr().add(RING_OFFSET)) };
        Ok(StoreSegment {
            segment,
            ring,
            capacity,
            signer: Signer::new_from_slice(&secret).expect("HMAC takes keys of any length"),
        })
    }

    fn header(&self) -> &StoreHeader {
        // SAFETY: see `create`/`open`: in bounds and aligned.
        unsafe { &*(self.segment.as_ptr() as *const StoreHeader) }
    }

    fn published(&self) -> &Published {
        // SAFETY: PUBLISHED_OFFSET + 64 <= RING_OFFSET, inside the mapping and 64-aligned
        // (the mapping is page-aligned); every field is an atomic. A peer that writes
        // them can make handles look valid or invalid, which the header and frame checks
        // bound: reads never leave the ring.
        unsafe { &*(self.segment.as_ptr().add(PUBLISHED_OFFSET) as *const Published) }
    }

    /// The handle-signing secret (vLLM's `get_auth_secret()`).
    pub fn secret(&self) -> [u8; SECRET_BYTES] {
        let mut secret = [0u8; SECRET_BYTES];
        // SAFETY: as in `open`: inside the header page, written once before the magic;
        // a peer rewriting it changes only the bytes returned.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.segment.as_ptr().add(SECRET_OFFSET),
                secret.as_mut_ptr(),
                SECRET_BYTES,
            )
        };
        secret
    }

    pub fn name(&self) -> &str {
        self.segment.name()
    }
    /// Bytes of the ring (`data_buffer_size`).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }
    pub fn is_creator(&self) -> bool {
        self.segment.is_creator()
    }
    pub fn creator_pid(&self) -> u32 {
        self.header().creator_pid
    }
    /// The process that created the segment.
    pub fn creator(&self) -> ProcessId {
        let h = self.header();
        ProcessId {
            pid: h.creator_pid,
            start_time: h.creator_start_time,
        }
    }

    /// Occupancy as the writer last published it (for inspection).
    pub fn occupancy(&self) -> StoreOccupancy {
        let p = self.published();
        let ids = self.snapshot().unwrap_or_default();
        // Relaxed: statistics; the values may be from slightly different moments.
        StoreOccupancy {
            live_chunks: p.live_chunks.load(Ordering::Relaxed),
            live_bytes: p.live_bytes.load(Ordering::Relaxed),
            id_start: ids.id_start,
            id_end: ids.id_end,
        }
    }

    /// A consistent reading of the published state; `None` if the writer stays in the
    /// middle of an update (it died there, or a peer wrote garbage into `seq`).
    fn snapshot(&self) -> Option<Snapshot> {
        let p = self.published();
        // Read the clock only once the first attempts have failed: it costs more than a
        // consistent read.
        let mut started = None;
        for attempt in 0u32.. {
            // The seqlock's read side (see `crate::seqlock` for the orderings).
            let snap = seqlock::read(&p.seq, || {
                // Relaxed: ordered by the seqlock's Acquire load and fence.
                Snapshot {
                    id_start: p.id_start.load(Ordering::Relaxed),
                    id_end: p.id_end.load(Ordering::Relaxed),
                    cleared_start: p.cleared_start.load(Ordering::Relaxed),
                    cleared_end: p.cleared_end.load(Ordering::Relaxed),
                    overwritten: p.overwritten.load(Ordering::Relaxed),
                }
            });
            if snap.is_some() {
                return snap;
            }
            if attempt < 64 {
                std::hint::spin_loop();
            } else if started.get_or_insert_with(Instant::now).elapsed() > SNAPSHOT_PATIENCE {
                return None;
            } else {
                std::thread::yield_now();
            }
        }
        None
    }

    /// Writer only: update the published state (the seqlock's write side).
    fn publish(&self, update: impl FnOnce(&Published)) {
        let p = self.published();
        // The seqlock's write side (only the writer, under the store's lock, calls this);
        // its closing Release fence orders the update before every later write of the
        // writer (into chunks it concerns), for readers that check it again after reading.
        seqlock::write(&p.seq, || update(p));
    }

    /// Writer only: publish the allocator's state and occupancy.
    fn publish_ids(&self, a: &FifoAllocator) {
        self.publish(|p| {
            // Relaxed: inside the seqlock (see `publish`).
            p.id_start.store(a.id_start(), Ordering::Relaxed);
            p.id_end.store(a.id_end(), Ordering::Relaxed);
        });
        let p = self.published();
        // Relaxed: statistics for inspection; nothing is ordered by them.
        p.live_chunks
            .store(a.live().len() as u64, Ordering::Relaxed);
        p.live_bytes.store(a.live_bytes(), Ordering::Relaxed);
    }

    /// Remove the segment's name now (see `Segment::unlink`).
    pub fn unlink(&self) -> Result<()> {
        self.segment.unlink()
    }

    /// The whole ring, for `shared_memory.buf`.
    pub fn ring_ptr(&self) -> *mut u8 {
        self.ring.as_ptr()
    }

    /// The byte at ring offset `offset`, as an atomic.
    fn byte(&self, offset: u64) -> &AtomicU8 {
        debug_assert!(offset < self.capacity);
        // SAFETY: callers pass an offset inside the ring. AtomicU8 has alignment 1. Any
        // process mapping the segment may write this byte at any time; an atomic access
        // makes that a race on values (which the callers check), not undefined behaviour.
        unsafe { &*(self.ring.as_ptr().add(offset as usize) as *const AtomicU8) }
    }

    /// Load the u32 at ring offset `offset` (any alignment) byte by byte, Relaxed.
    fn load_u32(&self, offset: u64) -> u32 {
        debug_assert!(offset + 4 <= self.capacity);
        // Relaxed: callers order these loads (by a snapshot before, a fence after).
        u32::from_le_bytes(std::array::from_fn(|i| {
            self.byte(offset + i as u64).load(Ordering::Relaxed)
        }))
    }

    /// Store `value` at ring offset `offset` (any alignment) byte by byte, Relaxed.
    fn store_u32(&self, offset: u64, value: u32) {
        debug_assert!(offset + 4 <= self.capacity);
        for (i, b) in value.to_le_bytes().into_iter().enumerate() {
            // Relaxed: published by the writer's next `publish` (Release).
            self.byte(offset + i as u64).store(b, Ordering::Relaxed);
        }
    }

    /// The 4-aligned reader count at ring offset `offset`.
    fn count(&self, offset: u64) -> &AtomicU32 {
        assert!(offset % 4 == 0 && offset + 4 <= self.capacity);
        // SAFETY: checked just above: 4-aligned (the ring start is page-aligned) and
        // inside the ring. shmq touches counts only atomically; a peer (or a Python view
        // from `access_buf`) could write it non-atomically, which changes the count, and
        // so only when the object is evicted, never what memory is read.
        unsafe { &*(self.ring.as_ptr().add(offset as usize) as *const AtomicU32) }
    }

    /// Write the header of a freshly allocated chunk (writer only; published after).
    fn write_header(&self, chunk: &Chunk) {
        let offset = chunk.offset(self.capacity);
        self.store_u32(offset + 4, chunk.size);
        self.store_u32(offset, chunk.id);
    }

    /// The header at `address`, checked to describe a chunk inside the ring.
    pub fn header_at(&self, address: u64) -> Result<ChunkHeader> {
        let offset = address % self.capacity;
        let invalid = || Error::InvalidArgument(format!("no chunk can be at address {address}"));
        if offset + HEADER_BYTES > self.capacity {
            return Err(invalid());
        }
        let id = self.load_u32(offset);
        let size = self.load_u32(offset + 4);
        if (size as u64) < HEADER_BYTES || offset + size as u64 > self.capacity {
            return Err(invalid());
        }
        Ok(ChunkHeader { offset, id, size })
    }

    /// Start and length of a chunk's data (after the 8-byte header).
    pub fn data_ptr(&self, h: &ChunkHeader) -> (*mut u8, usize) {
        // SAFETY: `h` came from `header_at` or the allocator, so offset + size <= capacity.
        let p = unsafe { self.ring.as_ptr().add((h.offset + HEADER_BYTES) as usize) };
        (p, h.size as usize - HEADER_BYTES as usize)
    }

    /// The HMAC-SHA256 that signs the handle `(address, id)` of `key`.
    pub fn sign(&self, key: &str, address: u64, id: u32) -> [u8; SIGNATURE_BYTES] {
        self.keyed_mac(key, address, id)
            .finalize()
            .into_bytes()
            .into()
    }

    fn keyed_mac(&self, key: &str, address: u64, id: u32) -> Signer {
        let mut mac = self.signer.clone();
        mac.update(&Sha256::digest(key.as_bytes()));
        mac.update(&address.to_le_bytes());
        mac.update(&id.to_le_bytes());
        mac
    }

    /// Check a handle's signature (constant-time compare); readers do this before they
    /// read anything at `address`.
    pub fn verify(&self, key: &str, address: u64, id: u32, signature: &[u8]) -> Result<()> {
        self.keyed_mac(key, address, id)
            .verify_slice(signature)
            .map_err(|_| Error::BadSignature { missing: false })
    }
}

fn writer_only(what: &str) -> Error {
    Error::WrongRole(format!("Only the writer can {what}."))
}

/// The spec's `RingBuffer`: the segment plus, on the writer, the FIFO allocator.
#[derive(Debug)]
pub struct ChunkRing {
    segment: Arc<StoreSegment>,
    writer: Option<RingWriter>,
}

/// The writer's state: the allocator and what it remembers of the last clear.
#[derive(Debug)]
struct RingWriter {
    alloc: FifoAllocator,
    /// Whether the chunks live at the last clear may still be read (see the module docs).
    cleared_readable: bool,
    /// End offset of the furthest of those chunks.
    cleared_end_offset: u64,
    /// Ring bytes `[0, overwritten)` written since the last clear.
    overwritten: u64,
}

impl ChunkRing {
    /// Create a ring of `capacity` bytes (this process is its writer).
    pub fn create(capacity: u64, name: Option<&str>) -> Result<ChunkRing> {
        let alloc = FifoAllocator::new(capacity).map_err(Error::InvalidArgument)?;
        let name = name.map_or_else(|| unique_name("store"), str::to_owned);
        Ok(ChunkRing {
            segment: Arc::new(StoreSegment::create(&name, capacity)?),
            writer: Some(RingWriter {
                alloc,
                cleared_readable: false,
                cleared_end_offset: 0,
                overwritten: 0,
            }),
        })
    }

    /// Open an existing ring as a reader; `capacity`, if given, must match.
    pub fn open(name: &str, capacity: Option<u64>) -> Result<ChunkRing> {
        let segment = StoreSegment::open(name)?;
        if let Some(c) = capacity.filter(|&c| c != segment.capacity()) {
            return Err(Error::InvalidArgument(format!(
                "shared memory segment '{name}' holds a ring of {} bytes, not {c}",
                segment.capacity()
            )));
        }
        Ok(ChunkRing {
            segment: Arc::new(segment),
            writer: None,
        })
    }

    pub fn segment(&self) -> &Arc<StoreSegment> {
        &self.segment
    }
    pub fn is_writer(&self) -> bool {
        self.writer.is_some()
    }
    /// The writer's allocator state.
    pub fn allocator(&self) -> Option<&FifoAllocator> {
        self.writer.as_ref().map(|w| &w.alloc)
    }

    /// Allocate a chunk with `data_bytes` of data and write its header.
    pub fn allocate(&mut self, data_bytes: u64) -> Result<Chunk> {
        if data_bytes == 0 {
            return Err(Error::InvalidArgument("Size must be greater than 0".into()));
        }
        self.allocate_with(|_| data_bytes)
    }

    /// Allocate a chunk sized by `data_bytes_at(ring offset)` (see
    /// [`FifoAllocator::allocate_with`]) and write its header.
    pub fn allocate_with(&mut self, data_bytes_at: impl FnMut(u64) -> u64) -> Result<Chunk> {
        let segment = &*self.segment;
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| writer_only("allocate buffers"))?;
        let chunk = w.alloc.allocate_with(data_bytes_at)?;
        let end = chunk.offset(segment.capacity()) + chunk.size as u64;
        if w.cleared_readable && end > w.overwritten {
            // The chunk covers bytes of chunks live at the last clear: say so before
            // writing them (`publish` orders this before the writes below).
            w.overwritten = end;
            let done = w.overwritten >= w.cleared_end_offset;
            w.cleared_readable = !done;
            segment.publish(|p| {
                // Relaxed: inside the seqlock (see `publish`).
                p.overwritten.store(end, Ordering::Relaxed);
                if done {
                    let id_end = p.id_end.load(Ordering::Relaxed);
                    p.cleared_start.store(id_end, Ordering::Relaxed);
                    p.cleared_end.store(id_end, Ordering::Relaxed);
                }
            });
        }
        segment.write_header(&chunk);
        // The header is written before the new id is published.
        segment.publish_ids(&w.alloc);
        Ok(chunk)
    }

    /// Free chunks oldest first while `is_free(id, data)` and fewer than `nbytes` bytes
    /// have been freed; a chunk is freed (and handles to it stop working) as soon as
    /// `is_free` returns true for it.
    pub fn free_while(
        &mut self,
        nbytes: u64,
        mut is_free: impl FnMut(u32, &[u8]) -> bool,
    ) -> Result<Freed> {
        let segment = &*self.segment;
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| writer_only("free buffers"))?;
        let capacity = segment.capacity();
        let freed = w.alloc.free_while(nbytes, |c| {
            let h = ChunkHeader {
                offset: c.offset(capacity),
                id: c.id,
                size: c.size,
            };
            let (p, n) = segment.data_ptr(&h);
            // SAFETY: a live chunk of ours lies inside the ring (allocator invariant);
            // readers only read it, and a peer writing it can only change what `is_free`
            // decides.
            let free = is_free(c.id, unsafe { std::slice::from_raw_parts(p, n) });
            if free {
                // Stamp the header too (published with the new id_start below).
                segment.store_u32(h.offset, INVALID_ID);
            }
            free
        });
        if freed.count > 0 {
            segment.publish_ids(&w.alloc);
        }
        Ok(freed)
    }

    /// Forget every chunk (writer only). Ids keep counting and addresses restart at 0;
    /// handles issued before keep reading their data until the memory is reused.
    pub fn clear(&mut self) -> Result<()> {
        let segment = &*self.segment;
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| writer_only("clear the buffer"))?;
        let capacity = segment.capacity();
        let (cleared_start, cleared_end) = (w.alloc.id_start(), w.alloc.id_end());
        w.cleared_end_offset = w
            .alloc
            .live()
            .map(|c| c.offset(capacity) + c.size as u64)
            .max()
            .unwrap_or(0);
        w.cleared_readable = w.cleared_end_offset > 0;
        w.overwritten = 0;
        w.alloc.clear();
        segment.publish(|p| {
            // Relaxed: inside the seqlock (see `publish`).
            p.cleared_start.store(cleared_start, Ordering::Relaxed);
            p.cleared_end.store(cleared_end, Ordering::Relaxed);
            p.overwritten.store(0, Ordering::Relaxed);
        });
        segment.publish_ids(&w.alloc);
        Ok(())
    }
}

/// Where the count and the parts of an object go: offsets from the start of the
/// chunk's data, which is at ring offset `data_offset`.
fn object_layout(
    data_offset: u64,
    lens: impl Iterator<Item = u64>,
    n: usize,
    align_from: usize,
    mut place: impl FnMut(usize, u64),
) -> u64 {
    let count_at = (4 - data_offset % 4) % 4;
    let mut at = count_at + COUNT_BYTES as u64 + 4 + 8 * n as u64;
    for (i, len) in lens.enumerate() {
        if i >= align_from {
            at = (data_offset + at).next_multiple_of(PART_ALIGN) - data_offset;
        }
        place(i, at);
        at += len;
    }
    at
}

/// The object in a chunk's data, its frame checked against the chunk's bounds.
pub struct ObjectView<'a> {
    /// The chunk's data (after the 8-byte header).
    data: &'a [u8],
    /// Where the count is in `data`.
    count_at: usize,
    n: usize,
}

impl<'a> ObjectView<'a> {
    /// Parse the frame of the object whose chunk data is `data` (at ring offset
    /// `data_offset`); any frame that points outside the data is an error.
    fn parse(data: &'a [u8], data_offset: u64) -> Option<ObjectView<'a>> {
        let count_at = ((4 - data_offset % 4) % 4) as usize;
        let word = |at: usize| -> Option<u32> {
            let b = data.get(at..at.checked_add(4)?)?;
            Some(u32::from_le_bytes(b.try_into().ok()?))
        };
        let n = word(count_at + COUNT_BYTES)? as usize;
        let frame_end = (count_at + COUNT_BYTES + 4).checked_add(n.checked_mul(8)?)?;
        if frame_end > data.len() {
            return None;
        }
        let view = ObjectView { data, count_at, n };
        for i in 0..n {
            let (off, len) = view.entry(i);
            if off < frame_end || off.checked_add(len)? > data.len() {
                return None;
            }
        }
        Some(view)
    }

    fn entry(&self, i: usize) -> (usize, usize) {
        let at = self.count_at + COUNT_BYTES + 4 + 8 * i;
        let w = |k: usize| u32::from_le_bytes(self.data[k..k + 4].try_into().unwrap()) as usize;
        (w(at), w(at + 4))
    }

    /// Number of parts.
    pub fn len(&self) -> usize {
        self.n
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    /// Part `i`: inside the chunk. The frame is read again here from shared memory; if
    /// it changed since `parse` checked it (the writer reused the chunk after a `clear()`
    /// while a reader used it, or another process wrote it), the range may be anything:
    /// it is then clamped to nothing, and `read_object`'s check after the read reports a
    /// reused object as modified. (Found by `fuzz/fuzz_targets/store_reader.rs`.)
    pub fn part(&self, i: usize) -> &'a [u8] {
        let (off, len) = self.entry(i);
        self.data.get(off..off.saturating_add(len)).unwrap_or(&[])
    }
    /// From the start of the first part to the end of the last (the parts of a custom
    /// serde follow each other without gaps: this is its `[metadata][data...]`).
    pub fn span(&self) -> &'a [u8] {
        if self.n == 0 {
            let at = self.count_at + COUNT_BYTES + 4;
            return &self.data[at..at];
        }
        let (first, _) = self.entry(0);
        let (last, len) = self.entry(self.n - 1);
        let end = last.saturating_add(len).max(first);
        // Clamped as in `part`: the frame may have changed since it was checked.
        self.data.get(first..end).unwrap_or(&[])
    }
}

/// The writer's bookkeeping for one object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub address: u64,
    pub id: u32,
    /// Times handed out by `put`/`get_cached`.
    pub handouts: u32,
}

/// Key → object index over a [`ChunkRing`] (the spec's `ObjectStorage`, minus serde).
/// Methods take the ring explicitly so the ring can be shared with its own API.
#[derive(Debug)]
pub struct ObjectStore {
    max_object_size: u64,
    n_readers: u32,
    keys: HashMap<Arc<str>, Entry>,
    ids: HashMap<u32, Arc<str>>,
    /// Ids the writer `touch`ed: not evicted until handed out again or released.
    touched: HashSet<u32>,
}

impl ObjectStore {
    pub fn new(max_object_size: u64, n_readers: u32) -> Result<ObjectStore> {
        if max_object_size <= COUNT_BYTES as u64 {
            return Err(Error::InvalidArgument(format!(
                "max_object_size must exceed {COUNT_BYTES} bytes"
            )));
        }
        Ok(ObjectStore {
            max_object_size,
            n_readers,
            keys: HashMap::new(),
            ids: HashMap::new(),
            touched: HashSet::new(),
        })
    }

    pub fn max_object_size(&self) -> u64 {
        self.max_object_size
    }
    pub fn n_readers(&self) -> u32 {
        self.n_readers
    }
    pub fn entry(&self, key: &str) -> Option<&Entry> {
        self.keys.get(key)
    }
    pub fn entries(&self) -> impl Iterator<Item = (&str, &Entry)> + '_ {
        self.keys.iter().map(|(k, e)| (&**k, e))
    }
    pub fn key_of(&self, id: u32) -> Option<&str> {
        self.ids.get(&id).map(|k| &**k)
    }
    pub fn is_touched(&self, id: u32) -> bool {
        self.touched.contains(&id)
    }
    /// Number of stored objects.
    pub fn len(&self) -> usize {
        self.keys.len()
    }
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Count one more hand-out of the object with id `id` (vLLM's
    /// `increment_writer_flag`); false if no stored object has that id.
    pub fn hand_out(&mut self, id: u32) -> bool {
        let Some(e) = self.ids.get(&id).and_then(|k| self.keys.get_mut(k)) else {
            return false;
        };
        e.handouts += 1;
        true
    }

    /// Whether the object with id `id`, whose chunk data is `data`, may be evicted: not
    /// touched, and read `n_readers` times per hand-out.
    pub fn is_free(&self, id: u32, data: &[u8]) -> bool {
        if self.touched.contains(&id) {
            return false;
        }
        let handouts = self
            .ids
            .get(&id)
            .and_then(|k| self.keys.get(k))
            .map_or(0, |e| e.handouts);
        reader_count(data) as u64 >= self.n_readers as u64 * handouts as u64
    }

    /// Store an object made of `parts` under `key`; returns `(address, id)`. Parts from
    /// `align_from` on start at 64-byte boundaries of the ring; the others follow each
    /// other. When the ring is full, first frees objects every reader has finished with.
    pub fn put(
        &mut self,
        ring: &mut ChunkRing,
        key: &str,
        parts: &[&[u8]],
        align_from: usize,
    ) -> Result<(u64, u32)> {
        if !ring.is_writer() {
            return Err(Error::WrongRole("Only the writer can put objects.".into()));
        }
        if self.keys.contains_key(key) {
            return Err(Error::KeyExists(key.to_owned()));
        }
        // vLLM's measure: the count plus the serialized bytes (not the frame or padding).
        let size = COUNT_BYTES as u64 + parts.iter().map(|p| p.len() as u64).sum::<u64>();
        if size > self.max_object_size {
            return Err(Error::TooLarge {
                size,
                max: self.max_object_size,
            });
        }
        let lens = || parts.iter().map(|p| p.len() as u64);
        let n = parts.len();
        let size_at = |chunk_offset: u64| {
            object_layout(
                chunk_offset + HEADER_BYTES,
                lens(),
                n,
                align_from,
                |_, _| (),
            )
        };
        let chunk = match ring.allocate_with(size_at) {
            Err(Error::Full(_)) => {
                self.free_unused(ring)?;
                ring.allocate_with(size_at)?
            }
            other => other?,
        };
        let segment = ring.segment();
        let h = ChunkHeader {
            offset: chunk.offset(segment.capacity()),
            id: chunk.id,
            size: chunk.size,
        };
        let (p, len) = segment.data_ptr(&h);
        let data_offset = h.offset + HEADER_BYTES;
        let count_at = (4 - data_offset % 4) % 4;
        // Relaxed: the count starts at 0 before the handle is given to anyone; the
        // channel that carries the handle to readers orders it (as it does the payload).
        segment
            .count(data_offset + count_at)
            .store(0, Ordering::Relaxed);
        let frame_at = (count_at as usize) + COUNT_BYTES;
        let write = |at: usize, bytes: &[u8]| {
            debug_assert!(at + bytes.len() <= len);
            // SAFETY: the chunk is ours (just allocated, not yet handed out; readers only
            // read it after they get its handle), and `object_layout` sized it so that
            // every write made here stays inside its `len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.add(at), bytes.len()) };
        };
        write(frame_at, &(n as u32).to_le_bytes());
        let end = object_layout(data_offset, lens(), n, align_from, |i, at| {
            let entry_at = frame_at + 4 + 8 * i;
            write(entry_at, &(at as u32).to_le_bytes());
            write(entry_at + 4, &(parts[i].len() as u32).to_le_bytes());
            write(at as usize, parts[i]);
        });
        debug_assert_eq!(end as usize, len);
        let key: Arc<str> = key.into();
        let entry = Entry {
            address: chunk.address,
            id: chunk.id,
            handouts: 1,
        };
        self.keys.insert(key.clone(), entry);
        self.ids.insert(chunk.id, key);
        Ok((chunk.address, chunk.id))
    }

    /// Hand `key`'s object out once more (every reader will read it once more); this
    /// also ends a `touch` of it.
    pub fn get_cached(&mut self, key: &str) -> Option<(u64, u32)> {
        let e = self.keys.get_mut(key)?;
        e.handouts += 1;
        self.touched.remove(&e.id);
        Some((e.address, e.id))
    }

    /// Keep `key`'s object from being evicted until the next `get_cached(key)` or
    /// `release_touches()`; unknown keys are ignored.
    pub fn touch(&mut self, key: &str) {
        if let Some(e) = self.keys.get(key) {
            self.touched.insert(e.id);
        }
    }

    /// Stop protecting every touched object.
    pub fn release_touches(&mut self) {
        self.touched.clear();
    }

    /// The signature of `key`'s current handle.
    pub fn signature(&self, segment: &StoreSegment, key: &str) -> Option<[u8; SIGNATURE_BYTES]> {
        let e = self.keys.get(key)?;
        Some(segment.sign(key, e.address, e.id))
    }

    /// The writer's check of a handle a request brings back: it must be `key`'s current
    /// entry and carry the right signature.
    pub fn verify_current(
        &self,
        segment: &StoreSegment,
        key: &str,
        address: u64,
        id: u32,
        signature: &[u8],
    ) -> Result<()> {
        match self.keys.get(key) {
            Some(e) if (e.address, e.id) == (address, id) => {
                segment.verify(key, address, id, signature)
            }
            _ => Err(Error::BadSignature { missing: false }),
        }
    }

    /// Free objects, oldest first, that every reader has finished with, up to about
    /// `2 * max_object_size` bytes. Returns the freed ids.
    pub fn free_unused(&mut self, ring: &mut ChunkRing) -> Result<Freed> {
        let limit = 2 * self.max_object_size;
        let freed = ring.free_while(limit, |id, data| self.is_free(id, data))?;
        for id in freed.ids() {
            if let Some(key) = self.ids.remove(&id) {
                self.keys.remove(&key);
            }
        }
        Ok(freed)
    }

    /// Forget every object and chunk.
    pub fn clear(&mut self, ring: &mut ChunkRing) -> Result<()> {
        ring.clear()?;
        self.keys.clear();
        self.ids.clear();
        self.touched.clear();
        Ok(())
    }
}

/// The reader count of the object whose chunk data is `data`.
fn reader_count(data: &[u8]) -> u32 {
    let count_at = (4 - data.as_ptr() as usize % 4) % 4;
    if data.len() < count_at + COUNT_BYTES {
        // Not an object (a raw allocation through the ring's own API): nothing counts.
        return 0;
    }
    // SAFETY: inside `data` (checked above) and 4-aligned by construction. shmq accesses
    // reader counts only atomically (a Python view from `access_buf` could write one:
    // that changes the count, which only decides when the object may be evicted).
    let count = unsafe { &*(data.as_ptr().add(count_at) as *const AtomicU32) };
    // Acquire: pairs with the Release increment in `read_object`; the reader's use of
    // the payload happens before the writer frees (and later overwrites) it.
    count.load(Ordering::Acquire)
}

/// The header of the object at `address` if `(address, id)` names a live (or cleared
/// but intact) object.
fn object_header(segment: &StoreSegment, address: u64, id: u32) -> Result<ChunkHeader> {
    let stale = || Error::StaleObject {
        address,
        id: id as u64,
    };
    // vLLM's arithmetic never gives a chunk an address of two laps or more.
    if address / 2 >= segment.capacity() {
        return Err(stale());
    }
    let snap = segment.snapshot().ok_or_else(stale)?;
    let offset = address % segment.capacity();
    if !snap.names(id, offset) {
        return Err(stale());
    }
    let h = segment.header_at(address).map_err(|_| stale())?;
    if h.id != id {
        return Err(stale());
    }
    Ok(h)
}

/// Whether `(address, id)` still names the object whose header is `h`: to call after
/// using its payload.
fn still_valid(segment: &StoreSegment, h: &ChunkHeader) -> bool {
    // Acquire fence: the payload reads before it complete before the loads below; if
    // they show the object still valid, the writer had not started reusing it (it
    // publishes before it writes, see `ChunkRing::allocate_with`/`free_while`).
    fence(Ordering::Acquire);
    segment.load_u32(h.offset) == h.id
        && segment.snapshot().is_some_and(|s| s.names(h.id, h.offset))
}

/// Check that `(address, id)` names a live object (what a reader's `touch` does).
pub fn check_object(segment: &StoreSegment, address: u64, id: u32) -> Result<()> {
    object_header(segment, address, id).map(|_| ())
}

/// Read the object at `(address, id)`: check the handle, call `f` on its parts, check
/// the handle again, and (if `count_read`) count this as one read. Any process may call
/// it.
pub fn read_object<R>(
    segment: &StoreSegment,
    address: u64,
    id: u32,
    count_read: bool,
    f: impl FnOnce(&ObjectView<'_>) -> R,
) -> Result<R> {
    let stale = || Error::StaleObject {
        address,
        id: id as u64,
    };
    let h = object_header(segment, address, id)?;
    let (p, n) = segment.data_ptr(&h);
    // SAFETY: the range is inside the ring (header_at). The writer does not overwrite a
    // live object until every reader has counted its read, which we do only after `f`;
    // a stale handle, or a peer writing the ring, may change these bytes under us: the
    // frame is bounds-checked before use and the handle checked again after `f`.
    let data = unsafe { std::slice::from_raw_parts(p, n) };
    let view = ObjectView::parse(data, h.offset + HEADER_BYTES).ok_or_else(stale)?;
    let out = f(&view);
    if !still_valid(segment, &h) {
        return Err(stale());
    }
    if count_read {
        let count_at = h.offset + HEADER_BYTES + view.count_at as u64;
        // Release: pairs with the Acquire load in `reader_count`: our reads of the
        // payload happen before the writer's eviction decision.
        segment.count(count_at).fetch_add(1, Ordering::Release);
    }
    Ok(out)
}

/// The reader count of the object at `(address, id)` (for inspection and tests).
pub fn object_reader_count(segment: &StoreSegment, address: u64, id: u32) -> Result<u32> {
    let h = object_header(segment, address, id)?;
    let (p, n) = segment.data_ptr(&h);
    // SAFETY: inside the ring (header_at), which `segment` keeps mapped; only the count
    // is read from it, atomically, whatever a peer writes there meanwhile.
    Ok(reader_count(unsafe { std::slice::from_raw_parts(p, n) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(capacity: u64, max: u64, readers: u32) -> (ChunkRing, ObjectStore) {
        (
            ChunkRing::create(capacity, None).unwrap(),
            ObjectStore::new(max, readers).unwrap(),
        )
    }

    fn read_all(seg: &StoreSegment, a: u64, i: u32, count: bool) -> Result<Vec<Vec<u8>>> {
        read_object(seg, a, i, count, |v| {
            (0..v.len()).map(|k| v.part(k).to_vec()).collect()
        })
    }

    #[test]
    fn put_get_and_errors() {
        let (mut ring, mut s) = store(4096, 1024, 1);
        let (addr, id) = s.put(&mut ring, "a", &[b"meta", b"data"], 2).unwrap();
        let reader = ChunkRing::open(ring.segment().name(), Some(4096)).unwrap();
        let got = read_object(reader.segment(), addr, id, true, |v| v.span().to_vec()).unwrap();
        assert_eq!(got, b"metadata");
        assert_eq!(object_reader_count(reader.segment(), addr, id).unwrap(), 1);
        assert!(matches!(
            s.put(&mut ring, "a", &[b"x"], 1),
            Err(Error::KeyExists(_))
        ));
        let e = s.put(&mut ring, "big", &[&[0u8; 1021]], 1).unwrap_err();
        assert!(e.to_string().contains("exceeds max object size"), "{e}");
        // Free "a": it must not be readable, whatever id is tried.
        ring.free_while(u64::MAX, |i, _| i == id).unwrap();
        for (a, i) in [
            (addr, id),
            (addr, INVALID_ID),
            (addr, id + 1),
            (addr + 8, id),
            (u64::MAX, id),
            (addr + 4096 * 1000 + 64, id),
        ] {
            let e = read_object(reader.segment(), a, i, false, |_| ()).unwrap_err();
            assert!(
                e.to_string().contains("has been modified or is invalid"),
                "{e}"
            );
        }
    }

    #[test]
    fn parts_from_align_from_are_64_byte_aligned_and_counts_4_byte_aligned() {
        let (mut ring, mut s) = store(1 << 16, 1 << 15, 1);
        let seg = ring.segment().clone();
        // Odd raw allocations move the next chunk to every residue mod 64.
        for skew in 0..70u64 {
            let key = format!("k{skew}");
            let parts: [&[u8]; 3] = [b"tree", &[1u8; 100], &[2u8; 3]];
            let (a, i) = s.put(&mut ring, &key, &parts, 1).unwrap();
            let got = read_object(&seg, a, i, true, |v| {
                let base = seg.ring_ptr() as usize;
                for k in 1..3 {
                    assert_eq!((v.part(k).as_ptr() as usize - base) % 64, 0);
                }
                (0..v.len()).map(|k| v.part(k).to_vec()).collect::<Vec<_>>()
            })
            .unwrap();
            assert_eq!(got, parts.map(|p| p.to_vec()));
            assert_eq!(object_reader_count(&seg, a, i).unwrap(), 1);
            ring.allocate(1 + skew % 7).unwrap();
            s.free_unused(&mut ring).unwrap();
        }
    }

    #[test]
    fn signatures_bind_key_address_and_id() {
        let (mut ring, mut s) = store(4096, 1024, 1);
        let (a, i) = s.put(&mut ring, "k", &[b"v"], 1).unwrap();
        let seg = ring.segment().clone();
        let sig = s.signature(&seg, "k").unwrap();
        let reader = ChunkRing::open(seg.name(), None).unwrap();
        reader.segment().verify("k", a, i, &sig).unwrap();
        assert_eq!(reader.segment().secret(), seg.secret());
        for (k, a2, i2) in [("k2", a, i), ("k", a + 1, i), ("k", a, i + 1)] {
            assert!(matches!(
                reader.segment().verify(k, a2, i2, &sig),
                Err(Error::BadSignature { missing: false })
            ));
        }
        let mut flipped = sig;
        flipped[31] ^= 1;
        assert!(reader.segment().verify("k", a, i, &flipped).is_err());
        assert!(reader.segment().verify("k", a, i, &sig[..31]).is_err());
        s.verify_current(&seg, "k", a, i, &sig).unwrap();
        assert!(s.verify_current(&seg, "k", a + 1, i, &sig).is_err());
        // A second store has another secret.
        let (other, _) = store(4096, 1024, 1);
        assert_ne!(other.segment().secret(), seg.secret());
    }

    #[test]
    fn eviction_waits_for_every_handout_and_touch() {
        let (mut ring, mut s) = store(512, 200, 2);
        let (a, i) = s.put(&mut ring, "k", &[&[1u8; 150]], 1).unwrap();
        s.get_cached("k").unwrap();
        let seg = ring.segment().clone();
        for _ in 0..3 {
            read_all(&seg, a, i, true).unwrap();
        }
        // 3 reads of 2 readers x 2 handouts: still in use.
        assert_eq!(s.free_unused(&mut ring).unwrap().count, 0);
        s.put(&mut ring, "k2", &[&[2u8; 150]], 1).unwrap();
        assert!(matches!(
            s.put(&mut ring, "k3", &[&[3u8; 150]], 1),
            Err(Error::Full(_))
        ));
        read_all(&seg, a, i, true).unwrap();
        s.touch("k");
        assert_eq!(s.free_unused(&mut ring).unwrap().count, 0);
        s.release_touches();
        // Now fully read: the full ring frees it and k3 fits.
        s.put(&mut ring, "k3", &[&[3u8; 150]], 1).unwrap();
        assert!(s.entry("k").is_none());
        assert!(read_object(&seg, a, i, false, |_| ()).is_err());
    }

    #[test]
    fn readers_cannot_write() {
        let (ring, _) = store(1024, 100, 1);
        let mut reader = ChunkRing::open(ring.segment().name(), None).unwrap();
        assert!(matches!(reader.allocate(10), Err(Error::WrongRole(_))));
        assert!(matches!(reader.clear(), Err(Error::WrongRole(_))));
        assert!(ChunkRing::open(ring.segment().name(), Some(999)).is_err());
    }

    #[test]
    fn cleared_objects_stay_readable_until_overwritten() {
        let (mut ring, mut s) = store(1024, 300, 1);
        let seg = ring.segment().clone();
        let (a0, i0) = s.put(&mut ring, "k0", &[&[7u8; 100]], 1).unwrap();
        let (a1, i1) = s.put(&mut ring, "k1", &[&[8u8; 100]], 1).unwrap();
        s.clear(&mut ring).unwrap();
        assert_eq!(read_all(&seg, a0, i0, false).unwrap(), vec![vec![7u8; 100]]);
        assert_eq!(read_all(&seg, a1, i1, false).unwrap(), vec![vec![8u8; 100]]);
        // A small object overwrites the start of k0 only.
        let (a2, i2) = s.put(&mut ring, "k2", &[b"x"], 1).unwrap();
        assert_eq!((a2, i2), (0, 2));
        assert!(read_object(&seg, a0, i0, false, |_| ()).is_err());
        assert_eq!(read_all(&seg, a1, i1, false).unwrap(), vec![vec![8u8; 100]]);
        // Enough to cover k1: it goes too, and the cleared range is dropped.
        s.put(&mut ring, "k3", &[&[9u8; 250]], 1).unwrap();
        assert!(read_object(&seg, a1, i1, false, |_| ()).is_err());
        assert_eq!(
            seg.snapshot().unwrap().cleared_start,
            seg.snapshot().unwrap().cleared_end
        );
        // A second clear forgets what the first one kept.
        s.clear(&mut ring).unwrap();
        assert!(read_object(&seg, a1, i1, false, |_| ()).is_err());
        assert_eq!(read_all(&seg, a2, i2, false).unwrap(), vec![b"x".to_vec()]);
    }

    #[test]
    fn a_stale_header_inside_new_data_is_refused() {
        // An old handle whose header position now lies inside a new object's bytes, which
        // hold exactly the old header: the published id range refuses it.
        let (mut ring, mut s) = store(256, 250, 1);
        let seg = ring.segment().clone();
        let (a, i) = s.put(&mut ring, "old", &[b"o"], 1).unwrap();
        read_all(&seg, a, i, true).unwrap();
        s.free_unused(&mut ring).unwrap();
        let mut forged = vec![0u8; 200];
        for k in [0usize, 13, 40, 81, 150] {
            forged[k..k + 4].copy_from_slice(&i.to_le_bytes());
            forged[k + 4..k + 8].copy_from_slice(&40u32.to_le_bytes());
        }
        s.put(&mut ring, "new", &[&forged], 1).unwrap();
        for off in 0..200 {
            assert!(read_object(&seg, off, i, false, |_| ()).is_err());
        }
    }

    #[test]
    fn a_frame_changed_during_a_read_is_an_error_not_a_panic() {
        // A reader is using object "a" when the writer clears the store and puts a larger
        // object in the same place: the frame the reader checked now describes parts
        // beyond the old chunk. Reading the parts again must not panic (it did: a slice
        // index out of range), and the read is reported as modified.
        let (mut ring, mut s) = store(4096, 2048, 1);
        let seg = ring.segment().clone();
        let (a, i) = s.put(&mut ring, "a", &[b"m", b"tiny"], 1).unwrap();
        let got = read_object(&seg, a, i, true, |v| {
            s.clear(&mut ring).unwrap();
            s.put(&mut ring, "b", &[&[1u8; 300], &[2u8; 900]], 1)
                .unwrap();
            (0..v.len()).map(|k| v.part(k).len()).sum::<usize>() + v.span().len()
        });
        assert!(matches!(got, Err(Error::StaleObject { .. })), "{got:?}");
        // A frame scribbled over by another process: parts come out clamped to nothing.
        let (a, i) = s.put(&mut ring, "c", &[b"meta", b"data"], 1).unwrap();
        let data_at = (a % 4096 + HEADER_BYTES) as usize;
        let count_at = (4 - data_at % 4) % 4;
        let entry0 = data_at + count_at + COUNT_BYTES + 4;
        let lens = read_object(&seg, a, i, false, |v| {
            // SAFETY: inside the ring (the frame's first entry); a test stands in for a
            // peer process writing the segment.
            unsafe {
                std::ptr::copy_nonoverlapping([0xffu8; 8].as_ptr(), seg.ring_ptr().add(entry0), 8)
            };
            (v.part(0).len(), v.span().len())
        })
        .unwrap();
        assert_eq!(lens, (0, 0));
    }

    #[test]
    fn layout_pads_inside_the_object() {
        let mut at = Vec::new();
        let end = object_layout(9, [5u64, 70, 1].into_iter(), 3, 1, |i, off| {
            at.push((i, off))
        });
        // data at ring offset 9: count at +3 (offset 12), frame n + 3 entries = 28 bytes,
        // part 0 at +35, part 1 at ring offset 64 (+55), part 2 at 192 (+183).
        assert_eq!(at, vec![(0, 35), (1, 55), (2, 183)]);
        assert_eq!(end, 184);
    }
}
