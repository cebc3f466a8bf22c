//! Unit tests of the store (one process; the Python tests run real processes).

use super::index::LOAN_ALIGN;
use super::object::{count_one_read, object_layout};
use super::store_segment::{COUNT_WORD_BYTES, INVALID_ID, count_word_at};
use super::*;
use crate::error::{Error, HandleRefusal, OsError, Result, StoreError};
use shmq_protocol::alloc::HEADER_BYTES;
use std::sync::Arc;

fn store(capacity: u64, max: u64, readers: u32) -> (BlockFifo, ObjectStore) {
    (
        BlockFifo::create(capacity, None).unwrap(),
        ObjectStore::new(max, readers).unwrap(),
    )
}

fn read_all(seg: &StoreSegment, a: u64, i: u32, count: bool) -> Result<Vec<Vec<u8>>> {
    read_object(seg, a, i, count, |v| {
        (0..v.len()).map(|k| v.part(k).to_vec()).collect()
    })
}

#[test]
fn put_get_and_errors() {
    let (mut ring, mut s) = store(4096, 1024, 1);
    let (addr, id) = s.put(&mut ring, "a", &[b"meta", b"data"], 2).unwrap();
    let reader = BlockFifo::open(ring.segment().name(), Some(4096)).unwrap();
    let got = read_object(reader.segment(), addr, id, true, |v| v.span().to_vec()).unwrap();
    assert_eq!(got, b"metadata");
    assert_eq!(object_reader_count(reader.segment(), addr, id).unwrap(), 1);
    assert!(matches!(
        s.put(&mut ring, "a", &[b"x"], 1),
        Err(Error::Store(StoreError::KeyExists(_)))
    ));
    let e = s.put(&mut ring, "big", &[&[0u8; 1021]], 1).unwrap_err();
    assert!(e.to_string().contains("exceeds max object size"), "{e}");
    // Free "a": it must not be readable, whatever id is tried.
    ring.free_while(u64::MAX, |i, _| i == id).unwrap();
    for (a, i) in [
        (addr, id),
        (addr, INVALID_ID),
        (addr, id + 1),
        (addr + 8, id),
        (u64::MAX, id),
        (addr + 4096 * 1000 + 64, id),
    ] {
        let e = read_object(reader.segment(), a, i, false, |_| ()).unwrap_err();
        assert!(
            e.to_string().contains("has been modified or is invalid"),
            "{e}"
        );
    }
}

#[test]
fn parts_from_align_from_are_64_byte_aligned_at_every_skew() {
    let (mut ring, mut s) = store(1 << 16, 1 << 15, 1);
    let seg = ring.segment().clone();
    // Odd raw allocations move the next block to every residue mod 64.
    for skew in 0..70u64 {
        let key = format!("k{skew}");
        let parts: [&[u8]; 3] = [b"tree", &[1u8; 100], &[2u8; 3]];
        let (a, i) = s.put(&mut ring, &key, &parts, 1).unwrap();
        let got = read_object(&seg, a, i, true, |v| {
            let base = seg.ring_ptr() as usize;
            for k in 1..3 {
                assert_eq!((v.part(k).as_ptr() as usize - base) % 64, 0);
            }
            (0..v.len()).map(|k| v.part(k).to_vec()).collect::<Vec<_>>()
        })
        .unwrap();
        assert_eq!(got, parts.map(|p| p.to_vec()));
        assert_eq!(object_reader_count(&seg, a, i).unwrap(), 1);
        ring.allocate(1 + skew % 7).unwrap();
        s.free_unused(&mut ring).unwrap();
    }
}

#[test]
fn signatures_bind_key_address_and_id() {
    let (mut ring, mut s) = store(4096, 1024, 1);
    let (a, i) = s.put(&mut ring, "k", &[b"v"], 1).unwrap();
    let seg = ring.segment().clone();
    let sig = s.signature(&seg, "k").unwrap();
    let reader = BlockFifo::open(seg.name(), None).unwrap();
    reader.segment().verify("k", a, i, &sig).unwrap();
    assert_eq!(reader.segment().secret(), seg.secret());
    for (k, a2, i2) in [("k2", a, i), ("k", a + 1, i), ("k", a, i + 1)] {
        assert!(matches!(
            reader.segment().verify(k, a2, i2, &sig),
            Err(Error::Store(StoreError::BadSignature {
                missing: false,
                why: Some(HandleRefusal::Mismatch { .. })
            }))
        ));
    }
    let mut flipped = sig;
    flipped[31] ^= 1;
    assert!(reader.segment().verify("k", a, i, &flipped).is_err());
    assert!(reader.segment().verify("k", a, i, &sig[..31]).is_err());
    s.verify_current(&seg, "k", a, i, &sig).unwrap();
    let refused = s.verify_current(&seg, "k", a + 1, i, &sig).unwrap_err();
    assert_eq!(
        refused.to_string(),
        format!(
            "Invalid SHM handle signature for cache key: the handle (address {}, id {i}) is \
             not this key's current object (address {a}, id {i})",
            a + 1
        )
    );
    assert!(matches!(
        s.verify_current(&seg, "k2", a, i, &sig),
        Err(Error::Store(StoreError::BadSignature {
            why: Some(HandleRefusal::NoEntry),
            ..
        }))
    ));
    assert_eq!(s.current(None).unwrap_err(), HandleRefusal::NoKey);
    // Without a reason, vLLM's sentence alone.
    let bare = |missing| Error::Store(StoreError::BadSignature { missing, why: None }).to_string();
    assert_eq!(bare(true), "Missing SHM handle signature for cache key.");
    assert_eq!(bare(false), "Invalid SHM handle signature for cache key.");
    // A second store has another secret.
    let (other, _) = store(4096, 1024, 1);
    assert_ne!(other.segment().secret(), seg.secret());
}

#[test]
fn eviction_waits_for_every_handout_and_touch() {
    let (mut ring, mut s) = store(512, 200, 2);
    let (a, i) = s.put(&mut ring, "k", &[&[1u8; 150]], 1).unwrap();
    s.get_cached(ring.segment(), "k").unwrap().unwrap();
    let seg = ring.segment().clone();
    for _ in 0..3 {
        read_all(&seg, a, i, true).unwrap();
    }
    // 3 reads of 2 readers x 2 handouts: still in use.
    assert_eq!(s.free_unused(&mut ring).unwrap().count, 0);
    s.put(&mut ring, "k2", &[&[2u8; 150]], 1).unwrap();
    assert!(matches!(
        s.put(&mut ring, "k3", &[&[3u8; 150]], 1),
        Err(Error::Store(StoreError::Full(_)))
    ));
    read_all(&seg, a, i, true).unwrap();
    s.touch("k");
    assert_eq!(s.free_unused(&mut ring).unwrap().count, 0);
    s.release_touches();
    // Now fully read: the full ring frees it and k3 fits.
    s.put(&mut ring, "k3", &[&[3u8; 150]], 1).unwrap();
    assert!(s.entry("k").is_none());
    assert!(read_object(&seg, a, i, false, |_| ()).is_err());
}

#[test]
fn a_private_view_keeps_its_object_from_eviction_and_clear() {
    let (mut ring, mut s) = store(3 * 8192, 9000, 1);
    let (a, i) = s.put(&mut ring, "a", &[b"head", &[7u8; 8000]], 1).unwrap();
    s.put(&mut ring, "b", &[b"head", &[8u8; 8000]], 1).unwrap();
    let seg = ring.segment().clone();
    let mut view = read_object_viewed(&seg, a, i, true, |object, views| views.map(object, 1))
        .unwrap()
        .unwrap()
        .expect("a live object can be viewed");
    assert_eq!(&view[..], &[7u8; 8000][..]);
    // Read (its count says free) but viewed: neither eviction nor clear reuses it.
    assert_eq!(s.free_unused(&mut ring).unwrap().count, 0);
    s.clear(&mut ring).unwrap();
    assert!(s.is_empty());
    s.put(&mut ring, "c", &[b"head", &[9u8; 8000]], 1).unwrap();
    assert!(matches!(
        s.put(&mut ring, "d", &[b"head", &[1u8; 8000]], 1),
        Err(Error::Store(StoreError::Full(_)))
    ));
    assert_eq!(&view[..], &[7u8; 8000][..]);
    // A write into the view is private to it.
    view.map[0] = 42;
    assert_eq!(read_all(&seg, a, i, false).unwrap()[1][0], 7);
    drop(view);
    s.put(&mut ring, "d", &[b"head", &[1u8; 8000]], 1).unwrap();
    assert!(read_object(&seg, a, i, false, |_| ()).is_err());
}

#[test]
fn a_loan_is_put_in_place_and_stays_until_dropped() {
    let (mut ring, mut s) = store(3 * 80_000, 75_000, 1);
    let mut loan = s.loan(&mut ring, 8000).unwrap();
    loan.fill(5);
    let (a, i) = s.put(&mut ring, "a", &[b"stream", &loan], 1).unwrap();
    let seg = ring.segment().clone();
    let parts = read_all(&seg, a, i, true).unwrap();
    assert_eq!(parts, vec![b"stream".to_vec(), vec![5u8; 8000]]);
    // The part is the loaned memory itself.
    read_object(&seg, a, i, false, |v| {
        assert_eq!(v.part(1).as_ptr(), loan.as_ptr())
    })
    .unwrap();
    // Read by every reader, but the loan still pins it.
    assert_eq!(s.free_unused(&mut ring).unwrap().count, 0);
    drop(loan);
    assert_eq!(s.free_unused(&mut ring).unwrap().count, 1);
    // A loan put twice, or with too much around it, is copied.
    let loan = s.loan(&mut ring, 100).unwrap();
    let (b, j) = s.put(&mut ring, "b", &[b"x", &loan], 1).unwrap();
    let (c, k) = s.put(&mut ring, "c", &[b"x", &loan], 1).unwrap();
    assert_ne!((b, j), (c, k));
    let big = vec![1u8; (LOAN_ROOM + LOAN_ALIGN) as usize];
    let loan2 = s.loan(&mut ring, 100).unwrap();
    let (d, l) = s
        .put(&mut ring, "d", &[&big[..100], &big, &loan2], 1)
        .unwrap();
    read_object(&seg, d, l, false, |v| {
        assert_ne!(v.part(2).as_ptr(), loan2.as_ptr())
    })
    .unwrap();
    drop((loan, loan2));
}

#[test]
fn a_cleared_object_is_read_but_not_viewed() {
    let (mut ring, mut s) = store(3 * 8192, 9000, 1);
    let (a, i) = s.put(&mut ring, "a", &[b"head", &[7u8; 8000]], 1).unwrap();
    s.clear(&mut ring).unwrap();
    let seg = ring.segment().clone();
    let viewed = read_object_viewed(&seg, a, i, true, |object, views| {
        (
            views.map(object, 1).unwrap().is_some(),
            object.part(1).to_vec(),
        )
    })
    .unwrap();
    assert_eq!(viewed, (false, vec![7u8; 8000]));
}

#[test]
fn readers_cannot_write() {
    let (ring, _) = store(1024, 100, 1);
    let mut reader = BlockFifo::open(ring.segment().name(), None).unwrap();
    assert!(matches!(reader.allocate(10), Err(Error::WrongRole(_))));
    assert!(matches!(reader.clear(), Err(Error::WrongRole(_))));
    assert!(BlockFifo::open(ring.segment().name(), Some(999)).is_err());
}

#[test]
fn cleared_objects_stay_readable_until_overwritten() {
    let (mut ring, mut s) = store(1024, 300, 1);
    let seg = ring.segment().clone();
    let (a0, i0) = s.put(&mut ring, "k0", &[&[7u8; 100]], 1).unwrap();
    let (a1, i1) = s.put(&mut ring, "k1", &[&[8u8; 100]], 1).unwrap();
    s.clear(&mut ring).unwrap();
    assert_eq!(read_all(&seg, a0, i0, false).unwrap(), vec![vec![7u8; 100]]);
    assert_eq!(read_all(&seg, a1, i1, false).unwrap(), vec![vec![8u8; 100]]);
    // A small object overwrites the start of k0 only.
    let (a2, i2) = s.put(&mut ring, "k2", &[b"x"], 1).unwrap();
    assert_eq!((a2, i2), (0, 2));
    assert!(read_object(&seg, a0, i0, false, |_| ()).is_err());
    assert_eq!(read_all(&seg, a1, i1, false).unwrap(), vec![vec![8u8; 100]]);
    // Enough to cover k1: it goes too, and the cleared range is dropped.
    s.put(&mut ring, "k3", &[&[9u8; 250]], 1).unwrap();
    assert!(read_object(&seg, a1, i1, false, |_| ()).is_err());
    assert_eq!(
        seg.snapshot().unwrap().cleared_start,
        seg.snapshot().unwrap().cleared_end
    );
    // A second clear forgets what the first one kept.
    s.clear(&mut ring).unwrap();
    assert!(read_object(&seg, a1, i1, false, |_| ()).is_err());
    assert_eq!(read_all(&seg, a2, i2, false).unwrap(), vec![b"x".to_vec()]);
}

#[test]
fn a_stale_header_inside_new_data_is_refused() {
    // An old handle whose header position now lies inside a new object's bytes, which
    // hold exactly the old header: the published id range refuses it.
    let (mut ring, mut s) = store(256, 250, 1);
    let seg = ring.segment().clone();
    let (a, i) = s.put(&mut ring, "old", &[b"o"], 1).unwrap();
    read_all(&seg, a, i, true).unwrap();
    s.free_unused(&mut ring).unwrap();
    let mut forged = vec![0u8; 200];
    for k in [0usize, 13, 40, 81, 150] {
        forged[k..k + 4].copy_from_slice(&i.to_le_bytes());
        forged[k + 4..k + 8].copy_from_slice(&40u32.to_le_bytes());
    }
    s.put(&mut ring, "new", &[&forged], 1).unwrap();
    for off in 0..200 {
        assert!(read_object(&seg, off, i, false, |_| ()).is_err());
    }
}

#[test]
fn a_frame_changed_during_a_read_is_an_error_not_a_panic() {
    // A reader is using object "a" when the writer clears the store and puts a larger
    // object in the same place: the frame the reader checked now describes parts
    // beyond the old block. Reading the parts again must not panic (it did: a slice
    // index out of range), and the read is reported as modified.
    let (mut ring, mut s) = store(4096, 2048, 1);
    let seg = ring.segment().clone();
    let (a, i) = s.put(&mut ring, "a", &[b"m", b"tiny"], 1).unwrap();
    let got = read_object(&seg, a, i, true, |v| {
        s.clear(&mut ring).unwrap();
        s.put(&mut ring, "b", &[&[1u8; 300], &[2u8; 900]], 1)
            .unwrap();
        (0..v.len()).map(|k| v.part(k).len()).sum::<usize>() + v.span().len()
    });
    assert!(
        matches!(got, Err(Error::Store(StoreError::StaleObject { .. }))),
        "{got:?}"
    );
    // A frame scribbled over by another process: parts come out clamped to nothing.
    let (a, i) = s.put(&mut ring, "c", &[b"meta", b"data"], 1).unwrap();
    let data_at = a % 4096 + HEADER_BYTES;
    let entry0 = (data_at + count_word_at(data_at) + COUNT_WORD_BYTES + 4) as usize;
    let lens = read_object(&seg, a, i, false, |v| {
        // SAFETY: inside the ring (the frame's first entry); a test stands in for a
        // peer process writing the segment.
        unsafe {
            std::ptr::copy_nonoverlapping([0xffu8; 8].as_ptr(), seg.ring_ptr().add(entry0), 8)
        };
        (v.part(0).len(), v.span().len())
    })
    .unwrap();
    assert_eq!(lens, (0, 0));
}

#[test]
fn layout_pads_inside_the_object() {
    let mut at = Vec::new();
    let end = object_layout(9, [5u64, 70, 1].into_iter(), 3, 0, 1, |i, off| {
        at.push((i, off))
    });
    // data at ring offset 9: count word at +7 (offset 16, 8 bytes), frame n + 3 entries
    // = 28 bytes, part 0 at +43, part 1 at ring offset 64 (+55), part 2 at 192 (+183).
    assert_eq!(at, vec![(0, 43), (1, 55), (2, 183)]);
    assert_eq!(end, 184);
}

/// A reader that checked its object, then stalled past the writer's patience while the
/// writer freed and reused the block, must not count into what is there now: neither
/// the next object's count (same address after a `clear()`) nor its payload.
#[test]
fn a_stalled_reader_never_counts_into_the_next_object() {
    let (mut ring, mut s) = store(4096, 4096, 1);
    let seg = ring.segment().clone();
    let word_at = |h: &BlockHeader| {
        let data = h.offset + HEADER_BYTES;
        data + count_word_at(data)
    };
    // Counted while live.
    let (a, i) = s.put(&mut ring, "a", &[b"meta", &[7u8; 100]], 1).unwrap();
    let ha = seg.header_at(a).unwrap();
    assert!(count_one_read(&seg, &ha, None));
    assert_eq!(object_reader_count(&seg, a, i).unwrap(), 1);
    // The same address, the next object: its count is not touched.
    s.clear(&mut ring).unwrap();
    let (b, j) = s.put(&mut ring, "b", &[b"meta", &[9u8; 100]], 1).unwrap();
    assert_eq!(b, a);
    assert!(!count_one_read(&seg, &ha, None));
    assert_eq!(object_reader_count(&seg, b, j).unwrap(), 0);
    // An object placed after another, then its memory covered by another object's
    // payload: the payload is not touched.
    for fill in [0u8, 0xff, 3] {
        s.clear(&mut ring).unwrap();
        s.put(&mut ring, "x", &[b"m", &[1u8; 200]], 1).unwrap();
        let (c, _) = s.put(&mut ring, "c", &[b"m", &[3u8; 50]], 1).unwrap();
        let hc = seg.header_at(c).unwrap();
        s.clear(&mut ring).unwrap();
        let (d, k) = s.put(&mut ring, "d", &[b"m", &[fill; 1024]], 0).unwrap();
        let hd = seg.header_at(d).unwrap();
        assert!(hd.offset + 64 < word_at(&hc) && word_at(&hc) + 8 < hd.offset + 1000);
        assert!(!count_one_read(&seg, &hc, None));
        assert_eq!(read_all(&seg, d, k, false).unwrap()[1], vec![fill; 1024]);
    }
}

/// A reader killed between announcing its increment and making it leaves `counting` > 0
/// for good: the writer waits one patience for it, then takes it as the floor (later
/// frees do not wait for it again), and lowers the floor once `counting` is below it.
/// `counting_floor()` is (floor, waits that ran out of patience).
#[test]
fn a_reader_dead_in_its_counting_window_is_waited_for_once() {
    let (mut ring, mut s) = store(4096, 4096, 1);
    let seg = ring.segment().clone();
    let mut put_and_free = |key: &str| {
        s.put(&mut ring, key, &[b"m", &[1u8; 10]], 1).unwrap();
        let freed = ring.free_while(u64::MAX, |_, _| true).unwrap();
        assert_eq!(freed.count, 1);
    };
    put_and_free("a");
    assert_eq!(seg.counting_floor(), (0, 0));
    // The announcement of a reader that then died (inside its window: the rest of the
    // test runs there).
    seg.counting().count(|| {
        put_and_free("b");
        assert_eq!(seg.counting_floor(), (1, 1));
        // Not waited for again.
        put_and_free("c");
        assert_eq!(seg.counting_floor(), (1, 1));
    });
    // It was alive after all, and made its increment (or a peer wrote the word).
    put_and_free("d");
    assert_eq!(seg.counting_floor(), (0, 1));
}

#[test]
fn the_ring_is_reserved_in_dev_shm_as_it_is_used() {
    use std::os::unix::fs::MetadataExt;
    let (mut ring, mut s) = store(256 << 20, 64 << 20, 1);
    let allocated = |ring: &BlockFifo| {
        std::fs::metadata(format!("/dev/shm/{}", ring.segment().name()))
            .unwrap()
            .blocks()
            * 512
    };
    assert!(allocated(&ring) <= 4096, "{}", allocated(&ring));
    for i in 0..100 {
        s.put(&mut ring, &format!("k{i}"), &[b"small"], 1).unwrap();
    }
    assert_eq!(ring.reserved(), fifo::RESERVE_STEP);
    assert!(
        allocated(&ring) <= 4096 + fifo::RESERVE_STEP,
        "{}",
        allocated(&ring)
    );
    let big = vec![3u8; 3 << 20];
    let (a, i) = s.put(&mut ring, "big", &[&big], 1).unwrap();
    let end = ring.allocator().unwrap().end();
    assert!(ring.reserved() >= end && ring.reserved() <= end + fifo::RESERVE_STEP);
    assert_eq!(
        read_all(ring.segment(), a, i, false).unwrap(),
        vec![big.clone()]
    );
    // The whole-ring view (`shared_memory.buf`) reserves all of it first, in a reader
    // too; what was stored stays as it was.
    let reader = BlockFifo::open(ring.segment().name(), Some(256 << 20)).unwrap();
    let (p, n) = reader.segment().ring_bytes().unwrap();
    assert_eq!((p, n), (reader.segment().ring_ptr(), 256 << 20));
    assert!(allocated(&ring) >= 256 << 20, "{}", allocated(&ring));
    assert_eq!(read_all(ring.segment(), a, i, false).unwrap(), vec![big]);
}

#[test]
fn free_oldest_first_frees_only_what_was_approved_and_still_the_oldest() {
    // What a Python `free_buf` does: ask about a block with the ring not borrowed (the
    // caller may use the ring meanwhile), then free it if it is still the oldest.
    let mut ring = BlockFifo::create(4096, None).unwrap();
    let ids: Vec<u32> = (0..6).map(|_| ring.allocate(10).unwrap().id).collect();
    let mut run = FreeOldestFirst::new(&ring, u64::MAX).unwrap();
    let c0 = run.next(&ring).unwrap().unwrap();
    assert_eq!(c0.id, ids[0]);
    assert!(run.free(&mut ring, &c0).unwrap());
    // Between the question and the free, something else frees the block asked about:
    // it is not freed twice, and the next oldest is not freed unasked.
    let c1 = run.next(&ring).unwrap().unwrap();
    ring.free_while(u64::MAX, |id, _| id == c1.id).unwrap();
    assert_eq!(ring.free_oldest(&c1).unwrap(), FreeOldest::NotOldest);
    assert!(
        run.free(&mut ring, &c1).unwrap(),
        "goes on with the next oldest"
    );
    assert_eq!(ring.allocator().unwrap().id_start(), ids[2]);
    let c2 = run.next(&ring).unwrap().unwrap();
    assert_eq!(c2.id, ids[2]);
    assert!(run.free(&mut ring, &c2).unwrap());
    // A block allocated after the start is never asked about.
    let later = ring.allocate(10).unwrap();
    for &id in &ids[3..] {
        let c = run.next(&ring).unwrap().unwrap();
        assert_eq!(c.id, id);
        assert!(run.free(&mut ring, &c).unwrap());
    }
    assert_eq!(run.next(&ring).unwrap(), None);
    assert_eq!(ring.allocator().unwrap().oldest(), Some(&later));
    // Something freed between two of its frees: the ids are not consecutive.
    assert_eq!(run.freed_ids(), &[ids[0], ids[2], ids[3], ids[4], ids[5]]);
    assert_eq!(run.consecutive(), None);

    // Cleared meanwhile: nothing is left from the start.
    let mut run = FreeOldestFirst::new(&ring, u64::MAX).unwrap();
    let c = run.next(&ring).unwrap().unwrap();
    ring.clear().unwrap();
    assert!(run.free(&mut ring, &c).unwrap());
    assert_eq!(run.next(&ring).unwrap(), None);
    let none = run.consecutive().unwrap();
    assert_eq!((none.first_id, none.count, none.bytes), (later.id, 0, 0));

    // nbytes: stops once reached; the ids are consecutive.
    let ids: Vec<u32> = (0..3).map(|_| ring.allocate(10).unwrap().id).collect();
    let mut run = FreeOldestFirst::new(&ring, 1).unwrap();
    let c = run.next(&ring).unwrap().unwrap();
    assert!(run.free(&mut ring, &c).unwrap());
    assert_eq!(run.next(&ring).unwrap(), None);
    let freed = run.consecutive().unwrap();
    assert_eq!((freed.first_id, freed.count, freed.bytes), (ids[0], 1, 18));

    // A reader's ring frees nothing.
    let reader = BlockFifo::open(ring.segment().name(), None).unwrap();
    assert!(matches!(
        FreeOldestFirst::new(&reader, u64::MAX),
        Err(Error::WrongRole(_))
    ));
}

#[test]
fn free_oldest_keeps_a_viewed_block() {
    let (mut ring, mut s) = store(3 * 8192, 9000, 1);
    let (a, i) = s.put(&mut ring, "a", &[b"head", &[7u8; 8000]], 1).unwrap();
    let seg = ring.segment().clone();
    let view = read_object_viewed(&seg, a, i, true, |object, views| views.map(object, 1))
        .unwrap()
        .unwrap()
        .expect("a live object can be viewed");
    let mut run = FreeOldestFirst::new(&ring, u64::MAX).unwrap();
    let c = run.next(&ring).unwrap().unwrap();
    assert_eq!(ring.free_oldest(&c).unwrap(), FreeOldest::Pinned);
    assert!(!run.free(&mut ring, &c).unwrap(), "stops at a pinned block");
    // Not stamped: still readable.
    assert_eq!(read_all(&seg, a, i, false).unwrap()[1], vec![7u8; 8000]);
    drop(view);
    assert!(run.free(&mut ring, &c).unwrap());
    assert!(read_object(&seg, a, i, false, |_| ()).is_err());
}

/// Parts kept beyond a read, as [`ObjectViews::kept_parts`] gives them: views (with their
/// bytes) or copies.
fn kept(
    seg: &Arc<StoreSegment>,
    a: u64,
    i: u32,
    view_from: usize,
) -> Vec<(bool, Vec<u8>, Option<PartView>)> {
    read_object_viewed(seg, a, i, true, |object, views| {
        views
            .kept_parts(object, view_from)
            .map(|p| match p.unwrap() {
                KeptPart::View(v) => (true, v.to_vec(), Some(v)),
                KeptPart::Copy(bytes) => (false, bytes.to_vec(), None),
            })
            .collect()
    })
    .unwrap()
}

#[test]
fn kept_parts_views_from_the_threshold_and_copies_below() {
    let (mut ring, mut s) = store(4 * 16384, 20_000, 1);
    let parts: [&[u8]; 4] = [b"head", &[7u8; 8000], &[3u8; 100], &[5u8; 4096]];
    let (a, i) = s.put(&mut ring, "a", &parts, 1).unwrap();
    let seg = ring.segment().clone();
    let got = kept(&seg, a, i, 4096);
    // The first part is not among them; the others are in order, 4096 bytes or more
    // viewed, smaller ones copied.
    let shape: Vec<(bool, &[u8])> = got.iter().map(|(v, b, _)| (*v, &b[..])).collect();
    assert_eq!(
        shape,
        vec![(true, parts[1]), (false, parts[2]), (true, parts[3])]
    );
    let views: Vec<PartView> = got.into_iter().filter_map(|(_, _, v)| v).collect();
    assert_eq!(&views[0][..], parts[1]);
    assert_eq!(&views[1][..], parts[3]);
    // Read by its one reader, but viewed: the block is pinned, not freed.
    let run = FreeOldestFirst::new(&ring, u64::MAX).unwrap();
    let c = run.next(&ring).unwrap().unwrap();
    assert_eq!(ring.free_oldest(&c).unwrap(), FreeOldest::Pinned);
    drop(run);
    assert_eq!(s.free_unused(&mut ring).unwrap().count, 0);
    // One view alone still pins it.
    let mut views = views.into_iter();
    drop(views.next());
    assert_eq!(s.free_unused(&mut ring).unwrap().count, 0);
    assert_eq!(read_all(&seg, a, i, false).unwrap()[3], parts[3]);
    drop(views);
    assert_eq!(s.free_unused(&mut ring).unwrap().count, 1);
    assert!(read_object(&seg, a, i, false, |_| ()).is_err());

    // Below every part's size nothing is viewed and nothing pinned.
    let (b, j) = s.put(&mut ring, "b", &parts, 1).unwrap();
    let got = kept(&seg, b, j, 8001);
    assert!(got.iter().all(|(v, _, view)| !v && view.is_none()));
    assert_eq!(got[0].1, parts[1]);
    assert_eq!(s.free_unused(&mut ring).unwrap().count, 1);
}

#[test]
fn kept_parts_of_a_cleared_object_are_copies() {
    let (mut ring, mut s) = store(3 * 8192, 9000, 1);
    let (a, i) = s.put(&mut ring, "a", &[b"head", &[7u8; 8000]], 1).unwrap();
    s.clear(&mut ring).unwrap();
    let seg = ring.segment().clone();
    let got = kept(&seg, a, i, 0);
    assert_eq!(got.len(), 1);
    assert!(!got[0].0 && got[0].2.is_none());
    assert_eq!(got[0].1, vec![7u8; 8000]);
}

#[test]
fn is_free_at_reads_only_memory_of_the_ring() {
    let (mut ring, mut s) = store(4096, 1024, 1);
    let (a, i) = s.put(&mut ring, "k", &[b"v"], 1).unwrap();
    let seg = ring.segment().clone();
    let base = seg.ring_ptr() as usize;
    // Inside the ring: read as the object's count. A put is one hand-out, not read yet.
    let block = base + a as usize;
    assert!(!s.is_free_at(&seg, i, block, 8).unwrap());
    // An id the index does not know has no hand-outs: free, by the count read there.
    assert!(s.is_free_at(&seg, i + 100, block, 8).unwrap());
    // Outside: refused, never read.
    let other = [0u8; 16];
    for (p, n) in [
        (other.as_ptr() as usize, other.len()),
        (base - 1, 8),
        (base + seg.capacity() as usize - 4, 8),
        (base, usize::MAX),
    ] {
        assert!(matches!(
            s.is_free_at(&seg, i, p, n),
            Err(Error::InvalidArgument(_))
        ));
    }
}

#[test]
fn store_roles_apply_vllms_rules() {
    use super::StoreRole;
    let reader = StoreRole {
        is_writer: false,
        count_writer_reads: false,
    };
    let writer = StoreRole {
        is_writer: true,
        count_writer_reads: false,
    };
    let counting_writer = StoreRole {
        is_writer: true,
        count_writer_reads: true,
    };
    // (counts reads, checks signatures, touch protects, checks the current entry)
    let rules = |r: StoreRole| {
        (
            r.counts_reads(),
            r.checks_signatures(),
            r.touch_protects(),
            r.checks_current_entry(),
        )
    };
    assert_eq!(rules(reader), (true, true, false, false));
    assert_eq!(rules(writer), (false, false, true, true));
    assert_eq!(rules(counting_writer), (true, false, false, true));
}

/// A Rust reader's get and touch check the handle's signature in core (issue 58, item 3):
/// no key or signature, a wrong one, one made for another key are refused with the typed
/// error (vLLM's messages) before anything at the address is read; the right one reads.
#[test]
fn a_readers_get_and_touch_check_the_signature() {
    let (mut ring, mut s) = store(4096, 1024, 1);
    let (a, i) = s.put(&mut ring, "k", &[b"meta", b"data"], 2).unwrap();
    let (a2, i2) = s.put(&mut ring, "k2", &[b"other"], 1).unwrap();
    let writer_seg = ring.segment().clone();
    let sig = s.signature(&writer_seg, "k").unwrap();
    let sig_k2 = s.signature(&writer_seg, "k2").unwrap();
    // The same handle signed for another key.
    let other_key = writer_seg.sign("k2", a, i);
    let mut flipped = sig;
    flipped[0] ^= 1;

    let reader_ring = BlockFifo::open(writer_seg.name(), None).unwrap();
    let seg = reader_ring.segment().clone();
    let reader = StoreRole {
        is_writer: false,
        count_writer_reads: false,
    };
    let get = |h: SignedHandle<'_>| read_signed(&seg, reader, h, true, |o| o.span().to_vec());
    let refusal = |r: Result<Vec<u8>>| match r {
        Err(Error::Store(StoreError::BadSignature {
            missing,
            why: Some(why),
        })) => (missing, why),
        other => panic!("expected a refused signature, got {other:?}"),
    };
    // `(a, i)` with this key and signature; `with` gives it another key or signature.
    let right = SignedHandle::new("k", a, i, &sig);
    fn with<'a>(
        h: SignedHandle<'a>,
        key: Option<&'a str>,
        signature: Option<&'a [u8]>,
    ) -> SignedHandle<'a> {
        SignedHandle {
            key,
            signature,
            ..h
        }
    }

    // Nothing given, or one of the two missing: "Missing ...".
    assert_eq!(
        refusal(get(with(right, None, None))),
        (true, HandleRefusal::NoKeyNoSignature)
    );
    assert_eq!(
        refusal(get(with(right, None, Some(&sig)))),
        (true, HandleRefusal::NoKeyForSignature)
    );
    let missing = get(with(right, Some("k"), None)).unwrap_err();
    assert!(matches!(
        missing,
        Error::Store(StoreError::BadSignature {
            missing: true,
            why: Some(HandleRefusal::NoSignature)
        })
    ));
    assert_eq!(
        missing.to_string(),
        "Missing SHM handle signature for cache key: no signature was given; pass the one \
         the writer's get_signature(key) returns"
    );
    // A wrong signature, one made for another key, one for another object: "Invalid ...".
    let mismatch = (false, HandleRefusal::Mismatch { address: a, id: i });
    for wrong in [&flipped, &other_key, &sig_k2] {
        assert_eq!(refusal(get(with(right, Some("k"), Some(wrong)))), mismatch);
    }
    assert_eq!(
        refusal(get(with(right, Some("k"), Some(&sig[..31])))),
        mismatch
    );
    assert_eq!(
        refusal(get(SignedHandle::new("k2", a, i, &sig))),
        (false, HandleRefusal::Mismatch { address: a, id: i })
    );
    assert_eq!(
        get(with(right, Some("k"), Some(&flipped)))
            .unwrap_err()
            .to_string(),
        format!(
            "Invalid SHM handle signature for cache key: the signature does not match this \
             key, address {a} and id {i} (was it made for another key or object, or by \
             another store?)"
        )
    );
    // Refused before the address is looked at: a handle naming no block is refused for its
    // signature, not reported stale; and no refused get counted a read.
    let nowhere = SignedHandle {
        address: u64::MAX,
        ..right
    };
    assert_eq!(
        refusal(get(nowhere)),
        (
            false,
            HandleRefusal::Mismatch {
                address: u64::MAX,
                id: i
            }
        )
    );
    assert_eq!(object_reader_count(&seg, a, i).unwrap(), 0);

    // The right one reads, and counts.
    assert_eq!(
        get(SignedHandle::new("k", a, i, &sig)).unwrap(),
        b"metadata"
    );
    assert_eq!(object_reader_count(&seg, a, i).unwrap(), 1);
    let viewed = read_signed_viewed(
        &seg,
        reader,
        SignedHandle::new("k2", a2, i2, &sig_k2),
        false,
        |o, _| o.part(0).to_vec(),
    );
    assert_eq!(viewed.unwrap(), b"other");
    assert!(matches!(
        read_signed_viewed(&seg, reader, with(right, Some("k"), None), false, |_, _| ()),
        Err(Error::Store(StoreError::BadSignature { missing: true, .. }))
    ));

    // A reader's touch: the same refusals, then that the handle still names its object.
    assert!(matches!(
        check_signed(&seg, with(right, Some("k"), None)),
        Err(Error::Store(StoreError::BadSignature {
            missing: true,
            why: Some(HandleRefusal::NoSignature)
        }))
    ));
    assert!(matches!(
        check_signed(&seg, with(right, Some("k"), Some(&other_key))),
        Err(Error::Store(StoreError::BadSignature {
            missing: false,
            why: Some(HandleRefusal::Mismatch { .. })
        }))
    ));
    check_signed(&seg, SignedHandle::new("k", a, i, &sig)).unwrap();
    // A handle signed for a block that is no object: signed, so only the object check
    // refuses it.
    let bogus_sig = writer_seg.sign("k", a + 1, i);
    assert!(matches!(
        check_signed(&seg, SignedHandle::new("k", a + 1, i, &bogus_sig)),
        Err(Error::Store(StoreError::StaleObject { .. }))
    ));

    // The writer made its handles: its gets check no signature (`checks_signatures`).
    let writer = StoreRole {
        is_writer: true,
        count_writer_reads: false,
    };
    let unsigned = with(right, None, None);
    let got = read_signed(&writer_seg, writer, unsigned, false, |o| o.span().to_vec());
    assert_eq!(got.unwrap(), b"metadata");
}

#[test]
fn a_truncated_store_refuses_puts_and_reports_no_object_cached() {
    // Issue 32: the index is the writer's own memory; the objects it names were lost.
    let (mut ring, mut s) = store(4 << 20, 1 << 20, 1);
    s.put(&mut ring, "a", &[&[1u8; 1000]], 1).unwrap();
    assert!(s.is_cached(ring.segment(), "a").unwrap());
    let name = ring.segment().name().to_owned();
    // A peer truncates the segment's file (through the segment module's own opener).
    use shmq_os::segment_file::{Access, SegmentFile};
    let file = SegmentFile::open(&name, Access::ReadWrite).unwrap();
    file.set_len(4096).unwrap();
    let truncated = |r: Result<()>| match r {
        Err(Error::Os(OsError::BadSegment { name: n, reason })) => {
            n == name && reason.contains("truncated")
        }
        _ => false,
    };
    assert!(truncated(s.is_cached(ring.segment(), "a").map(|_| ())));
    assert!(truncated(s.get_cached(ring.segment(), "a").map(|_| ())));
    // Past what was reserved (the step of the first put): refused before any page is
    // taken, and the file stays short.
    assert!(truncated(
        s.put(&mut ring, "b", &[&[2u8; 3 << 20]], 1).map(|_| ())
    ));
    assert!(truncated(s.put(&mut ring, "c", &[b"small"], 1).map(|_| ())));
    assert_eq!(file.size().unwrap(), 4096);
}

/// Reader slots (`readers`): a reader's reads count in its slot's words; the writer names
/// the reader an object waits for; a dead one fails the put (`Raise`) or is dropped
/// (`Drop`), and its reads then count for nothing; a live or closed one is never dropped.
#[test]
fn reader_slots_tell_the_writer_who_an_object_waits_for() {
    use crate::broadcast::DeadReaderPolicy;
    // Two objects of ~215 bytes fit (2 parts, not aligned: see `object_layout`), not three.
    let (mut ring, mut s) = store(500, 300, 2);
    let seg = ring.segment().clone();
    let (a, b) = (
        ReaderSlot::take(&seg, 2).unwrap().unwrap(),
        ReaderSlot::take(&seg, 2).unwrap().unwrap(),
    );
    assert_eq!((a.index(), b.index()), (0, 1));
    // Every slot held by a live reader: a third one reads anonymously.
    assert!(ReaderSlot::take(&seg, 2).unwrap().is_none());
    let statuses = |s: &ObjectStore| s.readers(&seg).iter().map(|r| r.status).collect::<Vec<_>>();
    let alive = ReaderStatus::Alive { known: true };
    assert_eq!(statuses(&s), [alive, alive]);

    // The frame: two reader words, between the frame word and the part table.
    let (ha, ia) = s.put(&mut ring, "a", &[b"meta", &[1u8; 150]], 2).unwrap();
    let read = |h: (u64, u32), slot: &ReaderSlot| {
        read_object(&seg, h.0, h.1, slot.count(), |v| v.part(1).to_vec()).unwrap()
    };
    assert_eq!(read((ha, ia), &b), [1u8; 150]);
    assert_eq!(object_reader_count(&seg, ha, ia).unwrap(), 1);
    assert_eq!(s.readers(&seg)[1].reads, 1);

    // b dies; "a" waits for a (alive), not b.
    b.die();
    assert_eq!(statuses(&s), [alive, ReaderStatus::Dead]);
    let (hb, ib) = s.put(&mut ring, "b", &[b"meta", &[2u8; 150]], 2).unwrap();
    let e = s
        .put(&mut ring, "c", &[b"meta", &[3u8; 150]], 2)
        .unwrap_err();
    let Error::Store(StoreError::Full(full)) = &e else {
        panic!("{e}")
    };
    let msg = store_full_message(full);
    assert!(
        msg.starts_with("Not enough space in the data buffer ("),
        "{msg}"
    );
    assert!(!msg.contains("free_buf"), "{msg}");
    assert!(msg.contains("reader slot 0 (pid"), "{msg}");
    assert!(msg.contains("alive) has not read it yet"), "{msg}");
    assert!(s.dead_reader().is_none(), "{msg}");

    // a reads "a" ("c" takes its room) and "b": now the oldest is "b", which b (dead)
    // never read.
    assert_eq!(read((ha, ia), &a), [1u8; 150]);
    assert_eq!(read((hb, ib), &a), [2u8; 150]);
    s.put(&mut ring, "c", &[b"meta", &[3u8; 150]], 2).unwrap();
    let e = s
        .put(&mut ring, "d", &[b"meta", &[4u8; 150]], 2)
        .unwrap_err();
    assert_eq!(s.dead_reader().map(|r| r.slot), Some(1), "{e}");
    assert!(e.to_string().contains("died before reading it"), "{e}");
    assert!(s.entry("b").is_some() && s.dropped_readers().is_empty());

    // Drop: b goes; "b" needs a's read alone, which it has.
    s.set_on_dead_reader(DeadReaderPolicy::Drop);
    s.put(&mut ring, "d", &[b"meta", &[4u8; 150]], 2).unwrap();
    assert!(s.dead_reader().is_none());
    assert_eq!(s.dropped_readers(), [1]);
    assert_eq!(statuses(&s), [alive, ReaderStatus::Dropped]);
    assert!(s.entry("b").is_none());
    // a's slot, once a closes, is taken again (left, not dead); so is a dropped one, by a
    // new reader, which objects stored from then on wait for.
    a.leave();
    assert_eq!(statuses(&s), [ReaderStatus::Left, ReaderStatus::Dropped]);
    let c = ReaderSlot::take(&seg, 2).unwrap().unwrap();
    assert_eq!(c.index(), 0);
    let d = ReaderSlot::take(&seg, 2).unwrap().unwrap();
    assert_eq!(d.index(), 1);
    assert_eq!(statuses(&s), [alive, alive]);
    drop((c, d));
}

/// A reader that takes a dropped reader's slot is waited for by the objects stored after
/// it came (not by those before); and reads without a slot (or a dead reader's) never
/// count for a reader that holds its slot.
#[test]
fn a_dropped_slot_serves_a_new_reader_and_nobody_reads_for_a_live_one() {
    use crate::broadcast::DeadReaderPolicy;
    // Three objects of ~250 bytes fit, not four.
    let (mut ring, mut s) = store(800, 300, 2);
    s.set_on_dead_reader(DeadReaderPolicy::Drop);
    let seg = ring.segment().clone();
    let (a, b) = (
        ReaderSlot::take(&seg, 2).unwrap().unwrap(),
        ReaderSlot::take(&seg, 2).unwrap().unwrap(),
    );
    let read = |h: (u64, u32), count: CountRead| read_object(&seg, h.0, h.1, count, |_| ());
    let old = s.put(&mut ring, "old", &[&[1u8; 200]], 1).unwrap();
    read(old, a.count()).unwrap();
    b.die();
    s.put(&mut ring, "two", &[&[2u8; 200]], 1).unwrap();
    s.put(&mut ring, "three", &[&[3u8; 200]], 1).unwrap();
    // "old" goes (a read it; b is dropped); the dead one's slot serves c.
    s.put(&mut ring, "four", &[&[4u8; 200]], 1).unwrap();
    assert_eq!(s.dropped_readers(), [1]);
    let c = ReaderSlot::take(&seg, 2).unwrap().unwrap();
    assert_eq!(c.index(), 1);
    // Objects stored before c came wait for a alone; c's reads (anonymous ones too) never
    // stand in for a's.
    let wanted = s.put(&mut ring, "wanted", &[&[5u8; 200]], 1);
    assert!(wanted.is_err(), "\"two\" waits for a");
    for k in ["two", "three", "four"] {
        let e = *s.entry(k).unwrap();
        read((e.address, e.id), c.count()).unwrap();
        read((e.address, e.id), CountRead::Anonymous).unwrap();
    }
    assert!(s.put(&mut ring, "wanted", &[&[5u8; 200]], 1).is_err());
    assert_eq!(s.dropped_readers(), Vec::<usize>::new());
    let two = *s.entry("two").unwrap();
    read((two.address, two.id), a.count()).unwrap();
    let wanted = s.put(&mut ring, "wanted", &[&[5u8; 200]], 1).unwrap();
    assert!(s.entry("two").is_none());
    // "wanted" waits for c as well as a.
    read(wanted, a.count()).unwrap();
    read(wanted, CountRead::Anonymous).unwrap();
    for k in ["three", "four"] {
        let e = *s.entry(k).unwrap();
        read((e.address, e.id), a.count()).unwrap();
    }
    s.put(&mut ring, "six", &[&[6u8; 200]], 1).unwrap();
    s.put(&mut ring, "seven", &[&[7u8; 200]], 1).unwrap();
    let e = s.put(&mut ring, "eight", &[&[8u8; 200]], 1).unwrap_err();
    assert!(s.entry("wanted").is_some(), "{e}");
    assert!(e.to_string().contains("reader slot 1 (pid"), "{e}");
    read(wanted, c.count()).unwrap();
    s.put(&mut ring, "eight", &[&[8u8; 200]], 1).unwrap();
    assert!(s.entry("wanted").is_none());
}

/// A dead reader's reads count for nothing once it is dropped: an object it read but a
/// live reader has not stays (the dead one's read does not stand in for the live one's).
#[test]
fn a_dropped_readers_reads_do_not_stand_in_for_a_live_one() {
    use crate::broadcast::DeadReaderPolicy;
    // Three objects of ~250 bytes fit, not four.
    let (mut ring, mut s) = store(800, 300, 2);
    s.set_on_dead_reader(DeadReaderPolicy::Drop);
    let seg = ring.segment().clone();
    let (a, b) = (
        ReaderSlot::take(&seg, 2).unwrap().unwrap(),
        ReaderSlot::take(&seg, 2).unwrap().unwrap(),
    );
    let (h, i) = s.put(&mut ring, "first", &[&[1u8; 200]], 1).unwrap();
    read_object(&seg, h, i, b.count(), |_| ()).unwrap();
    b.die();
    s.put(&mut ring, "second", &[&[2u8; 200]], 1).unwrap();
    s.put(&mut ring, "third", &[&[3u8; 200]], 1).unwrap();
    let e = s.put(&mut ring, "fourth", &[&[4u8; 200]], 1).unwrap_err();
    assert_eq!(s.dropped_readers(), [1], "{e}");
    assert!(s.entry("first").is_some(), "{e}");
    read_object(&seg, h, i, a.count(), |_| ()).unwrap();
    s.put(&mut ring, "fourth", &[&[4u8; 200]], 1).unwrap();
    assert!(s.entry("first").is_none());
}

/// A store of one reader keeps version 4's frame (no reader words); its reader's reads
/// are in the count word, and dropping it leaves nothing to wait for.
#[test]
fn a_store_of_one_reader_has_no_reader_words_and_drops_its_reader() {
    use crate::broadcast::DeadReaderPolicy;
    // Three objects of ~230 bytes fit, not four.
    let (mut ring, mut s) = store(800, 300, 1);
    let seg = ring.segment().clone();
    let r = ReaderSlot::take(&seg, 1).unwrap().unwrap();
    let (h, i) = s.put(&mut ring, "a", &[&[1u8; 200]], 1).unwrap();
    let data = h + HEADER_BYTES;
    let frame = data + count_word_at(data) + COUNT_WORD_BYTES;
    assert_eq!(seg.load_u32(frame), 1, "n = 1 part, no reader words");
    read_object(&seg, h, i, r.count(), |_| ()).unwrap();
    assert_eq!(object_reader_count(&seg, h, i).unwrap(), 1);
    s.put(&mut ring, "b", &[&[2u8; 200]], 1).unwrap();
    s.put(&mut ring, "c", &[&[3u8; 200]], 1).unwrap();
    r.die();
    // "d" takes the room of "a" (read); "e" waits for "b", which the dead reader never read.
    s.put(&mut ring, "d", &[&[4u8; 200]], 1).unwrap();
    assert!(s.put(&mut ring, "e", &[&[5u8; 200]], 1).is_err());
    assert_eq!(s.dead_reader().map(|r| r.slot), Some(0));
    s.set_on_dead_reader(DeadReaderPolicy::Drop);
    s.put(&mut ring, "e", &[&[5u8; 200]], 1).unwrap();
    s.put(&mut ring, "f", &[&[6u8; 200]], 1).unwrap();
    assert_eq!(s.dropped_readers(), [0]);
}
