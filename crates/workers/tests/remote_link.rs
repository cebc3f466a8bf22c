//! The worker link between real processes: this test binary is also the worker (it runs
//! itself again with `--exact worker_process` and the role in the environment), and
//! joins a parent in the test's process over TCP on 127.0.0.1.
//!
//! - a worker with the ticket's token is admitted, reports ready (raw bytes), is stopped
//!   and leaves with its exit code;
//! - a worker with another token is refused, and hears why;
//! - a worker SIGKILLed is seen by the parent as its link's loss, and by a [`Workers`]
//!   group as its death.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shmq_workers::link::{
    LinkError, ParentLink, ParentMessage, RemoteWorker, Ticket, WorkerListener, WorkerMessage,
};
use shmq_workers::{Error, SiblingFailure, WorkerExit, WorkerOptions, Workers};

const ROLE: &str = "SHMQ_LINK_TEST_ROLE";
const TICKET: &str = "SHMQ_LINK_TEST_TICKET";
const RANK: &str = "SHMQ_LINK_TEST_RANK";
const STARTUP: Duration = Duration::from_secs(30);
/// The worker's exit code when the parent refused it for a wrong token.
const REFUSED: i32 = 42;

/// The worker's side, in a process of its own (a no-op in the test run itself).
#[test]
fn worker_process() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let ticket: Ticket = std::env::var(TICKET).unwrap().parse().unwrap();
    let rank: u32 = std::env::var(RANK).unwrap().parse().unwrap();
    let mut link = match ParentLink::connect(&ticket, rank, STARTUP) {
        Ok(link) => link,
        Err(e) if e.to_string().contains("wrong token") => std::process::exit(REFUSED),
        Err(e) => panic!("{e}"),
    };
    link.send_ready(format!("pid {}", std::process::id()).as_bytes())
        .unwrap();
    match role.as_str() {
        // Until stopped (a sibling's failure told on the way is not a stop).
        "stop" => loop {
            match link.recv().unwrap() {
                ParentMessage::Stop { .. } => {
                    link.send_leaving(3, &["stopped".into()]).unwrap();
                    std::process::exit(3);
                }
                ParentMessage::SiblingFailed(_) => {}
            }
        },
        // Until told of a sibling's failure: leave with 0 if it names rank 0's lost
        // link, 9 if another; 8 if stopped or the link ends first.
        "told" => {
            let code = match link.recv() {
                Ok(ParentMessage::SiblingFailed(notice)) => {
                    let failure = SiblingFailure::from_notice(&notice).unwrap();
                    let named = failure.rank == 0
                        && failure.name == "Worker_0"
                        && failure.message.contains("lost its connection");
                    if named {
                        0
                    } else {
                        9
                    }
                }
                Ok(ParentMessage::Stop { .. }) | Err(_) => 8,
            };
            let _ = link.send_leaving(code, &[]);
            std::process::exit(code);
        }
        _ => loop {
            std::thread::sleep(Duration::from_secs(1)); // until killed
        },
    }
}

fn start_worker(role: &str, ticket: &Ticket, rank: u32) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "worker_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .env(TICKET, ticket.to_string())
        .env(RANK, rank.to_string())
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// The next connection's handshake, or a panic after [`STARTUP`] (no hang for a worker
/// that never came).
fn accept_within(
    listener: &WorkerListener,
    admit: impl FnOnce(&shmq_workers::link::Hello) -> Result<(), String>,
) -> shmq_workers::Result<RemoteWorker> {
    let socket: &TcpListener = listener.listener();
    socket.set_nonblocking(true).unwrap();
    let until = Instant::now() + STARTUP;
    let stream = loop {
        match socket.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("no worker connected: {e}"),
        }
    };
    stream.set_nonblocking(false).unwrap();
    listener.handshake(stream, admit)
}

fn wait_exit(child: &mut Child) -> Option<i32> {
    let until = Instant::now() + STARTUP;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        assert!(Instant::now() < until, "the worker did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_worker_process_with_the_token_is_admitted_reports_ready_and_is_stopped() {
    let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
    let mut child = start_worker("stop", listener.ticket(), 1);
    let mut worker = accept_within(&listener, |h| match h.rank {
        1 => Ok(()),
        r => Err(format!("rank {r} is not a remote rank")),
    })
    .unwrap();
    assert_eq!((worker.rank(), worker.pid()), (1, child.id()));
    let ready = format!("pid {}", child.id()).into_bytes();
    assert_eq!(worker.recv().unwrap(), WorkerMessage::Ready(ready));
    worker.send_stop(Duration::from_secs(5)).unwrap();
    assert_eq!(
        worker.recv().unwrap(),
        WorkerMessage::Leaving {
            exitcode: 3,
            stderr: vec!["stopped".into()]
        }
    );
    assert_eq!(wait_exit(&mut child), Some(3));
}

#[test]
fn a_worker_process_with_another_token_is_refused() {
    let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
    let mut wrong = listener.ticket().clone();
    wrong.token = [0; 32];
    let mut child = start_worker("stop", &wrong, 1);
    let admitted = accept_within(&listener, |_| Ok(()));
    match admitted {
        Err(Error::Link(LinkError::Refused(why))) => assert!(why.contains("wrong token"), "{why}"),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a worker with another token was admitted"),
    }
    assert_eq!(wait_exit(&mut child), Some(REFUSED));
}

#[test]
fn a_killed_worker_process_is_its_links_loss() {
    let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
    let mut child = start_worker("sleep", listener.ticket(), 0);
    let mut worker = accept_within(&listener, |_| Ok(())).unwrap();
    assert!(matches!(worker.recv().unwrap(), WorkerMessage::Ready(_)));
    child.kill().unwrap(); // SIGKILL
    match worker.recv() {
        Err(Error::Link(e)) => assert!(e.is_loss(), "{e}"),
        other => panic!("expected the link's loss, got {other:?}"),
    }
    assert_eq!(wait_exit(&mut child), None); // killed by a signal
}

/// The same through a [`Workers`] group: ready as the group's, the kill as a death
/// naming the worker, the other worker stopped through its link at close.
#[test]
fn a_workers_group_supervises_remote_worker_processes() {
    let workers = Workers::new(0, 2, WorkerOptions::default()).unwrap();
    let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
    let mut children = [
        start_worker("sleep", listener.ticket(), 0),
        start_worker("stop", listener.ticket(), 1),
    ];
    std::thread::scope(|scope| {
        let mut senders = Vec::new();
        for _ in 0..2 {
            let worker = listener.accept_into(&workers).unwrap();
            senders.push(worker.sender());
            scope.spawn(|| worker.serve(&workers));
        }
        workers.wait_until_ready(STARTUP).unwrap();
        let payloads = workers.ready_payloads();
        for (rank, child) in children.iter().enumerate() {
            let want = format!("pid {}", child.id()).into_bytes();
            assert_eq!(payloads[rank].as_deref(), Some(&want[..]));
        }
        children[0].kill().unwrap();
        let (rank, _) = workers.wait_any(Some(STARTUP)).unwrap().unwrap();
        assert_eq!(rank, 0);
        let err = workers.check().unwrap_err().to_string();
        assert!(
            err.contains("Worker_0") && err.contains("lost its connection to the parent"),
            "{err}"
        );
        // Close: the remote workers are told through their links.
        workers.close_begin();
        for sender in &senders {
            let _ = sender.send_stop(Duration::from_secs(5)); // rank 0's link is gone
        }
        assert!(workers.wait_exits(Instant::now() + STARTUP));
        workers.close_finish();
    });
    assert_eq!(wait_exit(&mut children[0]), None); // SIGKILL
    assert_eq!(wait_exit(&mut children[1]), Some(3));
    assert_eq!(workers.exits()[1], Some(WorkerExit::Code(3)));
}

/// One call admits and serves the remote workers (`Workers::admit_remote`), a monitor
/// tells the survivors of a death over their links, and `close()` stops the rest.
#[test]
fn admit_remote_serves_remote_workers_a_monitor_tells_them_and_close_stops_them() {
    let workers = Workers::new(0, 3, WorkerOptions::default()).unwrap();
    let ticket = workers
        .admit_remote(WorkerListener::bind("127.0.0.1:0").unwrap())
        .unwrap();
    let mut children = [
        start_worker("sleep", &ticket, 0),
        start_worker("told", &ticket, 1),
        start_worker("stop", &ticket, 2),
    ];
    workers.wait_until_ready(STARTUP).unwrap();
    let payloads = workers.ready_payloads();
    for (rank, child) in children.iter().enumerate() {
        let want = format!("pid {}", child.id()).into_bytes();
        assert_eq!(payloads[rank].as_deref(), Some(&want[..]));
    }
    let monitor = workers.monitor().unwrap();
    children[0].kill().unwrap();
    // Told over its link, by name (8: told nothing before its link ended).
    assert_eq!(wait_exit(&mut children[1]), Some(0));
    let err = monitor.finish().unwrap_err().to_string();
    assert!(err.contains("Worker_0"), "{err}");
    workers.close(); // rank 2 is asked to stop over its link
    assert_eq!(wait_exit(&mut children[2]), Some(3));
    assert_eq!(wait_exit(&mut children[0]), None); // SIGKILL
    let exits = workers.exits();
    assert_eq!(
        (exits[1], exits[2]),
        (Some(WorkerExit::Code(0)), Some(WorkerExit::Code(3)))
    );
}
