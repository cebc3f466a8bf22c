//! Object-store benchmarks (`cargo bench --bench alloc`).
//!
//! - `alloc+free/fixed`: allocate a 1 KiB block and free the oldest, in a 1 MiB ring
//!   kept about half full: the steady state of a cache that evicts as it goes. One
//!   iteration is one allocate plus one free; the figure is per pair.
//! - `alloc+free/random`: the same with sizes drawn from 64 B .. 64 KiB (xorshift).
//! - `store/put+get`: an `ObjectStore` put of a 135-byte payload (the size of the
//!   engines' small scheduler object) and a counted read of it, evicting as it goes.
//! - `store/sign+verify`: the HMAC-SHA256 of a handle and its constant-time check, what
//!   a put's `get_signature` and a reader's get add.
//! - `store/read 4MiB`: a counted read of a 4 MiB object, copying it out (throughput).
//! - `store/put 4MiB`: a put of a 4 MiB object (its bytes 64-byte aligned in the ring).
//!
//! vLLM's Python allocator takes ~3.7 µs per alloc+free on the reference machine; the
//! target here is <= 20 ns.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use shmq::alloc::FifoAllocator;
use shmq::storage::{read_object, BlockFifo, ObjectStore};
use std::hint::black_box;

struct XorShift(u64);
impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn allocator(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc+free");
    g.throughput(Throughput::Elements(1));
    g.bench_function("fixed", |b| {
        let mut a = FifoAllocator::new(1 << 20).unwrap();
        for _ in 0..400 {
            a.allocate(1024).unwrap();
        }
        b.iter(|| {
            let c = a.allocate(black_box(1024)).unwrap();
            a.free_while(1, |_| true);
            black_box(c)
        })
    });
    g.bench_function("random", |b| {
        let mut a = FifoAllocator::new(64 << 20).unwrap();
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let mut size = || 64 + rng.next() % (64 << 10);
        for _ in 0..900 {
            a.allocate(size()).unwrap();
        }
        b.iter(|| {
            let n = size();
            let c = loop {
                match a.allocate(n) {
                    Ok(c) => break c,
                    Err(_) => {
                        a.free_while(1, |_| true);
                    }
                }
            };
            a.free_while(1, |_| true);
            black_box(c)
        })
    });
    g.finish();
}

fn store(c: &mut Criterion) {
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Elements(1));
    g.bench_function("put+get 135B", |b| {
        let mut ring = BlockFifo::create(16 << 20, None).unwrap();
        let mut store = ObjectStore::new(1 << 20, 1).unwrap();
        let payload = [7u8; 135];
        let seg = ring.segment().clone();
        let mut n = 0u64;
        let keys: Vec<String> = (0..1 << 16).map(|i| format!("key-{i}")).collect();
        b.iter(|| {
            let key = &keys[(n % keys.len() as u64) as usize];
            n += 1;
            if store.entry(key).is_some() {
                // Lapped the key list: a real cache would hit; bench the miss path.
                store.clear(&mut ring).unwrap();
            }
            let (a, i) = store.put(&mut ring, key, &[&payload], 1).unwrap();
            read_object(&seg, a, i, true, |o| black_box(o.part(0).len())).unwrap()
        })
    });
    g.bench_function("sign+verify", |b| {
        let ring = BlockFifo::create(4096, None).unwrap();
        let seg = ring.segment().clone();
        let mut n = 0u32;
        b.iter(|| {
            n = n.wrapping_add(1);
            let sig = seg.sign(black_box("8f3c0d6e5b7a4c2e9d1f0a3b6c8e7d5f"), 4096, n);
            seg.verify("8f3c0d6e5b7a4c2e9d1f0a3b6c8e7d5f", 4096, n, &sig)
                .unwrap()
        })
    });
    let big = vec![1u8; 4 << 20];
    g.throughput(Throughput::Bytes(big.len() as u64));
    g.bench_function("read 4MiB", |b| {
        let mut ring = BlockFifo::create(64 << 20, None).unwrap();
        let mut store = ObjectStore::new(8 << 20, u32::MAX).unwrap();
        let (a, i) = store.put(&mut ring, "big", &[b"meta", &big], 1).unwrap();
        let seg = ring.segment().clone();
        let mut out = vec![0u8; big.len()];
        b.iter(|| read_object(&seg, a, i, true, |o| out.copy_from_slice(o.part(1))).unwrap())
    });
    g.bench_function("put 4MiB", |b| {
        let mut ring = BlockFifo::create(64 << 20, None).unwrap();
        let mut store = ObjectStore::new(8 << 20, 0).unwrap();
        let mut n = 0u64;
        b.iter_batched(
            || {
                n += 1;
                format!("big-{n}")
            },
            |key| store.put(&mut ring, &key, &[b"meta", &big], 1).unwrap(),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, allocator, store);
criterion_main!(benches);
