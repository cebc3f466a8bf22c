//! Broadcast-queue benchmarks through the public Rust API (`Writer::enqueue`,
//! `Reader::dequeue_view`), between two real processes.
//!
//! What is measured, and how:
//! - `latency/one_way_64B`: one-way latency of a 64-byte message. The bench process and
//!   an echo process (this bench binary started again with [`PEER_ENV`] set) play
//!   ping-pong over two queues: the bench enqueues on "ping", the echo process dequeues
//!   it and enqueues the same bytes on "pong", the bench dequeues that. Criterion times
//!   batches of round trips with `iter_custom`, which reports half the batch time, so
//!   its per-iteration figure is the one-way latency. After the criterion run, 20 000
//!   round trips (after 1 000 warm-up) are timed one by one and p50/p99 of the half
//!   round trip are printed (the way the project states its latency targets); those
//!   include one `Instant::now()` per round trip (about 20 ns, so ~10 ns one-way).
//! - `throughput/enqueue_64B_1_reader`: how fast the writer can enqueue 64-byte
//!   messages while one reader process drains the queue as fast as it can (the ring
//!   bounds how far the writer runs ahead, so this is the steady-state rate of the pair).
//!   Criterion reports it as elements per second.
//!
//! - `wait/machine_load_cached` and `wait/machine_load_read`: what a blocked wait pays to
//!   ask whether the machine is full (`shmq::wait::MachineLoad`): the cached reading
//!   (one atomic load), and a reading of `/proc/loadavg` (what one wait of the process
//!   pays about every 5 ms). `SHMQ_LOAD_CHECK=0` runs the latency rows without the check.
//!
//! Queues use `max_chunk_bytes = 24 MiB, max_chunks = 10` like `python -m shmq bench`;
//! a 64-byte message only touches the first cache line of its chunk either way. No CPU
//! pinning: on a 2-core machine each process gets a core of its own anyway.
//!
//! Run: `cargo bench --bench ring -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use shmq::wait::WaitSpec;
use shmq::{Error, Handle, QueueOptions, Reader, Writer};

/// Set in the peer process: `echo` or `drain`.
const PEER_ENV: &str = "SHMQ_BENCH_PEER";
/// The handle of the queue the peer reads.
const HANDLE_ENV: &str = "SHMQ_BENCH_HANDLE";
/// Bound on every blocking call, so a broken run fails instead of hanging.
const TIMEOUT: Option<Duration> = Some(Duration::from_secs(30));
const MESSAGE: [u8; 64] = [0xAB; 64];
/// Tells the peer to exit (bench messages are never empty).
const STOP: &[u8] = b"";

fn options() -> QueueOptions {
    let mut opts = QueueOptions::local(1);
    opts.max_chunk_bytes = 24 << 20;
    opts.max_chunks = 10;
    opts
}

// ---------------------------------------------------------------------------------
// The peer process

fn peer_main(role: &str) -> shmq::Result<()> {
    let handle: Handle = std::env::var(HANDLE_ENV)
        .expect("peer without a handle")
        .parse()?;
    let mut input = Reader::open(&handle, 0)?;
    // Waits for the next message have no deadline (criterion may pause between runs)
    // but end if the bench process goes away.
    let parent = std::os::unix::process::parent_id();
    let mut orphaned = || {
        if std::os::unix::process::parent_id() != parent {
            return Err(Error::Cancelled);
        }
        Ok(())
    };
    match role {
        "echo" => {
            let mut output = Writer::new(options())?;
            println!("{}", output.handle());
            output.wait_until_ready(TIMEOUT)?;
            input.wait_until_ready(TIMEOUT)?;
            loop {
                let wait = WaitSpec {
                    hook: Some(&mut orphaned),
                    ..WaitSpec::default()
                };
                // Echo straight from the chunk: no copy on this side.
                let done = input.dequeue_view(wait, |m| {
                    if m == STOP {
                        return Ok(true);
                    }
                    output.enqueue(m, TIMEOUT).map(|()| false)
                })??;
                if done {
                    return Ok(());
                }
            }
        }
        "drain" => {
            input.wait_until_ready(TIMEOUT)?;
            loop {
                let wait = WaitSpec {
                    hook: Some(&mut orphaned),
                    ..WaitSpec::default()
                };
                if input.dequeue_view(wait, |m| black_box(m) == STOP)? {
                    return Ok(());
                }
            }
        }
        _ => panic!("unknown {PEER_ENV}={role}"),
    }
}

/// A peer process started by the bench; killed if the bench panics.
struct Peer(Child);

impl Peer {
    fn spawn(role: &str, handle: &Handle) -> Peer {
        let child = Command::new(std::env::current_exe().unwrap())
            .env(PEER_ENV, role)
            .env(HANDLE_ENV, handle.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the peer process");
        Peer(child)
    }

    /// The line the peer prints first (the echo peer's queue handle).
    fn read_line(&mut self) -> String {
        let mut line = String::new();
        BufReader::new(self.0.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            !line.is_empty(),
            "the peer exited before printing its handle"
        );
        line
    }

    /// Send the stop message and wait (bounded) for the peer to exit cleanly.
    fn stop(mut self, writer: &mut Writer) {
        writer.enqueue(STOP, TIMEOUT).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "the peer did not stop");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(status.success(), "the peer exited with {status}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

// ---------------------------------------------------------------------------------
// The benches

fn round_trip(ping: &mut Writer, pong: &mut Reader) {
    ping.enqueue(&MESSAGE, TIMEOUT).unwrap();
    pong.dequeue_view(TIMEOUT, |m| black_box(m.len())).unwrap();
}

fn latency(c: &mut Criterion) {
    let mut ping = Writer::new(options()).unwrap();
    let mut peer = Peer::spawn("echo", ping.handle());
    let pong_handle: Handle = peer.read_line().parse().unwrap();
    let mut pong = Reader::open(&pong_handle, 0).unwrap();
    ping.wait_until_ready(TIMEOUT).unwrap();
    pong.wait_until_ready(TIMEOUT).unwrap();

    let mut group = c.benchmark_group("latency");
    group.bench_function("one_way_64B", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                round_trip(&mut ping, &mut pong);
            }
            start.elapsed() / 2
        })
    });
    group.finish();

    // Percentiles of single round trips, the way the latency targets are stated.
    for _ in 0..1_000 {
        round_trip(&mut ping, &mut pong);
    }
    let mut one_way: Vec<Duration> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            round_trip(&mut ping, &mut pong);
            t.elapsed() / 2
        })
        .collect();
    one_way.sort_unstable();
    let pct = |p: usize| one_way[one_way.len() * p / 100];
    println!(
        "latency/one_way_64B over 20000 round trips: p50 {:.3?}  p99 {:.3?}  max {:.3?}",
        pct(50),
        pct(99),
        one_way[one_way.len() - 1]
    );

    peer.stop(&mut ping);
}

fn throughput(c: &mut Criterion) {
    let mut writer = Writer::new(options()).unwrap();
    let peer = Peer::spawn("drain", writer.handle());
    writer.wait_until_ready(TIMEOUT).unwrap();

    let mut group = c.benchmark_group("throughput");
    group.throughput(Throughput::Elements(1));
    group.bench_function("enqueue_64B_1_reader", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                writer.enqueue(&MESSAGE, TIMEOUT).unwrap();
            }
            start.elapsed()
        })
    });
    group.finish();

    peer.stop(&mut writer);
}

fn machine_load(c: &mut Criterion) {
    let Some(load) = shmq::wait::machine_load() else {
        println!("wait/machine_load: off (SHMQ_LOAD_CHECK=0)");
        return;
    };
    let mut group = c.benchmark_group("wait");
    group.bench_function("machine_load_cached", |b| {
        b.iter(|| black_box(load.full(Instant::now())))
    });
    // A time 5 ms after the last reading's each call: every call reads the file.
    let t0 = Instant::now();
    let mut calls = 0u32;
    group.bench_function("machine_load_read", |b| {
        b.iter(|| {
            calls += 1;
            black_box(load.full(t0 + Duration::from_millis(5) * calls))
        })
    });
    group.finish();
}

fn main() {
    if let Ok(role) = std::env::var(PEER_ENV) {
        if let Err(e) = peer_main(&role) {
            eprintln!("bench peer ({role}): {e}");
            std::process::exit(1);
        }
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    latency(&mut c);
    throughput(&mut c);
    machine_load(&mut c);
    c.final_summary();
}
