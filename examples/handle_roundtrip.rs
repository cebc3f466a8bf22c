//! A queue handle's text form between Rust and Python: the same `shmq-handle-3|...` line
//! in both languages, so a Rust writer feeds Python readers and a Python writer feeds
//! Rust readers. `tests/python/test_handle_text.py` drives it in real processes.
//!
//! - `handle_roundtrip writer <n_readers> <max_chunk_bytes>`: make a writer with that
//!   many local readers, print its handle (one line), wait for the readers, send the
//!   messages of [`messages`] as raw bytes, then stay until stdin closes (so that the
//!   readers can take them all). A Python reader opens the line with
//!   `Handle.from_str(line)` and reads raw bytes with `acquire_read()`.
//! - `handle_roundtrip reader <rank> <count>`: read one handle line from stdin (a Python
//!   writer's `str(handle)`), print it as Rust prints it, join as reader `rank`, and
//!   print each of `count` messages as `<length> <hex>` on a line of its own.
//! - `handle_roundtrip parse`: for each line of stdin, print the handle it parses to
//!   (`to_string()`), or `error: <message>`.
//!
//! With no arguments it runs a writer and one reader of its own (both Rust), as a smoke
//! test: `cargo run --example handle_roundtrip`.

use std::error::Error;
use std::io::{BufRead, Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use shmq::{Handle, QueueOptions, Reader, Writer};

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(30));

/// What the writer sends: text, every byte value, nothing at all, and one message larger
/// than a chunk (it goes over the local overflow socket).
fn messages(max_chunk_bytes: usize) -> Vec<Vec<u8>> {
    vec![
        b"hello from rust".to_vec(),
        (0..=255).collect(),
        Vec::new(),
        (0..max_chunk_bytes * 2 + 3)
            .map(|i| (i % 251) as u8)
            .collect(),
    ]
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| -> Result<usize, Box<dyn Error>> {
        let text = args.get(i).ok_or("missing argument")?;
        Ok(text.parse()?)
    };
    match args.first().map(String::as_str) {
        Some("writer") => writer(arg(1)?, arg(2)?),
        Some("reader") => reader(arg(1)?, arg(2)?),
        Some("parse") => parse(),
        None => smoke_test(),
        Some(other) => Err(format!("unknown mode {other:?}: writer, reader or parse").into()),
    }
}

fn writer(n_readers: usize, max_chunk_bytes: usize) -> Result<(), Box<dyn Error>> {
    let mut opts = QueueOptions::local(n_readers);
    opts.max_chunk_bytes = max_chunk_bytes;
    opts.max_chunks = 4;
    let mut writer = Writer::new(opts)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", writer.handle())?;
    out.flush()?;
    writer.wait_until_ready(TIMEOUT)?;
    for message in messages(max_chunk_bytes) {
        writer.enqueue(&message, TIMEOUT)?;
    }
    // Stay until the caller says the readers are done (closes stdin).
    std::io::stdin().read_to_end(&mut Vec::new())?;
    Ok(())
}

fn reader(rank: usize, count: usize) -> Result<(), Box<dyn Error>> {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let handle: Handle = line.parse()?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{handle}")?;
    out.flush()?;
    let mut reader = Reader::open(&handle, rank)?;
    reader.wait_until_ready(TIMEOUT)?;
    for _ in 0..count {
        let message = reader.dequeue(TIMEOUT)?;
        writeln!(out, "{} {}", message.len(), hex(&message))?;
    }
    Ok(())
}

fn parse() -> Result<(), Box<dyn Error>> {
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        match line?.parse::<Handle>() {
            Ok(handle) => writeln!(out, "{handle}")?,
            Err(e) => writeln!(out, "error: {e}")?,
        }
    }
    Ok(())
}

/// This program as writer, and again as its one reader fed the writer's handle line.
fn smoke_test() -> Result<(), Box<dyn Error>> {
    const CHUNK: usize = 4096;
    let exe = std::env::current_exe()?;
    let mut writer = Command::new(&exe)
        .args(["writer", "1", &CHUNK.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut handle = String::new();
    std::io::BufReader::new(writer.stdout.take().ok_or("no stdout")?).read_line(&mut handle)?;
    let sent = messages(CHUNK);
    let mut reader = Command::new(&exe)
        .args(["reader", "0", &sent.len().to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    reader
        .stdin
        .take()
        .ok_or("no stdin")?
        .write_all(handle.as_bytes())?;
    let output = reader.wait_with_output()?;
    drop(writer.stdin.take()); // the reader is done: let the writer go
    let writer_status = writer.wait()?;
    if !output.status.success() || !writer_status.success() {
        return Err(format!("reader: {}, writer: {writer_status}", output.status).into());
    }
    let text = String::from_utf8(output.stdout)?;
    let expected: Vec<String> = std::iter::once(handle.trim_end().to_owned())
        .chain(sent.iter().map(|m| format!("{} {}", m.len(), hex(m))))
        .collect();
    if text.lines().collect::<Vec<_>>() != expected {
        return Err(format!("the reader printed {text:.200}...").into());
    }
    println!(
        "the handle line joined a reader; {} messages arrived",
        sent.len()
    );
    Ok(())
}
