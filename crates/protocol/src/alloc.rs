//! The FIFO allocator of the object store, as pure arithmetic on addresses and ids.
//!
//! One writer allocates variable-size blocks in a ring of `capacity` bytes and frees them
//! oldest first. Nothing here touches memory: the store (`shmq::storage`) writes the
//! block headers, so this module can be property-tested and benchmarked on its own.
//!
//! The arithmetic is vLLM 0.33's (`SingleWriterShmRingBuffer`), so that addresses, ids and
//! the `data_buffer_start`/`data_buffer_end` a caller can observe are the same:
//!
//! - **Blocks are packed tightly**: `[4-byte id][4-byte size][data]`, the next block
//!   right after (a 200-byte ring holds allocations of 100 and 80 bytes). Nothing is
//!   rounded: whoever needs alignment inside a block pads inside it (the store does, see
//!   `shmq::storage`).
//! - **Addresses** are positions on a line; `address % capacity` is the offset in the
//!   ring. A block that would not fit before the end of the ring starts at the next lap.
//!   When the last live block is freed, or on `clear`, the line restarts at 0; when the
//!   oldest live block is a whole lap ahead, both ends move back by one lap. Addresses
//!   therefore stay below `2 * capacity`; they are not unique over time (ids are).
//! - **Ids count up from 0 and wrap at 2**31** (they are stored in 4 bytes). They keep
//!   counting across `clear`, so a handle issued before a clear never names a later
//!   block (until the ids wrap).
//! - **The live span** is from the oldest live block's address to the end of the newest;
//!   an allocation that would make it exceed `capacity` fails with [`Full`].

use std::collections::VecDeque;

/// Bytes of the block header: `[4-byte id][4-byte size]`.
pub const HEADER_BYTES: u64 = 8;
/// Ids wrap at this value.
pub const ID_MAX: u32 = 1 << 31;

/// The allocation does not fit in the ring now (or ever, if larger than the ring).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "Not enough space in the data buffer, try calling free_buf() to free up space \
     ({needed} bytes needed, {live} of {capacity} bytes in use; Rust: free_while)"
)]
pub struct Full {
    pub needed: u64,
    pub live: u64,
    pub capacity: u64,
    /// What holds the room, when the store knows (added to the error's message by
    /// `shmq::Error`: the oldest object, which must go first, and what keeps it).
    pub held_by: Option<String>,
}

/// A live block: where it is, its id and its size (header included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub address: u64,
    pub id: u32,
    pub size: u32,
}

impl Block {
    /// Offset of the block in a ring of `capacity` bytes.
    pub fn offset(&self, capacity: u64) -> u64 {
        self.address % capacity
    }
}

/// What [`FifoAllocator::free_while`] freed: `count` consecutive ids from `first_id`
/// (wrapping at [`ID_MAX`]), `bytes` bytes of block size in all.
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
    /// Address of the oldest live block (0 when none is live).
    start: u64,
    /// Address just past the newest block (0 when none is live).
    end: u64,
    /// Id of the oldest live block (or `id_end` when none is live).
    id_start: u32,
    /// Id the next allocation gets.
    id_end: u32,
    live: VecDeque<Block>,
}

impl FifoAllocator {
    /// A ring of `capacity` bytes (more than the 8-byte header).
    ///
    /// # Errors
    ///
    /// A message saying why, when `capacity` is not larger than the 8-byte header, or
    /// larger than a quarter of `u64::MAX`.
    pub fn new(capacity: u64) -> Result<FifoAllocator, String> {
        Self::with_first_id(capacity, 0)
    }

    /// Like [`new`](Self::new), with ids starting at `first_id` (below [`ID_MAX`]) instead
    /// of 0: for tests of the wrap-around.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), and when `first_id` is not below [`ID_MAX`].
    pub fn with_first_id(capacity: u64, first_id: u32) -> Result<FifoAllocator, String> {
        if capacity < HEADER_BYTES + 1 {
            return Err(format!(
                "the ring must be larger than {HEADER_BYTES} bytes, got {capacity}"
            ));
        }
        if capacity > u64::MAX / 4 {
            return Err(format!("a ring of {capacity} bytes is too large"));
        }
        if first_id >= ID_MAX {
            return Err(format!("the first id must be below 2**31, got {first_id}"));
        }
        Ok(FifoAllocator {
            capacity,
            start: 0,
            end: 0,
            id_start: first_id,
            id_end: first_id,
            live: VecDeque::new(),
        })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }
    /// Address of the oldest live block (`data_buffer_start`).
    pub fn start(&self) -> u64 {
        self.start
    }
    /// Address past the newest block (`data_buffer_end`).
    pub fn end(&self) -> u64 {
        self.end
    }
    /// Id of the oldest live block (`monotonic_id_start`).
    pub fn id_start(&self) -> u32 {
        self.id_start
    }
    /// Id of the next allocation (`monotonic_id_end`).
    pub fn id_end(&self) -> u32 {
        self.id_end
    }
    /// Bytes between the oldest live block and the end of the newest.
    pub fn live_bytes(&self) -> u64 {
        self.end - self.start
    }
    /// Live blocks, oldest first.
    pub fn live(&self) -> impl ExactSizeIterator<Item = &Block> + '_ {
        self.live.iter()
    }
    /// The live block with this id, if any.
    pub fn get(&self, id: u32) -> Option<&Block> {
        // Live ids are consecutive (mod ID_MAX) from id_start.
        let k = id.wrapping_sub(self.id_start) % ID_MAX;
        self.live.get(k as usize).filter(|c| c.id == id)
    }

    /// Ring offset where a block of `size` bytes (header included) would start.
    fn place(&self, size: u64) -> (u64, u64) {
        let offset = self.end % self.capacity;
        if offset + size > self.capacity {
            // Does not fit before the end of the ring: start at the next lap.
            ((self.end / self.capacity + 1) * self.capacity, 0)
        } else {
            (self.end, offset)
        }
    }

    /// Allocate `data_bytes` of data (plus the header). Returns the block.
    ///
    /// # Errors
    ///
    /// [`Full`] when the block (with its header) is larger than the ring or than
    /// `u32::MAX`, or does not fit beside the live blocks until older ones are freed.
    pub fn allocate(&mut self, data_bytes: u64) -> Result<Block, Full> {
        self.allocate_with(|_| data_bytes)
    }

    /// Allocate a block whose data size depends on where it lands: `data_bytes_at(offset)`
    /// is asked for the ring offset the block would start at (once for the current end
    /// of the ring and, if that does not fit before the end, once more for offset 0).
    /// This lets the store size a block exactly for the padding its contents need.
    ///
    /// # Errors
    ///
    /// As [`allocate`](Self::allocate): [`Full`] when the block sized for where it lands
    /// does not fit.
    pub fn allocate_with(
        &mut self,
        mut data_bytes_at: impl FnMut(u64) -> u64,
    ) -> Result<Block, Full> {
        let capacity = self.capacity;
        let full = |needed: u64, a: &FifoAllocator| Full {
            needed,
            live: a.end - a.start,
            capacity,
            held_by: None,
        };
        let total = |data: u64| data.saturating_add(HEADER_BYTES);
        let mut size = total(data_bytes_at(self.end % capacity));
        let (address, offset) = self.place(size);
        if offset == 0 && address != self.end {
            size = total(data_bytes_at(0));
        }
        if size > capacity || size > u32::MAX as u64 {
            return Err(full(size, self));
        }
        // `start <= end <= address`, so this cannot underflow.
        if address + size - self.start > capacity {
            return Err(full(size, self));
        }
        let block = Block {
            address,
            id: self.id_end,
            size: size as u32,
        };
        self.live.push_back(block);
        self.end = address + size;
        self.id_end = (self.id_end + 1) % ID_MAX;
        Ok(block)
    }

    /// The oldest live block: the next one to free.
    pub fn oldest(&self) -> Option<&Block> {
        self.live.front()
    }

    /// Free the oldest live block and return it (`None` when none is live).
    pub fn free_oldest(&mut self) -> Option<Block> {
        let capacity = self.capacity;
        let oldest = self.live.pop_front()?;
        self.id_start = (self.id_start + 1) % ID_MAX;
        match self.live.front() {
            // Move to the next block: it is less than a lap ahead of `start`.
            Some(next) => {
                let gap = (next.address % capacity + capacity - self.start % capacity) % capacity;
                self.start += gap;
                if self.start >= capacity {
                    // The oldest block is a whole lap ahead: move both ends back by one lap.
                    self.start -= capacity;
                    self.end -= capacity;
                }
            }
            // Nothing live: the line restarts at 0.
            None => (self.start, self.end) = (0, 0),
        }
        Some(oldest)
    }

    /// Free blocks oldest first while `is_free(block)` says so and fewer than `nbytes`
    /// bytes (of size) have been freed; stop at the first block still in use. A block is
    /// freed as soon as `is_free` returns true for it. The freed ids are consecutive:
    /// the result says which.
    pub fn free_while(&mut self, nbytes: u64, mut is_free: impl FnMut(&Block) -> bool) -> Freed {
        let mut freed = Freed {
            first_id: self.id_start,
            count: 0,
            bytes: 0,
        };
        while freed.bytes < nbytes && self.oldest().is_some_and(&mut is_free) {
            let oldest = self.free_oldest().expect("a block is live");
            freed.bytes += oldest.size as u64;
            freed.count += 1;
        }
        freed
    }

    /// Forget every block. Ids keep counting up; addresses restart at 0.
    pub fn clear(&mut self) {
        self.live.clear();
        self.start = 0;
        self.end = 0;
        self.id_start = self.id_end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_packed_tightly() {
        let mut a = FifoAllocator::new(200).unwrap();
        let c0 = a.allocate(100).unwrap();
        let c1 = a.allocate(80).unwrap();
        assert_eq!((c0.address, c0.id, c0.size), (0, 0, 108));
        assert_eq!((c1.address, c1.id, c1.size), (108, 1, 88));
        assert_eq!(a.end(), 196);
        assert!(a.allocate(1).is_err());
        assert_eq!(a.get(1), Some(&c1));
        assert_eq!(a.get(2), None);
    }

    #[test]
    fn wraps_to_the_next_lap_and_reports_full() {
        let mut a = FifoAllocator::new(100).unwrap();
        let c0 = a.allocate(20).unwrap(); // 0..28
        let c1 = a.allocate(30).unwrap(); // 28..66
        let err = a.allocate(40).unwrap_err(); // would need 100..148: span 148 > 100
        assert_eq!(err.needed, 48);
        assert!(err
            .to_string()
            .starts_with("Not enough space in the data buffer"));
        let freed = a.free_while(u64::MAX, |c| c.id == c0.id);
        assert_eq!(
            freed,
            Freed {
                first_id: c0.id,
                count: 1,
                bytes: 28
            }
        );
        assert_eq!(a.start(), 28);
        assert!(a.allocate(40).is_err()); // span 28..148 is still too long
        assert_eq!(a.allocate(12).unwrap().address, 66); // 66..86
        a.free_while(u64::MAX, |c| c.id == c1.id);
        assert_eq!(a.start(), 66);
        let c3 = a.allocate(30).unwrap(); // 38 bytes do not fit at 86: next lap
        assert_eq!((c3.address, c3.address % 100), (100, 0));
        assert_eq!(a.end(), 138);
    }

    #[test]
    fn empty_ring_restarts_at_zero_and_laps_move_back() {
        let mut a = FifoAllocator::new(100).unwrap();
        a.allocate(40).unwrap(); // 0..48
        a.allocate(40).unwrap(); // 48..96
        a.free_while(u64::MAX, |c| c.id == 0);
        let c = a.allocate(30).unwrap(); // next lap: 100..138
        assert_eq!(c.address, 100);
        // Freeing id 1 makes the block at 100 the oldest: a lap ahead, so both ends move.
        a.free_while(u64::MAX, |c| c.id == 1);
        assert_eq!((a.start(), a.end()), (0, 38));
        // Freeing everything restarts the line.
        a.free_while(u64::MAX, |_| true);
        assert_eq!((a.start(), a.end(), a.id_start()), (0, 0, 3));
        assert_eq!(a.allocate(92).unwrap().address, 0);
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
        assert_eq!((a.start(), a.end(), a.id_start()), (0, 0, ids.len() as u32));
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
    fn allocate_with_sizes_for_the_offset_it_lands_on() {
        let mut a = FifoAllocator::new(100).unwrap();
        a.allocate(50).unwrap(); // 0..58
        let mut asked = Vec::new();
        // 40 bytes at offset 58 would cross the end: asked again for offset 0.
        let c = a
            .allocate_with(|off| {
                asked.push(off);
                if off == 0 {
                    10
                } else {
                    40
                }
            })
            .unwrap_err();
        assert_eq!(asked, vec![58, 0]);
        assert_eq!(c.needed, 18); // 100 + 18 - 0 > 100: full until id 0 is freed
        a.free_while(u64::MAX, |_| true);
        let c = a.allocate_with(|off| off + 5).unwrap();
        assert_eq!((c.address, c.size), (0, 13));
    }

    #[test]
    fn clear_restarts_addresses_and_keeps_counting_ids() {
        let mut a = FifoAllocator::new(4096).unwrap();
        for _ in 0..5 {
            a.allocate(10).unwrap();
        }
        a.clear();
        assert_eq!(a.live().len(), 0);
        assert_eq!((a.start(), a.end(), a.id_start(), a.id_end()), (0, 0, 5, 5));
        let c = a.allocate(10).unwrap();
        assert_eq!((c.address, c.id), (0, 5));
    }
}
