//! `shmq::workers` with real processes: `sh` scripts play the workers, and this test
//! binary, run again with [`ROLE_ENV`] set, plays a parent that a test SIGKILLs.
//!
//! Every wait is bounded. The bounds asserted ("gone within 1 s") are liveness
//! requirements (a pidfd wake-up, `PR_SET_PDEATHSIG`), not performance measurements.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shmq::process::{descendants, ProcessId};
use shmq::workers::Error;
use shmq::workers::{report_ready, Waited, WorkerExit, WorkerOptions, Workers};
use shmq::Error as CoreError;

/// Marks this binary run again as the parent of `workers_die_with_a_sigkilled_parent`.
const ROLE_ENV: &str = "SHMQ_TEST_WORKERS_ROLE";
const STARTUP: Duration = Duration::from_secs(60);
/// What a worker script runs once it is set up: an empty ready frame (a 4-byte length
/// of 0). (Through /proc: dash's `>&$fd` takes single-digit fds only.)
const READY: &str = r#"printf '\000\000\000\000' > "/proc/self/fd/$SHMQ_READY_FD""#;

fn sh(script: &str) -> Command {
    let mut c = Command::new("sh");
    c.args(["-c", script]);
    c
}

fn quiet() -> WorkerOptions {
    WorkerOptions {
        forward_stderr: false,
        ..WorkerOptions::default()
    }
}

fn alive(pid: u32) -> bool {
    // start_time 0: the pid alone (not a zombie, and there).
    ProcessId { pid, start_time: 0 }.is_alive()
}

fn wait_gone(pids: &[u32], within: Duration) -> Vec<u32> {
    let deadline = Instant::now() + within;
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn all_ready_then_closed() {
    let script = format!("{READY}; exec sleep 30");
    let workers = Workers::spawn((0..3).map(|_| sh(&script)), quiet()).unwrap();
    let pids: Vec<u32> = workers.pids().into_iter().flatten().collect();
    workers.wait_until_ready(STARTUP).unwrap();
    assert_eq!(
        workers.wait_any(Some(Duration::from_millis(100))).unwrap(),
        None
    );
    workers.close();
    workers.close(); // idempotent
    assert_eq!(
        workers.exits(),
        vec![Some(WorkerExit::Signal(libc::SIGTERM)); 3]
    );
    assert!(wait_gone(&pids, Duration::ZERO).is_empty());
}

#[test]
fn a_worker_that_dies_before_it_is_ready_is_named_at_once() {
    let ready = format!("{READY}; exec sleep 30");
    let failing = "echo 'loading weights' >&2; echo 'CUDA out of memory' >&2; exit 3";
    let commands = [sh(&ready), sh(failing), sh(&ready)];
    let start = Instant::now();
    let workers = Workers::spawn(commands, quiet()).unwrap();
    let pids: Vec<u32> = workers.pids().into_iter().flatten().collect();
    let err = workers.wait_until_ready(STARTUP).unwrap_err();
    assert!(
        start.elapsed() < STARTUP / 2,
        "not at once: {:?}",
        start.elapsed()
    );
    match &err {
        Error::WorkerDied(death) => {
            assert_eq!(
                (death.rank, death.pid, death.exit, death.before_ready),
                (1, Some(pids[1]), Some(WorkerExit::Code(3)), true)
            );
            assert_eq!(
                death.stderr_tail,
                &["loading weights", "CUDA out of memory"]
            );
        }
        other => panic!("expected WorkerDied, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "Worker_1 (rank 1, pid {}) exited with code 3 before it was ready; the last lines of its stderr:\n    \
             loading weights\n    CUDA out of memory",
            pids[1]
        )
    );
    drop(workers); // closes the others
    assert!(wait_gone(&pids, Duration::ZERO).is_empty());
}

#[test]
fn a_signal_is_named_and_check_reports_it() {
    let script = format!("{READY}; sleep 0.2; echo 'last words' >&2; kill -BUS $$");
    let workers = Workers::spawn([sh(&script)], quiet()).unwrap();
    workers.wait_until_ready(STARTUP).unwrap();
    workers.check().unwrap();
    let first = workers.wait_any(Some(STARTUP)).unwrap();
    assert_eq!(first, Some((0, Some(WorkerExit::Signal(libc::SIGBUS)))));
    let err = workers.check().unwrap_err().to_string();
    assert!(
        err.ends_with("was killed by SIGBUS while it was running; the last lines of its stderr:\n    last words"),
        "{err}"
    );
}

#[test]
fn a_deadline_that_passes_names_the_workers_not_ready() {
    let commands = [sh(&format!("{READY}; exec sleep 30")), sh("exec sleep 30")];
    let workers = Workers::spawn(commands, quiet()).unwrap();
    let pids: Vec<u32> = workers.pids().into_iter().flatten().collect();
    let start = Instant::now();
    let err = workers
        .wait_until_ready(Duration::from_secs(2))
        .unwrap_err();
    assert!(start.elapsed() >= Duration::from_secs(2));
    match &err {
        Error::WorkersNotReady {
            not_ready, total, ..
        } => {
            assert_eq!(*total, 2);
            assert_eq!(
                not_ready,
                &[(
                    "Worker_1".to_owned(),
                    format!("Worker_1 (rank 1, pid {})", pids[1])
                )]
            );
        }
        other => panic!("expected WorkersNotReady, got {other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.starts_with("1 of 2 worker(s) not ready after 2 s:"),
        "{message}"
    );
    assert!(
        message.ends_with(&format!(": Worker_1 (rank 1, pid {})", pids[1])),
        "{message}"
    );
}

#[test]
fn a_worker_ignoring_sigterm_is_killed_after_the_grace_period_with_its_children() {
    // Both children ignore SIGTERM too (inherited); one leaves the worker's process group.
    let script = format!("trap '' TERM; sleep 30 & setsid sleep 30 & {READY}; wait");
    let grace = Duration::from_millis(1500);
    let options = WorkerOptions { grace, ..quiet() };
    let workers = Workers::spawn([sh(&script)], options).unwrap();
    let worker = workers.pids()[0].unwrap();
    workers.wait_until_ready(STARTUP).unwrap();
    let mut children = descendants(worker);
    let deadline = Instant::now() + STARTUP;
    while children.len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        children = descendants(worker);
    }
    assert_eq!(children.len(), 2, "{children:?}");
    let start = Instant::now();
    workers.close();
    assert!(
        start.elapsed() >= grace,
        "SIGKILL before the grace period was over"
    );
    assert_eq!(
        workers.exits(),
        vec![Some(WorkerExit::Signal(libc::SIGKILL))]
    );
    let pids: Vec<u32> = children.iter().map(|p| p.pid).chain([worker]).collect();
    assert!(wait_gone(&pids, Duration::from_secs(1)).is_empty());
}

#[test]
fn the_children_of_a_worker_that_dies_die_with_it() {
    let script = format!("sleep 30 & {READY}; sleep 0.5; exit 4");
    let workers = Workers::spawn([sh(&script)], quiet()).unwrap();
    let worker = workers.pids()[0].unwrap();
    workers.wait_until_ready(STARTUP).unwrap();
    // `sleep 30`, and perhaps the foreground `sleep 0.5`.
    let children: Vec<u32> = descendants(worker).iter().map(|p| p.pid).collect();
    assert!(!children.is_empty());
    assert_eq!(
        workers.wait_any(Some(STARTUP)).unwrap(),
        Some((0, Some(WorkerExit::Code(4))))
    );
    assert!(wait_gone(&children, Duration::from_secs(1)).is_empty());
}

#[test]
fn too_many_workers_are_refused_before_anything_is_allocated() {
    use shmq::workers::MAX_WORKERS;
    for (local, remote) in [
        (1 << 40, 0),
        (0, 1 << 40),
        (usize::MAX, 1),
        (MAX_WORKERS, 1),
    ] {
        let e = Workers::new(local, remote, quiet()).err().expect("refused");
        let text = e.to_string();
        assert!(
            matches!(e, Error::Core(CoreError::InvalidArgument(_))),
            "{e:?}"
        );
        assert!(
            text.contains(&format!("at most {MAX_WORKERS} workers")),
            "{text}"
        );
    }
    Workers::new(0, MAX_WORKERS, quiet()).unwrap().close();
}

#[test]
fn waits_and_a_grace_of_duration_max_wait_without_end_instead_of_panicking() {
    // `Instant::now() + Duration::MAX` panicked: in `wait_any`, and in `close` with the
    // grace the Python bindings give for an infinite one.
    let options = WorkerOptions {
        grace: Duration::MAX,
        ..quiet()
    };
    let workers = Workers::spawn([sh("exit 3")], options).unwrap();
    assert_eq!(
        workers.wait_any(Some(Duration::MAX)).unwrap(),
        Some((0, Some(WorkerExit::Code(3))))
    );
    assert_eq!(
        workers.wait_all_exited(Some(Duration::MAX)),
        Waited::Failed(0)
    );
    workers.close();
}

#[test]
fn report_ready_outside_a_worker_is_an_error() {
    if std::env::var_os(shmq::workers::READY_FD_ENV).is_none() {
        assert!(matches!(
            report_ready(),
            Err(Error::Core(CoreError::WrongRole(_)))
        ));
    }
}

#[test]
fn workers_die_with_a_sigkilled_parent() {
    let script = format!("{READY}; exec sleep 30");
    if std::env::var_os(ROLE_ENV).is_some() {
        // The parent: start two workers, say their pids, wait to be killed.
        let workers = Workers::spawn((0..2).map(|_| sh(&script)), quiet()).unwrap();
        workers.wait_until_ready(STARTUP).unwrap();
        let pids: Vec<String> = workers
            .pids()
            .iter()
            .flatten()
            .map(u32::to_string)
            .collect();
        println!("WORKERS {}", pids.join(" "));
        std::thread::sleep(STARTUP);
        return;
    }
    /// Kills the parent process however the test ends.
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut parent = KillOnDrop(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "workers_die_with_a_sigkilled_parent",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_ENV, "parent")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stdout = BufReader::new(parent.0.stdout.take().unwrap());
    // libtest prints "test ... " first, on the same line.
    let line = stdout
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.split_once("WORKERS ").map(|(_, pids)| pids.to_owned()))
        .expect("the parent process never reported its workers");
    let pids: Vec<u32> = line
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2);
    assert!(pids.iter().all(|&p| alive(p)));
    parent.0.kill().unwrap(); // SIGKILL: no destructor, no close()
    parent.0.wait().unwrap();
    let left = wait_gone(&pids, Duration::from_secs(1));
    assert!(
        left.is_empty(),
        "workers {left:?} outlived their SIGKILLed parent"
    );
}

#[test]
fn a_ready_frame_may_come_in_pieces_and_its_payload_is_kept() {
    // The header and part of the payload, then the rest a moment later.
    let script = r#"fd="/proc/self/fd/$SHMQ_READY_FD"; printf '\000\000\000\003ab' > "$fd"; sleep 0.3; printf c > "$fd"; exec sleep 30"#;
    let workers = Workers::spawn([sh(script)], quiet()).unwrap();
    assert_eq!(
        workers
            .wait_ready_for(Some(Duration::from_millis(100)))
            .unwrap(),
        Waited::TimedOut
    );
    workers.wait_until_ready(STARTUP).unwrap();
    assert_eq!(workers.ready_payloads(), vec![Some(b"abc".to_vec())]);
}

#[test]
fn a_remote_rank_is_claimed_once_and_its_reported_exit_is_a_failure() {
    let workers = Workers::new(0, 1, quiet()).unwrap();
    assert_eq!(
        workers.claim_remote(3, 1234).unwrap_err(),
        "rank 3 is not a remote rank of this group (remote ranks: [0])"
    );
    workers.claim_remote(0, 1234).unwrap();
    assert_eq!(
        workers.claim_remote(0, 99).unwrap_err(),
        "rank 0 has already joined"
    );
    assert!(workers.remote_connected(0, "gpu-host-2"));
    workers.remote_ready(0, b"info".to_vec());
    workers.wait_until_ready(STARTUP).unwrap();
    workers.report_exit(
        0,
        Some(WorkerExit::Code(1)),
        vec!["RuntimeError: no route".to_owned()],
        None,
    );
    assert_eq!(workers.wait_failures(0, Some(STARTUP)), 1);
    assert_eq!(
        workers.check().unwrap_err().to_string(),
        "Worker_0 (rank 0, pid 1234 on gpu-host-2) exited with code 1 while it was running; \
         the last lines of its stderr:\n    RuntimeError: no route"
    );
    assert_eq!(workers.status()[0].exit, Some(WorkerExit::Code(1)));
    workers.close();
    assert!(workers.closed());
}

#[test]
fn a_death_notice_is_a_failure_before_the_worker_has_exited() {
    // The worker prints its traceback, sends a death notice (a frame whose length word
    // has the top bit set: exit code 1, then its last line), and then hangs as a
    // teardown can. Before ready, and after it (the pipe stays open after the report).
    let notice = r#"printf '\200\000\000\0221\nValueError: boom' > "$fd""#;
    let before = format!(
        r#"fd="/proc/self/fd/$SHMQ_READY_FD"; echo 'Traceback (most recent call last):' >&2; echo 'ValueError: boom' >&2; {notice}; exec sleep 30"#
    );
    let after = r#"fd="/proc/self/fd/$SHMQ_READY_FD"; exec 9>"$fd"; printf '\000\000\000\000' >&9; sleep 0.2; echo 'ValueError: boom' >&2; printf '\200\000\000\0221\nValueError: boom' >&9; exec sleep 30"#;
    let workers = Workers::spawn([sh(&before)], quiet()).unwrap();
    let pid = workers.pids()[0].unwrap();
    let err = workers.wait_until_ready(STARTUP).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "Worker_0 (rank 0, pid {pid}) exited with code 1 before it was ready; the last \
             lines of its stderr:\n    Traceback (most recent call last):\n    ValueError: boom"
        )
    );
    assert!(alive(pid), "the failure waited for the exit");
    assert!(!workers.status()[0].exited);
    drop(workers);

    let workers = Workers::spawn([sh(after)], quiet()).unwrap();
    let pid = workers.pids()[0].unwrap();
    workers.wait_until_ready(STARTUP).unwrap();
    assert_eq!(
        workers.wait_all_exited(Some(STARTUP)),
        Waited::Failed(0),
        "the notice after ready was not seen"
    );
    assert!(alive(pid), "the failure waited for the exit");
    let death = workers.death_of(0).unwrap();
    assert_eq!(
        (death.exit, death.before_ready, death.stderr_tail),
        (
            Some(WorkerExit::Code(1)),
            false,
            vec!["ValueError: boom".to_owned()]
        )
    );
    workers.close();
    assert_eq!(
        workers.exits(),
        vec![Some(WorkerExit::Signal(libc::SIGTERM))]
    );
}

/// Marks this binary run again as a process that dies with the process named in it.
const DIE_WITH_ENV: &str = "SHMQ_TEST_DIE_WITH";

#[test]
fn a_process_dies_with_a_process_that_is_not_its_parent_and_with_one_already_gone() {
    if let Some(pid) = std::env::var_os(DIE_WITH_ENV) {
        // The watcher: die of SIGTERM when `pid` (not this process's parent: a pidfd
        // watched by a thread of the core) exits, say so, wait to be killed.
        let pid: u32 = pid.to_str().unwrap().parse().unwrap();
        shmq::workers::die_with_process(pid, libc::SIGTERM).unwrap();
        println!("WATCHING");
        std::thread::sleep(STARTUP);
        return;
    }
    let run_watcher = |pid: u32| {
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_process_dies_with_a_process_that_is_not_its_parent_and_with_one_already_gone",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(DIE_WITH_ENV, pid.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    use std::os::unix::process::ExitStatusExt;
    // A process to die with, started by this test (a sibling of the watcher).
    let mut other = Command::new("sleep").arg("60").spawn().unwrap();
    let mut watcher = run_watcher(other.id());
    let stdout = BufReader::new(watcher.stdout.take().unwrap());
    assert!(
        stdout
            .lines()
            .map_while(Result::ok)
            .any(|l| l.contains("WATCHING")),
        "the watcher never got as far as watching"
    );
    assert!(alive(watcher.id()));
    other.kill().unwrap();
    other.wait().unwrap();
    let status = watcher.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    // A process that is gone already: the signal comes at once (and `WATCHING` is never
    // printed: the process is dead before it gets there).
    let mut gone = Command::new("true").spawn().unwrap();
    let gone_pid = gone.id();
    gone.wait().unwrap();
    let status = run_watcher(gone_pid).wait_with_output().unwrap();
    assert_eq!(status.status.signal(), Some(libc::SIGTERM), "{status:?}");
    assert!(!String::from_utf8_lossy(&status.stdout).contains("WATCHING"));
    // No signal number: refused, never a process that silently outlives its parent.
    for bad in [0, -1, libc::SIGRTMAX() + 1] {
        let e = shmq::workers::die_with_process(std::process::id(), bad).unwrap_err();
        assert!(
            matches!(e, Error::Core(CoreError::InvalidArgument(_))),
            "{bad}: {e}"
        );
    }
}
