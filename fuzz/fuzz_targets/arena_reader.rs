//! The tensor arena's reader (`ArenaReader::view`/`release`) with arbitrary references
//! (`ArenaRef`: lease, generation, offset, length) and a lease table the fuzzer wrote
//! over: a view is an error or exactly the bytes of a range inside the arena's data
//! region, writable and private (a write into it never reaches the segment); nothing
//! panics, crashes or maps outside the segment. Without patches, views of the writer's
//! references show what it copied in.
#![no_main]

use std::sync::Arc;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use shmq::arena::{ArenaReader, ArenaRef, ArenaWriter};
use shmq_fuzz::{apply, touch, Patch};

#[derive(Arbitrary, Debug)]
struct Input {
    n_reader: u8,
    reader: u8,
    /// Parts the writer copies in and publishes: `(len, fill byte)`.
    parts: Vec<(u16, u8)>,
    patches: Vec<Patch>,
    refs: Vec<RefSpec>,
}

#[derive(Arbitrary, Debug)]
enum RefSpec {
    /// One of the writer's references, as sent.
    Real(u8),
    /// One of the writer's references with some fields changed.
    Changed {
        index: u8,
        lease: Option<u32>,
        generation: Option<u32>,
        offset: Option<u64>,
        len: Option<u64>,
    },
    /// Anything at all.
    Forged {
        lease: u32,
        generation: u32,
        offset: u64,
        len: u64,
    },
}

fuzz_target!(|input: Input| {
    let n_reader = 1 + input.n_reader as usize % 3;
    let mut writer = ArenaWriter::create(n_reader, 256 << 10, 8).expect("an arena");
    let mut sent: Vec<(ArenaRef, Vec<u8>)> = Vec::new();
    for &(len, fill) in input.parts.iter().take(8) {
        let bytes = vec![fill; len as usize % 40_000];
        if let Some(r) = writer.copy_in(&bytes, &mut |_| false) {
            writer.publish(&r, 0..n_reader);
            sent.push((r, bytes));
        }
    }
    let reader = input.reader as usize % n_reader;
    let Ok(arena) = ArenaReader::open(writer.name(), reader) else {
        panic!("an intact arena must open");
    };
    let arena = Arc::new(arena);
    // Header, statistics and the queue's name (384 bytes), then the lease records (64
    // bytes each): 8 leases.
    apply(writer.name(), 384 + 64 * 8, &input.patches);
    let patched = !input.patches.is_empty();
    let segment_len = std::fs::metadata(shmq_fuzz::segment_path(writer.name()))
        .unwrap()
        .len();
    for spec in input.refs.iter().take(16) {
        let pick = |i: u8| sent.get(i as usize % sent.len().max(1));
        let (r, expect) = match *spec {
            RefSpec::Real(i) => match pick(i) {
                Some((r, b)) => (*r, Some(b)),
                None => continue,
            },
            RefSpec::Changed {
                index,
                lease,
                generation,
                offset,
                len,
            } => match pick(index) {
                Some((r, _)) => (
                    ArenaRef {
                        lease: lease.unwrap_or(r.lease),
                        generation: generation.unwrap_or(r.generation),
                        offset: offset.unwrap_or(r.offset),
                        len: len.unwrap_or(r.len),
                    },
                    None,
                ),
                None => continue,
            },
            RefSpec::Forged {
                lease,
                generation,
                offset,
                len,
            } => (
                ArenaRef {
                    lease,
                    generation,
                    offset,
                    len,
                },
                None,
            ),
        };
        match arena.view(&r) {
            Ok(mut view) => {
                assert_eq!(view.len() as u64, r.len);
                assert!(r.offset + r.len <= segment_len, "{r:?} past the segment");
                touch(&view);
                if let Some(b) = expect.filter(|_| !patched) {
                    assert_eq!(&view[..], &b[..]);
                }
                if !view.is_empty() {
                    // Private: the write stays in this view. (The data region starts at
                    // the first page after the lease table, which is 384 + 8 * 64 bytes.)
                    let at = shmq::arena::page_size() as u64 + r.offset;
                    let before = shmq_fuzz::read_at(writer.name(), at, 1);
                    view[0] ^= 0xff;
                    assert_eq!(shmq_fuzz::read_at(writer.name(), at, 1), before);
                }
            }
            Err(_) => {
                assert!(
                    patched || expect.is_none(),
                    "a view of a reference as sent failed"
                );
            }
        }
        arena.release(&r);
    }
    drop(arena);
    writer.reclaim();
});
