//! Named POSIX shared-memory segments.
//!
//! A [`Segment`] is a shared mapping of a segment's file (opened through
//! [`SegmentFile`], whose descriptor it keeps) with what a long-running server needs
//! around it:
//! - every name starts with [`NAME_PREFIX`], so shmq's segments can be told apart in
//!   `/dev/shm` (and cleaned up after a crash);
//! - the segment is created exclusively and owner-only (mode 0600: [`SegmentFile::create`]);
//! - pages are reserved with `fallocate` before anything is written there:
//!   `ftruncate` alone would let a full tmpfs show up much later as a `SIGBUS` on first
//!   touch (a read of a page not yet there allocates it too), killing the process.
//!   [`Segment::create`] reserves the whole segment up front; [`Segment::create_sparse`]
//!   sizes it with `ftruncate` (sparse) and reserves only a fixed first part, and the
//!   layer above reserves the rest with [`Segment::reserve_range`] as it comes to use it
//!   (the ring's chunks, the store's blocks, the arena): a segment far larger than
//!   `/dev/shm` then starts in a small container and commits memory as it is used. The
//!   free-space check at creation asks only for the part reserved then. A reservation
//!   that finds `/dev/shm` full is an [`Error::NoSpace`] the caller turns into a fallback
//!   (or a `MemoryError`), with one warning per process ([`warn_shm_too_small`]);
//! - only the creating process unlinks the name when it drops the segment, even if a
//!   forked child inherited the object;
//! - the creator holds a role lock on the file for as long as it lives, so that anyone
//!   can tell a live creator's segment from an orphan (see [`crate::liveness`]).

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::liveness::{RoleLock, CREATOR_BYTE};
pub use crate::segment_file::SHM_DIR;
use crate::segment_file::{path, Access, SegmentFile};

/// Every segment shmq creates has a name starting with this.
pub const NAME_PREFIX: &str = "shmq_";

/// The most readers a queue's segments are laid out for: the ring's state blocks, the
/// arena's per-reader holds (more would make them absurd; engines use a handful).
/// Defined here, below both; `broadcast::ring::MAX_READERS` is the public name.
pub const MAX_READERS: usize = 4096;

/// A mapped, named shared-memory segment.
pub struct Segment {
    /// The shared mapping of the whole file: `len` bytes at `ptr`, unmapped in `Drop`.
    ptr: NonNull<u8>,
    len: usize,
    /// The descriptor the mapping was made from. The creator (and a child forked from it)
    /// reserves pages through it (`fallocate`) and reads the file's size from it: it
    /// keeps naming the right file after the name is unlinked (at interpreter exit, say)
    /// while the creator still writes. Openers reserve and remap through the name
    /// instead, as a name that is gone has nothing left to reserve for them.
    file: SegmentFile,
    name: String,
    creator_pid: Option<u32>,
    /// The creator's role lock (byte 0 of the file): proves to `cleanup` and `inspect`,
    /// in any pid namespace, that the creator is alive (see [`crate::liveness`]).
    _creator_role: Option<RoleLock>,
    /// Set once `unlink` removed the name, so `Drop` does not try again.
    unlinked: AtomicBool,
    /// The mapping's entry in the `SIGBUS` registry (see `crate::sigbus`): a peer that
    /// truncates the file makes [`check_intact`](Self::check_intact) an error here,
    /// never a crash. Released in `Drop`, before the mapping goes.
    sigbus: crate::sigbus::Guard,
    /// Set once a size check ([`reserve_range`](Self::reserve_range),
    /// [`check_length`](Self::check_length)) found the file shorter than the mapping:
    /// from then on [`check_intact`](Self::check_intact) is the error, as after a fault,
    /// even if the file is grown again (its content is lost all the same).
    shrunk: AtomicBool,
    /// Set once [`reserve_whole`](Self::reserve_whole) reserved all of the segment in
    /// this process.
    whole_reserved: OnceLock<()>,
}

// SAFETY: `Segment` is neither Send nor Sync only because it holds the raw mapping
// pointer. The mapping is plain shared memory that stays valid until `Drop` (which needs
// `&mut`, so no other reference exists then). Every access that other threads or
// processes can race with goes through atomics or is guarded by the protocol of the
// layer above (ring flags, allocator ownership); `Segment` itself hands out only the
// base pointer.
unsafe impl Send for Segment {}
// SAFETY: see `Send` above; `&Segment` only allows reading the pointer, length and name.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("name", &self.name)
            .field("len", &self.len())
            .field("creator", &self.is_creator())
            .finish()
    }
}

/// A fresh segment name: prefix, a kind tag, the creator's pid and random bits.
pub fn unique_name(kind: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // Relaxed: the counter only has to hand out distinct values within this process.
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{NAME_PREFIX}{kind}_{pid}_{r:08x}",
        pid = std::process::id(),
        r = (nanos as u64 ^ (n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 16)) as u32
    )
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 200 || name.contains('/') || name.contains('\0') {
        return Err(Error::InvalidArgument(format!(
            "invalid shared memory name {name:?}: it must be 1-200 characters without '/'"
        )));
    }
    Ok(())
}

/// Bytes free in the tmpfs behind `/dev/shm`, or `None` if it cannot be queried.
pub fn shm_free_bytes() -> Option<u64> {
    shm_statvfs().map(|(free, _)| free)
}

/// Size of the tmpfs behind `/dev/shm`, or `None` if it cannot be queried.
fn shm_total_bytes() -> Option<u64> {
    shm_statvfs().map(|(_, total)| total)
}

/// `(bytes free, bytes in all)` of the tmpfs behind `/dev/shm`, or `None` if it cannot be
/// queried.
pub fn shm_statvfs() -> Option<(u64, u64)> {
    let path = CString::new(SHM_DIR).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is a valid NUL-terminated string and `st` points to writable memory
    // of the right type; statvfs only writes into it.
    let rc = unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled the struct.
    let st = unsafe { st.assume_init() };
    // The casts are no-ops on 64-bit Linux; fsblkcnt_t and c_ulong are 32 bits elsewhere.
    #[allow(clippy::unnecessary_cast)]
    Some((
        st.f_bavail as u64 * st.f_frsize as u64,
        st.f_blocks as u64 * st.f_frsize as u64,
    ))
}

/// Log, once per process, that `/dev/shm` is too small: `what` says what shmq does about
/// it (a fallback, or the error it raises). Called where a reservation found no room.
pub fn warn_shm_too_small(what: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    // Relaxed: it only decides which thread logs; nothing else is published by it.
    if WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    warn_user!(
        "{}",
        shm_too_small_message(what, shm_free_bytes(), shm_total_bytes())
    );
}

/// The text of [`warn_shm_too_small`].
fn shm_too_small_message(what: &str, free: Option<u64>, total: Option<u64>) -> String {
    let mib = |b: Option<u64>| b.map_or_else(|| "?".to_owned(), |b| (b >> 20).to_string());
    format!(
        "shmq: {SHM_DIR} is too small ({} MiB free of {} MiB): {what}. Give the container more \
         shared memory: `docker run --shm-size=1g` (or `--ipc=host`); on Kubernetes mount an \
         emptyDir with `medium: Memory` (and a `sizeLimit`) at {SHM_DIR}. (Shown once per \
         process.)",
        mib(free),
        mib(total)
    )
}

impl Segment {
    /// Create a new segment of `size` bytes (zero-filled) named `name`, with every page
    /// reserved in `/dev/shm` now.
    // The crate's own segments are all sparse now; tests and small fixed segments use it.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn create(name: &str, size: usize) -> Result<Self> {
        Self::create_sparse(name, size, size)
    }

    /// Create a new segment of `size` bytes of which only the first `reserve` bytes are
    /// reserved now; reserve more with [`reserve_range`](Self::reserve_range) before
    /// writing there (an unreserved page that cannot be had is a `SIGBUS` on first touch).
    pub fn create_sparse(name: &str, size: usize, reserve: usize) -> Result<Self> {
        check_name(name)?;
        if size == 0 {
            return Err(Error::InvalidArgument(
                "a shared memory segment cannot be empty".into(),
            ));
        }
        let reserve = reserve.min(size);
        refuse_populating_lock(name, size as u64, (size - reserve) as u64)?;
        if let Some(free) = shm_free_bytes() {
            if (reserve as u64) > free {
                return Err(Error::NoSpace {
                    name: name.into(),
                    needed: reserve as u64,
                    available: free,
                });
            }
        }
        let file = match SegmentFile::create(name) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(Error::InvalidArgument(format!(
                    "shared memory segment '{name}' already exists"
                )))
            }
            Err(e) => {
                return Err(Error::os(
                    format!("creating shared memory segment '{name}' ({size} bytes)"),
                    e,
                ))
            }
        };
        // The name is surely this segment's now (the create above was exclusive): if it
        // cannot be sized or mapped, it goes again.
        let ptr = match file
            .set_len(size as u64)
            .and_then(|()| map_shared(&file, size))
        {
            Ok(p) => p,
            Err(e) => {
                let _ = crate::segment_file::unlink(name);
                return Err(Error::os(
                    format!("creating shared memory segment '{name}' ({size} bytes)"),
                    e,
                ));
            }
        };
        let mut segment = Segment {
            sigbus: protect(ptr, size),
            ptr,
            len: size,
            file,
            name: name.to_owned(),
            creator_pid: Some(std::process::id()),
            _creator_role: None,
            unlinked: AtomicBool::new(false),
            shrunk: AtomicBool::new(false),
            whole_reserved: OnceLock::new(),
        };
        segment.reserve_range(0, reserve)?;
        segment._creator_role = RoleLock::acquire(name, CREATOR_BYTE)?;
        note_created(name);
        Ok(segment)
    }

    /// Reserve all of the segment's pages now, once per process (for a view of the whole
    /// segment that its holder may touch anywhere: `Error::NoSpace` when there is no room,
    /// never a `SIGBUS` later).
    pub fn reserve_whole(&self) -> Result<()> {
        // The flag only spares this process a second reservation (two threads may both
        // reserve: the second finds the pages allocated).
        if self.whole_reserved.get().is_none() {
            self.reserve_range(0, self.len())?;
            let _ = self.whole_reserved.set(());
        }
        Ok(())
    }

    /// Reserve the pages of `offset..offset + len` now, so a full `/dev/shm` is an error
    /// here and not a `SIGBUS` later. On failure in `create` the segment is dropped (and
    /// so unlinked) by the caller.
    ///
    /// A reservation never changes the file's size (`FALLOC_FL_KEEP_SIZE`): a file that
    /// another process truncated stays short, and one found shorter than this mapping,
    /// before or after the pages are taken, is the truncation error
    /// (`crate::sigbus::truncated`) from here on (see [`check_intact`](Self::check_intact)).
    /// Growing it back would hand every process zeros where the lost pages were, with
    /// no fault to tell them (issue 32).
    pub fn reserve_range(&self, offset: usize, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        use std::os::fd::AsRawFd;
        let opened;
        let file = match self.creators_file() {
            Some(f) => f,
            None => match SegmentFile::try_open(&self.name, Access::ReadWrite) {
                Ok(f) => {
                    opened = f;
                    &opened
                }
                // Not a tmpfs-backed /dev/shm (unusual), or the name is gone; nothing to
                // reserve through.
                Err(_) => return Ok(()),
            },
        };
        // Before: no pages are taken for a file already truncated (past its end they
        // would only be freed when it is removed).
        self.check_file_len(file)?;
        // The fallocate system call itself, not glibc's posix_fallocate: where the file
        // system cannot allocate (not a tmpfs), that one emulates it by writing a byte
        // per block, which could undo a peer's write; this one fails with EOPNOTSUPP.
        // KEEP_SIZE: a range past a truncated end is not made part of the file again.
        // SAFETY: the fd is open for writing for the duration of the call (`file` owns
        // it); the call only allocates pages of the file and changes neither its size nor
        // any byte (a peer may do the same, or truncate the file: the checks of its size
        // before and after make that an error here).
        let fallocate = || unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        let rc = loop {
            if fallocate() == 0 {
                break 0;
            }
            match std::io::Error::last_os_error().raw_os_error() {
                // A signal came (a large range takes a while): allocated pages stay.
                Some(libc::EINTR) => continue,
                e => break e.unwrap_or(libc::EIO),
            }
        };
        match rc {
            // After: a truncation that came during the call (the pages reserved past the
            // new end are not the file's, and touching them is a SIGBUS).
            0 => self.check_file_len(file),
            libc::ENOSPC => Err(Error::NoSpace {
                name: self.name.clone(),
                needed: len as u64,
                available: shm_free_bytes().unwrap_or(0),
            }),
            // File systems without fallocate: fall back to ftruncate's lazy pages.
            libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS => Ok(()),
            err => Err(Error::os(
                format!(
                    "reserving {len} bytes for shared memory segment '{}'",
                    self.name
                ),
                std::io::Error::from_raw_os_error(err),
            )),
        }
    }

    /// Open an existing segment by name.
    pub fn open(name: &str) -> Result<Self> {
        check_name(name)?;
        if let Ok(meta) = std::fs::metadata(path(name)) {
            use std::os::unix::fs::MetadataExt;
            let unreserved = meta.size().saturating_sub(meta.blocks() * 512);
            refuse_populating_lock(name, meta.size(), unreserved)?;
        }
        let opened = SegmentFile::try_open(name, Access::ReadWrite).and_then(|file| {
            // The whole file, as long as it is now.
            let len = usize::try_from(file.size()?).map_err(std::io::Error::other)?;
            let ptr = map_shared(&file, len)?;
            Ok((file, ptr, len))
        });
        match opened {
            Ok((file, ptr, len)) => Ok(Segment {
                sigbus: protect(ptr, len),
                ptr,
                len,
                file,
                name: name.to_owned(),
                creator_pid: None,
                _creator_role: None,
                unlinked: AtomicBool::new(false),
                shrunk: AtomicBool::new(false),
                whole_reserved: OnceLock::new(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::SegmentNotFound {
                name: name.to_owned(),
            }),
            Err(e) => Err(Error::os(
                format!("opening shared memory segment '{name}'"),
                e,
            )),
        }
    }

    /// The descriptor the creator (or a child forked from it) reserves and reads the
    /// size through; `None` in openers (see the `file` field).
    fn creators_file(&self) -> Option<&SegmentFile> {
        self.creator_pid.is_some().then_some(&self.file)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never, for a segment shmq made or opened: every kind
    /// has a header).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Base address of the mapping in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whether this process created the segment (and will unlink it on drop).
    pub fn is_creator(&self) -> bool {
        self.creator_pid == Some(std::process::id())
    }

    /// An [`Error::BadSegment`] once another process truncated the segment under this
    /// mapping (the `SIGBUS` handler then put zero pages in its place: see
    /// `crate::sigbus`). One atomic load: the layers above call it where a call begins,
    /// at each step of a wait and where a message or value is done.
    /// Also an error once a size check here found the file shorter than the mapping.
    #[inline]
    pub fn check_intact(&self) -> Result<()> {
        // Relaxed: the flag carries no data; the error is built from the file's size now.
        if self.sigbus.hit() || self.shrunk.load(Ordering::Relaxed) {
            return Err(crate::sigbus::truncated(&self.name, self.len()));
        }
        Ok(())
    }

    /// [`check_intact`](Self::check_intact), and an error too if the file is shorter
    /// than this mapping now: an `fstat` of the creator's descriptor (a `stat` of the
    /// name in openers). For the slow steps of waits, about once a second, which then
    /// see a truncation that no access of theirs has hit yet, and for calls that answer
    /// from this process's own records of what the segment holds (the store's
    /// `is_cached`), which touch no page of it.
    pub fn check_length(&self) -> Result<()> {
        self.check_intact()?;
        let len = match self.creators_file() {
            Some(f) => f.metadata(),
            None => std::fs::metadata(path(&self.name)),
        };
        match len {
            Ok(m) => self.check_size(m.len()),
            // Gone (unlinked: its mapping stays valid): nothing lost.
            Err(_) => Ok(()),
        }
    }

    /// The truncation error if `file`'s size is below this mapping's (and from then on:
    /// see [`check_intact`](Self::check_intact)).
    fn check_file_len(&self, file: &SegmentFile) -> Result<()> {
        match file.metadata() {
            Ok(m) => self.check_size(m.len()),
            Err(e) => Err(Error::os(
                format!("reading the size of shared memory segment '{}'", self.name),
                e,
            )),
        }
    }

    /// The truncation error if the file is `len` bytes long now, less than this mapping
    /// (which is as long as the file was when it was made or opened: a shmq segment
    /// never shrinks on its own).
    fn check_size(&self, len: u64) -> Result<()> {
        if len < self.len() as u64 {
            // Relaxed: see `check_intact`.
            self.shrunk.store(true, Ordering::Relaxed);
            return Err(crate::sigbus::truncated_to(&self.name, self.len(), len));
        }
        Ok(())
    }
}

/// Whether this process's new mappings are populated as they are made: memory locked
/// by default (`mlockall(MCL_FUTURE)` without `MCL_ONFAULT`). A probe: a fresh anonymous
/// page is resident at once only then.
fn maps_populated() -> bool {
    probe_page(|p, page| {
        let mut resident = 0u8;
        // SAFETY: `p` is the probe's own mapping of `page` bytes (see `probe_page`);
        // mincore only reads the page tables, into one byte per page.
        unsafe { libc::mincore(p, page, &mut resident) == 0 && resident & 1 != 0 }
    })
    .unwrap_or(false)
}

/// A new private anonymous page of this process's own, at a place the kernel picks
/// (`None` where it cannot be mapped): the caller owns it and unmaps it, or keeps it.
pub fn anon_page() -> Option<NonNull<libc::c_void>> {
    // SAFETY: asks for a new mapping only; it overlaps nothing of the process's, and no
    // other process can reach private anonymous memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page_size(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then(|| NonNull::new(p)).flatten()
}

/// `f` on a fresh private anonymous page of this process's own (its address and
/// length), made for the call and unmapped after it: how shmq asks the kernel what a new
/// mapping of this process is like (populated, locked). `None` where it cannot be mapped.
pub fn probe_page<R>(f: impl FnOnce(*mut libc::c_void, usize) -> R) -> Option<R> {
    let p = anon_page()?.as_ptr();
    let r = f(p, page_size());
    // SAFETY: the page `anon_page` just made, which nothing else refers to (`f` got only
    // its address, for the call).
    unsafe { libc::munmap(p, page_size()) };
    Some(r)
}

/// Refuse to map segment `name` (`size` bytes, `unreserved` of them not yet in
/// `/dev/shm`) in a process whose mappings are populated as they are made
/// (`mlockall(MCL_FUTURE)`): the lock would fault in every page of the sparse segment,
/// filling `/dev/shm` with memory the writer never reserved (a 512 MiB ring in a
/// 512 MiB `/dev/shm`, and every other queue starved). A clear error instead, saying
/// what works: locking with `MCL_ONFAULT` (pages locked as they are used).
fn refuse_populating_lock(name: &str, size: u64, unreserved: u64) -> Result<()> {
    if unreserved < page_size() as u64 || !maps_populated() {
        return Ok(());
    }
    Err(Error::Os {
        context: format!(
            "mapping shared memory segment '{name}' ({size} bytes, {unreserved} of them not \
             yet in use)"
        ),
        source: std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "this process locks its memory as it maps it (mlockall with MCL_FUTURE), which \
             would fill /dev/shm with every page of the segment, starving other queues; \
             lock with mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT) instead: pages \
             are then locked as they are used",
        ),
    })
}

/// Map all `len` bytes of `file` shared, read-write, at a place the kernel picks.
fn map_shared(file: &SegmentFile, len: usize) -> std::io::Result<NonNull<u8>> {
    use std::os::fd::AsRawFd;
    // SAFETY: a new mapping at a place the kernel picks: it replaces nothing of this
    // process's. `file` is open read-write for the call. A peer process that can open the
    // file may write it or truncate it later: the mapping is plain shared memory that the
    // layers above only reach through atomics and checked protocols, and a truncation
    // makes an access a SIGBUS, which the handler the caller registers the mapping with
    // (`protect`) turns into zero pages and an error (`crate::sigbus`).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(NonNull::new(p.cast()).expect("mmap never returns null without MAP_FIXED"))
}

/// Register a new mapping with the `SIGBUS` handler.
fn protect(ptr: NonNull<u8>, len: usize) -> crate::sigbus::Guard {
    crate::sigbus::Watch::new().protect(ptr.as_ptr(), len)
}

impl Segment {
    /// Keep the segment when this process dies without its exit hook: its janitor is told
    /// to leave it (it is still removed when this process drops it or exits normally).
    /// For segments meant to outlive a crashed creator, such as a named encoder cache
    /// whose published entries stay readable until a producer of the same name replaces
    /// it; `cleanup` removes them otherwise.
    pub fn survive_crash(&self) {
        if self.is_creator() {
            survivors().push((std::process::id(), self.name.clone()));
            tell_janitor(b'-', &self.name);
        }
    }

    /// Remove the segment's name now, if this process created it; the mapping stays
    /// valid for every process that has it. Used to clean up at interpreter exit, when
    /// objects may never be dropped.
    pub fn unlink(&self) -> Result<()> {
        // Relaxed: only this process's own Drop reads it, after every other use.
        if !self.is_creator() || self.unlinked.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        if !is_noted(&self.name) {
            // The exit hook removed it already (`remove_created`): the name may be
            // another process's by now (a named encoder cache or store taken over).
            return Ok(());
        }
        if let Err(err) = crate::segment_file::unlink(&self.name) {
            if err.raw_os_error() != Some(libc::ENOENT) {
                return Err(Error::os(
                    format!("removing shared memory segment '{}'", self.name),
                    err,
                ));
            }
        }
        forget_created(&self.name);
        Ok(())
    }
}

impl Segment {
    /// Map `len` bytes at `ptr` (page-aligned, inside this mapping) again from the same
    /// file offset: shared (`shared`), or as a private copy-on-write view whose unwritten
    /// pages keep showing the file and whose written pages this process alone sees.
    /// The address range stays mapped throughout, so references into it stay valid.
    fn remap(&self, ptr: *mut u8, len: usize, shared: bool) -> Result<()> {
        use std::os::fd::AsRawFd;
        let base = self.as_ptr() as usize;
        let (start, page) = (ptr as usize, page_size());
        let offset = start.wrapping_sub(base);
        if start < base || offset % page != 0 || len % page != 0 || offset + len > self.len() {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes at offset {offset} of segment '{}' are not whole pages of it",
                self.name
            )));
        }
        let opened;
        let file = match self.creators_file() {
            Some(f) => f,
            None => {
                opened = SegmentFile::open(&self.name, Access::ReadWrite)?;
                &opened
            }
        };
        // Shared again means written again soon (the memory is lent or copied into next):
        // MAP_POPULATE maps every page now, in one pass, instead of a fault per page on
        // the next fill. The private view is only read, if at all.
        let flags = libc::MAP_FIXED
            | if shared {
                libc::MAP_SHARED | libc::MAP_POPULATE
            } else {
                libc::MAP_PRIVATE
            };
        // SAFETY: the range is whole pages inside this segment's mapping (checked above),
        // so MAP_FIXED replaces only memory this segment owns, with the same file's same
        // pages: every address stays mapped and readable, so references into the range
        // (the loan's buffer) stay valid. A peer process cannot change what this maps: at
        // worst it truncated the file, which makes access a SIGBUS exactly as before.
        let p = unsafe {
            libc::mmap(
                ptr as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::os(
                format!("remapping part of shared memory segment '{}'", self.name),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// The pages of a writer's loan (a queue's or a store's), which the writer fills in place
/// and then sends by reference. Once sent, [`seal`](Self::seal) turns this process's
/// mapping of them into a private copy-on-write view: the writer still reads what it
/// sent, and its later writes reach nobody — not the readers, not later messages.
/// [`unseal`](Self::unseal) maps them shared again; the owner calls it when the loan is
/// dropped, before the memory can be lent or written again.
#[derive(Debug)]
pub struct LoanPages {
    start: *mut u8,
    len: usize,
    /// Set by the first `seal`. Release/Acquire: a loan is sealed by the thread that sends
    /// it and unsealed by whichever thread drops it; the flag carries "the mapping is
    /// private now" (and `parked` with it) between them (the remaps themselves are
    /// ordered by the kernel's mapping lock).
    sealed: AtomicBool,
    /// Where `seal` parked the shared mapping of the pages, page tables and all (0: not
    /// parked; `unseal` maps them shared afresh). Relaxed: written before the Release
    /// store of `sealed`, read after its Acquire load.
    parked: AtomicUsize,
}

// SAFETY: only address ranges and atomics; the pages are touched only through
// `Segment::remap` and `mremap` of this loan's own pages, whose safety arguments hold
// from any thread.
unsafe impl Send for LoanPages {}
// SAFETY: as for Send.
unsafe impl Sync for LoanPages {}

impl LoanPages {
    /// The whole pages of `start..start + len` (`start` page-aligned; `len` is rounded up
    /// to a page, so the loan's allocation must cover that much).
    pub fn new(start: *mut u8, len: usize) -> LoanPages {
        let page = page_size();
        LoanPages {
            start,
            len: round_up(len.max(1), page).unwrap_or(len),
            sealed: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
        }
    }

    /// The loan is being sent: from now on this process's writes to it are its own. Only
    /// the first call remaps. `false` if the pages could not be sealed (out of mappings,
    /// `vm.max_map_count`, say): they are still shared, so the caller must not send them
    /// by reference (a write after the send would reach the readers) but copy them.
    ///
    /// Replacing a filled (so populated) shared mapping costs the kernel a teardown of
    /// every page's entry (~0.35 ms for 16 MiB here), which would make a send cost in
    /// proportion to its size. So the shared mapping is first *moved* aside with its page
    /// tables (`mremap(MREMAP_DONTUNMAP)`, Linux 5.13+: ~15 µs for 16 MiB, and the range
    /// stays mapped throughout, empty), and `unseal` moves it back, pages still mapped.
    /// Where the kernel cannot, the pages are remapped in place.
    ///
    /// A seal costs the process up to [`SEAL_MAPPINGS`] mappings while the loan lives;
    /// they are asked of `map_budget::take_mappings` first, which refuses them well
    /// before `vm.max_map_count` (the loan is then sent by copy), so that loans never
    /// take the mappings the host program needs.
    pub fn seal(&self, segment: &Segment) -> bool {
        if self.sealed.load(Ordering::Acquire) {
            return true;
        }
        retry_deferred_unseals();
        if !crate::map_budget::take_mappings(SEAL_MAPPINGS) {
            return false;
        }
        let park = self.park();
        match segment.remap(self.start, self.len, false) {
            Ok(()) => {
                self.parked.store(park, Ordering::Relaxed);
                self.sealed.store(true, Ordering::Release);
                true
            }
            Err(e) => {
                if park != 0 {
                    // SAFETY: `park` is the mapping moved aside just above, `len` bytes,
                    // nobody else's; it replaces the (still shared) range at `start`.
                    unsafe { libc::munmap(park as *mut libc::c_void, self.len) };
                }
                crate::map_budget::give_back_mappings(SEAL_MAPPINGS);
                shmq_log!(
                    info,
                    "shmq: a loan could not be sealed, so it is sent by copy: {e}"
                );
                false
            }
        }
    }

    /// Move the loan's shared mapping aside with its page tables, leaving the range
    /// mapped to the same file without page entries (see `seal`); where it went, or 0 if
    /// the kernel could not.
    ///
    /// The move goes to a place reserved for it first (an inaccessible anonymous mapping
    /// of the same size, which `MREMAP_FIXED` replaces): left to pick the place itself,
    /// the kernel refuses (`EINVAL`) a move of some ranges of a file mapping, here (Linux
    /// 6.18) the first one tried at the start of the arena, so that sends fell back to
    /// the costly in-place remap and took ~4x as long.
    fn park(&self) -> usize {
        // SAFETY: a new anonymous mapping at a place the kernel picks: it replaces
        // nothing.
        let spot = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if spot == libc::MAP_FAILED {
            return 0;
        }
        // SAFETY: `start..start + len` is whole pages of `segment`'s shared mapping (the
        // owner's allocation), which this process keeps mapped while the loan lives.
        // MREMAP_DONTUNMAP moves its page tables to `spot` (our own reservation of the
        // same size, which it replaces: nothing else lives there) and leaves the old range
        // mapped (to the same file, without page entries), so every address of the loan
        // stays valid. A peer cannot change what is mapped here.
        let park = unsafe {
            libc::mremap(
                self.start as *mut libc::c_void,
                self.len,
                self.len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP,
                spot,
            )
        };
        if park == libc::MAP_FAILED {
            // SAFETY: `spot` is the reservation made above, unused.
            unsafe { libc::munmap(spot, self.len) };
            return 0;
        }
        park as usize
    }

    /// Whether it was sealed (sent) and not unsealed since.
    pub fn is_sealed(&self) -> bool {
        self.sealed.load(Ordering::Acquire)
    }

    /// Map the pages shared again (if sealed). `false` if that failed: the caller must
    /// then never reuse the memory (writes there would reach only this process).
    pub fn unseal(&self, segment: &Segment) -> bool {
        if !self.sealed.load(Ordering::Acquire) {
            return true;
        }
        let park = self.parked.swap(0, Ordering::Relaxed);
        if park != 0 {
            // SAFETY: `park` is this loan's shared mapping, moved aside by `seal` and used
            // by nothing since; MREMAP_FIXED moves it back over the private view at
            // `start` (whole pages of the segment's mapping, which it replaces: the loan's
            // buffer is gone, nothing reads it).
            let back = unsafe {
                libc::mremap(
                    park as *mut libc::c_void,
                    self.len,
                    self.len,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    self.start as *mut libc::c_void,
                )
            };
            if back != libc::MAP_FAILED {
                self.sealed.store(false, Ordering::Release);
                crate::map_budget::give_back_mappings(SEAL_MAPPINGS);
                return true;
            }
            // SAFETY: as above; the parked mapping is dropped, and the pages are mapped
            // shared afresh below.
            unsafe { libc::munmap(park as *mut libc::c_void, self.len) };
        }
        match segment.remap(self.start, self.len, true) {
            Ok(()) => {
                self.sealed.store(false, Ordering::Release);
                crate::map_budget::give_back_mappings(SEAL_MAPPINGS);
                true
            }
            Err(e) => {
                warn_user!(
                    "shmq: a returned loan's memory is kept out of use until this process \
                     can map it again: {e}"
                );
                false
            }
        }
    }
}

/// Mappings a sealed loan may cost: its range split out of the segment's mapping (two
/// splits) and its shared pages parked aside (one).
pub const SEAL_MAPPINGS: usize = 3;

/// The unseals that failed (the process was out of mappings: `unseal` needs one or two
/// for a moment), each with what gives the memory back once it succeeds; tried again by
/// [`retry_deferred_unseals`]. Each entry returns `true` once done (it is then dropped,
/// and with it the pin or hold it kept). Tagged with the fork generation it was made in:
/// a forked child's inherited entries are the parent's, never retried there.
type DeferredUnseal = (u64, Box<dyn FnMut() -> bool + Send>);
static DEFERRED_UNSEALS: Mutex<Vec<DeferredUnseal>> = Mutex::new(Vec::new());
/// Whether `DEFERRED_UNSEALS` may hold entries. Relaxed: a hint that spares the common
/// case a lock; the entries themselves are read under the mutex.
static ANY_DEFERRED_UNSEAL: AtomicBool = AtomicBool::new(false);

/// A loan's memory could not be shared again when it was dropped (`LoanPages::unseal`
/// failed): `retry` tries again (and gives the memory back once it succeeds), at the
/// next seal, loan or allocation of any loan of this process, so that the memory is
/// kept out of use only while the process is out of mappings, never for good.
pub fn defer_unseal(retry: Box<dyn FnMut() -> bool + Send>) {
    let mut list = DEFERRED_UNSEALS.lock().unwrap_or_else(|e| e.into_inner());
    list.push((crate::fork::generation(), retry));
    ANY_DEFERRED_UNSEAL.store(true, Ordering::Relaxed);
}

/// Try the unseals [`defer_unseal`] keeps again; cheap (one atomic load) when there are
/// none.
pub fn retry_deferred_unseals() {
    if !ANY_DEFERRED_UNSEAL.load(Ordering::Relaxed) {
        return;
    }
    let generation = crate::fork::generation();
    let mut list = DEFERRED_UNSEALS.lock().unwrap_or_else(|e| e.into_inner());
    list.retain_mut(|(made_in, retry)| *made_in != generation || !retry());
    if list.iter().all(|(made_in, _)| *made_in != generation) {
        ANY_DEFERRED_UNSEAL.store(false, Ordering::Relaxed);
    }
}

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

/// `n` rounded up to a multiple of `to` (which is above 0), or `None` on overflow.
pub fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

/// The layout's tail that the arena and the encoder cache share: a table of `count`
/// records of `stride` bytes from `table_offset`, then `capacity` bytes of data from the
/// next multiple of `page_size`. Returns `(data_offset, total)`, or `None` if the segment
/// would be too large (an overflow, or a total above `isize::MAX`).
pub fn data_after_table(
    table_offset: usize,
    stride: usize,
    count: usize,
    page_size: usize,
    capacity: usize,
) -> Option<(usize, usize)> {
    let table_end = stride.checked_mul(count)?.checked_add(table_offset)?;
    let data_offset = round_up(table_end, page_size)?;
    let total = data_offset
        .checked_add(capacity)
        .filter(|&t| t <= isize::MAX as usize)?;
    Some((data_offset, total))
}

/// What an opener expects at the start of a kind of segment: see
/// [`Segment::checked_header`]. Each kind states only its constants.
pub struct HeaderCheck {
    /// The segment must be at least this long: the header and whatever the opener reads
    /// before it can check the rest against the header's geometry.
    pub min_len: usize,
    /// The magic the creator stores last (with Release) once the header is written.
    pub magic: u64,
    /// The layout version this shmq reads.
    pub version: u32,
    /// The reason given when the magic does not match ("it is not a shmq ...").
    pub not_this_kind: &'static str,
}

impl Segment {
    /// The error for this segment when it cannot be used: `reason` says why (an opener's
    /// checks of its header and geometry all say it this way).
    pub fn bad(&self, reason: impl Into<String>) -> Error {
        Error::BadSegment {
            name: self.name.clone(),
            reason: reason.into(),
        }
    }

    /// An opener's refusal of a header whose geometry does not match the segment's size.
    pub fn header_mismatch(&self) -> Error {
        self.bad("its header does not match its size")
    }

    /// The header of type `H` at the start of the segment and the mapping's base
    /// address, once the segment is at least `check.min_len` bytes long and the header
    /// carries `check.magic` and `check.version`; `fields` picks the header's magic and
    /// layout version (read only after the magic). Every failure is an
    /// [`Error::BadSegment`] naming the segment.
    ///
    /// # Safety
    ///
    /// `check.min_len` must be at least `size_of::<H>()`, `H` must need no more than a
    /// page's alignment (the mapping is page-aligned), and every bit pattern must be a
    /// valid `H`: a peer with access to the segment may have written anything there.
    pub unsafe fn checked_header<H>(
        &self,
        check: &HeaderCheck,
        fields: impl FnOnce(&H) -> (&AtomicU64, &u32),
    ) -> Result<(NonNull<u8>, &H)> {
        debug_assert!(check.min_len >= std::mem::size_of::<H>());
        if self.len() < check.min_len {
            return Err(self.bad(format!("it is only {} bytes long", self.len())));
        }
        let base = NonNull::new(self.as_ptr()).expect("mmap never returns null");
        // SAFETY: the mapping is page-aligned and at least `check.min_len` bytes long,
        // which covers an `H`; the caller promises that `H` fits that alignment and that
        // any bytes there are a valid `H`. The reference lives no longer than `self`,
        // which keeps the mapping.
        let header = unsafe { &*(base.as_ptr() as *const H) };
        let (magic, version) = fields(header);
        // Acquire: pairs with the creator's Release store of the magic, which it makes
        // last: an opener that sees the magic sees the header fields written before it.
        if magic.load(Ordering::Acquire) != check.magic {
            return Err(self.bad(check.not_this_kind));
        }
        // The version only now, after the Acquire above (the creator wrote it before
        // its Release store of the magic).
        let version = *version;
        if version != check.version {
            return Err(self.bad(format!(
                "its layout version is {version}, this shmq reads version {}",
                check.version
            )));
        }
        Ok((base, header))
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // Out of the SIGBUS registry before the mapping goes.
        self.sigbus.release();
        // SAFETY: this segment's own mapping, made in `create`/`open` and unmapped only
        // here; `&mut self`, so nothing borrowed from it (`as_ptr`'s users hold the
        // segment) is left. Other processes' mappings of the file are theirs.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        // Only the creator unlinks: a forked child inherits the object but must not
        // unlink its parent's segment, and `unlink` leaves a segment unlinked already —
        // by `unlink`, or by the exit hook (`remove_created`, which leaves the name
        // unnoted) — alone (the name may be someone else's by now: a named encoder cache
        // or store). It forgets the name once it is gone; one it could not remove is
        // forgotten here all the same (nothing more can be done about it from a
        // destructor).
        if self.is_creator() && self.unlink().is_err() {
            forget_created(&self.name);
        }
        // The descriptor (`file`) closes after this body.
    }
}

// ---------------------------------------------------------------------------------
// What this process created, for the exit hook (`remove_created`).
//
// Objects remove what they created when they are dropped, but Python does not promise to
// drop objects at interpreter exit (a queue kept in a module-level list, a loan still
// alive, a daemon thread's locals). So every segment and socket directory is noted here
// while it exists, and the exit hook (`shmq._cleanup`) removes what is left. Entries
// carry the creator's pid: a forked child inherits the list but removes only its own.

/// `(creator pid, name)`: a segment's name, or the absolute path of a directory.
static CREATED: Mutex<Vec<(u32, String)>> = Mutex::new(Vec::new());

/// Names of [`CREATED`] that this process's janitor must leave (see
/// [`Segment::survive_crash`]), with their creator's pid.
static SURVIVORS: Mutex<Vec<(u32, String)>> = Mutex::new(Vec::new());

fn survivors() -> std::sync::MutexGuard<'static, Vec<(u32, String)>> {
    SURVIVORS.lock().unwrap_or_else(|e| e.into_inner())
}

fn created() -> std::sync::MutexGuard<'static, Vec<(u32, String)>> {
    // A panic while holding it leaves a plain list, still consistent.
    CREATED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Note a segment name, or the absolute path of a directory in `/dev/shm`, that this
/// process has just created (and tell this process's janitor, if it has one).
pub fn note_created(name_or_path: &str) {
    created().push((std::process::id(), name_or_path.to_owned()));
    tell_janitor(b'+', name_or_path);
}

/// Whether this process noted `name_or_path` ([`note_created`]) and has not removed it
/// since: the one registry of what this process created, which `unlink`, drops and
/// the exit hook all go by.
fn is_noted(name_or_path: &str) -> bool {
    let me = std::process::id();
    created()
        .iter()
        .any(|(pid, n)| *pid == me && n == name_or_path)
}

/// Forget a name noted by [`note_created`]: its creator removed it.
pub fn forget_created(name_or_path: &str) {
    let me = std::process::id();
    created().retain(|(pid, n)| !(*pid == me && n == name_or_path));
    survivors().retain(|(pid, n)| !(*pid == me && n == name_or_path));
    tell_janitor(b'-', name_or_path);
}

// ---------------------------------------------------------------------------------
// The janitor: what removes this process's segments when it dies without exit cleanup.
//
// A process killed by SIGKILL (vLLM's shutdown does that to its engine core and workers
// when they linger), by a signal's default action or by a crash runs no destructor and no
// exit hook. So a process can hand one end of a `SOCK_SEQPACKET` socket pair to a
// *janitor*: a small process of its own (the Python package starts one, see
// `shmq._janitor`) that holds the other end. Every name noted above is sent to it as
// `+name`, every removal as `-name`; when every copy of this end is closed — the process
// is gone, however it ended — the janitor reads end-of-file and removes the names still
// listed. Names carry their creator's pid and random bits, so nobody else has taken one.
// No signal handler is needed for it, and nothing runs in this process at its death.

/// This process's end of the socket to its janitor, with the pid that set it: a forked
/// child inherits the descriptor but not the janitor (it closes its copy at first use,
/// so that the parent's janitor is not kept waiting for it).
static JANITOR: Mutex<Option<(u32, std::os::fd::OwnedFd)>> = Mutex::new(None);

fn janitor() -> std::sync::MutexGuard<'static, Option<(u32, std::os::fd::OwnedFd)>> {
    JANITOR.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hand this process's end of a janitor's socket (a `SOCK_SEQPACKET` pair; see the
/// section above) to the core: every name this process has created and not removed is
/// sent now, and every later one as it comes. Replaces an earlier janitor (whose end is
/// closed, so it removes what it was told and ends). Returns how many names were sent.
pub fn set_janitor(fd: std::os::fd::OwnedFd) -> usize {
    let me = std::process::id();
    let mut slot = janitor();
    *slot = Some((me, fd));
    let kept = survivors().clone();
    let names: Vec<String> = created()
        .iter()
        .filter(|(pid, n)| *pid == me && !kept.iter().any(|(p, k)| p == pid && k == n))
        .map(|(_, n)| n.clone())
        .collect();
    for n in &names {
        send_to_janitor(&slot, b'+', n);
    }
    names.len()
}

/// Make the socket pair for a janitor: this process's end goes to [`set_janitor`], the
/// other end (close-on-exec, so pass it on explicitly) is returned for the janitor.
pub fn new_janitor_socket() -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors socketpair(2) writes; nothing else
    // is touched.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(Error::os(
            "making the socket pair for shmq's janitor".to_owned(),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: both descriptors were just made by socketpair(2) and nothing else owns them.
    let (ours, theirs) = unsafe {
        (
            std::os::fd::OwnedFd::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        )
    };
    // Room for many thousands of names queued at once (a burst of creations while the
    // janitor is not scheduled), so that a non-blocking send rarely finds it full.
    let room: libc::c_int = 4 << 20;
    // SAFETY: a valid socket and an int option of the right size; failure is harmless
    // (the default buffer stays).
    unsafe {
        libc::setsockopt(
            ours.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&room as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    set_janitor(ours);
    Ok(theirs)
}

/// Whether this process (not a parent it was forked from) has a janitor.
pub fn has_janitor() -> bool {
    let mut slot = janitor();
    forget_inherited_janitor(&mut slot);
    slot.is_some()
}

/// Close a janitor's socket inherited through `fork` (its janitor is the parent's).
pub fn forget_inherited_janitor_now() {
    forget_inherited_janitor(&mut janitor());
}

fn forget_inherited_janitor(slot: &mut Option<(u32, std::os::fd::OwnedFd)>) {
    if matches!(slot, Some((pid, _)) if *pid != std::process::id()) {
        *slot = None; // closes the descriptor
    }
}

fn tell_janitor(op: u8, name: &str) {
    let mut slot = janitor();
    forget_inherited_janitor(&mut slot);
    send_to_janitor(&slot, op, name);
}

fn send_to_janitor(slot: &Option<(u32, std::os::fd::OwnedFd)>, op: u8, name: &str) {
    use std::os::fd::AsRawFd;
    let Some((_, fd)) = slot else { return };
    let mut message = Vec::with_capacity(name.len() + 1);
    message.push(op);
    message.extend_from_slice(name.as_bytes());
    loop {
        // SAFETY: `fd` is an open socket owned by the slot, which the caller holds locked;
        // `message` is a live buffer of the given length. MSG_NOSIGNAL: a janitor that died
        // is EPIPE here, never a SIGPIPE to the host program. MSG_DONTWAIT: a janitor that
        // does not read (stopped, say) never blocks a segment's creation; the message is
        // then lost (a lost `-` is harmless: the janitor's removal of a name already gone
        // finds nothing; a lost `+` leaves that segment to `cleanup` after a crash). A
        // message of a SOCK_SEQPACKET socket arrives whole or not at all.
        let sent = unsafe {
            libc::send(
                fd.as_raw_fd(),
                message.as_ptr().cast(),
                message.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if sent >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            // A janitor that is gone cannot be helped from here: the exit hook and the
            // objects' own drops still remove what they made; `cleanup` finds the rest.
            return;
        }
    }
}

/// Remove every segment and directory this process created that is still there (at
/// interpreter exit); their mappings stay valid for whoever has them. Returns how many
/// were noted. A live object whose name goes here removes nothing when it is dropped
/// later (the name is no longer noted: a named encoder cache or store may have been
/// created anew by another process meanwhile).
pub fn remove_created() -> usize {
    let me = std::process::id();
    let mine: Vec<String> = {
        let mut list = created();
        let (mine, others) = list.drain(..).partition(|(pid, _)| *pid == me);
        *list = others;
        survivors().retain(|(pid, _)| *pid != me);
        mine.into_iter().map(|(_, n)| n).collect()
    };
    for n in &mine {
        if n.starts_with('/') {
            let _ = std::fs::remove_dir_all(n);
        } else {
            // An absent name is ENOENT: nothing to do.
            let _ = crate::segment_file::unlink(n);
        }
        // Removed: the janitor must not remove it again once this process is gone (a
        // process of the same name's successor may have taken it by then).
        tell_janitor(b'-', n);
    }
    mine.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether this kernel can move a shared mapping's page tables aside
    /// (`MREMAP_DONTUNMAP` on file mappings: Linux 5.13).
    fn kernel_parks_shared_mappings() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut v = release
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|x| x.parse::<u32>().ok());
        (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (5, 13)
    }

    #[test]
    fn a_loan_at_the_start_of_a_mapping_is_sealed_by_moving_its_pages_aside() {
        // The first loan of an arena lies at the start of its mapping, where the kernel
        // refused a move to a place of its own choosing: the costly fallback then
        // tore down and rebuilt the page tables of every send.
        let name = unique_name("test");
        let seg = Segment::create(&name, 4 << 20).unwrap();
        let other = Segment::open(&name).unwrap();
        let len = 1 << 20;
        // SAFETY: the first MiB of a 4 MiB mapping, this thread only.
        unsafe { std::ptr::write_bytes(seg.as_ptr(), 1, len) };
        let pages = LoanPages::new(seg.as_ptr(), len);
        assert!(pages.seal(&seg));
        if kernel_parks_shared_mappings() {
            assert_ne!(
                pages.parked.load(Ordering::Relaxed),
                0,
                "sealed by the costly in-place remap"
            );
        }
        // SAFETY: as above; the loan's range stays mapped (privately now).
        unsafe {
            *seg.as_ptr() = 2;
            assert_eq!(
                *other.as_ptr(),
                1,
                "a write after the seal reached the segment"
            );
        }
        assert!(pages.unseal(&seg));
        // SAFETY: as above; shared again, with the pages it had.
        unsafe {
            assert_eq!(*seg.as_ptr().add(4096), 1);
            *seg.as_ptr() = 3;
            assert_eq!(*other.as_ptr(), 3, "not shared again after the unseal");
        }
    }

    #[test]
    fn the_janitor_hears_of_every_segment_made_and_removed() {
        use std::os::fd::AsRawFd;
        let theirs = new_janitor_socket().unwrap();
        assert!(has_janitor());
        let name = unique_name("test");
        let seg = Segment::create(&name, 4096).unwrap();
        drop(seg);
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: a valid socket and a live buffer; MSG_DONTWAIT: no blocking.
            let n = unsafe {
                libc::recv(
                    theirs.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                break;
            }
            got.push(String::from_utf8_lossy(&buf[..n as usize]).into_owned());
        }
        assert!(got.contains(&format!("+{name}")), "{got:?}");
        assert!(got.contains(&format!("-{name}")), "{got:?}");
        // Later tests in this process go on without a janitor.
        *janitor() = None;
    }

    #[test]
    fn create_open_unlink() {
        let name = unique_name("test");
        let a = Segment::create(&name, 4096).unwrap();
        assert!(a.is_creator());
        assert!(std::path::Path::new(&format!("{SHM_DIR}/{name}")).exists());
        let b = Segment::open(&name).unwrap();
        assert_eq!(b.len(), 4096);
        assert!(!b.is_creator());
        // SAFETY: both mappings are 4096 bytes long and only this thread touches them.
        unsafe {
            *a.as_ptr().add(100) = 42;
            assert_eq!(*b.as_ptr().add(100), 42);
        }
        drop(b);
        assert!(std::path::Path::new(&format!("{SHM_DIR}/{name}")).exists());
        drop(a);
        assert!(!std::path::Path::new(&format!("{SHM_DIR}/{name}")).exists());
    }

    #[test]
    fn unlink_early_keeps_the_mapping() {
        let name = unique_name("test");
        let a = Segment::create(&name, 4096).unwrap();
        a.unlink().unwrap();
        assert!(!std::path::Path::new(&format!("{SHM_DIR}/{name}")).exists());
        // SAFETY: 4096-byte mapping, this thread only.
        unsafe { *a.as_ptr() = 1 };
        a.unlink().unwrap();
        drop(a);
    }

    #[test]
    fn owner_only_mode() {
        use std::os::unix::fs::PermissionsExt;
        let name = unique_name("test");
        let _a = Segment::create(&name, 4096).unwrap();
        let mode = std::fs::metadata(format!("{SHM_DIR}/{name}"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "segment readable by others: {mode:o}");
    }

    #[test]
    fn missing_segment_is_a_clear_error() {
        let err = Segment::open("shmq_test_does_not_exist_1234").unwrap_err();
        assert!(matches!(err, Error::SegmentNotFound { .. }), "{err}");
        assert!(err.to_string().contains("does not exist on this machine"));
    }

    #[test]
    fn too_large_is_no_space_not_sigbus() {
        let free = shm_free_bytes().unwrap();
        let err = Segment::create(&unique_name("test"), (free + (1 << 30)) as usize).unwrap_err();
        assert!(matches!(err, Error::NoSpace { .. }), "{err}");
        assert!(err.to_string().contains("--shm-size"));
    }

    #[test]
    fn a_peer_truncating_the_file_is_an_error_not_a_sigbus() {
        let name = unique_name("test");
        let creator = Segment::create(&name, 8 * 4096).unwrap();
        let opener = Segment::open(&name).unwrap();
        let other = Segment::open(&name).unwrap();
        let path = format!("{SHM_DIR}/{name}");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        // Not touched yet: only the length check (a stat) sees it, and from then on
        // the atomic check too.
        opener.check_intact().unwrap();
        let err = opener.check_length().unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
        assert!(opener.check_intact().is_err());
        // SAFETY: inside the mapping; the page is gone from the file, so this faults and
        // the handler puts zero pages there (volatile: the access must happen).
        let v = unsafe { creator.as_ptr().add(5 * 4096).read_volatile() };
        assert_eq!(v, 0);
        let err = creator.check_intact().unwrap_err();
        assert!(
            matches!(&err, Error::BadSegment { name: n, reason } if *n == name
                && reason.contains("truncated by another process")),
            "{err}"
        );
        // Another mapping is hit only where it touches a lost page.
        other.check_intact().unwrap();
        // SAFETY: as above, in that opener's own mapping.
        unsafe { other.as_ptr().add(7 * 4096).write_volatile(1) };
        assert!(other.check_intact().is_err());
    }

    #[test]
    fn a_reservation_never_grows_a_truncated_file_back() {
        // Issue 32: a writer's reservation past a truncated end (mode 0 fallocate) made
        // the file whole again, so nobody faulted and readers took zeros for data.
        let name = unique_name("test");
        let creator = Segment::create_sparse(&name, 64 * 4096, 4096).unwrap();
        let opener = Segment::open(&name).unwrap();
        let path = format!("{SHM_DIR}/{name}");
        let len = || std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        for seg in [&creator, &opener] {
            // Inside what is left, or past it: the file is short, so both are the error.
            for (offset, n) in [(0, 4096), (8 * 4096, 4 * 4096)] {
                let err = seg.reserve_range(offset, n).unwrap_err();
                assert!(
                    matches!(&err, Error::BadSegment { name: n, reason } if *n == name
                        && reason.contains("truncated") && reason.contains("4096 bytes long now")),
                    "{err}"
                );
            }
            assert_eq!(len(), 4096, "a reservation grew the file");
            // And from then on, without a fault or a stat: even once the file is as long
            // as before again (its lost pages would read zeros).
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(64 * 4096)
                .unwrap();
            assert!(seg.check_intact().is_err());
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(4096)
                .unwrap();
        }
    }

    #[test]
    fn sparse_segment_larger_than_dev_shm_starts_and_reserves_as_used() {
        let free = shm_free_bytes().unwrap() as usize;
        let size = free.max(shm_total_bytes().unwrap() as usize) + (2 << 20);
        let seg = Segment::create_sparse(&unique_name("test"), size, 4096).unwrap();
        assert_eq!(seg.len(), size);
        seg.reserve_range(size - 8192, 4096).unwrap();
        // SAFETY: the page was just reserved; only this thread uses the mapping.
        unsafe { *seg.as_ptr().add(size - 8192) = 1 };
        // More than the whole tmpfs: refused before anything is allocated (tmpfs checks
        // the size first), so the test never fills the machine's /dev/shm.
        let beyond = shm_total_bytes().unwrap() as usize + (1 << 20);
        let err = seg.reserve_range(4096, beyond).unwrap_err();
        assert!(matches!(err, Error::NoSpace { .. }), "{err}");
        // Reserving still works once the name is gone (the creator keeps a descriptor).
        seg.unlink().unwrap();
        let err = seg.reserve_range(4096, beyond).unwrap_err();
        assert!(matches!(err, Error::NoSpace { .. }), "{err}");
    }

    #[test]
    fn the_warning_says_how_to_raise_dev_shm() {
        let m = shm_too_small_message("messages go over the socket", Some(1 << 20), Some(64 << 20));
        for needle in [
            "1 MiB free of 64 MiB",
            "--shm-size=1g",
            "--ipc=host",
            "medium: Memory",
        ] {
            assert!(m.contains(needle), "{m}");
        }
    }

    #[test]
    fn bad_names_are_rejected() {
        assert!(matches!(
            Segment::open("a/b"),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            Segment::create("", 10),
            Err(Error::InvalidArgument(_))
        ));
    }
}
