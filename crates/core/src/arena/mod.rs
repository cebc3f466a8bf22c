//! The tensor arena: large message parts copied once into shared memory (or written
//! there in place through a [`Loan`]) and read by every local reader as a private view.
//!
//! # Why
//! A broadcast ring copies a message into a chunk and every reader copies it out again.
//! For a 16 MiB tensor that is two copies per reader, and the ring's chunks must be as
//! large as the largest tensor. The arena keeps large parts beside the ring instead: the
//! writer copies a part in once (or not at all, for a loan) and puts a small reference
//! in the chunk; readers map the bytes and hand them out without copying.
//!
//! # Readers own what they receive
//! Every view a reader hands out shows the part's pages through a `MAP_PRIVATE` mapping:
//! reading costs nothing (the pages are the writer's), and a reader that writes into a
//! received tensor gets private copies of just the pages it writes (copy-on-write), so
//! neither the writer nor another reader ever sees that write, and a later message never
//! changes what a reader already holds. The mapping is one per reader process that stays
//! (a *window* of the whole arena, see `private_map.rs`): a view is a range of it, so a
//! reader that consumes every byte of a message pays what reading a mapping that stays
//! costs, with no `mmap`, `munmap` or first-touch page faults per message once the arena's
//! pages have been read once. When a view goes, the pages it wrote (its private copies,
//! found in `/proc/self/pagemap`) are dropped, so the next message placed there shows
//! through; only then can a view of that range be made again in this process.
//!
//! # Leases
//! Each allocation is a *lease*: a record in the lease table with the part's place in
//! the data region, a generation (bumped on every reuse of the record), one hold count
//! per reader and a hold flag for the writer's own [`Loan`]. The writer adds one hold per
//! live reader for each reference it publishes; a reader drops one hold when the view
//! made from that reference is gone (the last Python object that used it included). A
//! lease goes back to the writer's allocator only when every count is zero, so no range
//! is reused under a live view. The writer never waits for a lease: when none is free it
//! reports `None` and the caller sends the bytes the ordinary way (a copy), counting it.
//! Holds of a reader proved dead are dropped by the writer (see *Dead readers* below).
//!
//! # Layout (offsets from the start of the segment; `#[repr(C)]`, pointer-free)
//! ```text
//! 0             ArenaHeader: geometry; `magic` stored last with Release
//! 64            ArenaStats: fallbacks, bytes in use (for inspection)
//! 128           the queue's ring name (for `inspect`): length u8, then the UTF-8 bytes
//! table_offset  max_leases lease records of lease_stride bytes (multiple of 64):
//!                 +0 generation: u32   +4 writer_hold: u32
//!                 +8 offset: u64       +16 len: u64
//!                 +32 holds: [u32; n_reader]
//! data_offset   `capacity` bytes of part data (page-aligned; leases are whole pages)
//! ```
//! The data region is reserved (`fallocate`) lazily, up to the highest byte used
//! so far, so an arena that never carries a large part costs no memory, and a full
//! `/dev/shm` makes the writer fall back to copying instead of dying of `SIGBUS`.
//!
//! # Made at first use
//! A queue's arena is named when the queue is made (the name travels in the handle) but
//! the segment is created only when the first large part, a loan or a reservation needs
//! it ([`LazyArenaWriter`]); a reader opens it when the first message that refers to it
//! arrives. A queue that only ever carries small messages has no arena file at all.
//!
//! # Dead readers
//! A reader SIGKILLed while it holds views never drops its holds. The writer asks the
//! ring's liveness locks whether readers are dead when it runs short of room, and also at
//! most once every [`DEAD_CHECK_EVERY`] while leases are outstanding (one lock probe per
//! reader, not per message), and drops the holds of each reader proved dead.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Arc;

use shmq_os::error::{Error, Result};
use shmq_os::private_map::{PrivateFile, PrivateMap};
use shmq_os::process::ProcessId;
use shmq_os::range_alloc::RangeAllocator;
use shmq_os::region;
use shmq_os::region::RawRegion;
use shmq_os::segment::{
    data_after_table, round_up, unique_name, HeaderCheck, LoanPages, Segment, MAX_READERS,
};
use shmq_protocol::sync::{AtomicU32, AtomicU64, Ordering};

/// "SHMQARN1" little-endian: marks a finished arena segment.
pub const ARENA_MAGIC: u64 = u64::from_le_bytes(*b"SHMQARN1");
/// Bumped whenever the layout changes; openers refuse any other version.
pub const ARENA_LAYOUT_VERSION: u32 = 2;
/// Default size of the data region (virtual: only what is used gets reserved).
pub const DEFAULT_CAPACITY: usize = 1 << 30;
/// Default size from which a message part goes to the arena.
pub const DEFAULT_THRESHOLD: usize = 1 << 20;
/// Default number of lease records (parts that can be outstanding at once).
pub const DEFAULT_MAX_LEASES: usize = 1024;

/// Environment variable: bytes of a new queue's tensor arena (0 turns it off).
pub const ARENA_BYTES_ENV: &str = "SHMQ_ARENA_BYTES";
/// Environment variable: smallest message part that goes to the arena.
pub const ARENA_THRESHOLD_ENV: &str = "SHMQ_ARENA_THRESHOLD";

fn env_usize(name: &str) -> Option<usize> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse() {
        Ok(n) => Some(n),
        Err(_) => {
            warn_user!("shmq: ignoring {name}={v:?}: not a number of bytes");
            None
        }
    }
}

/// The arena size a queue gets unless told otherwise: [`ARENA_BYTES_ENV`], else
/// [`DEFAULT_CAPACITY`].
/// How long after a failed reservation (a full `/dev/shm`) the arena tries again.
const RESERVE_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

pub fn default_capacity() -> usize {
    env_usize(ARENA_BYTES_ENV).unwrap_or(DEFAULT_CAPACITY)
}

/// The arena threshold a queue gets unless told otherwise: [`ARENA_THRESHOLD_ENV`], else
/// [`DEFAULT_THRESHOLD`].
pub fn default_threshold() -> usize {
    env_usize(ARENA_THRESHOLD_ENV).unwrap_or(DEFAULT_THRESHOLD)
}

const STATS_OFFSET: usize = 64;
/// Where the queue's ring name is recorded: one length byte, then the name.
const QUEUE_OFFSET: usize = 128;
/// The longest queue name recorded (longer ones are cut, at a character boundary).
const QUEUE_NAME_MAX: usize = 255;
const TABLE_OFFSET: usize = 384;
const _: () = assert!(QUEUE_OFFSET + 1 + QUEUE_NAME_MAX <= TABLE_OFFSET);

/// How often, at most, the writer probes the readers' liveness while leases are
/// outstanding (besides whenever room runs short).
pub const DEAD_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(500);
const LEASE_HOLDS_OFFSET: usize = 32;

/// The segment header. Lives at offset 0 of the mapping.
#[repr(C)]
struct ArenaHeader {
    magic: AtomicU64,
    version: u32,
    n_reader: u32,
    max_leases: u32,
    page_size: u32,
    lease_stride: u64,
    data_offset: u64,
    capacity: u64,
    creator_pid: u32,
    _pad: u32,
    creator_start_time: u64,
}
const _: () = assert!(std::mem::size_of::<ArenaHeader>() <= STATS_OFFSET);

/// What the writer publishes for inspection.
#[repr(C, align(64))]
struct ArenaStats {
    fallbacks: AtomicU64,
    bytes_in_use: AtomicU64,
    reserved: AtomicU64,
}
const _: () = assert!(STATS_OFFSET + std::mem::size_of::<ArenaStats>() <= QUEUE_OFFSET);

/// The fixed part of a lease record; the per-reader hold counts follow it.
#[repr(C)]
struct LeaseRecord {
    generation: AtomicU32,
    writer_hold: AtomicU32,
    offset: AtomicU64,
    len: AtomicU64,
}
const _: () = assert!(std::mem::size_of::<LeaseRecord>() <= LEASE_HOLDS_OFFSET);

pub use shmq_os::private_map::page_size;

/// Sizes derived from an arena's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    n_reader: usize,
    max_leases: usize,
    page_size: usize,
    lease_stride: usize,
    data_offset: usize,
    capacity: usize,
    total: usize,
}

impl Geometry {
    fn new(
        n_reader: usize,
        capacity: usize,
        max_leases: usize,
        page_size: usize,
    ) -> Result<Geometry> {
        let bad = |what: String| Error::InvalidArgument(what);
        if n_reader == 0 || n_reader > MAX_READERS {
            return Err(bad(format!(
                "an arena needs 1 to 4096 readers, got {n_reader}"
            )));
        }
        if max_leases == 0 || max_leases > 1 << 20 {
            return Err(bad(format!(
                "max_leases must be 1..2**20, got {max_leases}"
            )));
        }
        if !page_size.is_power_of_two() || page_size < 4096 {
            return Err(bad(format!(
                "page size {page_size} is not a power of two ≥ 4096"
            )));
        }
        let too_large = || bad(format!("an arena of {capacity} bytes is too large"));
        let capacity = round_up(capacity.max(page_size), page_size).ok_or_else(too_large)?;
        let lease_stride = round_up(LEASE_HOLDS_OFFSET + 4 * n_reader, 64).ok_or_else(too_large)?;
        let (data_offset, total) =
            data_after_table(TABLE_OFFSET, lease_stride, max_leases, page_size, capacity)
                .ok_or_else(too_large)?;
        Ok(Geometry {
            n_reader,
            max_leases,
            page_size,
            lease_stride,
            data_offset,
            capacity,
            total,
        })
    }
}

/// A mapped arena segment (`MAP_SHARED`, either side): the header, the lease table and,
/// on the writer, the data it fills.
struct Mapped {
    segment: Segment,
    base: NonNull<u8>,
    geo: Geometry,
}

// SAFETY: `base` points into `segment`'s mapping, which lives as long as `self`. The
// header is immutable after creation; lease records are only accessed through atomics;
// data bytes are written only by the writer, into leases no reader holds (the protocol
// in the module docs), and readers never read them through this mapping.
unsafe impl Send for Mapped {}
// SAFETY: as for Send: `&Mapped` exposes atomics and raw pointers only.
unsafe impl Sync for Mapped {}

impl Mapped {
    fn header(&self) -> &ArenaHeader {
        // SAFETY: offset 0 of a mapping at least `data_offset` bytes long, page-aligned;
        // the header is written once before the magic is published and never again.
        unsafe { &*(self.base.as_ptr() as *const ArenaHeader) }
    }

    fn stats(&self) -> &ArenaStats {
        // SAFETY: STATS_OFFSET is inside the header page, 64-aligned, atomics only.
        unsafe { &*(self.base.as_ptr().add(STATS_OFFSET) as *const ArenaStats) }
    }

    fn record(&self, lease: usize) -> &LeaseRecord {
        debug_assert!(lease < self.geo.max_leases);
        // SAFETY: lease < max_leases, so the record lies inside the table (Geometry::new);
        // records are 64-aligned (TABLE_OFFSET and the stride are multiples of 64); every
        // field is an atomic. A peer process that writes garbage into a record can only
        // change counts and generations, which readers validate and the writer trusts
        // only to decide when a range may be reused.
        unsafe {
            &*(self
                .base
                .as_ptr()
                .add(TABLE_OFFSET + lease * self.geo.lease_stride)
                as *const LeaseRecord)
        }
    }

    fn hold(&self, lease: usize, reader: usize) -> &AtomicU32 {
        debug_assert!(reader < self.geo.n_reader);
        // SAFETY: reader < n_reader: inside the record (lease_stride covers the counts);
        // 4-aligned; atomic only.
        unsafe {
            &*(self
                .base
                .as_ptr()
                .add(TABLE_OFFSET + lease * self.geo.lease_stride + LEASE_HOLDS_OFFSET + 4 * reader)
                as *const AtomicU32)
        }
    }

    /// The queue's ring name recorded by the writer ("" if none). A peer that scribbles
    /// over it changes only what `inspect` shows (cut to what is valid UTF-8).
    fn queue(&self) -> String {
        // SAFETY: QUEUE_OFFSET + 1 + QUEUE_NAME_MAX <= TABLE_OFFSET <= the mapping's
        // length (the length byte is capped at QUEUE_NAME_MAX, whatever it says); the
        // bytes are written once before the magic is published. A peer process may still
        // write them at any time: we copy them out byte by byte with volatile reads (no
        // reference to racing memory is formed; any value is a valid u8) and only show,
        // never trust, them.
        let bytes: Vec<u8> = unsafe {
            let at = self.base.as_ptr().add(QUEUE_OFFSET);
            let len = (std::ptr::read_volatile(at) as usize).min(QUEUE_NAME_MAX);
            (1..=len)
                .map(|i| std::ptr::read_volatile(at.add(i)))
                .collect()
        };
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => {
                let valid = e.utf8_error().valid_up_to();
                String::from_utf8_lossy(&e.into_bytes()[..valid]).into_owned()
            }
        }
    }

    /// The start of the data region in this mapping.
    fn data(&self) -> *mut u8 {
        // SAFETY: data_offset < total <= the mapping's length.
        unsafe { self.base.as_ptr().add(self.geo.data_offset) }
    }
}

/// A reference to bytes in the arena, as carried in a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaRef {
    pub lease: u32,
    pub generation: u32,
    /// Offset in the data region.
    pub offset: u64,
    pub len: u64,
}

/// The writer's in-process record of a lease it has handed out.
#[derive(Clone, Copy, Debug)]
struct Outstanding {
    lease: u32,
    offset: usize,
    len: usize,
}

/// The writer's side of an arena: it allocates leases and fills them.
pub struct ArenaWriter {
    map: Arc<Mapped>,
    /// Free ranges of the data region.
    free: RangeAllocator,
    /// Lease records not in use.
    free_leases: Vec<u32>,
    /// Leases handed out and not yet reclaimed.
    outstanding: Vec<Outstanding>,
    /// Bytes of the data region reserved in `/dev/shm` so far (from its start).
    reserved: usize,
    /// When reserving last failed (a full `/dev/shm`): growth is tried again only after
    /// [`RESERVE_RETRY`], not on every part (a failed `fallocate` costs as much as
    /// one that works).
    reserve_failed_at: Option<std::time::Instant>,
    fallbacks: u64,
    /// When the readers' liveness was last probed for dead holders (see
    /// [`DEAD_CHECK_EVERY`]).
    last_dead_check: Option<std::time::Instant>,
    /// Live loans by address in this process: start → (end, lease, its pages, which the
    /// first publish seals).
    loans: BTreeMap<usize, (usize, u32, Arc<LoanPages>)>,
    /// Which lease records are loans (kept by their `Loan`, not by a publish).
    is_loan: Vec<bool>,
}

impl std::fmt::Debug for ArenaWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaWriter")
            .field("name", &self.name())
            .field("capacity", &self.map.geo.capacity)
            .field("outstanding", &self.outstanding.len())
            .finish()
    }
}

impl ArenaWriter {
    /// Create an arena for `n_reader` readers with `capacity` bytes of data (rounded up
    /// to whole pages) and `max_leases` lease records. Only the header and the lease
    /// table are reserved now.
    pub fn create(n_reader: usize, capacity: usize, max_leases: usize) -> Result<ArenaWriter> {
        Self::create_named(&unique_name("arena"), "", n_reader, capacity, max_leases)
    }

    /// [`create`](Self::create) under the segment name `name`, recording `queue` (the
    /// name of the queue's ring, cut to 255 bytes) for `inspect`.
    pub fn create_named(
        name: &str,
        queue: &str,
        n_reader: usize,
        capacity: usize,
        max_leases: usize,
    ) -> Result<ArenaWriter> {
        let geo = Geometry::new(n_reader, capacity, max_leases, page_size())?;
        let segment = Segment::create_sparse(name, geo.total, geo.data_offset)?;
        let base = NonNull::new(segment.as_ptr()).expect("mmap never returns null");
        // A process forked from the writer does not get the arena's data pages: a loan
        // handed out before a fork and sent after it must be private to the writer once
        // sent (the send moves its pages aside here, but a child would keep the shared
        // mapping and could write into what every reader's view shows). The child
        // faults if it touches an inherited loan instead. The header stays inherited.
        // SAFETY: the range lies inside the mapping just made (data_offset < total,
        // both page multiples); MADV_DONTFORK changes no content, only what fork copies.
        unsafe {
            libc::madvise(
                base.as_ptr().add(geo.data_offset) as *mut libc::c_void,
                geo.total - geo.data_offset,
                libc::MADV_DONTFORK,
            );
        }
        let map = Mapped { segment, base, geo };
        let me = ProcessId::current();
        // SAFETY: the segment is new, page-aligned and larger than the header and the
        // queue name (QUEUE_OFFSET + 1 + QUEUE_NAME_MAX <= TABLE_OFFSET < data_offset);
        // no other process uses it before the magic is stored below (a same-uid peer that
        // writes it anyway only spoils what openers read and check: the header is
        // validated by `ArenaReader::open`, the name only shown by `inspect`). `cut` bytes
        // of `queue` are copied, cut at a character boundary, and `cut` fits in the u8.
        unsafe {
            let h = base.as_ptr() as *mut ArenaHeader;
            (*h).version = ARENA_LAYOUT_VERSION;
            (*h).n_reader = n_reader as u32;
            (*h).max_leases = geo.max_leases as u32;
            (*h).page_size = geo.page_size as u32;
            (*h).lease_stride = geo.lease_stride as u64;
            (*h).data_offset = geo.data_offset as u64;
            (*h).capacity = geo.capacity as u64;
            (*h).creator_pid = me.pid;
            (*h).creator_start_time = me.start_time;
            let mut cut = queue.len().min(QUEUE_NAME_MAX);
            while !queue.is_char_boundary(cut) {
                cut -= 1;
            }
            let at = base.as_ptr().add(QUEUE_OFFSET);
            *at = cut as u8;
            std::ptr::copy_nonoverlapping(queue.as_ptr(), at.add(1), cut);
        }
        // Release: pairs with the Acquire load in `ArenaReader::open`: an opener that
        // sees the magic sees the whole header (the table is zero from the kernel).
        map.header().magic.store(ARENA_MAGIC, Ordering::Release);
        Ok(ArenaWriter {
            map: Arc::new(map),
            free: RangeAllocator::new(geo.capacity, geo.page_size),
            free_leases: (0..geo.max_leases as u32).rev().collect(),
            outstanding: Vec::new(),
            reserved: 0,
            reserve_failed_at: None,
            fallbacks: 0,
            last_dead_check: None,
            loans: BTreeMap::new(),
            is_loan: vec![false; geo.max_leases],
        })
    }

    pub fn name(&self) -> &str {
        self.map.segment.name()
    }
    /// Bytes of the data region.
    pub fn capacity(&self) -> usize {
        self.map.geo.capacity
    }
    pub fn n_reader(&self) -> usize {
        self.map.geo.n_reader
    }
    /// Parts sent the ordinary way because no lease was free (or `/dev/shm` was full).
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks
    }
    /// Leases handed out and not yet returned.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }
    /// Bytes of the data region reserved in `/dev/shm` so far.
    pub fn reserved(&self) -> usize {
        self.reserved
    }
    /// An error once a peer truncated the arena under this writer (see `shmq_os::sigbus`):
    /// a fault in its mapping, or a reservation that found the file short (the writer
    /// then sends the part it was for no other way: a copy would hide the loss).
    pub fn check_intact(&self) -> Result<()> {
        self.map.segment.check_intact()
    }

    /// Remove the segment's name now (see `Segment::unlink`).
    pub fn unlink(&self) -> Result<()> {
        self.map.segment.unlink()
    }

    /// Count one fallback (a part sent the ordinary way), for the statistics.
    pub fn count_fallback(&mut self) {
        self.fallbacks += 1;
        // Relaxed: a statistic for inspection.
        self.map
            .stats()
            .fallbacks
            .store(self.fallbacks, Ordering::Relaxed);
        if self.fallbacks == 1 || self.fallbacks.is_power_of_two() {
            shmq_log!(
                info,
                "shmq: tensor arena {} full ({} parts outstanding); sent a part by copy \
                 ({} such fallbacks so far)",
                self.name(),
                self.outstanding.len(),
                self.fallbacks
            );
        }
    }

    /// Whether every hold on `lease` has been dropped.
    fn is_unused(&self, lease: u32) -> bool {
        let (map, l) = (&self.map, lease as usize);
        // Acquire: pairs with the Release decrement in `ArenaView::drop` (and the Release
        // store in `Loan::drop`): whatever the holder did with the bytes happened before
        // the writer reuses them.
        map.record(l).writer_hold.load(Ordering::Acquire) == 0
            && (0..map.geo.n_reader).all(|r| map.hold(l, r).load(Ordering::Acquire) == 0)
    }

    /// Give back every outstanding lease whose holds are all gone (done before every
    /// allocation; call it to see the current count in [`outstanding`](Self::outstanding)).
    pub fn reclaim(&mut self) {
        let mut k = 0;
        while k < self.outstanding.len() {
            let o = self.outstanding[k];
            if self.is_unused(o.lease) {
                // Relaxed: only this writer stores it; a new generation makes references
                // to the old contents fail their check in a reader (stale or forged
                // messages), and the next use bumps it again.
                self.map
                    .record(o.lease as usize)
                    .generation
                    .fetch_add(1, Ordering::Relaxed);
                self.outstanding.swap_remove(k);
                self.loans.remove(&(self.map.data() as usize + o.offset));
                self.free.give_back(o.offset, o.len);
                self.free_leases.push(o.lease);
            } else {
                k += 1;
            }
        }
        let in_use: usize = self.outstanding.iter().map(|o| o.len).sum();
        // Relaxed: a statistic.
        self.map
            .stats()
            .bytes_in_use
            .store(in_use as u64, Ordering::Relaxed);
    }

    /// Drop every hold of the readers proved dead (`reader_is_dead(r)`, asked only of
    /// readers that hold something now), then [`reclaim`](Self::reclaim). The writer
    /// does this by itself when room runs short and at most once every
    /// [`DEAD_CHECK_EVERY`] when it places a part; call it to do it now.
    pub fn reclaim_dead(&mut self, reader_is_dead: &mut dyn FnMut(usize) -> bool) {
        self.last_dead_check = Some(std::time::Instant::now());
        let n = self.map.geo.n_reader;
        let mut holding = vec![false; n];
        for o in &self.outstanding {
            for (r, h) in holding.iter_mut().enumerate() {
                // Relaxed: a hint of which readers to probe; a hold added or dropped
                // meanwhile is seen on a later check.
                *h |= self.map.hold(o.lease as usize, r).load(Ordering::Relaxed) != 0;
            }
        }
        let dead: Vec<usize> = (0..n)
            .filter(|&r| holding[r] && reader_is_dead(r))
            .collect();
        for o in &self.outstanding {
            for &r in &dead {
                // Relaxed: the dead reader no longer touches it (proved by its liveness
                // lock, released by the kernel only when the process is gone); the
                // Acquire in `is_unused` orders our later reuse after this store anyway.
                self.map
                    .hold(o.lease as usize, r)
                    .store(0, Ordering::Relaxed);
            }
        }
        if !dead.is_empty() {
            shmq_log!(
                info,
                "shmq: tensor arena {}: dropped the holds of dead reader(s) {dead:?}",
                self.name()
            );
        }
        self.reclaim();
    }

    /// Reserve the first `bytes` of the data region now (rounded up to whole pages, at
    /// most the capacity): the pages are taken in `/dev/shm` and mapped in this writer,
    /// so the first parts placed there do not pay for it (a new 256 MiB range costs
    /// ~0.1–0.2 s, most of it the kernel zeroing the pages). Returns the bytes reserved
    /// in all; an error (and nothing more reserved) when `/dev/shm` has no room.
    pub fn reserve(&mut self, bytes: usize) -> Result<usize> {
        let end = round_up(bytes, self.map.geo.page_size)
            .unwrap_or(usize::MAX)
            .min(self.map.geo.capacity);
        if end > self.reserved {
            self.grow_reservation(end, end)?;
        }
        Ok(self.reserved)
    }

    /// Make sure `end` bytes of the data region are reserved in `/dev/shm`.
    fn reserve_to(&mut self, end: usize) -> bool {
        if end <= self.reserved {
            return true;
        }
        if self
            .reserve_failed_at
            .is_some_and(|t| t.elapsed() < RESERVE_RETRY)
        {
            return false;
        }
        // Grow in steps of at least 64 MiB (or to the end) to keep the syscalls rare; where
        // a step does not fit (a small `/dev/shm`), exactly what this part needs.
        let step = end
            .max(self.reserved.saturating_add(64 << 20))
            .min(self.map.geo.capacity);
        let grown = self.grow_reservation(end, step).or_else(|e| {
            if step > end {
                self.grow_reservation(end, end)
            } else {
                Err(e)
            }
        });
        match grown {
            Ok(()) => {
                self.reserve_failed_at = None;
                true
            }
            // A truncated arena: no fallback, the writer's next check is the error (the
            // segment remembers it: see `Segment::reserve_range`).
            Err(e @ Error::BadSegment { .. }) => {
                shmq_log!(debug, "shmq: tensor arena {}: {e}", self.name());
                false
            }
            Err(e) => {
                if self.reserve_failed_at.is_none() {
                    warn_user!(
                        "shmq: cannot reserve more of tensor arena {} ({e}); large parts are \
                         copied through the queue instead until there is room",
                        self.name()
                    );
                }
                self.reserve_failed_at = Some(std::time::Instant::now());
                false
            }
        }
    }

    /// Reserve the data region up to `target` (at least `end`, which must fit).
    fn grow_reservation(&mut self, end: usize, target: usize) -> Result<()> {
        debug_assert!(self.reserved < end && end <= target);
        let from = self.reserved;
        match self
            .map
            .segment
            .reserve_range(self.map.geo.data_offset + from, target - from)
        {
            Ok(()) => {
                // Fault the writer's page tables in now rather than one page at a time
                // during the first copies (best effort: older kernels lack it).
                // SAFETY: the range lies inside the mapping (target <= capacity).
                unsafe {
                    libc::madvise(
                        self.map.data().add(from) as *mut libc::c_void,
                        target - from,
                        libc::MADV_POPULATE_WRITE,
                    );
                }
                self.reserved = target;
                // Relaxed: a statistic.
                self.map
                    .stats()
                    .reserved
                    .store(target as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// A lease of at least `len` bytes, or `None` if the arena has no room now.
    /// `reader_is_dead(r)` is asked, only when room is short, whether reader `r` is
    /// proved dead; its holds are then dropped.
    fn allocate(
        &mut self,
        len: usize,
        reader_is_dead: &mut dyn FnMut(usize) -> bool,
    ) -> Option<(u32, usize, usize)> {
        let len = self.free.rounded(len)?;
        self.reclaim();
        let short = self.free_leases.is_empty() || !self.free.fits(len);
        let due = self
            .last_dead_check
            .is_none_or(|t| t.elapsed() >= DEAD_CHECK_EVERY);
        if short || due {
            self.reclaim_dead(reader_is_dead);
        }
        let lease = *self.free_leases.last()?;
        let offset = self.free.take(len)?;
        if !self.reserve_to(offset + len) {
            self.free.give_back(offset, len);
            return None;
        }
        self.free_leases.pop();
        let rec = self.map.record(lease as usize);
        // Relaxed: these reach readers only through a message, which the ring publishes
        // with Release after this (and readers load with Acquire).
        rec.generation.fetch_add(1, Ordering::Relaxed);
        rec.offset.store(offset as u64, Ordering::Relaxed);
        rec.len.store(len as u64, Ordering::Relaxed);
        // Held by the writer until the message that carries it is published (`publish`)
        // or, for a loan, until the `Loan` is dropped: until then no reader holds it, and
        // `reclaim` must not take it back (say, while the next part of the same message
        // is being placed). Relaxed: read in this process only.
        rec.writer_hold.store(1, Ordering::Relaxed);
        self.is_loan[lease as usize] = false;
        self.outstanding.push(Outstanding { lease, offset, len });
        Some((lease, offset, len))
    }

    /// Copy `bytes` into a new lease and return the reference to publish (after
    /// [`publish`](Self::publish)), or `None` if there is no room (counted as a
    /// fallback).
    pub fn copy_in(
        &mut self,
        bytes: &[u8],
        reader_is_dead: &mut dyn FnMut(usize) -> bool,
    ) -> Option<ArenaRef> {
        let Some((lease, offset, _)) = self.allocate(bytes.len(), reader_is_dead) else {
            self.count_fallback();
            return None;
        };
        // SAFETY: the range [offset, offset + len) is a fresh lease inside the data region
        // (allocate); no reader holds it (all counts were zero when it was reclaimed), so
        // nobody reads it while we write, and it cannot overlap `bytes` (a caller's buffer
        // that lies in the arena is a loan, sent by reference, never copied in).
        let dst =
            unsafe { std::slice::from_raw_parts_mut(self.map.data().add(offset), bytes.len()) };
        shmq_os::copy::copy_large(dst, bytes);
        Some(self.reference(lease, offset, bytes.len()))
    }

    fn reference(&self, lease: u32, offset: usize, len: usize) -> ArenaRef {
        // Relaxed: only this writer stores the generation.
        let generation = self
            .map
            .record(lease as usize)
            .generation
            .load(Ordering::Relaxed);
        ArenaRef {
            lease,
            generation,
            offset: offset as u64,
            len: len as u64,
        }
    }

    /// Lend `len` bytes of the arena to fill in place; send them by passing (a part of)
    /// the loan's bytes to the queue. `None` if there is no room.
    pub fn loan(
        &mut self,
        len: usize,
        reader_is_dead: &mut dyn FnMut(usize) -> bool,
    ) -> Option<Loan> {
        // Loans dropped while the process was out of mappings give their memory back
        // first, where they can now.
        shmq_os::segment::retry_deferred_unseals();
        let (lease, offset, rounded) = self.allocate(len, reader_is_dead)?;
        self.is_loan[lease as usize] = true;
        // SAFETY: inside the data region (allocate).
        let ptr = unsafe { self.map.data().add(offset) };
        // The allocation is whole pages from a page boundary (the allocator's unit is the
        // page), so sealing it touches no other lease's memory.
        let pages = Arc::new(LoanPages::new(ptr, rounded));
        self.loans
            .insert(ptr as usize, (ptr as usize + rounded, lease, pages.clone()));
        Some(Loan {
            map: self.map.clone(),
            lease,
            // SAFETY: `ptr..ptr+len` lies in the lease, inside the mapping that `map`
            // keeps alive as long as the loan; the allocator gave the lease to this loan
            // alone. Readers that hold the lease read it through their own private
            // mappings; once sent, the loan's pages are this process's private
            // copy-on-write view (sealed by `publish`), so later writes reach no reader.
            bytes: unsafe { RawRegion::new(ptr, len) },
            pages,
            made_in: shmq_os::fork::generation(),
        })
    }

    /// If `bytes` lie inside a live loan of this arena, the reference that sends them
    /// without a copy.
    pub fn find_loan(&self, bytes: &[u8]) -> Option<ArenaRef> {
        let start = bytes.as_ptr() as usize;
        let (_, (end, lease, pages)) = self.loans.range(..=start).next_back()?;
        if start + bytes.len() > *end || pages.is_sealed() {
            // Not a loan's, or one sent already: its pages are the writer's own now
            // (sealed), so what the writer sees there is sent the ordinary way, copied.
            return None;
        }
        let lease = *lease;
        // Only bytes of a live loan can be passed in (the caller borrows them from it), so
        // the lease is still this loan's; `reclaim` forgets a loan once it is returned.
        Some(self.reference(lease, start - self.map.data() as usize, bytes.len()))
    }

    /// Seal the loan that `r` (from [`find_loan`](Self::find_loan)) lies in, if it is not
    /// sealed yet: call it before `r` goes into a message. `false` if its pages could not
    /// be sealed (see `LoanPages::seal` in `segment`): they are still shared with the readers, so
    /// the part must be copied, not referenced. `true` for a part that is no loan's.
    pub fn seal_loan(&self, r: &ArenaRef) -> bool {
        if !self.is_loan[r.lease as usize] {
            return true;
        }
        match self.loans.values().find(|(_, l, _)| *l == r.lease) {
            Some((_, _, pages)) => pages.seal(&self.map.segment),
            None => true,
        }
    }

    /// Publish `r`: add one hold per reader in `readers` on its lease, then drop the
    /// writer's own hold of a copied part (a loan keeps its hold until the `Loan` goes,
    /// and is sealed: see [`Loan`]). Call it before the message that carries `r` becomes
    /// visible to readers.
    pub fn publish(&self, r: &ArenaRef, readers: impl Iterator<Item = usize>) {
        self.seal_loan(r);
        for reader in readers {
            // Relaxed: the message carrying the reference is published with Release after
            // this, and the reader's decrement comes after it has seen that message.
            self.map
                .hold(r.lease as usize, reader)
                .fetch_add(1, Ordering::Relaxed);
        }
        self.abandon(r);
    }

    /// Drop the writer's hold of a copied part whose message will not be sent after all
    /// (loans keep theirs).
    pub fn abandon(&self, r: &ArenaRef) {
        if !self.is_loan[r.lease as usize] {
            // Release: pairs with the Acquire in `is_unused` (the holds added above are
            // seen before the lease can be judged unused).
            self.map
                .record(r.lease as usize)
                .writer_hold
                .store(0, Ordering::Release);
        }
    }
}

/// A queue's arena, named now and made when first needed (see the module docs): the
/// writer's handle on it whether or not the segment exists yet.
#[derive(Debug)]
pub struct LazyArenaWriter {
    name: String,
    queue: String,
    n_reader: usize,
    capacity: usize,
    max_leases: usize,
    made: Option<ArenaWriter>,
    /// When making it last failed (say, `/dev/shm` full): tried again only after
    /// [`RESERVE_RETRY`], not on every part.
    failed_at: Option<std::time::Instant>,
    /// Parts sent by copy before the arena could be made.
    fallbacks: u64,
}

impl LazyArenaWriter {
    /// Name an arena for the queue whose ring is `queue` (checking its parameters now);
    /// nothing is created yet.
    pub fn new(
        queue: &str,
        n_reader: usize,
        capacity: usize,
        max_leases: usize,
    ) -> Result<LazyArenaWriter> {
        let geo = Geometry::new(n_reader, capacity, max_leases, page_size())?;
        Ok(LazyArenaWriter {
            name: unique_name("arena"),
            queue: queue.to_owned(),
            n_reader,
            capacity: geo.capacity,
            max_leases,
            made: None,
            failed_at: None,
            fallbacks: 0,
        })
    }

    /// The segment's name (whether or not it exists yet).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Bytes of the data region.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// The arena, if it has been made.
    pub fn get(&self) -> Option<&ArenaWriter> {
        self.made.as_ref()
    }
    /// The arena, if it has been made.
    pub fn get_mut(&mut self) -> Option<&mut ArenaWriter> {
        self.made.as_mut()
    }

    /// The arena, made now if it is not yet; the error if it cannot be made.
    pub fn make(&mut self) -> Result<&mut ArenaWriter> {
        if self.made.is_none() {
            let a = ArenaWriter::create_named(
                &self.name,
                &self.queue,
                self.n_reader,
                self.capacity,
                self.max_leases,
            )?;
            self.failed_at = None;
            self.made = Some(a);
        }
        Ok(self.made.as_mut().expect("made above"))
    }

    /// The arena for a part that needs it: made now if it is not yet, `None` (logged
    /// once, tried again after a while) if it cannot be made.
    pub fn for_part(&mut self) -> Option<&mut ArenaWriter> {
        if self.made.is_none() {
            if self.failed_at.is_some_and(|t| t.elapsed() < RESERVE_RETRY) {
                return None;
            }
            if let Err(e) = self.make() {
                if self.failed_at.is_none() {
                    warn_user!(
                        "shmq: cannot make tensor arena {} ({e}); large parts are copied \
                         through the queue instead until there is room",
                        self.name
                    );
                }
                self.failed_at = Some(std::time::Instant::now());
                return None;
            }
        }
        self.made.as_mut()
    }

    /// Count one part sent by copy (the arena had no room, or could not be made).
    pub fn count_fallback(&mut self) {
        match self.made.as_mut() {
            Some(a) => a.count_fallback(),
            None => self.fallbacks += 1,
        }
    }

    /// Parts sent the ordinary way because the arena had no room (or could not be made).
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks + self.made.as_ref().map_or(0, |a| a.fallbacks())
    }
    /// Leases handed out and not yet returned (0 before the arena is made).
    pub fn outstanding(&self) -> usize {
        self.made.as_ref().map_or(0, |a| a.outstanding())
    }
    /// Bytes of the data region reserved in `/dev/shm` so far.
    pub fn reserved(&self) -> usize {
        self.made.as_ref().map_or(0, |a| a.reserved())
    }
}

/// Bytes of the arena lent to the writer's process to fill in place. Dropping it
/// without sending gives the bytes back; once sent, readers hold them until they are
/// done. Sending seals it: the writer's mapping of its pages becomes a private
/// copy-on-write view, so the writer still reads what it sent and whatever it writes
/// afterwards reaches no reader and no message already sent. Sending it again sends what
/// the writer sees then, copied like any other part. Dropping it maps the pages shared
/// again before the arena can reuse them.
pub struct Loan {
    map: Arc<Mapped>,
    lease: u32,
    bytes: RawRegion,
    pages: Arc<LoanPages>,
    /// The fork generation it was made in: a forked child's copy gives nothing back.
    made_in: u64,
}

// SAFETY: the loan's bytes are a range of the shared mapping that `map` keeps alive and
// that only this loan writes (the allocator hands each range to one lease).
unsafe impl Send for Loan {}
// SAFETY: `&Loan` gives only shared access to the bytes.
unsafe impl Sync for Loan {}

impl std::fmt::Debug for Loan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loan")
            .field("lease", &self.lease)
            .field("len", &self.bytes.len())
            .finish()
    }
}

region!(Loan, bytes, mut);

impl Drop for Loan {
    fn drop(&mut self) {
        if shmq_os::fork::is_inherited(self.made_in) {
            return; // the parent's loan, not this child's to give back
        }
        if !self.pages.unseal(&self.map.segment) {
            // Its pages are still private here (the process is out of mappings): writing
            // them for another lease would reach nobody. The writer keeps its hold, so the
            // arena does not reuse them, until a retry succeeds (at this process's next
            // seal or loan), never for good.
            let (pages, map, lease) = (self.pages.clone(), self.map.clone(), self.lease);
            shmq_os::segment::defer_unseal(Box::new(move || {
                if !pages.unseal(&map.segment) {
                    return false;
                }
                // Release: as below.
                map.record(lease as usize)
                    .writer_hold
                    .store(0, Ordering::Release);
                true
            }));
            return;
        }
        // Release: pairs with the Acquire load in `ArenaWriter::is_unused`: the writes into
        // the loan happen before the writer reuses its bytes.
        self.map
            .record(self.lease as usize)
            .writer_hold
            .store(0, Ordering::Release);
    }
}

/// A reader's side of an arena: the lease table (shared) and a descriptor to map parts
/// privately.
pub struct ArenaReader {
    map: Mapped,
    file: PrivateFile,
    reader: usize,
}

impl std::fmt::Debug for ArenaReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaReader")
            .field("name", &self.map.segment.name())
            .field("reader", &self.reader)
            .finish()
    }
}

impl ArenaReader {
    /// Open the arena `name` as reader number `reader`.
    pub fn open(name: &str, reader: usize) -> Result<ArenaReader> {
        let segment = Segment::open(name)?;
        let check = HeaderCheck {
            min_len: TABLE_OFFSET,
            magic: ARENA_MAGIC,
            version: ARENA_LAYOUT_VERSION,
            not_this_kind: "it is not a shmq tensor arena",
        };
        // SAFETY: the mapping is page-aligned and at least TABLE_OFFSET bytes long, which
        // covers the header; ArenaHeader is repr(C) plain integers and an atomic (any bit
        // pattern is valid). The magic's Acquire load pairs with the Release store in
        // `ArenaWriter::create`.
        let (base, header) =
            unsafe { segment.checked_header(&check, |h: &ArenaHeader| (&h.magic, &h.version)) }?;
        let geo = Geometry::new(
            header.n_reader as usize,
            header.capacity as usize,
            header.max_leases as usize,
            header.page_size as usize,
        )?;
        if geo.page_size != page_size()
            || (header.lease_stride, header.data_offset)
                != (geo.lease_stride as u64, geo.data_offset as u64)
            || segment.len() < geo.total
        {
            return Err(segment.header_mismatch());
        }
        if reader >= geo.n_reader {
            return Err(Error::InvalidArgument(format!(
                "reader index {reader} out of range: the arena has {} readers",
                geo.n_reader
            )));
        }
        let file = PrivateFile::open(name)?;
        Ok(ArenaReader {
            map: Mapped { segment, base, geo },
            file,
            reader,
        })
    }

    pub fn name(&self) -> &str {
        self.map.segment.name()
    }

    /// An error once a peer truncated the arena (see `shmq_os::sigbus`): the file is
    /// shorter than when opened (an `fstat`), or a mapping of it here was hit.
    pub fn check_intact(&self) -> Result<()> {
        self.map.segment.check_intact()?;
        self.file.check_intact()
    }

    /// An error once a mapping of the arena in this process was found truncated: the
    /// lease table's, or a view's, one that a caller may still hold and that reads zeros
    /// now (the `SIGBUS` handler's flags: atomic loads, no system call). For every call
    /// of the reader, also those whose message has no part here.
    pub fn check_faults(&self) -> Result<()> {
        self.map.segment.check_intact()?;
        self.file.check_faults()
    }

    fn check(&self, r: &ArenaRef) -> Result<usize> {
        let bad = |reason: &str| Error::BadSegment {
            name: self.name().to_owned(),
            reason: format!("a message names {reason} ({r:?})"),
        };
        let lease = r.lease as usize;
        if lease >= self.map.geo.max_leases {
            return Err(bad("a lease that does not exist"));
        }
        let rec = self.map.record(lease);
        // Relaxed: the writer stored these before publishing the message we got them from
        // (Release there, Acquire when we read the chunk).
        let (generation, offset, len) = (
            rec.generation.load(Ordering::Relaxed),
            rec.offset.load(Ordering::Relaxed),
            rec.len.load(Ordering::Relaxed),
        );
        let end = r.offset.checked_add(r.len);
        if generation != r.generation
            || r.offset < offset
            || end
                .is_none_or(|e| e > offset.saturating_add(len) || e > self.map.geo.capacity as u64)
        {
            return Err(bad("bytes outside their lease, or a lease reused since"));
        }
        Ok(lease)
    }

    /// Drop one hold on `r`'s lease without mapping it (a message taken but not used).
    pub fn release(&self, r: &ArenaRef) {
        if let Ok(lease) = self.check(r) {
            release_hold(&self.map, lease, self.reader);
        }
    }

    /// Map `r`'s bytes privately: a view that holds the lease until it is dropped.
    pub fn view(self: &Arc<Self>, r: &ArenaRef) -> Result<ArenaView> {
        // Before the lease table is read: a truncated arena is an error, not a SIGBUS.
        self.check_intact()?;
        let lease = self.check(r)?;
        // `check` bounded the range by the capacity, and `open` checked that the segment
        // holds data_offset + capacity bytes.
        match self
            .file
            .view(self.map.geo.data_offset as u64 + r.offset, r.len as usize)
        {
            Ok(map) => Ok(ArenaView {
                arena: self.clone(),
                lease,
                map,
                made_in: shmq_os::fork::generation(),
            }),
            Err(e) => {
                self.release(r);
                Err(e)
            }
        }
    }
}

fn release_hold(map: &Mapped, lease: usize, reader: usize) {
    // Release: pairs with the Acquire load in `ArenaWriter::is_unused`: our reads of the
    // bytes happen before the writer reuses them. Saturating: a count the writer already
    // zeroed (it thought us dead) must not wrap around and pin the lease forever.
    let _ = map
        .hold(lease, reader)
        .fetch_update(Ordering::Release, Ordering::Relaxed, |h| h.checked_sub(1));
}

/// Bytes of a message part, mapped privately in a reader: writable, and the writes stay
/// in this view. Holds its lease until dropped.
pub struct ArenaView {
    arena: Arc<ArenaReader>,
    lease: usize,
    map: PrivateMap,
    /// The fork generation it was made in: a forked child's copy drops no hold.
    made_in: u64,
}

impl std::fmt::Debug for ArenaView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaView")
            .field("lease", &self.lease)
            .field("len", &self.map.len())
            .finish()
    }
}

region!(ArenaView, map, mut);

impl Drop for ArenaView {
    fn drop(&mut self) {
        // The mapping (a field) is unmapped after this; the hold can go first: the
        // writer only writes the shared pages, never our private ones, and a page of
        // ours it changes now is one we no longer read. A forked child's copy of a view
        // drops nothing: the hold is its parent's.
        if !shmq_os::fork::is_inherited(self.made_in) {
            release_hold(&self.arena.map, self.lease, self.arena.reader);
        }
    }
}

/// What `inspect` shows of an arena.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaInfo {
    pub creator: ProcessId,
    /// The name of the queue's ring it belongs to ("" if it was made without one).
    pub queue: String,
    pub n_reader: usize,
    pub capacity: u64,
    pub reserved: u64,
    pub bytes_in_use: u64,
    pub fallbacks: u64,
}

/// Describe the arena segment `name` (fails if it is not one).
pub fn describe(name: &str) -> Result<ArenaInfo> {
    let a = ArenaReader::open(name, 0)?;
    let h = a.map.header();
    let s = a.map.stats();
    // Relaxed: statistics.
    Ok(ArenaInfo {
        creator: ProcessId {
            pid: h.creator_pid,
            start_time: h.creator_start_time,
        },
        queue: a.map.queue(),
        n_reader: a.map.geo.n_reader,
        capacity: a.map.geo.capacity as u64,
        reserved: s.reserved.load(Ordering::Relaxed),
        bytes_in_use: s.bytes_in_use.load(Ordering::Relaxed),
        fallbacks: s.fallbacks.load(Ordering::Relaxed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_dead(_: usize) -> bool {
        false
    }

    #[test]
    fn copy_in_view_release_reuse() {
        let mut w = ArenaWriter::create(2, 1 << 20, 8).unwrap();
        let r0 = Arc::new(ArenaReader::open(w.name(), 0).unwrap());
        let r1 = Arc::new(ArenaReader::open(w.name(), 1).unwrap());
        let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let a = w.copy_in(&data, &mut no_dead).unwrap();
        w.publish(&a, 0..2);
        let mut v0 = r0.view(&a).unwrap();
        let v1 = r1.view(&a).unwrap();
        assert_eq!(&v0[..], &data[..]);
        // A write in one view is private to it.
        v0[0] = 0xAA;
        assert_eq!(v1[0], 0);
        assert_eq!(v0[0], 0xAA);
        // Held: the next allocation does not reuse the range.
        let b = w.copy_in(&[7u8; 5000], &mut no_dead).unwrap();
        assert_ne!(a.offset, b.offset);
        // Not yet published: the writer holds it, so placing more parts cannot take it.
        w.reclaim();
        assert_eq!(w.outstanding(), 2);
        w.publish(&b, 0..0);
        drop(v0);
        assert_eq!(w.outstanding(), 2);
        drop(v1);
        w.reclaim();
        // b was published to nobody: reclaimed too.
        assert_eq!(w.outstanding(), 0);
        let c = w.copy_in(&[1u8; 10], &mut no_dead).unwrap();
        assert_eq!(c.offset, 0, "lowest free range first");
        // A stale reference (old generation) is refused.
        assert!(r0.view(&a).is_err());
    }

    #[test]
    fn full_arena_falls_back_and_dead_readers_release() {
        let mut w = ArenaWriter::create(1, 64 << 10, 4).unwrap();
        let r = Arc::new(ArenaReader::open(w.name(), 0).unwrap());
        let a = w.copy_in(&[1u8; 40 << 10], &mut no_dead).unwrap();
        w.publish(&a, 0..1);
        let _v = r.view(&a).unwrap();
        assert!(w.copy_in(&[2u8; 40 << 10], &mut no_dead).is_none());
        assert_eq!(w.fallbacks(), 1);
        // Reader 0 "dies": its hold is dropped when room is short.
        assert!(w.copy_in(&[2u8; 40 << 10], &mut |_| true).is_some());
    }

    #[test]
    fn loans_are_found_by_address_and_returned_when_dropped() {
        let mut w = ArenaWriter::create(1, 1 << 20, 8).unwrap();
        let r = Arc::new(ArenaReader::open(w.name(), 0).unwrap());
        let mut loan = w.loan(10_000, &mut no_dead).unwrap();
        loan.fill(3);
        let part = &loan[100..5000];
        let a = w.find_loan(part).unwrap();
        assert_eq!(a.len, 4900);
        assert!(w.find_loan(&[0u8; 10]).is_none());
        w.publish(&a, 0..1);
        let v = r.view(&a).unwrap();
        assert!(v.iter().all(|&b| b == 3));
        drop(loan);
        w.reclaim();
        assert_eq!(w.outstanding(), 1, "the reader still holds it");
        drop(v);
        w.reclaim();
        assert_eq!(w.outstanding(), 0);
        // An unsent loan comes back when dropped.
        let l2 = w.loan(100, &mut no_dead).unwrap();
        drop(l2);
        w.reclaim();
        assert_eq!(w.outstanding(), 0);
    }

    #[test]
    fn a_sent_loan_is_sealed_and_its_memory_shared_again_once_returned() {
        let mut w = ArenaWriter::create(1, 1 << 20, 8).unwrap();
        let r = Arc::new(ArenaReader::open(w.name(), 0).unwrap());
        let mut loan = w.loan(3 * 4096 + 10, &mut no_dead).unwrap();
        loan.fill(5);
        let a = w.find_loan(&loan).unwrap();
        w.publish(&a, 0..1);
        loan.fill(7); // after the send: the writer's own copy
        assert!(loan.iter().all(|&b| b == 7));
        let v = r.view(&a).unwrap();
        assert!(
            v.iter().all(|&b| b == 5),
            "a write after the send reached the reader"
        );
        // Sent again, it is copied (a new lease), not referenced.
        assert!(w.find_loan(&loan).is_none());
        drop((loan, v));
        w.reclaim();
        assert_eq!(w.outstanding(), 0);
        // The same memory lent again is shared: what the writer writes, readers read.
        let mut again = w.loan(3 * 4096 + 10, &mut no_dead).unwrap();
        assert_eq!(
            w.find_loan(&again).unwrap().offset,
            a.offset,
            "not the same memory"
        );
        again.fill(9);
        let b = w.find_loan(&again).unwrap();
        w.publish(&b, 0..1);
        assert!(r.view(&b).unwrap().iter().all(|&x| x == 9));
    }

    #[test]
    fn a_lazy_arena_is_made_at_first_use_and_names_its_queue() {
        let mut lazy = LazyArenaWriter::new("shmq_ring_test_queue", 2, 1 << 20, 8).unwrap();
        let name = lazy.name().to_owned();
        assert!(lazy.get().is_none());
        assert!(
            ArenaReader::open(&name, 0).is_err(),
            "made before it was needed"
        );
        assert_eq!(
            (lazy.outstanding(), lazy.reserved(), lazy.fallbacks()),
            (0, 0, 0)
        );
        let w = lazy.for_part().unwrap();
        assert_eq!(w.name(), name);
        let info = describe(&name).unwrap();
        assert_eq!(info.queue, "shmq_ring_test_queue");
        assert_eq!(info.n_reader, 2);
        assert!(ArenaReader::open(&name, 1).is_ok());
        // An arena made without a queue records none.
        let plain = ArenaWriter::create(1, 1 << 20, 8).unwrap();
        assert_eq!(describe(plain.name()).unwrap().queue, "");
    }

    #[test]
    fn dead_readers_holds_are_dropped_without_a_shortage() {
        let mut w = ArenaWriter::create(2, 1 << 20, 8).unwrap();
        let r1 = Arc::new(ArenaReader::open(w.name(), 1).unwrap());
        let a = w.copy_in(&[1u8; 5000], &mut no_dead).unwrap();
        w.publish(&a, 0..2);
        let _held = r1.view(&a).unwrap();
        // Reader 0 "died" holding `a` (it never took the message); reader 1 lives on.
        w.reclaim();
        assert_eq!(w.outstanding(), 1);
        let mut asked = Vec::new();
        w.reclaim_dead(&mut |r| {
            asked.push(r);
            r == 0
        });
        assert_eq!(asked, [0, 1], "only readers holding something are probed");
        assert_eq!(w.outstanding(), 1, "reader 1 still holds it");
        drop(_held);
        w.reclaim();
        assert_eq!(w.outstanding(), 0);
        // Placing a part probes at most every DEAD_CHECK_EVERY, room or not.
        let b = w.copy_in(&[2u8; 5000], &mut no_dead).unwrap();
        w.publish(&b, 0..2);
        let mut probes = 0;
        let _c = w.copy_in(&[3u8; 5000], &mut |_| {
            probes += 1;
            false
        });
        assert_eq!(probes, 0, "probed again right away");
        std::thread::sleep(DEAD_CHECK_EVERY);
        let _d = w.copy_in(&[4u8; 5000], &mut |r| r == 0 || r == 1);
        w.reclaim();
        // b went with its dead holders; c and d are still the writer's (unpublished).
        assert_eq!(w.outstanding(), 2);
    }

    #[test]
    fn bad_references_are_errors() {
        let mut w = ArenaWriter::create(1, 1 << 20, 8).unwrap();
        let r = Arc::new(ArenaReader::open(w.name(), 0).unwrap());
        let a = w.copy_in(&[1u8; 100], &mut no_dead).unwrap();
        for bad in [
            ArenaRef { lease: 9999, ..a },
            ArenaRef {
                generation: a.generation + 1,
                ..a
            },
            ArenaRef { len: 1 << 30, ..a },
            ArenaRef {
                offset: u64::MAX,
                ..a
            },
        ] {
            assert!(
                matches!(r.view(&bad), Err(Error::BadSegment { .. })),
                "{bad:?}"
            );
        }
        assert!(ArenaReader::open(w.name(), 1).is_err());
    }
}
