//! What a sent loan costs its writer against what copying the same bytes costs: the
//! basis of `shmq_core::arena::LOAN_SEAL_MIN`, below which a queue copies a loaned part
//! instead of sealing its loan.
//!
//! - `seal/{size}/seal+unseal`: `LoanPages::seal` then `unseal` of a filled (populated)
//!   shared range, what a loaned send and the loan's drop cost (four mapping calls: a
//!   reservation, the page tables moved aside, a private mapping, the move back);
//! - `seal/{size}/copy`: the same bytes copied into shared memory from a private buffer
//!   (`copy::copy_large`), what sending them by copy costs instead (the source filled
//!   once, before the clock, so it is as warm as a just-filled loan);
//! - the `busy thread` variants: the same with a second thread of the process running on
//!   another core (a host program's), which every mapping call's TLB flush must reach.
//!
//! Run: `cargo bench -p shmq-os --bench seal -- --warm-up-time 1 --measurement-time 3`.

use shmq_protocol::sync::local::{AtomicBool, Ordering};
use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput};
use shmq_os::segment::{unique_name, LoanPages, Segment};

const SIZES: [usize; 4] = [256 << 10, 1 << 20, 2 << 20, 16 << 20];

fn size_name(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{}MiB", n >> 20)
    } else {
        format!("{}KiB", n >> 10)
    }
}

fn seal_or_copy(c: &mut Criterion, busy: bool) {
    // A thread of this process that keeps running (and so keeps the process's memory
    // map live on its core), as a host program's worker thread would.
    let stop = Arc::new(AtomicBool::new(false));
    let spinner = busy.then(|| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            // Relaxed: a flag read until it turns; nothing is published with it.
            while !stop.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        })
    });
    let suffix = if busy { ", busy thread" } else { "" };
    for size in SIZES {
        let seg = Segment::create(&unique_name("bench"), 2 * size).expect("a segment");
        let src = vec![3u8; size];
        // SAFETY: the first `size` bytes of this process's own 2 * size mapping, written
        // by this thread only; nothing else maps the segment.
        let loan = unsafe { std::slice::from_raw_parts_mut(seg.as_ptr(), size) };
        loan.fill(1); // populated, as a filled loan is
                      // SAFETY: the second half of the same mapping, this thread only.
        let dst = unsafe { std::slice::from_raw_parts_mut(seg.as_ptr().add(size), size) };
        let pages = LoanPages::new(seg.as_ptr(), size);
        let mut g = c.benchmark_group(format!("seal/{}", size_name(size)));
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(format!("seal+unseal{suffix}"), |b| {
            b.iter(|| {
                assert!(pages.seal(&seg) && pages.unseal(&seg));
            })
        });
        g.bench_function(format!("copy{suffix}"), |b| {
            b.iter(|| shmq_os::copy::copy_large(dst, black_box(&src)))
        });
        g.finish();
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = spinner {
        t.join().expect("the spinner");
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    seal_or_copy(&mut c, false);
    seal_or_copy(&mut c, true);
    c.final_summary();
}
