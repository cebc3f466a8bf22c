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
//! increments the count once per read (one atomic `fetch_add`, no lock; reads of a
//! cleared object are not counted). The count lies in the chunk, so a reader announces
//! its increment in the segment header (`counting`) before its last check of the
//! handle, and the writer, after freeing chunks, waits for announced increments before
//! it reuses them: an increment never lands in another object. So the object
//! may be evicted when `count >= n_readers * handouts`, oldest first, unless the writer
//! `touch`ed it and has not yet handed it out again or released its touches, or some
//! process *pins* it.
//!
//! # Zero-copy views and loans
//! [`read_object_viewed`] lets a reader map parts privately (copy-on-write) and keep
//! them: the chunk is pinned — a shared lock on a byte of the segment's file, see the
//! `pins` module — until the last such view is dropped (or its process dies). The
//! writer frees a chunk only after stamping its header and finding no pin, and a
//! `clear()` that finds a pinned chunk frees nothing at once (the chunks go oldest first
//! as usual). [`ObjectStore::loan`] gives the writer a pinned chunk with [`LOAN_ROOM`]
//! bytes before a page-aligned buffer; `put` of parts one of which is that buffer writes
//! the others into the room, so the buffer is never copied.
//!
//! # Signed handles
//! `sign(key, address, id)` is HMAC-SHA256, under the segment's secret, of
//! `sha256(key) ‖ address (u64 LE) ‖ id (u32 LE)`, as in vLLM 0.33. Readers check it, in
//! constant time, before they read anything at the address. The secret is readable by
//! every process that can open the segment (mode 0600: the same user), and by nobody else.

use std::collections::{HashMap, HashSet};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::alloc::{Chunk, FifoAllocator, Freed, HEADER_BYTES, ID_MAX};
use crate::error::{Error, Result};
use crate::liveness::{Liveness, LockProbe};
use crate::pins::{Pin, Pins};
use crate::private_map::{PrivateFile, PrivateMap};
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
/// Where the count of zero-copy gets still holding a pin is (see `StoreSegment::pin_hint`).
const PIN_HINT_OFFSET: usize = 192;
/// Where the count of readers about to count a read is (see `StoreSegment::counting`).
const COUNTING_OFFSET: usize = 200;
/// How long the writer waits for readers in the middle of counting a read (they are
/// there for nanoseconds; only one that died there makes it wait this long).
const COUNTING_PATIENCE: Duration = Duration::from_millis(10);
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
const _: () = assert!(SECRET_OFFSET + SECRET_BYTES <= PIN_HINT_OFFSET);
const _: () = assert!(PIN_HINT_OFFSET + 8 <= COUNTING_OFFSET);
const _: () = assert!(COUNTING_OFFSET + 8 <= RING_OFFSET);

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
    /// This process's pins of chunks it has zero-copy views of (see [`ChunkPin`]).
    pins: Arc<Pins>,
    /// The writer's probe of every process's pins (`None` on readers).
    probe: Option<LockProbe>,
    /// A read-only descriptor to map object parts privately (opened at the first view).
    private: OnceLock<PrivateFile>,
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
            pins: Arc::new(Pins::new(name)),
            // Opened now, while the name surely is this segment's.
            probe: Some(LockProbe::open(name)),
            private: OnceLock::new(),
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
            pins: Arc::new(Pins::new(name)),
            probe: None,
            private: OnceLock::new(),
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

    /// How many zero-copy gets hold a pin (or are taking one) in any process: while it
    /// is 0 the writer need not probe for pins. A reader that dies keeps it above 0,
    /// which only makes the writer probe.
    fn pin_hint(&self) -> &AtomicU64 {
        // SAFETY: PIN_HINT_OFFSET + 8 <= RING_OFFSET (checked at compile time): inside the
        // mapping and 8-aligned (it is page-aligned). A peer that writes it can make the
        // writer probe needlessly, or (set to 0 under a live view) reuse memory a view
        // still shows: what any process that may write the segment can do anyway.
        unsafe { &*(self.segment.as_ptr().add(PIN_HINT_OFFSET) as *const AtomicU64) }
    }

    /// How many readers are between their last check of an object and the increment of
    /// its count (see `read_header`): the writer reuses freed memory only once none is.
    fn counting(&self) -> &AtomicU64 {
        // SAFETY: COUNTING_OFFSET + 8 <= RING_OFFSET (checked at compile time): inside the
        // mapping and 8-aligned. A peer that writes it can make the writer wait (up to
        // COUNTING_PATIENCE per batch of frees) or not wait: what any process that may
        // write the segment can do to the objects themselves anyway.
        unsafe { &*(self.segment.as_ptr().add(COUNTING_OFFSET) as *const AtomicU64) }
    }

    /// Writer, after publishing that chunks are freed: wait until no reader can still
    /// increment a count inside them (see `read_header`), so they can be reused.
    fn wait_for_counting_readers(&self) {
        // SeqCst fence and load: with the reader's SeqCst increment and fence, either we
        // see its increment (and wait for its decrement), or it sees the chunk freed.
        fence(Ordering::SeqCst);
        let mut started = None;
        for attempt in 0u32.. {
            // Acquire: pairs with the reader's Release decrement: its count increment
            // (into the old chunk) happens before we reuse the memory.
            if self.counting().load(Ordering::Acquire) == 0 {
                return;
            }
            if attempt < 64 {
                std::hint::spin_loop();
            } else if started.get_or_insert_with(Instant::now).elapsed() > COUNTING_PATIENCE {
                return; // a reader died there: its increment will never come
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Writer: whether some process may hold a zero-copy view of the chunk at ring offset
    /// `offset`. Call it after marking the chunk as no longer its object (its header
    /// stamped, or the clear published): see `pins` module for why a view cannot be
    /// missed then. A probe that cannot tell answers "pinned" (the memory is kept).
    fn is_pinned(&self, offset: u64) -> bool {
        // SeqCst fence and load: with the reader's SeqCst increment and fence in
        // `pin_chunk`, either this load sees the increment or the reader's check sees
        // our mark (store buffering is ruled out on both sides).
        fence(Ordering::SeqCst);
        if self.pin_hint().load(Ordering::SeqCst) == 0 {
            return false;
        }
        self.probe
            .as_ref()
            .is_none_or(|p| p.liveness(pin_byte(offset)) != Liveness::Dead)
    }

    /// The read-only descriptor that object parts are mapped privately from.
    fn private_file(&self) -> Result<&PrivateFile> {
        if let Some(f) = self.private.get() {
            return Ok(f);
        }
        let f = PrivateFile::open(self.name())?;
        Ok(self.private.get_or_init(|| f))
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

/// The byte of the segment's file whose read locks pin the chunk at ring offset
/// `offset` (the ring starts a page into the file; byte 0 is the creator's role lock).
fn pin_byte(offset: u64) -> u64 {
    RING_OFFSET as u64 + offset
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
            if !is_free(c.id, unsafe { std::slice::from_raw_parts(p, n) }) {
                return false;
            }
            // Stamp the header (published with the new id_start below), then look for
            // zero-copy views: a reader that pins it from now on sees the stamp.
            segment.store_u32(h.offset, INVALID_ID);
            if segment.is_pinned(h.offset) {
                // Some process still has views: keep the chunk (and all after it).
                segment.store_u32(h.offset, c.id);
                return false;
            }
            true
        });
        if freed.count > 0 {
            segment.publish_ids(&w.alloc);
            segment.wait_for_counting_readers();
        }
        Ok(freed)
    }

    /// Forget every chunk (writer only). Ids keep counting and addresses restart at 0;
    /// handles issued before keep reading their data until the memory is reused. If a
    /// process holds a zero-copy view of some chunk, nothing moves instead: the chunks
    /// stay, to be freed oldest first like unused objects, each once no view holds it.
    pub fn clear(&mut self) -> Result<()> {
        let segment = &*self.segment;
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| writer_only("clear the buffer"))?;
        let capacity = segment.capacity();
        let (cleared_start, cleared_end) = (w.alloc.id_start(), w.alloc.id_end());
        // The writer alone publishes: its snapshot is what it last published.
        let before = segment.snapshot().unwrap_or_default();
        // Publish first that every live chunk is cleared, then look for zero-copy views:
        // a reader that pins one from now on sees it cleared and copies instead.
        segment.publish(|p| {
            // Relaxed: inside the seqlock (see `publish`).
            p.id_start.store(cleared_end, Ordering::Relaxed);
            p.cleared_start.store(cleared_start, Ordering::Relaxed);
            p.cleared_end.store(cleared_end, Ordering::Relaxed);
            p.overwritten.store(0, Ordering::Relaxed);
        });
        if w.alloc
            .live()
            .any(|c| segment.is_pinned(c.offset(capacity)))
        {
            // Some process has views of a chunk: keep every chunk where it is (the store
            // forgets their keys; they are freed oldest first once no view holds them)
            // and put the published state back.
            segment.publish(|p| {
                // Relaxed: inside the seqlock (see `publish`).
                p.cleared_start
                    .store(before.cleared_start, Ordering::Relaxed);
                p.cleared_end.store(before.cleared_end, Ordering::Relaxed);
                p.overwritten.store(before.overwritten, Ordering::Relaxed);
            });
            segment.publish_ids(&w.alloc);
            return Ok(());
        }
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

/// Bytes a store loan keeps before its buffer for the rest of the object `put` with it
/// (the count, the frame and the other parts: the pickle or msgpack stream and small
/// buffers); an object whose other parts need more is copied instead.
pub const LOAN_ROOM: u64 = 64 * 1024;
/// Loaned buffers start at multiples of this (ring offset): readers map them page by page.
const LOAN_ALIGN: u64 = 4096;

/// Where a loaned buffer is (the writer's bookkeeping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LoanSpot {
    address: u64,
    /// The chunk's header.
    header: ChunkHeader,
    /// The buffer's offset from the start of the chunk's data.
    buffer_at: u64,
    len: u64,
}

/// Memory loaned by the store's writer: `len` bytes of a chunk in the ring, to fill in
/// place and `put` without a copy. The chunk stays (pinned) while the loan lives, also
/// once put: drop it after the put to let the object be evicted in its turn.
#[derive(Debug)]
pub struct StoreLoan {
    ptr: *mut u8,
    len: usize,
    _pin: Arc<ChunkPin>,
}

// SAFETY: the loan is the only handle to its bytes in this process (the writer's
// bookkeeping keeps only their place), and the pin keeps the chunk from reuse; moving or
// sharing it between threads is like a Vec's.
unsafe impl Send for StoreLoan {}
// SAFETY: as for Send: `&StoreLoan` gives the pointer out, not access.
unsafe impl Sync for StoreLoan {}

impl std::ops::Deref for StoreLoan {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes of the loan's chunk, mapped and unreused while the pin
        // lives. Readers only get the chunk's handle once it is put; from then on they
        // read what the writer wrote, and a writer that keeps writing is racing only with
        // its own readers' view of the data (byte values, never memory safety).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for StoreLoan {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only slice made from it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl StoreLoan {
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
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
    /// Loaned buffers not yet put, by chunk id.
    loans: HashMap<u32, LoanSpot>,
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
            loans: HashMap::new(),
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
        if let Some(placed) = self.put_in_loan(ring, key, parts, align_from) {
            return Ok(placed);
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
        self.register(key, chunk.address, chunk.id);
        Ok((chunk.address, chunk.id))
    }

    fn register(&mut self, key: &str, address: u64, id: u32) {
        let key: Arc<str> = key.into();
        let entry = Entry {
            address,
            id,
            handouts: 1,
        };
        self.keys.insert(key.clone(), entry);
        self.ids.insert(id, key);
    }

    /// Loan `nbytes` of a new chunk to fill in place (writer only): `put` of an object
    /// one of whose buffers (from `align_from` on) is exactly this memory writes the rest
    /// of the object around it, with no copy. `Error::Full` if there is no room even
    /// after freeing what every reader has finished with.
    pub fn loan(&mut self, ring: &mut ChunkRing, nbytes: u64) -> Result<StoreLoan> {
        if !ring.is_writer() {
            return Err(Error::WrongRole("Only the writer can loan memory.".into()));
        }
        if nbytes == 0 {
            return Err(Error::InvalidArgument("Size must be greater than 0".into()));
        }
        let size = COUNT_BYTES as u64 + nbytes;
        if size > self.max_object_size {
            return Err(Error::TooLarge {
                size,
                max: self.max_object_size,
            });
        }
        let buffer_at = |chunk_offset: u64| {
            let data = chunk_offset + HEADER_BYTES;
            (data + LOAN_ROOM).next_multiple_of(LOAN_ALIGN) - data
        };
        let size_at = |chunk_offset: u64| buffer_at(chunk_offset) + nbytes;
        let chunk = match ring.allocate_with(size_at) {
            Err(Error::Full(_)) => {
                self.free_unused(ring)?;
                ring.allocate_with(size_at)?
            }
            other => other?,
        };
        let segment = ring.segment();
        let header = ChunkHeader {
            offset: chunk.offset(segment.capacity()),
            id: chunk.id,
            size: chunk.size,
        };
        let data_offset = header.offset + HEADER_BYTES;
        let count_at = (4 - data_offset % 4) % 4;
        // Relaxed: nobody has this chunk's handle yet; the channel that carries it orders
        // these stores. An empty object (no parts) until it is put.
        segment
            .count(data_offset + count_at)
            .store(0, Ordering::Relaxed);
        segment.store_u32(data_offset + count_at + COUNT_BYTES as u64, 0);
        // If pinning fails, the chunk (an empty object nobody knows) goes in its turn.
        let pin = pin_own(segment, header.offset)?;
        let spot = LoanSpot {
            address: chunk.address,
            header,
            buffer_at: buffer_at(header.offset),
            len: nbytes,
        };
        self.loans.insert(chunk.id, spot);
        let (p, _) = segment.data_ptr(&header);
        Ok(StoreLoan {
            // SAFETY: buffer_at + nbytes is the chunk's data size (size_at above).
            ptr: unsafe { p.add(spot.buffer_at as usize) },
            len: nbytes as usize,
            _pin: pin,
        })
    }

    /// Put `parts` around a loaned buffer that is exactly one of them (from `align_from`
    /// on), if the others fit in the room before it; `None` to copy instead.
    fn put_in_loan(
        &mut self,
        ring: &ChunkRing,
        key: &str,
        parts: &[&[u8]],
        align_from: usize,
    ) -> Option<(u64, u32)> {
        if self.loans.is_empty() {
            return None;
        }
        let segment = ring.segment();
        let base = segment.ring_ptr() as usize;
        let mut found = None;
        for (i, part) in parts.iter().enumerate().skip(align_from) {
            let at = (part.as_ptr() as usize).wrapping_sub(base) as u64;
            let hit = self.loans.iter().find(|(_, s)| {
                s.header.offset + HEADER_BYTES + s.buffer_at == at && s.len == part.len() as u64
            });
            if let Some((&id, &spot)) = hit {
                if found.is_some() {
                    return None; // two loans in one object: copied into one chunk
                }
                found = Some((i, id, spot));
            }
        }
        let (k, id, spot) = found?;
        if ring.allocator()?.get(id).is_none() {
            self.loans.remove(&id);
            return None;
        }
        let data_offset = spot.header.offset + HEADER_BYTES;
        let count_at = (4 - data_offset % 4) % 4;
        let frame_at = count_at + COUNT_BYTES as u64;
        let mut at = frame_at + 4 + 8 * parts.len() as u64;
        let mut offsets = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            if i == k {
                offsets.push(spot.buffer_at);
                continue;
            }
            if i >= align_from {
                at = (data_offset + at).next_multiple_of(PART_ALIGN) - data_offset;
            }
            offsets.push(at);
            at += part.len() as u64;
        }
        if at > spot.buffer_at {
            return None; // the rest does not fit before the buffer: copy
        }
        let (p, len) = segment.data_ptr(&spot.header);
        let write = |at: u64, bytes: &[u8]| {
            debug_assert!(at as usize + bytes.len() <= spot.buffer_at as usize);
            // SAFETY: the chunk is this writer's (live, loaned, its handle not yet given
            // out), and every write here ends before the buffer (checked just above), which
            // lies inside the chunk's `len` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.add(at as usize), bytes.len())
            };
        };
        debug_assert!(spot.buffer_at + spot.len <= len as u64);
        write(frame_at, &(parts.len() as u32).to_le_bytes());
        for (i, part) in parts.iter().enumerate() {
            let entry_at = frame_at + 4 + 8 * i as u64;
            write(entry_at, &(offsets[i] as u32).to_le_bytes());
            write(entry_at + 4, &(part.len() as u32).to_le_bytes());
            if i != k {
                write(offsets[i], part);
            }
        }
        self.loans.remove(&id);
        self.register(key, spot.address, id);
        Some((spot.address, id))
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
            self.loans.remove(&id);
        }
        Ok(freed)
    }

    /// Forget every object and chunk.
    pub fn clear(&mut self, ring: &mut ChunkRing) -> Result<()> {
        ring.clear()?;
        self.keys.clear();
        self.ids.clear();
        self.touched.clear();
        // Loans whose chunks a view kept (see `ChunkRing::clear`) can still be put.
        if let Some(alloc) = ring.allocator() {
            self.loans.retain(|id, _| alloc.get(*id).is_some());
        }
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
    validity(segment, h) != Validity::Stale
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Validity {
    Stale,
    /// Live: the writer frees it only through `free_while` (which waits for counters).
    Live,
    /// Cleared, not yet overwritten: readable, but nothing counts its reads any more.
    Cleared,
}

fn validity(segment: &StoreSegment, h: &ChunkHeader) -> Validity {
    if segment.load_u32(h.offset) != h.id {
        return Validity::Stale;
    }
    match segment.snapshot() {
        Some(s) if id_in(h.id, s.id_start, s.id_end) => Validity::Live,
        Some(s) if s.names(h.id, h.offset) => Validity::Cleared,
        _ => Validity::Stale,
    }
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
    let h = object_header(segment, address, id)?;
    read_header(segment, h, address, id, count_read, f)
}

/// [`read_object`] from a header found valid for `(address, id)`.
fn read_header<R>(
    segment: &StoreSegment,
    h: ChunkHeader,
    address: u64,
    id: u32,
    count_read: bool,
    f: impl FnOnce(&ObjectView<'_>) -> R,
) -> Result<R> {
    let stale = || Error::StaleObject {
        address,
        id: id as u64,
    };
    let (p, n) = segment.data_ptr(&h);
    // SAFETY: the range is inside the ring (header_at). The writer does not overwrite a
    // live object until every reader has counted its read, which we do only after `f`;
    // a stale handle, or a peer writing the ring, may change these bytes under us: the
    // frame is bounds-checked before use and the handle checked again after `f`.
    let data = unsafe { std::slice::from_raw_parts(p, n) };
    let view = ObjectView::parse(data, h.offset + HEADER_BYTES).ok_or_else(stale)?;
    let out = f(&view);
    if !count_read {
        return if still_valid(segment, &h) {
            Ok(out)
        } else {
            Err(stale())
        };
    }
    // The count lies in the chunk: it must not be incremented once the chunk may be
    // reused (that would write into another object). So announce the increment first
    // (SeqCst, then a SeqCst fence: with the writer's fence and load in
    // `wait_for_counting_readers`, either the check below sees the chunk freed, or the
    // writer waits for our decrement before it reuses the memory).
    segment.counting().fetch_add(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    let validity = validity(segment, &h);
    if validity == Validity::Live {
        let count_at = h.offset + HEADER_BYTES + view.count_at as u64;
        // Release: pairs with the Acquire load in `reader_count`: our reads of the
        // payload happen before the writer's eviction decision.
        segment.count(count_at).fetch_add(1, Ordering::Release);
    }
    // Release: pairs with the writer's Acquire load: the increment above happens before
    // the writer reuses the chunk.
    segment.counting().fetch_sub(1, Ordering::Release);
    if validity == Validity::Stale {
        return Err(stale());
    }
    Ok(out)
}

/// Keeps an object's chunk from being freed or overwritten while zero-copy views of it
/// live in this process (a read lock on a byte of the segment's file, see
/// `pins` module); shared by the views of one `get`.
#[derive(Debug)]
pub struct ChunkPin {
    segment: Arc<StoreSegment>,
    _pin: Pin,
    made_in: u64,
}

impl Drop for ChunkPin {
    fn drop(&mut self) {
        // A forked child's copy counts nothing: the hint is its parent's to decrement.
        if !crate::fork::is_inherited(self.made_in) {
            // Relaxed: only tells the writer whether to probe; the lock (released right
            // after, with the field) is what the writer relies on.
            self.segment.pin_hint().fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// A private, copy-on-write mapping of one part of a stored object: zero-copy to read;
/// a write copies the touched pages, never reaching the writer or another reader. The
/// object's chunk is not reused while it lives.
#[derive(Debug)]
pub struct PartView {
    map: PrivateMap,
    _pin: Arc<ChunkPin>,
}

impl PartView {
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

impl std::ops::Deref for PartView {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

/// What [`read_object_viewed`] offers to map parts of the object it reads. The chunk is
/// pinned at the first [`ObjectViews::map`] (objects read without views cost no pin).
pub struct ObjectViews<'a> {
    segment: &'a Arc<StoreSegment>,
    header: ChunkHeader,
    pin: std::cell::OnceCell<Option<Arc<ChunkPin>>>,
}

impl ObjectViews<'_> {
    /// A private mapping of part `i` of `object` (the object being read); `None` when
    /// the object cannot be viewed (a cleared object, or pinning failed): copy instead.
    pub fn map(&self, object: &ObjectView<'_>, i: usize) -> Result<Option<PartView>> {
        let pin = self
            .pin
            .get_or_init(|| pin_chunk(self.segment, &self.header));
        let Some(pin) = pin else { return Ok(None) };
        // The part as `part` clamps it (the frame is shared memory a peer may change).
        let part = object.part(i);
        let (off, len) = (
            part.as_ptr() as usize - object.data.as_ptr() as usize,
            part.len(),
        );
        let at = RING_OFFSET as u64 + self.header.offset + HEADER_BYTES + off as u64;
        Ok(Some(PartView {
            map: self.segment.private_file()?.map(at, len)?,
            _pin: pin.clone(),
        }))
    }
}

/// The writer pins a chunk it loans out (no check needed: the writer itself is what
/// would free it, and its frees probe for pins).
fn pin_own(segment: &Arc<StoreSegment>, offset: u64) -> Result<Arc<ChunkPin>> {
    // SeqCst: as in `pin_chunk` (here the writer's own later probes would see it anyway).
    segment.pin_hint().fetch_add(1, Ordering::SeqCst);
    let made_in = crate::fork::generation();
    match segment.pins.pin(pin_byte(offset)) {
        Ok(pin) => Ok(Arc::new(ChunkPin {
            segment: segment.clone(),
            _pin: pin,
            made_in,
        })),
        Err(e) => {
            // Relaxed: see `ChunkPin::drop`.
            segment.pin_hint().fetch_sub(1, Ordering::Relaxed);
            Err(e)
        }
    }
}

/// Pin the chunk of `h` if it holds a live object (not a cleared one, which the writer
/// reuses without looking for pins); `None` if it does not, or cannot be pinned.
fn pin_chunk(segment: &Arc<StoreSegment>, h: &ChunkHeader) -> Option<Arc<ChunkPin>> {
    // SeqCst: pairs with the writer's SeqCst fence and load in `is_pinned`.
    segment.pin_hint().fetch_add(1, Ordering::SeqCst);
    let made_in = crate::fork::generation();
    let Ok(pin) = segment.pins.pin(pin_byte(h.offset)) else {
        // Relaxed: see `ChunkPin::drop`.
        segment.pin_hint().fetch_sub(1, Ordering::Relaxed);
        return None;
    };
    let pin = ChunkPin {
        segment: segment.clone(),
        _pin: pin,
        made_in,
    };
    // SeqCst fence: the checks below come after the increment (and the lock) in the
    // order the writer's `is_pinned` is part of. If they pass, the writer will see the
    // pin before it frees or clears the chunk; if the writer marked it first, they fail.
    fence(Ordering::SeqCst);
    let live = segment.load_u32(h.offset) == h.id
        && segment
            .snapshot()
            .is_some_and(|s| id_in(h.id, s.id_start, s.id_end));
    live.then(|| Arc::new(pin))
}

/// [`read_object`], and `f` may also map parts privately (through `views`) to keep
/// them beyond the call: the chunk then stays until the last of them is dropped.
pub fn read_object_viewed<R>(
    segment: &Arc<StoreSegment>,
    address: u64,
    id: u32,
    count_read: bool,
    f: impl FnOnce(&ObjectView<'_>, &ObjectViews<'_>) -> R,
) -> Result<R> {
    let h = object_header(segment, address, id)?;
    let views = ObjectViews {
        segment,
        header: h,
        pin: std::cell::OnceCell::new(),
    };
    read_header(segment, h, address, id, count_read, |object| {
        f(object, &views)
    })
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
    fn a_private_view_keeps_its_object_from_eviction_and_clear() {
        let (mut ring, mut s) = store(3 * 8192, 9000, 1);
        let (a, i) = s.put(&mut ring, "a", &[b"head", &[7u8; 8000]], 1).unwrap();
        s.put(&mut ring, "b", &[b"head", &[8u8; 8000]], 1).unwrap();
        let seg = ring.segment().clone();
        let mut view = read_object_viewed(&seg, a, i, true, |object, views| views.map(object, 1))
            .unwrap()
            .unwrap()
            .expect("a live object can be viewed");
        assert_eq!(&view[..], &[7u8; 8000][..]);
        // Read (its count says free) but viewed: neither eviction nor clear reuses it.
        assert_eq!(s.free_unused(&mut ring).unwrap().count, 0);
        s.clear(&mut ring).unwrap();
        assert!(s.is_empty());
        s.put(&mut ring, "c", &[b"head", &[9u8; 8000]], 1).unwrap();
        assert!(matches!(
            s.put(&mut ring, "d", &[b"head", &[1u8; 8000]], 1),
            Err(Error::Full(_))
        ));
        assert_eq!(&view[..], &[7u8; 8000][..]);
        // A write into the view is private to it.
        view.map[0] = 42;
        assert_eq!(read_all(&seg, a, i, false).unwrap()[1][0], 7);
        drop(view);
        s.put(&mut ring, "d", &[b"head", &[1u8; 8000]], 1).unwrap();
        assert!(read_object(&seg, a, i, false, |_| ()).is_err());
    }

    #[test]
    fn a_loan_is_put_in_place_and_stays_until_dropped() {
        let (mut ring, mut s) = store(3 * 80_000, 75_000, 1);
        let mut loan = s.loan(&mut ring, 8000).unwrap();
        loan.fill(5);
        let (a, i) = s.put(&mut ring, "a", &[b"stream", &loan], 1).unwrap();
        let seg = ring.segment().clone();
        let parts = read_all(&seg, a, i, true).unwrap();
        assert_eq!(parts, vec![b"stream".to_vec(), vec![5u8; 8000]]);
        // The part is the loaned memory itself.
        read_object(&seg, a, i, false, |v| {
            assert_eq!(v.part(1).as_ptr(), loan.as_ptr())
        })
        .unwrap();
        // Read by every reader, but the loan still pins it.
        assert_eq!(s.free_unused(&mut ring).unwrap().count, 0);
        drop(loan);
        assert_eq!(s.free_unused(&mut ring).unwrap().count, 1);
        // A loan put twice, or with too much around it, is copied.
        let loan = s.loan(&mut ring, 100).unwrap();
        let (b, j) = s.put(&mut ring, "b", &[b"x", &loan], 1).unwrap();
        let (c, k) = s.put(&mut ring, "c", &[b"x", &loan], 1).unwrap();
        assert_ne!((b, j), (c, k));
        let big = vec![1u8; (LOAN_ROOM + LOAN_ALIGN) as usize];
        let loan2 = s.loan(&mut ring, 100).unwrap();
        let (d, l) = s
            .put(&mut ring, "d", &[&big[..100], &big, &loan2], 1)
            .unwrap();
        read_object(&seg, d, l, false, |v| {
            assert_ne!(v.part(2).as_ptr(), loan2.as_ptr())
        })
        .unwrap();
        drop((loan, loan2));
    }

    #[test]
    fn a_cleared_object_is_read_but_not_viewed() {
        let (mut ring, mut s) = store(3 * 8192, 9000, 1);
        let (a, i) = s.put(&mut ring, "a", &[b"head", &[7u8; 8000]], 1).unwrap();
        s.clear(&mut ring).unwrap();
        let seg = ring.segment().clone();
        let viewed = read_object_viewed(&seg, a, i, true, |object, views| {
            (
                views.map(object, 1).unwrap().is_some(),
                object.part(1).to_vec(),
            )
        })
        .unwrap();
        assert_eq!(viewed, (false, vec![7u8; 8000]));
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
