//! Private copy-on-write views of a segment: what readers hand out as zero-copy buffers.
//!
//! A [`PrivateFile`] is a read-only descriptor of a segment. Its views are `MAP_PRIVATE`
//! pages of the segment: reading costs nothing (the pages are the segment's own, shared
//! with the writer); the first write to a page gives this process a private copy of it,
//! so the writer, other readers and other views never see the write.
//!
//! # One mapping that stays: [`PrivateFile::view`]
//! Mapping every view anew costs, per message, an `mmap`, a page fault on the first touch
//! of every page and a `munmap` (measured in `docs/performance.md`, "Copies and
//! mappings"). So a process maps the whole segment privately once (its
//! *window*) and carves views out of it; the page tables stay warm from one message to
//! the next. What a view wrote must not outlive it (a later message placed in the same
//! memory would show this reader's old writes), so when a view goes, the pages it wrote
//! are dropped with `MADV_DONTNEED` and show the segment again. Which pages were written
//! is what Linux tells in `/proc/self/pagemap`: a page of a private file mapping that is
//! present and no longer the file's page is a private copy (or it was swapped out). Only
//! those are dropped, so pages that were only read keep their page-table entries. Where
//! pagemap cannot be read, the whole range is dropped (correct, only slower).
//!
//! Two live views of the same pages would share the window's private copies (a write
//! through one would show in the other), so a view whose pages overlap a live view of
//! the window gets a mapping of its own instead ([`PrivateFile::map`], unmapped when
//! dropped), as does a range past the window.
//!
//! Limits: a process whose memory is locked by default (`mlockall(MCL_FUTURE)`) or that
//! runs under strict overcommit gets no window (views map on their own). One that locks
//! its memory with `mlockall(MCL_CURRENT)` *after* it made a window makes the kernel copy
//! every page of the window in privately, as the segment was then: a later message in
//! memory that no view has shown since would read those stale copies (zeros, say). So a
//! page that nothing ever touches (the *lock sentinel*, mapped before the first window)
//! tells whether the process was locked since: the lock faults it in (`mincore`), and
//! from then on each view first drops the private copies in its range (pagemap, and
//! `MADV_DONTNEED_LOCKED`), or maps on its own where they cannot be dropped. A
//! pointer kept past its view reads whatever the window shows later, where one past a
//! view mapped on its own would fault: the bindings hand out buffers that keep their view alive, never raw pointers.
//!
//! What a view shows of pages it has not written is the segment's current content: the
//! layer above must keep the writer off a range while a view of it lives (the arena's
//! holds, the store's pins, the encoder cache's entry pins).
//!
//! What a sealed loan costs in mappings is counted in `crate::map_budget`.
#![allow(
    clippy::disallowed_methods,
    reason = "the segment module: it maps segment files private (clippy.toml)"
)]

use shmq_protocol::sync::local::{AtomicBool, Ordering};
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::region;
use crate::region::RawRegion;
use crate::segment_file::{Access, SegmentFile};

pub use crate::segment::page_size;

/// A read-only descriptor of a segment, to map ranges of it privately.
#[derive(Debug)]
pub struct PrivateFile {
    file: SegmentFile,
    /// The segment's length when opened: no mapping may reach past it.
    len: u64,
    name: String,
    /// The whole segment mapped privately, made at the first [`view`](Self::view);
    /// `None` if that mapping failed (views then map on their own).
    window: OnceLock<Option<Arc<Window>>>,
    /// Whether the `SIGBUS` handler found one of this file's mappings truncated (see
    /// `crate::sigbus`); every mapping made here is registered with it.
    sigbus: crate::sigbus::Watch,
    /// Set once [`check_intact`](Self::check_intact) found the file shorter than when
    /// opened: it stays an error if the file is grown again (what was lost is zeros).
    shrunk: AtomicBool,
    /// The whole segment mapped shared and read-only, made at the first
    /// [`shared`](Self::shared) (what a device registers and copies from).
    shared: Mutex<Option<Arc<SharedView>>>,
}

impl PrivateFile {
    /// Open the segment `name` (in `/dev/shm`) read-only.
    ///
    /// # Errors
    ///
    /// [`Error::SegmentNotFound`], [`Error::NotOwned`] or [`Error::Os`] when segment `name`
    /// cannot be opened read-only (gone, not this user's, open to others), or its size
    /// cannot be read.
    pub fn open(name: &str) -> Result<PrivateFile> {
        // Read-only is enough for MAP_PRIVATE maps that are written into: the writes go
        // to private pages, and no view can ever write the segment.
        let file = SegmentFile::open(name, Access::ReadOnly)?;
        let len = file
            .size()
            .map_err(|e| Error::os(format!("reading the size of '{name}'"), e))?;
        Ok(PrivateFile {
            file,
            len,
            name: name.to_owned(),
            window: OnceLock::new(),
            sigbus: crate::sigbus::Watch::new(),
            shrunk: AtomicBool::new(false),
            shared: Mutex::new(None),
        })
    }

    /// The whole segment, as long as it was when opened, mapped *shared* and read-only
    /// in this process: made once, on the first call, and kept while this file or any
    /// holder of the returned `Arc` lives. It shows the segment's bytes as they are now
    /// (no copy-on-write): what a device registers once and copies ranges from, each
    /// while the layer above holds the range (a view of it: its lease, pin or entry
    /// pin), so that the writer leaves the bytes alone meanwhile.
    ///
    /// # Errors
    ///
    /// [`Error::BadSegment`] when the segment was found truncated; [`Error::Os`] when
    /// `mmap` fails (no address space left).
    pub fn shared(&self) -> Result<Arc<SharedView>> {
        self.check_intact()?;
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = shared.as_ref() {
            return Ok(s.clone());
        }
        let len = self.len as usize;
        if len == 0 {
            return Err(Error::InvalidArgument(format!(
                "segment '{}' is empty: nothing to map",
                self.name
            )));
        }
        // SAFETY: a new shared read-only mapping of the whole file, as long as it was when
        // opened (and still is: `check_intact` above). Nothing in this process writes it
        // (PROT_READ). A process of the same user may write the bytes (they are the
        // segment's: values change, never memory safety) or shrink the file: an access of
        // the lost pages is then a SIGBUS, which the handler the mapping is registered
        // with (below) turns into zero pages and an error (`crate::sigbus`).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::os(
                format!("mapping segment '{}' shared", self.name),
                std::io::Error::last_os_error(),
            ));
        }
        let p = p as *mut u8;
        let view = Arc::new(SharedView {
            sigbus: self.sigbus.protect(p, len),
            ptr: p,
            len,
        });
        *shared = Some(view.clone());
        Ok(view)
    }

    /// The range must lie inside the segment as it was when opened, and the segment must
    /// still be that long: a peer that truncated it makes this an error
    /// (`crate::sigbus::truncated`) before any page of the range is touched (one
    /// `fstat`). A truncation after this check is caught by the `SIGBUS` handler.
    fn check_range(&self, offset: u64, len: usize) -> Result<()> {
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|e| e > self.len) {
            return Err(Error::InvalidArgument(format!(
                "bytes {offset}..+{len} lie outside segment '{}' ({} bytes)",
                self.name, self.len
            )));
        }
        self.check_intact()
    }

    /// An error once the segment is shorter than when opened (an `fstat`; and from then
    /// on, even if it is grown again), or a mapping of it was found truncated.
    ///
    /// # Errors
    ///
    /// [`Error::BadSegment`] when the file is shorter now than when it was opened, or a
    /// mapping of it was found truncated (the `SIGBUS` handler's flag).
    pub fn check_intact(&self) -> Result<()> {
        self.check_faults()?;
        // A peer may have truncated the file since it was opened: its size now (fstat).
        if let Ok(now) = self.file.size() {
            if now < self.len {
                // Relaxed: the flag carries no data; the error is built from the size now.
                self.shrunk.store(true, Ordering::Relaxed);
                return Err(crate::sigbus::truncated_to(
                    &self.name,
                    self.len as usize,
                    now,
                ));
            }
        }
        Ok(())
    }

    /// An error once a mapping made here was found truncated (the `SIGBUS` handler's
    /// flag), or [`check_intact`](Self::check_intact) found the file short: atomic
    /// loads, no system call.
    ///
    /// # Errors
    ///
    /// [`Error::BadSegment`] when a mapping made here hit a truncation, or
    /// [`check_intact`](Self::check_intact) found the file short before.
    pub fn check_faults(&self) -> Result<()> {
        // Relaxed: as in `check_intact`.
        if self.sigbus.hit() || self.shrunk.load(Ordering::Relaxed) {
            return Err(crate::sigbus::truncated(&self.name, self.len as usize));
        }
        Ok(())
    }

    /// A private (copy-on-write) view of `len` bytes at `offset`, carved out of this
    /// process's window of the segment (see the module docs): no mapping is made, and
    /// pages read through earlier views need no new page fault. A range that overlaps a
    /// live view, or that the window cannot hold, is mapped on its own ([`map`](Self::map)).
    /// The range must lie inside the segment as it was when opened.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `offset..offset + len` does not lie inside the
    /// segment as opened; [`Error::BadSegment`] when it was truncated since; [`Error::Os`]
    /// when a mapping cannot be made.
    pub fn view(&self, offset: u64, len: usize) -> Result<PrivateMap> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(PrivateMap::empty(offset));
        }
        let window = self
            .window
            .get_or_init(|| Window::map(&self.file, self.len as usize, &self.sigbus).map(Arc::new));
        if let Some(window) = window {
            let page = page_size() as u64;
            let start = (offset / page * page) as usize;
            let end = ((offset + len as u64).div_ceil(page) * page) as usize;
            if window.claim(start, end) && window.fresh(start, end) {
                // SAFETY: `offset + len <= self.len`, the window's length.
                let ptr = unsafe { window.base.add(offset as usize) };
                return Ok(PrivateMap {
                    file_offset: offset,
                    sigbus: None,
                    // SAFETY: the range lies in the window's pages `start..end`, which this
                    // view has claimed (no other live view has them) and which stay mapped
                    // while the view holds the window. Pages not yet written here show the
                    // segment's bytes, which the layer above keeps the writer from changing
                    // while the view lives.
                    bytes: unsafe { RawRegion::new(ptr, len) },
                    map: Mapping::Window {
                        window: window.clone(),
                        start,
                        end,
                    },
                });
            }
        }
        self.map(offset, len)
    }

    /// Map `len` bytes at `offset` of the segment privately (copy-on-write), in a mapping
    /// of this view's own (unmapped when it is dropped). The range must lie inside the
    /// segment as it was when opened.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `offset..offset + len` does not lie inside the
    /// segment as opened; [`Error::BadSegment`] when it was truncated since; [`Error::Os`]
    /// when `mmap` fails.
    pub fn map(&self, offset: u64, len: usize) -> Result<PrivateMap> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(PrivateMap::empty(offset));
        }
        let page = page_size() as u64;
        let start = offset / page * page;
        let map_len = ((offset + len as u64).div_ceil(page) * page - start) as usize;
        // SAFETY: a new private mapping of whole pages of the segment, all inside the
        // file (checked above against its length when opened and now). A process of the
        // same user that shrinks the file later makes an access of the lost pages fault:
        // the mapping is registered with the SIGBUS handler (below), which puts zero
        // pages there and flags the file (`crate::sigbus`), so that is an error, not a crash.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                self.file.as_raw_fd(),
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
        // SAFETY: the offset within the first page is below `map_len`.
        let ptr = unsafe { p.add((offset - start) as usize) };
        Ok(PrivateMap {
            file_offset: offset,
            sigbus: Some(self.sigbus.protect(p, map_len)),
            map: Mapping::Own(p, map_len),
            // SAFETY: the range lies in this view's own mapping, made just above and
            // unmapped only when the view is dropped; writes go to private copy-on-write
            // pages. Pages not yet written show the segment's bytes, which the layer above
            // keeps the writer from changing while the view lives.
            bytes: unsafe { RawRegion::new(ptr, len) },
        })
    }
}

/// A process's private mapping of a whole segment, out of which views are carved.
struct Window {
    base: *mut u8,
    len: usize,
    /// Page ranges of the live views carved out of it (start → end), never overlapping.
    live: Mutex<BTreeMap<usize, usize>>,
    /// Its entry in the `SIGBUS` registry, released before it is unmapped.
    sigbus: crate::sigbus::Guard,
}

// SAFETY: the mapping lives as long as the Window; the bytes are only reached through the
// views (each its own range, see `claim`), and `live` is behind a mutex.
unsafe impl Send for Window {}
// SAFETY: as above: `&Window` gives access to the claim table only.
unsafe impl Sync for Window {}

impl Window {
    /// Map all `len` bytes of `file` privately; `None` if the mapping fails.
    fn map(file: &SegmentFile, len: usize, sigbus: &crate::sigbus::Watch) -> Option<Window> {
        if len == 0 {
            return None;
        }
        if let Some(why) = window_unfit() {
            shmq_log!(
                debug,
                "shmq: no window mapping ({why}); views map on their own"
            );
            return None;
        }
        // Before the window: a lock from now on faults in both (see `locked_since_window`).
        lock_sentinel();
        // SAFETY: a new private mapping of the whole file, as long as it was when opened.
        // Any process of the same user could shrink the file (a later access of the lost
        // pages, even of ones this process wrote, is then a SIGBUS, which the handler the
        // window is registered with turns into zero pages and an error: `crate::sigbus`)
        // or punch holes in it (pages a view has not written then read zeros). MAP_NORESERVE: only the pages this process writes take memory,
        // and only while a view holds them (`window_unfit` refuses strict overcommit,
        // which ignores the flag).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            shmq_log!(
                debug,
                "shmq: no window mapping ({}); views map on their own",
                std::io::Error::last_os_error()
            );
            return None;
        }
        Some(Window {
            base: p as *mut u8,
            len,
            live: Mutex::new(BTreeMap::new()),
            sigbus: sigbus.protect(p as *mut u8, len),
        })
    }

    /// Claim pages `start..end` for one view, unless a live view holds any of them or
    /// the window ends before `end`.
    fn claim(&self, start: usize, end: usize) -> bool {
        if end > self.len {
            return false;
        }
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        // The live ranges do not overlap, so only the last one starting before `end`
        // can reach into `start..end`.
        if live
            .range(..end)
            .next_back()
            .is_some_and(|(_, &e)| e > start)
        {
            return false;
        }
        live.insert(start, end);
        true
    }

    /// Whether the freshly claimed pages `start..end` show the segment: always, unless the
    /// process was locked since the window was made (then the lock copied them in as they
    /// were: those copies are dropped here). Pages that cannot be dropped stay claimed
    /// for good (as in `release`), and the view maps on its own.
    fn fresh(&self, start: usize, end: usize) -> bool {
        if !locked_since_window() || discard_written(self.base, start, end).is_ok() {
            return true;
        }
        warn_user!(
            "shmq: this process was locked (mlockall) after it mapped a segment, and the \
             pages it copied could not be dropped ({}); views of that range map on their own",
            std::io::Error::last_os_error()
        );
        false
    }

    /// A view of pages `start..end` is gone: drop the pages it wrote (they show the
    /// segment again), then let another view have the range.
    fn release(&self, start: usize, end: usize) {
        if discard_written(self.base, start, end).is_err() {
            // The pages it wrote stay (locked memory: an mlock of the view, or mlockall
            // after the window was made): the range must never show another message, so
            // it stays claimed, and later views of it map on their own.
            warn_user!(
                "shmq: could not drop the pages a view wrote ({}); that range of the \
                 mapping is retired",
                std::io::Error::last_os_error()
            );
            return;
        }
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.remove(&start);
    }
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window").field("len", &self.len).finish()
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        self.sigbus.release();
        // SAFETY: our own mapping, unmapped once; every view holds an Arc to the window,
        // so none is left.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// Calls `f` with this process's `/proc/self/pagemap` (`None` where it cannot be read),
/// opened once. A descriptor opened before a fork reads the parent's page tables, so a
/// forked child opens its own.
fn with_pagemap<R>(f: impl FnOnce(Option<&std::fs::File>) -> R) -> R {
    static PAGEMAP: OnceLock<(u64, Option<std::fs::File>)> = OnceLock::new();
    let open = || std::fs::File::open("/proc/self/pagemap").ok();
    let generation = crate::fork::generation();
    let (opened_in, file) = PAGEMAP.get_or_init(|| (generation, open()));
    if *opened_in == generation {
        f(file.as_ref())
    } else {
        f(open().as_ref())
    }
}

/// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE: u64 = 1 << 61;

/// Why this process should not use a window, if so: its memory is locked by default
/// (`mlockall(MCL_FUTURE)`: mapping the window would copy the whole segment into locked
/// private memory, and written pages could not be dropped), or the kernel ignores
/// `MAP_NORESERVE` (strict overcommit: every reader would be charged the whole segment).
fn window_unfit() -> Option<&'static str> {
    if std::fs::read_to_string("/proc/sys/vm/overcommit_memory").is_ok_and(|m| m.trim() == "2") {
        return Some("strict overcommit");
    }
    // MADV_DONTNEED fails with EINVAL on locked memory.
    crate::segment::probe_page(|p, page| {
        // SAFETY: `p` is the probe's own page (see `probe_page`): dropping its contents
        // touches nothing else.
        unsafe { libc::madvise(p, page, libc::MADV_DONTNEED) != 0 }
    })
    .map_or(Some("no memory for a probe"), |locked| {
        locked.then_some("memory is locked (mlockall)")
    })
}

/// The lock sentinel (see the module docs): one private anonymous page that nothing
/// touches, so it is resident only once a lock (`mlockall(MCL_CURRENT)`, which faults in
/// every page of the process) made it so. Mapped before the first window; its address,
/// or 0 where it could not be mapped.
fn lock_sentinel() -> usize {
    static SENTINEL: OnceLock<usize> = OnceLock::new();
    // Never unmapped (one page per process), and nothing refers to it.
    *SENTINEL.get_or_init(|| crate::segment::anon_page().map_or(0, |p| p.as_ptr() as usize))
}

/// Whether this process's memory was locked (and so its windows copied in privately)
/// since the lock sentinel was mapped; once true, true for good. Where there is no
/// sentinel, true (views then check their range: correct, only slower).
fn locked_since_window() -> bool {
    static LOCKED: AtomicBool = AtomicBool::new(false);
    // Relaxed: a flag that only ever goes from false to true and carries no data.
    if LOCKED.load(Ordering::Relaxed) {
        return true;
    }
    let sentinel = lock_sentinel();
    let mut resident = 0u8;
    // SAFETY: the sentinel is one mapped page of our own, and `resident` has room for one
    // page's entry; mincore only reads the page tables.
    let locked = sentinel == 0
        || unsafe { libc::mincore(sentinel as *mut libc::c_void, page_size(), &mut resident) } != 0
        || resident & 1 != 0;
    if locked {
        LOCKED.store(true, Ordering::Relaxed);
    }
    locked
}

/// `MADV_DONTNEED_LOCKED` (Linux 5.18): `MADV_DONTNEED` for locked pages too.
const MADV_DONTNEED_LOCKED: libc::c_int = 24;

/// Drop the private copies among pages `start..end` (byte offsets, page-aligned) of the
/// window at `base`: the pages this process wrote, as pagemap tells. Where pagemap cannot
/// be read, every page of the range is dropped. An error if some could not be dropped.
fn discard_written(base: *mut u8, start: usize, end: usize) -> std::io::Result<()> {
    let dont_need = |from: usize, to: usize| -> std::io::Result<()> {
        let (at, len) = (base.wrapping_add(from) as *mut libc::c_void, to - from);
        // SAFETY: `from..to` lies inside the window (a claimed range), which this process
        // mapped MAP_PRIVATE: MADV_DONTNEED drops this process's private copies of those
        // pages, and their next access maps the segment's page again. Nothing of this
        // process reads the range any more (its view is gone). Locked pages refuse it
        // (EINVAL); MADV_DONTNEED_LOCKED drops them too where the kernel has it.
        let done = unsafe {
            libc::madvise(at, len, libc::MADV_DONTNEED) == 0
                || libc::madvise(at, len, MADV_DONTNEED_LOCKED) == 0
        };
        if done {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    with_pagemap(|file| match file {
        Some(file) => discard_by_pagemap(file, base, start, end, dont_need),
        None => dont_need(start, end),
    })
}

fn discard_by_pagemap(
    file: &std::fs::File,
    base: *mut u8,
    start: usize,
    end: usize,
    dont_need: impl Fn(usize, usize) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let page = page_size();
    // 8 bytes per page; read a batch of entries at a time.
    const BATCH: usize = 4096;
    let mut entries = vec![0u8; ((end - start) / page).min(BATCH) * 8];
    let mut run: Option<usize> = None; // start of the current run of written pages
    let mut at = start;
    while at < end {
        let n = ((end - at) / page).min(BATCH);
        let buf = &mut entries[..n * 8];
        let index = (base as usize + at) / page;
        if file.read_exact_at(buf, index as u64 * 8).is_err() {
            // Drop the rest whole (what the run had found included).
            return dont_need(run.unwrap_or(at), end);
        }
        for (k, e) in buf.chunks_exact(8).enumerate() {
            let e = u64::from_ne_bytes(e.try_into().expect("8 bytes"));
            let written = e & PM_SWAPPED != 0 || (e & PM_PRESENT != 0 && e & PM_FILE == 0);
            let here = at + k * page;
            match (written, run) {
                (true, None) => run = Some(here),
                (false, Some(r)) => {
                    dont_need(r, here)?;
                    run = None;
                }
                _ => {}
            }
        }
        at += n * page;
    }
    match run {
        Some(r) => dont_need(r, end),
        None => Ok(()),
    }
}

/// How a [`PrivateMap`]'s bytes are mapped.
enum Mapping {
    /// Nothing (an empty view).
    None,
    /// A mapping of its own, `(address, length)`, unmapped when dropped.
    Own(*mut u8, usize),
    /// Pages `start..end` of its file's window, given back (written pages dropped) when
    /// dropped.
    Window {
        window: Arc<Window>,
        start: usize,
        end: usize,
    },
}

/// A private (copy-on-write) view of a segment's bytes: its own mapping, or a claimed
/// range of the file's window (see the module docs). Given back when dropped.
pub struct PrivateMap {
    map: Mapping,
    bytes: RawRegion,
    /// A mapping of its own's entry in the `SIGBUS` registry (`None` for a window view:
    /// the window's covers it), released before it is unmapped.
    sigbus: Option<crate::sigbus::Guard>,
    /// Where its first byte lies in the segment file.
    file_offset: u64,
}

// SAFETY: the bytes are this object's alone (its own mapping, or a window range no other
// live view holds), so moving it between threads is like moving a Vec.
unsafe impl Send for PrivateMap {}
// SAFETY: `&PrivateMap` gives shared access to the bytes only.
unsafe impl Sync for PrivateMap {}

impl std::fmt::Debug for PrivateMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrivateMap")
            .field("len", &self.bytes.len())
            .finish()
    }
}

region!(PrivateMap, bytes, mut);

impl PrivateMap {
    fn empty(file_offset: u64) -> PrivateMap {
        PrivateMap {
            file_offset,
            map: Mapping::None,
            // SAFETY: zero bytes at a dangling, non-null pointer: an empty slice, nothing
            // to keep mapped.
            bytes: unsafe { RawRegion::new(NonNull::dangling().as_ptr(), 0) },
            sigbus: None,
        }
    }
}

impl PrivateMap {
    /// Where this view's first byte lies in its segment file (the same byte is at this
    /// offset in [`PrivateFile::shared`]).
    pub fn file_offset(&self) -> u64 {
        self.file_offset
    }

    /// Give this mapping a private copy of every page it has not written yet, so that it
    /// no longer shows later changes of the segment (one copy of the bytes). For views
    /// from [`PrivateFile::map`] (a window view's pages go back to the window instead).
    pub fn detach(&self) {
        let Mapping::Own(p, n) = self.map else { return };
        let page = page_size();
        for k in (0..n).step_by(page) {
            // SAFETY: `p + k` lies in this object's own writable mapping, only accessed
            // through atomics here. A compare-exchange of a byte with itself writes the
            // page (a copy-on-write fault makes it private) without changing it, even if
            // another thread writes the same byte meanwhile (then that write made the page
            // private already). Not `fetch_or(0)`: compilers turn an idempotent relaxed
            // RMW into a plain load, which writes nothing.
            // A process-local atomic: the page is this process's private copy.
            let byte = unsafe { shmq_protocol::sync::local::AtomicU8::from_ptr(p.add(k)) };
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
    /// on, never the segment's later content, and nothing is copied. For views from
    /// [`PrivateFile::map`]; a window view is refused (its range is the window's).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a view carved out of the shared window (not a mapping
    /// of its own); [`Error::Os`] when the anonymous mapping over it cannot be made.
    pub fn retire(&self) -> Result<()> {
        let Mapping::Own(p, n) = self.map else {
            return match self.map {
                Mapping::None => Ok(()),
                _ => Err(Error::InvalidArgument(
                    "a window view cannot be retired (map it with PrivateFile::map)".into(),
                )),
            };
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

/// A whole segment mapped shared and read-only ([`PrivateFile::shared`]); unmapped when
/// the last holder drops it. It gives its address and length, never a Rust slice: its
/// bytes are the segment's own, which the writer may change at any time (the layer above
/// keeps it off a range only while a view of that range lives); a device reads them by
/// DMA, and a binding hands them out as a read-only buffer.
pub struct SharedView {
    ptr: *mut u8,
    len: usize,
    /// Its entry in the `SIGBUS` registry, released before it is unmapped.
    sigbus: crate::sigbus::Guard,
}

// SAFETY: the mapping lives as long as the SharedView, and nothing here reads or writes
// its bytes (it only gives their address): moving it between threads is moving a number.
unsafe impl Send for SharedView {}
// SAFETY: as above.
unsafe impl Sync for SharedView {}

impl SharedView {
    /// The segment's first byte in this mapping (`PROT_READ`: never write through it).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The mapping's length: the segment's length when its file was opened.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for SharedView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedView")
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for SharedView {
    fn drop(&mut self) {
        self.sigbus.release();
        // SAFETY: our own mapping from `PrivateFile::shared`, unmapped once; every holder
        // of it held the Arc, so none is left. A device registration of it is kept from
        // outliving it by its user: the Python bindings hand it out only as a buffer
        // export (a `ShmView` holding the Arc), which `shmq._device_reader.DeviceReader`
        // keeps until every block is unregistered (and for good where one could not be).
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

impl Drop for PrivateMap {
    fn drop(&mut self) {
        // Out of the SIGBUS registry before the mapping goes.
        drop(self.sigbus.take());
        match std::mem::replace(&mut self.map, Mapping::None) {
            Mapping::None => {}
            Mapping::Own(p, n) => {
                // SAFETY: our own mapping from `PrivateFile::map`, unmapped once; nothing
                // refers to it any more (the bindings drop a view only after its last
                // buffer export).
                unsafe { libc::munmap(p as *mut libc::c_void, n) };
            }
            // Nothing refers to the range any more (as above): its written pages go, then
            // the range is free for the next view.
            Mapping::Window { window, start, end } => window.release(start, end),
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
    /// Resident pages of `[p, p + len)` in this process that are the segment's own pages
    /// (read, not written), as pagemap shows them.
    fn file_pages(p: *const u8, len: usize) -> usize {
        let page = page_size();
        let f = std::fs::File::open("/proc/self/pagemap").unwrap();
        let mut buf = vec![0u8; len / page * 8];
        f.read_exact_at(&mut buf, (p as usize / page * 8) as u64)
            .unwrap();
        buf.chunks_exact(8)
            .map(|e| u64::from_ne_bytes(e.try_into().unwrap()))
            .filter(|e| e & PM_PRESENT != 0 && e & PM_FILE != 0)
            .count()
    }

    #[test]
    fn window_views_are_private_and_their_writes_go_with_them() {
        let page = page_size();
        let seg = Segment::create(&unique_name("test"), 8 * page).unwrap();
        // SAFETY: the segment is 8 pages long and only this thread uses it.
        unsafe { std::ptr::write_bytes(seg.as_ptr(), 7, 8 * page) };
        let f = PrivateFile::open(seg.name()).unwrap();
        let mut a = f.view(0, 4 * page).unwrap();
        assert!(matches!(a.map, Mapping::Window { .. }));
        let at = a.as_ptr() as usize;
        assert!(a.iter().all(|&x| x == 7));
        a[10] = 1; // page 0 written: a private copy
                   // Page 3 too.
        a[3 * page] = 2;
        // SAFETY: in bounds; only this thread uses the segment.
        let shared = unsafe { *seg.as_ptr().add(10) };
        assert_eq!(shared, 7, "a private write reached the segment");
        // A second view of the same pages while `a` lives is a mapping of its own and
        // does not see `a`'s writes; one of other pages comes from the window.
        let b = f.view(page as u64, 2 * page).unwrap();
        assert!(matches!(b.map, Mapping::Own(..)));
        let c = f.view(4 * page as u64 + 5, 100).unwrap();
        assert!(matches!(c.map, Mapping::Window { .. }));
        assert_eq!(b[2 * page - 1], 7);
        drop((a, b, c));
        // The segment changes while nobody views it; the next view of the same memory
        // shows the segment, not the old view's writes, and pages only read kept their
        // page-table entries (those written were dropped).
        // SAFETY: in bounds; only this thread uses the segment.
        unsafe { *seg.as_ptr().add(3 * page + 1) = 9 };
        let d = f.view(0, 4 * page).unwrap();
        assert_eq!(d.as_ptr() as usize, at, "the same window range");
        assert_eq!(
            file_pages(d.as_ptr(), 4 * page),
            2,
            "pages 1 and 2 were read, not written"
        );
        assert_eq!((d[10], d[3 * page], d[3 * page + 1]), (7, 7, 9));
        // Past the segment, still refused.
        assert!(f.view(0, 8 * page + 1).is_err());
        assert_eq!(f.view(3, 0).unwrap().len(), 0);
    }

    #[test]
    fn the_shared_mapping_shows_the_segment_where_views_lie_and_is_made_once() {
        let page = page_size();
        let seg = Segment::create(&unique_name("test"), 4 * page).unwrap();
        // SAFETY: the segment is 4 pages long and only this thread uses it.
        unsafe { std::ptr::write_bytes(seg.as_ptr(), 7, 4 * page) };
        let f = PrivateFile::open(seg.name()).unwrap();
        let shared = f.shared().unwrap();
        assert_eq!(shared.len(), 4 * page);
        assert!(
            Arc::ptr_eq(&shared, &f.shared().unwrap()),
            "made once per file"
        );
        let mut v = f.view(page as u64 + 5, 100).unwrap();
        let w = f.map(2 * page as u64 + 9, 10).unwrap();
        assert_eq!(
            (v.file_offset(), w.file_offset()),
            (page as u64 + 5, 2 * page as u64 + 9)
        );
        let at = |off: u64| {
            // SAFETY: `off` lies inside the 4-page mapping, which `shared` keeps mapped;
            // only this thread writes the segment.
            unsafe { std::ptr::read_volatile(shared.as_ptr().add(off as usize)) }
        };
        // A view's private write stays out of the shared mapping; the segment's own
        // writes show in it at the view's offset (no copy-on-write there).
        v[0] = 1;
        assert_eq!(at(v.file_offset()), 7);
        // SAFETY: in bounds; only this thread uses the segment.
        unsafe { *seg.as_ptr().add(2 * page + 9) = 3 };
        assert_eq!((at(w.file_offset()), w[0]), (3, 3));
        // Read-only: the mapping's protection says so.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let start = format!("{:x}-", shared.as_ptr() as usize);
        let line = maps.lines().find(|l| l.starts_with(&start)).unwrap();
        assert!(
            line.split_whitespace().nth(1).unwrap().starts_with("r--s"),
            "{line}"
        );
        // It outlives the file that made it while held.
        drop((v, w, f));
        assert_eq!(at(0), 7);
    }
}
