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
#![allow(
    clippy::disallowed_methods,
    reason = "the segment module: it maps segment files and reserves their pages (clippy.toml)"
)]

use shmq_protocol::sync::local::{AtomicBool, AtomicU64, Ordering};
use shmq_protocol::word::PublishedU64;
use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::OnceLock;

use crate::error::{AsOsError, Error, Result};
use crate::liveness::{RoleLock, CREATOR_BYTE};
pub use crate::segment_file::SHM_DIR;
use crate::segment_file::{path, Access, SegmentFile};

mod created;
mod loan_pages;

pub use created::{
    forget_created, forget_inherited_janitor_now, has_janitor, new_janitor_socket, note_created,
    remove_created, set_janitor,
};
use created::{is_noted, survivors, tell_janitor};
pub use loan_pages::{defer_unseal, retry_deferred_unseals, LoanPages, SEAL_MAPPINGS};

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

/// A fresh segment name: prefix, a kind tag, the creator's pid and 32 random bits from
/// the kernel's random source, so that another user cannot tell a name before the
/// segment is made (and make a file of that name first: see [`with_unique_name`], which
/// draws again when a name is taken).
pub fn unique_name(kind: &str) -> String {
    let r = match crate::random::random_bytes::<4>("a segment name") {
        Ok(b) => u32::from_le_bytes(b),
        // No getrandom (a kernel before 3.17): the clock and a counter, unique within
        // this process and unlikely to be met by another's.
        Err(_) => {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            // Relaxed: the counter only has to hand out distinct values in this process.
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            (nanos as u64 ^ (n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 16)) as u32
        }
    };
    format!(
        "{NAME_PREFIX}{kind}_{pid}_{r:08x}",
        pid = std::process::id()
    )
}

/// How many fresh names [`with_unique_name`] tries.
const UNIQUE_NAME_TRIES: usize = 16;

/// `create(name)` with a fresh [`unique_name`] of `kind`, drawn again (up to 16 times)
/// while the name is taken ([`Error::SegmentExists`]: a file of that name was there,
/// say one another user made to stop this process making segments).
/// `create` may return this layer's error or a layer's above that wraps it ([`AsOsError`]).
///
/// # Errors
///
/// `create`'s error: the last [`Error::SegmentExists`] after 16 names drawn were all taken,
/// or at once any other error of `create`.
pub fn with_unique_name<T, E: AsOsError>(
    kind: &str,
    mut create: impl FnMut(&str) -> Result<T, E>,
) -> Result<T, E> {
    let mut tries = 1;
    loop {
        match create(&unique_name(kind)) {
            Err(e)
                if matches!(e.as_os_error(), Some(Error::SegmentExists { .. }))
                    && tries < UNIQUE_NAME_TRIES =>
            {
                tries += 1
            }
            done => return done,
        }
    }
}

/// Bidirectional-text controls: embeddings and overrides (U+202A-U+202E), isolates
/// (U+2066-U+2069), the marks (U+200E, U+200F, U+061C).
const BIDI_CONTROLS: [char; 12] = [
    '\u{202A}', '\u{202B}', '\u{202C}', '\u{202D}', '\u{202E}', '\u{2066}', '\u{2067}', '\u{2068}',
    '\u{2069}', '\u{200E}', '\u{200F}', '\u{061C}',
];
/// Characters that show as nothing: zero-width space, non-joiner and joiner, word
/// joiner, and the byte-order mark (zero-width no-break space).
const ZERO_WIDTH: [char; 5] = ['\u{200B}', '\u{200C}', '\u{200D}', '\u{2060}', '\u{FEFF}'];

/// What is wrong with `name` as a name people read and type (a queue's, a store's):
/// `None` if nothing. Refused: a leading `-` (a command line takes it for an option:
/// `python -m shmq inspect -x`), a control character (Unicode category Cc: a newline,
/// a tab, NUL...), a bidirectional-text control (a right-to-left override makes a name
/// read as another), a zero-width character (two names that look the same). The one
/// check of both, so that they cannot drift apart.
pub fn name_trouble(name: &str) -> Option<String> {
    if name.starts_with('-') {
        return Some("it starts with '-' (a command line would take it for an option)".into());
    }
    name.chars().find_map(|c| {
        let what = if c.is_control() {
            "a control character"
        } else if BIDI_CONTROLS.contains(&c) {
            "a bidirectional-text control"
        } else if ZERO_WIDTH.contains(&c) {
            "a zero-width character"
        } else {
            return None;
        };
        Some(format!("{c:?} (U+{:04X}, {what}) is not allowed", c as u32))
    })
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 200 || name.contains('/') || name.contains('\0') {
        return Err(Error::InvalidArgument(format!(
            "invalid shared memory name {name:?}: it must be 1-200 characters without '/'"
        )));
    }
    Ok(())
}

/// [`check_name`] and, for a name about to be made, [`name_trouble`]'s rules.
fn check_new_name(name: &str) -> Result<()> {
    check_name(name)?;
    match name_trouble(name) {
        Some(why) => Err(Error::InvalidArgument(format!(
            "invalid shared memory name {name:?}: {why} (a name has no control characters, \
             bidirectional-text controls or zero-width characters, and does not start with '-')"
        ))),
        None => Ok(()),
    }
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
    ///
    /// # Errors
    ///
    /// As [`create_sparse`](Self::create_sparse), all of `size` reserved:
    /// [`Error::NoSpace`] when `/dev/shm` has less room than `size`.
    // The crate's own segments are all sparse now; tests and small fixed segments use it.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn create(name: &str, size: usize) -> Result<Self> {
        Self::create_sparse(name, size, size)
    }

    /// Create a new segment of `size` bytes of which only the first `reserve` bytes are
    /// reserved now; reserve more with [`reserve_range`](Self::reserve_range) before
    /// writing there (an unreserved page that cannot be had is a `SIGBUS` on first touch).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an invalid name or a `size` of 0;
    /// [`Error::SegmentExists`] when a file of that name is there; [`Error::NoSpace`] when
    /// `/dev/shm` has no room for `reserve` bytes; [`Error::Os`] when the file cannot be
    /// made, sized or mapped, or the process locks its memory as it maps it
    /// (`mlockall(MCL_FUTURE)` without `MCL_ONFAULT`).
    pub fn create_sparse(name: &str, size: usize, reserve: usize) -> Result<Self> {
        check_new_name(name)?;
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
                return Err(Error::SegmentExists { name: name.into() })
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
    ///
    /// # Errors
    ///
    /// As [`reserve_range`](Self::reserve_range) over the whole segment: [`Error::NoSpace`]
    /// when `/dev/shm` has no room for it.
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
    ///
    /// # Errors
    ///
    /// [`Error::NoSpace`] when `/dev/shm` has no room for the range (`fallocate`'s
    /// `ENOSPC`); [`Error::Os`] when the file cannot be opened read-write or `fallocate`
    /// fails otherwise.
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
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an invalid name; [`Error::SegmentNotFound`] when no
    /// segment has it; [`Error::NotOwned`] for a file of another user or open to others;
    /// [`Error::Os`] when it cannot be mapped (or the process locks its memory as it maps
    /// it, see [`create_sparse`](Self::create_sparse)).
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
            if len == 0 {
                // A file its creator has made and not sized yet (or a peer truncated):
                // nothing to map (`mmap` refuses a length of 0 with EINVAL).
                return Ok((file, None, 0));
            }
            let ptr = map_shared(&file, len)?;
            Ok((file, Some(ptr), len))
        });
        match opened {
            Ok((_, None, _)) => Err(Error::BadSegment {
                name: name.to_owned(),
                reason:
                    "it is 0 bytes long: its creator has not set it up yet (or it was truncated)"
                        .into(),
            }),
            Ok((file, Some(ptr), len)) => Ok(Segment {
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
            Err(e) => Err(Error::from_open(
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
    ///
    /// # Errors
    ///
    /// [`Error::BadSegment`] once another process truncated the segment under this mapping.
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
    ///
    /// # Errors
    ///
    /// [`Error::BadSegment`] when the segment was truncated (seen by a fault, or its file
    /// is shorter than this mapping now).
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
    /// Keep the segment when this process dies without its exit hook for as long as
    /// another process still holds it: for segments meant to outlive a crashed creator,
    /// such as a named encoder cache whose published entries stay readable to the
    /// consumers joined to it (each holds a role lock on its file) until a producer of the
    /// same name replaces it. It is still removed when this process drops it or exits
    /// normally. Its janitor, told with a descriptor of the file, removes it once no
    /// process holds any lock on it any more, the creator's own lock included — the
    /// creator gone and its last consumer gone, however each ended (vLLM SIGKILLs its
    /// workers when it stops: issue 54) — and only while the name is still this file.
    /// Without a janitor it is left for `shmq cleanup`.
    pub fn survive_crash(&self) {
        if self.is_creator() {
            survivors().push((std::process::id(), self.name.clone()));
            if !created::hand_to_janitor(&self.name, &self.file, true) {
                tell_janitor(b'-', &self.name);
            }
        }
    }

    /// Leave the removal of this segment (this process's own) to this process's janitor,
    /// which removes it once no process holds a lock on segment `wait_on`'s file (see
    /// `created::hand_to_janitor`); from then on this process removes it no more. False,
    /// and nothing changed, where that cannot be done (no janitor, not this process's
    /// segment, `wait_on` cannot be opened): the segment is then removed as before.
    pub fn hand_removal_to_janitor(&self, wait_on: &str) -> bool {
        if !self.is_creator() {
            return false;
        }
        let Ok(file) = SegmentFile::try_open(wait_on, Access::ReadWrite) else {
            return false;
        };
        created::hand_to_janitor(&self.name, &file, false)
    }

    /// Remove the segment's name now, if this process created it; the mapping stays
    /// valid for every process that has it. Used to clean up at interpreter exit, when
    /// objects may never be dropped.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the file cannot be removed for another reason than being gone
    /// already (no permission on `/dev/shm`).
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
    /// # Errors
    ///
    /// [`Error::BadSegment`] naming the segment when it is shorter than `check.min_len`, or
    /// its magic or layout version is not `check`'s (another kind of segment, or another
    /// version of shmq).
    ///
    /// # Safety
    ///
    /// `check.min_len` must be at least `size_of::<H>()`, `H` must need no more than a
    /// page's alignment (the mapping is page-aligned), and every bit pattern must be a
    /// valid `H`: a peer with access to the segment may have written anything there.
    pub unsafe fn checked_header<H>(
        &self,
        check: &HeaderCheck,
        fields: impl FnOnce(&H) -> (&PublishedU64, &u32),
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
        // Acquire (`PublishedU64::get`): pairs with the creator's Release store of the
        // magic, which it makes last: an opener that sees the magic sees the header
        // fields written before it.
        if magic.get() != check.magic {
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

#[cfg(test)]
mod tests;
