//! Queues by name across real processes (issue 59 item 9): a writer made with
//! `QueueOptions { name, record_name: true, .. }` in one process, a reader that knows only
//! the name (`Reader::open_by_name`) in another; a name held by a live writer refused in
//! another process; a killed writer's name reported gone, then taken over; as root, a
//! stranger squatting a user's directory of names denying that user nothing. (Python
//! and Rust sharing the names: `tests/python/test_cross_language.py`.)
//!
//! A test starts its other processes as this same test binary run again
//! (`<this binary> --exact <test> --nocapture`) with [`ROLE_ENV`] set: the test function
//! starts again in the child, sees the variable at its top ([`child_role`]) and plays
//! that role, printing `NAMES <word> ...` lines the parent waits for. Every wait is
//! bounded; children still running when a test ends are killed.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

use shmq::error::{CreateError, NameError, OpenError};
use shmq::names::{self, Kind};
use shmq::{QueueOptions, Reader, Writer};

/// What a child plays: `writer`, `reader`, `claimer`, `absent` or `checker`. Its presence marks the child.
const ROLE_ENV: &str = "SHMQ_NAMES_TEST_ROLE";
/// The queue's name.
const NAME_ENV: &str = "SHMQ_NAMES_TEST_NAME";
/// How many messages the writer sends and the reader reads.
const COUNT_ENV: &str = "SHMQ_NAMES_TEST_COUNT";
/// The user a child becomes before anything else (a root parent's children only).
const UID_ENV: &str = "SHMQ_NAMES_TEST_UID";

/// The pid of the killed writer whose name a `checker` child checks.
const KILLED_ENV: &str = "SHMQ_NAMES_TEST_KILLED";

/// Bound on every blocking call and every wait for a child.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Message `seq`: its number (u64 LE), then `seq % 300` bytes of a pattern.
fn message(seq: u64) -> Vec<u8> {
    let mut m = seq.to_le_bytes().to_vec();
    m.extend((0..seq % 300).map(|j| ((seq * 31 + j) % 251) as u8));
    m
}

fn unique_name(what: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{what} {}-{nanos:x}", std::process::id())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn named_options(name: &str) -> QueueOptions {
    let mut opts = QueueOptions::local(1);
    opts.max_chunk_bytes = 64 * 1024;
    opts.max_chunks = 8;
    opts.name = Some(name.to_owned());
    opts.record_name = true;
    opts
}

// ---------------------------------------------------------------------------------
// The child side

/// Play the child's role and exit, if this process is a child (call first thing in a
/// test function); return in the parent.
fn child_role() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    if let Ok(uid) = std::env::var(UID_ENV) {
        let uid: u32 = uid.parse().unwrap();
        // SAFETY: setgid/setuid change this process's credentials only; this child runs
        // nothing else yet (its test harness waits for this test's thread).
        let ok = unsafe { libc::setgid(uid) == 0 && libc::setuid(uid) == 0 };
        assert!(
            ok,
            "becoming uid {uid}: {}",
            std::io::Error::last_os_error()
        );
    }
    let name = std::env::var(NAME_ENV).unwrap();
    let count: u64 = std::env::var(COUNT_ENV).map_or(0, |c| c.parse().unwrap());
    let outcome = match role.as_str() {
        "writer" => play_writer(&name, count),
        "reader" => play_reader(&name, count),
        "claimer" => play_claimer(&name),
        "absent" => match Reader::open_by_name(&name, 0) {
            Err(OpenError::Name(NameError::NotFound { .. })) => {
                say("absent");
                Ok(())
            }
            Err(e) => Err(format!("not 'not found': {e}")),
            Ok(_) => Err("an ended writer's queue opened".into()),
        },
        "checker" => play_checker(&name, std::env::var(KILLED_ENV).unwrap().parse().unwrap()),
        other => Err(format!("unknown role {other}")),
    };
    match outcome {
        Ok(()) => std::process::exit(0),
        Err(why) => {
            eprintln!("{role} failed: {why}");
            std::process::exit(1)
        }
    }
}

/// Say `line` to the parent (`NAMES ` first: the harness prints around it).
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nNAMES {line}").unwrap();
    out.flush().unwrap();
}

/// Hold the name; say `ready <pid>`; with messages to send, wait for the reader and send
/// them, then say `sent`; end when stdin closes (the writer dropped: the name released).
fn play_writer(name: &str, count: u64) -> Result<(), String> {
    let mut writer = Writer::new(named_options(name)).map_err(|e| format!("new: {e}"))?;
    say(&format!("ready {}", std::process::id()));
    if count > 0 {
        writer
            .wait_until_ready(Some(TIMEOUT))
            .map_err(|e| format!("wait_until_ready: {e}"))?;
        for seq in 0..count {
            writer
                .enqueue(&message(seq), Some(TIMEOUT))
                .map_err(|e| format!("enqueue {seq}: {e}"))?;
        }
        say("sent");
    }
    let mut rest = String::new();
    let _ = std::io::stdin().read_line(&mut rest);
    drop(writer);
    Ok(())
}

/// Open reader 0 of the queue named `name`, read `count` messages and check each; say
/// `read <count>`.
fn play_reader(name: &str, count: u64) -> Result<(), String> {
    let mut reader = Reader::open_by_name(name, 0).map_err(|e| format!("open_by_name: {e}"))?;
    reader
        .wait_until_ready(Some(TIMEOUT))
        .map_err(|e| format!("wait_until_ready: {e}"))?;
    for seq in 0..count {
        let got = reader
            .dequeue(Some(TIMEOUT))
            .map_err(|e| format!("message {seq}: {e}"))?;
        if got != message(seq) {
            return Err(format!("message {seq} differs"));
        }
    }
    say(&format!("read {count}"));
    Ok(())
}

/// Try to make a writer of `name`; say `taken <pid in the error>`, or `took`.
fn play_claimer(name: &str) -> Result<(), String> {
    match Writer::new(named_options(name)) {
        Err(CreateError::Name(NameError::Taken { pid: Some(pid), .. })) => {
            say(&format!("taken {pid}"))
        }
        Err(e) => return Err(format!("not refused as taken: {e}")),
        Ok(writer) => {
            say("took");
            drop(writer);
        }
    }
    Ok(())
}

/// The name of the killed writer `killed`: reported gone once (its record removed), then
/// not found, then taken by a new writer; say `checked`. Run with a directory of names
/// of its own (`SHMQ_NAMES_DIR`): any other process's claim removes dead records.
fn play_checker(name: &str, killed: u32) -> Result<(), String> {
    let path = names::record_path(Kind::Queue, name, false)
        .map_err(|e| e.to_string())?
        .ok_or("no directory of names")?;
    if std::fs::symlink_metadata(&path).is_err() {
        return Err("the killed writer's record is not there".into());
    }
    match Reader::open_by_name(name, 0) {
        Err(OpenError::Name(NameError::Gone { pid, .. })) if pid == i64::from(killed) => {}
        Err(e) => return Err(format!("not reported gone: {e}")),
        Ok(_) => return Err("a dead writer's queue opened".into()),
    }
    let gone = format!("the queue named '{name}' is gone: its writer (pid {killed})");
    if std::fs::symlink_metadata(&path).is_ok() {
        return Err("the dead record is still there".into());
    }
    match Reader::open_by_name(name, 0) {
        Err(OpenError::Name(NameError::NotFound { .. })) => {}
        Err(e) => return Err(format!("not 'not found' the second time: {e}")),
        Ok(_) => return Err("a dead writer's queue opened".into()),
    }
    let taken = Writer::new(named_options(name)).map_err(|e| format!("taking over: {e}"))?;
    let record = names::lookup(Kind::Queue, name).map_err(|e| e.to_string())?;
    if record.pid() != i64::from(std::process::id()) {
        return Err(format!("the record names pid {}", record.pid()));
    }
    drop(taken);
    say(&format!("checked {gone}"));
    Ok(())
}

// ---------------------------------------------------------------------------------
// The parent side

/// A child process of the test: this binary again, running `test` as `role`.
struct Peer {
    child: Child,
    lines: Receiver<String>,
}

impl Peer {
    fn start(test: &str, role: &str, name: &str, count: u64, uid: Option<u32>) -> Peer {
        Self::start_with(test, role, name, count, uid, &[])
    }

    /// [`start`](Self::start), with `env` set too.
    fn start_with(
        test: &str,
        role: &str,
        name: &str,
        count: u64,
        uid: Option<u32>,
        env: &[(&str, String)],
    ) -> Peer {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .envs(env.iter().map(|(k, v)| (k, v)))
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, role)
            .env(NAME_ENV, name)
            .env(COUNT_ENV, count.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(uid) = uid {
            command.env(UID_ENV, uid.to_string());
        }
        let mut child = command.spawn().expect("starting a child");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if let Some(said) = line.strip_prefix("NAMES ") {
                    let _ = tx.send(said.to_owned());
                }
            }
        });
        Peer { child, lines }
    }

    /// The child's next `NAMES` line, which must start with `word`: the rest of it.
    fn expect(&mut self, word: &str) -> String {
        match self.lines.recv_timeout(TIMEOUT) {
            Ok(line) if line.split(' ').next() == Some(word) => {
                line[word.len()..].trim().to_owned()
            }
            Ok(line) => panic!("expected {word:?} from the child, it said {line:?}"),
            Err(_) => {
                let status = self.child.try_wait();
                panic!("no {word:?} from the child within {TIMEOUT:?} (status: {status:?})")
            }
        }
    }

    fn stdin(&mut self) -> ChildStdin {
        self.child.stdin.take().unwrap()
    }

    /// Wait (bounded) for the child to end; whether it succeeded.
    fn succeeded(&mut self) -> bool {
        drop(self.child.stdin.take());
        for _ in 0..TIMEOUT.as_millis() / 5 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("the child is still running after {TIMEOUT:?}")
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Remove what process `pid` (killed: no destructors ran) left in `/dev/shm`: the
/// segments and socket directories named `shmq_<kind>_<pid>_...`.
fn remove_leftovers_of(pid: u32) {
    let tag = format!("_{pid}_");
    for entry in std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok())
    {
        let name = entry.file_name().into_string().unwrap_or_default();
        if name.starts_with("shmq_") && name.contains(&tag) {
            let path = entry.path();
            if path.is_dir() {
                let _ = std::fs::remove_dir_all(path);
            } else {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// The tests

/// A directory of names of the test's own (`SHMQ_NAMES_DIR`, set for its children
/// only): every claim removes the dead records it finds, so a test in the user's
/// directory of names would sweep other programs' (and the Python tests') records, and
/// have its own swept.
struct PrivateNames(String);

impl PrivateNames {
    fn new(test: &str) -> PrivateNames {
        PrivateNames(format!(
            "/dev/shm/.shmqtest-names-{}-{test}",
            std::process::id()
        ))
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![(names::DIRECTORY_ENV, self.0.clone())]
    }
}

impl Drop for PrivateNames {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_reader_in_another_process_opens_a_writer_by_its_name() {
    child_role();
    const TEST: &str = "a_reader_in_another_process_opens_a_writer_by_its_name";
    const N: u64 = 2000;
    let dir = PrivateNames::new("opened");
    let name = unique_name("steps →");
    let mut writer = Peer::start_with(TEST, "writer", &name, N, None, &dir.env());
    writer.expect("ready");
    let mut reader = Peer::start_with(TEST, "reader", &name, N, None, &dir.env());
    assert_eq!(reader.expect("read"), N.to_string());
    assert!(reader.succeeded());
    writer.expect("sent");
    assert!(writer.succeeded()); // its stdin closed: it ends, and lets the name go
                                 // Ended: the name is free, and there is no such queue.
    let mut absent = Peer::start_with(TEST, "absent", &name, 0, None, &dir.env());
    assert_eq!(absent.expect("absent"), "");
    assert!(absent.succeeded());
    let mut claimer = Peer::start_with(TEST, "claimer", &name, 0, None, &dir.env());
    assert_eq!(claimer.expect("took"), "");
    assert!(claimer.succeeded());
}

#[test]
fn a_name_held_by_a_live_writer_is_refused_in_another_process() {
    child_role();
    const TEST: &str = "a_name_held_by_a_live_writer_is_refused_in_another_process";
    let dir = PrivateNames::new("held");
    let name = unique_name("held");
    let mut writer = Peer::start_with(TEST, "writer", &name, 0, None, &dir.env());
    let pid = writer.expect("ready");
    let mut claimer = Peer::start_with(TEST, "claimer", &name, 0, None, &dir.env());
    assert_eq!(claimer.expect("taken"), pid);
    assert!(claimer.succeeded());
    assert!(writer.succeeded());
    // Free once its writer is gone.
    let mut claimer = Peer::start_with(TEST, "claimer", &name, 0, None, &dir.env());
    assert_eq!(claimer.expect("took"), "");
    assert!(claimer.succeeded());
}

#[test]
fn a_killed_writers_name_is_reported_gone_then_taken_over() {
    child_role();
    const TEST: &str = "a_killed_writers_name_is_reported_gone_then_taken_over";
    // A directory of names of the test's own: another process's claim (the other tests',
    // or any program of this user) removes the dead records it finds, before the checker
    // could see this one.
    let dir = PrivateNames::new("killed");
    let env = dir.env();
    let name = unique_name("killed");
    let result = std::panic::catch_unwind(|| {
        let mut writer = Peer::start_with(TEST, "writer", &name, 0, None, &env);
        let pid: u32 = writer.expect("ready").parse().unwrap();
        // SIGKILL: no destructor runs, the record stays; only its lock goes.
        writer.child.kill().unwrap();
        writer.child.wait().unwrap();
        remove_leftovers_of(pid);
        let env = [env[0].clone(), (KILLED_ENV, pid.to_string())];
        let mut checker = Peer::start_with(TEST, "checker", &name, 0, None, &env);
        let checked = checker.expect("checked");
        assert!(
            checked.contains(&format!("its writer (pid {pid})")),
            "{checked}"
        );
        assert!(checker.succeeded());
    });
    drop(dir);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

/// As root: a stranger (uid 65534) owns the entry where a user's directory of names goes
/// (a directory anyone may write into); two processes of the user find each other by
/// name all the same, through the fallback `.1`, made the user's own and owner-only.
#[test]
fn a_strangers_squat_of_the_names_directory_denies_nothing() {
    child_role();
    if !is_root() {
        eprintln!("skipped: playing a stranger and a victim needs root");
        return;
    }
    const TEST: &str = "a_strangers_squat_of_the_names_directory_denies_nothing";
    let victim = 30_000 + std::process::id() % 30_000;
    let base = format!("/dev/shm/.shmq-names-{victim}");
    let cleanup = || {
        for path in [base.clone(), format!("{base}.1"), format!("{base}.2")] {
            let _ = std::fs::remove_dir_all(&path);
        }
    };
    cleanup();
    std::fs::create_dir(&base).unwrap();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(&base, Some(65534), Some(65534)).unwrap();
    let name = unique_name("squatted");
    let result = std::panic::catch_unwind(|| {
        let mut writer = Peer::start(TEST, "writer", &name, 3, Some(victim));
        writer.expect("ready");
        let mut reader = Peer::start(TEST, "reader", &name, 3, Some(victim));
        assert_eq!(reader.expect("read"), "3");
        assert!(reader.succeeded());
        writer.expect("sent");
        drop(writer.stdin());
        assert!(writer.succeeded());
        let meta = std::fs::symlink_metadata(format!("{base}.1")).unwrap();
        assert!(meta.is_dir());
        assert_eq!((meta.uid(), meta.mode() & 0o777), (victim, 0o700));
        // The stranger's directory was never written into.
        assert_eq!(std::fs::read_dir(&base).unwrap().count(), 0);
    });
    cleanup();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}
