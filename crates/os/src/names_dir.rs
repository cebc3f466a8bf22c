//! This user's directory of names: where a writer that opens by name records its handle
//! (`shmq_core::names` decides what a record holds; this module keeps the files), for
//! the processes of the same user on this machine, in any language (Python's
//! `MessageQueue.open` and Rust's `Reader::open_by_name` read the same files).
//!
//! **The directory.** `/dev/shm/.shmq-names-<uid>` (`<uid>`: this process's effective
//! user), made owner-only (0700) by the first named writer. Where that entry is not this
//! user's directory (another user made it first, or put a symlink there: anyone may
//! create entries in `/dev/shm`, and only their owner may remove them), the user's names
//! live in the first of `.shmq-names-<uid>.1`, `.2`, ... that is (made if none is): every
//! process of the user, in any container sharing `/dev/shm`, finds the same one by the
//! same rule (the directory of the user with the lowest number), and a warning names the
//! squatted entry. So a stranger cannot deny a user's names by squatting, only push them
//! to another directory. One race is left: a stranger who removes its squat while the
//! user's processes make their first directory can have two of them made (from then on
//! all use the lower one; a writer already recorded in the other is not found by name
//! until it ends). [`DIRECTORY_ENV`] (`SHMQ_NAMES_DIR`) names a directory of the user's
//! choice instead (made 0700 if missing): set it alike in every process that shares
//! names. A directory is opened without following a symbolic link (`O_NOFOLLOW`) and
//! checked on the descriptor opened (`fstat`): one that is not this user's, or that
//! others may enter, is refused ([`Error::NamesDirRefused`], `PermissionError` in Python):
//! it could show this user another's queues. Every record is then reached through that
//! descriptor (`openat`, `linkat`, `unlinkat`), never through the path again.
//!
//! **A record is a file of its own**, named by the caller (a hash of the name, so that
//! every name fits in a file name), made owner-only (0600) with no name at all
//! (`O_TMPFILE`; where the file system has none, under a temporary name that no lookup
//! reads), its writer's lock taken and its bytes written, and only then linked under its
//! name. `link` fails on a name that exists, so no record is ever replaced in place and a
//! reader never sees half of one.
//!
//! **Who holds a name: a lock, not a pid.** The writer holds an open-file-description
//! lock (`F_OFD_SETLK`) on byte [`WRITER_BYTE`] of its record's file for as long as it
//! holds the name ([`HeldRecord`]). The kernel drops the lock when the writer closes its
//! descriptor, which is also when it dies, however it dies (a forked child's copy of the
//! descriptor is closed in the child at once: see [`crate::fork`]). Every process that
//! can open the file sees the lock, whatever its pid namespace (as the role locks of
//! [`crate::liveness`]). A record is therefore **alive** (its lock is held), **dead** (it
//! is not: proved; a record whose lock nobody ever held, such as a damaged file, is dead
//! too), or **unknown** (the lock cannot be tested, or the file is not this user's).
//! Only a dead record of this user's is removed or taken over; an unknown one is never
//! touched.
//!
//! **Removing a dead record is race-free** ([`NamesDir::remove_dead`]). The remover takes
//! a second lock, on byte [`REMOVER_BYTE`] of that same file, checks that the name still
//! leads to that file and that its writer's byte is still free, and unlinks it: no other
//! remover unlinks it meanwhile (it holds byte 1), its writer is gone (so it does not
//! either), and a name that exists cannot be linked over, so the name still leads to this
//! file when it is unlinked, never to a new writer's. A file that is not this user's own
//! is never removed, also by root (who could open it).
//!
//! **Records are read only if they are this user's and only this user's** (owner and
//! mode, on the descriptor opened with `O_NOFOLLOW`): another user's file, or a symbolic
//! link, is unknown and never read; a file of this user's that others may read or write
//! is judged by its lock (and removed once dead) but its bytes are not trusted.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::fork;
use crate::liveness::{byte_liveness, lock_byte, Liveness};
use crate::segment_file::SHM_DIR;

/// The environment variable that names a directory to keep this user's names in instead
/// of `/dev/shm/.shmq-names-<uid>` (see the module docs).
pub const DIRECTORY_ENV: &str = "SHMQ_NAMES_DIR";

/// The lock byte of a record's writer, held for as long as it holds the name.
pub const WRITER_BYTE: u64 = 0;

/// The lock byte a process holds while it removes a dead record.
pub const REMOVER_BYTE: u64 = 1;

/// How far past `.shmq-names-<uid>` a user's directory is looked for, when strangers
/// squat that many entries.
pub const MAX_FALLBACK: u32 = 1000;

/// The most bytes of a record that are read; a longer file is not a record (its bytes
/// are not returned).
pub const MAX_RECORD_BYTES: u64 = 1 << 20;

/// The prefix of a record's temporary name where the file system makes no unnamed
/// files: never a record's name, so lookups and sweeps pass it by.
const TEMPORARY_PREFIX: &str = ".new.";

/// This process's effective uid: whose directories and records are this process's own
/// (files are made with it).
pub fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Which file a name led to (device and inode): a name that still leads to the same
/// file has not been removed and linked anew meanwhile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    fn of(meta: &std::fs::Metadata) -> FileId {
        FileId {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }
}

/// Why a directory of names was refused (see the module docs); the error's text says
/// what to do. Carried by [`Error::NamesDirRefused`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DirRefusal {
    /// The directory at `path` is not a directory of this user's that only this user may
    /// enter (`owner`, `mode` and whether it is a directory, as found; `how`: which
    /// directory it was, "named by SHMQ_NAMES_DIR" or "this user's directory of names").
    NotPrivate {
        /// Where it is.
        path: String,
        /// Which directory it was meant to be.
        how: &'static str,
        /// Its owner (uid).
        owner: u32,
        /// Its type and permission bits (`st_mode`).
        mode: u32,
        /// This process's effective uid.
        uid: u32,
    },
    /// `base` and every fallback up to `base.`[`MAX_FALLBACK`] are other users' entries.
    AllTaken {
        /// `/dev/shm/.shmq-names-<uid>`.
        base: String,
    },
}

impl std::fmt::Display for DirRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DirRefusal::NotPrivate {
                path,
                how,
                owner,
                mode,
                uid,
            } => {
                let what = match mode & libc::S_IFMT {
                    libc::S_IFDIR => "directory",
                    libc::S_IFLNK => "symbolic link",
                    _ => "file",
                };
                write!(
                    f,
                    "{path} ({how}) is not a directory of queue and store names that only this \
                     user may enter (a {what} of owner uid {owner}, mode {:04o}; this is uid \
                     {uid}): opening by name is refused until it is; handles still work",
                    mode & 0o7777
                )
            }
            DirRefusal::AllTaken { base } => write!(
                f,
                "{base} and {base}.1 to .{MAX_FALLBACK} are all taken by other users: opening \
                 by name is refused; set {DIRECTORY_ENV} to a directory of this user's \
                 (handles still work)"
            ),
        }
    }
}

impl std::error::Error for DirRefusal {}

// ---------------------------------------------------------------------------------
// System calls on a directory's descriptor

fn c_string(s: &str) -> std::io::Result<CString> {
    CString::new(s).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{s:?} holds a NUL byte"),
        )
    })
}

/// `openat(dir, name, flags | O_CLOEXEC, mode)` as a `File` (its descriptor owned).
fn open_at(
    dir: RawFd,
    name: &CStr,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> std::io::Result<File> {
    // SAFETY: `name` is a NUL-terminated string alive for the call; `dir` is a descriptor
    // the caller owns for the call (or AT_FDCWD). A peer may change the directory's
    // entries at any time: the flags (O_NOFOLLOW, O_EXCL, O_TMPFILE) and the caller's
    // checks on the opened descriptor are what make the result safe to use.
    let fd = unsafe {
        libc::openat(
            dir,
            name.as_ptr(),
            flags | libc::O_CLOEXEC,
            libc::c_uint::from(mode),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just made for us and nothing else owns it.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The file `name` in `dir` leads to, itself if a symbolic link (`fstatat` with
/// `AT_SYMLINK_NOFOLLOW`).
fn id_at(dir: RawFd, name: &CStr) -> std::io::Result<FileId> {
    // SAFETY: all-zero is a valid `stat`, which the kernel fills.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated name and a `stat` to fill, both alive for the call; `dir`
    // is owned by the caller for the call.
    if unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(FileId {
        dev: st.st_dev,
        ino: st.st_ino,
    })
}

/// `unlinkat(dir, name, 0)`.
fn unlink_at(dir: RawFd, name: &CStr) -> std::io::Result<()> {
    // SAFETY: a NUL-terminated name alive for the call; `dir` is owned by the caller for
    // the call. Only the directory entry goes; open descriptors of the file stay valid.
    if unsafe { libc::unlinkat(dir, name.as_ptr(), 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `linkat(from_dir, from, to_dir, to, flags)`: `Ok(false)` if `to` exists already.
fn link_at(
    from_dir: RawFd,
    from: &CStr,
    to_dir: RawFd,
    to: &CStr,
    flags: libc::c_int,
) -> std::io::Result<bool> {
    // SAFETY: NUL-terminated names alive for the call; the descriptors are owned by the
    // caller for the call (or AT_FDCWD). linkat never replaces an existing name (EEXIST),
    // whatever a peer does meanwhile.
    if unsafe { libc::linkat(from_dir, from.as_ptr(), to_dir, to.as_ptr(), flags) } != 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EEXIST) => Ok(false),
            _ => Err(e),
        };
    }
    Ok(true)
}

/// Whether `meta` is a regular file of this user's.
fn own_regular_file(meta: &std::fs::Metadata) -> bool {
    meta.file_type().is_file() && meta.uid() == uid()
}

// ---------------------------------------------------------------------------------
// The directory

/// Entries already warned about (`(squatted base, directory used)`): once per process.
static WARNED: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// What is at `path`: `None` if nothing, else whether it is a directory of this user's
/// (not a symbolic link to one).
fn ours(path: &str) -> Option<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) => Some(meta.file_type().is_dir() && meta.uid() == uid()),
        Err(_) => None,
    }
}

/// The numbers `n` of the entries `<base>.<n>` of `base`'s parent, in order.
fn fallbacks(base: &str) -> Vec<u32> {
    let (parent, stem) = base.rsplit_once('/').unwrap_or((".", base));
    let prefix = format!("{stem}.");
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut numbers: Vec<u32> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let suffix = name.strip_prefix(&prefix)?;
            let n: u32 = suffix.parse().ok()?;
            // Only the canonical spelling (no sign, no leading zeros).
            (n.to_string() == suffix).then_some(n)
        })
        .collect();
    numbers.sort_unstable();
    numbers
}

/// Warn, once per process, that `base` is not this user's and `path` is used instead.
fn note_fallback(base: &str, path: &str) {
    let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    if warned.iter().any(|(b, p)| b == base && p == path) {
        return;
    }
    warned.push((base.to_owned(), path.to_owned()));
    let what = match std::fs::symlink_metadata(base) {
        Ok(meta) if meta.file_type().is_symlink() => format!("a symlink of uid {}", meta.uid()),
        Ok(meta) => format!("an entry of uid {}", meta.uid()),
        Err(_) => "gone now".to_owned(),
    };
    warn_user!(
        "{base} is not this user's directory of queue and store names ({what}; this is uid \
         {}): this user's names are in {path}, which every process of this user sharing \
         {SHM_DIR} finds the same way; set {DIRECTORY_ENV} to choose the directory",
        uid()
    );
}

/// This user's directory of names, open (see the module docs).
#[derive(Debug)]
pub struct NamesDir {
    path: String,
    dir: OwnedFd,
}

impl NamesDir {
    /// This user's directory of names: the one [`DIRECTORY_ENV`] names if it is set (and
    /// not empty), else `/dev/shm/.shmq-names-<uid>` or its fallback (see the module
    /// docs). `Ok(None)` when there is none yet and `create` is false.
    /// [`Error::NamesDirRefused`] when the one found may be entered by others or is not
    /// this user's directory, or when strangers hold every fallback.
    ///
    /// # Errors
    ///
    /// [`Error::NamesDirRefused`] when the directory found (or the one [`DIRECTORY_ENV`]
    /// names) is not this user's or others may enter it, or is not a directory;
    /// [`Error::Os`] when it cannot be opened or made.
    pub fn find(create: bool) -> Result<Option<NamesDir>> {
        match std::env::var(DIRECTORY_ENV) {
            Ok(chosen) if !chosen.is_empty() => {
                if create {
                    // An error (it exists, or cannot be made) shows in the open below.
                    let _ = std::fs::DirBuilder::new().mode(0o700).create(&chosen);
                }
                Self::open(&chosen, "named by SHMQ_NAMES_DIR")
            }
            _ => Self::find_in(&format!("{SHM_DIR}/.shmq-names-{}", uid()), create),
        }
    }

    /// The directory of names whose default place is `base` (`/dev/shm/.shmq-names-<uid>`
    /// outside tests), or its fallback.
    fn find_in(base: &str, create: bool) -> Result<Option<NamesDir>> {
        const HOW: &str = "this user's directory of names";
        if ours(base) == Some(true) {
            return Self::open(base, HOW);
        }
        // Absent, or not this user's: this user's names are in the directory of this
        // user with the lowest number, if there is one. (None is made below it while one
        // exists, so every process of the user picks the same one.)
        for n in fallbacks(base) {
            let path = format!("{base}.{n}");
            if ours(&path) == Some(true) {
                let found = Self::open(&path, HOW)?;
                note_fallback(base, &path);
                return Ok(found);
            }
        }
        if !create {
            return Ok(None);
        }
        for n in 0..=MAX_FALLBACK {
            let path = if n == 0 {
                base.to_owned()
            } else {
                format!("{base}.{n}")
            };
            if ours(&path).is_none() {
                // Another process may make it at the same moment: whose it is decides.
                let _ = std::fs::DirBuilder::new().mode(0o700).create(&path);
            }
            if ours(&path) == Some(true) {
                let found = Self::open(&path, HOW)?;
                if n > 0 {
                    note_fallback(base, &path);
                }
                return Ok(found);
            }
        }
        Err(Error::NamesDirRefused(DirRefusal::AllTaken {
            base: base.to_owned(),
        }))
    }

    /// Open the directory at `path` (`how`: which it is, for the error): `Ok(None)` if
    /// nothing is there; refused unless it is a directory of this user's that no one else
    /// may enter, checked on the descriptor opened (never through a symbolic link).
    ///
    /// # Errors
    ///
    /// [`Error::NamesDirRefused`] when `path` is a symbolic link, not a directory, not this
    /// user's, or others may enter it; [`Error::Os`] when it cannot be opened for another
    /// reason.
    pub fn open(path: &str, how: &'static str) -> Result<Option<NamesDir>> {
        let c_path = c_string(path).map_err(|e| Error::os(format!("opening {path}"), e))?;
        let refused = |owner: u32, mode: u32| {
            Error::NamesDirRefused(DirRefusal::NotPrivate {
                path: path.to_owned(),
                how,
                owner,
                mode,
                uid: uid(),
            })
        };
        let file = match open_at(
            libc::AT_FDCWD,
            &c_path,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
        ) {
            Ok(file) => file,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            // A symbolic link (ELOOP) or not a directory (ENOTDIR): refused, named.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                let meta = std::fs::symlink_metadata(path)
                    .map_err(|e| Error::os(format!("looking at {path}"), e))?;
                return Err(refused(meta.uid(), meta.mode()));
            }
            Err(e) => return Err(Error::os(format!("opening the directory {path}"), e)),
        };
        let meta = file
            .metadata()
            .map_err(|e| Error::os(format!("looking at {path}"), e))?;
        if !meta.file_type().is_dir() || meta.uid() != uid() || meta.mode() & 0o077 != 0 {
            return Err(refused(meta.uid(), meta.mode()));
        }
        Ok(Some(NamesDir {
            path: path.to_owned(),
            dir: OwnedFd::from(file),
        }))
    }

    /// Where the directory is.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Where the record file `file` is (or would be).
    pub fn record_path(&self, file: &str) -> String {
        format!("{}/{file}", self.path)
    }

    fn raw(&self) -> RawFd {
        self.dir.as_raw_fd()
    }

    /// The record file `file`: whether its writer holds it, its bytes if it is a file of
    /// this user's that only this user may read and write (and at most
    /// [`MAX_RECORD_BYTES`]), and which file it is. `None` if there is no such file.
    pub fn examine(&self, file: &str) -> Option<Examined> {
        let name = c_string(file).ok()?;
        let mut f = match open_at(
            self.raw(),
            &name,
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
            0,
        ) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return None,
            // A symbolic link, or a file this process may not open: not a record of
            // this user's, and never touched.
            Err(_) => {
                return Some(Examined {
                    liveness: Liveness::Unknown,
                    contents: None,
                    id: id_at(self.raw(), &name).ok(),
                })
            }
        };
        let Ok(meta) = f.metadata() else {
            return Some(Examined {
                liveness: Liveness::Unknown,
                contents: None,
                id: None,
            });
        };
        let id = Some(FileId::of(&meta));
        if !own_regular_file(&meta) {
            return Some(Examined {
                liveness: Liveness::Unknown,
                contents: None,
                id,
            });
        }
        // A record is written in full before it is linked under its name and never
        // changed after, so what is read is what its writer wrote.
        let contents = if meta.mode() & 0o077 == 0 && meta.len() <= MAX_RECORD_BYTES {
            let mut bytes = Vec::new();
            (&mut f)
                .take(MAX_RECORD_BYTES + 1)
                .read_to_end(&mut bytes)
                .ok()
                .filter(|_| bytes.len() as u64 <= MAX_RECORD_BYTES)
                .map(|_| bytes)
        } else {
            None
        };
        Some(Examined {
            liveness: byte_liveness(&f, WRITER_BYTE),
            contents,
            id,
        })
        // `f` holds no lock: closing it releases nobody's.
    }

    /// Remove the record file `file` if it is still the file `seen`, still dead and this
    /// user's (see the module docs: safe against every other process doing the same, and
    /// against new writers). Returns whether it removed it; any failure is "not removed".
    pub fn remove_dead(&self, file: &str, seen: FileId) -> bool {
        let Ok(name) = c_string(file) else {
            return false;
        };
        // Read-write: the remover's lock is a write lock.
        let Ok(f) = open_at(
            self.raw(),
            &name,
            libc::O_RDWR | libc::O_NOFOLLOW | libc::O_NONBLOCK,
            0,
        ) else {
            return false; // gone already, or not a file this process may open
        };
        let Ok(meta) = f.metadata() else {
            return false;
        };
        // Another record by now, or a file that is not this user's (root can open any:
        // another user's file is never removed).
        if FileId::of(&meta) != seen || !own_regular_file(&meta) {
            return false;
        }
        if lock_byte(&f, libc::F_WRLCK, REMOVER_BYTE).is_err() {
            return false; // another remover is at it
        }
        if byte_liveness(&f, WRITER_BYTE) != Liveness::Dead {
            return false;
        }
        if id_at(self.raw(), &name).ok() != Some(seen) {
            return false;
        }
        unlink_at(self.raw(), &name).is_ok()
        // Dropping `f` releases the remover's lock.
    }

    /// Remove every dead record of this user's whose file name `is_record` accepts
    /// (records of writers that died: SIGKILL leaves them), so that they do not pile up
    /// in `/dev/shm`. Only dead ones: a live writer in another pid namespace holds its
    /// lock as any other does. Returns how many it removed.
    pub fn sweep(&self, is_record: impl Fn(&str) -> bool) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.path) else {
            return 0;
        };
        let mut removed = 0;
        for entry in entries.filter_map(|e| e.ok()) {
            let Ok(file) = entry.file_name().into_string() else {
                continue;
            };
            if !is_record(&file) {
                continue; // a record not yet published, or another version's file
            }
            let Some(found) = self.examine(&file) else {
                continue;
            };
            if let (Liveness::Dead, Some(id)) = (found.liveness, found.id) {
                removed += usize::from(self.remove_dead(&file, id));
            }
        }
        removed
    }

    /// A new record holding `contents`, its writer's lock already held, not yet under
    /// any name a lookup reads: publish it with [`NewRecord::publish`].
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the record's file cannot be made, written or locked in the
    /// directory (no room, no permission, `getrandom` refused for its temporary name).
    pub fn new_record(self, contents: &[u8]) -> Result<NewRecord> {
        let path = self.path.clone();
        let context = || format!("making a record of a name in {path}");
        let (mut file, temporary) = match self.unnamed_file() {
            Ok(file) => (file, None),
            Err(_) => {
                let random = crate::random::random_bytes::<16>("a record's temporary name")?;
                let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
                let temporary = c_string(&format!("{TEMPORARY_PREFIX}{hex}"))
                    .map_err(|e| Error::os(context(), e))?;
                let file = open_at(
                    self.raw(),
                    &temporary,
                    libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
                    0o600,
                )
                .map_err(|e| Error::os(context(), e))?;
                (file, Some(temporary))
            }
        };
        let mut record = NewRecord {
            file: None,
            temporary,
            dir: Some(self),
        };
        // Nobody else can have this file open yet (it has no name, or a random one in a
        // directory only this user enters): the lock is free.
        let written =
            lock_byte(&file, libc::F_WRLCK, WRITER_BYTE).and_then(|()| file.write_all(contents));
        if let Err(e) = written {
            return Err(Error::os(context(), e)); // `record` removes its temporary name
        }
        record.file = Some(file);
        Ok(record)
    }

    /// An unnamed file in the directory (`O_TMPFILE`), where it can later be linked
    /// through `/proc/self/fd` (which `linkat` must follow).
    fn unnamed_file(&self) -> std::io::Result<File> {
        if !std::path::Path::new("/proc/self/fd").is_dir() {
            return Err(std::io::ErrorKind::NotFound.into());
        }
        open_at(self.raw(), c".", libc::O_TMPFILE | libc::O_RDWR, 0o600)
    }
}

/// What [`NamesDir::examine`] found of a record file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Examined {
    /// Whether its writer holds it ([`Liveness::Unknown`] for a file that is not this
    /// user's, or a symbolic link).
    pub liveness: Liveness,
    /// Its bytes, if it is a file of this user's that only this user may read and
    /// write, of at most [`MAX_RECORD_BYTES`].
    pub contents: Option<Vec<u8>>,
    /// Which file it is, if that could be told (for [`NamesDir::remove_dead`]).
    pub id: Option<FileId>,
}

/// A record written and locked, not yet published under its name (see
/// [`NamesDir::new_record`]). Dropped unpublished, it is gone.
#[derive(Debug)]
pub struct NewRecord {
    /// `None` only while it is being made, and once held.
    file: Option<File>,
    /// Its temporary name, where the file system makes no unnamed files.
    temporary: Option<CString>,
    /// `None` once held.
    dir: Option<NamesDir>,
}

impl NewRecord {
    fn names_dir(&self) -> &NamesDir {
        self.dir
            .as_ref()
            .expect("a NewRecord has its directory until held")
    }

    /// The directory it is in.
    pub fn dir(&self) -> &NamesDir {
        self.names_dir()
    }

    /// Link the record under the file name `file`: `Ok(false)` if a record is there
    /// already (`link` never replaces one).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when `link` fails for another reason than a record already there
    /// (`Ok(false)`): the directory removed, no room, no permission.
    pub fn publish(&self, file: &str) -> Result<bool> {
        let dir = self.names_dir();
        let context = || format!("linking a record of a name as {}", dir.record_path(file));
        let to = c_string(file).map_err(|e| Error::os(context(), e))?;
        let linked = match (&self.temporary, &self.file) {
            (Some(temporary), _) => link_at(dir.raw(), temporary, dir.raw(), &to, 0),
            (None, Some(f)) => {
                let proc_path = c_string(&format!("/proc/self/fd/{}", f.as_raw_fd()))
                    .map_err(|e| Error::os(context(), e))?;
                link_at(
                    libc::AT_FDCWD,
                    &proc_path,
                    dir.raw(),
                    &to,
                    libc::AT_SYMLINK_FOLLOW,
                )
            }
            (None, None) => unreachable!("a NewRecord has its file until held"),
        };
        linked.map_err(|e| Error::os(context(), e))
    }

    /// Hold the name the record was published under (`file`): the writer's lock stays
    /// held until the [`HeldRecord`] is released or dropped, or the process ends.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when `file` is not a valid file name or the record's file cannot be
    /// looked at (`fstat`).
    pub fn hold(mut self, file: &str) -> Result<HeldRecord> {
        let name = c_string(file).map_err(|e| Error::os("holding a record", e))?;
        let dir = self
            .dir
            .take()
            .expect("a NewRecord has its directory until held");
        if let Some(temporary) = self.temporary.take() {
            let _ = unlink_at(dir.raw(), &temporary); // linked under `file` now
        }
        let f = self
            .file
            .take()
            .expect("a NewRecord has its file until held");
        let id = f
            .metadata()
            .map(|m| FileId::of(&m))
            .map_err(|e| Error::os(format!("looking at {}", dir.record_path(file)), e))?;
        // A forked child closes its copy at once: it must not keep a dead writer's name.
        fork::close_in_children(f.as_raw_fd());
        Ok(HeldRecord {
            file: Some(f),
            path: dir.record_path(file),
            name,
            id,
            dir,
            generation: fork::generation(),
        })
    }
}

impl Drop for NewRecord {
    fn drop(&mut self) {
        if let (Some(temporary), Some(dir)) = (&self.temporary, &self.dir) {
            let _ = unlink_at(dir.raw(), temporary);
        }
    }
}

/// A name held: the descriptor that holds its record's writer lock. [`release`] (or
/// dropping it) removes the record, if it is still this one, and lets the lock go; a
/// forked child's copy holds nothing and removes nothing.
///
/// [`release`]: HeldRecord::release
#[derive(Debug)]
pub struct HeldRecord {
    file: Option<File>,
    dir: NamesDir,
    name: CString,
    path: String,
    id: FileId,
    generation: u64,
}

impl HeldRecord {
    /// Where the record is.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Whether the name is still held (not released).
    pub fn is_held(&self) -> bool {
        self.file.is_some() && !fork::is_inherited(self.generation)
    }

    /// Remove the record (if it is still this one) and drop the lock. Idempotent; in a
    /// forked child, it only forgets the descriptor (closed at the fork).
    pub fn release(&mut self) {
        let Some(file) = self.file.take() else { return };
        if fork::is_inherited(self.generation) {
            // The fork handler closed this descriptor number in the child already; it
            // may name another file by now: do not close it again.
            std::mem::forget(file);
            return;
        }
        // Nobody else removes a record whose lock is held: if the name still leads to
        // this file, it is ours.
        if id_at(self.dir.raw(), &self.name).ok() == Some(self.id) {
            let _ = unlink_at(self.dir.raw(), &self.name);
        }
        fork::forget_fd(file.as_fd().as_raw_fd());
        drop(file); // releases the lock
    }
}

impl Drop for HeldRecord {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests;
