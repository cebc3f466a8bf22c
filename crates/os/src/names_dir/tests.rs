//! The directory of names in one process: its place and fallbacks, records made, held,
//! found dead and removed; another user's records and directories (as root) never used
//! nor removed. Several processes: `tests/names.rs` and the Python tests.

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use shmq_protocol::sync::local::{AtomicU32, Ordering};

use super::*;

/// A fresh `/dev/shm/.shmqtest-names-<pid>-<n>` (nothing there yet), removed with its
/// fallbacks when dropped.
struct Base(String);

impl Base {
    fn new() -> Base {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed); // Relaxed: only uniqueness matters
        Base(format!(
            "{SHM_DIR}/.shmqtest-names-{}-{n}",
            std::process::id()
        ))
    }
}

impl Drop for Base {
    fn drop(&mut self) {
        for n in 0..=4 {
            let path = if n == 0 {
                self.0.clone()
            } else {
                format!("{}.{n}", self.0)
            };
            match std::fs::symlink_metadata(&path) {
                Ok(m) if m.file_type().is_dir() => {
                    let _ = std::fs::remove_dir_all(&path);
                }
                Ok(_) => {
                    let _ = std::fs::remove_file(&path);
                }
                Err(_) => {}
            }
        }
    }
}

fn is_root() -> bool {
    uid() == 0
}

/// A record file written by hand (no lock: dead), as a damaged or abandoned one.
fn write_dead(dir: &NamesDir, file: &str, contents: &str) -> String {
    let path = dir.record_path(file);
    std::fs::write(&path, contents).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

#[test]
fn the_directory_is_made_owner_only_and_found_again() {
    let base = Base::new();
    assert!(NamesDir::find_in(&base.0, false).unwrap().is_none());
    let dir = NamesDir::find_in(&base.0, true).unwrap().unwrap();
    assert_eq!(dir.path(), base.0);
    let meta = std::fs::symlink_metadata(&base.0).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.mode() & 0o777, 0o700);
    assert_eq!(meta.uid(), uid());
    let again = NamesDir::find_in(&base.0, false).unwrap().unwrap();
    assert_eq!(again.path(), base.0);
}

#[test]
fn a_directory_others_may_enter_is_refused() {
    let base = Base::new();
    NamesDir::find_in(&base.0, true).unwrap().unwrap();
    std::fs::set_permissions(&base.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let err = NamesDir::find_in(&base.0, false).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::NamesDirRefused(DirRefusal::NotPrivate { mode, .. }) if mode & 0o777 == 0o755
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("only this user may enter"),
        "{err}"
    );
    let err = NamesDir::open(&base.0, "named by SHMQ_NAMES_DIR").unwrap_err();
    assert!(err.to_string().contains("named by SHMQ_NAMES_DIR"), "{err}");
}

#[test]
fn a_symlink_in_the_directorys_place_is_passed_by_for_a_fallback() {
    let base = Base::new();
    std::os::unix::fs::symlink("/tmp", &base.0).unwrap();
    let err = NamesDir::open(&base.0, "a test").unwrap_err();
    assert!(matches!(err, Error::NamesDirRefused(_)), "{err:?}");
    assert!(NamesDir::find_in(&base.0, false).unwrap().is_none());
    let dir = NamesDir::find_in(&base.0, true).unwrap().unwrap();
    assert_eq!(dir.path(), format!("{}.1", base.0));
    // Found again by the same rule, made no further.
    let again = NamesDir::find_in(&base.0, true).unwrap().unwrap();
    assert_eq!(again.path(), dir.path());
    assert!(std::fs::symlink_metadata(format!("{}.2", base.0)).is_err());
}

#[test]
fn a_record_is_published_once_held_and_removed_when_released() {
    let base = Base::new();
    let dir = || NamesDir::find_in(&base.0, true).unwrap().unwrap();
    let record = dir().new_record(b"{\"a\": 1}").unwrap();
    assert!(record.publish("q.one").unwrap());
    let mut held = record.hold("q.one").unwrap();
    assert!(held.is_held());
    // No temporary name is left beside it.
    let entries: Vec<_> = std::fs::read_dir(&base.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(entries, ["q.one"]);
    let meta = std::fs::metadata(held.path()).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o600);
    let found = dir().examine("q.one").unwrap();
    assert_eq!(found.liveness, Liveness::Alive);
    assert_eq!(found.contents.as_deref(), Some(&b"{\"a\": 1}"[..]));
    // A second record cannot be linked over it, and the held one is never removed.
    let other = dir().new_record(b"other").unwrap();
    assert!(!other.publish("q.one").unwrap());
    assert!(!dir().remove_dead("q.one", found.id.unwrap()));
    assert_eq!(dir().sweep(|_| true), 0);
    held.release();
    held.release(); // idempotent
    assert!(!held.is_held());
    assert!(dir().examine("q.one").is_none());
    assert!(other.publish("q.one").unwrap());
}

#[test]
fn a_dead_record_is_removed_and_only_if_it_is_still_the_same_file() {
    let base = Base::new();
    let dir = NamesDir::find_in(&base.0, true).unwrap().unwrap();
    write_dead(&dir, "q.dead", "not a record");
    let found = dir.examine("q.dead").unwrap();
    assert_eq!(found.liveness, Liveness::Dead);
    assert_eq!(found.contents.as_deref(), Some(&b"not a record"[..]));
    // Replaced meanwhile by another file: not removed.
    std::fs::remove_file(dir.record_path("q.dead")).unwrap();
    write_dead(&dir, "q.dead", "another");
    assert!(!dir.remove_dead("q.dead", found.id.unwrap()));
    let found = dir.examine("q.dead").unwrap();
    assert!(dir.remove_dead("q.dead", found.id.unwrap()));
    assert!(dir.examine("q.dead").is_none());
}

#[test]
fn a_sweep_removes_dead_records_it_is_told_are_records_and_nothing_else() {
    let base = Base::new();
    let dir = || NamesDir::find_in(&base.0, true).unwrap().unwrap();
    let d = dir();
    write_dead(&d, "q.dead", "{}");
    write_dead(&d, "unrelated", "{}");
    let live = dir().new_record(b"{}").unwrap();
    assert!(live.publish("q.live").unwrap());
    let _held = live.hold("q.live").unwrap();
    assert_eq!(d.sweep(|f| f.starts_with("q.")), 1);
    assert!(d.examine("q.dead").is_none());
    assert!(d.examine("q.live").is_some());
    assert!(d.examine("unrelated").is_some());
}

#[test]
fn a_record_of_this_user_open_to_others_is_judged_but_not_read() {
    let base = Base::new();
    let dir = NamesDir::find_in(&base.0, true).unwrap().unwrap();
    let path = write_dead(&dir, "q.loose", "{}");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let found = dir.examine("q.loose").unwrap();
    assert_eq!((found.liveness, found.contents), (Liveness::Dead, None));
    assert!(dir.remove_dead("q.loose", found.id.unwrap()));
}

#[test]
fn a_symlink_record_is_unknown_and_never_removed() {
    let base = Base::new();
    let dir = NamesDir::find_in(&base.0, true).unwrap().unwrap();
    let target = write_dead(&dir, "elsewhere", "{}");
    std::os::unix::fs::symlink(&target, dir.record_path("q.link")).unwrap();
    let found = dir.examine("q.link").unwrap();
    assert_eq!((found.liveness, found.contents), (Liveness::Unknown, None));
    assert_eq!(dir.sweep(|f| f.starts_with("q.")), 0);
    assert!(std::fs::symlink_metadata(dir.record_path("q.link")).is_ok());
}

/// As root (who can open every file): another user's record in this user's directory,
/// dead, is unknown, never read and never removed, by a sweep or a removal.
#[test]
fn another_users_record_is_never_read_nor_removed_even_by_root() {
    if !is_root() {
        eprintln!("skipped: giving a file to another user needs root");
        return;
    }
    let base = Base::new();
    let dir = NamesDir::find_in(&base.0, true).unwrap().unwrap();
    let path = write_dead(&dir, "q.strangers", "{\"kind\": \"queue\"}");
    std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
    let found = dir.examine("q.strangers").unwrap();
    assert_eq!((found.liveness, found.contents), (Liveness::Unknown, None));
    let id = FileId::of(&std::fs::symlink_metadata(&path).unwrap());
    assert!(!dir.remove_dead("q.strangers", id));
    assert_eq!(dir.sweep(|_| true), 0);
    assert!(std::fs::symlink_metadata(&path).is_ok());
}

/// As root: a stranger's directory (uid 65534, open to all) where this user's would go
/// is passed by, and this user's names go to the first fallback, made owner-only.
#[test]
fn a_strangers_directory_in_the_place_is_passed_by_as_root() {
    if !is_root() {
        eprintln!("skipped: giving a directory to another user needs root");
        return;
    }
    let base = Base::new();
    std::fs::create_dir(&base.0).unwrap();
    std::fs::set_permissions(&base.0, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(&base.0, Some(65534), Some(65534)).unwrap();
    let dir = NamesDir::find_in(&base.0, true).unwrap().unwrap();
    assert_eq!(dir.path(), format!("{}.1", base.0));
    let meta = std::fs::symlink_metadata(dir.path()).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o700));
    // The stranger's own directory is never opened as this user's.
    let err = NamesDir::open(&base.0, "a test").unwrap_err();
    assert!(err.to_string().contains("owner uid 65534"), "{err}");
}
