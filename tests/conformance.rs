//! One set of contracts for every kind of segment shmq makes — the broadcast ring, the
//! tensor arena, the object store, the encoder cache — run in real processes, the way
//! iceoryx2 runs each of its services through the same conformance tests.
//!
//! Each kind says only how it is made, how a process attaches to it, how something is
//! published in it and read back ([`Kind`]); the contracts are written once
//! ([`contracts`]) and instantiated per kind by [`conformance!`]:
//!
//! - **created owner-only**: the creator's file is `/dev/shm/shmq_*`, this user's, mode
//!   0600, and `shmq::admin::list_segments` reports it with its kind, its creator's pid
//!   and that creator alive;
//! - **attached from another process**: what the creator process publishes, an attacher
//!   process reads back byte for byte;
//! - **a dead creator**: a creator killed with SIGKILL leaves its segment, which
//!   `list_segments` reports with its creator dead and `remove_orphans` removes — and
//!   never the segment of another creator of the same kind that is still alive;
//! - **a truncated file** and **a wrong layout version**: a process that opens the
//!   segment gets an error naming it, never a crash (`SIGBUS`) or a hang;
//! - **leftovers**: a creator that ends normally leaves no file, with an attacher still
//!   attached.
//!
//! The processes are this test binary run again: [`spawn`] starts it with
//! `--exact conformance_child` and [`ROLE_ENV`] set, and [`conformance_child`] plays the
//! role (a creator, an attacher, an opener) instead of being a test. A child speaks on
//! its stdout one line per step (`READY`, `ATTACHED`, `TOKEN`, `READ`, `ERR`) and takes
//! its orders on its stdin; every wait for a line has a timeout, and a child still
//! running when its test ends is killed ([`Child`]'s drop).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

use shmq::admin::{self, SegmentKind};
use shmq::arena::{ArenaReader, ArenaRef, ArenaWriter};
use shmq::encoder_cache::{Consumer, Producer, ProducerOptions};
use shmq::liveness::Liveness;
use shmq::storage::{read_object, BlockFifo, ObjectStore};
use shmq::{Handle, QueueOptions, Reader, Writer};

/// What a child process plays (`create`, `attach`, `open`); its presence marks a child.
const ROLE_ENV: &str = "SHMQ_CONFORMANCE_ROLE";
/// The kind of segment the child works on ([`Kind::NAME`]).
const KIND_ENV: &str = "SHMQ_CONFORMANCE_KIND";
/// For an attacher or an opener: the segment's file name and what the creator printed
/// after it (the handle an attacher opens by).
const SEGMENT_ENV: &str = "SHMQ_CONFORMANCE_SEGMENT";
const HANDLE_ENV: &str = "SHMQ_CONFORMANCE_HANDLE";

/// What starts a child's line to its parent: the test harness may have printed a test's
/// name on the same line before it.
const MARK: &str = "@conformance: ";

/// Bound on every wait for a child's line and on a child's own blocking calls.
const TIMEOUT: Duration = Duration::from_secs(30);
/// What a creator publishes: long enough to span pages, with no run a zeroed page fakes.
fn probe() -> Vec<u8> {
    (0..20_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect()
}

type Res<T> = std::result::Result<T, String>;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

// ---------------------------------------------------------------------------------
// The kinds

/// A kind of segment, as the contracts need it. Everything here runs in a child.
trait Kind {
    /// The name of the kind, in [`KIND_ENV`].
    const NAME: &'static str;
    /// How `shmq::admin` reports it.
    const ADMIN: SegmentKind;
    /// What the creator holds; dropping it is the creator's normal end.
    type Owner;
    /// What an attacher holds.
    type Attached;

    /// Make a segment: the owner, the segment's file name, the handle attachers open by.
    fn create() -> Res<(Self::Owner, String, String)>;
    /// Publish `probe` (after an attacher attached): the token that finds it.
    fn publish(owner: &mut Self::Owner, probe: &[u8]) -> Res<String>;
    /// Attach to the segment as a reader (before anything is published).
    fn attach(segment: &str, handle: &str) -> Res<Self::Attached>;
    /// Read what the token finds; `token` reads the creator's token when the kind needs
    /// one (a kind whose reader is told by the segment itself does not call it).
    fn read(attached: &mut Self::Attached, token: &mut dyn FnMut() -> String) -> Res<Vec<u8>>;
    /// Open the segment the way a process that is handed it does, and use it as far as
    /// that opening goes (for the bad-file contracts: this must fail, and cleanly).
    fn open(segment: &str, handle: &str) -> Res<()>;
}

/// The broadcast ring, through the queue that makes it: a writer with one local reader.
struct Ring;

impl Kind for Ring {
    const NAME: &'static str = "ring";
    const ADMIN: SegmentKind = SegmentKind::Ring;
    type Owner = Writer;
    type Attached = Reader;

    fn create() -> Res<(Writer, String, String)> {
        let writer = Writer::new(QueueOptions::local(1)).map_err(err)?;
        let segment = writer
            .ring()
            .ok_or("a local queue without a ring")?
            .name()
            .to_owned();
        let handle = writer.handle().to_string();
        Ok((writer, segment, handle))
    }
    fn publish(writer: &mut Writer, probe: &[u8]) -> Res<String> {
        writer.wait_until_ready(TIMEOUT).map_err(err)?;
        writer.enqueue(probe, TIMEOUT).map_err(err)?;
        Ok(String::new())
    }
    fn attach(_segment: &str, handle: &str) -> Res<Reader> {
        let handle: Handle = handle.parse().map_err(err)?;
        Reader::open(&handle, 0).map_err(err)
    }
    fn read(reader: &mut Reader, _token: &mut dyn FnMut() -> String) -> Res<Vec<u8>> {
        reader.wait_until_ready(TIMEOUT).map_err(err)?;
        reader.dequeue(TIMEOUT).map_err(err)
    }
    fn open(segment: &str, handle: &str) -> Res<()> {
        shmq::broadcast::ring::Ring::open(segment).map_err(err)?;
        Self::attach(segment, handle).map(drop)
    }
}

/// The tensor arena: a writer copies the probe into a lease held for reader 0.
struct Arena;

impl Kind for Arena {
    const NAME: &'static str = "arena";
    const ADMIN: SegmentKind = SegmentKind::Arena;
    type Owner = ArenaWriter;
    type Attached = std::sync::Arc<ArenaReader>;

    fn create() -> Res<(ArenaWriter, String, String)> {
        let writer = ArenaWriter::create(1, 1 << 20, 16).map_err(err)?;
        let segment = writer.name().to_owned();
        Ok((writer, segment.clone(), segment))
    }
    fn publish(writer: &mut ArenaWriter, probe: &[u8]) -> Res<String> {
        let r = writer
            .copy_in(probe, &mut |_| false)
            .ok_or("the arena had no room for the probe")?;
        writer.publish(&r, std::iter::once(0));
        Ok(format!(
            "{} {} {} {}",
            r.lease, r.generation, r.offset, r.len
        ))
    }
    fn attach(segment: &str, _handle: &str) -> Res<std::sync::Arc<ArenaReader>> {
        ArenaReader::open(segment, 0)
            .map(std::sync::Arc::new)
            .map_err(err)
    }
    fn read(reader: &mut Self::Attached, token: &mut dyn FnMut() -> String) -> Res<Vec<u8>> {
        let t = token();
        let f: Vec<u64> = t
            .split(' ')
            .map(|w| w.parse().map_err(err))
            .collect::<Res<_>>()?;
        let [lease, generation, offset, len] = f[..] else {
            return Err(format!("a bad arena token: {t:?}"));
        };
        let r = ArenaRef {
            lease: lease as u32,
            generation: generation as u32,
            offset,
            len,
        };
        let bytes = reader.view(&r).map_err(err)?.to_vec();
        reader.release(&r);
        Ok(bytes)
    }
    fn open(segment: &str, handle: &str) -> Res<()> {
        Self::attach(segment, handle).map(drop)
    }
}

/// The object store: one writer that puts the probe under a key, one reader slot.
struct Store;

impl Kind for Store {
    const NAME: &'static str = "store";
    const ADMIN: SegmentKind = SegmentKind::Store;
    type Owner = (BlockFifo, ObjectStore);
    type Attached = BlockFifo;

    fn create() -> Res<(Self::Owner, String, String)> {
        let ring = BlockFifo::create(1 << 20, None).map_err(err)?;
        let store = ObjectStore::new(1 << 19, 1).map_err(err)?;
        let segment = ring.segment().name().to_owned();
        Ok(((ring, store), segment.clone(), segment))
    }
    fn publish((ring, store): &mut Self::Owner, probe: &[u8]) -> Res<String> {
        let (address, id) = store.put(ring, "probe", &[probe], 0).map_err(err)?;
        Ok(format!("{address} {id}"))
    }
    fn attach(segment: &str, _handle: &str) -> Res<BlockFifo> {
        BlockFifo::open(segment, None).map_err(err)
    }
    fn read(reader: &mut BlockFifo, token: &mut dyn FnMut() -> String) -> Res<Vec<u8>> {
        let t = token();
        let (address, id) = t
            .split_once(' ')
            .and_then(|(a, i)| Some((a.parse().ok()?, i.parse().ok()?)))
            .ok_or_else(|| format!("a bad store token: {t:?}"))?;
        read_object(reader.segment(), address, id, true, |frame| {
            frame.part(0).to_vec()
        })
        .map_err(err)
    }
    fn open(segment: &str, handle: &str) -> Res<()> {
        Self::attach(segment, handle).map(drop)
    }
}

/// The encoder cache: a producer saves the probe under a key; a consumer loads it.
struct EncoderCache;

impl Kind for EncoderCache {
    const NAME: &'static str = "encoder cache";
    const ADMIN: SegmentKind = SegmentKind::EncoderCache;
    type Owner = Producer;
    type Attached = Consumer;

    fn create() -> Res<(Producer, String, String)> {
        let options = ProducerOptions {
            capacity: 1 << 20,
            ..ProducerOptions::default()
        };
        let producer = Producer::create(None, options).map_err(err)?;
        let (segment, name) = (
            producer.segment_name().to_owned(),
            producer.name().to_owned(),
        );
        Ok((producer, segment, name))
    }
    fn publish(producer: &mut Producer, probe: &[u8]) -> Res<String> {
        if !producer
            .save("probe", &[probe], Some(TIMEOUT))
            .map_err(err)?
        {
            return Err("the key was in the cache already".into());
        }
        Ok("probe".into())
    }
    fn attach(_segment: &str, handle: &str) -> Res<Consumer> {
        Consumer::new(&[handle]).map_err(err)
    }
    fn read(consumer: &mut Consumer, token: &mut dyn FnMut() -> String) -> Res<Vec<u8>> {
        let key = token();
        let entry = consumer
            .load(&key)
            .map_err(err)?
            .ok_or_else(|| format!("the consumer found no entry {key:?}"))?;
        Ok(entry.part(0).to_vec())
    }
    fn open(segment: &str, _handle: &str) -> Res<()> {
        shmq::encoder_cache::describe(segment)
            .map(drop)
            .map_err(err)
    }
}

// ---------------------------------------------------------------------------------
// The children

/// The entry point of every child process; a no-op as a test of its own.
#[test]
fn conformance_child() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let kind = std::env::var(KIND_ENV).expect("a child without a kind");
    let outcome = match kind.as_str() {
        Ring::NAME => play::<Ring>(&role),
        Arena::NAME => play::<Arena>(&role),
        Store::NAME => play::<Store>(&role),
        EncoderCache::NAME => play::<EncoderCache>(&role),
        other => Err(format!("no kind {other:?}")),
    };
    // An error is a line for the parent to judge (an opener's refusal is what its test
    // wants); the exit code stays 0 unless the child crashed.
    if let Err(e) = outcome {
        say(&format!("ERR {}", e.replace('\n', " ")));
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{MARK}{line}")
        .and_then(|()| out.flush())
        .expect("stdout");
}

fn hear(lines: &mut impl Iterator<Item = std::io::Result<String>>) -> String {
    lines.next().and_then(|l| l.ok()).unwrap_or_default()
}

fn play<K: Kind>(role: &str) -> Res<()> {
    let stdin = std::io::stdin();
    let mut orders = stdin.lock().lines();
    match role {
        "create" => {
            let (mut owner, segment, handle) = K::create()?;
            say(&format!("READY {segment} {handle}"));
            loop {
                match hear(&mut orders).as_str() {
                    "publish" => say(&format!("TOKEN {}", K::publish(&mut owner, &probe())?)),
                    // The normal end: the owner dropped, then the process exits.
                    "exit" | "" => {
                        drop(owner);
                        say("GONE");
                        return Ok(());
                    }
                    other => return Err(format!("no order {other:?}")),
                }
            }
        }
        "attach" => {
            let (segment, handle) = (env(SEGMENT_ENV), env(HANDLE_ENV));
            let mut attached = K::attach(&segment, &handle)?;
            say("ATTACHED");
            let mut token = || hear(&mut orders);
            let bytes = K::read(&mut attached, &mut token)?;
            say(&format!("READ {} {:016x}", bytes.len(), fnv(&bytes)));
            // Stay attached until told to go (the leftovers contract ends the creator
            // under an attached reader).
            hear(&mut orders);
            Ok(())
        }
        "open" => {
            K::open(&env(SEGMENT_ENV), &env(HANDLE_ENV))?;
            say("OPENED");
            Ok(())
        }
        other => Err(format!("no role {other:?}")),
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

// ---------------------------------------------------------------------------------
// The parent's side

/// A child process, killed when dropped if still running.
struct Child {
    process: std::process::Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    role: String,
}

fn spawn(kind: &str, role: &str, segment: &str, handle: &str) -> Child {
    let mut process = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", "conformance_child", "--nocapture"])
        .env(ROLE_ENV, role)
        .env(KIND_ENV, kind)
        .env(SEGMENT_ENV, segment)
        .env(HANDLE_ENV, handle)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting a child");
    let stdout = process.stdout.take().expect("piped");
    let (tx, lines) = mpsc::channel();
    // The child's lines, less the test harness's own ("running 1 test", ...).
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            let Some((_, ours)) = line.split_once(MARK) else {
                continue;
            };
            if tx.send(ours.to_owned()).is_err() {
                break;
            }
        }
    });
    let stdin = process.stdin.take();
    Child {
        process,
        stdin,
        lines,
        role: format!("{kind} {role}"),
    }
}

impl Child {
    /// The child's next line, which must start with `word` (else the test fails with
    /// what the child said instead).
    fn expect(&mut self, word: &str) -> String {
        let line = self
            .lines
            .recv_timeout(TIMEOUT)
            .unwrap_or_else(|_| panic!("the {} child said nothing for {TIMEOUT:?}", self.role));
        match line.strip_prefix(word) {
            Some(rest) => rest.trim_start().to_owned(),
            None => panic!("the {} child said {line:?}, not {word}", self.role),
        }
    }

    fn order(&mut self, line: &str) {
        // A child that already left closed its stdin: what it said instead is what the
        // test checks next.
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{line}").and_then(|()| stdin.flush());
        }
    }

    /// Wait for the child's exit (bounded); it must have exited with 0, no signal.
    fn ends_cleanly(mut self) {
        self.stdin.take();
        let deadline = std::time::Instant::now() + TIMEOUT;
        loop {
            if let Some(status) = self.process.try_wait().expect("waitpid") {
                assert!(
                    status.success(),
                    "the {} child ended with {status}",
                    self.role
                );
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the {} child did not end",
                self.role
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn kill(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }

    fn pid(&self) -> u32 {
        self.process.id()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if matches!(self.process.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}

/// Hand the creator's token to the attacher (a ring's reader needs none: it reads the
/// ring, and a line it did not ask for would be taken as its order to leave).
fn send_token(attacher: &mut Child, token: String) {
    if !token.is_empty() {
        attacher.order(&token);
    }
}

/// A creator child that made its segment: the child, the segment's file name, its handle.
fn creator(kind: &str) -> (Child, String, String) {
    let mut child = spawn(kind, "create", "", "");
    let ready = child.expect("READY");
    let (segment, handle) = ready.split_once(' ').expect("READY <segment> <handle>");
    (child, segment.to_owned(), handle.to_owned())
}

fn shm_path(segment: &str) -> String {
    format!("/dev/shm/{segment}")
}

fn report(segment: &str) -> Option<admin::SegmentReport> {
    admin::list_segments()
        .expect("listing /dev/shm")
        .into_iter()
        .find(|s| s.name == segment)
}

/// What a broken or hostile peer does to a segment's file.
#[derive(Clone, Copy)]
enum Damage {
    /// Cut the file to this many bytes.
    Truncate(u64),
    /// Add one to the layout version (every kind's header starts with its magic, a
    /// u64, and its layout version, a u32).
    BumpVersion,
}

/// Play the part of a peer that writes to the file (the bad-file contracts): open it
/// with std's file API, which a library user would not use on a segment.
#[allow(
    clippy::disallowed_methods,
    reason = "the test plays a hostile or broken peer that truncates or rewrites the file"
)]
fn tamper(segment: &str, damage: Damage) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(shm_path(segment))
        .expect("opening the segment's file");
    match damage {
        Damage::Truncate(len) => file.set_len(len).expect("truncating"),
        Damage::BumpVersion => {
            let mut word = [0u8; 4];
            file.read_exact_at(&mut word, 8)
                .expect("reading the version");
            let other = u32::from_le_bytes(word).wrapping_add(1).to_le_bytes();
            file.write_all_at(&other, 8).expect("writing the version");
        }
    }
}

/// Every contract, for kind `K`.
mod contracts {
    use super::*;

    pub fn created_owner_only<K: Kind>() {
        let (creator, segment, _) = creator(K::NAME);
        assert!(
            segment.starts_with("shmq_"),
            "{} segment named {segment}",
            K::NAME
        );
        let meta = std::fs::metadata(shm_path(&segment)).expect("the segment's file");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{segment}'s mode");
        // SAFETY: geteuid has no preconditions and cannot fail.
        assert_eq!(meta.uid(), unsafe { libc::geteuid() }, "{segment}'s owner");
        let r = report(&segment).expect("list_segments finds the segment");
        assert_eq!(r.kind, K::ADMIN, "{segment}'s kind");
        assert_eq!(
            r.creator.map(|c| c.pid),
            Some(creator.pid()),
            "{segment}'s creator"
        );
        assert_eq!(r.creator_liveness, Liveness::Alive, "{segment}'s creator");
        creator.ends_cleanly();
    }

    pub fn attached_from_another_process<K: Kind>() {
        let (mut creator, segment, handle) = creator(K::NAME);
        let mut attacher = spawn(K::NAME, "attach", &segment, &handle);
        attacher.expect("ATTACHED");
        creator.order("publish");
        send_token(&mut attacher, creator.expect("TOKEN"));
        let want = probe();
        assert_eq!(
            attacher.expect("READ"),
            format!("{} {:016x}", want.len(), fnv(&want)),
            "what the {} attacher read",
            K::NAME
        );
        attacher.order("go");
        attacher.ends_cleanly();
        creator.ends_cleanly();
    }

    pub fn a_dead_creators_segment_is_removed_and_a_live_ones_never<K: Kind>() {
        let (mut dead, dead_segment, _) = creator(K::NAME);
        let (alive, alive_segment, _) = creator(K::NAME);
        dead.kill();
        assert!(
            std::path::Path::new(&shm_path(&dead_segment)).exists(),
            "a killed creator's segment stays until it is cleaned up"
        );
        let r = report(&dead_segment).expect("list_segments finds the dead creator's");
        assert_eq!(
            r.creator_liveness,
            Liveness::Dead,
            "{dead_segment}'s creator"
        );
        assert_eq!(r.kind, K::ADMIN);
        let removed: Vec<String> = admin::remove_orphans(false, false)
            .expect("remove_orphans")
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert!(
            removed.contains(&dead_segment),
            "{removed:?} without {dead_segment}"
        );
        assert!(
            !removed.contains(&alive_segment),
            "a live creator's removed: {removed:?}"
        );
        assert!(!std::path::Path::new(&shm_path(&dead_segment)).exists());
        assert!(std::path::Path::new(&shm_path(&alive_segment)).exists());
        alive.ends_cleanly();
    }

    pub fn another_kinds_segment_is_refused<K: Kind, Other: Kind>() {
        let (creator, segment, handle) = super::creator(Other::NAME);
        let opener = spawn(K::NAME, "open", &segment, &handle);
        let line = opener
            .lines
            .recv_timeout(TIMEOUT)
            .unwrap_or_else(|_| panic!("the {} opener hung", K::NAME));
        opener.ends_cleanly();
        let refusal = line.strip_prefix("ERR ").unwrap_or_else(|| {
            panic!(
                "{}'s segment opened as a {}: {line:?}",
                Other::NAME,
                K::NAME
            )
        });
        assert!(refusal.contains(&segment), "{refusal}");
        creator.ends_cleanly();
    }

    /// The creator is stopped first: only an opener's side is under test (a creator whose
    /// own file a peer truncated is the `SIGBUS` guard's, tested in shmq-os).
    fn opened_after<K: Kind>(damage: Damage) -> String {
        let (mut creator, segment, handle) = creator(K::NAME);
        // Stopped, so that it touches its mapping no more while the file is damaged.
        // SAFETY: kill has no memory preconditions; the pid is our own child's, not yet
        // reaped, so it names no other process.
        let stopped = unsafe { libc::kill(creator.pid() as i32, libc::SIGSTOP) };
        assert_eq!(stopped, 0, "stopping the creator");
        tamper(&segment, damage);
        let opener = spawn(K::NAME, "open", &segment, &handle);
        let line = opener
            .lines
            .recv_timeout(TIMEOUT)
            .unwrap_or_else(|_| panic!("the {} opener hung", K::NAME));
        opener.ends_cleanly();
        creator.kill();
        let _ = std::fs::remove_file(shm_path(&segment));
        let refusal = line
            .strip_prefix("ERR ")
            .unwrap_or_else(|| panic!("a damaged {} segment opened: {line:?}", K::NAME));
        assert!(
            refusal.contains(&segment),
            "the {} refusal does not name {segment}: {refusal}",
            K::NAME
        );
        refusal.to_owned()
    }

    pub fn a_truncated_segment_is_refused<K: Kind>() {
        let refusal = opened_after::<K>(Damage::Truncate(24));
        assert!(refusal.contains("bytes long"), "{refusal}");
    }

    pub fn another_layout_version_is_refused<K: Kind>() {
        let refusal = opened_after::<K>(Damage::BumpVersion);
        assert!(refusal.contains("version"), "{refusal}");
    }

    pub fn a_normal_end_leaves_nothing<K: Kind>() {
        let (mut creator, segment, handle) = creator(K::NAME);
        let mut attacher = spawn(K::NAME, "attach", &segment, &handle);
        attacher.expect("ATTACHED");
        creator.order("publish");
        send_token(&mut attacher, creator.expect("TOKEN"));
        attacher.expect("READ");
        creator.order("exit");
        creator.expect("GONE");
        creator.ends_cleanly();
        assert!(
            !std::path::Path::new(&shm_path(&segment)).exists(),
            "{segment} left by a {} creator that ended normally",
            K::NAME
        );
        attacher.order("go");
        attacher.ends_cleanly();
    }
}

macro_rules! conformance {
    ($module:ident, $kind:ty, $other:ty) => {
        mod $module {
            use super::contracts;

            #[test]
            fn created_owner_only() {
                contracts::created_owner_only::<$kind>();
            }
            #[test]
            fn attached_from_another_process() {
                contracts::attached_from_another_process::<$kind>();
            }
            #[test]
            fn a_dead_creators_segment_is_removed_and_a_live_ones_never() {
                contracts::a_dead_creators_segment_is_removed_and_a_live_ones_never::<$kind>();
            }
            #[test]
            fn a_truncated_segment_is_refused() {
                contracts::a_truncated_segment_is_refused::<$kind>();
            }
            #[test]
            fn another_layout_version_is_refused() {
                contracts::another_layout_version_is_refused::<$kind>();
            }
            #[test]
            fn another_kinds_segment_is_refused() {
                contracts::another_kinds_segment_is_refused::<$kind, $other>();
            }
            #[test]
            fn a_normal_end_leaves_nothing() {
                contracts::a_normal_end_leaves_nothing::<$kind>();
            }
        }
    };
}

// Each kind also refuses the next one's segment.
conformance!(ring, super::Ring, super::Arena);
conformance!(arena, super::Arena, super::Store);
conformance!(store, super::Store, super::EncoderCache);
conformance!(encoder_cache, super::EncoderCache, super::Ring);
