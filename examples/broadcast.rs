//! One writer broadcasts to two reader processes.
//!
//! `cargo run --example broadcast` starts the writer. It creates the queue and runs this
//! same program twice more as `broadcast reader <rank> <handle>`: the handle, as text,
//! is all a reader needs to join. Each reader prints what it receives.

use std::error::Error;
use std::process::Command;
use std::time::Duration;

use shmq::{QueueOptions, Reader, Writer};

const N_READERS: usize = 2;
const N_MESSAGES: usize = 10;
const TIMEOUT: Option<Duration> = Some(Duration::from_secs(10));

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("reader") => reader(args[2].parse()?, &args[3]),
        _ => writer(),
    }
}

fn writer() -> Result<(), Box<dyn Error>> {
    // Chunks of 64 KiB: larger messages still work, they go over a local socket.
    let mut opts = QueueOptions::local(N_READERS);
    opts.max_chunk_bytes = 64 * 1024;
    opts.max_chunks = 4;
    let mut writer = Writer::new(opts)?;
    let handle = writer.handle().to_string();

    let exe = std::env::current_exe()?;
    let mut readers = Vec::new();
    for rank in 0..N_READERS {
        let rank = rank.to_string();
        readers.push(
            Command::new(&exe)
                .args(["reader", &rank, &handle])
                .spawn()?,
        );
    }

    writer.wait_until_ready(TIMEOUT)?; // every reader has joined
    for i in 0..N_MESSAGES {
        writer.enqueue(format!("message {i}").as_bytes(), TIMEOUT)?;
    }

    for mut reader in readers {
        let status = reader.wait()?;
        if !status.success() {
            return Err(format!("a reader exited with {status}").into());
        }
    }
    println!("writer: sent {N_MESSAGES} messages to {N_READERS} readers");
    Ok(())
}

fn reader(rank: usize, handle: &str) -> Result<(), Box<dyn Error>> {
    let mut reader = Reader::open(&handle.parse()?, rank)?;
    reader.wait_until_ready(TIMEOUT)?;
    for _ in 0..N_MESSAGES {
        let msg = reader.dequeue(TIMEOUT)?;
        println!("reader {rank}: {}", String::from_utf8_lossy(&msg));
    }
    Ok(())
}
