//! Tests of the ring: layout, flag state machine, slots, dead peers, bounds.

use std::sync::Arc;

use super::*;
use crate::error::QueueError;
use crate::wait::Wait;
use std::time::Duration;

/// Make slot `index` name a holder that is gone: attached, with no role lock held.
fn fake_dead_holder(ring: &Ring, index: usize) {
    let slot = ring.slot(index);
    let generation = shmq_protocol::ring::slot_begin_attach(&slot.word).unwrap();
    slot.pid.set(u32::MAX - 1);
    slot.start_time.set(1);
    shmq_protocol::ring::slot_end_attach(&slot.word, generation);
}

fn wait() -> Wait<'static> {
    Wait::new("test", Some(Duration::from_millis(50)))
}

#[test]
fn geometry_is_aligned() {
    let g = Geometry::new(3, 1000, 5).unwrap();
    assert_eq!(g.state_stride, 64);
    assert_eq!(g.states_offset, SLOTS_OFFSET + 4 * SLOT_SIZE);
    assert_eq!(g.data_stride, 1024);
    assert_eq!(g.data_offset % 64, 0);
    assert_eq!(g.total, g.data_offset + 5 * 1024);
    assert_eq!(Geometry::new(100, 8, 1).unwrap().state_stride, 128);
    assert!(Geometry::new(0, 8, 1).is_err());
    assert!(Geometry::new(1, 0, 1).is_err());
    assert!(Geometry::new(1, usize::MAX / 2, 4).is_err());
}

#[test]
fn state_machine_follows_the_spec() {
    let ring = Arc::new(Ring::create(2, 64, 2).unwrap());
    let mut w = RingWriter::new(ring.clone()).unwrap();
    let mut r0 = RingReader::new(ring.clone(), 0).unwrap();
    let mut r1 = RingReader::new(ring.clone(), 1).unwrap();
    // 1. not written: readers may not read, the writer may write.
    assert_eq!(ring.metadata(0).unwrap(), vec![0, 0, 0]);
    assert!(r0.poll().is_none());
    assert!(w.can_write());
    w.write(b"hello", &mut wait()).unwrap();
    // 2. written, nobody has read: readable.
    assert_eq!(ring.metadata(0).unwrap(), vec![1, 0, 0]);
    let info = r0.poll().unwrap();
    assert_eq!((info.index, info.len, info.kind), (0, 5, ChunkKind::Inline));
    assert_eq!(r0.data(&info), b"hello");
    r0.finish();
    // 3. read by some: the others may still read, the writer must wait.
    assert_eq!(ring.metadata(0).unwrap(), vec![1, 1, 0]);
    w.write(b"second", &mut wait()).unwrap(); // chunk 1 is free
    assert!(!w.can_write(), "chunk 0 is still unread by reader 1");
    assert!(matches!(w.acquire(&mut wait()), Err(Error::Timeout { .. })));
    assert_eq!(r1.data(&r1.poll().unwrap()), b"hello");
    r1.finish();
    // 4. read by all: the writer may write, nobody may read it again.
    assert_eq!(ring.metadata(0).unwrap(), vec![1, 1, 1]);
    assert!(w.can_write());
    assert_eq!(r0.data(&r0.poll().unwrap()), b"second");
    r0.finish();
    assert!(r0.poll().is_none(), "reader 0 has read everything");
    // A new round resets the read flags.
    w.write(b"third", &mut wait()).unwrap();
    assert_eq!(ring.metadata(0).unwrap(), vec![1, 0, 0]);
    assert_eq!(r0.data(&r0.poll().unwrap()), b"third");
}

#[test]
fn slots_record_who_holds_each_side() {
    let ring = Arc::new(Ring::create(2, 64, 2).unwrap());
    assert!(ring.slot_info(None).unwrap().process.is_none());
    let mut w = RingWriter::new(ring.clone()).unwrap();
    let mut r1 = RingReader::new(ring.clone(), 1).unwrap();
    let me = ProcessId::current();
    assert_eq!(ring.slot_info(None).unwrap().process, Some(me));
    assert_eq!(ring.slot_info(Some(1)).unwrap().process, Some(me));
    assert!(ring.slot_info(Some(0)).unwrap().process.is_none());
    assert!(ring.slot_info(Some(2)).is_err());
    w.write(b"x", &mut wait()).unwrap();
    r1.poll().unwrap();
    r1.finish();
    assert_eq!(ring.slot_info(None).unwrap().messages, 1);
    assert_eq!(ring.slot_info(Some(1)).unwrap().messages, 1);
    assert_eq!(ring.creator(), me);
}

#[test]
fn a_dead_reader_is_reported_or_dropped() {
    let ring = Arc::new(Ring::create(2, 64, 1).unwrap());
    let mut w = RingWriter::new(ring.clone()).unwrap();
    let mut r0 = RingReader::new(ring.clone(), 0).unwrap();
    // Reader 1's slot names a process that is gone (a pid that cannot exist).
    fake_dead_holder(&ring, 2);
    w.write(b"one", &mut wait()).unwrap();
    r0.poll().unwrap();
    r0.finish();
    let long = || Wait::new("test", Some(Duration::from_secs(10)));
    match w.acquire(&mut long()) {
        Err(Error::Queue(QueueError::DeadReader {
            reader: 1,
            chunk: 0,
            ..
        })) => {}
        other => panic!("expected DeadReader, got {other:?}"),
    }
    w.on_dead_reader(DeadReaderPolicy::Drop);
    w.acquire(&mut long()).unwrap();
    assert_eq!(w.dropped_readers(), vec![1]);
    assert!(ring.slot_info(Some(1)).unwrap().dropped);
    w.commit(3, ChunkKind::Inline).unwrap();
    // The dropped reader's flag is set, so it never holds the writer back.
    assert_eq!(ring.metadata(0).unwrap(), vec![1, 0, 1]);
}

#[test]
fn a_reader_that_left_is_gone_not_dead() {
    let ring = Arc::new(Ring::create(2, 64, 1).unwrap());
    let mut w = RingWriter::new(ring.clone()).unwrap();
    let mut r0 = RingReader::new(ring.clone(), 0).unwrap();
    let r1 = RingReader::new(ring.clone(), 1).unwrap();
    w.write(b"one", &mut wait()).unwrap();
    r0.poll().unwrap();
    r0.finish();
    // Reader 1 ends normally without reading chunk 0: it leaves.
    drop(r1);
    let info = ring.slot_info(Some(1)).unwrap();
    assert!(info.left && !info.dropped, "{info:?}");
    assert!(
        info.process.is_some(),
        "a reader that left still names its holder"
    );
    assert!(!ring.slot_info(Some(0)).unwrap().left);
    assert!(ring.reader_left(1) && !ring.reader_left(0));
    // With the default policy (raise) as well: the writer goes on without it.
    let long = || Wait::new("test", Some(Duration::from_secs(10)));
    w.acquire(&mut long()).unwrap();
    assert_eq!(w.left_readers(), vec![1]);
    assert!(
        w.dropped_readers().is_empty(),
        "a reader that left was not dropped as dead"
    );
    w.commit(3, ChunkKind::Inline).unwrap();
    assert_eq!(ring.metadata(0).unwrap(), vec![1, 0, 1]);
    // Its rank can be opened again (a new holder is not one that left).
    let again = RingReader::new(ring.clone(), 1).unwrap();
    assert!(!ring.reader_left(1));
    drop(again);
}

#[test]
fn a_reader_dropped_by_a_panic_has_not_left() {
    let ring = Arc::new(Ring::create(1, 64, 1).unwrap());
    let mut w = RingWriter::new(ring.clone()).unwrap();
    let r0 = RingReader::new(ring.clone(), 0).unwrap();
    w.write(b"one", &mut wait()).unwrap();
    let thread = std::thread::spawn(move || {
        let _reader = r0;
        panic!("a reader's failure (this panic is the test's)");
    });
    assert!(thread.join().is_err());
    assert!(!ring.slot_info(Some(0)).unwrap().left);
    let long = || Wait::new("test", Some(Duration::from_secs(10)));
    match w.acquire(&mut long()) {
        Err(Error::Queue(QueueError::DeadReader { reader: 0, .. })) => {}
        other => panic!("expected DeadReader, got {other:?}"),
    }
}

#[test]
fn a_dead_writer_is_reported() {
    let ring = Arc::new(Ring::create(1, 64, 1).unwrap());
    let r = RingReader::new(ring.clone(), 0).unwrap();
    fake_dead_holder(&ring, 0);
    let err = r
        .wait(&mut Wait::new("test", Some(Duration::from_secs(10))))
        .unwrap_err();
    assert!(
        matches!(err, Error::Queue(QueueError::DeadWriter { .. })),
        "{err}"
    );
}

#[test]
fn open_checks_the_header() {
    let ring = Ring::create(1, 16, 1).unwrap();
    let other = Ring::open(ring.name()).unwrap();
    assert_eq!(other.handle(), ring.handle());
    assert!(!other.is_creator());
    let seg = Segment::create(&shmq_os::segment::unique_name("test"), 4096).unwrap();
    let err = Ring::open(seg.name()).unwrap_err();
    assert!(
        err.to_string().contains("not a shmq broadcast ring"),
        "{err}"
    );
}

#[test]
fn too_large_message_and_bad_indices() {
    let ring = Arc::new(Ring::create(1, 16, 2).unwrap());
    let mut w = RingWriter::new(ring.clone()).unwrap();
    assert!(matches!(
        w.write(&[0; 17], &mut wait()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(ring.data_ptr(2).is_err());
    assert!(ring.metadata_ptr(5).is_err());
    assert!(RingReader::new(ring, 1).is_err());
}

#[test]
fn stats_and_the_warnings_words_follow_each_side() {
    let ring = Arc::new(Ring::create(2, 64, 2).unwrap());
    let mut w = RingWriter::new(ring.clone()).unwrap();
    w.set_reader_ranks(vec![3, 5]);
    let mut r0 = RingReader::new(ring.clone(), 0).unwrap();
    let _r1 = RingReader::new(ring.clone(), 1).unwrap();
    w.write(b"hello", &mut wait()).unwrap();
    w.write(b"second", &mut wait()).unwrap();
    let info = r0.wait(&mut wait()).unwrap();
    assert_eq!(info.len, 5);
    r0.finish();
    // The writer waits for chunk 0, which reader 1 has not read: it times out, and the
    // wait is counted in its slot.
    assert!(matches!(w.acquire(&mut wait()), Err(Error::Timeout { .. })));
    let s = ring.stats();
    assert_eq!((s.writer.messages, s.writer.bytes), (2, 11));
    assert_eq!(s.writer.waits, 1);
    assert!(s.writer.wait_seconds >= 0.03, "{}", s.writer.wait_seconds); // 50 ms
    assert_eq!(s.writer.waiting_seconds, None, "the wait is over");
    assert_eq!((s.readers[0].messages, s.readers[0].bytes), (1, 5));
    assert_eq!(s.readers[0].behind(&s.writer), 1);
    assert_eq!(s.readers[1].behind(&s.writer), 2);
    assert_eq!(s.readers[1].idle_seconds, None, "reader 1 has read nothing");
    assert!(s.readers[0].idle_seconds.is_some());
    assert_eq!(s.readers[0].liveness, shmq_os::liveness::Liveness::Alive);
    let behind = ring.explain_readers_behind(0, &|_| false, &|r| format!("reader {r}"));
    assert!(behind.contains("reader 1: pid "), "{behind}");
    assert!(
        behind.contains("2 messages behind, has not read a message yet"),
        "{behind}"
    );
    assert!(
        behind.contains("not in the queue (busy elsewhere)"),
        "{behind}"
    );
    assert!(
        !behind.contains("reader 0"),
        "reader 0 has read chunk 0: {behind}"
    );
    let writer = ring.explain_writer();
    assert!(writer.starts_with("the writer: pid "), "{writer}");
    assert!(
        writer.contains("2 messages written, last wrote"),
        "{writer}"
    );
    // A reader that waits is marked as waiting while it does (seen from its slot).
    let mut r0 = r0;
    let info = r0.wait(&mut wait()).unwrap();
    r0.finish();
    assert_eq!(info.len, 6);
    let ring2 = ring.clone();
    let t = std::thread::spawn(move || {
        let r = r0.wait(&mut Wait::new("test", Some(Duration::from_millis(300))));
        (r.is_err(), ring2.stats().readers[0].waits)
    });
    std::thread::sleep(Duration::from_millis(100));
    let during = ring.stats().readers[0].waiting_seconds;
    let (timed_out, waits) = t.join().unwrap();
    assert!(timed_out);
    assert!(during.is_some(), "reader 0 is inside a wait");
    assert_eq!(ring.stats().readers[0].waiting_seconds, None);
    assert_eq!(waits, 1);
}
