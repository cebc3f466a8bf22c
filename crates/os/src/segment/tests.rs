//! The segment's unit tests (module `segment`).

use super::created::janitor;
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
    use std::os::unix::fs::MetadataExt;
    let name = unique_name("test");
    let seg = Segment::create(&name, 4096).unwrap();
    // The identity the janitor checks before it removes the name: this very file.
    let meta = std::fs::symlink_metadata(format!("{SHM_DIR}/{name}")).unwrap();
    let made = format!("+{}:{}:{name}", meta.dev(), meta.ino());
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
    assert!(got.contains(&made), "{got:?}");
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
fn an_empty_file_is_a_segment_not_set_up_yet_not_an_os_error() {
    // What an opener finds between its creator making the file and sizing it (two
    // processes of one deployment starting together): a clear BadSegment that a caller
    // can take as "not there yet", where mmap's EINVAL was an OS error.
    use std::os::unix::fs::OpenOptionsExt;
    let name = unique_name("test");
    let path = format!("{SHM_DIR}/{name}");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .unwrap();
    let err = Segment::open(&name).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    drop(file);
    assert!(matches!(err, Error::BadSegment { .. }), "{err}");
    assert!(err.to_string().contains("0 bytes long"), "{err}");
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

/// Issue 44: a name a file already has is `SegmentExists`, and a fresh name is drawn
/// again while the one drawn is taken (another user who made files under names shmq
/// draws cannot stop it making segments); names have the kernel's random bits.
#[test]
fn a_taken_name_is_drawn_again() {
    let name = unique_name("test");
    std::fs::write(path(&name), b"").unwrap();
    let err = Segment::create(&name, 4096).unwrap_err();
    assert!(matches!(err, Error::SegmentExists { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        format!("shared memory segment '{name}' already exists")
    );
    std::fs::remove_file(path(&name)).unwrap();

    let mut drawn = Vec::new();
    let seg = with_unique_name("test", |n| {
        drawn.push(n.to_owned());
        if drawn.len() < 5 {
            // Taken, as by a squatter who got there first.
            std::fs::write(path(n), b"").unwrap();
        }
        Segment::create(n, 4096)
    })
    .unwrap();
    assert_eq!(drawn.len(), 5);
    assert_eq!(seg.name(), drawn[4]);
    for n in &drawn[..4] {
        std::fs::remove_file(path(n)).unwrap();
    }
    let distinct: std::collections::HashSet<_> = drawn.iter().collect();
    assert_eq!(distinct.len(), drawn.len(), "{drawn:?}");

    // Past 16 tries the error is the caller's.
    let mut tries = 0;
    let err = with_unique_name("test", |n| -> Result<()> {
        tries += 1;
        Err(Error::SegmentExists { name: n.into() })
    })
    .unwrap_err();
    assert!(matches!(err, Error::SegmentExists { .. }));
    assert_eq!(tries, 16);
}

/// Issue 44: names people read (queues', stores') refuse a leading '-', control,
/// bidirectional-text and zero-width characters, naming the one found.
#[test]
fn names_with_characters_that_mislead_are_refused() {
    for (name, why) in [
        ("-store", "starts with '-'"),
        ("a\nb", "U+000A, a control character"),
        ("a\tb", "U+0009, a control character"),
        ("a\u{7f}b", "U+007F, a control character"),
        ("a\u{85}b", "U+0085, a control character"),
        ("abc\u{202E}gpj", "U+202E, a bidirectional-text control"),
        ("a\u{2066}b", "U+2066, a bidirectional-text control"),
        ("a\u{200F}b", "U+200F, a bidirectional-text control"),
        ("a\u{200B}b", "U+200B, a zero-width character"),
        ("a\u{2060}b", "U+2060, a zero-width character"),
        ("\u{FEFF}ab", "U+FEFF, a zero-width character"),
    ] {
        let trouble = name_trouble(name).unwrap_or_default();
        assert!(trouble.contains(why), "{name:?}: {trouble:?}");
        let err = Segment::create(name, 4096).unwrap_err().to_string();
        assert!(err.contains(why), "{name:?}: {err}");
        assert!(!std::path::Path::new(&path(name)).exists());
    }
    // A '-' inside a name is fine (vLLM's stores are `vllm_mm_<urlsafe base64>`), and
    // so is text that is not ASCII.
    for name in ["vllm_mm_-AbC_x-", "a-b", "scheduler → workers", "名前"] {
        assert_eq!(name_trouble(name), None, "{name:?}");
    }
}
