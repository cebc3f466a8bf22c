//! The store's segment: its header, the published state readers check handles against
//! (a seqlock), the signing secret, the pin hint and the counting window, and byte-level
//! access to the blocks in its ring. Any process that maps the segment uses this; the
//! allocator is the writer's ([`super::fifo`]).

use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::error::{Error, HandleRefusal, Result};
use shmq_os::liveness::{Liveness, LockProbe};
use shmq_os::pins::Pins;
use shmq_os::private_map::PrivateFile;
use shmq_os::process::ProcessId;
use shmq_os::segment::{HeaderCheck, Segment};
use shmq_protocol::alloc::{Block, FifoAllocator, HEADER_BYTES, ID_MAX};
use shmq_protocol::read_count::{CountingWindow, PinHint, ReadCount};
use shmq_protocol::seqlock;
use shmq_protocol::seqlock::SeqWord;
use shmq_protocol::sync::local::{AtomicU64 as LocalU64, Ordering};
use shmq_protocol::word::{FieldU8, FieldU32, FieldU64, PublishedU64, StatU64};

/// "SHMQSTO3" little-endian: marks a finished object-store segment.
pub const STORE_MAGIC: u64 = u64::from_le_bytes(*b"SHMQSTO3");
/// 3: an object's count is a tagged 8-byte word (see `StoreSegment::count_word`); 5:
/// reader slots in the header page, and an object's frame carries one count word per
/// reader slot (see `super::readers`).
pub const STORE_LAYOUT_VERSION: u32 = 5;
/// The ring starts one page into the segment.
pub(super) const RING_OFFSET: usize = 4096;
const PUBLISHED_OFFSET: usize = 64;
const SECRET_OFFSET: usize = 128;
/// Where the count of zero-copy gets still holding a pin is (see `StoreSegment::pin_hint`).
const PIN_HINT_OFFSET: usize = 192;
/// Where the count of readers about to count a read is (see `StoreSegment::counting`):
/// its own cache line, apart from the pin hint (both are written by readers).
const COUNTING_OFFSET: usize = 256;
/// The writer's statistics (objects put, blocks freed): after the header, in its line.
const WRITER_STATS_OFFSET: usize = 32;
/// The readers' statistic (counted gets), in a cache line of its own.
const GETS_OFFSET: usize = 320;
/// Where the reader slots are (see `super::readers`): after the counters, to the end of
/// the header page.
pub(super) const READER_SLOTS_OFFSET: usize = 1024;
/// Bytes of one reader slot.
pub(super) const READER_SLOT_BYTES: usize = 32;
/// How many reader slots the header page holds: readers beyond them (a store of more
/// `n_readers`, or more processes opening it than it has readers) count anonymously.
/// Below 256: an object's frame says how many count words of slots it has in one byte.
pub const MAX_READER_SLOTS: usize = (RING_OFFSET - READER_SLOTS_OFFSET) / READER_SLOT_BYTES;
/// How long the writer waits for readers in the middle of counting a read (they are
/// there for nanoseconds; only one that died there makes it wait this long).
const COUNTING_PATIENCE: Duration = Duration::from_millis(10);
/// Bytes of the handle-signing secret (vLLM's `AUTH_SECRET_BYTES`).
pub const SECRET_BYTES: usize = 32;
/// Bytes of a handle signature (one SHA-256 digest).
pub const SIGNATURE_BYTES: usize = 32;
/// Stored in the header of a freed block: never a valid id (ids are below 2**31).
pub(super) const INVALID_ID: u32 = u32::MAX;
/// Bytes of an object's reader count, as vLLM 0.33 measures an object (its flag bytes):
/// what `put` adds to the parts' sizes before comparing with `max_object_size`.
pub const COUNT_BYTES: usize = 4;
/// Bytes of the word that holds an object's count in its block: the count (low half) and
/// a tag of the object's id (high half), 8-aligned (see `StoreSegment::count_word`).
pub(super) const COUNT_WORD_BYTES: u64 = 8;

/// Bits of an object's frame word that count its parts (the rest, above, count its
/// reader words: see [`frame_word`]).
pub(super) const PART_BITS: u32 = 24;
/// Most parts an object may have.
pub const MAX_PARTS: usize = (1 << PART_BITS) - 1;

/// The frame word of an object (the u32 after its count word): its number of parts in the
/// low [`PART_BITS`] bits, its number of reader words (count words of reader slots, see
/// `super::readers`) in the high 8. An object of a store of one reader has none, and its
/// frame is the layout of version 4: `[count word][n][n × (offset, len)]`.
pub(super) fn frame_word(parts: usize, slots: usize) -> u32 {
    debug_assert!(parts <= MAX_PARTS && slots <= MAX_READER_SLOTS);
    parts as u32 | (slots as u32) << PART_BITS
}
/// The number of parts a frame word says.
pub(super) fn frame_parts(word: u32) -> usize {
    (word & ((1 << PART_BITS) - 1)) as usize
}
/// The number of reader words a frame word says.
pub(super) fn frame_slots(word: u32) -> usize {
    (word >> PART_BITS) as usize
}
/// From an object's count word: where the count word of reader slot `s` is (after the
/// frame word and 4 bytes of padding, so 8-aligned like the count word).
pub(super) fn reader_word_offset(s: usize) -> u64 {
    COUNT_WORD_BYTES + 8 + 8 * s as u64
}
/// From an object's count word: where its part table starts, with `slots` reader words.
pub(super) fn part_table_offset(slots: usize) -> u64 {
    if slots == 0 {
        COUNT_WORD_BYTES + 4
    } else {
        reader_word_offset(slots)
    }
}

/// Where an object's count word is, from the start of its block's data at ring offset
/// `data_offset`: the first multiple of 8 (the ring starts page-aligned, so ring offsets
/// and addresses agree on alignment).
pub(super) fn count_word_at(data_offset: u64) -> u64 {
    (COUNT_WORD_BYTES - data_offset % COUNT_WORD_BYTES) % COUNT_WORD_BYTES
}
/// Parts of an object from `align_from` on start at multiples of this (ring offset).
pub const PART_ALIGN: u64 = 64;
/// How long a reader waits for a consistent view of the published state before it
/// gives up (only a writer that died in the middle of an update can make it wait).
const SNAPSHOT_PATIENCE: Duration = Duration::from_secs(1);

/// The handle-signing key, ready to sign (HMAC-SHA256 keyed once).
type Signer = Hmac<Sha256>;

#[repr(C)]
pub(super) struct StoreHeader {
    magic: PublishedU64,
    version: u32,
    creator_pid: u32,
    pub(super) capacity: u64,
    creator_start_time: u64,
}
const _: () = assert!(std::mem::size_of::<StoreHeader>() <= PUBLISHED_OFFSET);

/// What readers check handles against (see the module docs), in its own cache line.
/// `seq` is a seqlock: odd while the writer updates the fields below it.
#[repr(C, align(64))]
pub(super) struct Published {
    seq: SeqWord,
    pub(super) id_start: FieldU32,
    pub(super) id_end: FieldU32,
    pub(super) cleared_start: FieldU32,
    pub(super) cleared_end: FieldU32,
    pub(super) overwritten: FieldU64,
    /// Statistics for `inspect` (outside the seqlock: they order nothing).
    live_blocks: StatU64,
    live_bytes: StatU64,
}
const _: () = assert!(std::mem::size_of::<Published>() == 64);
const _: () = assert!(PUBLISHED_OFFSET + 64 <= SECRET_OFFSET);
const _: () = assert!(SECRET_OFFSET + SECRET_BYTES <= PIN_HINT_OFFSET);
const _: () = assert!(PIN_HINT_OFFSET + 64 <= COUNTING_OFFSET); // another cache line
const _: () = assert!(COUNTING_OFFSET + 8 <= RING_OFFSET);
const _: () = assert!(std::mem::size_of::<StoreHeader>() <= WRITER_STATS_OFFSET);
const _: () = assert!(WRITER_STATS_OFFSET + 16 <= PUBLISHED_OFFSET);
const _: () = assert!(GETS_OFFSET >= COUNTING_OFFSET + 64 && GETS_OFFSET + 8 <= RING_OFFSET);
const _: () = assert!(GETS_OFFSET + 64 <= READER_SLOTS_OFFSET && READER_SLOTS_OFFSET % 64 == 0);
const _: () = assert!(MAX_READER_SLOTS < 256);

/// A store's metrics (see [`StoreSegment::stats`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreStats {
    /// Objects put (blocks allocated) and freed (evicted to make room, or cleared).
    pub puts: u64,
    pub evictions: u64,
    /// Reads counted by readers (`get`s).
    pub gets: u64,
    /// Zero-copy gets still holding their objects' memory, in every process.
    pub views_held: u64,
}

/// One consistent reading of [`Published`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Snapshot {
    pub(super) id_start: u32,
    pub(super) id_end: u32,
    pub(super) cleared_start: u32,
    pub(super) cleared_end: u32,
    pub(super) overwritten: u64,
}

/// Whether `id` is in `[start, end)` on the ids' circle (they wrap at 2**31).
pub(super) fn id_in(id: u32, start: u32, end: u32) -> bool {
    id < ID_MAX && id.wrapping_sub(start) % ID_MAX < end.wrapping_sub(start) % ID_MAX
}

impl Snapshot {
    /// Whether a block with this id at this ring offset may still hold its object.
    pub(super) fn names(&self, id: u32, offset: u64) -> bool {
        id_in(id, self.id_start, self.id_end)
            || (id_in(id, self.cleared_start, self.cleared_end) && offset >= self.overwritten)
    }
}

/// The store's occupancy as its writer last published it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreOccupancy {
    pub live_blocks: u64,
    /// Bytes from the oldest live block to the end of the newest.
    pub live_bytes: u64,
    pub id_start: u32,
    pub id_end: u32,
}

/// A mapped store segment: the part of the ring every process can use (no allocator).
pub struct StoreSegment {
    pub(super) segment: Segment,
    pub(super) ring: NonNull<u8>,
    pub(super) capacity: u64,
    signer: Signer,
    /// Mixed into the id tag of every count word (derived from the secret, so the same in
    /// every process of the segment; see `count_tag`).
    count_salt: u32,
    /// Writer: announcements in `counting` taken as left by dead readers (see
    /// `wait_for_counting_readers`). Process-local.
    counting_floor: LocalU64,
    /// Writer: how many waits for counting readers ran out of patience (process-local).
    patience_spent: LocalU64,
    /// This process's pins of blocks it has zero-copy views of (see [`BlockPin`](super::object::BlockPin)).
    pub(super) pins: Arc<Pins>,
    /// The writer's probe of every process's pins (`None` on readers).
    pub(super) probe: Option<LockProbe>,
    /// A read-only descriptor to map object parts privately (opened at the first view).
    pub(super) private: OnceLock<PrivateFile>,
}

// SAFETY: `ring` points into `segment`'s mapping, alive as long as `self`. Shared state
// in it is reached through atomics (headers, published state, reader counts) or, for
// payload bytes, only by the single writer before it publishes a block and by readers
// after; see the module docs for how a reader detects a block reused under it.
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

/// A block found at an address: its ring offset, id and size (header included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHeader {
    pub offset: u64,
    pub id: u32,
    pub size: u32,
}

/// The salt of the count words' id tags: from the secret, domain-separated from the
/// handle signatures (it is readable in the ring; the secret's other uses need no more).
fn count_salt(secret: &[u8; SECRET_BYTES]) -> u32 {
    let digest = Sha256::new()
        .chain_update(b"shmq store count tag")
        .chain_update(secret)
        .finalize();
    u32::from_le_bytes(
        digest[..4]
            .try_into()
            .expect("a SHA-256 digest has 32 bytes"),
    )
}

impl StoreSegment {
    pub(super) fn create(name: &str, capacity: u64) -> Result<StoreSegment> {
        let total = usize::try_from(capacity)
            .ok()
            .and_then(|c| c.checked_add(RING_OFFSET))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("data_buffer_size {capacity} is too large"))
            })?;
        let secret = shmq_os::random::random_bytes::<SECRET_BYTES>("the store's signing secret")?;
        // Sparse: the first page now, the ring as it is used (see `super::fifo`).
        let segment = Segment::create_sparse(name, total, RING_OFFSET)?;
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
        // Probe opened now, while the name surely is this segment's.
        let s = StoreSegment::mapped(
            name,
            segment,
            capacity,
            &secret,
            Some(LockProbe::open(name)),
        );
        // Release: pairs with the Acquire load in `open`: the header fields and the
        // secret are visible to an opener that sees the magic.
        s.header().magic.publish(STORE_MAGIC);
        Ok(s)
    }

    pub(super) fn open(name: &str) -> Result<StoreSegment> {
        let segment = Segment::open(name)?;
        let check = HeaderCheck {
            min_len: RING_OFFSET,
            magic: STORE_MAGIC,
            version: STORE_LAYOUT_VERSION,
            not_this_kind: "it is not a shmq object store of this version (or its creator has \
                            not finished setting it up)",
        };
        // SAFETY: the mapping is page-aligned and at least RING_OFFSET bytes long, which
        // covers the header; StoreHeader is repr(C) plain integers and an atomic (any bit
        // pattern is valid). The header's plain fields are written once, before the magic,
        // and never again; a peer that scribbles on them can only make this open fail or
        // mis-size the ring, which the size check below catches. The magic's Acquire load
        // pairs with the Release store in `create`.
        let (base, header) =
            unsafe { segment.checked_header(&check, |h: &StoreHeader| (&h.magic, &h.version)) }?;
        let capacity = header.capacity;
        if (segment.len() - RING_OFFSET) as u64 != capacity || capacity <= HEADER_BYTES {
            return Err(segment.header_mismatch().into());
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
        Ok(StoreSegment::mapped(name, segment, capacity, &secret, None))
    }

    /// The segment `segment` (named `name`, at least `RING_OFFSET + capacity` bytes) with
    /// signing secret `secret`; the writer passes its pin probe.
    fn mapped(
        name: &str,
        segment: Segment,
        capacity: u64,
        secret: &[u8; SECRET_BYTES],
        probe: Option<LockProbe>,
    ) -> StoreSegment {
        debug_assert!(segment.len() as u64 >= RING_OFFSET as u64 + capacity);
        let base = NonNull::new(segment.as_ptr()).expect("mmap never returns null");
        // SAFETY: RING_OFFSET < segment.len() (both callers checked the size).
        let ring = unsafe { NonNull::new_unchecked(base.as_ptr().add(RING_OFFSET)) };
        StoreSegment {
            pins: Arc::new(Pins::new(name)),
            probe,
            private: OnceLock::new(),
            segment,
            ring,
            capacity,
            count_salt: count_salt(secret),
            counting_floor: LocalU64::new(0),
            patience_spent: LocalU64::new(0),
            signer: Signer::new_from_slice(secret).expect("HMAC takes keys of any length"),
        }
    }

    pub(super) fn header(&self) -> &StoreHeader {
        // SAFETY: see `create`/`open`: in bounds and aligned.
        unsafe { &*(self.segment.as_ptr() as *const StoreHeader) }
    }

    pub(super) fn published(&self) -> &Published {
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

    /// An error once a peer truncated the segment under this process (see
    /// `shmq_os::sigbus`): one atomic load, where each read and write begins and ends.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::BadSegment`](crate::error::OsError::BadSegment) once
    /// another process truncated the segment.
    #[inline]
    pub fn check_intact(&self) -> Result<()> {
        Ok(self.segment.check_intact()?)
    }

    /// [`check_intact`](Self::check_intact), and an error too if the file is shorter
    /// than the mapping now (an `fstat` on the writer): for calls that touch no page of
    /// the ring and would otherwise not notice (`put` before it writes, `is_cached`).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::BadSegment`](crate::error::OsError::BadSegment) once
    /// the segment was truncated (seen by a fault, or its file is shorter now).
    pub fn check_length(&self) -> Result<()> {
        Ok(self.segment.check_length()?)
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

    fn stat_word(&self, offset: usize) -> &StatU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= RING_OFFSET);
        // SAFETY: WRITER_STATS_OFFSET.. and GETS_OFFSET.. lie below RING_OFFSET (checked
        // at compile time), inside the mapping and 8-aligned (it is page-aligned); only
        // accessed atomically. A peer that writes them changes what is reported, nothing
        // else.
        unsafe { &*(self.segment.as_ptr().add(offset) as *const StatU64) }
    }

    /// Writer: `n` more objects put (`evicted`: freed).
    pub(super) fn count_writes(&self, put: u64, evicted: u64) {
        for (offset, n) in [
            (WRITER_STATS_OFFSET, put),
            (WRITER_STATS_OFFSET + 8, evicted),
        ] {
            if n > 0 {
                let w = self.stat_word(offset);
                // Relaxed: a statistic written by the writer alone (a load and a store
                // are no lost update); read by others for reports only.
                w.add_own(n);
            }
        }
    }

    /// Any process: one more read counted.
    pub(super) fn count_get(&self) {
        // Relaxed: a statistic; several readers add to it, so an atomic add.
        self.stat_word(GETS_OFFSET).add(1);
    }

    /// Puts, evictions, gets and views held, as they are now.
    pub fn stats(&self) -> StoreStats {
        // Relaxed: statistics; the values may be from slightly different moments.
        StoreStats {
            puts: self.stat_word(WRITER_STATS_OFFSET).get(),
            evictions: self.stat_word(WRITER_STATS_OFFSET + 8).get(),
            gets: self.stat_word(GETS_OFFSET).get(),
            views_held: self.pin_hint().held(),
        }
    }

    /// Occupancy as the writer last published it (for inspection).
    pub fn occupancy(&self) -> StoreOccupancy {
        let p = self.published();
        let ids = self.snapshot().unwrap_or_default();
        // Relaxed: statistics; the values may be from slightly different moments.
        StoreOccupancy {
            live_blocks: p.live_blocks.get(),
            live_bytes: p.live_bytes.get(),
            id_start: ids.id_start,
            id_end: ids.id_end,
        }
    }

    /// A consistent reading of the published state; `None` if the writer stays in the
    /// middle of an update (it died there, or a peer wrote garbage into `seq`).
    pub(super) fn snapshot(&self) -> Option<Snapshot> {
        let p = self.published();
        // Read the clock only once the first attempts have failed: it costs more than a
        // consistent read.
        let mut started = None;
        for attempt in 0u32.. {
            // The seqlock's read side (see `shmq_protocol::seqlock` for the orderings).
            let snap = seqlock::read(&p.seq, || {
                // Relaxed: ordered by the seqlock's Acquire load and fence.
                Snapshot {
                    id_start: p.id_start.get(),
                    id_end: p.id_end.get(),
                    cleared_start: p.cleared_start.get(),
                    cleared_end: p.cleared_end.get(),
                    overwritten: p.overwritten.get(),
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
    pub(super) fn publish(&self, update: impl FnOnce(&Published)) {
        let p = self.published();
        // The seqlock's write side (only the writer, under the store's lock, calls this);
        // its closing Release fence orders the update before every later write of the
        // writer (into blocks it concerns), for readers that check it again after reading.
        seqlock::write(&p.seq, || update(p));
    }

    /// Writer only: publish the allocator's state and occupancy.
    pub(super) fn publish_ids(&self, a: &FifoAllocator) {
        self.publish(|p| {
            // Relaxed: inside the seqlock (see `publish`).
            p.id_start.set(a.id_start());
            p.id_end.set(a.id_end());
        });
        let p = self.published();
        // Relaxed: statistics for inspection; nothing is ordered by them.
        p.live_blocks.set(a.live().len() as u64);
        p.live_bytes.set(a.live_bytes());
    }

    /// Remove the segment's name now (see `Segment::unlink`).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the file cannot be removed for another reason than being gone
    /// already.
    pub fn unlink(&self) -> Result<()> {
        Ok(self.segment.unlink()?)
    }

    /// Where the ring starts in this process.
    pub fn ring_ptr(&self) -> *mut u8 {
        self.ring.as_ptr()
    }

    /// Start and length of the whole ring in this process (what Python's
    /// `RingBuffer.shared_memory.buf` shows), all of the segment reserved in `/dev/shm`
    /// first (once per process), so that touching any byte cannot fault (`OsError::NoSpace`
    /// when there is no room). The writer otherwise reserves only as far as it allocated.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::NoSpace`](crate::error::OsError::NoSpace) when
    /// `/dev/shm` has no room for the whole segment.
    pub fn ring_bytes(&self) -> Result<(*mut u8, usize)> {
        self.segment.reserve_whole()?;
        Ok((self.ring.as_ptr(), self.capacity as usize))
    }

    /// The byte at ring offset `offset`, as an atomic.
    pub(super) fn byte(&self, offset: u64) -> &FieldU8 {
        debug_assert!(offset < self.capacity);
        // SAFETY: callers pass an offset inside the ring. AtomicU8 has alignment 1. Any
        // process mapping the segment may write this byte at any time; an atomic access
        // makes that a race on values (which the callers check), not undefined behaviour.
        unsafe { &*(self.ring.as_ptr().add(offset as usize) as *const FieldU8) }
    }

    /// Load the u32 at ring offset `offset` (any alignment) byte by byte, Relaxed.
    pub(super) fn load_u32(&self, offset: u64) -> u32 {
        debug_assert!(offset + 4 <= self.capacity);
        // Relaxed: callers order these loads (by a snapshot before, a fence after).
        u32::from_le_bytes(std::array::from_fn(|i| self.byte(offset + i as u64).get()))
    }

    /// Store `value` at ring offset `offset` (any alignment) byte by byte, Relaxed.
    pub(super) fn store_u32(&self, offset: u64, value: u32) {
        debug_assert!(offset + 4 <= self.capacity);
        for (i, b) in value.to_le_bytes().into_iter().enumerate() {
            // Relaxed: published by the writer's next `publish` (Release).
            self.byte(offset + i as u64).set(b);
        }
    }

    /// The count word of an object, at ring offset `offset` (8-aligned): its reader
    /// count in the low 32 bits, [`Self::count_tag`] of its id in the high 32. A reader
    /// increments it only while the tag is its object's (a compare-exchange), so a reader
    /// that was stalled past the writer's reuse of the block (see `read_header`) does not
    /// write into the next object: the bytes there would have to equal the old tag and
    /// count, all 8 of them.
    pub(super) fn count_word(&self, offset: u64) -> &ReadCount {
        assert!(offset % COUNT_WORD_BYTES == 0 && offset + COUNT_WORD_BYTES <= self.capacity);
        // SAFETY: checked just above: 8-aligned (the ring start is page-aligned) and
        // inside the ring; a `ReadCount` is one `AtomicU64` (repr(transparent)). shmq
        // touches count words only atomically; a peer (or a Python
        // view from `access_buf`) could write one non-atomically, which changes the count
        // or the tag, and so only when the object is evicted (or that a read is not
        // counted), never what memory is read.
        unsafe { &*(self.ring.as_ptr().add(offset as usize) as *const ReadCount) }
    }

    /// The tag of object `id` in its count word: the id mixed with a salt of this
    /// segment, so that data which merely holds small integers (a following object's
    /// bytes) does not look like a count word.
    pub(super) fn count_tag(&self, id: u32) -> u32 {
        id ^ self.count_salt
    }

    /// The count word of the object in block `h`.
    pub(super) fn count_word_of(&self, h: &BlockHeader) -> &ReadCount {
        let data = h.offset + HEADER_BYTES;
        self.count_word(data + count_word_at(data))
    }

    /// A fresh object's count word in block `h`, and its `slots` reader words after the
    /// frame word: its tag, count 0 (writer, before the handle is handed out:
    /// `ReadCount::reset`). The block must be sized for them (`object_layout` with
    /// `slots`); the frame word is the caller's.
    pub(super) fn init_counts(&self, h: &BlockHeader, slots: usize) {
        let tag = self.count_tag(h.id);
        self.count_word_of(h).reset(tag);
        let data = h.offset + HEADER_BYTES;
        let count_at = data + count_word_at(data);
        for s in 0..slots {
            self.count_word(count_at + reader_word_offset(s)).reset(tag);
        }
    }

    /// The count word of reader slot `s` in the object of block `h`, if its frame gives
    /// that slot one (`super::readers`); `None` if it does not (that reader counts in the
    /// object's count word), or if the frame does not fit the block (reused meanwhile, or
    /// written by a peer: then no word of the block's is touched). The word found may
    /// still be another object's by now: its tag says (`count_one_read`).
    pub(super) fn reader_word_of(&self, h: &BlockHeader, s: usize) -> Option<&ReadCount> {
        let data = h.offset + HEADER_BYTES;
        let count_at = data + count_word_at(data);
        let end = h.offset.checked_add(h.size as u64)?.min(self.capacity);
        if count_at + COUNT_WORD_BYTES + 4 > end {
            return None;
        }
        if s >= frame_slots(self.load_u32(count_at + COUNT_WORD_BYTES)) {
            return None;
        }
        let at = count_at + reader_word_offset(s);
        // Inside the block, so inside the ring, and 8-aligned as the count word is.
        (at + COUNT_WORD_BYTES <= end).then(|| self.count_word(at))
    }

    /// Write the header of a freshly allocated block (writer only; published after).
    pub(super) fn write_header(&self, block: &Block) {
        let offset = block.offset(self.capacity);
        self.store_u32(offset + 4, block.size);
        self.store_u32(offset, block.id);
    }

    /// The header at `address`, checked to describe a block inside the ring.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when no block can be at `address`: its header would reach
    /// past the ring, or the size it holds is below a header's or reaches past the ring.
    pub fn header_at(&self, address: u64) -> Result<BlockHeader> {
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
        Ok(BlockHeader { offset, id, size })
    }

    /// Start and length of a block's data (after the 8-byte header). Panics if `h` does
    /// not lie inside the ring (headers from `header_at` and the allocator always do; a
    /// `BlockHeader` made up by hand may not).
    pub fn data_ptr(&self, h: &BlockHeader) -> (*mut u8, usize) {
        assert!(
            h.size as u64 >= HEADER_BYTES
                && h.offset
                    .checked_add(h.size as u64)
                    .is_some_and(|end| end <= self.capacity),
            "chunk header {h:?} lies outside the ring"
        );
        // SAFETY: checked just above: offset + size <= capacity, so the data lies inside
        // the ring's mapping.
        let p = unsafe { self.ring.as_ptr().add((h.offset + HEADER_BYTES) as usize) };
        (p, h.size as usize - HEADER_BYTES as usize)
    }

    /// The data of the live block `c` (after its header), from the allocator (panics if
    /// it does not lie inside the ring, see [`data_ptr`](Self::data_ptr)). Only the
    /// writer writes blocks, and only before it publishes them or after it frees them: a
    /// caller that keeps the bytes past the block's life sees whatever is written there
    /// next, never memory outside the ring.
    pub fn block_data(&self, c: &Block) -> &[u8] {
        let (p, n) = self.data_ptr(&BlockHeader {
            offset: c.offset(self.capacity),
            id: c.id,
            size: c.size,
        });
        // SAFETY: `data_ptr` checked the span lies inside the ring, which stays mapped
        // as long as `self`; ring bytes are plain memory that any process may read.
        unsafe { std::slice::from_raw_parts(p, n) }
    }

    /// How many zero-copy gets hold a pin (or are taking one) in any process: while it
    /// is 0 the writer need not probe for pins. A reader that dies keeps it above 0,
    /// which only makes the writer probe.
    pub(super) fn pin_hint(&self) -> &PinHint {
        // SAFETY: PIN_HINT_OFFSET + 8 <= RING_OFFSET (checked at compile time): inside the
        // mapping and 8-aligned (it is page-aligned); a `PinHint` is one `AtomicU64`
        // (repr(transparent)). A peer that writes it can make the
        // writer probe needlessly, or (set to 0 under a live view) reuse memory a view
        // still shows: what any process that may write the segment can do anyway.
        unsafe { &*(self.segment.as_ptr().add(PIN_HINT_OFFSET) as *const PinHint) }
    }

    /// How many readers are between their last check of an object and the increment of
    /// its count (see `read_header`): the writer reuses freed memory only once none is.
    pub(super) fn counting(&self) -> &CountingWindow {
        // SAFETY: COUNTING_OFFSET + 8 <= RING_OFFSET (checked at compile time): inside the
        // mapping and 8-aligned; a `CountingWindow` is one `AtomicU64` (repr(transparent)). A peer that writes it can make the writer wait (up to
        // COUNTING_PATIENCE each time it raises it) or not wait: what any process that may
        // write the segment can do to the objects themselves anyway.
        unsafe { &*(self.segment.as_ptr().add(COUNTING_OFFSET) as *const CountingWindow) }
    }

    /// Writer, after publishing that blocks are freed: wait until no reader can still
    /// increment a count inside them (see `read_header`), so they can be reused.
    ///
    /// A reader killed inside its counting window leaves its announcement in `counting`
    /// for good. So after one full `COUNTING_PATIENCE`, what is still announced is taken
    /// as left by the dead (the floor), and later waits are for announcements above it:
    /// one dead reader costs one patience, not one per batch of frees. A live reader
    /// hidden under the floor was stalled past a patience already; its count word's tag
    /// keeps its increment out of reused memory (`count_one_read`). The floor comes down
    /// whenever `counting` is seen below it (those readers were alive after all).
    pub(super) fn wait_for_counting_readers(&self) {
        // The fence and the loads that pair with the readers' window:
        // `shmq_protocol::read_count::CountingWindow::wait`.
        // Relaxed: only this process (the writer, under its store lock) uses the floor.
        let floor = self.counting_floor.load(Ordering::Relaxed);
        let mut started = None;
        let mut attempt = 0u32;
        self.counting().wait(|now| {
            attempt += 1;
            if now <= floor {
                if now < floor {
                    // Relaxed: as the load of the floor above.
                    self.counting_floor.store(now, Ordering::Relaxed);
                }
                return true;
            }
            if attempt <= 64 {
                std::hint::spin_loop();
            } else if started.get_or_insert_with(Instant::now).elapsed() > COUNTING_PATIENCE {
                // A reader died there (its increment will never come) or is stalled: its
                // count word no longer carries its object's tag once the block is reused,
                // so its increment finds nothing to count (`count_one_read`). Relaxed
                // (both): process-local, used only by the writer under its store lock.
                self.counting_floor.store(now, Ordering::Relaxed);
                self.patience_spent.fetch_add(1, Ordering::Relaxed);
                return true;
            } else {
                std::thread::yield_now();
            }
            false
        });
    }

    /// The writer's floor of `counting`, and how many of its waits ran out of patience
    /// (see `wait_for_counting_readers`).
    #[cfg(test)]
    pub(super) fn counting_floor(&self) -> (u64, u64) {
        // Relaxed: read by the writer's own thread (a test).
        (
            self.counting_floor.load(Ordering::Relaxed),
            self.patience_spent.load(Ordering::Relaxed),
        )
    }

    /// Writer: whether some process may hold a zero-copy view of the block with id `id`. Call it after marking the block as no longer its object (its header
    /// stamped, or the clear published): see `pins` module for why a view cannot be
    /// missed then. A probe that cannot tell answers "pinned" (the memory is kept).
    pub(super) fn is_pinned(&self, id: u32) -> bool {
        // The writer's half of the handshake with `pin_block` (`PinHint::may_be_held`):
        // either it sees the reader's hold or the reader's check sees our mark.
        if !self.pin_hint().may_be_held() {
            return false;
        }
        self.probe
            .as_ref()
            .is_none_or(|p| p.liveness(pin_byte(id)) != Liveness::Dead)
    }

    /// The read-only descriptor that object parts are mapped privately from.
    pub(super) fn private_file(&self) -> Result<&PrivateFile> {
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
    ///
    /// # Errors
    ///
    /// [`Error::Store`] with
    /// [`StoreError::BadSignature`](crate::error::StoreError::BadSignature)
    /// ([`HandleRefusal::Mismatch`]) when `signature` is not the store's for `key` at
    /// `(address, id)`.
    pub fn verify(&self, key: &str, address: u64, id: u32, signature: &[u8]) -> Result<()> {
        self.keyed_mac(key, address, id)
            .verify_slice(signature)
            .map_err(|_| HandleRefusal::Mismatch { address, id }.into())
    }
}

/// Where the bytes whose read locks pin blocks start: far beyond any segment's end (a
/// lock may lie past the end of the file), clear of every other lock on it (byte 0 is
/// the creator's role lock).
const PIN_BYTES_FROM: u64 = 1 << 48;

/// The byte of the segment's file whose read locks pin the block with id `id`. By id, not
/// by place: objects are made and read in id order, so the pins a process holds are mostly
/// runs of neighbouring bytes, which the kernel keeps as one lock each. Its lock list is
/// walked on every lock call, so one entry per pin made a get slow down as views piled
/// up (issue 18; measured in `docs/performance.md`, "Figures quoted elsewhere"). Blocks alive at the same time never share an id.
pub(super) fn pin_byte(id: u32) -> u64 {
    PIN_BYTES_FROM + id as u64
}
