//! A tokio front end that broadcasts steps to worker processes and awaits their results.
//!
//! `cargo run --example async_tokio` starts the front end. It makes the steps queue (one
//! writer, a local reader per worker) and runs this same program three times as
//! `async_tokio worker <rank> <steps handle>`. Each worker makes its own results queue
//! and prints its handle; the front end reads the three into one `Gather`. Then, on a
//! tokio runtime, it sends each step and awaits one result per worker with
//! `gather.recv_async()` (under `tokio::time::timeout`), while a ticker task shows that
//! the runtime's thread is never blocked. shmq's futures need no particular runtime:
//! its own waiter threads sleep on the queues and wake the tasks.

use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shmq::broadcast::{DequeueError, Gather, GatherRecvError};
use shmq::{QueueOptions, Reader, Writer};

const WORKERS: usize = 3;
const STEPS: usize = 4;
const TIMEOUT: Duration = Duration::from_secs(10);

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("worker") {
        return worker(args[2].parse()?, &args[3]);
    }
    // Setup, blocking: start the workers and join their results queues.
    let mut steps = Writer::new(QueueOptions::local(WORKERS))?;
    let exe = std::env::current_exe()?;
    let mut workers: Vec<Child> = Vec::new();
    let mut results = Vec::new();
    for rank in 0..WORKERS {
        let mut child = Command::new(&exe)
            .args(["worker", &rank.to_string(), &steps.handle().to_string()])
            .stdout(Stdio::piped())
            .spawn()?;
        // The worker's first line: its results queue's handle.
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
        let mut reader = Reader::open(&line.trim().parse()?, 0)?;
        reader.wait_until_ready(TIMEOUT)?;
        results.push((format!("worker {rank}"), reader));
        workers.push(child);
    }
    let gather = Gather::new(results)?;
    steps.wait_until_ready(TIMEOUT)?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    runtime.block_on(front_end(steps, gather))?;

    for mut w in workers {
        let status = w.wait()?;
        if !status.success() {
            return Err(format!("a worker exited with {status}").into());
        }
    }
    Ok(())
}

/// Send each step, await every worker's result; then end the steps queue and await the
/// workers' ends.
async fn front_end(mut steps: Writer, mut gather: Gather) -> Result<(), Box<dyn Error>> {
    // Runs beside the awaits on the same thread: it could not if they blocked it.
    let ticks = Arc::new(Mutex::new(0u64));
    let ticker = tokio::spawn({
        let ticks = ticks.clone();
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
                *ticks.lock().unwrap() += 1;
            }
        }
    });
    for step in 0..STEPS {
        // A short enqueue (the ring has room: every worker read the step before).
        steps.enqueue(format!("step {step}").as_bytes(), TIMEOUT)?;
        for _ in 0..WORKERS {
            let (worker, result) = tokio::time::timeout(TIMEOUT, gather.recv_async()).await??;
            println!(
                "front end: {} answered {:?}",
                gather.name(worker),
                String::from_utf8_lossy(&result)
            );
        }
    }
    // Done: the workers see the queue's end, close their results queues and exit.
    steps.close();
    match tokio::time::timeout(TIMEOUT, gather.recv_async()).await? {
        Err(GatherRecvError::Ended { ended, .. }) => {
            println!("front end: every worker ended ({})", ended.join(", "));
        }
        other => return Err(format!("expected the workers' end, got {other:?}").into()),
    }
    ticker.abort();
    println!(
        "front end: the ticker ran {} times meanwhile, on the same thread",
        ticks.lock().unwrap()
    );
    Ok(())
}

/// A worker: read each step, answer it on its own results queue, until the steps queue
/// ends.
fn worker(rank: usize, steps_handle: &str) -> Result<(), Box<dyn Error>> {
    let mut steps = Reader::open(&steps_handle.parse()?, rank)?;
    let mut results = Writer::new(QueueOptions::local(1))?;
    println!("{}", results.handle());
    steps.wait_until_ready(TIMEOUT)?;
    results.wait_until_ready(TIMEOUT)?;
    loop {
        match steps.dequeue(TIMEOUT) {
            Ok(step) => {
                let answer = format!("{} done by worker {rank}", String::from_utf8_lossy(&step));
                results.enqueue(answer.as_bytes(), TIMEOUT)?;
            }
            Err(DequeueError::WriterShutDown { .. }) => break,
            Err(e) => return Err(e.into()),
        }
    }
    results.close();
    Ok(())
}
