//! Raw bytes between Rust and Python in one queue: a Rust writer's `enqueue(&[u8])` is
//! read in Python with `MessageQueue.dequeue_bytes()`, a Python writer's
//! `enqueue_bytes(data)` with Rust's `Reader::dequeue`. A pickled Python object (Python's
//! `enqueue`) is refused by Rust's `dequeue` with an error naming the mismatch (the
//! message consumed, the reader going on). `tests/python/test_raw_messages.py` drives it.
//!
//! - `raw_to_python writer <n_readers> <max_chunk_bytes> <count>`: print the handle line,
//!   wait for the readers, send the `count` messages of [`message`], then stay until
//!   stdin closes.
//! - `raw_to_python reader <rank> <count>`: read a handle line from stdin, join as reader
//!   `rank` and print one line per message: `<length> <fnv1a-64 hex>`, or `error: <text>`.

use std::error::Error;
use std::io::{BufRead, Read, Write};
use std::time::Duration;

use shmq::{Handle, QueueOptions, Reader, Writer};

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(30));
const SIZES: [usize; 9] = [0, 1, 100, 4095, 4096, 4097, 65_536, 300_001, 1 << 20];

/// Message `i`: of size `SIZES[i % 9]`, byte `j` being `(i * 31 + j) % 251`.
fn message(i: usize) -> Vec<u8> {
    (0..SIZES[i % SIZES.len()])
        .map(|j| ((i * 31 + j) % 251) as u8)
        .collect()
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| -> Result<usize, Box<dyn Error>> {
        Ok(args.get(i).ok_or("missing argument")?.parse()?)
    };
    match args.first().map(String::as_str) {
        Some("writer") => writer(arg(1)?, arg(2)?, arg(3)?),
        Some("reader") => reader(arg(1)?, arg(2)?),
        _ => Err("usage: raw_to_python writer <n_readers> <max_chunk_bytes> <count> | reader <rank> <count>".into()),
    }
}

fn writer(n_readers: usize, max_chunk_bytes: usize, count: usize) -> Result<(), Box<dyn Error>> {
    let mut opts = QueueOptions::local(n_readers);
    opts.max_chunk_bytes = max_chunk_bytes;
    opts.max_chunks = 8;
    let mut writer = Writer::new(opts)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", writer.handle())?;
    out.flush()?;
    writer.wait_until_ready(TIMEOUT)?;
    for i in 0..count {
        writer.enqueue(&message(i), TIMEOUT)?;
    }
    std::io::stdin().read_to_end(&mut Vec::new())?;
    Ok(())
}

fn reader(rank: usize, count: usize) -> Result<(), Box<dyn Error>> {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let handle: Handle = line.parse()?;
    let mut reader = Reader::open(&handle, rank)?;
    reader.wait_until_ready(TIMEOUT)?;
    let mut out = std::io::stdout().lock();
    for _ in 0..count {
        match reader.dequeue(TIMEOUT) {
            Ok(m) => writeln!(out, "{} {:016x}", m.len(), fnv1a(&m))?,
            Err(e) => writeln!(out, "error: {e}")?,
        }
    }
    Ok(())
}
