//! The allocator of a data region in whole pages, shared by the tensor arena's writer
//! (`shmq::arena`) and the encoder cache's producer (`shmq::encoder_cache`).

use std::collections::BTreeMap;

use crate::segment::round_up;

/// Free ranges of a data region (offset → length, whole pages, coalesced), handed out
/// lowest first so that the reserved part of `/dev/shm` stays as small as the load allows.
#[derive(Debug)]
pub struct RangeAllocator {
    free: BTreeMap<usize, usize>,
    page: usize,
    capacity: usize,
}

impl RangeAllocator {
    pub fn new(capacity: usize, page: usize) -> RangeAllocator {
        let mut free = BTreeMap::new();
        free.insert(0, capacity);
        RangeAllocator {
            free,
            page,
            capacity,
        }
    }

    /// `len` rounded up to whole pages (at least one), or `None` if that is more than the
    /// whole region.
    pub fn rounded(&self, len: usize) -> Option<usize> {
        round_up(len.max(1), self.page).filter(|&r| r <= self.capacity)
    }

    /// Whether some free range holds `len` (rounded) bytes.
    pub fn fits(&self, len: usize) -> bool {
        self.free.values().any(|&l| l >= len)
    }

    /// The lowest free range of `len` (rounded) bytes.
    pub fn take(&mut self, len: usize) -> Option<usize> {
        let (&at, &have) = self.free.iter().find(|(_, &l)| l >= len)?;
        self.free.remove(&at);
        if have > len {
            self.free.insert(at + len, have - len);
        }
        Some(at)
    }

    /// Free `len` bytes at `offset` (a range [`take`](Self::take) gave), merged with the
    /// free ranges on either side.
    pub fn give_back(&mut self, mut offset: usize, mut len: usize) {
        if let Some((&prev, &plen)) = self.free.range(..offset).next_back() {
            if prev + plen == offset {
                self.free.remove(&prev);
                offset = prev;
                len += plen;
            }
        }
        if let Some(&nlen) = self.free.get(&(offset + len)) {
            self.free.remove(&(offset + len));
            len += nlen;
        }
        self.free.insert(offset, len);
    }

    /// Bytes not handed out.
    pub fn free_bytes(&self) -> usize {
        self.free.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_takes_lowest_and_coalesces() {
        let mut a = RangeAllocator::new(4 * 4096, 4096);
        assert_eq!(a.rounded(1), Some(4096));
        assert_eq!(a.rounded(0), Some(4096));
        assert_eq!(a.rounded(5 * 4096), None);
        let x = a.take(4096).unwrap();
        let y = a.take(8192).unwrap();
        let z = a.take(4096).unwrap();
        assert_eq!((x, y, z), (0, 4096, 12288));
        assert!(a.take(4096).is_none());
        a.give_back(x, 4096);
        a.give_back(z, 4096);
        assert!(a.take(8192).is_none(), "not contiguous");
        a.give_back(y, 8192);
        assert_eq!(a.free_bytes(), 4 * 4096);
        assert_eq!(a.take(4 * 4096), Some(0));
    }
}
