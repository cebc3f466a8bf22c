//! [`ChunkFifo`]: the segment plus, on the writer, the FIFO allocator: allocating,
//! freeing oldest first (never a chunk some process pins) and clearing.
//!
//! # Memory is committed as it is used
//! The segment is sparse: its first page (header, published state, secret) is reserved
//! in `/dev/shm` at creation, the ring as chunks come to be allocated. Chunks are placed
//! from ring offset 0 on, each at 0 or right after the previous one, so what has been
//! reserved is a prefix `[0, reserved)` of the ring: before allocating, the writer
//! reserves up to the end of where the chunk will land (in steps of [`RESERVE_STEP`]),
//! and a `/dev/shm` without room for it is an [`Error::NoSpace`] before anything moves
//! (the store frees what readers have finished with and tries again, then raises it as
//! its `MemoryError`; one warning per process says how to raise `/dev/shm`). Readers
//! only read chunks the writer allocated, so they never touch an unreserved page.

use std::sync::Arc;

use super::segment::{ChunkHeader, StoreSegment, INVALID_ID, RING_OFFSET};
use crate::alloc::{Chunk, FifoAllocator, Freed, HEADER_BYTES};
use crate::error::{Error, Result};
use crate::segment::unique_name;
use crate::sync::Ordering;

/// The ring is reserved in `/dev/shm` in steps of this many bytes (or exactly what a
/// chunk needs when a whole step does not fit).
pub const RESERVE_STEP: u64 = 1 << 20;

fn writer_only(what: &str) -> Error {
    Error::WrongRole(format!("Only the writer can {what}."))
}

/// The spec's `RingBuffer`: the segment plus, on the writer, the FIFO allocator.
#[derive(Debug)]
pub struct ChunkFifo {
    pub(super) segment: Arc<StoreSegment>,
    pub(super) writer: Option<RingWriter>,
}

/// The writer's state: the allocator and what it remembers of the last clear.
#[derive(Debug)]
pub(super) struct RingWriter {
    pub(super) alloc: FifoAllocator,
    /// Whether the chunks live at the last clear may still be read (see the module docs).
    cleared_readable: bool,
    /// End offset of the furthest of those chunks.
    cleared_end_offset: u64,
    /// Ring bytes `[0, overwritten)` written since the last clear.
    pub(super) overwritten: u64,
    /// Ring bytes `[0, reserved)` reserved in `/dev/shm` (see the module docs).
    reserved: u64,
}

impl ChunkFifo {
    /// Create a ring of `capacity` bytes (this process is its writer).
    pub fn create(capacity: u64, name: Option<&str>) -> Result<ChunkFifo> {
        let alloc = FifoAllocator::new(capacity).map_err(Error::InvalidArgument)?;
        let name = name.map_or_else(|| unique_name("store"), str::to_owned);
        Ok(ChunkFifo {
            segment: Arc::new(StoreSegment::create(&name, capacity)?),
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
    pub fn open(name: &str, capacity: Option<u64>) -> Result<ChunkFifo> {
        let segment = StoreSegment::open(name)?;
        if let Some(c) = capacity.filter(|&c| c != segment.capacity()) {
            return Err(Error::InvalidArgument(format!(
                "shared memory segment '{name}' holds a ring of {} bytes, not {c}",
                segment.capacity()
            )));
        }
        Ok(ChunkFifo {
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
        segment.check_intact()?;
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| writer_only("allocate buffers"))?;
        let mut data_bytes_at = data_bytes_at;
        // Where the chunk will land (the allocator's placement: after the newest chunk,
        // or at 0 when it does not fit before the end), reserved before anything moves.
        let capacity = segment.capacity();
        let at = w.alloc.end() % capacity;
        let size = data_bytes_at(at).saturating_add(HEADER_BYTES);
        let lands_end = if at.saturating_add(size) > capacity {
            data_bytes_at(0).saturating_add(HEADER_BYTES)
        } else {
            at + size
        };
        // A chunk larger than the ring is the allocator's error (Full), not ours.
        reserve_ring(segment, &mut w.reserved, lands_end.min(capacity))?;
        let chunk = w.alloc.allocate_with(data_bytes_at)?;
        let end = chunk.offset(segment.capacity()) + chunk.size as u64;
        if end > w.reserved {
            // The placement above is the allocator's; should it ever differ, the chunk
            // is still reserved before it is written (an error leaves it unwritten, to
            // be freed in turn).
            reserve_ring(segment, &mut w.reserved, end)?;
        }
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
        segment.count_writes(1, 0);
        // The header may have gone to the zero pages of a truncated segment.
        segment.check_intact()?;
        Ok(chunk)
    }

    /// Ring bytes reserved in `/dev/shm` so far (writer; 0 on readers).
    pub fn reserved(&self) -> u64 {
        self.writer.as_ref().map_or(0, |w| w.reserved)
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
        segment.check_intact()?;
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
            // A chunk already pinned stays, and stays readable: no stamp (readers
            // would take a live object for a stale one meanwhile).
            if segment.is_pinned(h.id) {
                return false;
            }
            // Stamp the header (published with the new id_start below), then look for
            // zero-copy views again: this second look is the one that counts, since a
            // reader that pins it from now on sees the stamp.
            segment.store_u32(h.offset, INVALID_ID);
            if segment.is_pinned(h.id) {
                // Some process still has views: keep the chunk (and all after it).
                segment.store_u32(h.offset, c.id);
                return false;
            }
            true
        });
        if freed.count > 0 {
            segment.publish_ids(&w.alloc);
            segment.wait_for_counting_readers();
            segment.count_writes(0, freed.count as u64);
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
            .any(|c| segment.is_pinned(c.id))
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
        // The cleared range is already published (above); now the ids.
        segment.publish_ids(&w.alloc);
        // A reader that found an object live just before the clear may still be about to
        // count its read, in memory the next put reuses: wait for it, as `free_buf`
        // does. Readers from now on see the objects cleared and do not count.
        segment.wait_for_counting_readers();
        Ok(())
    }
}

/// Reserve ring bytes up to `end` in `/dev/shm` (`*reserved` is how far they are): a
/// step at a time, or exactly to `end` when a step does not fit; [`Error::NoSpace`] if
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
            Err(Error::NoSpace { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    last
}
