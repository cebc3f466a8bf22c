//! Which bytes of a producer's data region are backed by pages of `/dev/shm` now: the
//! producer's own bookkeeping (no shared memory, no system calls: the producer makes
//! those and records them here).
//!
//! The data region is a sparse file range. The producer reserves pages
//! (`fallocate`) up to a high-water mark as entries first need them, in steps, so
//! that a full `/dev/shm` is an error at `save` and never a `SIGBUS` at a later write.
//! When `/dev/shm` runs out before the cache's capacity does, the producer evicts what
//! may go and gives the pages of free ranges back to `/dev/shm` (`MADV_REMOVE`, a hole
//! punched in the file): a free tail lowers the mark, a free range below it becomes a
//! *hole*, which is reserved again before a later entry is written there.
//!
//! Invariant (the producer keeps it): every hole is free in the allocator, and every
//! range handed out to an entry is backed (reserved below the mark and in no hole).

use std::collections::BTreeMap;

/// The backed part of a data region: `[0, mark)` minus the holes.
#[derive(Debug, Default)]
pub(crate) struct Backing {
    /// Bytes from the region's start that were reserved (some may be holes since).
    mark: usize,
    /// Punched ranges below `mark` (start → length), disjoint, none touching another.
    holes: BTreeMap<usize, usize>,
    hole_bytes: usize,
}

impl Backing {
    pub fn new() -> Backing {
        Backing::default()
    }

    /// The high-water mark: nothing at or above it is backed.
    pub fn mark(&self) -> usize {
        self.mark
    }

    /// Bytes backed in `/dev/shm` now.
    pub fn backed_bytes(&self) -> usize {
        self.mark - self.hole_bytes
    }

    /// The parts of `[a, b)` that are not backed, in order (holes, then what lies above
    /// the mark).
    pub fn missing(&self, a: usize, b: usize) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = self
            .holes_overlapping(a, b)
            .into_iter()
            .map(|(s, e)| (s.max(a), e.min(b)))
            .collect();
        if b > self.mark {
            out.push((a.max(self.mark), b));
        }
        out
    }

    /// The parts of `[a, b)` that are backed, in order.
    pub fn backed(&self, a: usize, b: usize) -> Vec<(usize, usize)> {
        let b = b.min(self.mark);
        let mut out = Vec::new();
        let mut at = a;
        for (s, e) in self.holes_overlapping(a, b) {
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        }
        if at < b {
            out.push((at, b));
        }
        out
    }

    /// `[a, b)` was reserved: it is backed now. Above the mark it must start at or below
    /// the mark (reservations grow the backed prefix without gaps).
    pub fn fill(&mut self, a: usize, b: usize) {
        if a >= b {
            return;
        }
        for (s, e) in self.holes_overlapping(a, b) {
            self.holes.remove(&s);
            self.hole_bytes -= e - s;
            if s < a {
                self.add_hole(s, a);
            }
            if e > b {
                self.add_hole(b, e);
            }
        }
        if b > self.mark {
            assert!(
                a <= self.mark,
                "a reservation left a gap: [{a}, {b}) above {}",
                self.mark
            );
            self.mark = b;
        }
    }

    /// `[a, b)` (below the mark, backed, free) was given back to `/dev/shm`.
    pub fn punch(&mut self, a: usize, b: usize) {
        if a >= b {
            return;
        }
        assert!(
            b <= self.mark,
            "punched [{a}, {b}) above the mark {}",
            self.mark
        );
        self.add_hole(a, b);
        // A hole that reaches the mark is no hole: the mark comes down to its start.
        if let Some((&s, &len)) = self.holes.iter().next_back() {
            if s + len == self.mark {
                self.holes.remove(&s);
                self.hole_bytes -= len;
                self.mark = s;
            }
        }
    }

    /// Holes overlapping `[a, b)`, as `(start, end)`, in order.
    fn holes_overlapping(&self, a: usize, b: usize) -> Vec<(usize, usize)> {
        if a >= b {
            return Vec::new();
        }
        // Holes are disjoint and sorted, so their ends are sorted too: walk back from
        // the last one starting before `b` while they still end after `a`.
        let mut out: Vec<(usize, usize)> = self
            .holes
            .range(..b)
            .rev()
            .map(|(&s, &len)| (s, s + len))
            .take_while(|&(_, e)| e > a)
            .collect();
        out.reverse();
        out
    }

    /// Record the hole `[a, b)` (which overlaps no hole), merged with holes it touches.
    fn add_hole(&mut self, mut a: usize, mut b: usize) {
        self.hole_bytes += b - a;
        if let Some((&s, &len)) = self.holes.range(..a).next_back() {
            debug_assert!(s + len <= a, "holes overlap");
            if s + len == a {
                self.holes.remove(&s);
                a = s;
            }
        }
        if let Some(&len) = self.holes.get(&b) {
            self.holes.remove(&b);
            b += len;
        }
        self.holes.insert(a, b - a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_punch_and_refill() {
        let mut b = Backing::new();
        assert_eq!(b.missing(0, 10), vec![(0, 10)]);
        b.fill(0, 100);
        assert_eq!((b.mark(), b.backed_bytes()), (100, 100));
        assert!(b.missing(0, 100).is_empty());
        assert_eq!(b.missing(90, 120), vec![(100, 120)]);
        // Holes in the middle merge with their neighbours.
        b.punch(10, 20);
        b.punch(30, 40);
        b.punch(20, 30);
        assert_eq!(b.backed_bytes(), 70);
        assert_eq!(b.missing(0, 100), vec![(10, 40)]);
        assert_eq!(b.backed(0, 100), vec![(0, 10), (40, 100)]);
        assert_eq!(b.missing(15, 25), vec![(15, 25)]);
        // Refilling part of a hole splits it.
        b.fill(15, 25);
        assert_eq!(b.missing(0, 100), vec![(10, 15), (25, 40)]);
        assert_eq!(b.backed_bytes(), 80);
        // A hole reaching the mark lowers it, through the holes it then touches.
        b.punch(15, 25);
        b.punch(40, 100);
        assert_eq!((b.mark(), b.backed_bytes()), (10, 10));
        assert!(b.missing(0, 10).is_empty());
        assert_eq!(b.missing(0, 50), vec![(10, 50)]);
        // Growth from the mark.
        b.fill(10, 60);
        assert_eq!((b.mark(), b.backed_bytes()), (60, 60));
        assert_eq!(b.backed(0, 200), vec![(0, 60)]);
    }

    #[test]
    fn random_operations_match_a_page_map() {
        let n = 64;
        let mut model = vec![false; n];
        let mut b = Backing::new();
        let mut rng = 0x9E37_79B9u64;
        let mut next = |m: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % m as u64) as usize
        };
        for _ in 0..20_000 {
            let x = next(n);
            let y = x + 1 + next(n - x);
            match next(3) {
                0 if x <= b.mark() => {
                    b.fill(x, y);
                    model[x..y].iter_mut().for_each(|p| *p = true);
                }
                1 if y <= b.mark() => {
                    // The producer punches only what is backed.
                    for (s, e) in b.backed(x, y) {
                        b.punch(s, e);
                    }
                    model[x..y].iter_mut().for_each(|p| *p = false);
                }
                _ => {}
            }
            let backed: Vec<bool> = (0..n)
                .map(|i| b.backed(i, i + 1) == vec![(i, i + 1)])
                .collect();
            assert_eq!(backed, model);
            assert_eq!(b.backed_bytes(), model.iter().filter(|&&p| p).count());
            let missing: usize = b.missing(0, n).iter().map(|(s, e)| e - s).sum();
            assert_eq!(missing, n - b.backed_bytes());
            assert!(
                b.mark() == 0 || model[b.mark() - 1],
                "the mark sits on a backed byte"
            );
        }
    }
}
