//! The writer's side of an arena ([`ArenaWriter`]): leases, the reservation of the
//! data region, loans ([`Loan`]), publishing and reclaiming.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Arc;

use super::layout::{ArenaHeader, Geometry, Mapped, QUEUE_NAME_MAX, QUEUE_OFFSET};
use super::{
    ARENA_LAYOUT_VERSION, ARENA_MAGIC, ArenaRef, DEAD_CHECK_EVERY, RESERVE_RETRY, page_size,
};
use crate::error::{Error, OsError, Result};
use shmq_os::process::ProcessId;
use shmq_os::range_alloc::RangeAllocator;
use shmq_os::region;
use shmq_os::region::RawRegion;
use shmq_os::segment::{LoanPages, Segment, round_up, with_unique_name};

/// The writer's in-process record of a lease it has handed out.
#[derive(Clone, Copy, Debug)]
struct Outstanding {
    lease: u32,
    offset: usize,
    len: usize,
}

/// The writer's side of an arena: it allocates leases and fills them.
///
/// # Examples
///
/// A queue's writer makes its arena itself ([`Writer::loan`](crate::Writer::loan) lends
/// from it, and its readers get [`ArenaView`](crate::ArenaView)s); on its own, an arena
/// works so:
///
/// ```
/// use std::sync::Arc;
/// use shmq_core::arena::{ArenaReader, ArenaWriter};
///
/// let no_dead_reader = &mut |_reader: usize| false;
/// let mut writer = ArenaWriter::create(1, 1 << 20, 8)?; // 1 reader, 1 MiB, 8 leases
/// let reader = Arc::new(ArenaReader::open(writer.name(), 0)?);
/// assert_eq!((writer.n_reader(), writer.capacity()), (1, 1 << 20));
///
/// // A loan: filled in place, then sent by reference (the reader holds it).
/// let mut loan = writer.loan(10_000, no_dead_reader).expect("room");
/// loan.fill(3);
/// let sent = writer.find_loan(&loan[100..5000]).expect("bytes of a live loan");
/// writer.publish(&sent, 0..1); // before the message that carries `sent` is seen
/// let view = reader.view(&sent)?; // a private mapping: writes stay in it
/// assert!(view.iter().all(|&b| b == 3));
///
/// // A copy: for bytes that are not a loan's.
/// let copied = writer.copy_in(b"copied in", no_dead_reader).expect("room");
/// writer.publish(&copied, 0..1);
/// assert_eq!(&reader.view(&copied)?[..], b"copied in");
///
/// drop((loan, view));
/// writer.reclaim(); // leases no one holds any more come back
/// writer.check_intact()?;
/// # Ok::<(), shmq_core::Error>(())
/// ```
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
    ///
    /// # Errors
    ///
    /// As [`create_named`](Self::create_named), a name taken 16 times in a row included.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn create(n_reader: usize, capacity: usize, max_leases: usize) -> Result<ArenaWriter> {
        with_unique_name("arena", |name| {
            Self::create_named(name, "", n_reader, capacity, max_leases)
        })
    }

    /// [`create`](Self::create) under the segment name `name`, recording `queue` (the
    /// name of the queue's ring, cut to 255 bytes) for `inspect`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a capacity or lease count out of range; [`Error::Os`]
    /// when the segment cannot be made (the name taken, no room in `/dev/shm` for the
    /// header and lease table).
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
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
        map.header().magic.publish(ARENA_MAGIC);
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

    /// The arena's segment name (what its readers open).
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn name(&self) -> &str {
        self.map.segment.name()
    }
    /// Bytes of the data region.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn capacity(&self) -> usize {
        self.map.geo.capacity
    }
    /// How many readers the arena was made for.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn n_reader(&self) -> usize {
        self.map.geo.n_reader
    }
    /// Parts sent the ordinary way because no lease was free (or `/dev/shm` was full).
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks
    }
    /// Leases handed out and not yet returned.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }
    /// Bytes of the data region reserved in `/dev/shm` so far.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn reserved(&self) -> usize {
        self.reserved
    }
    /// An error once a peer truncated the arena under this writer (see `shmq_os::sigbus`):
    /// a fault in its mapping, or a reservation that found the file short (the writer
    /// then sends the part it was for no other way: a copy would hide the loss).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::BadSegment`] once a peer truncated the arena.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn check_intact(&self) -> Result<()> {
        Ok(self.map.segment.check_intact()?)
    }

    /// Remove the segment's name now (see `Segment::unlink`).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the file cannot be removed for another reason than being gone
    /// already.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn unlink(&self) -> Result<()> {
        Ok(self.map.segment.unlink()?)
    }

    /// Whether some reader holds a part still (a message it has not read yet, or a view
    /// of one it keeps).
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn has_reader_holds(&self) -> bool {
        let n = self.map.geo.n_reader;
        self.outstanding.iter().any(|o| {
            let lease = self.map.lease(o.lease as usize);
            (0..n).any(|r| lease.is_held_by(r))
        })
    }

    /// Leave the removal of the arena's name to this process's janitor, which removes it
    /// once no process holds a lock on ring `ring`'s file (the queue's readers hold their
    /// role locks there until they leave or die): see `Segment::hand_removal_to_janitor`.
    /// False where that cannot be done (the name is then removed as before).
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn hand_removal_to_janitor(&self, ring: &str) -> bool {
        self.map.segment.hand_removal_to_janitor(ring)
    }

    /// Count one fallback (a part sent the ordinary way), for the statistics.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn count_fallback(&mut self) {
        self.fallbacks += 1;
        // Relaxed: a statistic for inspection.
        self.map.stats().fallbacks.set(self.fallbacks);
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

    /// Give back every outstanding lease whose holds are all gone (done before every
    /// allocation; call it to see the current count in [`outstanding`](Self::outstanding)).
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn reclaim(&mut self) {
        let mut k = 0;
        while k < self.outstanding.len() {
            let o = self.outstanding[k];
            let lease = self.map.lease(o.lease as usize);
            if lease.is_unused() {
                lease.retire();
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
        self.map.stats().bytes_in_use.set(in_use as u64);
    }

    /// Drop every hold of the readers proved dead (`reader_is_dead(r)`, asked only of
    /// readers that hold something now), then [`reclaim`](Self::reclaim). The writer
    /// does this by itself when room runs short and at most once every
    /// [`DEAD_CHECK_EVERY`] when it places a part; call it to do it now.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn reclaim_dead(&mut self, reader_is_dead: &mut dyn FnMut(usize) -> bool) {
        self.last_dead_check = Some(std::time::Instant::now());
        let n = self.map.geo.n_reader;
        let mut holding = vec![false; n];
        for o in &self.outstanding {
            let lease = self.map.lease(o.lease as usize);
            for (r, h) in holding.iter_mut().enumerate() {
                *h |= lease.is_held_by(r);
            }
        }
        let dead: Vec<usize> = (0..n)
            .filter(|&r| holding[r] && reader_is_dead(r))
            .collect();
        for o in &self.outstanding {
            let lease = self.map.lease(o.lease as usize);
            for &r in &dead {
                // Proved dead by its liveness lock, which the kernel releases only when
                // the process is gone.
                lease.drop_holds_of(r);
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
    /// so the first parts placed there do not pay for it (most of a new range's cost is
    /// the kernel zeroing the pages: `docs/performance.md`, "How to read the tensor
    /// rows"). Returns the bytes reserved
    /// in all; an error (and nothing more reserved) when `/dev/shm` has no room.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::NoSpace`] when `/dev/shm` has no room for the pages,
    /// or when they cannot be mapped.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
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
            Err(e @ Error::Os(OsError::BadSegment { .. })) => {
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
                self.map.stats().reserved.set(target as u64);
                Ok(())
            }
            Err(e) => Err(e.into()),
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
        // Held by the writer until the message that carries it is published (`publish`)
        // or, for a loan, until the `Loan` is dropped: until then no reader holds it, and
        // `reclaim` must not take it back (say, while the next part of the same message
        // is being placed).
        self.map
            .lease(lease as usize)
            .take(offset as u64, len as u64);
        self.is_loan[lease as usize] = false;
        self.outstanding.push(Outstanding { lease, offset, len });
        Some((lease, offset, len))
    }

    /// Copy `bytes` into a new lease and return the reference to publish (after
    /// [`publish`](Self::publish)), or `None` if there is no room (counted as a
    /// fallback).
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
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
        let generation = self.map.lease(lease as usize).generation();
        ArenaRef {
            lease,
            generation,
            offset: offset as u64,
            len: len as u64,
        }
    }

    /// Lend `len` bytes of the arena to fill in place; send them by passing (a part of)
    /// the loan's bytes to the queue. `None` if there is no room.
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
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
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
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
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
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
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn publish(&self, r: &ArenaRef, readers: impl Iterator<Item = usize>) {
        self.seal_loan(r);
        self.map.lease(r.lease as usize).add_holds(readers);
        self.abandon(r);
    }

    /// Drop the writer's hold of a copied part whose message will not be sent after all
    /// (loans keep theirs).
    ///
    /// # Examples
    ///
    /// See [the type's example](ArenaWriter).
    pub fn abandon(&self, r: &ArenaRef) {
        if !self.is_loan[r.lease as usize] {
            self.map.lease(r.lease as usize).drop_writer_hold();
        }
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
                map.lease(lease as usize).drop_writer_hold();
                true
            }));
            return;
        }
        // The loan's writes happen before the writer reuses its bytes (the Release of
        // `drop_writer_hold`).
        self.map.lease(self.lease as usize).drop_writer_hold();
    }
}
