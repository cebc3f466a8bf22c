//! [`BlockFifo`]: the segment plus, on the writer, the FIFO allocator: allocating,
//! freeing oldest first (never a block some process pins) and clearing.
//!
//! # Memory is committed as it is used
//! The segment is sparse: its first page (header, published state, secret) is reserved
//! in `/dev/shm` at creation, the ring as blocks come to be allocated. Blocks are placed
//! from ring offset 0 on, each at 0 or right after the previous one, so what has been
//! reserved is a prefix `[0, reserved)` of the ring: before allocating, the writer
//! reserves up to the end of where the block will land (in steps of [`RESERVE_STEP`]),
//! and a `/dev/shm` without room for it is an [`OsError::NoSpace`] before anything moves
//! (the store frees what readers have finished with and tries again, then raises it as
//! its `MemoryError`; one warning per process says how to raise `/dev/shm`). Readers
//! only read blocks the writer allocated, so they never touch an unreserved page.

use std::sync::Arc;

use super::store_segment::{INVALID_ID, RING_OFFSET, StoreSegment, id_in};
use crate::error::{Error, OsError, Result};
use shmq_os::liveness::{Liveness, creator_liveness};
use shmq_os::segment::with_unique_name;
use shmq_os::segment_file;
use shmq_protocol::alloc::{Block, FifoAllocator, Freed, HEADER_BYTES};

/// The ring is reserved in `/dev/shm` in steps of this many bytes (or exactly what a
/// block needs when a whole step does not fit).
pub const RESERVE_STEP: u64 = 1 << 20;

fn writer_only(what: &str) -> Error {
    Error::WrongRole(format!("Only the writer can {what}."))
}

/// If `name` is a finished store whose creator is proved dead, remove its name.
fn remove_if_dead_store(name: &str) -> Result<()> {
    if !std::path::Path::new(&segment_file::path(name)).exists() {
        return Ok(());
    }
    // Only a store whose header is finished: its creator took its role lock before it
    // stored the magic, so "no lock held" then proves it dead (not one still starting).
    let Ok(old) = StoreSegment::open(name) else {
        return Ok(());
    };
    let creator = old.creator();
    drop(old);
    if creator_liveness(name) != Liveness::Dead {
        return Ok(());
    }
    match segment_file::unlink(name) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(Error::os(
                format!(
                    "removing the dead writer's store {}",
                    segment_file::path(name)
                ),
                e,
            ));
        }
    }
    shmq_os::shmq_log!(
        info,
        "shmq: replaced the store '{name}' left by dead writer pid {}",
        creator.pid
    );
    Ok(())
}

/// The spec's `RingBuffer`: the segment plus, on the writer, the FIFO allocator.
#[derive(Debug)]
pub struct BlockFifo {
    pub(super) segment: Arc<StoreSegment>,
    pub(super) writer: Option<RingWriter>,
}

/// The writer's state: the allocator and what it remembers of the last clear.
#[derive(Debug)]
pub(super) struct RingWriter {
    pub(super) alloc: FifoAllocator,
    /// Whether the blocks live at the last clear may still be read (see the module docs).
    cleared_readable: bool,
    /// End offset of the furthest of those blocks.
    cleared_end_offset: u64,
    /// Ring bytes `[0, overwritten)` written since the last clear.
    pub(super) overwritten: u64,
    /// Ring bytes `[0, reserved)` reserved in `/dev/shm` (see the module docs).
    reserved: u64,
}

impl BlockFifo {
    /// The segment, checked intact, and the writer's state; a reader is refused the
    /// call `what` names.
    fn writer_parts(&mut self, what: &str) -> Result<(&StoreSegment, &mut RingWriter)> {
        self.segment.check_intact()?;
        let w = self.writer.as_mut().ok_or_else(|| writer_only(what))?;
        Ok((&self.segment, w))
    }

    /// Create a ring of `capacity` bytes (this process is its writer).
    ///
    /// A `name` the caller chose that a crashed writer's store still holds (its creator
    /// proved dead by its role lock) is taken over: the old segment's name is removed
    /// first (readers that map it keep their mapping). Any other file of that name is
    /// refused ("already exists").
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a `capacity` of no more than a block header;
    /// [`Error::Os`] when the segment cannot be made (a `name` a live store holds, no room
    /// in `/dev/shm`), or a dead store's segment under `name` cannot be removed.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn create(capacity: u64, name: Option<&str>) -> Result<BlockFifo> {
        let alloc = FifoAllocator::new(capacity).map_err(Error::InvalidArgument)?;
        if let Some(name) = name {
            remove_if_dead_store(name)?;
        }
        let segment = match name {
            Some(name) => StoreSegment::create(name, capacity)?,
            None => with_unique_name("store", |name| StoreSegment::create(name, capacity))?,
        };
        Ok(BlockFifo {
            segment: Arc::new(segment),
            writer: Some(RingWriter {
                alloc,
                cleared_readable: false,
                cleared_end_offset: 0,
                overwritten: 0,
                reserved: 0,
            }),
        })
    }

    /// Open an existing ring as a reader; `capacity`, if given, must match.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when segment `name` cannot be opened (gone, not this user's) or is not
    /// a finished store of this layout version; [`Error::InvalidArgument`] when its
    /// capacity is not `capacity`.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn open(name: &str, capacity: Option<u64>) -> Result<BlockFifo> {
        let segment = StoreSegment::open(name)?;
        if let Some(c) = capacity.filter(|&c| c != segment.capacity()) {
            return Err(Error::InvalidArgument(format!(
                "shared memory segment '{name}' holds a ring of {} bytes, not {c}",
                segment.capacity()
            )));
        }
        Ok(BlockFifo {
            segment: Arc::new(segment),
            writer: None,
        })
    }

    /// The store's segment (its name is what readers open).
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn segment(&self) -> &Arc<StoreSegment> {
        &self.segment
    }
    /// Whether this process is the ring's writer ([`create`](Self::create)), not a reader.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn is_writer(&self) -> bool {
        self.writer.is_some()
    }
    /// The writer's allocator state.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn allocator(&self) -> Option<&FifoAllocator> {
        self.writer.as_ref().map(|w| &w.alloc)
    }

    /// Allocate a block with `data_bytes` of data and write its header.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a `data_bytes` of 0; else as
    /// [`allocate_with`](Self::allocate_with).
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn allocate(&mut self, data_bytes: u64) -> Result<Block> {
        if data_bytes == 0 {
            return Err(Error::InvalidArgument("Size must be greater than 0".into()));
        }
        self.allocate_with(|_| data_bytes)
    }

    /// Allocate a block sized by `data_bytes_at(ring offset)` (see
    /// [`FifoAllocator::allocate_with`]) and write its header.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for a reader;
    /// [`StoreError::Full`](crate::error::StoreError::Full) when the ring has no room for
    /// the block until older ones are freed (or never has, for one that large);
    /// [`Error::Os`] when `/dev/shm` has no room for its pages or the segment was
    /// truncated.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn allocate_with(&mut self, data_bytes_at: impl FnMut(u64) -> u64) -> Result<Block> {
        let (segment, w) = self.writer_parts("allocate buffers")?;
        let mut data_bytes_at = data_bytes_at;
        // Where the block will land (the allocator's placement: after the newest block,
        // or at 0 when it does not fit before the end), reserved before anything moves.
        let capacity = segment.capacity();
        let at = w.alloc.end() % capacity;
        let size = data_bytes_at(at).saturating_add(HEADER_BYTES);
        let lands_end = if at.saturating_add(size) > capacity {
            data_bytes_at(0).saturating_add(HEADER_BYTES)
        } else {
            at + size
        };
        // A block larger than the ring is the allocator's error (Full), not ours.
        reserve_ring(segment, &mut w.reserved, lands_end.min(capacity))?;
        let block = w.alloc.allocate_with(data_bytes_at)?;
        let end = block.offset(segment.capacity()) + block.size as u64;
        if end > w.reserved {
            // The placement above is the allocator's; should it ever differ, the block
            // is still reserved before it is written (an error leaves it unwritten, to
            // be freed in turn).
            reserve_ring(segment, &mut w.reserved, end)?;
        }
        if w.cleared_readable && end > w.overwritten {
            // The block covers bytes of blocks live at the last clear: say so before
            // writing them (`publish` orders this before the writes below).
            w.overwritten = end;
            let done = w.overwritten >= w.cleared_end_offset;
            w.cleared_readable = !done;
            segment.publish(|p| {
                // Relaxed: inside the seqlock (see `publish`).
                p.overwritten.set(end);
                if done {
                    let id_end = p.id_end.get();
                    p.cleared_start.set(id_end);
                    p.cleared_end.set(id_end);
                }
            });
        }
        segment.write_header(&block);
        // The header is written before the new id is published.
        segment.publish_ids(&w.alloc);
        segment.count_writes(1, 0);
        // The header may have gone to the zero pages of a truncated segment.
        segment.check_intact()?;
        Ok(block)
    }

    /// Ring bytes reserved in `/dev/shm` so far (writer; 0 on readers).
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn reserved(&self) -> u64 {
        self.writer.as_ref().map_or(0, |w| w.reserved)
    }

    /// Free blocks oldest first while `is_free(id, data)` and fewer than `nbytes` bytes
    /// have been freed; a block is freed (and handles to it stop working) as soon as
    /// `is_free` returns true for it. `is_free` runs with the ring borrowed: for code
    /// that must not (a Python callback, which may use the ring), see [`FreeOldestFirst`].
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for a reader; [`Error::Os`] when the segment was truncated.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn free_while(
        &mut self,
        nbytes: u64,
        mut is_free: impl FnMut(u32, &[u8]) -> bool,
    ) -> Result<Freed> {
        let (segment, w) = self.writer_parts("free buffers")?;
        let mut freed = Freed {
            first_id: w.alloc.id_start(),
            count: 0,
            bytes: 0,
        };
        while freed.bytes < nbytes {
            let Some(&c) = w.alloc.oldest() else {
                break;
            };
            if !is_free(c.id, segment.block_data(&c)) || !stamp_unpinned(segment, &c) {
                break;
            }
            w.alloc.free_oldest();
            freed.count += 1;
            freed.bytes += c.size as u64;
        }
        if freed.count > 0 {
            segment.publish_ids(&w.alloc);
            segment.wait_for_counting_readers();
            segment.count_writes(0, freed.count as u64);
        }
        Ok(freed)
    }

    /// The oldest live block (writer only): what [`free_oldest`](Self::free_oldest)
    /// frees.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for a reader; [`Error::Os`] when the segment was truncated.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn oldest(&self) -> Result<Option<Block>> {
        self.segment.check_intact()?;
        let w = self
            .writer
            .as_ref()
            .ok_or_else(|| writer_only("free buffers"))?;
        Ok(w.alloc.oldest().copied())
    }

    /// Free the oldest live block if it is still `block` (found by
    /// [`oldest`](Self::oldest), and judged free while the ring was not borrowed), with
    /// the checks of [`free_while`](Self::free_while): a block some process pins stays.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for a reader; [`Error::Os`] when the segment was truncated.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
    pub fn free_oldest(&mut self, block: &Block) -> Result<FreeOldest> {
        let (segment, w) = self.writer_parts("free buffers")?;
        if w.alloc.oldest() != Some(block) {
            // Freed (or cleared) meanwhile: the block approved is not there to free.
            return Ok(FreeOldest::NotOldest);
        }
        if !stamp_unpinned(segment, block) {
            return Ok(FreeOldest::Pinned);
        }
        w.alloc.free_oldest();
        segment.publish_ids(&w.alloc);
        segment.wait_for_counting_readers();
        segment.count_writes(0, 1);
        Ok(FreeOldest::Freed)
    }

    /// Forget every block (writer only). Ids keep counting and addresses restart at 0;
    /// handles issued before keep reading their data until the memory is reused. If a
    /// process holds a zero-copy view of some block, nothing moves instead: the blocks
    /// stay, to be freed oldest first like unused objects, each once no view holds it.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for a reader; [`Error::Os`] when the segment was truncated.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](super::ObjectStore).
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
        // Publish first that every live block is cleared, then look for zero-copy views:
        // a reader that pins one from now on sees it cleared and copies instead.
        segment.publish(|p| {
            // Relaxed: inside the seqlock (see `publish`).
            p.id_start.set(cleared_end);
            p.cleared_start.set(cleared_start);
            p.cleared_end.set(cleared_end);
            p.overwritten.set(0);
        });
        if w.alloc.live().any(|c| segment.is_pinned(c.id)) {
            // Some process has views of a block: keep every block where it is (the store
            // forgets their keys; they are freed oldest first once no view holds them)
            // and put the published state back.
            segment.publish(|p| {
                // Relaxed: inside the seqlock (see `publish`).
                p.cleared_start.set(before.cleared_start);
                p.cleared_end.set(before.cleared_end);
                p.overwritten.set(before.overwritten);
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
        // The cleared range is already published (above); now the ids.
        segment.publish_ids(&w.alloc);
        // A reader that found an object live just before the clear may still be about to
        // count its read, in memory the next put reuses: wait for it, as `free_buf`
        // does. Readers from now on see the objects cleared and do not count.
        segment.wait_for_counting_readers();
        Ok(())
    }
}

/// Stamp the header of the live block `c`, about to be freed, unless some process pins
/// it: true if stamped (free it now), false if pinned (it stays, and stays readable).
fn stamp_unpinned(segment: &StoreSegment, c: &Block) -> bool {
    // A block already pinned stays, and stays readable: no stamp (readers would take a
    // live object for a stale one meanwhile).
    if segment.is_pinned(c.id) {
        return false;
    }
    // Stamp the header (published with the new id_start by the caller), then look for
    // zero-copy views again: this second look is the one that counts, since a reader
    // that pins it from now on sees the stamp.
    let offset = c.offset(segment.capacity());
    segment.store_u32(offset, INVALID_ID);
    if segment.is_pinned(c.id) {
        // Some process still has views: keep the block (and all after it).
        segment.store_u32(offset, c.id);
        return false;
    }
    true
}

/// What [`BlockFifo::free_oldest`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeOldest {
    Freed,
    /// Some process pins the block: it stays (and so do the blocks after it).
    Pinned,
    /// The block is not the oldest live one any more (freed or cleared meanwhile).
    NotOldest,
}

/// [`BlockFifo::free_while`] for an `is_free` that runs without the ring borrowed, so
/// that it may use the ring itself (allocate, free, clear, read its state): a Python
/// callback. The caller loops: [`next`](Self::next) with the ring, `is_free` on that
/// block without it, [`free`](Self::free) with it again, until either says stop.
///
/// Only blocks live when it starts are asked about (one allocated meanwhile, by the
/// callback say, is not), and only the block `is_free` approved is ever freed: one that
/// went meanwhile (another free, a clear) is not freed again; the next oldest is asked.
#[derive(Debug)]
pub struct FreeOldestFirst {
    nbytes: u64,
    /// The ids live at the start: `[id_start, id_end)` then.
    ids: (u32, u32),
    /// Freed by this run, oldest first (consecutive unless something else freed between).
    freed: Vec<u32>,
    bytes: u64,
}

impl FreeOldestFirst {
    /// Free blocks of `ring` oldest first while fewer than `nbytes` bytes have been
    /// freed (writer only).
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] when `ring` is a reader's; [`Error::Os`] when the segment was
    /// truncated.
    pub fn new(ring: &BlockFifo, nbytes: u64) -> Result<FreeOldestFirst> {
        ring.segment.check_intact()?;
        let a = ring
            .allocator()
            .ok_or_else(|| writer_only("free buffers"))?;
        Ok(FreeOldestFirst {
            nbytes,
            ids: (a.id_start(), a.id_end()),
            freed: Vec::new(),
            bytes: 0,
        })
    }

    /// The block to ask `is_free` about next, or `None` when done: `nbytes` freed, or
    /// no block left of those live at the start.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] when `ring` is a reader's; [`Error::Os`] when the segment was
    /// truncated.
    pub fn next(&self, ring: &BlockFifo) -> Result<Option<Block>> {
        if self.bytes >= self.nbytes {
            return Ok(None);
        }
        Ok(ring
            .oldest()?
            .filter(|c| id_in(c.id, self.ids.0, self.ids.1)))
    }

    /// Free `block` (from [`next`](Self::next), approved by `is_free`) if it is still the
    /// oldest; whether to go on (false: it is pinned).
    ///
    /// # Errors
    ///
    /// As [`BlockFifo::free_oldest`]: [`Error::WrongRole`] for a reader's ring,
    /// [`Error::Os`] when the segment was truncated.
    pub fn free(&mut self, ring: &mut BlockFifo, block: &Block) -> Result<bool> {
        match ring.free_oldest(block)? {
            FreeOldest::Freed => {
                self.freed.push(block.id);
                self.bytes += block.size as u64;
                Ok(true)
            }
            FreeOldest::Pinned => Ok(false),
            FreeOldest::NotOldest => Ok(true),
        }
    }

    /// The ids freed, oldest first.
    pub fn freed_ids(&self) -> &[u32] {
        &self.freed
    }

    /// What was freed as a [`Freed`] (from the oldest id live at the start when nothing
    /// was), if the ids are consecutive: always, unless something else freed blocks
    /// between two of this run's.
    pub fn consecutive(&self) -> Option<Freed> {
        let first_id = self.freed.first().copied().unwrap_or(self.ids.0);
        let freed = Freed {
            first_id,
            count: self.freed.len() as u32,
            bytes: self.bytes,
        };
        freed.ids().eq(self.freed.iter().copied()).then_some(freed)
    }
}

/// Reserve ring bytes up to `end` in `/dev/shm` (`*reserved` is how far they are): a
/// step at a time, or exactly to `end` when a step does not fit; [`OsError::NoSpace`] if
/// even that does not.
fn reserve_ring(segment: &StoreSegment, reserved: &mut u64, end: u64) -> Result<()> {
    if end <= *reserved {
        return Ok(());
    }
    let capacity = segment.capacity();
    let step = end.max(reserved.saturating_add(RESERVE_STEP)).min(capacity);
    let mut last = Ok(());
    for target in [step, end] {
        let (from, len) = (*reserved, target - *reserved);
        last = segment
            .segment
            .reserve_range(RING_OFFSET + from as usize, len as usize);
        match last {
            Ok(()) => {
                *reserved = target;
                return Ok(());
            }
            Err(OsError::NoSpace { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(last?)
}
