//! `Workers::monitor` between real processes (issue 59 item 7): this test binary is also
//! the worker (`Workers::spawn` runs it again with `--exact monitor_worker`; the worker
//! finds its rank in `SHMQ_WORKER_RANK`).
//!
//! - one of three workers dies (exit code 7): the two others hear of it through
//!   `sibling_failure()` (its name, rank and exit) and leave with code 0; the parent's
//!   writer registered with the monitor has its blocked wait end with the queue's
//!   shutdown; `finish()` names the worker;
//! - a monitor made after the failure fires at once;
//! - exits that `wait_exits` sees before the supervisor thread are failures all the same;
//! - without a failure, dropping the monitor joins its thread (nothing fires);
//! - a Python worker (`python3`, `PYTHONPATH` the repository's `python/`) hears of the
//!   failure through `shmq.workers.sibling_failure()` (skipped, saying so, where that
//!   Python cannot import shmq).
//!
//! No timing is asserted: the bounds below only turn a hang into a failure.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shmq_core::broadcast::{EnqueueError, QueueOptions, Writer};
use shmq_workers::{
    report_ready, sibling_failure, Error, WorkerExit, WorkerOptions, Workers, RANK_ENV,
};

/// What a worker does: `die` (ready, then exit 7), `listen` (ready, then wait for a
/// sibling's failure: exit 0 if it names `Worker_0` and its exit code 7, 9 if it names
/// another, 8 if none came within the bound), `finish` (ready, then exit 0).
const ROLE: &str = "SHMQ_MONITOR_TEST_ROLE";
/// Hang guard only.
const BOUND: Duration = Duration::from_secs(60);

#[test]
fn monitor_worker() {
    let Ok(rank) = std::env::var(RANK_ENV) else {
        return; // the test run itself
    };
    let roles = std::env::var(ROLE).unwrap();
    let role = roles.split(',').nth(rank.parse().unwrap()).unwrap();
    report_ready().unwrap();
    match role {
        "die" => std::process::exit(7),
        "finish" => std::process::exit(0),
        "listen" => {
            let until = Instant::now() + BOUND;
            while Instant::now() < until {
                if let Some(failure) = sibling_failure() {
                    eprintln!("told: {failure}");
                    let named = failure.name == "Worker_0"
                        && failure.rank == 0
                        && failure.exit == Some(WorkerExit::Code(7))
                        && failure.message.contains("Worker_0");
                    std::process::exit(if named { 0 } else { 9 });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            std::process::exit(8);
        }
        other => panic!("no role {other}"),
    }
}

fn worker(roles: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "monitor_worker",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, roles);
    command
}

fn options() -> WorkerOptions {
    WorkerOptions {
        grace: Duration::from_secs(5),
        ..WorkerOptions::default()
    }
}

/// Wait until every worker has exited (the bound only guards a hang).
fn all_exited(workers: &Workers) {
    assert!(
        workers.wait_exits(Instant::now() + BOUND),
        "workers still running: {:?}",
        workers.status()
    );
}

fn assert_names_worker_0(e: &Error) {
    match e {
        Error::WorkerDied(death) => {
            assert_eq!((death.rank, death.exit), (0, Some(WorkerExit::Code(7))));
        }
        other => panic!("expected Worker_0's death, got {other}"),
    }
}

#[test]
fn a_death_is_told_to_the_siblings_and_ends_the_parents_blocked_wait() {
    let roles = "die,listen,listen";
    let workers = Workers::spawn((0..3).map(|_| worker(roles)), options()).unwrap();
    // A writer whose readers never come: its wait blocks until the monitor shuts it down.
    let mut writer = Writer::new(QueueOptions::local(2)).unwrap();
    let monitor = workers.monitor().unwrap();
    monitor.shut_down(&writer.canceller());
    let ran = Arc::new(Mutex::new(false));
    let ran_too = ran.clone();
    monitor.on_failure(move |death| {
        assert_eq!(death.rank, 0);
        *ran_too.lock().unwrap() = true;
    });
    let waited = writer.wait_until_ready(BOUND);
    assert!(
        matches!(waited, Err(EnqueueError::ShutDown)),
        "the writer's wait ended with {waited:?}"
    );
    assert!(*ran.lock().unwrap());
    assert_names_worker_0(&monitor.check().unwrap_err());
    all_exited(&workers);
    // The survivors were told, by name (8: told nothing; 9: told of another).
    assert_eq!(
        workers.exits(),
        vec![
            Some(WorkerExit::Code(7)),
            Some(WorkerExit::Code(0)),
            Some(WorkerExit::Code(0))
        ]
    );
    assert_names_worker_0(&monitor.finish().unwrap_err());
    workers.close();
}

#[test]
fn a_monitor_made_after_the_failure_fires_at_once() {
    let roles = "die,listen";
    let workers = Workers::spawn((0..2).map(|_| worker(roles)), options()).unwrap();
    let (rank, _) = workers.wait_any(Some(BOUND)).unwrap().unwrap();
    assert_eq!(rank, 0);
    let until = Instant::now() + BOUND;
    while workers.failures().is_empty() {
        // Recorded by the supervisor with the exit it sees (the bound guards a hang).
        assert!(
            Instant::now() < until,
            "the exit was never recorded as a failure"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let writer = Writer::new(QueueOptions::local(1)).unwrap();
    let monitor = workers.monitor().unwrap();
    all_exited(&workers); // the survivor exits once it has been told
    assert_eq!(workers.exits()[1], Some(WorkerExit::Code(0)));
    monitor.shut_down(&writer.canceller()); // fired: now
    assert!(writer.canceller().is_cancelled());
    assert_names_worker_0(&monitor.finish().unwrap_err());
}

#[test]
fn without_a_failure_nothing_fires_and_drop_joins_the_thread() {
    let roles = "finish,finish";
    let workers = Workers::spawn((0..2).map(|_| worker(roles)), options()).unwrap();
    let writer = Writer::new(QueueOptions::local(1)).unwrap();
    {
        let monitor = workers.monitor().unwrap();
        monitor.shut_down(&writer.canceller());
        all_exited(&workers); // finished (code 0 after ready): no failure
        monitor.check().unwrap();
    } // dropped: its thread joined
    assert!(!writer.canceller().is_cancelled());
    assert!(workers.failures().is_empty());
    workers.close();
}

/// `wait_exits` before close leaves the exits to the supervisor thread, which records each
/// with its failure: were an exit recorded by the wait first (as it once was, whenever it
/// looked before that thread), it had no failure and a monitor never fired. Six workers
/// dying at once, three rounds: after the wait, every one is a failure.
#[test]
fn an_exit_that_wait_exits_sees_first_is_still_a_failure() {
    for _ in 0..3 {
        let workers =
            Workers::spawn((0..6).map(|_| worker("die,die,die,die,die,die")), options()).unwrap();
        all_exited(&workers);
        let ranks: Vec<usize> = workers.failures().iter().map(|d| d.rank).collect();
        assert_eq!(ranks.len(), 6, "failures recorded: ranks {ranks:?}");
        let monitor = workers.monitor().unwrap();
        assert!(monitor.finish().is_err(), "the monitor never fired");
        workers.close();
    }
}

/// A Python worker of a Rust parent: `shmq.workers.sibling_failure()` reads the notice
/// pipe `Workers::spawn` left it.
#[test]
fn a_python_worker_hears_of_a_sibling_failure() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../python");
    let importable = Command::new(&python)
        .args(["-c", "import shmq.workers"])
        .env("PYTHONPATH", &root)
        .status()
        .is_ok_and(|s| s.success());
    if !importable {
        eprintln!(
            "SKIPPED: {python} cannot import shmq from {} (build the extension: maturin develop)",
            root.display()
        );
        return;
    }
    let listen = "\
import sys, time
import shmq
from shmq.workers import sibling_failure
shmq.report_ready()
for _ in range(12000):
    f = sibling_failure()
    if f is not None:
        print('told:', f, file=sys.stderr)
        ok = (f.name, f.rank, f.exitcode) == ('Worker_0', 0, 7) and 'Worker_0' in str(f)
        sys.exit(0 if ok else 9)
    time.sleep(0.005)
sys.exit(8)
";
    let roles = "die,listen";
    let mut python_worker = Command::new(&python);
    python_worker.args(["-c", listen]).env("PYTHONPATH", &root);
    let workers = Workers::spawn([worker(roles), python_worker], options()).unwrap();
    let monitor = workers.monitor().unwrap();
    all_exited(&workers);
    assert_eq!(
        workers.exits(),
        vec![Some(WorkerExit::Code(7)), Some(WorkerExit::Code(0))]
    );
    assert_names_worker_0(&monitor.finish().unwrap_err());
}

/// Set (to anything) in the process that `a_parent_with_sigpipe_at_its_default_...`
/// runs `sigpipe_parent` in.
const SIGPIPE_PARENT: &str = "SHMQ_MONITOR_TEST_SIGPIPE_PARENT";

/// The parent of the test below, in a process of its own (the signal's disposition is
/// process-wide): SIGPIPE at its default, as in a C program that embeds the library; one
/// worker finishes, the other dies, and the monitor made then tells the one that finished,
/// whose notice pipe has no reader any more.
#[test]
fn sigpipe_parent() {
    if std::env::var(SIGPIPE_PARENT).is_err() {
        return; // the test run itself
    }
    // SAFETY: sets this process's SIGPIPE to its default; this process runs this one test
    // (`--exact`, one thread) and nothing else.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let workers = Workers::spawn((0..2).map(|_| worker("finish,die")), options()).unwrap();
    all_exited(&workers);
    let monitor = workers.monitor().unwrap(); // fires at once: tells Worker_0, gone
    match monitor.finish().unwrap_err() {
        Error::WorkerDied(death) => assert_eq!(death.rank, 1),
        other => panic!("expected Worker_1's death, got {other}"),
    }
    println!("the parent lived on");
    workers.close();
}

#[test]
fn telling_a_worker_that_has_exited_never_raises_sigpipe_in_the_parent() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "sigpipe_parent",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SIGPIPE_PARENT, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("the parent lived on"),
        "{:?} (killed by SIGPIPE: signal 13)\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
