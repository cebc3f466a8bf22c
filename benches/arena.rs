//! Tensor-arena benchmarks through the public Rust API, in one process (writer and
//! reader objects side by side, so only the mechanism is timed, not a process switch).
//!
//! - `copy/16MiB/{memcpy,copy_large}`: the copy into shared memory, plain `memcpy`
//!   against `shmq::copy::copy_large` (streaming stores above 2 MiB);
//! - `queue/16MiB/{copied,loaned}`: one message whose 16 MiB part goes through the arena,
//!   from `enqueue(Message::Parts(..))` to the reader dropping the part it got from `dequeue_parts`:
//!   copied in once, or a new loan (one byte written) sent by reference, sealed, and
//!   dropped (given back);
//! - `queue/256MiB/loaned`: the same loaned send at 256 MiB: the cost does not grow with
//!   the size.
//!
//! Run: `cargo bench --bench arena -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use shmq::{Message, QueueOptions, Reader, Writer};

const TIMEOUT: Option<Duration> = Some(Duration::from_secs(30));

fn copies(c: &mut Criterion) {
    let n = 16 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let mut g = c.benchmark_group("copy/16MiB");
    g.throughput(Throughput::Bytes(n as u64));
    g.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    g.bench_function("copy_large", |b| {
        b.iter(|| shmq::copy::copy_large(&mut dst, black_box(&src)))
    });
    g.finish();
}

fn queue(c: &mut Criterion) {
    let mut opts = QueueOptions::local(1);
    opts.max_chunk_bytes = 64 << 10;
    opts.max_chunks = 4;
    let mut writer = Writer::new(opts).unwrap();
    let mut reader = Reader::open(writer.handle(), 0).unwrap();
    for (size, copied) in [(16usize << 20, true), (16 << 20, false), (256 << 20, false)] {
        let body = b"body";
        let data = vec![7u8; size];
        let name = format!("queue/{}MiB", size >> 20);
        let mut g = c.benchmark_group(&name);
        g.throughput(Throughput::Bytes(size as u64));
        let label = if copied { "copied" } else { "loaned" };
        g.bench_function(label, |b| {
            b.iter(|| {
                if copied {
                    writer
                        .enqueue(Message::Parts(&[body, &data]), TIMEOUT)
                        .unwrap();
                } else {
                    // A new loan per send, as a producer takes one: a loan sent once is
                    // sealed, and sending it again would copy.
                    let mut loan = writer.loan(size).expect("room");
                    loan[size - 1] = 7;
                    writer
                        .enqueue(Message::Parts(&[body, &loan]), TIMEOUT)
                        .unwrap();
                }
                let parts = reader.dequeue_parts(TIMEOUT).unwrap();
                black_box(parts[1][size - 1]);
            })
        });
        g.finish();
    }
    assert_eq!(writer.arena_fallbacks(), 0);
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    copies(&mut c);
    queue(&mut c);
    c.final_summary();
}
