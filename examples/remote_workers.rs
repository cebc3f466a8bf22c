//! A Rust parent supervising workers that join it over TCP (`shmq::workers::link`), as
//! workers on other machines would: here they are this same program run again, on
//! 127.0.0.1. Each proves the ticket's token, reports ready with a payload of raw bytes,
//! and leaves when the parent stops the group; a worker's death (its connection lost)
//! would be the group's failure, named by rank.
//!
//! Run: `cargo run --example remote_workers` (parent: starts 3 workers and stops them).

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use shmq::workers::link::{LinkError, ParentLink, ParentMessage, WorkerListener};
use shmq::workers::{Error, Result, WorkerOptions, Workers};

/// How a worker gets its ticket: an environment variable (unlike a command-line argument,
/// not readable by other users of the machine).
const TICKET_ENV: &str = "SHMQ_WORKER_TICKET";
const WORKERS: usize = 3;
const STARTUP: Duration = Duration::from_secs(30);

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("worker") => worker(args[2].parse().expect("a rank")),
        _ => parent(),
    }
}

/// A worker: join the parent, set up, report ready, serve until told to stop.
fn worker(rank: u32) -> Result<()> {
    let ticket = std::env::var(TICKET_ENV).expect("the parent sets the ticket");
    let mut parent = ParentLink::connect(&ticket.parse()?, rank, STARTUP)?;
    // ... set up here (open the queue, load the model) ...
    let ready = format!("rank {rank}, pid {}", std::process::id());
    parent.send_ready(ready.as_bytes())?;
    loop {
        match parent.recv() {
            Ok(ParentMessage::Stop { grace }) => {
                eprintln!("worker {rank}: stopping (within {grace:?})");
                parent.send_leaving(0, &[])?;
                return Ok(());
            }
            Ok(ParentMessage::SiblingFailed(notice)) => {
                eprintln!(
                    "worker {rank}: a sibling failed: {}",
                    String::from_utf8_lossy(&notice)
                );
            }
            Err(e) => {
                // The parent is gone (or the link failed): a worker does not outlive it.
                eprintln!("worker {rank}: the parent is gone: {e}");
                std::process::exit(1);
            }
        }
    }
}

/// The parent: a group of remote ranks, a listener, the workers started and admitted,
/// then stopped.
fn parent() -> Result<()> {
    let workers = Workers::new(0, WORKERS, WorkerOptions::default())?;
    let listener = WorkerListener::bind("127.0.0.1:0")?;
    let ticket = listener.ticket().to_string();
    let exe = std::env::current_exe().map_err(|e| Error::os("finding this program", e))?;
    let mut children: Vec<Child> = (0..WORKERS)
        .map(|rank| {
            Command::new(&exe)
                .args(["worker", &rank.to_string()])
                .env(TICKET_ENV, &ticket)
                .spawn()
                .map_err(|e| Error::os("starting a worker", e))
        })
        .collect::<Result<_>>()?;

    // Accept without blocking, so that the parent notices a worker that dies before it
    // joins (and gives up at the deadline) instead of waiting for it for ever.
    listener
        .listener()
        .set_nonblocking(true)
        .map_err(|e| Error::os("making the listener non-blocking", e))?;
    let deadline = Instant::now() + STARTUP;
    std::thread::scope(|scope| -> Result<()> {
        let mut senders = Vec::new();
        let run = (|| -> Result<()> {
            while senders.len() < WORKERS {
                // Its token proved and its rank claimed in the group; then a thread reads
                // its frames (ready, leaving, or the link's loss: its death). A connection
                // refused (a wrong token, a rank taken) or failed is only logged.
                let worker = match listener.accept_into(&workers) {
                    Ok(worker) => worker,
                    Err(Error::Link(LinkError::TimedOut)) => {
                        // Nobody waiting to join (or a stranger's handshake ran out).
                        if let Some(e) = exited_before_joining(&mut children) {
                            return Err(e);
                        }
                        if Instant::now() > deadline {
                            return Err(Error::os(
                                "waiting for the workers to join",
                                std::io::ErrorKind::TimedOut.into(),
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                    Err(e) => {
                        eprintln!("parent: {e}");
                        continue;
                    }
                };
                println!(
                    "admitted rank {} (pid {} on {:?}, from {})",
                    worker.rank(),
                    worker.pid(),
                    worker.host(),
                    worker.peer()
                );
                senders.push(worker.sender());
                scope.spawn(|| worker.serve(&workers));
            }
            workers.wait_until_ready(STARTUP)?; // names a worker that died first
            for (rank, payload) in workers.ready_payloads().iter().enumerate() {
                let payload = payload.as_deref().unwrap_or_default();
                println!("Worker_{rank} ready: {}", String::from_utf8_lossy(payload));
            }
            // ... broadcast to them; workers.check()? between steps ...
            workers.check()?;
            Ok(())
        })();
        // Shut down: remote workers are told through their links. On an error too: each
        // link's serving thread ends with its link, so the scope never waits for one.
        workers.close_begin();
        for sender in &senders {
            let _ = sender.send_stop(Duration::from_secs(5)); // a link already gone
        }
        workers.wait_exits(Instant::now() + Duration::from_secs(5));
        for sender in &senders {
            sender.shutdown();
        }
        workers.close_finish();
        run
    })?;
    for child in &mut children {
        let status = child
            .wait()
            .map_err(|e| Error::os("waiting for a worker", e))?;
        println!("worker process {} exited: {status}", child.id());
    }
    Ok(())
}

/// A worker process that has exited (before it joined): its exit, as an error.
fn exited_before_joining(children: &mut [Child]) -> Option<Error> {
    children
        .iter_mut()
        .find_map(|child| match child.try_wait() {
            Ok(Some(status)) => Some(Error::os(
                "a worker exited before it joined",
                std::io::Error::other(format!("pid {}: {status}", child.id())),
            )),
            _ => None,
        })
}
