//! In-process tests of the producer and consumer (one process can be both: a consumer
//! joins with this process's id). Multi-process behaviour is tested from Python
//! (`tests/python/test_encoder_cache.py`).

use std::time::{Duration, Instant};

use super::layout::Mapped;
use super::slots;
use super::*;
use crate::error::{CacheError, Error, OsError};
use shmq_os::process::ProcessId;

const PAGE: usize = 4096;

fn name(tag: &str) -> String {
    // shmq_t_<pid>_<hex>: unique, and the name shows which test process made it.
    format!("{}-{tag}", shmq_os::segment::unique_name("t"))
}

fn producer(tag: &str, pages: usize, max_entries: usize) -> Producer {
    Producer::create(
        Some(&name(tag)),
        ProducerOptions {
            capacity: pages * PAGE,
            max_entries,
            max_consumers: 4,
            min_consumers: 0,
        },
    )
    .unwrap()
}

/// A process that has died (pid and start time of a reaped child).
fn dead_process() -> ProcessId {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let start_time = rest.split_whitespace().nth(19).unwrap().parse().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    ProcessId { pid, start_time }
}

fn short() -> Option<Duration> {
    Some(Duration::from_millis(200))
}

#[test]
fn saved_parts_reach_a_consumer_as_private_views() {
    let p = producer("basic", 16, 8);
    let mut c = Consumer::new(&[p.name()]).unwrap();
    let mut idx = Consumer::index_only(&[p.name()]).unwrap();
    assert!(!c.has("k"));
    let body = b"body".to_vec();
    let big: Vec<u8> = (0..3 * PAGE + 5).map(|i| (i % 251) as u8).collect();
    assert!(p.save("k", &[&body, &big, b""], None).unwrap());
    assert!(
        !p.save("k", &[b"other"], None).unwrap(),
        "a held key is not saved again"
    );
    assert!(c.has("k") && idx.has("k") && p.has("k"));
    assert!(!idx.has(&"x".repeat(1000)), "too long to be held");
    assert!(matches!(idx.load("k"), Err(Error::WrongRole(_))));

    let mut v = c.load("k").unwrap().unwrap();
    assert_eq!(v.n_parts(), 3);
    assert_eq!(v.part(0), b"body");
    assert_eq!(v.part(1), &big[..]);
    assert_eq!(v.part(2), b"");
    let v2 = c.load("k").unwrap().unwrap();
    v.part_mut(1)[0] = 0xEE;
    assert_eq!(
        v2.part(1)[0],
        big[0],
        "a write in one view is private to it"
    );
    assert!(c.load("absent").unwrap().is_none());
    assert_eq!(p.load_state("k"), LoadState::Loaded);
    assert_eq!(p.load_state("absent"), LoadState::Unknown);
    let consumers = p.consumers();
    assert_eq!(consumers.len(), 1);
    assert_eq!(consumers[0].process, ProcessId::current());
    assert_eq!(consumers[0].loads, 2);

    // Evicted while mapped: gone from the index at once, the bytes stay until the views go.
    assert!(p.evict("k"));
    assert!(!c.has("k") && !p.has("k"));
    assert_eq!(p.stats().zombies, 1);
    assert_eq!(v2.part(1), &big[..]);
    drop((v, v2));
    p.sweep();
    let s = p.stats();
    assert_eq!((s.zombies, s.entries, s.bytes_in_use), (0, 0, 0));
    assert_eq!(
        p.load_state("k"),
        LoadState::Loaded,
        "evicted after it was loaded"
    );
}

#[test]
fn eviction_waits_for_every_joined_consumer_and_not_for_late_joiners() {
    // Room for two one-page entries.
    let p = producer("evict", 2, 8);
    let mut a = Consumer::new(&[p.name()]).unwrap();
    let mut b = Consumer::new(&[p.name()]).unwrap();
    p.save("k1", &[b"1"], None).unwrap();
    p.save("k2", &[b"2"], None).unwrap();
    assert!(a.acknowledge("k1").unwrap());
    // b has not loaded k1: no room.
    let err = p.save("k3", &[b"3"], short()).unwrap_err();
    assert!(
        matches!(err, Error::Cache(CacheError::Full { .. })),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("not yet loaded"), "{msg}");
    assert!(b.load("k1").unwrap().is_some()); // loaded and dropped at once
    assert!(p.save("k3", &[b"3"], short()).unwrap());
    assert!(
        !p.has("k1") && p.has("k2") && p.has("k3"),
        "oldest loaded entry went"
    );
    assert_eq!(
        p.load_state("k1"),
        LoadState::Loaded,
        "evicted after it was loaded"
    );

    // A consumer that joins now holds back nothing published before it.
    let mut late = Consumer::new(&[p.name()]).unwrap();
    for c in [&mut a, &mut b] {
        c.acknowledge("k2").unwrap();
        c.acknowledge("k3").unwrap();
    }
    assert_eq!(p.load_state("k2"), LoadState::Loaded);
    assert!(late.has("k2"), "a late joiner sees the keys held");
    p.save("k4", &[b"4"], short()).unwrap();
    // ...but what is published after it joined waits for it too.
    a.acknowledge("k4").unwrap();
    b.acknowledge("k4").unwrap();
    assert_eq!(p.load_state("k4"), LoadState::Pending);
    assert!(
        p.wait_loaded("k4", Some(Duration::from_millis(50)))
            .is_err()
    );
    late.acknowledge("k4").unwrap();
    p.wait_loaded("k4", short()).unwrap();
    assert!(matches!(
        p.wait_loaded("nope", short()),
        Err(Error::Cache(CacheError::UnknownKey(_)))
    ));
    // A consumer that leaves stops counting.
    p.save("k5", &[b"5"], short()).unwrap();
    a.acknowledge("k5").unwrap();
    b.acknowledge("k5").unwrap();
    assert_eq!(p.load_state("k5"), LoadState::Pending);
    drop(late);
    assert_eq!(p.load_state("k5"), LoadState::Loaded);
}

#[test]
fn min_consumers_holds_entries_until_enough_consumers_loaded_them() {
    let p = Producer::create(
        Some(&name("min")),
        ProducerOptions {
            capacity: PAGE,
            max_entries: 4,
            max_consumers: 4,
            min_consumers: 1,
        },
    )
    .unwrap();
    p.save("k1", &[b"1"], None).unwrap();
    assert_eq!(p.load_state("k1"), LoadState::Pending, "no consumer yet");
    assert!(matches!(
        p.save("k2", &[b"2"], short()),
        Err(Error::Cache(CacheError::Full { .. }))
    ));
    let mut c = Consumer::new(&[p.name()]).unwrap();
    c.acknowledge("k1").unwrap();
    assert!(p.save("k2", &[b"2"], short()).unwrap());
}

#[test]
fn pinned_entries_are_never_reused_and_a_full_cache_times_out() {
    let p = producer("pinned", 2, 8);
    let mut c = Consumer::new(&[p.name()]).unwrap();
    p.save("k1", &[&[1u8; 100]], None).unwrap();
    p.save("k2", &[&[2u8; 100]], None).unwrap();
    let v1 = c.load("k1").unwrap().unwrap();
    c.acknowledge("k2").unwrap();
    // k1 is loaded but mapped: k2 goes.
    p.save("k3", &[&[3u8; 100]], short()).unwrap();
    assert!(p.has("k1") && !p.has("k2"));
    let v3 = c.load("k3").unwrap().unwrap();
    let t = Instant::now();
    let err = p.save("k4", &[&[4u8; 100]], short()).unwrap_err();
    assert!(t.elapsed() >= Duration::from_millis(150), "it waited first");
    let msg = err.to_string();
    assert!(msg.contains("still mapped by a consumer"), "{msg}");
    assert!(v1.part(0).iter().all(|&b| b == 1) && v3.part(0).iter().all(|&b| b == 3));
    drop(v1);
    p.save("k4", &[&[4u8; 100]], short()).unwrap();
    assert!(!p.has("k1"));
    // Too large for the cache at all.
    assert!(matches!(
        p.save("big", &[&vec![0u8; 3 * PAGE]], short()),
        Err(Error::Cache(CacheError::TooLarge { .. }))
    ));
}

#[test]
fn a_full_cache_wakes_a_waiting_save_when_a_consumer_loads() {
    let p = producer("wake", 1, 4);
    let mut c = Consumer::new(&[p.name()]).unwrap();
    p.save("k1", &[b"1"], None).unwrap();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| p.save("k2", &[b"2"], Some(Duration::from_secs(20))));
        std::thread::sleep(Duration::from_millis(50));
        c.acknowledge("k1").unwrap();
        assert!(waiter.join().unwrap().unwrap());
    });
}

#[test]
fn a_dead_consumer_stops_counting_and_its_pins_go() {
    let p = producer("dead", 1, 4);
    p.save("k1", &[b"1"], None).unwrap();
    // A consumer that joined, pinned k1 without acknowledging it, and died.
    let map = Mapped::open(p.segment_name()).unwrap();
    let (slot, _, role) = slots::join(&map, dead_process()).unwrap();
    drop(role); // what dying does to it
    assert!(map.pin(0, slot).pin(&map.entry(0).state, 0));
    // (It joined after k1 was published: make k1 wait for it.)
    map.consumer(slot).backdate_join(0);
    map.entry(0).published_at.set(1);
    assert_eq!(p.load_state("k1"), LoadState::Pending);
    let t = Instant::now();
    assert!(
        p.save("k2", &[b"2"], Some(Duration::from_secs(10)))
            .unwrap()
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(!p.has("k1"));
    assert!(p.consumers().is_empty());
    assert_eq!(map.pin(0, slot).count(), 0);
}

#[test]
fn consumer_slots_are_bounded_and_dead_ones_reused() {
    let p = producer("slots", 1, 4);
    let cs: Vec<Consumer> = (0..4)
        .map(|_| Consumer::new(&[p.name()]).unwrap())
        .collect();
    let err = Consumer::new(&[p.name()]).unwrap_err();
    assert!(err.to_string().contains("no free consumer slot"), "{err}");
    drop(cs);
    let map = Mapped::open(p.segment_name()).unwrap();
    for _ in 0..4 {
        let (_, _, role) = slots::join(&map, dead_process()).unwrap();
        drop(role); // what dying does to it
    }
    // Every slot is taken by a dead process: a new consumer reclaims one.
    Consumer::new(&[p.name()]).unwrap();
}

#[test]
fn a_restarted_producer_supersedes_the_dead_ones_segment() {
    let n = name("restart");
    let old = Producer::create(Some(&n), ProducerOptions::default()).unwrap();
    let mut c = Consumer::new(&[&n]).unwrap();
    old.save("old-key", &[b"old"], None).unwrap();
    old.save("same", &[b"old value"], None).unwrap();
    assert!(c.has("old-key"));
    // A live producer of the name cannot be replaced.
    let err = Producer::create(Some(&n), ProducerOptions::default()).unwrap_err();
    assert!(err.to_string().contains("already served"), "{err}");
    // Make it look dead (as if killed: its destructor does not run).
    let map = Mapped::open(old.segment_name()).unwrap();
    let dead = dead_process();
    // SAFETY: test only; the header's creator fields (offsets 24 and 32) are plain
    // integers nobody reads concurrently in this test.
    unsafe {
        let h = map.segment.as_ptr();
        *(h.add(24) as *mut u32) = dead.pid;
        *(h.add(32) as *mut u64) = dead.start_time;
    }
    std::mem::forget(old);
    let new = Producer::create(Some(&n), ProducerOptions::default()).unwrap();
    assert!(
        !c.has("old-key"),
        "the old segment's keys are never served again"
    );
    assert!(!c.has("same"));
    new.save("same", &[b"new value"], None).unwrap();
    assert!(c.has("same"));
    assert_eq!(c.load("same").unwrap().unwrap().part(0), b"new value");
    // The forgotten producer's mapping leaks in this test process; its name is gone.
    drop(map);
}

#[test]
fn a_closed_producer_is_dropped_and_a_new_one_found() {
    let n = name("closed");
    let p = Producer::create(Some(&n), ProducerOptions::default()).unwrap();
    let mut c = Consumer::new(&[&n, "never-there"]).unwrap();
    p.save("k", &[b"v"], None).unwrap();
    let view = c.load("k").unwrap().unwrap();
    p.close().unwrap();
    assert!(matches!(
        p.save("k2", &[b"v"], None),
        Err(Error::WrongRole(_))
    ));
    assert!(!c.has("k"));
    assert_eq!(view.part(0), b"v", "views outlive their producer");
    drop(p);
    let p2 = Producer::create(Some(&n), ProducerOptions::default()).unwrap();
    p2.save("k", &[b"v2"], None).unwrap();
    std::thread::sleep(RETRY_OPEN + Duration::from_millis(20));
    assert_eq!(c.load("k").unwrap().unwrap().part(0), b"v2");
    assert_eq!(
        c.producers(),
        vec![
            (format!("shmq_ec_{n}"), true),
            ("shmq_ec_never-there".to_owned(), false)
        ]
    );
}

#[test]
fn a_consumer_made_before_its_producer_loads_at_once() {
    // The workers of examples/encoder_cache.py start before the encoder: their first
    // load comes less than RETRY_OPEN after they last failed to open the producer.
    let n = name("before");
    let mut c = Consumer::new(&[&n]).unwrap();
    let p = Producer::create(Some(&n), ProducerOptions::default()).unwrap();
    p.save("k", &[b"v"], None).unwrap();
    let view = c
        .load("k")
        .unwrap()
        .expect("a held key was reported missing");
    assert_eq!(view.part(0), b"v");
}

#[test]
fn several_producers_serve_one_consumer() {
    let a = producer("multi-a", 4, 4);
    let b = producer("multi-b", 4, 4);
    let mut c = Consumer::new(&[a.name(), b.name()]).unwrap();
    a.save("from-a", &[b"a"], None).unwrap();
    b.save("from-b", &[b"b"], None).unwrap();
    assert_eq!(c.load("from-a").unwrap().unwrap().part(0), b"a");
    assert_eq!(c.load("from-b").unwrap().unwrap().part(0), b"b");
    assert_eq!(a.load_state("from-a"), LoadState::Loaded);
    assert_eq!(b.load_state("from-b"), LoadState::Loaded);
}

#[test]
fn many_keys_stay_within_capacity_and_the_index_stays_exact() {
    let p = producer("churn", 8, 16);
    let mut c = Consumer::new(&[p.name()]).unwrap();
    for i in 0..2000u32 {
        let key = format!("key-{i}");
        let data = vec![(i % 256) as u8; (i as usize * 37) % (2 * PAGE) + 1];
        assert!(p.save(&key, &[&data], short()).unwrap(), "{key}");
        let v = c.load(&key).unwrap().unwrap();
        assert_eq!(v.part(0), &data[..]);
        if i >= 20 {
            // Old keys are eventually evicted, and never reported held when gone.
            let old = format!("key-{}", i - 20);
            assert_eq!(c.has(&old), p.has(&old));
        }
        let s = p.stats();
        assert!(s.bytes_in_use <= s.capacity && s.reserved <= s.capacity);
        assert!(s.entries <= 16);
    }
    assert!(p.stats().evictions >= 1900);
}

#[test]
fn a_reservation_is_filled_in_place_or_given_back() {
    let p = producer("reserve", 4, 4);
    let mut c = Consumer::new(&[p.name()]).unwrap();
    let mut r = p.reserve("k", &[10, 4000], None).unwrap().unwrap();
    assert!(p.reserve("k", &[1], None).unwrap().is_none(), "being saved");
    assert!(!p.has("k") && !c.has("k"));
    r.part_mut(0).copy_from_slice(b"0123456789");
    r.part_mut(1).fill(7);
    assert!(r.publish().unwrap());
    let v = c.load("k").unwrap().unwrap();
    assert_eq!(v.part(0), b"0123456789");
    assert!(v.part(1).iter().all(|&b| b == 7));
    // Dropped unpublished: the room comes back.
    let before = p.stats().bytes_in_use;
    drop(p.reserve("gone", &[5000], None).unwrap().unwrap());
    assert_eq!(p.stats().bytes_in_use, before);
    assert!(!p.has("gone"));
    // Evicted while being written: dropped at publish.
    let r = p.reserve("cancel", &[5], None).unwrap().unwrap();
    assert!(p.evict("cancel"));
    assert!(!r.publish().unwrap());
    assert!(!p.has("cancel"));
    assert_eq!(p.stats().bytes_in_use, before);
}

#[test]
fn corrupt_segments_are_errors_not_crashes() {
    let p = producer("corrupt", 4, 4);
    let mut c = Consumer::new(&[p.name()]).unwrap();
    p.save("k", &[b"v"], None).unwrap();
    let map = Mapped::open(p.segment_name()).unwrap();
    // An entry pointing outside the data region.
    map.entry(0).offset.set(u64::MAX - 2);
    assert!(matches!(
        c.load("k"),
        Err(Error::Os(OsError::BadSegment { .. }))
    ));
    map.entry(0).offset.set(0);
    // A corrupt part table.
    // SAFETY: test only; the entry's first page is in the data region.
    unsafe { *map.data().add(4) = 0xFF };
    assert!(matches!(
        c.load("k"),
        Err(Error::Os(OsError::BadSegment { .. }))
    ));
    // Garbage in the index: lookups stay bounded.
    let index_offset = map.geo.index_offset;
    // SAFETY: test only; the index table lies in the mapping and holds only atomics.
    unsafe {
        std::ptr::write_bytes(
            map.segment.as_ptr().add(index_offset),
            0xAB,
            192 * map.geo.index_slots,
        )
    };
    assert!(!c.has("k"));
    // A consumer of a segment that is not an encoder cache treats it as absent.
    map.header().magic.publish(0);
    let mut c2 = Consumer::new(&[p.name()]).unwrap();
    assert!(!c2.has("k"));
    assert!(Mapped::open(p.segment_name()).is_err());
}

#[test]
fn closing_the_producer_ends_its_blocked_waits() {
    // A consumer joined before the key was saved and never loads it: the producer's
    // wait for the load blocks until another thread closes the producer. (Its timeout is
    // only there so that a close that did not end the wait fails this test with a
    // `Timeout` instead of hanging it.)
    let p = producer("close-wakes", 16, 8);
    let _c = Consumer::new(&[p.name()]).unwrap();
    assert!(p.save("k", &[b"x"], None).unwrap());
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let started = Instant::now();
            (
                p.wait_loaded("k", Some(Duration::from_secs(30))),
                started.elapsed(),
            )
        });
        // The waiter is blocked until the close, however late it comes.
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiter.is_finished());
        p.close().unwrap();
        let (result, took) = waiter.join().unwrap();
        assert!(matches!(result, Err(Error::Cancelled)), "{result:?}");
        assert!(took < Duration::from_secs(10), "{took:?}");
    });
}

#[test]
fn a_new_producer_has_its_first_pages_reserved_before_any_save() {
    // The first save must not reserve the data region's first step on its caller's path:
    // the producer reserves it as it is made (here the whole capacity, smaller than a step).
    use std::os::unix::fs::MetadataExt;
    let p = producer("prefault", 2048, 8); // 8 MiB of 4 KiB pages
    let file = format!("/dev/shm/{}", p.segment_name());
    let allocated = std::fs::metadata(&file).unwrap().blocks() * 512;
    assert!(
        allocated >= (2048 * PAGE) as u64,
        "{allocated} bytes allocated in {file}"
    );
}
