//! Private copy-on-write views of a segment: what readers hand out as zero-copy buffers.
//!
//! A [`PrivateFile`] is a read-only descriptor of a segment; [`PrivateFile::map`] maps a
//! byte range of it `MAP_PRIVATE`, in whole pages. Reading costs nothing (the pages are
//! the segment's own, shared with the writer); the first write to a page gives this
//! mapping a private copy of it, so the writer, other readers and other views never see
//! the write; unmapping (dropping the [`PrivateMap`]) discards those copies. Each view
//! has a mapping of its own, so two views of the same bytes are independent too.
//!
//! What a view shows of pages it has not written is the segment's current content: the
//! layer above must keep the writer off a range while a view of it lives (the arena's
//! holds, the store's reader counts).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// The system's page size (mappings are made in whole pages).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// A read-only descriptor of a segment, to map ranges of it privately.
#[derive(Debug)]
pub struct PrivateFile {
    fd: OwnedFd,
    /// The segment's length when opened: no mapping may reach past it.
    len: u64,
    name: String,
}

impl PrivateFile {
    /// Open the segment `name` (in `/dev/shm`) read-only.
    pub fn open(name: &str) -> Result<PrivateFile> {
        let c_name = std::ffi::CString::new(format!("/{name}"))
            .map_err(|_| Error::InvalidArgument(format!("invalid segment name {name:?}")))?;
        // SAFETY: a valid NUL-terminated name. Read-only is enough for MAP_PRIVATE maps
        // that are written into: the writes go to private pages.
        let fd = unsafe { libc::shm_open(c_name.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            return Err(Error::os(
                format!("opening shared memory segment '{name}'"),
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: shm_open returned a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = std::fs::File::from(
            fd.try_clone()
                .map_err(|e| Error::os(format!("duplicating the descriptor of '{name}'"), e))?,
        )
        .metadata()
        .map_err(|e| Error::os(format!("reading the size of '{name}'"), e))?
        .len();
        Ok(PrivateFile {
            fd,
            len,
            name: name.to_owned(),
        })
    }

    /// Map `len` bytes at `offset` of the segment privately (copy-on-write). The range
    /// must lie inside the segment as it was when opened.
    pub fn map(&self, offset: u64, len: usize) -> Result<PrivateMap> {
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|e| e > self.len) {
            return Err(Error::InvalidArgument(format!(
                "bytes {offset}..+{len} lie outside segment '{}' ({} bytes)",
                self.name, self.len
            )));
        }
        if len == 0 {
            return Ok(PrivateMap {
                map: None,
                ptr: NonNull::dangling().as_ptr(),
                len: 0,
            });
        }
        let page = page_size() as u64;
        let start = offset / page * page;
        let map_len = ((offset + len as u64).div_ceil(page) * page - start) as usize;
        // SAFETY: a new private mapping of whole pages of the segment, all inside the
        // file (checked above against its length when opened; only the segment's owner,
        // who created it 0600, could shrink it and make a later access SIGBUS).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                self.fd.as_raw_fd(),
                start as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::os(
                format!("mapping {len} bytes of segment '{}'", self.name),
                std::io::Error::last_os_error(),
            ));
        }
        let p = p as *mut u8;
        Ok(PrivateMap {
            map: Some((p, map_len)),
            // SAFETY: the offset within the first page is below `map_len`.
            ptr: unsafe { p.add((offset - start) as usize) },
            len,
        })
    }
}

/// A private (copy-on-write) mapping of a segment's bytes, unmapped when dropped.
pub struct PrivateMap {
    map: Option<(*mut u8, usize)>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is this object's alone (nothing else in this process maps those
// pages through it), so moving it between threads is like moving a Vec.
unsafe impl Send for PrivateMap {}
// SAFETY: `&PrivateMap` gives shared access to the bytes only.
unsafe impl Sync for PrivateMap {}

impl std::fmt::Debug for PrivateMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrivateMap")
            .field("len", &self.len)
            .finish()
    }
}

impl PrivateMap {
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

impl PrivateMap {
    /// Give this mapping a private copy of every page it has not written yet, so that it
    /// no longer shows later changes of the segment (one copy of the bytes).
    // Used by the Python bindings' `acquire_read`.
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    pub fn detach(&self) {
        let Some((p, n)) = self.map else { return };
        let page = page_size();
        for k in (0..n).step_by(page) {
            // SAFETY: `p + k` lies in this object's own writable mapping, only accessed
            // through atomics here. A compare-exchange of a byte with itself writes the
            // page (a copy-on-write fault makes it private) without changing it, even if
            // another thread writes the same byte meanwhile (then that write made the page
            // private already). Not `fetch_or(0)`: compilers turn an idempotent relaxed
            // RMW into a plain load, which writes nothing.
            let byte = unsafe { std::sync::atomic::AtomicU8::from_ptr(p.add(k)) };
            // Relaxed: only the write fault matters, not any ordering.
            let v = byte.load(std::sync::atomic::Ordering::Relaxed);
            let _ = byte.compare_exchange(
                v,
                v,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
    }
}

impl PrivateMap {
    /// Replace this mapping's pages, in place, by zero pages of its own: whatever still
    /// points into it (a raw pointer kept without a buffer export) reads zeros from now
    /// on, never the segment's later content, and nothing is copied.
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    pub fn retire(&self) -> Result<()> {
        let Some((p, n)) = self.map else {
            return Ok(());
        };
        // SAFETY: `p..p+n` is exactly this object's own mapping; MAP_FIXED replaces it
        // with fresh anonymous memory at the same address (nothing else of this process
        // lives there), which the unmap in `drop` later removes as before.
        let q = unsafe {
            libc::mmap(
                p as *mut libc::c_void,
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if q == libc::MAP_FAILED {
            return Err(Error::os(
                "retiring a view of shared memory",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

impl std::ops::Deref for PrivateMap {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` lies in this object's own mapping, alive until drop.
        // Pages not yet written here show the segment's bytes, which the layer above
        // keeps the writer from changing while the view lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for PrivateMap {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; writes go to private copy-on-write pages.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PrivateMap {
    fn drop(&mut self) {
        if let Some((p, n)) = self.map.take() {
            // SAFETY: our own mapping from `PrivateFile::map`, unmapped once; nothing refers
            // to it any more (the bindings drop a view only after its last buffer export).
            unsafe { libc::munmap(p as *mut libc::c_void, n) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::{unique_name, Segment};

    #[test]
    fn private_writes_stay_private_and_bounds_are_checked() {
        let seg = Segment::create(&unique_name("test"), 3 * page_size()).unwrap();
        // SAFETY: the segment is 3 pages long and only this thread uses it.
        unsafe { std::ptr::write_bytes(seg.as_ptr(), 7, 3 * page_size()) };
        let f = PrivateFile::open(seg.name()).unwrap();
        let mut a = f.map(100, 5000).unwrap();
        let b = f.map(100, 5000).unwrap();
        assert!(a.iter().all(|&x| x == 7));
        a[0] = 1;
        assert_eq!((a[0], b[0]), (1, 7));
        // SAFETY: in bounds; only this thread uses the segment.
        let shared = unsafe { *seg.as_ptr().add(100) };
        assert_eq!(shared, 7, "a private write reached the segment");
        // The segment's later changes show on pages a view has not written.
        let next_page = page_size(); // view index of the segment's byte 100 + page_size
                                     // SAFETY: in bounds (100 + page_size < 3 pages).
        unsafe { *seg.as_ptr().add(100 + next_page) = 9 };
        assert_eq!((a[next_page], b[next_page]), (9, 9));
        // Detached, a view no longer follows the segment.
        b.detach();
        // SAFETY: in bounds (100 + page_size + 1 < 3 pages).
        unsafe { *seg.as_ptr().add(101 + next_page) = 8 };
        assert_eq!((a[next_page + 1], b[next_page + 1]), (8, 7));
        // Retired, a view reads zeros, whatever the segment holds.
        a.retire().unwrap();
        assert!(a.iter().all(|&x| x == 0));
        assert!(f.map(0, 3 * page_size() + 1).is_err());
        assert!(f.map(u64::MAX, 1).is_err());
        assert_eq!(f.map(5, 0).unwrap().len(), 0);
    }
}
