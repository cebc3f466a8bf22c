//! The regions of shared memory that shmq hands out to fill or to read (a queue's
//! `shmq::Loan` and `shmq::ArenaView`, the store's
//! `shmq::storage::StoreLoan` and `shmq::storage::PartView`,
//! and the private mapping under every view): one definition of their pointer, length
//! and slice access ([`region!`](macro@crate::region)), and of the raw range under them ([`RawRegion`]).

/// `len` bytes at `ptr`, inside a mapping that the region's owner keeps alive: the bytes
/// of a loan or of a private mapping. Made only through [`RawRegion::new`], whose
/// contract its slices rely on.
#[derive(Debug)]
pub struct RawRegion {
    ptr: *mut u8,
    len: usize,
}

impl RawRegion {
    /// The region `ptr..ptr + len`.
    ///
    /// # Safety
    /// For as long as the `RawRegion` lives, `ptr..ptr + len` must stay mapped, readable
    /// and writable in this process, and no other object of this process may make
    /// references to those bytes: its owner keeps the mapping alive and the range to
    /// itself (an arena lease, a pinned store block, a private mapping of its own). A
    /// peer process may still write them (a hostile one, or readers through a mapping
    /// of their own): that changes byte values, which any bit pattern is, never memory
    /// safety.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawRegion {
        RawRegion { ptr, len }
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for RawRegion {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the contract of `new`: mapped, and no other reference in this process.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for RawRegion {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only slice made from it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// `as_ptr`, `len`, `is_empty` and `Deref<Target = [u8]>` (with `mut`: `DerefMut` too)
/// for a region type whose bytes are its field `$field` (a `PrivateMap` or a
/// [`RawRegion`]), so that every region type gives its bytes the same way.
#[macro_export]
macro_rules! region {
    ($ty:ty, $field:ident) => {
        impl $ty {
            /// The first byte of the region.
            pub fn as_ptr(&self) -> *mut u8 {
                self.$field.as_ptr()
            }
            /// The region's length in bytes.
            pub fn len(&self) -> usize {
                self.$field.len()
            }
            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }
        }

        impl std::ops::Deref for $ty {
            type Target = [u8];
            fn deref(&self) -> &[u8] {
                &self.$field
            }
        }
    };
    ($ty:ty, $field:ident, mut) => {
        $crate::region!($ty, $field);

        impl std::ops::DerefMut for $ty {
            fn deref_mut(&mut self) -> &mut [u8] {
                &mut self.$field
            }
        }
    };
}
