//! The arena segment's layout (see the `arena` module docs: Layout): the header, the
//! statistics, the lease table (records and holds as `shmq_protocol::lease` lays them
//! out) and the sizes derived from an arena's parameters, and [`Mapped`], a mapped
//! segment that reads them.

use std::ptr::NonNull;

use crate::error::{Error, Result};
use shmq_os::segment::{MAX_READERS, Segment, data_after_table, round_up};
use shmq_protocol::lease::{HOLDS_OFFSET, Hold, Lease, LeaseRecord};
use shmq_protocol::word::{PublishedU64, StatU64};

const STATS_OFFSET: usize = 64;
/// Where the queue's ring name is recorded: one length byte, then the name.
pub(super) const QUEUE_OFFSET: usize = 128;
/// The longest queue name recorded (longer ones are cut, at a character boundary).
pub(super) const QUEUE_NAME_MAX: usize = 255;
pub(super) const TABLE_OFFSET: usize = 384;
const _: () = assert!(QUEUE_OFFSET + 1 + QUEUE_NAME_MAX <= TABLE_OFFSET);

/// The segment header. Lives at offset 0 of the mapping.
#[repr(C)]
pub(super) struct ArenaHeader {
    pub(super) magic: PublishedU64,
    pub(super) version: u32,
    pub(super) n_reader: u32,
    pub(super) max_leases: u32,
    pub(super) page_size: u32,
    pub(super) lease_stride: u64,
    pub(super) data_offset: u64,
    pub(super) capacity: u64,
    pub(super) creator_pid: u32,
    _pad: u32,
    pub(super) creator_start_time: u64,
}
const _: () = assert!(std::mem::size_of::<ArenaHeader>() <= STATS_OFFSET);

/// What the writer publishes for inspection.
#[repr(C, align(64))]
pub(super) struct ArenaStats {
    pub(super) fallbacks: StatU64,
    pub(super) bytes_in_use: StatU64,
    pub(super) reserved: StatU64,
}
const _: () = assert!(STATS_OFFSET + std::mem::size_of::<ArenaStats>() <= QUEUE_OFFSET);

/// Sizes derived from an arena's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geometry {
    pub(super) n_reader: usize,
    pub(super) max_leases: usize,
    pub(super) page_size: usize,
    pub(super) lease_stride: usize,
    pub(super) data_offset: usize,
    pub(super) capacity: usize,
    pub(super) total: usize,
}

impl Geometry {
    pub(super) fn new(
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
        let lease_stride = round_up(HOLDS_OFFSET + 4 * n_reader, 64).ok_or_else(too_large)?;
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
pub(super) struct Mapped {
    pub(super) segment: Segment,
    pub(super) base: NonNull<u8>,
    pub(super) geo: Geometry,
}

// SAFETY: `base` points into `segment`'s mapping, which lives as long as `self`. The
// header is immutable after creation; lease records are only accessed through atomics;
// data bytes are written only by the writer, into leases no reader holds (the protocol
// in the `arena` module docs), and readers never read them through this mapping.
unsafe impl Send for Mapped {}
// SAFETY: as for Send: `&Mapped` exposes atomics and raw pointers only.
unsafe impl Sync for Mapped {}

impl Mapped {
    pub(super) fn header(&self) -> &ArenaHeader {
        // SAFETY: offset 0 of a mapping at least `data_offset` bytes long, page-aligned;
        // the header is written once before the magic is published and never again.
        unsafe { &*(self.base.as_ptr() as *const ArenaHeader) }
    }

    pub(super) fn stats(&self) -> &ArenaStats {
        // SAFETY: STATS_OFFSET is inside the header page, 64-aligned, atomics only.
        unsafe { &*(self.base.as_ptr().add(STATS_OFFSET) as *const ArenaStats) }
    }

    /// Lease `lease`: its record and its readers' hold counts (the protocol on them is
    /// [`shmq_protocol::lease`]).
    pub(super) fn lease(&self, lease: usize) -> Lease<'_> {
        assert!(lease < self.geo.max_leases);
        // SAFETY: lease < max_leases (asserted), so the record and the n_reader hold counts
        // after it lie inside the table (Geometry::new: lease_stride covers HOLDS_OFFSET +
        // 4 * n_reader bytes), inside the mapping that `self` keeps alive. The record is
        // 64-aligned (TABLE_OFFSET and the stride are multiples of 64), the counts 4-aligned
        // (HOLDS_OFFSET is a multiple of 4). Every field is an atomic (or an atomic's
        // padding-free integer), valid for any bit pattern: a peer process that writes
        // garbage into a record can only change counts and generations, which readers
        // validate and the writer trusts only to decide when a range may be reused.
        unsafe {
            let at = self
                .base
                .as_ptr()
                .add(TABLE_OFFSET + lease * self.geo.lease_stride);
            Lease {
                record: &*(at as *const LeaseRecord),
                holds: std::slice::from_raw_parts(
                    at.add(HOLDS_OFFSET) as *const Hold,
                    self.geo.n_reader,
                ),
            }
        }
    }

    /// The queue's ring name recorded by the writer ("" if none). A peer that scribbles
    /// over it changes only what `inspect` shows (cut to what is valid UTF-8).
    pub(super) fn queue(&self) -> String {
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
    pub(super) fn data(&self) -> *mut u8 {
        // SAFETY: data_offset < total <= the mapping's length.
        unsafe { self.base.as_ptr().add(self.geo.data_offset) }
    }
}
