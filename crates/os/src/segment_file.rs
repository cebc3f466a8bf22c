//! A segment's file in `/dev/shm`: the one place that turns a segment's name into an
//! open file.
//!
//! A [`SegmentFile`] owns one descriptor of the file, opened by its path in [`SHM_DIR`]
//! (as `shm_open` would open it): close-on-exec, never through a symbolic link
//! (`O_NOFOLLOW`), read-write or read-only ([`Access`]), and, when it makes the file,
//! owner-only (mode 0600) and exclusively. Each open makes a new *open file
//! description*, which is what the open-file-description locks of `crate::liveness` and
//! `crate::pins` belong to: a role lock, a pin holder and a probe each open the file
//! afresh, so that no lock of one is another's (a `dup` would share them).
//!
//! Why each holder opens its own:
//! - the segment's mapping ([`crate::segment::Segment`]), read-write: shared pages are
//!   written through it; a creator keeps it to reserve pages (`fallocate`) and to read the
//!   file's size after the name is gone; an opener opens the file again by name when it
//!   reserves or remaps (a name that is gone has nothing left to reserve for it);
//! - a role ([`crate::liveness::RoleLock`]), read-write: a write lock needs a descriptor
//!   open for writing, and a description of its own;
//! - a probe ([`crate::liveness::LockProbe`]), read-only: it holds no lock, so every lock
//!   shows to it, this process's own included;
//! - pins ([`crate::pins::Pins`]), read-only: read locks, one description for all of a
//!   process's pins of the segment;
//! - private views ([`crate::private_map::PrivateFile`]), read-only: its `MAP_PRIVATE`
//!   views can never write the segment, whatever is written into them.
//!
//! Every open checks whose the file is, on the descriptor it opened (`fstat`, so a peer
//! cannot swap the file between the check and the use): a file that is not this
//! process's effective user's own (root included: root opens no other user's segment
//! either), or that its mode lets another user read or write, is refused with
//! [`Error::NotOwned`] (`PermissionError` in Python) naming its owner. Another local user
//! can create any name in `/dev/shm` (it is world-writable); without this check a
//! stranger's file under a victim's segment name would be mapped, trusted and its
//! records unpickled in the victim's process.
//!
//! Anyone who can open the file (the same user) can also truncate it, lock its bytes or
//! write it: what shmq guarantees against such a peer is in `crate::sigbus`.
//!
//! This module and `crate::segment` make the few `libc` calls a segment needs (`open` of
//! the path with `shm_open`'s flags, `ftruncate`, `mmap(MAP_SHARED)`, `unlink`); why no
//! shared-memory crate: `docs/design.md` ("Why the OS layer is built as it is").
#![allow(
    clippy::disallowed_methods,
    reason = "the segment module: it opens, creates and sizes segment files (clippy.toml)"
)]

use std::fs::{File, Metadata, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use crate::error::{Error, Result};

/// Where Linux keeps POSIX shared memory: the segments' files, whose bytes the role locks
/// lock (`crate::liveness` and `crate::segment` re-export it).
pub const SHM_DIR: &str = "/dev/shm";

/// The path of segment `name`'s file.
pub fn path(name: &str) -> String {
    format!("{SHM_DIR}/{name}")
}

/// How a [`SegmentFile`] is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read and write: for shared mappings, reservations and write (role) locks.
    ReadWrite,
    /// Read only: for read locks, probes and private views that must never write the
    /// segment.
    ReadOnly,
}

/// An open descriptor of a segment's file (closed when dropped): see the module docs.
#[derive(Debug)]
pub struct SegmentFile {
    file: File,
}

impl SegmentFile {
    /// Open segment `name`'s file, a new open file description; the error is the
    /// system's (callers that treat any failure as "cannot tell" or "nothing to do").
    /// A name that is not one file name in [`SHM_DIR`] is `InvalidInput`.
    /// A file of another user, or one others may read or write, is `PermissionDenied`
    /// carrying a [`ForeignSegment`] ([`Error::from_open`] turns it into
    /// [`Error::NotOwned`]).
    ///
    /// # Errors
    ///
    /// `InvalidInput` for a name that is not one file name; `NotFound` when no such file
    /// exists; `PermissionDenied` carrying a [`ForeignSegment`] for a file of another user
    /// or open to others; else the error of `open`.
    pub fn try_open(name: &str, access: Access) -> std::io::Result<SegmentFile> {
        let file = Self::options(name, access)?.open(path(name))?;
        check_own(name, &file)?;
        Ok(SegmentFile { file })
    }

    /// [`try_open`](Self::try_open), with the error naming the segment: "opening shared
    /// memory segment '...'" ([`Error::InvalidArgument`] for a name that is not one file
    /// name).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a name that is not one file name; [`Error::NotOwned`]
    /// for a file of another user or open to others; [`Error::Os`] naming the segment
    /// otherwise (no such file included).
    pub fn open(name: &str, access: Access) -> Result<SegmentFile> {
        check_name(name).map_err(|_| invalid_name(name))?;
        Self::try_open(name, access)
            .map_err(|e| Error::from_open(format!("opening shared memory segment '{name}'"), e))
    }

    /// [`try_open`](Self::try_open), with the error naming the file and why it was
    /// opened: "opening /dev/shm/... to `purpose`" ([`Error::InvalidArgument`] for a name
    /// that is not one file name).
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open), the [`Error::Os`] naming the file and `purpose`.
    pub fn open_to(name: &str, access: Access, purpose: &str) -> Result<SegmentFile> {
        check_name(name).map_err(|_| invalid_name(name))?;
        Self::try_open(name, access)
            .map_err(|e| Error::from_open(format!("opening {} to {purpose}", path(name)), e))
    }

    /// Create segment `name`'s file, empty, owner-only (mode 0600) and read-write; an
    /// error if the name exists (`AlreadyExists`), so the file is surely this caller's.
    ///
    /// # Errors
    ///
    /// `AlreadyExists` when a file of that name is there; `InvalidInput` for a name that is
    /// not one file name; else the error of `open` (no permission on `/dev/shm`).
    pub fn create(name: &str) -> std::io::Result<SegmentFile> {
        Self::options(name, Access::ReadWrite)?
            .create_new(true)
            .mode(0o600)
            .open(path(name))
            .map(|file| SegmentFile { file })
    }

    /// The open flags for `access`: std's `open` adds `O_CLOEXEC`; `O_NOFOLLOW` as
    /// `shm_open`, so a link a peer put at the name is never followed elsewhere.
    fn options(name: &str, access: Access) -> std::io::Result<OpenOptions> {
        check_name(name)?;
        let mut options = OpenOptions::new();
        options
            .read(true)
            .write(access == Access::ReadWrite)
            .custom_flags(libc::O_NOFOLLOW);
        Ok(options)
    }

    /// The file's metadata now (`fstat`): its size may differ from when it was opened
    /// (a peer can truncate it).
    ///
    /// # Errors
    ///
    /// The system's error of `fstat` (none is expected on an open descriptor).
    pub fn metadata(&self) -> std::io::Result<Metadata> {
        self.file.metadata()
    }

    /// The file's length in bytes now (`fstat`).
    ///
    /// # Errors
    ///
    /// As [`metadata`](Self::metadata).
    pub fn size(&self) -> std::io::Result<u64> {
        self.metadata().map(|m| m.len())
    }

    /// Set the file's length (`ftruncate`): only for a file this process just created.
    ///
    /// # Errors
    ///
    /// The system's error of `ftruncate`: `ENOSPC`/`EFBIG` for a length `/dev/shm` refuses,
    /// `EINVAL` for a file not open for writing.
    pub fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.file.set_len(len)
    }
}

/// Why an opened segment file was refused: it is not this process's user's own, or others
/// may read or write it (see the module docs). Carried inside the `std::io::Error` of
/// [`SegmentFile::try_open`]; [`Error::from_open`] makes it [`Error::NotOwned`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignSegment {
    /// The segment's name.
    pub name: String,
    /// The file's owner (uid).
    pub owner: u32,
    /// The file's permission bits.
    pub mode: u32,
    /// This process's effective uid.
    pub uid: u32,
}

impl std::fmt::Display for ForeignSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            name,
            owner,
            mode,
            uid,
        } = self;
        if owner != uid {
            write!(
                f,
                "shared memory segment '{name}' belongs to another user (uid {owner}, mode \
                 {mode:04o}; this process is uid {uid}): shmq opens only its own user's segments"
            )
        } else {
            write!(
                f,
                "shared memory segment '{name}' is open to other users (mode {mode:04o}, owner \
                 uid {owner}): shmq makes its segments owner-only (0600) and opens no other"
            )
        }
    }
}

impl std::error::Error for ForeignSegment {}

/// `PermissionDenied` (carrying a [`ForeignSegment`]) unless the opened `file` belongs to
/// this process's effective user and no other user may read or write it. On the
/// descriptor (`fstat`): the file checked is the file used.
fn check_own(name: &str, file: &File) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let mode = meta.mode() & 0o7777;
    if meta.uid() == uid && mode & 0o077 == 0 {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        ForeignSegment {
            name: name.to_owned(),
            owner: meta.uid(),
            mode,
            uid,
        },
    ))
}

/// Remove segment `name`'s file from [`SHM_DIR`] (as `shm_unlink`): every mapping and
/// open descriptor of it stays valid; the name is free for a new segment.
///
/// # Errors
///
/// `InvalidInput` for a name that is not one file name; `NotFound` when no such file
/// exists; `PermissionDenied` when `/dev/shm` refuses.
pub fn unlink(name: &str) -> std::io::Result<()> {
    check_name(name)?;
    std::fs::remove_file(path(name))
}

/// `InvalidInput` unless `name` is one file name in [`SHM_DIR`] (as `shm_open` takes
/// them: no `/`, not `.` or `..`; and no NUL, which no path can hold).
fn check_name(name: &str) -> std::io::Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("invalid segment name {name:?}"),
        ));
    }
    Ok(())
}

fn invalid_name(name: &str) -> Error {
    Error::InvalidArgument(format!("invalid segment name {name:?}"))
}

impl AsFd for SegmentFile {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl AsRawFd for SegmentFile {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_are_not_one_file_are_refused() {
        for name in ["", ".", "..", "a/b", "/x", "a\0b"] {
            let err = SegmentFile::try_open(name, Access::ReadOnly).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{name:?}");
        }
    }

    #[test]
    fn a_created_file_is_owner_only_exclusive_and_never_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let name = format!("shmq_test_segfile_{}", std::process::id());
        let f = SegmentFile::create(&name).unwrap();
        let mode = f.metadata().unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        let again = SegmentFile::create(&name).unwrap_err();
        assert_eq!(again.kind(), std::io::ErrorKind::AlreadyExists);
        f.set_len(4096).unwrap();
        let r = SegmentFile::open(&name, Access::ReadOnly).unwrap();
        assert_eq!(r.size().unwrap(), 4096);
        let link = format!("{name}_link");
        std::os::unix::fs::symlink(path(&name), path(&link)).unwrap();
        let err = SegmentFile::try_open(&link, Access::ReadOnly).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ELOOP));
        std::fs::remove_file(path(&link)).unwrap();
        std::fs::remove_file(path(&name)).unwrap();
        let err = SegmentFile::open(&name, Access::ReadWrite).unwrap_err();
        assert!(
            err.to_string()
                .starts_with(&format!("opening shared memory segment '{name}'")),
            "{err}"
        );
    }

    /// A file of this user's that others may read or write, and (where this process may
    /// give a file away: root) a file of another user, are refused by every open, with
    /// the owner named; neither is ever mapped.
    #[test]
    fn a_file_of_another_user_or_open_to_others_is_refused() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let name = format!("shmq_test_foreign_{}", std::process::id());
        let f = SegmentFile::create(&name).unwrap();
        f.set_len(4096).unwrap();
        std::fs::set_permissions(path(&name), std::fs::Permissions::from_mode(0o644)).unwrap();
        for access in [Access::ReadOnly, Access::ReadWrite] {
            let err = SegmentFile::try_open(&name, access).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied);
        }
        let err = SegmentFile::open(&name, Access::ReadOnly).unwrap_err();
        assert!(
            matches!(err, Error::NotOwned(ref f) if f.mode == 0o644),
            "{err}"
        );
        assert!(
            err.to_string().contains("open to other users (mode 0644"),
            "{err}"
        );
        let err = crate::segment::Segment::open(&name).unwrap_err();
        assert!(matches!(err, Error::NotOwned(_)), "{err}");
        std::fs::set_permissions(path(&name), std::fs::Permissions::from_mode(0o600)).unwrap();
        SegmentFile::open(&name, Access::ReadOnly).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(path(&name), Some(65534), Some(65534)).unwrap();
            assert_eq!(f.metadata().unwrap().uid(), 65534);
            let err = SegmentFile::open_to(&name, Access::ReadWrite, "lock a role").unwrap_err();
            assert!(
                matches!(err, Error::NotOwned(ref f) if f.owner == 65534 && f.uid == 0),
                "{err}"
            );
            assert!(
                err.to_string()
                    .contains("belongs to another user (uid 65534"),
                "{err}"
            );
            let err = crate::segment::Segment::open(&name).unwrap_err();
            assert!(matches!(err, Error::NotOwned(_)), "{err}");
        }
        std::fs::remove_file(path(&name)).unwrap();
    }
}
