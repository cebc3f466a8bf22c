//! Property tests of the FIFO allocator against a simple model: the ring as a list of
//! occupied byte ranges. The model places a chunk right after the newest one (or at the
//! start of the ring if it would cross the end) and calls the ring full exactly when that
//! range overlaps a live chunk; the allocator decides by its live span instead.

use proptest::prelude::*;
use shmq::alloc::{Chunk, FifoAllocator, CHUNK_ALIGN, HEADER_BYTES, ID_MAX};
use std::collections::VecDeque;

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64),
    /// Free oldest-first with the first `in_use` live chunk (by position) still in use,
    /// and at most `nbytes` freed.
    Free {
        in_use: usize,
        nbytes: u64,
    },
    Clear,
}

fn ops(capacity: u64) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        4 => (0..capacity).prop_map(Op::Alloc),
        4 => (0..capacity / 4).prop_map(Op::Alloc),
        3 => (0usize..8, prop_oneof![Just(u64::MAX), 1..capacity]).prop_map(|(in_use, nbytes)| Op::Free { in_use, nbytes }),
        1 => Just(Op::Clear),
    ];
    proptest::collection::vec(op, 1..300)
}

/// The ring as occupied ranges of offsets.
struct Model {
    capacity: u64,
    /// Live chunks, oldest first: (offset, footprint, id).
    live: VecDeque<(u64, u64, u32)>,
    /// Offset after the newest chunk ever placed.
    tail: u64,
    next_id: u32,
}

impl Model {
    fn alloc(&mut self, data: u64) -> Option<(u64, u32)> {
        let size = data + HEADER_BYTES;
        if size > self.capacity {
            return None;
        }
        let off = if self.tail + size > self.capacity {
            0
        } else {
            self.tail
        };
        // Rounded up to the alignment, but never past the end of the ring.
        let fp = (size.div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN).min(self.capacity - off);
        if self
            .live
            .iter()
            .any(|&(o, f, _)| off < o + f && o < off + fp)
        {
            return None;
        }
        let id = self.next_id;
        self.live.push_back((off, fp, id));
        self.tail = off + fp;
        self.next_id = (id + 1) % ID_MAX;
        Some((off, id))
    }
}

fn check_invariants(a: &FifoAllocator) {
    let cap = a.capacity();
    let chunks: Vec<Chunk> = a.live().copied().collect();
    for c in &chunks {
        let fp = c.footprint as u64;
        assert!(
            c.address % cap + fp <= cap,
            "{c:?} crosses the end of the ring"
        );
        assert!(fp >= c.size as u64);
        assert_eq!(
            c.address % cap % CHUNK_ALIGN,
            0,
            "{c:?} is not aligned in the ring"
        );
    }
    for (i, x) in chunks.iter().enumerate() {
        for y in &chunks[i + 1..] {
            assert!(
                x.address + x.footprint as u64 <= y.address,
                "{x:?} and {y:?} are out of order"
            );
            let (xo, yo) = (x.address % cap, y.address % cap);
            let overlap = xo < yo + y.footprint as u64 && yo < xo + x.footprint as u64;
            assert!(!overlap, "{x:?} and {y:?} overlap in the ring");
        }
        assert_eq!(
            x.id,
            (chunks[0].id + i as u32) % ID_MAX,
            "ids are not consecutive"
        );
    }
    assert!(a.live_bytes() <= cap);
    if let Some(first) = chunks.first() {
        assert_eq!((first.address, first.id), (a.start(), a.id_start()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn allocator_matches_the_model(
        capacity in prop_oneof![(1u64..64).prop_map(|l| l * CHUNK_ALIGN), 9u64..4096],
        first_id in prop_oneof![Just(0u32), (ID_MAX - 16)..ID_MAX],
        ops in ops(4096),
    ) {
        let mut a = FifoAllocator::with_first_id(capacity, first_id).unwrap();
        let mut model = Model { capacity, live: VecDeque::new(), tail: 0, next_id: first_id };
        for op in ops {
            match op {
                Op::Alloc(n) => {
                    let got = a.allocate(n).ok().map(|c| (c.address % capacity, c.id, c.size as u64));
                    let want = model.alloc(n).map(|(off, id)| (off, id, n + HEADER_BYTES));
                    prop_assert_eq!(got, want, "allocate({})", n);
                }
                Op::Free { in_use, nbytes } => {
                    // The predicate sees candidates oldest first; a chunk is freed when
                    // it says yes, so record those.
                    let mut freed = Vec::new();
                    let result = a.free_while(nbytes, |c| {
                        let free = freed.len() < in_use;
                        if free {
                            freed.push(*c);
                        }
                        free
                    });
                    // FIFO: the freed chunks are the model's oldest, in order, and freeing
                    // stopped at the first in-use chunk or once nbytes were freed.
                    let mut freed_bytes = 0u64;
                    for c in &freed {
                        let (off, _, id) = model.live.pop_front().expect("the model has the chunk");
                        prop_assert_eq!((c.address % capacity, c.id), (off, id));
                        prop_assert!(freed_bytes < nbytes, "freed past nbytes");
                        freed_bytes += c.size as u64;
                    }
                    prop_assert_eq!(result.ids().collect::<Vec<_>>(), freed.iter().map(|c| c.id).collect::<Vec<_>>());
                    prop_assert_eq!(result.bytes, freed_bytes);
                    let stopped_early = freed.len() < in_use && !model.live.is_empty();
                    prop_assert!(!stopped_early || freed_bytes >= nbytes, "stopped before an in-use chunk without reaching nbytes");
                }
                Op::Clear => {
                    a.clear();
                    model.live.clear();
                }
            }
            check_invariants(&a);
            prop_assert_eq!(a.live().len(), model.live.len());
            prop_assert_eq!(a.id_end(), model.next_id);
        }
    }
}
