//! Tests of the queue in one process (threads): handles, options, local and remote
//! readers, shutdown.

use std::time::Duration;

use super::super::ring::RingHandle;
use super::reader::ChunkEnd;
use super::*;
use crate::error::{CreateError, DequeueError, EnqueueError, OpenError};

#[test]
fn handle_text_round_trip() {
    let h = Handle {
        local_reader_ranks: vec![0, 2, 5],
        buffer: Some(RingHandle {
            n_reader: 3,
            max_chunk_bytes: 1024,
            max_chunks: 4,
            name: "shmq_ring_1_abc".into(),
        }),
        local_subscribe_addr: Some("ipc://@shmq_ring_1_abc".into()),
        remote_subscribe_addr: Some("tcp://[::1]:5555".into()),
        remote_addr_ipv6: true,
        arena: Some("shmq_arena_1_abc".into()),
        remote_secret: Some([0xA5; 32]),
    };
    assert_eq!(h.to_string().parse::<Handle>().unwrap(), h);
    let empty = Handle {
        local_reader_ranks: vec![],
        buffer: None,
        local_subscribe_addr: None,
        remote_subscribe_addr: None,
        remote_addr_ipv6: false,
        arena: None,
        remote_secret: None,
    };
    assert_eq!(empty.to_string().parse::<Handle>().unwrap(), empty);
    assert!("nonsense".parse::<Handle>().is_err());
}

/// A text that is not a handle: an error that says which part is wrong (never showing a
/// field's value beyond the text's first characters: the last one is the secret).
#[test]
fn handle_text_errors_say_what_is_wrong() {
    let secret = "ab".repeat(32);
    let ok = format!("shmq-handle-3|0|1,64,2,shmq_ring_x|||0||{secret}");
    assert!(ok.parse::<Handle>().is_ok());
    for (text, why) in [
        (
            "nonsense".to_string(),
            "it must start with \"shmq-handle-3|\"",
        ),
        ("shmq-handle-2|0|||0||".to_string(), "another shmq version"),
        (
            "shmq-handle-3|0||||0|".to_string(),
            "8 fields separated by '|' expected, found 7",
        ),
        (ok.replace("|0|1,", "|x|1,"), "a local reader rank must be"),
        (
            ok.replace("1,64,2,shmq_ring_x", "1,64,2"),
            "the ring must be n_reader,",
        ),
        (
            ok.replace("1,64,", "1,-64,"),
            "the ring's max_chunk_bytes must be",
        ),
        (
            ok.replace("|||0|", "|||yes|"),
            "the IPv6 flag must be 0 or 1",
        ),
        (
            ok.replace(&secret, &secret[..62]),
            "the secret must be 64 hexadecimal digits",
        ),
        (
            ok.replace(&secret, &"zz".repeat(32)),
            "the secret must be 64 hexadecimal digits",
        ),
    ] {
        let e = text.parse::<Handle>().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        let shown = e.to_string();
        assert!(shown.starts_with("not a shmq queue handle ("), "{shown}");
        assert!(shown.contains(why), "{text:?}: {shown}");
        assert!(!shown.contains(&secret[..40]), "{shown}");
    }
}

#[test]
fn options_are_checked() {
    let e = Writer::new(QueueOptions {
        n_reader: 1,
        n_local_reader: 2,
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("cannot exceed"), "{e}");
    let e = Writer::new(QueueOptions {
        local_reader_ranks: Some(vec![0, 1]),
        ..QueueOptions::local(1)
    })
    .unwrap_err();
    assert!(
        e.to_string().contains("local_reader_ranks has 2 entries"),
        "{e}"
    );
    // The remote bounds and the policies' names: the same checks and messages as the
    // Python arguments (which go through them).
    for (remote, message) in [
        (
            crate::remote::RemoteOptions {
                hwm: 0,
                ..Default::default()
            },
            "remote_hwm must be at least 1 message, got 0",
        ),
        (
            crate::remote::RemoteOptions {
                max_queued_bytes: 0,
                ..Default::default()
            },
            "remote_max_queued_bytes must be at least 1 byte, got 0",
        ),
    ] {
        let e = Writer::new(QueueOptions {
            remote,
            ..QueueOptions::local(1)
        })
        .unwrap_err();
        assert!(
            matches!(&e, CreateError::BadOptions(m) if m == message),
            "{e}"
        );
    }
    use crate::broadcast::ring::DeadReaderPolicy;
    use crate::remote::SlowReaderPolicy;
    assert_eq!(
        "drop".parse::<DeadReaderPolicy>().unwrap(),
        DeadReaderPolicy::Drop
    );
    assert_eq!(
        "block".parse::<SlowReaderPolicy>().unwrap(),
        SlowReaderPolicy::Block
    );
    assert_eq!(
        "ignore"
            .parse::<DeadReaderPolicy>()
            .unwrap_err()
            .to_string(),
        r#"on_dead_reader must be "raise" or "drop", got "ignore""#
    );
    assert_eq!(
        "wait".parse::<SlowReaderPolicy>().unwrap_err().to_string(),
        r#"slow_remote_reader must be "block" or "drop", got "wait""#
    );
}

/// A writer of 64-byte chunks with one local reader (rank 0) and one remote reader
/// (rank 1, TCP on 127.0.0.1).
fn one_local_one_remote(max_chunks: usize, arena_bytes: usize) -> Writer {
    Writer::new(QueueOptions {
        n_reader: 2,
        n_local_reader: 1,
        max_chunk_bytes: 64,
        max_chunks,
        arena_bytes,
        connect_ip: Some("127.0.0.1".into()),
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn local_and_remote_in_threads() {
    let mut w = one_local_one_remote(2, QueueOptions::default().arena_bytes);
    let h = w.handle().clone();
    let msgs: Vec<Vec<u8>> = (0..200).map(|i| vec![i as u8; (i * 7) % 150]).collect();
    std::thread::scope(|s| {
        for rank in [0, 1] {
            let h = h.clone();
            let msgs = msgs.clone();
            s.spawn(move || {
                let mut r = Reader::open(&h, rank).unwrap();
                assert_eq!(r.is_local(), rank == 0);
                r.wait_until_ready(Some(Duration::from_secs(10))).unwrap();
                for m in &msgs {
                    assert_eq!(&r.dequeue(Some(Duration::from_secs(10))).unwrap(), m);
                }
            });
        }
        w.wait_until_ready(Some(Duration::from_secs(10))).unwrap();
        for m in &msgs {
            w.enqueue(m, Some(Duration::from_secs(10))).unwrap();
        }
    });
    assert!(w.overflow_count() > 0);
}

/// The remote reader's message goes before the local reader's chunk is published, but
/// only after every wait: a send that finds the ring full (a local reader that takes
/// nothing) and times out has sent nothing to the remote reader either, and the next
/// send after the local reader took a message goes to both, in order.
#[test]
fn a_send_that_waits_for_the_ring_in_vain_sends_nothing_to_remote_readers() {
    let mut w = one_local_one_remote(2, QueueOptions::default().arena_bytes);
    let h = w.handle().clone();
    let (mut local, mut remote) = (Reader::open(&h, 0).unwrap(), Reader::open(&h, 1).unwrap());
    std::thread::scope(|s| {
        s.spawn(|| {
            local
                .wait_until_ready(Some(Duration::from_secs(10)))
                .unwrap()
        });
        s.spawn(|| {
            remote
                .wait_until_ready(Some(Duration::from_secs(10)))
                .unwrap()
        });
        w.wait_until_ready(Some(Duration::from_secs(10))).unwrap();
    });
    let ten = Some(Duration::from_secs(10));
    w.enqueue(b"one", ten).unwrap();
    w.enqueue(b"two", ten).unwrap();
    // Both chunks are taken: the third waits for the local reader, in vain.
    let e = w
        .enqueue(b"three", Some(Duration::from_millis(50)))
        .unwrap_err();
    assert!(matches!(e, EnqueueError::Timeout { .. }), "{e:?}");
    assert_eq!(remote.dequeue(ten).unwrap(), b"one");
    assert_eq!(remote.dequeue(ten).unwrap(), b"two");
    let e = remote
        .dequeue(Some(Duration::from_millis(200)))
        .unwrap_err();
    assert!(
        matches!(e, DequeueError::Timeout { .. }),
        "the timed-out send reached it: {e:?}"
    );
    assert_eq!(local.dequeue(ten).unwrap(), b"one");
    w.enqueue(b"four", ten).unwrap();
    assert_eq!(remote.dequeue(ten).unwrap(), b"four");
    assert_eq!(local.dequeue(ten).unwrap(), b"two");
    assert_eq!(local.dequeue(ten).unwrap(), b"four");
}

/// `LostReaderPolicy::Raise`: the send that loses a remote reader (here dropped as slow:
/// room for one message, none taken) and every later one fail with
/// `RemoteError::LostReaders` naming it, with the text Python's `PeerDiedError` shows;
/// the policy's names are Python's `on_lost_remote_reader`.
#[test]
fn a_lost_remote_reader_fails_the_sends_of_a_writer_that_asks_for_it() {
    use crate::error::RemoteError;
    use crate::remote::{LostReaderPolicy, RemoteOptions, SlowReaderPolicy};
    let mut w = Writer::new(QueueOptions {
        n_reader: 1,
        n_local_reader: 0,
        connect_ip: Some("127.0.0.1".into()),
        remote: RemoteOptions {
            hwm: 1,
            slow_reader: SlowReaderPolicy::Drop,
            on_lost_reader: LostReaderPolicy::Raise,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let h = w.handle().clone();
    let t = Some(Duration::from_secs(10));
    let (done, wait_done) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut r = Reader::open(&h, 0).unwrap();
            r.wait_until_ready(t).unwrap();
            // Connected, and takes nothing until the writer is done.
            wait_done.recv().unwrap();
        });
        w.wait_until_ready(t).unwrap();
        w.enqueue(b"one", t).unwrap();
        for msg in [&b"two"[..], b"three"] {
            let e = w.enqueue(msg, t).unwrap_err();
            assert!(
                matches!(&e, EnqueueError::Remote(RemoteError::LostReaders { readers, .. })
                    if readers[..] == [(0, Some("127.0.0.1".to_owned()))]),
                "{e:?}"
            );
            assert_eq!(
                e.to_string(),
                "remote reader rank 0 (host 127.0.0.1) is gone: its connection closed, or \
                 nothing came from it within the heartbeat bound \
                 (SHMQ_REMOTE_HEARTBEAT_TIMEOUT), or it fell behind; no more messages go to \
                 it (on_lost_remote_reader=\"raise\")"
            );
        }
        done.send(()).unwrap();
    });
    assert_eq!(
        "raise".parse::<LostReaderPolicy>().unwrap(),
        LostReaderPolicy::Raise
    );
    assert_eq!(
        "ignore"
            .parse::<LostReaderPolicy>()
            .unwrap_err()
            .to_string(),
        "on_lost_remote_reader must be 'warn' or 'raise', got 'ignore'"
    );
}

/// Typed arrays reach a local reader (inline, over the overflow socket, through the arena)
/// and a remote one (frames) with their dtype, shape and values; a raw message between
/// them is read in place with `dequeue_view`; each wrong call names what the message is,
/// consumes it, and the reader goes on.
#[test]
fn arrays_to_local_and_remote_readers() {
    use crate::broadcast::{ArrayRef, Dtype};
    let mut w = one_local_one_remote(4, 64 << 20);
    let h = w.handle().clone();
    let sizes = [0usize, 3, 1000, 300_000];
    let t = Duration::from_secs(10);
    std::thread::scope(|s| {
        for rank in [0, 1] {
            let h = h.clone();
            s.spawn(move || {
                let mut r = Reader::open(&h, rank).unwrap();
                r.wait_until_ready(t).unwrap();
                for &n in &sizes {
                    let a = r.dequeue_array(t).unwrap();
                    assert_eq!((a.dtype(), a.shape()), (Dtype::F32, &[n, 2][..]));
                    let want: Vec<f32> = (0..2 * n).map(|i| i as f32).collect();
                    assert_eq!(a.to_vec::<f32>().unwrap(), want);
                    assert!(a.to_vec::<i32>().is_err());
                }
                assert_eq!(r.dequeue_view(t, |b| b.to_vec()).unwrap(), b"raw");
                let e = r.dequeue(t).unwrap_err().to_string();
                assert!(
                    e.contains("a typed array (int64 [2]: enqueue_array)")
                        && e.contains("dequeue_array"),
                    "{e}"
                );
                let e = r.dequeue_array(t).unwrap_err().to_string();
                assert!(
                    e.contains("raw bytes") && e.contains("read it with dequeue"),
                    "{e}"
                );
                let e = r.dequeue_parts(t).unwrap_err().to_string();
                assert!(e.contains("a typed array"), "{e}");
                assert_eq!(r.dequeue(t).unwrap(), b"last");
            });
        }
        w.wait_until_ready(t).unwrap();
        for &n in &sizes {
            let v: Vec<f32> = (0..2 * n).map(|i| i as f32).collect();
            w.enqueue(&ArrayRef::new(&v, &[n, 2]).unwrap(), t).unwrap();
        }
        w.enqueue(b"raw", t).unwrap();
        w.enqueue(&ArrayRef::new(&[1i64, 2], &[2]).unwrap(), t)
            .unwrap();
        w.enqueue(b"not an array", t).unwrap();
        w.enqueue(&ArrayRef::new(&[1u8], &[1]).unwrap(), t).unwrap();
        w.enqueue(b"last", t).unwrap();
    });
}

/// `Message::Body` sends a message of one part (a chunk of kind `Body`, or over a socket a
/// block and a frame): every reader, local (in a chunk and overflowing) and remote, gets
/// it from `dequeue_parts` as one part, and `dequeue` refuses it (consumed), while raw
/// bytes in between stay raw.
#[test]
fn a_body_is_a_message_of_one_part_everywhere() {
    let mut w = one_local_one_remote(4, QueueOptions::default().arena_bytes);
    let h = w.handle().clone();
    let msgs: Vec<Vec<u8>> = (0..60).map(|i| vec![i as u8; (i * 13) % 150]).collect();
    let t = Some(Duration::from_secs(10));
    std::thread::scope(|s| {
        for rank in [0, 1] {
            let h = h.clone();
            let msgs = msgs.clone();
            s.spawn(move || {
                let mut r = Reader::open(&h, rank).unwrap();
                r.wait_until_ready(t).unwrap();
                for (i, m) in msgs.iter().enumerate() {
                    match i % 3 {
                        0 => assert_eq!(&r.dequeue(t).unwrap(), m),
                        1 => {
                            let parts = r.dequeue_parts(t).unwrap();
                            assert_eq!(parts.len(), 1);
                            assert_eq!(&parts[0][..], &m[..]);
                        }
                        _ => {
                            let e = r.dequeue(t).unwrap_err();
                            assert!(matches!(e, DequeueError::WrongKind(_)), "{e}");
                        }
                    }
                }
            });
        }
        w.wait_until_ready(t).unwrap();
        for (i, m) in msgs.iter().enumerate() {
            match i % 3 {
                0 => w.enqueue(m, t).unwrap(),
                _ => w.enqueue(Message::Body(m), t).unwrap(),
            }
        }
    });
    assert!(w.overflow_count() > 0);
}

#[test]
fn shutdown_wakes_a_blocked_reader() {
    let w = Writer::new(QueueOptions {
        max_chunk_bytes: 64,
        max_chunks: 2,
        ..QueueOptions::local(1)
    })
    .unwrap();
    let mut r = Reader::open(w.handle(), 0).unwrap();
    let canceller = r.canceller();
    std::thread::scope(|s| {
        s.spawn(move || {
            // Long enough for the reader to be asleep on the futex.
            std::thread::sleep(Duration::from_millis(200));
            canceller.cancel();
        });
        let started = std::time::Instant::now();
        assert!(matches!(
            r.dequeue(Some(Duration::from_secs(10))),
            Err(DequeueError::Cancelled)
        ));
        // Woken by cancel(), not by the reader's own 500 ms liveness slice.
        let waited = started.elapsed();
        assert!(waited < Duration::from_millis(420), "{waited:?}");
    });
}

#[test]
fn endpoints_with_a_nul_are_errors_not_panics() {
    // The zmq crate panics on an endpoint with a NUL (it makes a C string of it); a
    // handle can carry anything (found by tests/python/test_fuzz.py).
    let writer = Writer::new(QueueOptions {
        max_chunk_bytes: 64,
        max_chunks: 2,
        arena_bytes: 0,
        ..QueueOptions::local(1)
    })
    .unwrap();
    let mut h = writer.handle().clone();
    h.local_subscribe_addr = Some("ipc:///tmp/x\0y".into());
    let e = Reader::open(&h, 0).unwrap_err();
    assert!(matches!(e, OpenError::BadHandle(_)), "{e}");
    let remote = Handle {
        local_reader_ranks: vec![],
        buffer: None,
        local_subscribe_addr: None,
        remote_subscribe_addr: Some("tcp://127.0.0.1:1\0".into()),
        remote_addr_ipv6: false,
        arena: None,
        remote_secret: Some([7; 32]),
    };
    let e = Reader::open(&remote, 3).unwrap_err();
    assert!(matches!(e, OpenError::BadHandle(_)), "{e}");
    let e = Writer::new(QueueOptions {
        n_reader: 1,
        n_local_reader: 0,
        connect_ip: Some("127.0.0.1\0".into()),
        ..Default::default()
    })
    .unwrap_err();
    assert!(matches!(e, CreateError::BadOptions(_)), "{e}");
}

#[test]
fn wait_until_ready_a_second_time_returns_at_once_on_every_side() {
    // The writer says "ready" once: a reader that waited for a second one timed out.
    let mut w = one_local_one_remote(2, 0);
    let h = w.handle().clone();
    let again = Some(Duration::from_millis(50));
    std::thread::scope(|s| {
        for rank in [0, 1] {
            let h = h.clone();
            s.spawn(move || {
                let mut r = Reader::open(&h, rank).unwrap();
                r.wait_until_ready(Some(Duration::from_secs(10))).unwrap();
                r.wait_until_ready(again).unwrap();
                assert_eq!(r.dequeue(Some(Duration::from_secs(10))).unwrap(), b"m");
            });
        }
        w.wait_until_ready(Some(Duration::from_secs(10))).unwrap();
        w.wait_until_ready(again).unwrap();
        w.enqueue(b"m", Some(Duration::from_secs(10))).unwrap();
    });
}

#[test]
fn close_ends_the_writer_and_readers_get_everything_then_the_end() {
    // Two chunks and one message over the overflow socket left in the ring when the
    // writer closes; a local and a remote reader, both blocked without a timeout.
    let mut w = one_local_one_remote(3, 0);
    let h = w.handle().clone();
    let msgs: Vec<Vec<u8>> = vec![b"a".to_vec(), vec![7; 500], b"c".to_vec()];
    std::thread::scope(|s| {
        for rank in [0, 1] {
            let h = h.clone();
            let msgs = msgs.clone();
            s.spawn(move || {
                let mut r = Reader::open(&h, rank).unwrap();
                r.wait_until_ready(Some(Duration::from_secs(10))).unwrap();
                for m in &msgs {
                    assert_eq!(&r.dequeue(None).unwrap(), m);
                }
                for _ in 0..2 {
                    let e = r.dequeue(None).unwrap_err();
                    // The local reader's error names the queue's ring; the remote
                    // reader's stream has none.
                    let named = match &e {
                        DequeueError::WriterShutDown { queue } => queue.clone(),
                        other => panic!("rank {rank}: {other}"),
                    };
                    assert_eq!(
                        named.is_some_and(|q| q.starts_with("'shmq_ring_")),
                        rank == 0,
                        "rank {rank}: {e}"
                    );
                }
            });
        }
        w.wait_until_ready(Some(Duration::from_secs(10))).unwrap();
        for m in &msgs {
            w.enqueue(m, Some(Duration::from_secs(10))).unwrap();
        }
        w.close();
        assert!(w.is_shut_down());
        let e = w
            .enqueue(b"late", Some(Duration::from_secs(1)))
            .unwrap_err();
        assert!(matches!(e, EnqueueError::ShutDown), "{e}");
    });
}

#[test]
fn a_cancelled_writer_says_it_was_shut_down() {
    let mut w = Writer::new(QueueOptions {
        max_chunk_bytes: 64,
        max_chunks: 1,
        arena_bytes: 0,
        ..QueueOptions::local(1)
    })
    .unwrap();
    let _r = Reader::open(w.handle(), 0).unwrap(); // never reads
    w.enqueue(b"fills the ring", None).unwrap();
    let canceller = w.canceller();
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            canceller.cancel();
        });
        let e = w.enqueue(b"blocked", None).unwrap_err();
        assert!(matches!(e, EnqueueError::ShutDown), "{e}");
    });
}

/// The shared bytes of chunk 0 of `r`'s ring (what the writer wrote there last).
fn shared_chunk0(r: &Reader, n: usize) -> Vec<u8> {
    let (p, len) = r.ring().unwrap().data_ptr(0).unwrap();
    assert!(n <= len);
    // SAFETY: `p..p+len` is chunk 0's data in the ring's mapping, which `r` keeps alive;
    // no writer writes while this test reads it.
    unsafe { std::slice::from_raw_parts(p, n) }.to_vec()
}

#[test]
fn acquire_read_hands_out_a_private_view_that_never_shows_the_next_message() {
    let t = Some(Duration::from_secs(10));
    // One chunk: the writer's next message goes into the chunk just read.
    let mut w = Writer::new(QueueOptions {
        max_chunk_bytes: 64,
        max_chunks: 1,
        ..QueueOptions::local(1)
    })
    .unwrap();
    let h = w.handle().clone();
    let mut r = std::thread::scope(|s| {
        let reader = s.spawn(move || {
            let mut r = Reader::open(&h, 0).unwrap();
            r.wait_until_ready(t).unwrap();
            r
        });
        w.wait_until_ready(t).unwrap();
        reader.join().unwrap()
    });

    // Kept past finish_read (ChunkEnd::Detach): writes stay private, and it keeps the
    // message it showed.
    w.enqueue(b"first message", t).unwrap();
    let mut v = r.acquire_chunk(t).unwrap();
    assert!(!v.is_overflow());
    assert_eq!(&v[..], b"first message");
    v[0] = b'F';
    assert_eq!(&v[..], b"First message");
    assert_eq!(
        shared_chunk0(&r, 13),
        b"first message",
        "a write reached the ring"
    );
    r.finish_chunk(ChunkEnd::Detach).unwrap();
    w.enqueue(b"second message", t).unwrap();
    assert_eq!(shared_chunk0(&r, 14), b"second message");
    assert_eq!(&v[..], b"First message");

    // Not used any more (ChunkEnd::Retire): it reads zeros, never the next message.
    let v2 = r.acquire_chunk(t).unwrap();
    assert_eq!(&v2[..], b"second message");
    r.finish_chunk(ChunkEnd::Retire).unwrap();
    assert!(v2.iter().all(|&b| b == 0));
    w.enqueue(b"third message!", t).unwrap();
    assert!(v2.iter().all(|&b| b == 0));
    assert_eq!(&v[..], b"First message");

    // An oversized message is the one from the socket, owned.
    let big: Vec<u8> = (0..200).map(|i| i as u8).collect();
    let v3 = r.acquire_chunk(t).unwrap();
    assert_eq!(&v3[..], b"third message!");
    r.finish_chunk(ChunkEnd::Retire).unwrap();
    w.enqueue(&big, t).unwrap();
    let v4 = r.acquire_chunk(t).unwrap();
    assert!(v4.is_overflow());
    r.finish_chunk(ChunkEnd::Retire).unwrap();
    assert_eq!(&v4[..], &big[..]);

    // The public API: the view borrows the reader, so it is gone before finish_read;
    // what it wrote reaches neither the ring nor the next message.
    w.enqueue(b"fifth message", t).unwrap();
    let mut v5 = r.acquire_read(t).unwrap();
    assert!(!v5.is_overflow());
    assert_eq!(&v5[..], b"fifth message");
    v5.fill(b'x');
    drop(v5);
    assert_eq!(shared_chunk0(&r, 13), b"fifth message");
    r.finish_read().unwrap();
    w.enqueue(b"sixth message", t).unwrap();
    let v6 = r.acquire_read(t).unwrap();
    assert_eq!(&v6[..], b"sixth message");
    drop(v6);
    r.finish_read().unwrap();
}

#[test]
fn an_enqueue_ended_by_its_hook_and_started_again_sends_each_message_once() {
    // What the Python bindings do to run signal handlers with the writer let go: the
    // hook ends the call, which is made again with the same clock. The writer waits for
    // its slow remote reader's credit before it writes to the local one, so a call
    // started again never sends a message twice.
    use crate::wait::{WaitClock, WaitSpec};
    let mut w = Writer::new(QueueOptions {
        n_reader: 2,
        n_local_reader: 1,
        max_chunk_bytes: 64,
        max_chunks: 2,
        arena_bytes: 0,
        connect_ip: Some("127.0.0.1".into()),
        remote: crate::remote::RemoteOptions {
            hwm: 1,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let h = w.handle().clone();
    let msgs: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 10]).collect();
    let t = Some(Duration::from_secs(20));
    let mut pauses = 0;
    std::thread::scope(|s| {
        for rank in [0, 1] {
            let (h, msgs) = (h.clone(), msgs.clone());
            s.spawn(move || {
                let mut r = Reader::open(&h, rank).unwrap();
                r.wait_until_ready(t).unwrap();
                for m in &msgs {
                    if rank == 1 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    assert_eq!(&r.dequeue(t).unwrap(), m);
                }
                let e = r.dequeue(Some(Duration::from_millis(300))).unwrap_err();
                assert!(
                    matches!(e, DequeueError::Timeout { .. }),
                    "a message more: {e:?}"
                );
            });
        }
        w.wait_until_ready(t).unwrap();
        for m in &msgs {
            let mut clock = WaitClock::default();
            loop {
                let mut paused = false;
                let mut pause = || {
                    paused = true;
                    Err(Error::Cancelled)
                };
                let spec = WaitSpec {
                    timeout: t,
                    hook: Some(&mut pause),
                    quiet: false,
                    resume: Some(&mut clock),
                };
                match w.enqueue(m, spec) {
                    Ok(()) => break,
                    Err(_) if paused => pauses += 1,
                    Err(e) => panic!("{e}"),
                }
            }
        }
    });
    assert!(pauses > 0, "the writer never waited for its remote reader");
}

/// A loaned part below `LOAN_SEAL_MIN` is copied (its loan stays shared and unsealed); one
/// at or above it goes by reference, sealed. Either way the reader gets what was in the
/// loan at the send, and the writer's later writes reach nobody.
#[test]
fn small_loaned_parts_are_copied_and_large_ones_sent_by_reference() {
    let mut w = Writer::new(QueueOptions {
        n_reader: 1,
        n_local_reader: 1,
        max_chunk_bytes: 1 << 16,
        max_chunks: 4,
        arena_bytes: 64 << 20,
        ..Default::default()
    })
    .unwrap();
    let h = w.handle().clone();
    let t = Duration::from_secs(10);
    let sizes = [
        crate::arena::LOAN_SEAL_MIN - 4096,
        crate::arena::LOAN_SEAL_MIN,
    ];
    let (to_send, sent) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut r = Reader::open(&h, 0).unwrap();
            r.wait_until_ready(t).unwrap();
            for &n in &sizes {
                // The writer has written 7 over the loan since it sent 3.
                sent.recv().unwrap();
                let parts = r.dequeue_parts(t).unwrap();
                assert_eq!(parts[1].len(), n);
                assert!(
                    parts[1].iter().all(|&b| b == 3),
                    "a write after the send reached the reader"
                );
            }
        });
        w.wait_until_ready(t).unwrap();
        let ring = w.ring().unwrap().clone();
        for (i, &n) in sizes.iter().enumerate() {
            let mut loan = w.loan(n).unwrap();
            loan.fill(3);
            let before = ring.stats();
            w.enqueue(Message::Parts(&[b"body", &loan[..]]), t).unwrap();
            let after = ring.stats();
            let (loaned, copied) = (
                after.loaned_parts - before.loaned_parts,
                after.arena_parts - before.arena_parts,
            );
            assert_eq!(
                (loaned, copied),
                if i == 0 { (0, 1) } else { (1, 0) },
                "size {n}"
            );
            loan.fill(7);
            to_send.send(()).unwrap();
        }
    });
}
