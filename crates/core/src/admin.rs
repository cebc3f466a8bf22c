//! Finding, describing and removing shmq segments: what `python -m shmq cleanup` and
//! `python -m shmq inspect` do.
//!
//! Every segment shmq creates is in `/dev/shm`, named `shmq_*` unless its creator chose the
//! name, and records its creator (pid and start time) in its header. A segment whose creator is gone was left by a
//! crash (a clean exit removes it) and can be removed; readers that still map it keep
//! their mapping.
//!
//! # Examples
//!
//! ```
//! use shmq_core::admin::{self, Metrics, SegmentKind};
//! use shmq_core::liveness::Liveness;
//! use shmq_core::{QueueOptions, Writer};
//!
//! let writer = Writer::new(QueueOptions::local(1))?;
//! let ring = writer.ring().expect("local readers: a ring").name().to_owned();
//! let found = admin::list_segments()?;
//! let mine = found.iter().find(|s| s.name == ring).expect("listed");
//! assert_eq!(mine.kind, SegmentKind::Ring);
//! assert_eq!(admin::describe_liveness(mine.creator_liveness), "alive");
//! assert!(admin::describe(&ring)?.contains("broadcast ring"));
//! assert!(matches!(admin::metrics(&ring)?, Metrics::Ring { n_reader: 1, .. }));
//! // Only segments whose creator is proved dead would go (this one's is alive).
//! let orphans = admin::remove_orphans(true, false)?; // dry run: listed, not removed
//! assert!(orphans.iter().all(|s| s.creator_liveness == Liveness::Dead));
//! # Ok::<(), shmq_core::Error>(())
//! ```

use std::fmt::Write as _;

use crate::arena;
use crate::broadcast::Ring;
use crate::error::{Error, OsError, Result};
use crate::storage::BlockFifo;
use shmq_os::liveness::{Liveness, creator_liveness};
use shmq_os::process::ProcessId;
use shmq_os::segment::Segment;
use shmq_os::segment_file;

// What a queue writer's socket directory beside its segment ends with (`<segment>.sock`,
// or `<segment>.<16 hex digits>.sock` where that was taken), and the segment of one.
pub use crate::transport::{SOCKET_DIR_SUFFIX, socket_dir_segment};
// What this process created: the prefix of every name, where the files are, their removal
// at a normal exit, and the janitor that removes them when the process dies without one.
pub use shmq_os::liveness::SHM_DIR;
pub use shmq_os::segment::{
    NAME_PREFIX, forget_inherited_janitor_now, has_janitor, new_janitor_socket, remove_created,
    set_janitor,
};

/// What a segment is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentKind {
    Ring,
    Store,
    Arena,
    EncoderCache,
    /// Not (or not yet) a finished shmq segment of this version.
    Unknown,
}

impl SegmentKind {
    /// The kind in words, as `inspect` shows it.
    ///
    /// # Examples
    ///
    /// See [the module's example](crate::admin).
    pub fn as_str(&self) -> &'static str {
        match self {
            SegmentKind::Ring => "broadcast ring",
            SegmentKind::Store => "object store",
            SegmentKind::Arena => "tensor arena",
            SegmentKind::EncoderCache => "encoder cache",
            SegmentKind::Unknown => "unknown",
        }
    }
}

/// One shmq segment in `/dev/shm`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentReport {
    pub name: String,
    pub size: u64,
    pub kind: SegmentKind,
    /// From the header, or for an unreadable segment the pid in its name.
    pub creator: Option<ProcessId>,
    /// Whether the creator is alive: from its role lock on the file, else its pid.
    pub creator_liveness: Liveness,
}

/// The pid in a name made by [`shmq_os::segment::unique_name`]: `shmq_<kind>_<pid>_<hex>`.
fn pid_from_name(name: &str) -> Option<u32> {
    name.strip_prefix(NAME_PREFIX)?
        .split('_')
        .nth(1)?
        .parse()
        .ok()
}

fn report(name: &str, size: u64, own: bool) -> SegmentReport {
    if !own {
        // Another user's file (seen by root): never opened (`shmq_os::segment_file`), so
        // neither its kind nor its creator's lock is known here, and a pid in its name
        // proves nothing across pid namespaces: Unknown, never removed without --force.
        return SegmentReport {
            name: name.to_owned(),
            size,
            kind: SegmentKind::Unknown,
            creator: pid_from_name(name).map(|pid| ProcessId { pid, start_time: 0 }),
            creator_liveness: Liveness::Unknown,
        };
    }
    let (kind, creator) = if let Ok(ring) = Ring::open(name) {
        (SegmentKind::Ring, Some(ring.creator()))
    } else if let Ok(store) = BlockFifo::open(name, None) {
        (SegmentKind::Store, Some(store.segment().creator()))
    } else if let Ok(a) = arena::describe(name) {
        (SegmentKind::Arena, Some(a.creator))
    } else if let Ok(c) = crate::encoder_cache::describe(name) {
        (SegmentKind::EncoderCache, Some(c.creator))
    } else {
        // start_time 0: only the pid can be checked.
        (
            SegmentKind::Unknown,
            pid_from_name(name).map(|pid| ProcessId { pid, start_time: 0 }),
        )
    };
    // The creator's role lock decides; where it cannot be tested, the pid (a pid not
    // visible from here is Unknown: never removed without --force).
    let creator_liveness = match creator_liveness(name) {
        Liveness::Unknown => creator.map_or(Liveness::Unknown, |c| c.liveness()),
        known => known,
    };
    SegmentReport {
        name: name.to_owned(),
        size,
        kind,
        creator,
        creator_liveness,
    }
}

/// Every shmq segment on this machine (in this container's `/dev/shm`): those named
/// `shmq_*`, and those made under a name their creator chose (vLLM names its multimodal
/// store `vllm_mm_<id>`), found by their header among this user's files. Another user's
/// `shmq_*` files are listed (root sees them) but never opened: kind and liveness unknown.
/// A file of another program is only opened, never changed.
///
/// # Errors
///
/// [`Error::Os`] when `/dev/shm` cannot be listed.
///
/// # Examples
///
/// See [the module's example](crate::admin).
pub fn list_segments() -> Result<Vec<SegmentReport>> {
    use std::os::unix::fs::MetadataExt;
    let dir = std::fs::read_dir(SHM_DIR).map_err(|e| Error::os(format!("listing {SHM_DIR}"), e))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let mut out: Vec<SegmentReport> = dir
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            // Not followed: a symlink is nobody's segment.
            let meta = entry.metadata().ok()?;
            // Segments are files; a ring's socket directory goes with its ring.
            if !meta.is_file() {
                return None;
            }
            let own = meta.uid() == me;
            if name.starts_with(NAME_PREFIX) {
                return Some(report(&name, meta.len(), own));
            }
            if !own {
                return None;
            }
            let found = report(&name, meta.len(), own);
            (found.kind != SegmentKind::Unknown).then_some(found)
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Remove the segments whose creator is proved dead (only list them if `dry_run`); with
/// `force`, also those whose creator cannot be judged from here (another pid namespace
/// with its own `/dev/shm` view, no permission). Returns those segments.
///
/// # Errors
///
/// As [`list_segments`]; [`Error::Os`] when an orphan's file cannot be removed (no
/// permission, another user's).
///
/// # Examples
///
/// See [the module's example](crate::admin).
pub fn remove_orphans(dry_run: bool, force: bool) -> Result<Vec<SegmentReport>> {
    let orphans: Vec<SegmentReport> = list_segments()?
        .into_iter()
        .filter(|s| match s.creator_liveness {
            Liveness::Dead => true,
            Liveness::Unknown => force,
            Liveness::Alive => false,
        })
        .collect();
    if !dry_run {
        for s in &orphans {
            match segment_file::unlink(&s.name) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Error::os(
                        format!("removing {}", segment_file::path(&s.name)),
                        e,
                    ));
                }
            }
        }
        remove_stray_socket_dirs();
    }
    Ok(orphans)
}

/// Remove the socket directories of segment `segment` (`<segment>.sock`, and
/// `<segment>.<16 hex digits>.sock` where that name was taken: see
/// [`socket_dir_segment`]), as its creator is gone.
///
/// # Examples
///
/// See [the module's example](crate::admin).
pub fn remove_socket_dirs_of(segment: &str) {
    let _ = std::fs::remove_dir_all(format!("{SHM_DIR}/{segment}{SOCKET_DIR_SUFFIX}"));
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return;
    };
    for entry in dir.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        if name.starts_with(segment) && socket_dir_segment(name) == Some(segment) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Remove the socket directories (`<segment>.sock`, see [`socket_dir_segment`]) whose
/// segment is gone: nobody can join through them any more (connections already made
/// do not need the path).
fn remove_stray_socket_dirs() {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return;
    };
    for entry in dir.filter_map(|e| e.ok()) {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let Some(segment) = socket_dir_segment(&name) else {
            continue;
        };
        if segment.starts_with(NAME_PREFIX)
            && !std::path::Path::new(&segment_file::path(segment)).exists()
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn describe_process(p: Option<ProcessId>, liveness: Liveness) -> String {
    match p {
        None => "nobody".to_owned(),
        Some(p) => format!("pid {} ({})", p.pid, describe_liveness(liveness)),
    }
}

/// How a liveness reads in reports.
///
/// # Examples
///
/// See [the module's example](crate::admin).
pub fn describe_liveness(l: Liveness) -> &'static str {
    match l {
        Liveness::Alive => "alive",
        Liveness::Dead => "dead",
        Liveness::Unknown => "unknown: not visible from here",
    }
}

/// A human-readable description of a live segment's state.
///
/// # Errors
///
/// [`Error::Os`] when `name` cannot be opened as any shmq segment (gone, not this user's,
/// not shmq's), or its slots cannot be read.
///
/// # Examples
///
/// See [the module's example](crate::admin).
pub fn describe(name: &str) -> Result<String> {
    let mut out = String::new();
    if let Ok(ring) = Ring::open(name) {
        let w = ring.slot_info(None)?;
        let _ = writeln!(
            out,
            "{name}: broadcast ring{}, {} readers, {} chunks of {} bytes\ncreator: {}\nwriter: {}, {} messages written, {} sent over the overflow socket",
            ring.label()
                .map_or(String::new(), |l| format!(" of queue {l:?}")),
            ring.n_reader(),
            ring.max_chunks(),
            ring.max_chunk_bytes(),
            describe_process(Some(ring.creator()), creator_liveness(name)),
            describe_process(w.process, ring.holder_liveness(None, &w)),
            w.messages,
            ring.overflow_count(),
        );
        for r in 0..ring.n_reader() {
            let s = ring.slot_info(Some(r))?;
            let dropped = if s.dropped {
                ", dropped by the writer"
            } else {
                ""
            };
            let _ = writeln!(
                out,
                "reader {r}: {}, {} messages read{dropped}",
                describe_process(s.process, ring.holder_liveness(Some(r), &s)),
                s.messages
            );
        }
        for i in 0..ring.max_chunks() {
            let flags = ring.metadata(i)?;
            let read: Vec<String> = (0..ring.n_reader())
                .filter(|&r| flags[1 + r] == 1)
                .map(|r| r.to_string())
                .collect();
            let state = if flags[0] == 0 {
                "empty or being written".to_owned()
            } else {
                format!("written, read by [{}]", read.join(", "))
            };
            let _ = writeln!(out, "chunk {i}: {state}");
        }
        return Ok(out);
    }
    if let Ok(store) = BlockFifo::open(name, None) {
        let seg = store.segment();
        let o = seg.occupancy();
        let pct = 100.0 * o.live_bytes as f64 / seg.capacity().max(1) as f64;
        let _ = writeln!(
            out,
            "{name}: object store, {} bytes\ncreator: {}\nlive: {} chunks, {} bytes ({pct:.1}% of the ring), ids {}..{}",
            seg.capacity(),
            describe_process(Some(seg.creator()), creator_liveness(name)),
            o.live_blocks,
            o.live_bytes,
            o.id_start,
            o.id_end,
        );
        return Ok(out);
    }
    if let Ok(a) = arena::describe(name) {
        let _ = writeln!(
            out,
            "{name}: tensor arena of a queue, {} readers, {} bytes ({} reserved)\nqueue: {}\ncreator: {}\nin use: {} bytes; parts sent by copy for lack of room: {}",
            a.n_reader,
            a.capacity,
            a.reserved,
            if a.queue.is_empty() {
                "(not recorded)"
            } else {
                &a.queue
            },
            describe_process(Some(a.creator), creator_liveness(name)),
            a.bytes_in_use,
            a.fallbacks,
        );
        return Ok(out);
    }
    if let Ok(c) = crate::encoder_cache::describe(name) {
        let _ = writeln!(
            out,
            "{name}: encoder cache ({}), {} bytes ({} reserved), up to {} entries and {} consumers\ncreator: {}\nheld: {} entries, {} bytes; {} saved, {} evicted",
            c.state,
            c.capacity,
            c.reserved,
            c.max_entries,
            c.max_consumers,
            describe_process(Some(c.creator), creator_liveness(name)),
            c.entries,
            c.bytes_in_use,
            c.saves,
            c.evictions,
        );
        for k in &c.consumers {
            let _ = writeln!(
                out,
                "consumer slot {}: {}, {} keys loaded",
                k.slot,
                describe_process(
                    Some(k.process),
                    if k.alive {
                        Liveness::Alive
                    } else {
                        Liveness::Dead
                    }
                ),
                k.loads
            );
        }
        return Ok(out);
    }
    // None of these opened it: say why in the words of the kind the segment says it is
    // (a store of another layout version is "not a shmq object store of this version",
    // not "not a broadcast ring").
    let not_shmq = || {
        Error::Os(OsError::BadSegment {
            name: name.to_owned(),
            reason: "it is not a shmq segment (or its creator has not finished setting it up)"
                .into(),
        })
    };
    match claimed_kind(name)? {
        SegmentKind::Ring => Ring::open(name).map(|_| ())?,
        SegmentKind::Store => BlockFifo::open(name, None).map(|_| ())?,
        SegmentKind::Arena => arena::describe(name).map(|_| ())?,
        SegmentKind::EncoderCache => crate::encoder_cache::describe(name).map(|_| ())?,
        SegmentKind::Unknown => {}
    }
    // Unknown, or it opened after all (its creator finished setting it up meanwhile).
    Err(not_shmq())
}

/// A segment's live metrics (see [`metrics`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Metrics {
    /// A queue's ring: every side and the writer's counters.
    Ring {
        /// The queue's name, if its writer gave one (`QueueOptions::name`).
        label: Option<String>,
        n_reader: usize,
        max_chunks: usize,
        max_chunk_bytes: usize,
        stats: crate::broadcast::ring::RingStats,
    },
    Store {
        capacity: u64,
        occupancy: crate::storage::StoreOccupancy,
        stats: crate::storage::StoreStats,
    },
    Arena(arena::ArenaInfo),
    EncoderCache(crate::encoder_cache::CacheInfo),
}

/// The live metrics of segment `name`, read from the segment itself (so from any
/// process of the machine): what `python -m shmq inspect --json`, `top` and the
/// Prometheus collector show.
///
/// # Errors
///
/// [`Error::Os`] when `name` cannot be opened as a queue's ring, a store, an arena or an
/// encoder cache (gone, not this user's, not shmq's).
///
/// # Examples
///
/// See [the module's example](crate::admin).
pub fn metrics(name: &str) -> Result<Metrics> {
    if let Ok(ring) = Ring::open(name) {
        return Ok(Metrics::Ring {
            label: ring.label(),
            n_reader: ring.n_reader(),
            max_chunks: ring.max_chunks(),
            max_chunk_bytes: ring.max_chunk_bytes(),
            stats: ring.stats(),
        });
    }
    if let Ok(store) = BlockFifo::open(name, None) {
        let seg = store.segment();
        return Ok(Metrics::Store {
            capacity: seg.capacity(),
            occupancy: seg.occupancy(),
            stats: seg.stats(),
        });
    }
    if let Ok(a) = arena::describe(name) {
        return Ok(Metrics::Arena(a));
    }
    if let Ok(c) = crate::encoder_cache::describe(name) {
        return Ok(Metrics::EncoderCache(c));
    }
    // None opened it: say why in the words `describe` uses (it fails the same way),
    // or, if it opens now (its creator finished setting it up in between), say so.
    describe(name)?;
    Err(Error::Os(OsError::BadSegment {
        name: name.to_owned(),
        reason: "its creator was still setting it up; try again".into(),
    }))
}

/// The kind of shmq segment `name` says it is, by the tag of its magic ("SHMQSTO" of
/// "SHMQSTO3"), whatever its layout version; `Unknown` if it has no shmq magic.
fn claimed_kind(name: &str) -> Result<SegmentKind> {
    let segment = Segment::open(name)?;
    if segment.len() < 8 {
        return Ok(SegmentKind::Unknown);
    }
    // SAFETY: the mapping is page-aligned and at least 8 bytes long, so this is an
    // aligned u64 inside it. Every shmq segment keeps its magic there as an atomic that
    // its creator stores last; any process that can write the segment may write
    // anything there, which only changes the kind reported.
    let magic = unsafe { &*(segment.as_ptr() as *const shmq_protocol::word::PublishedU64) };
    // Acquire (`PublishedU64::get`): pairs with the creators' Release store of the magic
    // (as in their openers).
    let tag = magic.get().to_le_bytes();
    Ok(match &tag[..7] {
        b"SHMQRNG" => SegmentKind::Ring,
        b"SHMQSTO" => SegmentKind::Store,
        b"SHMQARN" => SegmentKind::Arena,
        b"SHMQENC" => SegmentKind::EncoderCache,
        _ => SegmentKind::Unknown,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use shmq_os::segment::unique_name;

    #[test]
    fn names_carry_the_creator_pid() {
        assert_eq!(
            pid_from_name(&unique_name("ring")),
            Some(std::process::id())
        );
        assert_eq!(pid_from_name("shmq_ring_x_1"), None);
        assert_eq!(pid_from_name("other"), None);
    }

    #[test]
    fn live_segments_are_listed_and_kept() {
        let ring = Ring::create(2, 64, 2).unwrap();
        let store = BlockFifo::create(4096, None).unwrap();
        let arena = crate::arena::ArenaWriter::create(2, 1 << 20, 4).unwrap();
        let cache = crate::encoder_cache::Producer::create(None, Default::default()).unwrap();
        let all = list_segments().unwrap();
        let find = |n: &str| all.iter().find(|s| s.name == n).cloned().unwrap();
        let r = find(ring.name());
        assert_eq!(
            (r.kind, r.creator_liveness),
            (SegmentKind::Ring, Liveness::Alive)
        );
        assert_eq!(r.creator.unwrap().pid, std::process::id());
        assert_eq!(find(store.segment().name()).kind, SegmentKind::Store);
        assert_eq!(find(arena.name()).kind, SegmentKind::Arena);
        assert_eq!(find(cache.segment_name()).kind, SegmentKind::EncoderCache);
        assert_eq!(
            pid_from_name(cache.segment_name()),
            Some(std::process::id())
        );
        assert!(
            describe(cache.segment_name())
                .unwrap()
                .contains("encoder cache (open)")
        );
        assert!(
            describe(arena.name())
                .unwrap()
                .contains("tensor arena of a queue, 2 readers")
        );
        let orphans = remove_orphans(true, false).unwrap();
        assert!(
            orphans
                .iter()
                .all(|s| s.name != ring.name() && s.name != store.segment().name())
        );
        assert!(
            describe(ring.name())
                .unwrap()
                .contains("broadcast ring, 2 readers, 2 chunks of 64 bytes")
        );
        assert!(
            describe(store.segment().name())
                .unwrap()
                .contains("object store, 4096 bytes")
        );
        assert!(matches!(
            describe("shmq_missing_1_2"),
            Err(Error::Os(OsError::SegmentNotFound { .. }))
        ));
    }

    #[test]
    fn a_store_that_cannot_be_opened_is_described_as_a_store() {
        // A store of another layout version (as an older shmq made it): `inspect` said
        // "it is not a shmq broadcast ring".
        let store = BlockFifo::create(4096, None).unwrap();
        let seg = Segment::open(store.segment().name()).unwrap();
        // SAFETY: the version field (offset 8) of a segment only this test uses; a test
        // standing in for an older shmq.
        unsafe { *(seg.as_ptr().add(8) as *mut u32) = 1 };
        let e = describe(store.segment().name()).unwrap_err().to_string();
        assert!(e.contains("layout version is 1"), "{e}");
        assert!(!e.contains("broadcast ring"), "{e}");
        // And an older magic: still named an object store.
        // SAFETY: as above, the magic at offset 0.
        unsafe { *(seg.as_ptr() as *mut u64) = u64::from_le_bytes(*b"SHMQSTO1") };
        let e = describe(store.segment().name()).unwrap_err().to_string();
        assert!(e.contains("not a shmq object store of this version"), "{e}");
        // Not shmq's at all.
        // SAFETY: as above.
        unsafe { *(seg.as_ptr() as *mut u64) = 0 };
        let e = describe(store.segment().name()).unwrap_err().to_string();
        assert!(e.contains("not a shmq segment"), "{e}");
    }
}
