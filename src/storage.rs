//! The object store: a FIFO ring of variable-size chunks in one segment (one writer
//! allocates, any process reads by `(address, id)`), and on top of it a key → object
//! index whose objects carry an atomic reader count.
//!
//! # Segment layout
//! ```text
//! 0      StoreHeader (magic stored last with Release, layout version, capacity, pid)
//! 4096   the ring: `capacity` bytes of chunks, each at a 64-byte-aligned offset:
//!          +0 id: u32    (stored with Release after the size: a reader that sees the
//!          +4 size: u32   id it expects sees the size written with it)
//!          +8 data: `size - 8` bytes; for an object: [reader count: u32][payload]
//! ```
//! Every `(address, id)` a reader is given is checked before any byte is read: the
//! offset must hold a header whose id matches and whose size stays inside the ring; the
//! id is read again after the payload is used, so an object evicted meanwhile is reported
//! as modified instead of returning torn data.
//!
//! # Eviction
//! `put` hands an object out once; each `get_cached` hands it out again. Every reader
//! increments the count once per read (one atomic `fetch_add`, no lock), so the object
//! may be evicted when `count >= n_readers * handouts`, oldest first.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::alloc::{Chunk, FifoAllocator, Freed, HEADER_BYTES, ID_MAX};
use crate::error::{Error, Result};
use crate::process::ProcessId;
use crate::segment::{unique_name, Segment};

/// "SHMQSTO1" little-endian: marks a finished object-store segment.
pub const STORE_MAGIC: u64 = u64::from_le_bytes(*b"SHMQSTO1");
pub const STORE_LAYOUT_VERSION: u32 = 1;
/// The ring starts one page into the segment.
const RING_OFFSET: usize = 4096;
/// Stored in the header of a freed chunk: never a valid id (ids are below 2**31).
const INVALID_ID: u32 = u32::MAX;
/// Bytes of an object's reader count, at the start of its chunk data.
pub const COUNT_BYTES: usize = 4;

#[repr(C)]
struct StoreHeader {
    magic: AtomicU64,
    version: u32,
    creator_pid: u32,
    capacity: u64,
    creator_start_time: u64,
}

/// Occupancy, kept by the writer for `inspect` (in its own cache line at offset 64).
#[repr(C, align(64))]
struct StoreStats {
    live_chunks: AtomicU64,
    live_bytes: AtomicU64,
    id_start: AtomicU32,
    id_end: AtomicU32,
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
}

// SAFETY: `ring` points into `segment`'s mapping, alive as long as `self`. Shared state
// in it is reached through atomics (headers, reader counts) or, for payload bytes, only
// by the single writer before it publishes a chunk and by readers after; see the module
// docs for how a reader detects a chunk reused under it.
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

impl StoreSegment {
    fn create(name: &str, capacity: u64) -> Result<StoreSegment> {
        let total = usize::try_from(capacity)
            .ok()
            .and_then(|c| c.checked_add(RING_OFFSET))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("data_buffer_size {capacity} is too large"))
            })?;
        let segment = Segment::create(name, total)?;
        let base = NonNull::new(segment.as_ptr()).expect("mmap never returns null");
        // SAFETY: the segment is new, page-aligned and larger than the header; nobody else
        // uses it before the magic is stored below.
        unsafe {
            let h = base.as_ptr() as *mut StoreHeader;
            (*h).version = STORE_LAYOUT_VERSION;
            let me = ProcessId::current();
            (*h).creator_pid = me.pid;
            (*h).creator_start_time = me.start_time;
            (*h).capacity = capacity;
        }
        // SAFETY: RING_OFFSET < total.
        let ring = unsafe { NonNull::new_unchecked(base.as_ptr().add(RING_OFFSET)) };
        let s = StoreSegment {
            segment,
            ring,
            capacity,
        };
        // Release: pairs with the Acquire load in `open`: the header fields are visible
        // to an opener that sees the magic.
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
        // SAFETY: the mapping is page-aligned and at least RING_OFFSET bytes long.
        let header = unsafe { &*(base.as_ptr() as *const StoreHeader) };
        // Acquire: pairs with the Release store in `create`.
        if header.magic.load(Ordering::Acquire) != STORE_MAGIC {
            return Err(bad(
                "it is not a shmq object store (or its creator has not finished setting it up)"
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
        // SAFETY: RING_OFFSET < segment.len().
        let ring = unsafe { NonNull::new_unchecked(base.as_ptr().add(RING_OFFSET)) };
        Ok(StoreSegment {
            segment,
            ring,
            capacity,
        })
    }

    fn header(&self) -> &StoreHeader {
        // SAFETY: see `create`/`open`: in bounds and aligned.
        unsafe { &*(self.segment.as_ptr() as *const StoreHeader) }
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

    fn stats(&self) -> &StoreStats {
        // SAFETY: offset 64 < RING_OFFSET, inside the mapping, 64-aligned; only accessed
        // atomically.
        unsafe { &*(self.segment.as_ptr().add(64) as *const StoreStats) }
    }

    /// Occupancy as the writer last published it (for inspection).
    pub fn occupancy(&self) -> StoreOccupancy {
        let s = self.stats();
        // Relaxed: statistics; the four values may be from slightly different moments.
        StoreOccupancy {
            live_chunks: s.live_chunks.load(Ordering::Relaxed),
            live_bytes: s.live_bytes.load(Ordering::Relaxed),
            id_start: s.id_start.load(Ordering::Relaxed),
            id_end: s.id_end.load(Ordering::Relaxed),
        }
    }

    /// Publish the writer's occupancy (after each allocation, free or clear).
    fn publish_occupancy(&self, a: &FifoAllocator) {
        let s = self.stats();
        // Relaxed: statistics for inspection; nothing is ordered by them.
        s.live_chunks
            .store(a.live().len() as u64, Ordering::Relaxed);
        s.live_bytes.store(a.live_bytes(), Ordering::Relaxed);
        s.id_start.store(a.id_start(), Ordering::Relaxed);
        s.id_end.store(a.id_end(), Ordering::Relaxed);
    }
    /// Remove the segment's name now (see `Segment::unlink`).
    pub fn unlink(&self) -> Result<()> {
        self.segment.unlink()
    }

    /// The whole ring, for `shared_memory.buf`.
    pub fn ring_ptr(&self) -> *mut u8 {
        self.ring.as_ptr()
    }

    fn word(&self, offset: u64) -> &AtomicU32 {
        debug_assert!(offset + 4 <= self.capacity && offset % 4 == 0);
        // SAFETY: callers pass a 4-aligned offset with 4 bytes inside the ring; the ring
        // start is page-aligned. Header words and reader counts are only accessed atomically.
        unsafe { &*(self.ring.as_ptr().add(offset as usize) as *const AtomicU32) }
    }

    /// Write the header of a freshly allocated chunk (writer only).
    fn write_header(&self, chunk: &Chunk) {
        let offset = chunk.address % self.capacity;
        // Relaxed: published by the Release store of the id just below.
        self.word(offset + 4).store(chunk.size, Ordering::Relaxed);
        // Release: pairs with the Acquire load in `header_at`.
        self.word(offset).store(chunk.id, Ordering::Release);
    }

    /// Mark a freed chunk's header so that handles to it fail from now on (writer only).
    fn invalidate(&self, chunk: &Chunk) {
        // Relaxed store, then a Release fence: the new id is ordered before any later
        // write of the writer into this chunk, so a reader whose final id check (see
        // `id_at`) still sees the old id did not read bytes written after the free.
        self.word(chunk.address % self.capacity)
            .store(INVALID_ID, Ordering::Relaxed);
        fence(Ordering::Release);
    }

    /// The chunk header at `address`, checked to lie inside the ring.
    pub fn header_at(&self, address: u64) -> Result<ChunkHeader> {
        let offset = address % self.capacity;
        let invalid = Error::InvalidArgument(format!("no chunk can be at address {address}"));
        // Chunks start 64-aligned, so anything else cannot be one.
        if offset % 64 != 0 || offset + HEADER_BYTES > self.capacity {
            return Err(invalid);
        }
        // Acquire: pairs with the Release store in `write_header`.
        let id = self.word(offset).load(Ordering::Acquire);
        // Relaxed: ordered after the id load above.
        let size = self.word(offset + 4).load(Ordering::Relaxed);
        if (size as u64) < HEADER_BYTES || offset + size as u64 > self.capacity {
            return Err(invalid);
        }
        Ok(ChunkHeader { offset, id, size })
    }

    /// The id now stored in the header at `offset` (to re-check after using a chunk).
    ///
    /// With `invalidate` this is a seqlock: the writer stamps INVALID_ID, fences, then
    /// may overwrite; the reader reads the payload, fences, then re-reads the id. The
    /// payload accesses are plain, not atomic, so this relies on the fences ordering them
    /// as the hardware does (the usual seqlock practice); it only matters for handles that
    /// are stale or forged: the protocol never frees an object a reader has not read.
    fn id_at(&self, offset: u64) -> u32 {
        // Acquire fence: the payload reads before it complete before this load, so if the
        // id is unchanged the writer had not started reusing the chunk during those reads.
        fence(Ordering::Acquire);
        // Relaxed: ordered by the fence.
        self.word(offset).load(Ordering::Relaxed)
    }

    /// Start and length of a chunk's data (after the 8-byte header).
    pub fn data_ptr(&self, h: &ChunkHeader) -> (*mut u8, usize) {
        // SAFETY: `h` came from `header_at`, which checked offset + size <= capacity.
        let p = unsafe { self.ring.as_ptr().add((h.offset + HEADER_BYTES) as usize) };
        (p, h.size as usize - HEADER_BYTES as usize)
    }
}

fn writer_only(what: &str) -> Error {
    Error::WrongRole(format!("Only the writer can {what}."))
}

/// The spec's `RingBuffer`: the segment plus, on the writer, the FIFO allocator.
#[derive(Debug)]
pub struct ChunkRing {
    segment: Arc<StoreSegment>,
    alloc: Option<FifoAllocator>,
}

impl ChunkRing {
    /// Create a ring of `capacity` bytes (this process is its writer).
    pub fn create(capacity: u64, name: Option<&str>) -> Result<ChunkRing> {
        let alloc = FifoAllocator::new(capacity).map_err(Error::InvalidArgument)?;
        let name = name.map_or_else(|| unique_name("store"), str::to_owned);
        Ok(ChunkRing {
            segment: Arc::new(StoreSegment::create(&name, capacity)?),
            alloc: Some(alloc),
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
            alloc: None,
        })
    }

    pub fn segment(&self) -> &Arc<StoreSegment> {
        &self.segment
    }
    pub fn is_writer(&self) -> bool {
        self.alloc.is_some()
    }
    /// The writer's allocator state.
    pub fn allocator(&self) -> Option<&FifoAllocator> {
        self.alloc.as_ref()
    }

    /// Allocate a chunk with `data_bytes` of data and write its header.
    pub fn allocate(&mut self, data_bytes: u64) -> Result<Chunk> {
        if data_bytes == 0 {
            return Err(Error::InvalidArgument("Size must be greater than 0".into()));
        }
        let alloc = self
            .alloc
            .as_mut()
            .ok_or_else(|| writer_only("allocate buffers"))?;
        let chunk = alloc.allocate(data_bytes)?;
        self.segment.write_header(&chunk);
        self.segment.publish_occupancy(alloc);
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
        let alloc = self
            .alloc
            .as_mut()
            .ok_or_else(|| writer_only("free buffers"))?;
        let freed = alloc.free_while(nbytes, |c| {
            let h = ChunkHeader {
                offset: c.address % segment.capacity(),
                id: c.id,
                size: c.size,
            };
            let (p, n) = segment.data_ptr(&h);
            // SAFETY: a live chunk of ours lies inside the ring (allocator invariant).
            let free = is_free(c.id, unsafe { std::slice::from_raw_parts(p, n) });
            if free {
                segment.invalidate(c);
            }
            free
        });
        segment.publish_occupancy(alloc);
        Ok(freed)
    }

    /// Forget every chunk (writer only); handles issued before fail from now on, and
    /// ids and addresses keep counting.
    pub fn clear(&mut self) -> Result<()> {
        let alloc = self
            .alloc
            .as_mut()
            .ok_or_else(|| writer_only("clear the buffer"))?;
        alloc.live().for_each(|c| self.segment.invalidate(c));
        alloc.clear();
        self.segment.publish_occupancy(alloc);
        Ok(())
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

    /// Store the payload `parts` (concatenated) under `key`; returns `(address, id)`.
    /// When the ring is full, first frees objects every reader has finished with.
    pub fn put(&mut self, ring: &mut ChunkRing, key: &str, parts: &[&[u8]]) -> Result<(u64, u32)> {
        if !ring.is_writer() {
            return Err(Error::WrongRole("Only the writer can put objects.".into()));
        }
        if self.keys.contains_key(key) {
            return Err(Error::KeyExists(key.to_owned()));
        }
        let size = COUNT_BYTES as u64 + parts.iter().map(|p| p.len() as u64).sum::<u64>();
        if size > self.max_object_size {
            return Err(Error::TooLarge {
                size,
                max: self.max_object_size,
            });
        }
        let chunk = match ring.allocate(size) {
            Err(Error::Full(_)) => {
                self.free_unused(ring)?;
                ring.allocate(size)?
            }
            other => other?,
        };
        let segment = ring.segment();
        let h = ChunkHeader {
            offset: chunk.address % segment.capacity(),
            id: chunk.id,
            size: chunk.size,
        };
        let (p, n) = segment.data_ptr(&h);
        debug_assert_eq!(n as u64, size);
        // Relaxed: the count starts at 0 before the handle is given to anyone; the
        // channel that carries the handle to readers orders it (as it does the payload).
        segment
            .word(h.offset + HEADER_BYTES)
            .store(0, Ordering::Relaxed);
        let mut at = COUNT_BYTES;
        for part in parts {
            // SAFETY: the chunk is ours (just allocated, not yet handed out) and the parts
            // add up to `n - COUNT_BYTES` bytes, so every copy stays inside it.
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), p.add(at), part.len()) };
            at += part.len();
        }
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

    /// Hand `key`'s object out once more (every reader will read it once more).
    pub fn get_cached(&mut self, key: &str) -> Option<(u64, u32)> {
        let e = self.keys.get_mut(key)?;
        e.handouts += 1;
        Some((e.address, e.id))
    }

    /// Free objects, oldest first, that every reader has finished with, up to about
    /// `2 * max_object_size` bytes. Returns the freed ids.
    pub fn free_unused(&mut self, ring: &mut ChunkRing) -> Result<Freed> {
        let limit = 2 * self.max_object_size;
        let n_readers = self.n_readers as u64;
        let (keys, ids) = (&mut self.keys, &mut self.ids);
        ring.free_while(limit, |id, data| {
            let handouts = ids
                .get(&id)
                .and_then(|k| keys.get(k))
                .map_or(0, |e| e.handouts);
            let free = reader_count(data) as u64 >= n_readers * handouts as u64;
            if free {
                if let Some(key) = ids.remove(&id) {
                    keys.remove(&key);
                }
            }
            free
        })
    }

    /// Forget every object and chunk.
    pub fn clear(&mut self, ring: &mut ChunkRing) -> Result<()> {
        ring.clear()?;
        self.keys.clear();
        self.ids.clear();
        Ok(())
    }
}

fn reader_count(data: &[u8]) -> u32 {
    if data.len() < COUNT_BYTES {
        // Not an object (a raw allocation through the ring's own API): nothing counts.
        return 0;
    }
    // SAFETY: at least COUNT_BYTES long (checked above); chunk data starts 8 bytes after
    // a 64-aligned offset, so it is 4-aligned. shmq accesses reader counts only
    // atomically (a Python view from `access_buf` could write them: that changes the
    // count, which only decides when the object may be evicted).
    let count = unsafe { &*(data.as_ptr() as *const AtomicU32) };
    // Acquire: pairs with the Release increment in `read_object`; the reader's use of
    // the payload happens before the writer frees (and later overwrites) it.
    count.load(Ordering::Acquire)
}

/// The header of the object at `address` if it is live with id `id`.
fn live_object_header(segment: &StoreSegment, address: u64, id: u32) -> Result<ChunkHeader> {
    let stale = || Error::StaleObject {
        address,
        id: id as u64,
    };
    // Ids are below 2**31; anything else (e.g. INVALID_ID of a freed chunk) names nothing.
    if id >= ID_MAX {
        return Err(stale());
    }
    // Only ids the writer has issued and not freed can name an object: this catches
    // a stale handle whose header position now lies inside another object's bytes.
    let o = segment.occupancy();
    if id.wrapping_sub(o.id_start) % ID_MAX >= o.id_end.wrapping_sub(o.id_start) % ID_MAX {
        return Err(stale());
    }
    let h = segment.header_at(address).map_err(|_| stale())?;
    if h.id != id || (h.size as usize) < HEADER_BYTES as usize + COUNT_BYTES {
        return Err(stale());
    }
    Ok(h)
}

/// Read the object at `(address, id)`: check the handle, call `f` on the payload, check
/// the id again, and (if `count_read`) count this as one read. Any process may call it.
pub fn read_object<R>(
    segment: &StoreSegment,
    address: u64,
    id: u32,
    count_read: bool,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<R> {
    let h = live_object_header(segment, address, id)?;
    let (p, n) = segment.data_ptr(&h);
    // SAFETY: the range is inside the ring (header_at). The writer does not overwrite a
    // chunk until every reader has counted its read, which we do only after `f`; a forged
    // or stale handle may see bytes changing under it, which the id re-check reports.
    let payload = unsafe { std::slice::from_raw_parts(p.add(COUNT_BYTES), n - COUNT_BYTES) };
    let out = f(payload);
    if segment.id_at(h.offset) != id {
        return Err(Error::StaleObject {
            address,
            id: id as u64,
        });
    }
    if count_read {
        // SAFETY: as in `reader_count`: 4-aligned, inside the chunk, atomic-only.
        let count = unsafe { &*(p as *const AtomicU32) };
        // Release: pairs with the Acquire load in `reader_count`.
        count.fetch_add(1, Ordering::Release);
    }
    Ok(out)
}

/// The reader count of the object at `(address, id)` (for inspection and tests).
pub fn object_reader_count(segment: &StoreSegment, address: u64, id: u32) -> Result<u32> {
    let h = live_object_header(segment, address, id)?;
    let (p, n) = segment.data_ptr(&h);
    // SAFETY: inside the ring (header_at).
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

    #[test]
    fn put_get_and_errors() {
        let (mut ring, mut s) = store(4096, 1024, 1);
        let (addr, id) = s.put(&mut ring, "a", &[b"meta", b"data"]).unwrap();
        let reader = ChunkRing::open(ring.segment().name(), Some(4096)).unwrap();
        let got = read_object(reader.segment(), addr, id, true, |b| b.to_vec()).unwrap();
        assert_eq!(got, b"metadata");
        assert_eq!(object_reader_count(reader.segment(), addr, id).unwrap(), 1);
        assert!(matches!(
            s.put(&mut ring, "a", &[b"x"]),
            Err(Error::KeyExists(_))
        ));
        let e = s.put(&mut ring, "big", &[&[0u8; 1021]]).unwrap_err();
        assert!(e.to_string().contains("exceeds max object size"), "{e}");
        // Free "a": its header now holds INVALID_ID, which must not work as an id.
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
    fn eviction_waits_for_every_handout() {
        let (mut ring, mut s) = store(512, 200, 2);
        let (a, i) = s.put(&mut ring, "k", &[&[1u8; 150]]).unwrap();
        s.get_cached("k").unwrap();
        let seg = ring.segment().clone();
        for _ in 0..3 {
            read_object(&seg, a, i, true, |_| ()).unwrap();
        }
        // 3 reads of 2 readers x 2 handouts: still in use.
        assert!(s.free_unused(&mut ring).unwrap().count == 0);
        s.put(&mut ring, "k2", &[&[2u8; 150]]).unwrap();
        assert!(matches!(
            s.put(&mut ring, "k3", &[&[3u8; 150]]),
            Err(Error::Full(_))
        ));
        read_object(&seg, a, i, true, |_| ()).unwrap();
        // Now fully read: the full ring frees it and k3 fits.
        s.put(&mut ring, "k3", &[&[3u8; 150]]).unwrap();
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
    fn clear_invalidates_old_handles() {
        let (mut ring, mut s) = store(1024, 100, 1);
        let (a, i) = s.put(&mut ring, "k", &[b"one"]).unwrap();
        s.clear(&mut ring).unwrap();
        let (a2, i2) = s.put(&mut ring, "k", &[b"two"]).unwrap();
        assert_ne!((a, i), (a2, i2));
        assert!(read_object(ring.segment(), a, i, false, |_| ()).is_err());
    }
}
