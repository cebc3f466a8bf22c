//! The producer segment: what lives where, the `#[repr(C)]` records, and the checks an
//! opener makes before it trusts any of it.
//!
//! ```text
//! 0                 Header: geometry, creator; `magic` stored last with Release
//!   +64               state (open / closed / superseded), index epoch, clock
//!   +128              the doorbell consumers ring after an acknowledgement or unpin
//!   +192              statistics
//! 256               max_consumers ConsumerSlots of 64 bytes
//! index_offset      index_slots IndexSlots of 192 bytes (see `key_index`)
//! entries_offset    max_entries entry records of entry_stride bytes (multiple of 64):
//!                     +0 state: u64 (generation << 2 | FREE/WRITING/READY/RETIRED)
//!                     +8 offset: u64  +16 len: u64  (in the data region)
//!                     +24 published_at: u64 (the clock when it became READY)
//!                     +32 acks: u64 (bit s: consumer slot s loaded this generation)
//!                     +48 pins: [u32; max_consumers] (views each consumer holds)
//! data_offset       `capacity` bytes of entry data, page-aligned, reserved lazily
//! ```
//! Everything but the data region is reserved when the segment is made; the data region
//! is reserved (`fallocate`) as entries need it, and given back in part when
//! `/dev/shm` runs out (see `backing`), so a full `/dev/shm` is an error at `save`,
//! never a `SIGBUS`.

use std::ptr::NonNull;

use crate::error::{Error, Result};
use shmq_os::private_map::page_size;
use shmq_os::process::ProcessId;
use shmq_os::segment::{HeaderCheck, Segment, data_after_table, round_up};
use shmq_protocol::consumer_slot::JoinClock;
use shmq_protocol::doorbell::DoorbellWords;
use shmq_protocol::entry::{EntryAcks, EntryPin, EntryState};
use shmq_protocol::key_index::IndexEpoch;
use shmq_protocol::word::{FieldU64, PublishedU32, PublishedU64, StatU64};

use shmq_protocol::key_index::{IndexSlot, KeyIndex, SLOT_BYTES};

/// "SHMQENC1" little-endian: marks a finished encoder-cache segment.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SHMQENC1");
/// Bumped whenever the layout (or the key hash) changes; openers refuse other versions.
pub const LAYOUT_VERSION: u32 = 1;
/// Segments of encoder caches are named `shmq_ec_<name>`.
pub const SEGMENT_PREFIX: &str = "shmq_ec_";
/// At most this many consumers per producer (one bit each in an entry's `acks`).
pub const MAX_CONSUMERS: usize = 64;
/// At most this many entries per producer.
pub const MAX_ENTRIES: usize = 1 << 20;

pub(crate) const HEADER_BYTES: usize = 256;
const CONSUMER_SLOT_BYTES: usize = shmq_protocol::consumer_slot::SLOT_BYTES;
const ENTRY_PINS_OFFSET: usize = 48;

/// Types that live in a shared segment: `#[repr(C)]`, no pointers, every field either
/// immutable after the segment is published or an atomic, valid for any bit pattern a
/// peer process could leave there (so a corrupted segment is wrong data, never UB).
///
/// # Safety
/// Implement only for types that are all of the above.
pub(crate) unsafe trait InSharedMemory: Sized {}

/// The header at offset 0.
#[repr(C)]
pub(crate) struct Header {
    pub magic: PublishedU64,
    pub version: u32,
    pub page_size: u32,
    pub max_entries: u32,
    pub max_consumers: u32,
    pub creator_pid: u32,
    _pad0: u32,
    pub creator_start_time: u64,
    pub capacity: u64,
    pub data_offset: u64,
    _pad1: u64,
    // +64: what changes while the segment is in use.
    /// [`STATE_OPEN`], [`STATE_CLOSED`] or [`STATE_SUPERSEDED`].
    pub state: PublishedU32,
    /// The key index's rebuild seqlock (see `key_index`).
    pub index_epoch: IndexEpoch,
    /// Orders consumer joins against entry publications (see `slots`).
    pub clock: JoinClock,
    _pad2: [u64; 6],
    // +128: the doorbell the producer sleeps on while it waits for consumers.
    pub bell: DoorbellWords,
    // +192: statistics (Relaxed; for inspection only).
    pub stat_entries: StatU64,
    pub stat_bytes: StatU64,
    pub stat_reserved: StatU64,
    pub stat_saves: StatU64,
    pub stat_evictions: StatU64,
    /// Saves and waits for loads that had to wait (for room, or for consumers), and
    /// their total time in ns.
    pub stat_waits: StatU64,
    pub stat_wait_ns: StatU64,
    _pad4: u64,
}
const _: () = assert!(std::mem::size_of::<Header>() == HEADER_BYTES);
const _: () = assert!(std::mem::align_of::<Header>() == 64);
// SAFETY: repr(C), integers and atomics only; a peer can only make the values wrong,
// and every opener validates the geometry it derives from them.
unsafe impl InSharedMemory for Header {}

pub(crate) const STATE_OPEN: u32 = 1;
pub(crate) const STATE_CLOSED: u32 = 2;
pub(crate) const STATE_SUPERSEDED: u32 = 3;

/// One consumer slot (see `slots`; the protocol on its word is
/// [`shmq_protocol::consumer_slot`]).
pub(crate) use shmq_protocol::consumer_slot::ConsumerSlot;
const _: () = assert!(std::mem::size_of::<ConsumerSlot>() == CONSUMER_SLOT_BYTES);
// SAFETY: repr(C), atomics and padding integers only (see `consumer_slot`): any bit
// pattern a peer leaves is a valid slot.
unsafe impl InSharedMemory for ConsumerSlot {}

/// The fixed part of an entry record; `max_consumers` pin counts (u32) follow at +48.
#[repr(C)]
pub(crate) struct EntryRecord {
    /// `generation << 2 | state` (see `entries`, [`shmq_protocol::entry`]).
    pub state: EntryState,
    /// Published by `state` (READY).
    pub offset: FieldU64,
    pub len: FieldU64,
    pub published_at: FieldU64,
    /// Which consumer slots loaded this generation ([`shmq_protocol::entry`]).
    pub acks: EntryAcks,
    _pad: u64,
}
const _: () = assert!(std::mem::size_of::<EntryRecord>() == ENTRY_PINS_OFFSET);
// SAFETY: repr(C), atomics only.
unsafe impl InSharedMemory for EntryRecord {}
// SAFETY: repr(C) (see key_index), atomics only.
unsafe impl InSharedMemory for IndexSlot {}
// SAFETY: one atomic (a pin count, repr(transparent)): any bit pattern is a count.
unsafe impl InSharedMemory for EntryPin {}

/// Sizes and offsets derived from a segment's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub max_entries: usize,
    pub max_consumers: usize,
    pub index_slots: usize,
    pub entry_stride: usize,
    pub page_size: usize,
    pub index_offset: usize,
    pub entries_offset: usize,
    pub data_offset: usize,
    /// Bytes of the data region (whole pages).
    pub capacity: usize,
    pub total: usize,
}

impl Geometry {
    /// The layout of a segment of `capacity` bytes of entries, with room for
    /// `max_entries` entries and `max_consumers` consumers, on pages of `page_size` bytes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the option for an entry or consumer count of 0 or
    /// over the most a segment holds, a page size that is not a power of two of at least
    /// 4096, or a capacity of 0 or too large for a segment.
    pub fn new(
        capacity: usize,
        max_entries: usize,
        max_consumers: usize,
        page_size: usize,
    ) -> Result<Geometry> {
        let bad = |what: String| Error::InvalidArgument(what);
        if max_entries == 0 || max_entries > MAX_ENTRIES {
            return Err(bad(format!(
                "max_entries must be 1..={MAX_ENTRIES}, got {max_entries}"
            )));
        }
        if max_consumers == 0 || max_consumers > MAX_CONSUMERS {
            return Err(bad(format!(
                "max_consumers must be 1..={MAX_CONSUMERS}, got {max_consumers}"
            )));
        }
        if !page_size.is_power_of_two() || page_size < 4096 {
            return Err(bad(format!(
                "page size {page_size} is not a power of two ≥ 4096"
            )));
        }
        if capacity == 0 {
            return Err(bad("an encoder cache needs a capacity above 0 bytes".into()));
        }
        let too_large = || bad(format!("an encoder cache of {capacity} bytes is too large"));
        let capacity = round_up(capacity, page_size).ok_or_else(too_large)?;
        // At most half the slots hold keys, so probes stay short (see `key_index`).
        let index_slots = (2 * max_entries).next_power_of_two().max(8);
        let index_offset = HEADER_BYTES + CONSUMER_SLOT_BYTES * max_consumers;
        let entries_offset = index_offset + SLOT_BYTES * index_slots;
        let entry_stride =
            round_up(ENTRY_PINS_OFFSET + 4 * max_consumers, 64).ok_or_else(too_large)?;
        let (data_offset, total) = data_after_table(
            entries_offset,
            entry_stride,
            max_entries,
            page_size,
            capacity,
        )
        .ok_or_else(too_large)?;
        Ok(Geometry {
            max_entries,
            max_consumers,
            index_slots,
            entry_stride,
            page_size,
            index_offset,
            entries_offset,
            data_offset,
            capacity,
            total,
        })
    }
}

/// `shmq_ec_<name>` for a producer's name; the name may also be given whole.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a name that is empty, longer than 100 bytes, or has other
/// characters than ASCII letters, digits, `-`, `_` and `.`.
pub fn segment_name(name: &str) -> Result<String> {
    let short = name.strip_prefix(SEGMENT_PREFIX).unwrap_or(name);
    if short.is_empty()
        || short.len() > 100
        || !short
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    {
        return Err(Error::InvalidArgument(format!(
            "invalid encoder cache name {name:?}: use 1-100 letters, digits, '-', '_' or '.'"
        )));
    }
    Ok(format!("{SEGMENT_PREFIX}{short}"))
}

/// A producer segment mapped shared (either side), with accessors for its records.
pub(crate) struct Mapped {
    pub segment: Segment,
    base: NonNull<u8>,
    pub geo: Geometry,
}

// SAFETY: `base` points into `segment`'s mapping, which lives as long as `self`. The
// immutable header fields are written before the magic is published and never again;
// every other shared field is an atomic. Data bytes are written only by the producer,
// into ranges of entries no consumer can load (WRITING, or freed after every pin went),
// and consumers never read them through this mapping (they map entries privately).
unsafe impl Send for Mapped {}
// SAFETY: as for Send: `&Mapped` hands out atomics and raw data pointers only.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Map a freshly created `segment` (zero-filled, `geo.total` bytes) and write its
    /// header; the magic is stored last, by [`publish`](Self::publish).
    pub fn init(segment: Segment, geo: Geometry, creator: ProcessId) -> Mapped {
        assert!(segment.len() >= geo.total);
        let base = NonNull::new(segment.as_ptr()).expect("mmap never returns null");
        // SAFETY: the segment is new, page-aligned and larger than the header; other
        // processes do not use it before the magic is stored (they refuse it), so these
        // plain stores race with nothing. Creator fields are written first so that a
        // producer that dies before `publish` leaves a segment whose creator can be
        // judged dead (and the segment replaced).
        unsafe {
            let h = base.as_ptr() as *mut Header;
            (*h).creator_pid = creator.pid;
            (*h).creator_start_time = creator.start_time;
            (*h).version = LAYOUT_VERSION;
            (*h).page_size = geo.page_size as u32;
            (*h).max_entries = geo.max_entries as u32;
            (*h).max_consumers = geo.max_consumers as u32;
            (*h).capacity = geo.capacity as u64;
            (*h).data_offset = geo.data_offset as u64;
        }
        let m = Mapped { segment, base, geo };
        // Relaxed: published by the magic's Release store.
        m.header().state.set_early(STATE_OPEN);
        m
    }

    /// Store the magic: from now on openers accept the segment.
    pub fn publish(&self) {
        // Release: pairs with the Acquire load in `open`: an opener that sees the magic
        // sees the whole header (the tables are zero from the kernel).
        self.header().magic.publish(MAGIC);
    }

    /// Open and validate the segment `segment_name`.
    pub fn open(segment_name: &str) -> Result<Mapped> {
        let segment = Segment::open(segment_name)?;
        Self::validate(segment)
    }

    fn validate(segment: Segment) -> Result<Mapped> {
        let check = HeaderCheck {
            min_len: HEADER_BYTES,
            magic: MAGIC,
            version: LAYOUT_VERSION,
            not_this_kind: "it is not a shmq encoder cache (or its producer has not finished making it)",
        };
        // SAFETY: the mapping is page-aligned and at least HEADER_BYTES long, which covers
        // the header; the header is InSharedMemory (any bit pattern is a valid value). The
        // magic's Acquire load pairs with the Release store in `publish`.
        let (base, header) =
            unsafe { segment.checked_header(&check, |h: &Header| (&h.magic, &h.version)) }?;
        let geo = Geometry::new(
            header.capacity as usize,
            header.max_entries as usize,
            header.max_consumers as usize,
            header.page_size as usize,
        )
        .map_err(|e| segment.bad(format!("its header is invalid ({e})")))?;
        if geo.page_size != page_size()
            || geo.capacity as u64 != header.capacity
            || geo.data_offset as u64 != header.data_offset
            || segment.len() < geo.total
        {
            return Err(segment.header_mismatch().into());
        }
        Ok(Mapped { segment, base, geo })
    }

    /// The creator recorded in the header of `segment` (any segment at least a header
    /// long), whether or not it was finished.
    pub fn creator_of(segment: &Segment) -> Option<ProcessId> {
        if segment.len() < HEADER_BYTES {
            return None;
        }
        // SAFETY: in bounds, aligned, any bit pattern valid (InSharedMemory). Plain reads
        // of fields a live creator wrote before anyone could open it, or that a dead one
        // left; a peer writing them now can only make the answer wrong.
        let h = unsafe { &*(segment.as_ptr() as *const Header) };
        Some(ProcessId {
            pid: h.creator_pid,
            start_time: h.creator_start_time,
        })
    }

    /// Whether `segment` is a finished encoder cache; if so, mark it superseded (its
    /// consumers drop it at their next call).
    pub fn mark_superseded(segment: Segment) -> bool {
        match Self::validate(segment) {
            Ok(m) => {
                // Release: pairs with the Acquire load in `Link::is_current` (nothing
                // else to publish; Release keeps the state's history in order).
                m.header().state.publish(STATE_SUPERSEDED);
                true
            }
            Err(_) => false,
        }
    }

    /// The record of type `T` at byte `offset` of the mapping.
    fn at<T: InSharedMemory>(&self, offset: usize) -> &T {
        assert!(
            offset % std::mem::align_of::<T>() == 0
                && offset + std::mem::size_of::<T>() <= self.geo.total.max(HEADER_BYTES)
        );
        // SAFETY: in bounds of the mapping (asserted; the mapping is at least `total`
        // bytes, checked when it was made or opened) and aligned (asserted; the base is
        // page-aligned). `T: InSharedMemory`, so whatever bytes a peer left there are a
        // valid `T`, and every field a peer may change is an atomic. The reference lives
        // as long as `&self`, which keeps the mapping.
        unsafe { &*(self.base.as_ptr().add(offset) as *const T) }
    }

    pub fn header(&self) -> &Header {
        self.at(0)
    }

    pub fn creator(&self) -> ProcessId {
        let h = self.header();
        ProcessId {
            pid: h.creator_pid,
            start_time: h.creator_start_time,
        }
    }

    pub fn consumer(&self, slot: usize) -> &ConsumerSlot {
        assert!(slot < self.geo.max_consumers);
        self.at(HEADER_BYTES + slot * CONSUMER_SLOT_BYTES)
    }

    pub fn index_slots(&self) -> &[IndexSlot] {
        let _: &IndexSlot = self.at(self.geo.index_offset); // bounds and alignment of the first
        // SAFETY: the index table lies inside the mapping (Geometry::new), 64-aligned;
        // IndexSlot is InSharedMemory, so any bytes there are valid slots. The slice lives
        // as long as `&self` (the mapping).
        unsafe {
            std::slice::from_raw_parts(
                self.base.as_ptr().add(self.geo.index_offset) as *const IndexSlot,
                self.geo.index_slots,
            )
        }
    }

    pub fn index(&self) -> KeyIndex<'_> {
        KeyIndex::new(&self.header().index_epoch, self.index_slots())
    }

    pub fn entry(&self, entry: usize) -> &EntryRecord {
        assert!(entry < self.geo.max_entries);
        self.at(self.geo.entries_offset + entry * self.geo.entry_stride)
    }

    pub fn pin(&self, entry: usize, slot: usize) -> &EntryPin {
        assert!(entry < self.geo.max_entries && slot < self.geo.max_consumers);
        // Inside entry `entry`'s record: the stride covers max_consumers counts after
        // the fixed part (Geometry::new).
        self.at(self.geo.entries_offset
            + entry * self.geo.entry_stride
            + ENTRY_PINS_OFFSET
            + 4 * slot)
    }

    /// The start of the data region in this mapping.
    pub fn data(&self) -> *mut u8 {
        // SAFETY: data_offset < total <= the mapping's length.
        unsafe { self.base.as_ptr().add(self.geo.data_offset) }
    }

    /// The doorbell consumers ring and the producer sleeps on.
    pub fn bell(&self) -> &DoorbellWords {
        &self.header().bell
    }

    /// Wake the producer if it sleeps (after an acknowledgement or an unpin).
    pub fn ring(&self) {
        self.bell().doorbell().ring();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_aligned_and_bounded() {
        let g = Geometry::new(10_000, 100, 3, 4096).unwrap();
        assert_eq!(g.capacity, 12_288);
        assert_eq!(g.index_slots, 256);
        assert_eq!(g.entry_stride, 64);
        assert_eq!(g.index_offset % 64, 0);
        assert_eq!(g.entries_offset % 64, 0);
        assert_eq!(g.data_offset % 4096, 0);
        assert_eq!(g.total, g.data_offset + g.capacity);
        assert_eq!(Geometry::new(1, 1, 64, 4096).unwrap().entry_stride, 320);
        for (c, e, k) in [
            (0, 1, 1),
            (1, 0, 1),
            (1, 1, 0),
            (1, 1, 65),
            (usize::MAX, 1, 1),
        ] {
            assert!(Geometry::new(c, e, k, 4096).is_err(), "{c} {e} {k}");
        }
    }

    #[test]
    fn names() {
        assert_eq!(segment_name("enc-0").unwrap(), "shmq_ec_enc-0");
        assert_eq!(segment_name("shmq_ec_enc-0").unwrap(), "shmq_ec_enc-0");
        for bad in ["", "a/b", "a b", "é", &"x".repeat(101)] {
            assert!(segment_name(bad).is_err(), "{bad:?}");
        }
    }
}
