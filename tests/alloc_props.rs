//! Property tests of the FIFO allocator against two models.
//!
//! - **vLLM 0.33's arithmetic** (`SingleWriterShmRingBuffer`: `allocate_buf`,
//!   `free_buf`, `clear`), restated here from its documented behaviour: the addresses,
//!   ids, `data_buffer_start`/`data_buffer_end` and "full" decisions must be the same.
//! - **The ring as occupied byte ranges**: whatever the arithmetic, live blocks never
//!   overlap in the ring, never cross its end, and their ids are consecutive.

use proptest::prelude::*;
use shmq::alloc::{Block, FifoAllocator, HEADER_BYTES, ID_MAX};
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64),
    /// Free oldest-first with the first `in_use` live blocks (by position) free, and
    /// at most `nbytes` freed.
    Free {
        in_use: usize,
        nbytes: Option<u64>,
    },
    Clear,
}

fn ops(capacity: u64) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        4 => (1..capacity).prop_map(Op::Alloc),
        4 => (1..(capacity / 4).max(2)).prop_map(Op::Alloc),
        3 => (0usize..8, prop_oneof![Just(None), (1..capacity).prop_map(Some)])
            .prop_map(|(in_use, nbytes)| Op::Free { in_use, nbytes }),
        1 => Just(Op::Clear),
    ];
    proptest::collection::vec(op, 1..300)
}

/// vLLM 0.33's ring-buffer bookkeeping, as plain integers.
struct VllmModel {
    size: u64,
    start: u64,
    end: u64,
    id_start: u32,
    id_end: u32,
    /// id → address of live blocks (vLLM's `metadata`).
    metadata: BTreeMap<u32, u64>,
    /// id → block size (header included), what vLLM reads back from the header.
    sizes: BTreeMap<u32, u64>,
}

impl VllmModel {
    fn allocate(&mut self, data: u64) -> Option<(u64, u32)> {
        let size = data + HEADER_BYTES;
        let mut reset = self.end % self.size;
        if reset + size > self.size {
            reset = (self.end / self.size + 1) * self.size;
        } else {
            reset = self.end;
        }
        if reset + size - self.start > self.size {
            return None;
        }
        self.end = reset;
        let (address, id) = (self.end, self.id_end);
        self.metadata.insert(id, address);
        self.sizes.insert(id, size);
        self.end += size;
        self.id_end = (self.id_end + 1) % ID_MAX;
        Some((address, id))
    }

    /// Returns the freed ids.
    fn free(&mut self, mut is_free: impl FnMut(u32) -> bool, nbytes: Option<u64>) -> Vec<u32> {
        let nbytes = nbytes.unwrap_or(self.size);
        let mut freed_bytes = 0;
        let mut freed = Vec::new();
        while self.metadata.contains_key(&self.id_start) && freed_bytes < nbytes {
            let id = self.id_start;
            if !is_free(id) {
                break;
            }
            self.metadata.remove(&id);
            self.id_start = (self.id_start + 1) % ID_MAX;
            if let Some(&next) = self.metadata.get(&self.id_start) {
                let gap = (next as i128 - self.start as i128).rem_euclid(self.size as i128);
                self.start += gap as u64;
            } else {
                self.start = 0;
                self.end = 0;
            }
            freed_bytes += self.sizes.remove(&id).unwrap();
            freed.push(id);
        }
        if self.start >= self.size {
            self.start -= self.size;
            self.end -= self.size;
        }
        freed
    }

    fn clear(&mut self) {
        self.metadata.clear();
        self.sizes.clear();
        self.id_start = self.id_end;
        self.start = 0;
        self.end = 0;
    }
}

fn check_layout(a: &FifoAllocator) {
    let cap = a.capacity();
    let blocks: Vec<Block> = a.live().copied().collect();
    for c in &blocks {
        assert!(
            c.address % cap + c.size as u64 <= cap,
            "{c:?} crosses the end of the ring"
        );
        assert!(c.address < 2 * cap, "{c:?}: addresses stay below two laps");
    }
    for (i, x) in blocks.iter().enumerate() {
        for y in &blocks[i + 1..] {
            let (xo, yo) = (x.address % cap, y.address % cap);
            let overlap = xo < yo + y.size as u64 && yo < xo + x.size as u64;
            assert!(!overlap, "{x:?} and {y:?} overlap in the ring");
        }
        assert_eq!(
            x.id,
            (blocks[0].id + i as u32) % ID_MAX,
            "ids are not consecutive"
        );
    }
    assert!(a.live_bytes() <= cap);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn allocator_is_vllms_arithmetic(
        capacity in prop_oneof![9u64..64, 64u64..4096],
        first_id in prop_oneof![Just(0u32), (ID_MAX - 16)..ID_MAX],
        ops in ops(4096),
    ) {
        let mut a = FifoAllocator::with_first_id(capacity, first_id).unwrap();
        let mut model = VllmModel {
            size: capacity, start: 0, end: 0, id_start: first_id, id_end: first_id,
            metadata: BTreeMap::new(), sizes: BTreeMap::new(),
        };
        for op in ops {
            match op {
                Op::Alloc(n) => {
                    let got = a.allocate(n).ok().map(|c| (c.address, c.id));
                    // vLLM would raise for a block larger than the ring too.
                    let want = if n + HEADER_BYTES > capacity { None } else { model.allocate(n) };
                    prop_assert_eq!(got, want, "allocate({})", n);
                }
                Op::Free { in_use, nbytes } => {
                    let mut seen = 0;
                    let result = a.free_while(nbytes.unwrap_or(capacity), |_| {
                        seen += 1;
                        seen <= in_use
                    });
                    let mut seen = 0;
                    let want = model.free(|_| { seen += 1; seen <= in_use }, nbytes);
                    prop_assert_eq!(result.ids().collect::<Vec<_>>(), want);
                }
                Op::Clear => {
                    a.clear();
                    model.clear();
                }
            }
            check_layout(&a);
            prop_assert_eq!((a.start(), a.end()), (model.start, model.end));
            prop_assert_eq!((a.id_start(), a.id_end()), (model.id_start, model.id_end));
            let live: BTreeMap<u32, u64> = a.live().map(|c| (c.id, c.address)).collect();
            prop_assert_eq!(live, model.metadata.clone());
        }
    }
}
