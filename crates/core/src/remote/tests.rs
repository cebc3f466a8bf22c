//! The remote stream's tests: writer and readers over loopback TCP, and forged,
//! replayed and closing messages fed to a reader by hand.

use std::time::{Duration, Instant};

use super::reader::reader_in_session;
use super::wire::*;
use super::*;
use crate::auth::mac;
use crate::error::QueueError;
use crate::wait::Wait;

fn wait() -> Wait<'static> {
    Wait::new("test", Some(Duration::from_secs(10)))
}

#[test]
fn readers_with_the_secret_get_authenticated_messages_and_others_nothing() {
    let ctx = zmq::Context::new();
    let key = new_secret().unwrap();
    let (mut w, _) =
        RemoteWriter::bind(&ctx, "127.0.0.1", key, 1, vec![0], RemoteOptions::default()).unwrap();
    // A stranger with a wrong secret, and a raw client sending garbage.
    let mut stranger = RemoteReader::connect(&ctx, w.endpoint(), false, [7; 32], 1).unwrap();
    let raw = ctx.socket(zmq::DEALER).unwrap();
    raw.connect(w.endpoint()).unwrap();
    raw.send(&[1u8, 0, 2, 0, 1][..], 0).unwrap();
    let mut r = RemoteReader::connect(&ctx, w.endpoint(), false, key, 1).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| r.wait_ready(&mut wait()).unwrap());
        w.wait_for_readers(&mut wait()).unwrap();
    });
    assert_eq!(w.readers(), vec![1]);
    // The reader's connection is known good to the port's guard (by its descriptor).
    assert_eq!(w.guard.authenticated.lock().unwrap().len(), 1);
    w.send(&[b"one"], &mut wait()).unwrap();
    w.send(&[b"two", b"parts"], &mut wait()).unwrap();
    let got = r.recv_frames(&mut wait()).unwrap();
    assert_eq!(&got[0][..], b"one");
    let got = r.recv_frames(&mut wait()).unwrap();
    assert_eq!((&got[0][..], &got[1][..]), (&b"two"[..], &b"parts"[..]));
    // The stranger and the raw client got nothing.
    std::thread::sleep(Duration::from_millis(100));
    assert!(stranger.try_recv_frames().unwrap().is_none());
    assert!(matches!(
        raw.recv_msg(zmq::DONTWAIT),
        Err(zmq::Error::EAGAIN)
    ));
    // A second reader of the same rank is refused, with the writer's word for it.
    let mut twin = RemoteReader::connect(&ctx, w.endpoint(), false, key, 1).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    w.send(&[b"three"], &mut wait()).unwrap();
    // The refusal reaches it in its wait for its connection or, where the writer
    // answered its hello only after that wait (a busy machine), in its first receive.
    let e = twin
        .wait_ready(&mut wait())
        .and_then(|()| twin.recv_frames(&mut wait()).map(drop))
        .unwrap_err();
    assert!(e.to_string().contains("rank 1 has joined already"), "{e}");
}

/// A writer on 127.0.0.1 and its one remote reader (rank 1), both ready.
fn ready_pair(ctx: &zmq::Context, options: RemoteOptions) -> (RemoteWriter, RemoteReader) {
    let key = new_secret().unwrap();
    let (mut w, _) = RemoteWriter::bind(ctx, "127.0.0.1", key, 1, vec![0], options).unwrap();
    let mut r = RemoteReader::connect(ctx, w.endpoint(), false, key, 1).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| r.wait_ready(&mut wait()).unwrap());
        w.wait_for_readers(&mut wait()).unwrap();
    });
    (w, r)
}

#[test]
fn a_reader_that_takes_nothing_stops_the_writer_at_its_credit() {
    let ctx = zmq::Context::new();
    let options = RemoteOptions {
        hwm: 100,
        max_queued_bytes: 3 << 20,
        slow_reader: SlowReaderPolicy::Block,
        ..RemoteOptions::default()
    };
    let (mut w, mut r) = ready_pair(&ctx, options);
    let mib = vec![7u8; 1 << 20];
    let short = || Wait::new("test", Some(Duration::from_millis(200)));
    // Three MiB fit in the byte bound; the fourth waits, and times out.
    for _ in 0..3 {
        w.send(&[&mib], &mut short()).unwrap();
    }
    assert!(w.send(&[&mib], &mut short()).is_err());
    // The reader takes one (and says so when asked): room for one more, and the
    // stream is whole (the timed-out message used no sequence number).
    r.recv_frames(&mut wait()).unwrap();
    w.send(&[&mib], &mut wait()).unwrap();
    for _ in 0..3 {
        assert_eq!(r.recv_frames(&mut wait()).unwrap()[0].len(), 1 << 20);
    }
    // A message larger than the bound goes once the reader has taken everything.
    let big = vec![1u8; 4 << 20];
    w.send(&[&big], &mut wait()).unwrap();
    assert_eq!(r.recv_frames(&mut wait()).unwrap()[0].len(), 4 << 20);
}

#[test]
fn a_writer_waiting_for_credit_stops_once_the_readers_connection_closes() {
    // The writer waits for a reader that takes nothing until it has asked it for credit
    // as often as it will (`MAX_UNANSWERED_PINGS`); then the reader's connection closes
    // (the reader gone, or given up by the heartbeats). Asking sends nothing more, yet the
    // writer sees the connection closed and goes on without it (before: it waited for
    // that reader until its timeout).
    let ctx = zmq::Context::new();
    let options = RemoteOptions {
        hwm: 2,
        ..RemoteOptions::default()
    };
    let (mut w, r) = ready_pair(&ctx, options);
    w.send(&[b"one"], &mut wait()).unwrap();
    w.send(&[b"two"], &mut wait()).unwrap();
    let short = Duration::from_millis(500);
    let e = w
        .send(&[b"three"], &mut Wait::new("test", Some(short)))
        .unwrap_err();
    assert!(e.to_string().contains("remote reader rank 1"), "{e}");
    drop(r);
    let t0 = Instant::now();
    w.send(&[b"three"], &mut wait()).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!(w.peers(), vec![(1, Some("127.0.0.1".into()), true)]);
}

#[test]
fn a_reader_whose_writer_goes_without_shutdown_gets_what_arrived_then_an_error() {
    let ctx = zmq::Context::new();
    let key = new_secret().unwrap();
    let (mut w, _) =
        RemoteWriter::bind(&ctx, "127.0.0.1", key, 1, vec![0], RemoteOptions::default()).unwrap();
    let mut r = RemoteReader::connect(&ctx, w.endpoint(), false, key, 1).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| r.wait_ready(&mut wait()).unwrap());
        w.wait_for_readers(&mut wait()).unwrap();
    });
    w.send(&[b"one"], &mut wait()).unwrap();
    w.send(&[b"two"], &mut wait()).unwrap();
    // Gone without CLOSED (as a killed writer: its connection closes).
    drop(w);
    let t0 = Instant::now();
    assert_eq!(&r.recv_frames(&mut wait()).unwrap()[0][..], b"one");
    assert_eq!(&r.recv_frames(&mut wait()).unwrap()[0][..], b"two");
    let e = r.recv_frames(&mut wait()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote(RemoteError::WriterGone { received: 2, .. })
        ),
        "{e}"
    );
    // The connection's close is usually seen at once; the promise is the heartbeat's
    // bound (once, under load, the close was seen only by it, at 5.0 s), with slack.
    let bound = HEARTBEAT_INTERVAL + DEFAULT_HEARTBEAT_TIMEOUT + Duration::from_secs(2);
    assert!(t0.elapsed() < bound, "{:?}", t0.elapsed());
    // And from then on, at once.
    assert!(matches!(
        r.try_recv_frames(),
        Err(Error::Remote(RemoteError::WriterGone { .. }))
    ));
}

#[test]
fn a_dropped_reader_gets_what_was_sent_to_it_then_is_told() {
    let ctx = zmq::Context::new();
    let key = new_secret().unwrap();
    let options = RemoteOptions {
        hwm: 4,
        max_queued_bytes: 1 << 20,
        slow_reader: SlowReaderPolicy::Drop,
        ..RemoteOptions::default()
    };
    let (mut w, _) = RemoteWriter::bind(&ctx, "127.0.0.1", key, 1, vec![0], options).unwrap();
    let mut r = RemoteReader::connect(&ctx, w.endpoint(), false, key, 1).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| r.wait_ready(&mut wait()).unwrap());
        w.wait_for_readers(&mut wait()).unwrap();
    });
    // Four fit its credit; the fifth drops it (it reads nothing meanwhile).
    for i in 0..10u8 {
        w.send(&[&[i]], &mut wait()).unwrap();
    }
    assert_eq!(w.peers(), vec![(1, Some("127.0.0.1".into()), true)]);
    for i in 0..4u8 {
        assert_eq!(&r.recv_frames(&mut wait()).unwrap()[0][..], &[i]);
    }
    let e = r.recv_frames(&mut wait()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Remote(RemoteError::ReaderDropped {
                rank: 1,
                received: 4,
                ..
            })
        ),
        "{e}"
    );
    // The writer's end does not change what the reader was told.
    w.close(Duration::from_millis(100));
    assert!(matches!(
        r.try_recv_frames(),
        Err(Error::Remote(RemoteError::ReaderDropped { .. }))
    ));
}

#[test]
fn a_rank_whose_reader_went_before_the_start_is_free_again() {
    let ctx = zmq::Context::new();
    let key = new_secret().unwrap();
    let (mut w, _) =
        RemoteWriter::bind(&ctx, "127.0.0.1", key, 2, vec![0], RemoteOptions::default()).unwrap();
    let first = RemoteReader::connect(&ctx, w.endpoint(), false, key, 1).unwrap();
    let short = || Wait::new("test", Some(Duration::from_millis(300)));
    // The writer takes its HELLO, and waits for rank 2.
    assert!(matches!(
        w.wait_for_readers(&mut short()),
        Err(Error::Timeout { .. })
    ));
    assert_eq!(w.readers(), vec![1]);
    drop(first);
    std::thread::sleep(Duration::from_millis(100));
    let mut again = RemoteReader::connect(&ctx, w.endpoint(), false, key, 1).unwrap();
    let mut other = RemoteReader::connect(&ctx, w.endpoint(), false, key, 2).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| again.wait_ready(&mut wait()).unwrap());
        s.spawn(|| other.wait_ready(&mut wait()).unwrap());
        w.wait_for_readers(&mut wait()).unwrap();
    });
    w.send(&[b"both"], &mut wait()).unwrap();
    assert_eq!(&again.recv_frames(&mut wait()).unwrap()[0][..], b"both");
    assert_eq!(&other.recv_frames(&mut wait()).unwrap()[0][..], b"both");
}

#[test]
fn the_closing_message_ends_the_stream_and_a_forged_one_is_refused() {
    let ctx = zmq::Context::new();
    let key = new_secret().unwrap();
    let session = [5; 16];
    let mut r = reader_in_session(&ctx, key, session);
    let closed = |key: &[u8; 32], seq: u64| {
        let m = mac(key, b"closed", &[&session, &seq.to_le_bytes()]);
        vec![zmq::Message::from(
            &header(KIND_CLOSED, seq, &session, &m)[..],
        )]
    };
    // Wrong key: refused as a stranger's, not taken as the end.
    let e = r.accept(closed(&[9; 32], 1)).unwrap_err();
    assert!(matches!(e, Error::Remote(RemoteError::Refused(_))), "{e}");
    assert!(r.ended.is_none());
    // The real one: the end, and from then on every receive says so.
    let e = r.accept(closed(&key, 1)).unwrap_err();
    assert!(
        matches!(e, Error::Queue(QueueError::WriterShutDown { queue: None })),
        "{e}"
    );
    assert!(matches!(
        r.try_recv_frames(),
        Err(Error::Queue(QueueError::WriterShutDown { .. }))
    ));
    // A replay of it cannot rewind the stream.
    assert!(matches!(
        r.accept(closed(&key, 1)),
        Err(Error::Remote(RemoteError::Refused(_)))
    ));
}

#[test]
fn a_forged_message_is_refused() {
    let ctx = zmq::Context::new();
    let key = new_secret().unwrap();
    let mut r = reader_in_session(&ctx, key, [5; 16]);
    let msg =
        |h: [u8; HEADER], body: &[u8]| vec![zmq::Message::from(&h[..]), zmq::Message::from(body)];
    // The writer's start first (a message before it is refused whatever it holds).
    let ready = mac(&key, b"ready", &[&[5; 16], &0u64.to_le_bytes()]);
    let ready = header(KIND_READY, 0, &[5; 16], &ready);
    assert!(
        r.accept(vec![zmq::Message::from(&ready[..])])
            .unwrap()
            .is_some()
    );
    // Right session, wrong key.
    let m = mac(&[9; 32], b"data", &[&[5; 16], &1u64.to_le_bytes(), b"x"]);
    assert!(
        r.accept(msg(header(KIND_DATA, 1, &[5; 16], &m), b"x"))
            .is_err()
    );
    // Right key, body changed after the MAC.
    let m = mac(&key, b"data", &[&[5; 16], &1u64.to_le_bytes(), b"x"]);
    assert!(
        r.accept(msg(header(KIND_DATA, 1, &[5; 16], &m), b"y"))
            .is_err()
    );
    // A good one, then a replay of it.
    assert!(
        r.accept(msg(header(KIND_DATA, 1, &[5; 16], &m), b"x"))
            .unwrap()
            .is_some()
    );
    assert!(
        r.accept(msg(header(KIND_DATA, 1, &[5; 16], &m), b"x"))
            .is_err()
    );
    // Garbage.
    assert!(r.accept(vec![zmq::Message::from(&b"junk"[..])]).is_err());
}

#[test]
fn a_replayed_start_message_cannot_rewind_the_stream() {
    let ctx = zmq::Context::new();
    let key = new_secret().unwrap();
    let session = [5; 16];
    let mut r = reader_in_session(&ctx, key, session);
    let ready = header(
        KIND_READY,
        0,
        &session,
        &mac(&key, b"ready", &[&session, &0u64.to_le_bytes()]),
    );
    let data_mac = mac(&key, b"data", &[&session, &1u64.to_le_bytes(), b"x"]);
    let data = || {
        vec![
            zmq::Message::from(&header(KIND_DATA, 1, &session, &data_mac)[..]),
            zmq::Message::from(&b"x"[..]),
        ]
    };
    assert!(
        r.accept(vec![zmq::Message::from(&ready[..])])
            .unwrap()
            .is_some()
    );
    // The start said again before any message (the writer moved this reader to a new
    // connection) is nothing new.
    assert!(
        r.accept(vec![zmq::Message::from(&ready[..])])
            .unwrap()
            .is_none()
    );
    assert!(r.accept(data()).unwrap().is_some());
    // Someone who recorded the stream replays the start and the first message.
    let e = r.accept(vec![zmq::Message::from(&ready[..])]).unwrap_err();
    assert!(e.to_string().contains("a second start message"), "{e}");
    assert!(r.accept(data()).is_err(), "a replayed message was taken");
}

/// The writer's authenticated refusal ends the stream for good: every later call fails
/// with it (a refused reader that went on waiting would wait on a connection the writer
/// never sends to). A message before the writer's start is refused, and not taken.
#[test]
fn a_refusal_is_for_good_and_nothing_is_taken_before_the_start() {
    let ctx = zmq::Context::new();
    let key = new_secret().unwrap();
    let session = [6; 16];
    let mut r = reader_in_session(&ctx, key, session);
    let data_mac = mac(&key, b"data", &[&session, &1u64.to_le_bytes(), b"x"]);
    let data = vec![
        zmq::Message::from(&header(KIND_DATA, 1, &session, &data_mac)[..]),
        zmq::Message::from(&b"x"[..]),
    ];
    let e = r.accept(data).unwrap_err();
    assert!(
        e.to_string().contains("before the writer said start"),
        "{e}"
    );
    assert!(
        r.ended.is_none(),
        "a message out of turn does not end the stream"
    );
    let why = b"rank 1 lost its connection after messages were sent to it";
    // The reader of `reader_in_session` has rank 1 and an all-zero nonce.
    let m = mac(
        &key,
        b"refused",
        &[&1u64.to_le_bytes(), &[0u8; 16], &session, why],
    );
    let refused = vec![
        zmq::Message::from(&header(KIND_REFUSED, 0, &session, &m)[..]),
        zmq::Message::from(&why[..]),
    ];
    let e = r.accept(refused).unwrap_err();
    assert!(
        e.to_string().contains("the writer refused it: rank 1 lost"),
        "{e}"
    );
    for _ in 0..2 {
        let again = r.try_recv_frames().unwrap_err();
        assert_eq!(again.to_string(), e.to_string());
    }
}

#[test]
fn wait_taken_returns_once_the_reader_asked_for_more_after_the_last_message() {
    let ctx = zmq::Context::new();
    let key = new_secret().unwrap();
    let (mut w, _) =
        RemoteWriter::bind(&ctx, "127.0.0.1", key, 1, vec![0], RemoteOptions::default()).unwrap();
    let mut r = RemoteReader::connect(&ctx, w.endpoint(), false, key, 1).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| r.wait_ready(&mut wait()).unwrap());
        w.wait_for_readers(&mut wait()).unwrap();
    });
    // Nothing sent: nothing to wait for.
    w.wait_taken(&mut Wait::new("test", Some(Duration::ZERO)))
        .unwrap();
    for m in [&b"one"[..], b"two", b"three"] {
        w.send(&[m], &mut wait()).unwrap();
    }
    // The reader took one of three and has not read since: the wait runs out, naming it
    // and what it acknowledged.
    assert_eq!(&r.recv_frames(&mut wait()).unwrap()[0][..], b"one");
    let e = w
        .wait_taken(&mut Wait::new("test", Some(Duration::from_millis(200))))
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("has acknowledged 0 of the 3 messages"),
        "{e}"
    );
    // It takes the rest and asks for more (the writer's request is what it finds): the
    // wait returns.
    let done = shmq_protocol::sync::local::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            assert_eq!(&r.recv_frames(&mut wait()).unwrap()[0][..], b"two");
            assert_eq!(&r.recv_frames(&mut wait()).unwrap()[0][..], b"three");
            let deadline = Instant::now() + Duration::from_secs(10);
            // Relaxed: a test flag; the loop ends by its deadline anyway.
            while !done.load(shmq_protocol::sync::local::Ordering::Relaxed)
                && Instant::now() < deadline
            {
                assert!(r.try_recv_frames().unwrap().is_none());
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        w.wait_taken(&mut wait()).unwrap();
        done.store(true, shmq_protocol::sync::local::Ordering::Relaxed);
    });
}
