//! The arena's tests: copies in and views out, fallbacks, loans, the lazy arena, dead
//! readers and bad references.

use std::sync::Arc;

use super::*;
use crate::error::{Error, OsError};

fn no_dead(_: usize) -> bool {
    false
}

#[test]
fn copy_in_view_release_reuse() {
    let mut w = ArenaWriter::create(2, 1 << 20, 8).unwrap();
    let r0 = Arc::new(ArenaReader::open(w.name(), 0).unwrap());
    let r1 = Arc::new(ArenaReader::open(w.name(), 1).unwrap());
    let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
    let a = w.copy_in(&data, &mut no_dead).unwrap();
    w.publish(&a, 0..2);
    let mut v0 = r0.view(&a).unwrap();
    let v1 = r1.view(&a).unwrap();
    assert_eq!(&v0[..], &data[..]);
    // A write in one view is private to it.
    v0[0] = 0xAA;
    assert_eq!(v1[0], 0);
    assert_eq!(v0[0], 0xAA);
    // Held: the next allocation does not reuse the range.
    let b = w.copy_in(&[7u8; 5000], &mut no_dead).unwrap();
    assert_ne!(a.offset, b.offset);
    // Not yet published: the writer holds it, so placing more parts cannot take it.
    w.reclaim();
    assert_eq!(w.outstanding(), 2);
    w.publish(&b, 0..0);
    drop(v0);
    assert_eq!(w.outstanding(), 2);
    drop(v1);
    w.reclaim();
    // b was published to nobody: reclaimed too.
    assert_eq!(w.outstanding(), 0);
    let c = w.copy_in(&[1u8; 10], &mut no_dead).unwrap();
    assert_eq!(c.offset, 0, "lowest free range first");
    // A stale reference (old generation) is refused.
    assert!(r0.view(&a).is_err());
}

#[test]
fn full_arena_falls_back_and_dead_readers_release() {
    let mut w = ArenaWriter::create(1, 64 << 10, 4).unwrap();
    let r = Arc::new(ArenaReader::open(w.name(), 0).unwrap());
    let a = w.copy_in(&[1u8; 40 << 10], &mut no_dead).unwrap();
    w.publish(&a, 0..1);
    let _v = r.view(&a).unwrap();
    assert!(w.copy_in(&[2u8; 40 << 10], &mut no_dead).is_none());
    assert_eq!(w.fallbacks(), 1);
    // Reader 0 "dies": its hold is dropped when room is short.
    assert!(w.copy_in(&[2u8; 40 << 10], &mut |_| true).is_some());
}

#[test]
fn loans_are_found_by_address_and_returned_when_dropped() {
    let mut w = ArenaWriter::create(1, 1 << 20, 8).unwrap();
    let r = Arc::new(ArenaReader::open(w.name(), 0).unwrap());
    let mut loan = w.loan(10_000, &mut no_dead).unwrap();
    loan.fill(3);
    let part = &loan[100..5000];
    let a = w.find_loan(part).unwrap();
    assert_eq!(a.len, 4900);
    assert!(w.find_loan(&[0u8; 10]).is_none());
    w.publish(&a, 0..1);
    let v = r.view(&a).unwrap();
    assert!(v.iter().all(|&b| b == 3));
    drop(loan);
    w.reclaim();
    assert_eq!(w.outstanding(), 1, "the reader still holds it");
    drop(v);
    w.reclaim();
    assert_eq!(w.outstanding(), 0);
    // An unsent loan comes back when dropped.
    let l2 = w.loan(100, &mut no_dead).unwrap();
    drop(l2);
    w.reclaim();
    assert_eq!(w.outstanding(), 0);
}

#[test]
fn a_sent_loan_is_sealed_and_its_memory_shared_again_once_returned() {
    let mut w = ArenaWriter::create(1, 1 << 20, 8).unwrap();
    let r = Arc::new(ArenaReader::open(w.name(), 0).unwrap());
    let mut loan = w.loan(3 * 4096 + 10, &mut no_dead).unwrap();
    loan.fill(5);
    let a = w.find_loan(&loan).unwrap();
    w.publish(&a, 0..1);
    loan.fill(7); // after the send: the writer's own copy
    assert!(loan.iter().all(|&b| b == 7));
    let v = r.view(&a).unwrap();
    assert!(
        v.iter().all(|&b| b == 5),
        "a write after the send reached the reader"
    );
    // Sent again, it is copied (a new lease), not referenced.
    assert!(w.find_loan(&loan).is_none());
    drop((loan, v));
    w.reclaim();
    assert_eq!(w.outstanding(), 0);
    // The same memory lent again is shared: what the writer writes, readers read.
    let mut again = w.loan(3 * 4096 + 10, &mut no_dead).unwrap();
    assert_eq!(
        w.find_loan(&again).unwrap().offset,
        a.offset,
        "not the same memory"
    );
    again.fill(9);
    let b = w.find_loan(&again).unwrap();
    w.publish(&b, 0..1);
    assert!(r.view(&b).unwrap().iter().all(|&x| x == 9));
}

#[test]
fn a_lazy_arena_is_made_at_first_use_and_names_its_queue() {
    let mut lazy = LazyArenaWriter::new("shmq_ring_test_queue", 2, 1 << 20, 8).unwrap();
    let name = lazy.name().to_owned();
    assert!(lazy.get().is_none());
    assert!(
        ArenaReader::open(&name, 0).is_err(),
        "made before it was needed"
    );
    assert_eq!(
        (lazy.outstanding(), lazy.reserved(), lazy.fallbacks()),
        (0, 0, 0)
    );
    let w = lazy.for_part().unwrap();
    assert_eq!(w.name(), name);
    let info = describe(&name).unwrap();
    assert_eq!(info.queue, "shmq_ring_test_queue");
    assert_eq!(info.n_reader, 2);
    assert!(ArenaReader::open(&name, 1).is_ok());
    // An arena made without a queue records none.
    let plain = ArenaWriter::create(1, 1 << 20, 8).unwrap();
    assert_eq!(describe(plain.name()).unwrap().queue, "");
}

#[test]
fn dead_readers_holds_are_dropped_without_a_shortage() {
    let mut w = ArenaWriter::create(2, 1 << 20, 8).unwrap();
    let r1 = Arc::new(ArenaReader::open(w.name(), 1).unwrap());
    let a = w.copy_in(&[1u8; 5000], &mut no_dead).unwrap();
    w.publish(&a, 0..2);
    let _held = r1.view(&a).unwrap();
    // Reader 0 "died" holding `a` (it never took the message); reader 1 lives on.
    w.reclaim();
    assert_eq!(w.outstanding(), 1);
    let mut asked = Vec::new();
    w.reclaim_dead(&mut |r| {
        asked.push(r);
        r == 0
    });
    assert_eq!(asked, [0, 1], "only readers holding something are probed");
    assert_eq!(w.outstanding(), 1, "reader 1 still holds it");
    drop(_held);
    w.reclaim();
    assert_eq!(w.outstanding(), 0);
    // Placing a part probes at most every DEAD_CHECK_EVERY, room or not.
    let b = w.copy_in(&[2u8; 5000], &mut no_dead).unwrap();
    w.publish(&b, 0..2);
    let mut probes = 0;
    let _c = w.copy_in(&[3u8; 5000], &mut |_| {
        probes += 1;
        false
    });
    assert_eq!(probes, 0, "probed again right away");
    std::thread::sleep(DEAD_CHECK_EVERY);
    let _d = w.copy_in(&[4u8; 5000], &mut |r| r == 0 || r == 1);
    w.reclaim();
    // b went with its dead holders; c and d are still the writer's (unpublished).
    assert_eq!(w.outstanding(), 2);
}

#[test]
fn bad_references_are_errors() {
    let mut w = ArenaWriter::create(1, 1 << 20, 8).unwrap();
    let r = Arc::new(ArenaReader::open(w.name(), 0).unwrap());
    let a = w.copy_in(&[1u8; 100], &mut no_dead).unwrap();
    for bad in [
        ArenaRef { lease: 9999, ..a },
        ArenaRef {
            generation: a.generation + 1,
            ..a
        },
        ArenaRef { len: 1 << 30, ..a },
        ArenaRef {
            offset: u64::MAX,
            ..a
        },
    ] {
        assert!(
            matches!(r.view(&bad), Err(Error::Os(OsError::BadSegment { .. }))),
            "{bad:?}"
        );
    }
    assert!(ArenaReader::open(w.name(), 1).is_err());
}
