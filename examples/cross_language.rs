//! A Rust scheduler and Python workers in one queue, both ways: raw bytes and typed
//! arrays (from a few bytes to 16 MiB), the format both languages speak. A Rust writer's
//! `enqueue` of bytes and of an `ArrayRef` reach Python's `dequeue_bytes()` and `dequeue()` (a
//! numpy array) and a Rust reader's `dequeue` / `dequeue_array`; a Python writer's
//! `enqueue_bytes` and `enqueue_array` reach a Rust reader the same way.
//! `tests/python/test_cross_language.py` drives it (and checks the same messages in
//! Python); the bench's `cross-language` rows time it.
//!
//! - `cross_language writer <n_readers> <count>`: print the handle line, wait for the
//!   readers, send messages `0..count` of [`expected`], print `sent <count> <seconds>`,
//!   then stay until stdin closes.
//! - `cross_language reader <rank> <count>`: read a handle line from stdin, join as reader
//!   `rank`, take `count` messages (any kind, in order) and check each one against
//!   [`expected`]; print `ok <count> <seconds>`, or `error: <text>` and exit 1 at the
//!   first difference.
//!
//! - `cross_language named-writer <name> <count>` and `named-reader <name> <rank> <count>`:
//!   the same, the queue found by its name instead of its handle (issue 59 item 9): the
//!   writer holds `name` ([`QueueOptions::record_name`]) until it ends, so Python's
//!   `MessageQueue.open(name, rank)` finds it and Python's `MessageQueue(..., name=name)`
//!   is refused meanwhile; the reader opens a Rust or Python writer's queue by its name
//!   ([`Reader::open_by_name`]). The writer prints its handle line too; either prints
//!   `error: <text>` and exits 1 when it cannot take or find the name.
//!
//! - `cross_language send <n_readers> <count> <bytes|f32> <nbytes>` and `take <rank>
//!   <count> [kind]`: the bench's rows (`python -m shmq bench --scenarios cross-language`):
//!   `count` messages of `nbytes` (raw bytes, or a float32 array), each one fresh (its
//!   first 8 bytes are its number); the reader reads every byte of each (a sum) and
//!   prints `took <count> <seconds> <sum>`, timed from its first message.
//!
//! Run as a Rust user would, from this repository: `cargo run --example cross_language
//! writer 1 1000 | cargo run --example cross_language reader 0 1000` (the reader reads
//! the handle the writer prints).

use std::error::Error;
use std::io::{BufRead, Read, Write};
use std::time::{Duration, Instant};

use shmq::broadcast::Received;
use shmq::{ArrayRef, Dtype, Handle, QueueOptions, Reader, Writer};

const TIMEOUT: Duration = Duration::from_secs(60);
/// Element counts of the messages, in turn; every 10 007th message is 16 MiB.
const SIZES: [usize; 7] = [0, 1, 7, 100, 1000, 4097, 70_000];
const LARGE: usize = 16 << 20;

/// What message `i` is: raw bytes, or an array of a dtype and shape, its element `j`
/// being `(i * 31 + j) % 251` (as that dtype); `n` elements (bytes for raw bytes).
#[derive(Debug, PartialEq)]
enum Expected {
    Bytes(usize),
    Array(Dtype, Vec<usize>),
}

fn expected(i: usize) -> Expected {
    let large = i % 10_007 == 5;
    let n = if large {
        LARGE
    } else {
        SIZES[(i / 4) % SIZES.len()]
    };
    match i % 4 {
        0 => Expected::Bytes(n),
        1 => Expected::Array(Dtype::F32, vec![n / if large { 4 } else { 1 }]),
        2 => Expected::Array(Dtype::I64, vec![2, n / if large { 16 } else { 1 }]),
        _ => Expected::Array(Dtype::U16, vec![n / if large { 2 } else { 1 }, 1]),
    }
}

fn value(i: usize, j: usize) -> u8 {
    ((i * 31 + j) % 251) as u8
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| -> Result<usize, Box<dyn Error>> {
        Ok(args.get(i).ok_or("missing argument")?.parse()?)
    };
    match args.first().map(String::as_str) {
        Some("writer") => writer(arg(1)?, arg(2)?, None),
        Some("reader") => {
            if let Err(e) = reader(arg(1)?, arg(2)?, None) {
                println!("error: {e}");
                std::process::exit(1);
            }
            Ok(())
        }
        Some(role @ ("named-writer" | "named-reader")) => {
            let name = args.get(1).ok_or("missing argument")?;
            let done = if role == "named-writer" {
                writer(1, arg(2)?, Some(name))
            } else {
                reader(arg(2)?, arg(3)?, Some(name))
            };
            if let Err(e) = done {
                println!("error: {e}");
                std::process::exit(1);
            }
            Ok(())
        }
        Some("send") => {
            let kind = args.get(3).ok_or("missing argument")?.clone();
            send(arg(1)?, arg(2)?, &kind, arg(4)?)
        }
        Some("take") => take(arg(1)?, arg(2)?),
        _ => Err(
            "usage: cross_language writer <n_readers> <count> | reader <rank> <count> | \
                  named-writer <name> <count> | named-reader <name> <rank> <count> | \
                  send <n_readers> <count> <bytes|f32> <nbytes> | take <rank> <count>"
                .into(),
        ),
    }
}

/// A writer for `n_readers` local readers, chunks of `max_chunk_bytes`, holding `name` if
/// one is given: its handle printed (one line on stdout, for the readers), and its
/// readers joined.
fn start_writer(
    n_readers: usize,
    max_chunk_bytes: usize,
    name: Option<&str>,
) -> Result<Writer, Box<dyn Error>> {
    let mut opts = QueueOptions::local(n_readers);
    opts.max_chunk_bytes = max_chunk_bytes;
    opts.max_chunks = 16;
    opts.name = name.map(str::to_owned);
    opts.record_name = name.is_some();
    let mut writer = Writer::new(opts)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", writer.handle())?;
    out.flush()?;
    writer.wait_until_ready(TIMEOUT)?;
    Ok(writer)
}

/// Reader `rank` of the queue named `name`, or else of the one whose handle is the first
/// line on stdin, joined.
fn join(rank: usize, name: Option<&str>) -> Result<Reader, Box<dyn Error>> {
    let mut reader = match name {
        Some(name) => Reader::open_by_name(name, rank)?,
        None => {
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line)?;
            let handle: Handle = line.parse()?;
            Reader::open(&handle, rank)?
        }
    };
    reader.wait_until_ready(TIMEOUT)?;
    Ok(reader)
}

/// Element `j` of every message `i` is `(i * 31 + j) % 251`: `pattern[(i * 31) % 251..]`
/// of these, made once (so that neither side spends its time making or checking values).
struct Patterns {
    bytes: Vec<u8>,
    f32: Vec<f32>,
    i64: Vec<i64>,
    u16: Vec<u16>,
}

impl Patterns {
    fn new() -> Patterns {
        let bytes: Vec<u8> = (0..LARGE + 251).map(|j| value(0, j)).collect();
        Patterns {
            f32: bytes.iter().map(|&b| f32::from(b)).collect(),
            i64: bytes.iter().map(|&b| i64::from(b)).collect(),
            u16: bytes.iter().map(|&b| u16::from(b)).collect(),
            bytes,
        }
    }
}

/// Elements `(i * 31) % 251 ..` of `pattern`, `n` of them.
fn slice<T>(pattern: &[T], i: usize, n: usize) -> &[T] {
    let start = (i * 31) % 251;
    &pattern[start..start + n]
}

fn writer(n_readers: usize, count: usize, name: Option<&str>) -> Result<(), Box<dyn Error>> {
    let p = Patterns::new();
    let mut writer = start_writer(n_readers, 1 << 20, name)?;
    let mut out = std::io::stdout().lock();
    let start = Instant::now();
    for i in 0..count {
        match expected(i) {
            Expected::Bytes(n) => writer.enqueue(slice(&p.bytes, i, n), TIMEOUT)?,
            Expected::Array(dtype, shape) => {
                let n = shape.iter().product();
                let array = match dtype {
                    Dtype::F32 => ArrayRef::new(slice(&p.f32, i, n), &shape)?,
                    Dtype::I64 => ArrayRef::new(slice(&p.i64, i, n), &shape)?,
                    _ => ArrayRef::new(slice(&p.u16, i, n), &shape)?,
                };
                writer.enqueue(&array, TIMEOUT)?;
            }
        }
    }
    writeln!(out, "sent {count} {:.3}", start.elapsed().as_secs_f64())?;
    out.flush()?;
    std::io::stdin().read_to_end(&mut Vec::new())?;
    Ok(())
}

fn reader(rank: usize, count: usize, name: Option<&str>) -> Result<(), Box<dyn Error>> {
    let p = Patterns::new();
    let mut reader = join(rank, name)?;
    let mut start = None;
    for i in 0..count {
        reader.wait_message(TIMEOUT)?;
        start.get_or_insert_with(Instant::now);
        // Empty (`TryDequeueError::Empty`) would be a message seen as ready and gone.
        let checked = reader.try_take_message(|m| check(&p, i, m))?;
        checked.map_err(|e| format!("message {i}: {e}"))?;
    }
    let seconds = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    println!("ok {count} {seconds:.3}");
    Ok(())
}

/// Whether message `i` is what [`expected`] says, in kind, dtype, shape and every value.
fn check(p: &Patterns, i: usize, m: Received<'_>) -> Result<(), String> {
    match (expected(i), m) {
        (Expected::Bytes(n), Received::Bytes(b)) => {
            if b != slice(&p.bytes, i, n) {
                return Err(format!("{} bytes, not the {n} expected", b.len()));
            }
            Ok(())
        }
        (Expected::Array(dtype, shape), Received::Array { meta, data }) => {
            if meta.dtype != dtype || meta.shape != shape || !meta.is_contiguous() {
                return Err(format!("{meta:?}, not {dtype} {shape:?}"));
            }
            // The bytes as the elements' little-endian bytes (any alignment).
            let n = shape.iter().product();
            let same = match dtype {
                Dtype::F32 => *data == *bytemuck::cast_slice::<f32, u8>(slice(&p.f32, i, n)),
                Dtype::I64 => *data == *bytemuck::cast_slice::<i64, u8>(slice(&p.i64, i, n)),
                _ => *data == *bytemuck::cast_slice::<u16, u8>(slice(&p.u16, i, n)),
            };
            if !same {
                return Err(format!("the values of {dtype} {shape:?} differ"));
            }
            Ok(())
        }
        (want, got) => Err(format!("{want:?} expected, got {}", got.kind_words())),
    }
}

/// The bench's writer (see the module docs).
fn send(n_readers: usize, count: usize, kind: &str, nbytes: usize) -> Result<(), Box<dyn Error>> {
    let mut writer = start_writer(n_readers, (2 * nbytes).max(1 << 16), None)?;
    let mut message = vec![0f32; nbytes.div_ceil(4).max(2)];
    for i in 0..count {
        // Fresh data: the message's number in its first 8 bytes.
        message[..2].copy_from_slice(bytemuck::cast_slice(&[i as u64]));
        let bytes: &[u8] = bytemuck::cast_slice(&message);
        match kind {
            "bytes" => writer.enqueue(&bytes[..nbytes], TIMEOUT)?,
            _ => writer.enqueue(&ArrayRef::new(&message, &[message.len()])?, TIMEOUT)?,
        }
    }
    std::io::stdin().read_to_end(&mut Vec::new())?;
    Ok(())
}

/// The bench's reader (see the module docs).
fn take(rank: usize, count: usize) -> Result<(), Box<dyn Error>> {
    let mut reader = join(rank, None)?;
    let (mut start, mut sum) = (None, 0u64);
    for _ in 0..count {
        reader.wait_message(TIMEOUT)?;
        start.get_or_insert_with(Instant::now);
        // Every byte read, in blocks whose sums fit a u32, added with `wrapping_add` (it
        // never wraps here): the crate's release profile checks overflow, and a checked
        // `sum` would keep the compiler from vectorizing the loop (4x slower than numpy's
        // sum on the Python side).
        let bytes_sum = |b: &[u8]| {
            b.chunks(1 << 16)
                .map(|c| u64::from(c.iter().fold(0u32, |a, &x| a.wrapping_add(u32::from(x)))))
                .sum::<u64>()
        };
        sum += reader.try_take_message(|m| match m {
            Received::Bytes(b) => bytes_sum(b),
            Received::Array { data, .. } => bytes_sum(&data),
            _ => 0,
        })?;
    }
    let seconds = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    println!("took {count} {seconds:.6} {sum}");
    Ok(())
}
