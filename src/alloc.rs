//! The FIFO allocator of the object store, as pure arithmetic on addresses and ids.
//!
//! One writer allocates variable-size chunks in a ring of `capacity` bytes and frees them
//! oldest first. Nothing here touches memory: the store ([`crate::storage`]) writes the
//! chunk headers, so this module can be property-tested and benchmarked on its own.
//!
//! - **Addresses grow monotonically.** A chunk's address is a position on an unbounded
//!   line; `address % capacity` is its offset in the segment. A chunk that would not fit
//!   before the end of the ring starts at the next lap (the tail of the lap is skipped).
//!   Addresses never go back, not even after everything is freed or after `clear`.
//! - **Ids count up from 0 and wrap at 2**31** (they are stored in 4 bytes).
//! - **The live span** is from the oldest live chunk's address to the end of the newest;
//!   an allocation that would make it exceed `capacity` fails with [`Full`].
//! - Chunks start at offsets that are multiples of [`CHUNK_ALIGN`], so the store can
//!   place atomics and tensor data in them: a chunk's recorded size is exact, its
//!   footprint is rounded up to the alignment, or to the end of the lap if that is nearer
//!   (so a ring of any size works and the next lap starts at offset 0).

use std::collections::VecDeque;

/// Bytes of the chunk header: `[4-byte id][4-byte size]`.
pub const HEADER_BYTES: u64 = 8;
/// Ids wrap at this value.
pub const ID_MAX: u32 = 1 << 31;
/// Every chunk starts at a multiple of this.
pub const CHUNK_ALIGN: u64 = 64;

/// The allocation does not fit in the ring now (or ever, if larger than the ring).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "Not enough space in the data buffer, try calling free_buf() to free up space \
     ({needed} bytes needed, {live} of {capacity} bytes in use)"
)]
pub struct Full {
    pub needed: u64,
    pub live: u64,
    pub capacity: u64,
}

/// A live chunk: where it is, its id and its size (header included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub address: u64,
    pub id: u32,
    pub size: u32,
    /// Bytes of the ring it occupies: `size` rounded up (see the module docs).
    pub footprint: u32,
}

/// Footprint of a chunk of `size` bytes at ring offset `offset`.
fn footprint(size: u64, offset: u64, capacity: u64) -> u64 {
    (size.div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN).min(capacity - offset)
}

/// What [`FifoAllocator::free_while`] freed: `count` consecutive ids from `first_id`
/// (wrapping at [`ID_MAX`]), `bytes` bytes of chunk size in all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    pub first_id: u32,
    pub count: u32,
    pub bytes: u64,
}

impl Freed {
    /// The freed ids, oldest first.
    pub fn ids(&self) -> impl ExactSizeIterator<Item = u32> + use<> {
        let first = self.first_id;
        (0..self.count).map(move |k| (first + k) % ID_MAX)
    }
}

/// The writer's view of the ring.
#[derive(Clone, Debug)]
pub struct FifoAllocator {
    capacity: u64,
    /// Address of the oldest live chunk (or `end` when none is live).
    start: u64,
    /// Address just past the newest chunk's footprint.
    end: u64,
    /// Id of the oldest live chunk (or `id_end` when none is live).
    id_start: u32,
    /// Id the next allocation gets.
    id_end: u32,
    live: VecDeque<Chunk>,
}

impl FifoAllocator {
    /// A ring of `capacity` bytes (more than the 8-byte header).
    pub fn new(capacity: u64) -> Result<FifoAllocator, String> {
        Self::with_first_id(capacity, 0)
    }

    /// Like [`new`](Self::new), with ids starting at `first_id` (below [`ID_MAX`]) instead
    /// of 0: for a store that must never reuse an id it issued before, and for tests of
    /// the wrap-around.
    pub fn with_first_id(capacity: u64, first_id: u32) -> Result<FifoAllocator, String> {
        if capacity < HEADER_BYTES + 1 {
            return Err(format!(
                "the ring must be larger than {HEADER_BYTES} bytes, got {capacity}"
            ));
        }
        if first_id >= ID_MAX {
            return Err(format!("the first id must be below 2**31, got {first_id}"));
        }
        let id = first_id;
        Ok(FifoAllocator {
            capacity,
            start: 0,
            end: 0,
            id_start: id,
            id_end: id,
            live: VecDeque::new(),
        })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }
    /// Address of the oldest live chunk (`data_buffer_start`).
    pub fn start(&self) -> u64 {
        self.start
    }
    /// Address past the newest chunk (`data_buffer_end`).
    pub fn end(&self) -> u64 {
        self.end
    }
    /// Id of the oldest live chunk (`monotonic_id_start`).
    pub fn id_start(&self) -> u32 {
        self.id_start
    }
    /// Id of the next allocation (`monotonic_id_end`).
    pub fn id_end(&self) -> u32 {
        self.id_end
    }
    /// Bytes between the oldest live chunk and the end of the newest.
    pub fn live_bytes(&self) -> u64 {
        self.end - self.start
    }
    /// Live chunks, oldest first.
    pub fn live(&self) -> impl ExactSizeIterator<Item = &Chunk> + '_ {
        self.live.iter()
    }
    /// The live chunk with this id, if any.
    pub fn get(&self, id: u32) -> Option<&Chunk> {
        // Live ids are consecutive (mod ID_MAX) from id_start.
        let k = id.wrapping_sub(self.id_start) % ID_MAX;
        self.live.get(k as usize).filter(|c| c.id == id)
    }

    /// Allocate `data_bytes` of data (plus the header). Returns the chunk.
    pub fn allocate(&mut self, data_bytes: u64) -> Result<Chunk, Full> {
        let size = data_bytes
            .checked_add(HEADER_BYTES)
            .filter(|&s| s <= u32::MAX as u64);
        let full = |needed| Full {
            needed,
            live: self.end - self.start,
            capacity: self.capacity,
        };
        let Some(size) = size.filter(|&s| s <= self.capacity) else {
            return Err(full(data_bytes.saturating_add(HEADER_BYTES)));
        };
        let offset = self.end % self.capacity;
        let (address, offset) = if offset + size > self.capacity {
            // Does not fit before the end of the ring: start at the next lap.
            (self.end - offset + self.capacity, 0)
        } else {
            (self.end, offset)
        };
        let footprint = footprint(size, offset, self.capacity);
        // With nothing live, the span starts at the new chunk (a skipped lap tail is free).
        let start = if self.live.is_empty() {
            address
        } else {
            self.start
        };
        if address + footprint - start > self.capacity {
            return Err(full(size));
        }
        let chunk = Chunk {
            address,
            id: self.id_end,
            size: size as u32,
            footprint: footprint as u32,
        };
        if self.live.is_empty() {
            self.start = address;
        }
        self.live.push_back(chunk);
        self.end = address + footprint;
        self.id_end = (self.id_end + 1) % ID_MAX;
        Ok(chunk)
    }

    /// Free chunks oldest first while `is_free(chunk)` says so and fewer than `nbytes`
    /// bytes (of size) have been freed; stop at the first chunk still in use. A chunk is
    /// freed as soon as `is_free` returns true for it. The freed ids are consecutive:
    /// the result says which.
    pub fn free_while(&mut self, nbytes: u64, mut is_free: impl FnMut(&Chunk) -> bool) -> Freed {
        let mut freed = Freed {
            first_id: self.id_start,
            count: 0,
            bytes: 0,
        };
        while freed.bytes < nbytes {
            let Some(oldest) = self.live.front() else {
                break;
            };
            if !is_free(oldest) {
                break;
            }
            freed.bytes += oldest.size as u64;
            freed.count += 1;
            self.live.pop_front();
        }
        if freed.count > 0 {
            self.id_start = (self.id_start + freed.count) % ID_MAX;
            self.start = self.live.front().map_or(self.end, |c| c.address);
        }
        freed
    }

    /// Forget every chunk. Addresses and ids keep counting up, so nothing issued before
    /// can resolve to a later chunk.
    pub fn clear(&mut self) {
        self.live.clear();
        self.start = self.end;
        self.id_start = self.id_end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_and_monotonic() {
        let mut a = FifoAllocator::new(1024).unwrap();
        let c0 = a.allocate(10).unwrap();
        let c1 = a.allocate(100).unwrap();
        assert_eq!((c0.address, c0.id, c0.size, c0.footprint), (0, 0, 18, 64));
        assert_eq!(
            (c1.address, c1.id, c1.size, c1.footprint),
            (64, 1, 108, 128)
        );
        assert_eq!(a.end(), 64 + 128);
        assert_eq!(a.get(1), Some(&c1));
        assert_eq!(a.get(2), None);
    }

    #[test]
    fn wraps_to_the_next_lap_and_reports_full() {
        let mut a = FifoAllocator::new(256).unwrap();
        let c0 = a.allocate(100).unwrap(); // 0..128
        let _c1 = a.allocate(56).unwrap(); // 128..192
        let err = a.allocate(100).unwrap_err(); // would need 256..384: span 384 > 256
        assert_eq!(err.needed, 108);
        assert!(err
            .to_string()
            .starts_with("Not enough space in the data buffer"));
        let freed = a.free_while(u64::MAX, |c| c.id == c0.id);
        assert_eq!(
            freed,
            Freed {
                first_id: c0.id,
                count: 1,
                bytes: c0.size as u64
            }
        );
        assert_eq!(a.start(), 128);
        let c2 = a.allocate(100).unwrap(); // next lap: 256..384, span 128..384 = 256
        assert_eq!(c2.address, 256);
        assert_eq!(c2.address % a.capacity(), 0);
    }

    #[test]
    fn never_fits_is_full() {
        let mut a = FifoAllocator::new(256).unwrap();
        assert!(a.allocate(249).is_err());
        assert!(a.allocate(u64::MAX).is_err());
        assert!(a.allocate(248).is_ok());
    }

    #[test]
    fn free_stops_at_first_in_use_and_at_nbytes() {
        let mut a = FifoAllocator::new(4096).unwrap();
        let ids: Vec<u32> = (0..5).map(|_| a.allocate(56).unwrap().id).collect();
        let ids_of = |f: Freed| f.ids().collect::<Vec<_>>();
        assert_eq!(ids_of(a.free_while(u64::MAX, |c| c.id != 2)), vec![0, 1]);
        assert_eq!(a.id_start(), 2);
        assert_eq!(ids_of(a.free_while(64, |_| true)), vec![2]);
        assert_eq!(a.free_while(u64::MAX, |_| true).count, 2);
        assert_eq!((a.start(), a.id_start()), (a.end(), ids.len() as u32));
    }

    #[test]
    fn ids_wrap_at_2_pow_31() {
        let mut a = FifoAllocator::with_first_id(1024, ID_MAX - 1).unwrap();
        assert_eq!(a.allocate(1).unwrap().id, ID_MAX - 1);
        assert_eq!(a.allocate(1).unwrap().id, 0);
        assert_eq!(a.get(0).unwrap().id, 0);
        assert_eq!(a.get(ID_MAX - 1).unwrap().id, ID_MAX - 1);
        let freed = a.free_while(u64::MAX, |_| true);
        assert_eq!(freed.ids().collect::<Vec<_>>(), vec![ID_MAX - 1, 0]);
        assert_eq!(a.id_start(), 1);
    }

    #[test]
    fn empty_ring_takes_a_full_size_chunk_after_a_lap_skip() {
        let mut a = FifoAllocator::new(256).unwrap();
        a.allocate(56).unwrap();
        a.free_while(u64::MAX, |_| true);
        let c = a.allocate(248).unwrap(); // footprint 256 does not fit at offset 64
        assert_eq!(c.address, 256);
    }

    #[test]
    fn ring_sizes_need_not_be_aligned() {
        let mut a = FifoAllocator::new(1000).unwrap();
        let c0 = a.allocate(900).unwrap(); // 908 bytes: footprint 960
        assert_eq!(c0.footprint, 960);
        a.free_while(u64::MAX, |_| true);
        let c1 = a.allocate(30).unwrap(); // 38 bytes at 960 fit; footprint ends the lap
        assert_eq!((c1.address, c1.footprint), (960, 40));
        let c2 = a.allocate(10).unwrap();
        assert_eq!(c2.address % 1000, 0);
        assert!(a.allocate(992).is_err());
        assert!(FifoAllocator::new(8).is_err());
    }

    #[test]
    fn clear_keeps_counting() {
        let mut a = FifoAllocator::new(1024).unwrap();
        a.allocate(10).unwrap();
        let end = a.end();
        a.clear();
        assert_eq!(a.live().len(), 0);
        let c = a.allocate(10).unwrap();
        assert_eq!((c.id, c.address), (1, end));
    }
}
