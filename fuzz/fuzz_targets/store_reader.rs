//! The object store's reader side (`read_object`, `check_object`, `object_reader_count`,
//! `header_at`, `verify`: what `ObjectStorage.get`/`touch` run) with arbitrary addresses,
//! ids, keys and signatures, on a store whose segment the fuzzer wrote over: its header,
//! the published state, the signing secret, block headers, reader counts and object
//! frames, before the reader opens it and again *while* a read uses the object (as the
//! writer reusing the block, or any process that can write the segment, could). Every
//! call is a value or an error, never a panic, a crash or a read outside the ring.
//! Without patches, every live object reads back as it was put, and its signature holds.
#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use shmq::storage::{
    check_object, object_reader_count, read_object, read_object_viewed, BlockFifo, ObjectStore,
    PartView,
};
use shmq_fuzz::{apply, read_at, touch, write_at, Patch};

/// Where the published state's sequence word is (see `storage`'s layout).
const PUBLISHED_SEQ: u64 = 64;
/// Where the ring starts in the segment.
const RING_OFFSET: u64 = 4096;

#[derive(Arbitrary, Debug)]
struct Input {
    capacity: u16,
    n_readers: u8,
    ops: Vec<Op>,
    patches: Vec<Patch>,
    during: Vec<Patch>,
    reads: Vec<Read>,
}

/// What the writer does before the reader reads.
#[derive(Arbitrary, Debug)]
enum Op {
    /// Put key `k{key}` made of parts `(len, fill byte)`.
    Put {
        key: u8,
        parts: Vec<(u8, u8)>,
        align_from: u8,
    },
    /// A raw allocation through the ring's own API (not an object).
    Allocate(u8),
    /// Count one read of key `k{key}`, as a reader's get does.
    Read(u8),
    GetCached(u8),
    FreeUnused,
    Clear,
}

#[derive(Arbitrary, Debug)]
enum Read {
    /// Key `k{key}`'s handle, as the writer gave it out; with `views`, its parts are
    /// mapped privately and kept after the read (what a zero-copy `get` returns).
    Real { key: u8, count: bool, views: bool },
    /// A handle near key `k{key}`'s.
    Near { key: u8, address: i16, id: i8 },
    /// Anything at all, with any key and signature.
    Forged {
        address: u64,
        id: u32,
        key: String,
        signature: Vec<u8>,
    },
}

/// Keep the published sequence word even: an odd one (an update under way) makes every
/// reader call wait for the store's patience (1 s) before it gives up, by design (a
/// writer that died mid-update). Tested in the unit tests; here it would only slow the
/// fuzzer down.
fn keep_seq_even(name: &str) {
    let b = read_at(name, PUBLISHED_SEQ, 1)[0];
    if b % 2 == 1 {
        write_at(name, PUBLISHED_SEQ, &[b ^ 1]);
    }
}

fn parts_of(spec: &[(u8, u8)]) -> Vec<Vec<u8>> {
    spec.iter()
        .take(5)
        .map(|&(len, fill)| vec![fill; len as usize])
        .collect()
}

fuzz_target!(|input: Input| {
    let capacity = 64 + input.capacity as u64 % 8192;
    let n_readers = 1 + input.n_readers as u32 % 3;
    let mut ring = BlockFifo::create(capacity, None).expect("a store");
    let mut store = ObjectStore::new(capacity, n_readers).expect("a store");
    let seg = ring.segment().clone();
    let name = seg.name().to_owned();
    let mut put: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
    for op in input.ops.iter().take(24) {
        match op {
            Op::Put {
                key,
                parts,
                align_from,
            } => {
                let key = format!("k{key}");
                let parts = parts_of(parts);
                let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
                if store
                    .put(&mut ring, &key, &refs, *align_from as usize % 6)
                    .is_ok()
                {
                    put.insert(key, parts);
                }
            }
            Op::Allocate(n) => {
                let _ = ring.allocate(1 + *n as u64);
            }
            Op::Read(key) => {
                if let Some(e) = store.entry(&format!("k{key}")).copied() {
                    read_object(&seg, e.address, e.id, true, |_| ()).expect("a live object");
                }
            }
            Op::GetCached(key) => {
                let _ = store.get_cached(&seg, &format!("k{key}"));
            }
            Op::FreeUnused => {
                store.free_unused(&mut ring).expect("free_unused");
            }
            Op::Clear => store.clear(&mut ring).expect("clear"),
        }
    }
    let patched = !input.patches.is_empty() || !input.during.is_empty();
    // The header page (header, published state, secret), then the first blocks.
    apply(&name, RING_OFFSET + 256, &input.patches);
    keep_seq_even(&name);
    let Ok(reader) = BlockFifo::open(&name, None) else {
        assert!(patched, "a reader of an intact store must open");
        return;
    };
    let rseg = reader.segment();
    for read in input.reads.iter().take(16) {
        let (address, id, key, signature, expect) = match read {
            Read::Real { key, .. } | Read::Near { key, .. } => {
                let key = format!("k{key}");
                let Some(e) = store.entry(&key).copied() else {
                    continue;
                };
                let signature = store.signature(&seg, &key).unwrap().to_vec();
                match read {
                    Read::Near {
                        address, id: did, ..
                    } => (
                        e.address.wrapping_add_signed(*address as i64),
                        e.id.wrapping_add_signed(*did as i32),
                        key,
                        signature,
                        None,
                    ),
                    _ => (e.address, e.id, key.clone(), signature, put.get(&key)),
                }
            }
            Read::Forged {
                address,
                id,
                key,
                signature,
            } => (*address, *id, key.clone(), signature.clone(), None),
        };
        let count = matches!(read, Read::Real { count: true, .. });
        let verified = rseg.verify(&key, address, id, &signature);
        if expect.is_some() && !patched {
            if let Err(e) = &verified {
                panic!("the writer's signature was refused: {e}");
            }
        }
        if matches!(read, Read::Forged { .. }) && signature[..] != seg.sign(&key, address, id) {
            assert!(verified.is_err(), "a forged signature verified");
        }
        let views = matches!(read, Read::Real { views: true, .. });
        let mut kept: Vec<PartView> = Vec::new();
        let got = read_object_viewed(rseg, address, id, count, |view, mapper| {
            apply(&name, RING_OFFSET + capacity, &input.during);
            keep_seq_even(&name);
            let parts: Vec<Vec<u8>> = (0..view.len()).map(|k| view.part(k).to_vec()).collect();
            touch(view.span());
            if views {
                for k in 0..view.len() {
                    if let Ok(Some(v)) = mapper.map(view, k) {
                        kept.push(v);
                    }
                }
            }
            parts
        });
        for v in &kept {
            touch(v);
        }
        if let (Ok(parts), false) = (&got, patched) {
            // Unpatched, a view shows what the read copied.
            if kept.len() == parts.len() {
                for (v, p) in kept.iter().zip(parts) {
                    assert_eq!(&v[..], &p[..]);
                }
            }
        }
        drop(kept);
        match (got, expect) {
            (Ok(parts), Some(want)) if !patched => assert_eq!(&parts, want),
            (Err(e), Some(_)) if !patched => panic!("a live object did not read: {e}"),
            _ => {}
        }
        let _ = check_object(rseg, address, id);
        let _ = object_reader_count(rseg, address, id);
        if let Ok(h) = rseg.header_at(address) {
            // What `access_buf` hands out: the block's data, inside the ring.
            assert!(h.offset + h.size as u64 <= capacity);
            let (p, n) = rseg.data_ptr(&h);
            // SAFETY: `header_at` checked that the block lies inside the ring, which
            // `reader` keeps mapped. Only this thread writes the segment (through its
            // file), and not while this slice lives.
            touch(unsafe { std::slice::from_raw_parts(p, n) });
        }
    }
    // The writer goes on over whatever was written into its segment.
    store.free_unused(&mut ring).expect("free_unused");
    let _ = store.put(&mut ring, "after", &[b"x"], 1);
    drop(reader);
});
