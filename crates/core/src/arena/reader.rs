//! The reader's side of an arena ([`ArenaReader`]): opening it, checking references,
//! and the private views it hands out ([`ArenaView`]); and [`describe`], what
//! `inspect` shows of an arena.

use std::sync::Arc;

use super::layout::{ArenaHeader, Geometry, Mapped, TABLE_OFFSET};
use super::{ARENA_LAYOUT_VERSION, ARENA_MAGIC, ArenaRef, page_size};
use crate::error::{Error, OsError, Result};
use shmq_os::private_map::{PrivateFile, PrivateMap, SharedView};
use shmq_os::process::ProcessId;
use shmq_os::region;
use shmq_os::segment::{HeaderCheck, Segment};

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
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when segment `name` cannot be opened (gone, not this user's) or is not
    /// a shmq tensor arena of this layout version; [`Error::InvalidArgument`] when `reader`
    /// is not below its reader count.
    ///
    /// # Examples
    ///
    /// See [`ArenaWriter`'s example](super::ArenaWriter).
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
            return Err(segment.header_mismatch().into());
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

    /// The arena's segment name.
    ///
    /// # Examples
    ///
    /// See [`ArenaWriter`'s example](super::ArenaWriter).
    pub fn name(&self) -> &str {
        self.map.segment.name()
    }

    /// An error once a peer truncated the arena (see `shmq_os::sigbus`): the file is
    /// shorter than when opened (an `fstat`), or a mapping of it here was hit.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::BadSegment`] once the arena's file is shorter than
    /// when opened, or a mapping of it here was hit by a truncation.
    ///
    /// # Examples
    ///
    /// See [`ArenaWriter`'s example](super::ArenaWriter).
    pub fn check_intact(&self) -> Result<()> {
        self.map.segment.check_intact()?;
        Ok(self.file.check_intact()?)
    }

    /// An error once a mapping of the arena in this process was found truncated: the
    /// lease table's, or a view's, one that a caller may still hold and that reads zeros
    /// now (the `SIGBUS` handler's flags: atomic loads, no system call). For every call
    /// of the reader, also those whose message has no part here.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::BadSegment`] once a mapping of the arena here was hit
    /// by a truncation.
    ///
    /// # Examples
    ///
    /// See [`ArenaWriter`'s example](super::ArenaWriter).
    pub fn check_faults(&self) -> Result<()> {
        self.map.segment.check_intact()?;
        Ok(self.file.check_faults()?)
    }

    fn check(&self, r: &ArenaRef) -> Result<usize> {
        let bad = |reason: &str| {
            Error::Os(OsError::BadSegment {
                name: self.name().to_owned(),
                reason: format!("a message names {reason} ({r:?})"),
            })
        };
        let lease = r.lease as usize;
        if lease >= self.map.geo.max_leases {
            return Err(bad("a lease that does not exist"));
        }
        // Stored by the writer before it published the message we got them from.
        let (generation, offset, len) = self.map.lease(lease).read();
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
    ///
    /// # Examples
    ///
    /// See [`ArenaWriter`'s example](super::ArenaWriter).
    pub fn release(&self, r: &ArenaRef) {
        if let Ok(lease) = self.check(r) {
            release_hold(&self.map, lease, self.reader);
        }
    }

    /// Map `r`'s bytes privately: a view that holds the lease until it is dropped.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::BadSegment`] when `r` names no lease of this arena (a
    /// corrupt reference: out of range, freed, another reader's) or the arena was
    /// truncated; [`Error::Os`] when the mapping cannot be made.
    ///
    /// # Examples
    ///
    /// See [`ArenaWriter`'s example](super::ArenaWriter).
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
                Err(e.into())
            }
        }
    }
}

fn release_hold(map: &Mapped, lease: usize, reader: usize) {
    // Our reads of the bytes happen before the writer reuses them (`Lease::release`).
    map.lease(lease).release(reader);
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

impl ArenaView {
    /// This process's shared read-only mapping of the arena (made once per reader, on
    /// the first call: `PrivateFile::shared`) and where this view's first byte lies in
    /// it: what a device copies from, while this view holds the lease.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the arena cannot be mapped shared (no address space left), or was
    /// truncated.
    ///
    /// # Examples
    ///
    /// See [`ArenaWriter`'s example](super::ArenaWriter).
    pub fn shared(&self) -> Result<(Arc<SharedView>, usize)> {
        Ok((self.arena.file.shared()?, self.map.file_offset() as usize))
    }
}

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
///
/// # Errors
///
/// As [`ArenaReader::open`]: `name` cannot be opened or is not a tensor arena.
///
/// # Examples
///
/// See [`ArenaWriter`'s example](super::ArenaWriter) for an arena, and [`admin`](crate::admin)'s for `describe`.
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
        reserved: s.reserved.get(),
        bytes_in_use: s.bytes_in_use.get(),
        fallbacks: s.fallbacks.get(),
    })
}
