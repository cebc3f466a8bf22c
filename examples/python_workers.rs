//! A Rust parent supervising local Python workers: `Workers::spawn` starts each worker's
//! command (here `python3 -c ...`), and the worker's `shmq.report_ready()` reaches the
//! parent through the ready pipe the spawn left it (`SHMQ_READY_FD`), as Rust's own
//! `report_ready()` does. `shmq.report_ready(raw=b"...")` hands the parent those bytes
//! as they are (`Workers::ready_payloads`); `report_ready()` an empty payload. A worker
//! that dies first is named by rank, with its last stderr lines.
//! `tests/python/test_rust_parent.py` drives it.
//!
//! Run: `cargo run --example python_workers -- <n> <program> [args...]`: start `n`
//! workers running `program args...` (each finds its rank in `SHMQ_WORKER_RANK`), wait
//! for them to be ready (60 s), print one line per worker, `ready <rank> <payload as
//! hex>`, check that none has failed, then close the group (SIGTERM, a grace period,
//! SIGKILL) and print `closed`. Without arguments: three `python3` workers, each
//! reporting its rank as raw bytes.

use std::process::Command;
use std::time::Duration;

use shmq::workers::{Result, WorkerOptions, Workers};

const WORKER: &str = "\
import os, shmq
rank = os.environ['SHMQ_WORKER_RANK']
# ... set up here (open the queues, load the model) ...
shmq.report_ready(raw=f'worker {rank} ready'.encode())
import signal; signal.pause()  # serve until the parent stops the group
";

fn main() {
    if let Err(e) = run() {
        // The error's text: which worker, its exit code, its last stderr lines.
        eprintln!("python_workers: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (n, program, rest): (usize, String, Vec<String>) = match args.split_first() {
        Some((n, [program, rest @ ..])) => (
            n.parse().expect("the number of workers"),
            program.clone(),
            rest.to_vec(),
        ),
        _ => (3, "python3".into(), vec!["-c".into(), WORKER.into()]),
    };
    let commands = (0..n).map(|_| {
        let mut command = Command::new(&program);
        command.args(&rest);
        command
    });
    let workers = Workers::spawn(commands, WorkerOptions::default())?;
    // A worker that exits (or raises) before it is ready ends this wait with an error
    // naming it: its rank, pid, exit code and last stderr lines.
    workers.wait_until_ready(Duration::from_secs(60))?;
    for (rank, payload) in workers.ready_payloads().iter().enumerate() {
        let payload = payload.as_deref().expect("every worker is ready");
        let hex: String = payload.iter().map(|b| format!("{b:02x}")).collect();
        println!("ready {rank} {hex}");
    }
    workers.check()?;
    workers.close();
    println!("closed");
    Ok(())
}
