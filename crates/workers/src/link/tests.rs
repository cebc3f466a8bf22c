use std::io::Cursor;
use std::net::TcpStream;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use shmq_core::auth::{mac, message_mac, secret_from_text, to_hex};

const TOKEN: [u8; 32] = [7; 32];

fn sealers(token: &[u8; 32]) -> (SealOut, SealIn, SealOut, SealIn) {
    let session = [[1u8; 32], [2u8; 32]].concat();
    (
        SealOut::new(token, &session, Side::Worker),
        SealIn::new(token, &session, Side::Parent),
        SealOut::new(token, &session, Side::Parent),
        SealIn::new(token, &session, Side::Worker),
    )
}

#[test]
fn sealed_frames_open_in_order_and_the_seal_is_the_cores_message_mac() {
    let (mut w_out, mut p_in, mut p_out, mut w_in) = sealers(&TOKEN);
    let a = w_out.seal(Kind::Ready.byte(), b"ready");
    let b = w_out.seal(Kind::Leaving.byte(), b"{}");
    assert_eq!(p_in.open(Kind::Ready.byte(), &a).unwrap(), b"ready");
    assert_eq!(p_in.open(Kind::Leaving.byte(), &b).unwrap(), b"{}");
    let s = p_out.seal(Kind::Stop.byte(), b"{\"grace\": 1}");
    assert_eq!(w_in.open(Kind::Stop.byte(), &s).unwrap(), b"{\"grace\": 1}");
    // On the wire: [seq (8, big-endian)][seal (32)][payload].
    assert_eq!(&b[..8], &1u64.to_be_bytes());
    let session = [[1u8; 32], [2u8; 32]].concat();
    let want = message_mac(
        &TOKEN,
        b"shmq worker link: worker to parent",
        &session,
        1,
        [&[Kind::Leaving.byte()][..], b"{}"],
    );
    assert_eq!(&b[8..40], &want);
}

#[test]
fn an_altered_replayed_reordered_reflected_or_unsealed_frame_is_refused() {
    let (mut w_out, mut p_in, mut p_out, _) = sealers(&TOKEN);
    let f0 = w_out.seal(Kind::Ready.byte(), b"info");
    let f1 = w_out.seal(Kind::Ready.byte(), b"more");
    // Reordered: frame 1 first.
    let mut fresh = p_in.clone();
    assert!(matches!(
        fresh.open(Kind::Ready.byte(), &f1),
        Err(LinkError::OutOfTurn { got: 1, due: 0 })
    ));
    // Altered payload, or kind.
    let mut altered = f0.clone();
    *altered.last_mut().unwrap() ^= 1;
    assert!(matches!(
        p_in.clone().open(Kind::Ready.byte(), &altered),
        Err(LinkError::BadSeal)
    ));
    assert!(matches!(
        p_in.clone().open(Kind::Leaving.byte(), &f0),
        Err(LinkError::BadSeal)
    ));
    // Unsealed (too short for a seal).
    assert!(matches!(
        p_in.clone().open(Kind::Ready.byte(), b"pickled"),
        Err(LinkError::Unsealed)
    ));
    // Reflected: the parent's own frame back to it.
    let s = p_out.seal(Kind::Stop.byte(), b"{}");
    assert!(matches!(
        p_in.clone().open(Kind::Stop.byte(), &s),
        Err(LinkError::BadSeal)
    ));
    // Replayed: frame 0 again after frame 0.
    assert_eq!(p_in.open(Kind::Ready.byte(), &f0).unwrap(), b"info");
    assert!(matches!(
        p_in.open(Kind::Ready.byte(), &f0),
        Err(LinkError::OutOfTurn { got: 0, due: 1 })
    ));
    // Another key or another session.
    let (mut other, ..) = sealers(&[8; 32]);
    assert!(matches!(
        p_in.clone()
            .open(Kind::Ready.byte(), &other.seal(Kind::Ready.byte(), b"x")),
        Err(LinkError::BadSeal)
    ));
    let mut other_session = SealOut::new(&TOKEN, &[9u8; 64], Side::Worker);
    other_session.seal(Kind::Ready.byte(), b"x");
    assert!(matches!(
        p_in.clone().open(
            Kind::Ready.byte(),
            &other_session.seal(Kind::Ready.byte(), b"more")
        ),
        Err(LinkError::BadSeal)
    ));
    // The genuine next frame still opens.
    assert_eq!(p_in.open(Kind::Ready.byte(), &f1).unwrap(), b"more");
}

#[test]
fn frames_round_trip_and_bad_lengths_or_truncation_are_clear_errors() {
    let mut wire = Vec::new();
    write_frame(&mut wire, b'R', b"abc").unwrap();
    assert_eq!(wire, b"\0\0\0\x04Rabc");
    assert_eq!(
        read_frame(&mut Cursor::new(&wire), 16).unwrap(),
        (b'R', b"abc".to_vec())
    );
    // Over the limit: refused before the body is read, nothing allocated.
    let err = read_frame(&mut Cursor::new(&wire), 3).unwrap_err();
    assert_eq!(err.to_string(), "bad frame length 4 (at most 3 here)");
    let huge = (u32::MAX).to_be_bytes();
    assert!(matches!(
        read_frame(&mut Cursor::new(&huge), MAX_FRAME),
        Err(LinkError::BadLength { length, .. }) if length == u64::from(u32::MAX)
    ));
    assert!(matches!(
        read_frame(&mut Cursor::new(&[0u8; 4]), 16),
        Err(LinkError::BadLength { length: 0, .. })
    ));
    // Truncated: in the length word, or in the body.
    assert!(matches!(
        read_frame(&mut Cursor::new(&wire[..2]), 16),
        Err(LinkError::Closed)
    ));
    assert!(matches!(
        read_frame(&mut Cursor::new(&wire[..6]), 16),
        Err(LinkError::Closed)
    ));
    assert!(matches!(
        read_frame(&mut Cursor::new(&[][..]), 16),
        Err(LinkError::Closed)
    ));
}

#[test]
fn the_hello_and_welcome_are_the_cores_mac_in_domains_of_their_own() {
    let (theirs, ours) = (new_nonce().unwrap(), new_nonce().unwrap());
    let proof = hello_mac(&TOKEN, &theirs, 3, 4242, "node-1", &ours);
    let parts: [&[u8]; 5] = [theirs.as_bytes(), b"3", b"4242", b"node-1", ours.as_bytes()];
    assert_eq!(proof, mac(&TOKEN, b"shmq worker hello", &parts));
    let welcome = welcome_mac(&TOKEN, &ours, &theirs, 3);
    assert_ne!(welcome, proof);
    let hello = Hello::new(&TOKEN, &theirs, 3, 4242, "node-1").unwrap();
    assert!(hello.is_genuine(&TOKEN, &theirs));
    assert!(!hello.is_genuine(&[8; 32], &theirs));
    assert!(!hello.is_genuine(&TOKEN, &ours));
    let decoded = Hello::check(Kind::Hello.byte(), &hello.encode(), &TOKEN, &theirs).unwrap();
    assert_eq!(decoded, hello);
    assert_eq!(
        Hello::check(Kind::Hello.byte(), &hello.encode(), &[8; 32], &theirs).unwrap_err(),
        "wrong token"
    );
    // The answer: admitted only with the parent's proof over this worker's nonce.
    let ok = welcome_payload(&TOKEN, &hello.nonce, &theirs, 3);
    read_answer(
        Kind::Answer.byte(),
        &ok,
        &TOKEN,
        &hello.nonce,
        &theirs,
        3,
        "p",
    )
    .unwrap();
    for (answer, rank, expect) in [
        (ok.clone(), 4, "without proving"),
        (
            welcome_payload(&[8; 32], &hello.nonce, &theirs, 3),
            3,
            "without proving",
        ),
        (
            br#"{"ok": true, "mac": "00"}"#.to_vec(),
            3,
            "without proving",
        ),
        (
            refusal_payload("wrong token"),
            3,
            "refused worker rank 3: wrong token",
        ),
        (b"not json".to_vec(), 3, "a malformed answer"),
    ] {
        let err = read_answer(
            Kind::Answer.byte(),
            &answer,
            &TOKEN,
            &hello.nonce,
            &theirs,
            rank,
            "p",
        )
        .unwrap_err();
        assert!(err.to_string().contains(expect), "{err}");
    }
}

#[test]
fn malformed_hellos_and_challenges_are_refused_with_a_reason() {
    let nonce = new_nonce().unwrap();
    let deep = "[".repeat(4095);
    for (kind, payload, expect) in [
        (b'X', b"{}".to_vec(), "malformed hello"),
        (b'H', deep.into_bytes(), "nested too deep"),
        (b'H', br#"{"":["#.repeat(800), "nested too deep"),
        (b'H', vec![0x80, 0x81, 0xff], "malformed hello"),
        (b'H', b"[1, 2]".to_vec(), "malformed hello"),
        (
            b'H',
            format!(
                r#"{{"rank": 4294967296, "pid": 1, "host": "h", "nonce": "{nonce}", "mac": ""}}"#
            )
            .into_bytes(),
            "malformed hello",
        ),
        (
            b'H',
            br#"{"rank": 0, "pid": 1, "host": "h", "mac": ""}"#.to_vec(),
            "no nonce",
        ),
        (
            b'H',
            format!(r#"{{"rank": 0, "pid": 1, "host": 7, "nonce": "{nonce}", "mac": ""}}"#)
                .into_bytes(),
            "malformed hello",
        ),
        (
            b'H',
            format!(r#"{{"rank": 0, "pid": 1, "host": "h", "nonce": "{nonce}", "mac": "zz"}}"#)
                .into_bytes(),
            "wrong token",
        ),
    ] {
        let err = Hello::check(kind, &payload, &TOKEN, &nonce).unwrap_err();
        assert!(
            err.contains(expect),
            "{err} for {:?}",
            String::from_utf8_lossy(&payload[..payload.len().min(40)])
        );
    }
    assert_eq!(
        read_challenge(b'C', &challenge_payload(&nonce), "p").unwrap(),
        nonce
    );
    let old = format!(r#"{{"nonce": "{nonce}"}}"#);
    let err = read_challenge(b'C', old.as_bytes(), "p").unwrap_err();
    assert!(
        err.to_string()
            .contains("speaks worker protocol 1, this worker 2"),
        "{err}"
    );
    assert!(matches!(
        read_challenge(b'A', b"{}", "p"),
        Err(LinkError::Malformed(_))
    ));
    assert!(matches!(
        read_challenge(b'C', br#"{"nonce": "ab"}"#, "p"),
        Err(LinkError::Malformed(_))
    ));
}

#[test]
fn a_ticket_prints_and_parses_and_refuses_anything_else() {
    let ticket = Ticket {
        host: "::1".into(),
        port: 5000,
        token: TOKEN,
    };
    let text = ticket.to_string();
    assert_eq!(
        text,
        format!("shmq-workers://[::1]:5000/{}", to_hex(&TOKEN))
    );
    assert_eq!(text.parse::<Ticket>().unwrap(), ticket);
    assert!(!format!("{ticket:?}").contains(&to_hex(&TOKEN)));
    let token = to_hex(&TOKEN);
    for bad in [
        String::new(),
        format!("http://h:1/{token}"),
        format!("shmq-workers://h/{token}"),
        format!("shmq-workers://:1/{token}"),
        format!("shmq-workers://h:x/{token}"),
        format!("shmq-workers://h:70000/{token}"),
        "shmq-workers://h:1/abc".into(),
    ] {
        assert!(bad.parse::<Ticket>().is_err(), "{bad}");
    }
}

/// A parent and a worker over loopback TCP, in threads: admitted, frames both ways, a
/// wrong token refused on both sides, and the worker's drop seen as the link's loss.
#[test]
fn a_worker_joins_over_tcp_and_a_wrong_token_is_refused() {
    let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
    let ticket = listener.ticket().clone();
    let worker = std::thread::spawn(move || {
        let mut link = ParentLink::connect(&ticket, 1, Duration::from_secs(10)).unwrap();
        link.send_ready(b"raw bytes").unwrap();
        assert_eq!(
            link.recv().unwrap(),
            ParentMessage::SiblingFailed(b"Worker_0 died".to_vec())
        );
        let ParentMessage::Stop { grace } = link.recv().unwrap() else {
            panic!("no stop")
        };
        assert_eq!(grace, Duration::from_millis(1500));
        link.send_leaving(0, &["bye".into()]).unwrap();
    });
    let mut admitted = listener
        .accept(|h| {
            if h.rank == 1 {
                Ok(())
            } else {
                Err("no".into())
            }
        })
        .unwrap();
    assert_eq!((admitted.rank(), admitted.pid()), (1, std::process::id()));
    assert_eq!(
        admitted.recv().unwrap(),
        WorkerMessage::Ready(b"raw bytes".to_vec())
    );
    admitted.send_sibling_failed(b"Worker_0 died").unwrap();
    admitted.send_stop(Duration::from_millis(1500)).unwrap();
    assert_eq!(
        admitted.recv().unwrap(),
        WorkerMessage::Leaving {
            exitcode: 0,
            stderr: vec!["bye".into()]
        }
    );
    worker.join().unwrap();
    match admitted.recv() {
        Err(crate::Error::Link(e)) => assert!(e.is_loss(), "{e}"),
        other => panic!("expected the link's loss, got {other:?}"),
    }

    // A wrong token: the parent refuses it, and the worker hears why.
    let mut wrong = listener.ticket().clone();
    wrong.token = [0; 32];
    let worker =
        std::thread::spawn(move || ParentLink::connect(&wrong, 1, Duration::from_secs(10)).err());
    let err = listener.accept(|_| Ok(())).err().unwrap();
    assert!(err.to_string().contains("wrong token"), "{err}");
    let err = worker.join().unwrap().unwrap();
    assert!(
        err.to_string()
            .contains("refused worker rank 1: wrong token"),
        "{err}"
    );
    // A rank the parent does not expect: admit's reason.
    let ticket = listener.ticket().clone();
    let worker =
        std::thread::spawn(move || ParentLink::connect(&ticket, 7, Duration::from_secs(10)).err());
    assert!(listener
        .accept(|h| Err(format!("rank {} is not a remote rank", h.rank)))
        .is_err());
    let err = worker.join().unwrap().unwrap();
    assert!(
        err.to_string().contains("rank 7 is not a remote rank"),
        "{err}"
    );
}

/// A stranger that sends an oversized length or nothing at all: a clear error for the
/// parent, never a panic (and the silent one is dropped at the deadline, tested with a
/// short one through `Deadlined` in `read_frame`).
#[test]
fn a_stranger_on_the_port_gets_a_clear_error() {
    let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
    let port = listener.ticket().port;
    let stranger = std::thread::spawn(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (k, _) = read_frame(&mut s, MAX_FRAME).unwrap();
        assert_eq!(k, Kind::Challenge.byte());
        write_frame(&mut s, Kind::Hello.byte(), &vec![b'['; MAX_HELLO_FRAME]).unwrap();
    });
    let err = listener.accept(|_| Ok(())).err().unwrap();
    let crate::Error::Link(LinkError::HandshakeFrameTooLong { peer, length, max }) = &err else {
        panic!("expected HandshakeFrameTooLong, got {err:?}");
    };
    assert!(peer.starts_with("127.0.0.1:"), "{peer}");
    assert_eq!((*length, *max), (4097, MAX_HELLO_FRAME));
    assert!(
        err.to_string()
            .contains("handshake frame of 4097 bytes, over the handshake's limit of 4096 bytes"),
        "{err}"
    );
    stranger.join().unwrap();
}

/// A stranger posing as the parent (a plain TCP server on the ticket's address) that
/// drips its challenge a byte every 100 ms: every read of the worker gets a byte well
/// within `timeout`, but the worker's handshake has one deadline, so `connect` gives up
/// at it (before, the timeout was per read: it waited as long as the bytes came).
#[test]
fn a_worker_gives_up_on_a_dripping_parent_at_its_one_deadline() {
    use std::io::Write;
    use std::time::Instant;
    for drip_answer in [false, true] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ticket = Ticket {
            host: "127.0.0.1".into(),
            port: listener.local_addr().unwrap().port(),
            token: TOKEN,
        };
        let stranger = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let challenge = challenge_payload(&new_nonce().unwrap());
            let mut wire = Vec::new();
            write_frame(&mut wire, Kind::Challenge.byte(), &challenge).unwrap();
            if drip_answer {
                // A genuine-looking challenge at once, then the answer drips.
                s.write_all(&wire).unwrap();
                read_frame(&mut s, MAX_HELLO_FRAME).unwrap();
                wire = Vec::new();
                write_frame(
                    &mut wire,
                    Kind::Answer.byte(),
                    &refusal_payload(&"x".repeat(100)),
                )
                .unwrap();
            }
            // 100 ms a byte: at most 8 s, then it stops (and the test fails, if the
            // worker was still reading).
            for b in wire.iter().take(80) {
                if s.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let start = Instant::now();
        let err = ParentLink::connect(&ticket, 0, Duration::from_millis(700))
            .err()
            .unwrap();
        let took = start.elapsed();
        assert!(
            matches!(err, crate::Error::Link(LinkError::TimedOut)),
            "{drip_answer}: {err}"
        );
        assert!(took < Duration::from_secs(4), "{drip_answer}: {took:?}");
        stranger.join().unwrap();
    }
}

/// A stranger posing as the parent that announces a 64 MiB challenge (or answer): the
/// worker refuses the length as it reads it, naming the peer and the limit, and reads
/// none of the body.
#[test]
fn a_worker_refuses_a_huge_handshake_frame_at_its_length() {
    use std::io::Write;
    for huge_answer in [false, true] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let ticket = Ticket {
            host: "127.0.0.1".into(),
            port,
            token: TOKEN,
        };
        let stranger = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            if huge_answer {
                let nonce = new_nonce().unwrap();
                write_frame(&mut s, Kind::Challenge.byte(), &challenge_payload(&nonce)).unwrap();
                read_frame(&mut s, MAX_HELLO_FRAME).unwrap();
            }
            let k = if huge_answer {
                Kind::Answer.byte()
            } else {
                Kind::Challenge.byte()
            };
            s.write_all(&(64u32 << 20).to_be_bytes()).unwrap();
            s.write_all(&[k]).unwrap();
            // Then body bytes until the worker hangs up: none of them is read.
            let chunk = vec![b' '; 1 << 16];
            let mut sent = 0usize;
            while sent < 64 << 20 && s.write_all(&chunk).is_ok() {
                sent += chunk.len();
            }
        });
        let err = ParentLink::connect(&ticket, 0, Duration::from_secs(10))
            .err()
            .unwrap();
        let crate::Error::Link(LinkError::HandshakeFrameTooLong { peer, length, max }) = &err
        else {
            panic!("expected HandshakeFrameTooLong, got {err:?}");
        };
        assert_eq!(
            (peer.as_str(), *length, *max),
            (
                format!("127.0.0.1:{port}").as_str(),
                64 << 20,
                MAX_HELLO_FRAME
            )
        );
        assert!(
            err.to_string().starts_with(&format!(
                "127.0.0.1:{port} sent a handshake frame of 67108864 bytes, over the \
                 handshake's limit of 4096 bytes"
            )),
            "{err}"
        );
        stranger.join().unwrap();
    }
}

/// An admitted worker that sends a frame over `MAX_FRAME`: the parent refuses its
/// length as it reads it (naming the worker's address and the limit) and the link is
/// over; frames up to the limit arrive whole.
#[test]
fn an_admitted_peers_frame_over_the_limit_ends_the_link() {
    use std::io::Write;
    let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
    let ticket = listener.ticket().clone();
    let worker = std::thread::spawn(move || {
        let link = ParentLink::connect(&ticket, 0, Duration::from_secs(10)).unwrap();
        link.send_ready(&vec![3u8; MAX_FRAME - SEAL_BYTES - 1])
            .unwrap();
        let mut raw = link.stream();
        let _ = raw.write_all(&(MAX_FRAME as u32 + 1).to_be_bytes());
        let _ = raw.write_all(&[Kind::Ready.byte(); 1 << 16]);
        link
    });
    let mut admitted = listener.accept(|_| Ok(())).unwrap();
    let peer = admitted.peer().to_string();
    match admitted.recv().unwrap() {
        WorkerMessage::Ready(p) => {
            assert!(p.len() == MAX_FRAME - SEAL_BYTES - 1 && p.iter().all(|&b| b == 3))
        }
        other => panic!("{other:?}"),
    }
    let err = admitted.recv().unwrap_err();
    let crate::Error::Link(LinkError::FrameTooLong {
        peer: named,
        length,
        max,
    }) = &err
    else {
        panic!("expected FrameTooLong, got {err:?}");
    };
    assert_eq!(
        (named, *length, *max),
        (&peer, MAX_FRAME as u64 + 1, MAX_FRAME)
    );
    assert!(
        err.to_string()
            .contains(&format!("over the link's limit of {MAX_FRAME} bytes")),
        "{err}"
    );
    drop(worker.join().unwrap());
}

/// A frame's body is read as it comes: a peer that claims a long frame and sends a few
/// bytes of it costs a buffer sized by what came, not by the claim.
#[test]
fn a_frames_buffer_grows_with_what_arrived() {
    let mut wire = (MAX_FRAME as u32).to_be_bytes().to_vec();
    wire.push(Kind::Ready.byte());
    wire.extend_from_slice(&[9; 100]);
    /// Records the most room a read was offered.
    struct Tracked<'a>(Cursor<&'a Vec<u8>>, usize);
    impl std::io::Read for Tracked<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.1 = self.1.max(buf.len());
            self.0.read(buf)
        }
    }
    let mut tracked = Tracked(Cursor::new(&wire), 0);
    assert!(matches!(
        read_frame_from(&mut tracked, MAX_FRAME, "here", false),
        Err(LinkError::Closed)
    ));
    assert!(tracked.1 <= 64 << 10, "offered {} bytes of room", tracked.1);
    // And a whole frame arrives as it was sent, over several reads.
    let mut wire = Vec::new();
    let payload: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
    write_frame(&mut wire, Kind::Ready.byte(), &payload).unwrap();
    assert_eq!(
        read_frame_from(&mut Cursor::new(&wire), MAX_FRAME, "here", false).unwrap(),
        (Kind::Ready.byte(), payload)
    );
    let refusal = refusal_payload(&"\u{1}".repeat(10_000));
    assert!(refusal.len() <= MAX_HELLO_FRAME, "{}", refusal.len());
}

/// A peer that drips a byte now and then cannot stretch the handshake's read past its
/// one deadline (the parent's `Deadlined` reads, shortened here).
#[test]
fn a_dripping_peer_is_cut_off_at_the_deadline() {
    use std::io::Write;
    use std::time::Instant;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let drip = std::thread::spawn(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        for b in [0u8, 0, 0, 200, b'H']
            .into_iter()
            .chain(std::iter::repeat_n(b'x', 40))
        {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let (stream, _) = listener.accept().unwrap();
    let start = Instant::now();
    let mut reader = endpoint::Deadlined {
        stream: &stream,
        deadline: start + Duration::from_millis(300),
    };
    let err = read_frame(&mut reader, MAX_HELLO_FRAME).unwrap_err();
    assert!(matches!(err, LinkError::TimedOut), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    drop(stream);
    drip.join().unwrap();
}

/// A proof reflected into the other message fails: the worker's hello proof offered back
/// to it as the parent's welcome (a stranger posing as the parent), and a parent's welcome
/// proof offered to the parent as a hello (a stranger posing as a worker). The domains
/// (and parts) differ, so neither side computes anything the other side accepts.
#[test]
fn a_proof_reflected_into_the_other_message_fails() {
    let (parent_nonce, worker_nonce) = (new_nonce().unwrap(), new_nonce().unwrap());
    // Posing as the parent: the worker's own proof as the welcome's.
    let hello = Hello::new(&TOKEN, &parent_nonce, 3, 4242, "node-1").unwrap();
    let reflected = serde_json::json!({"ok": true, "mac": hello.mac}).to_string();
    let err = read_answer(
        Kind::Answer.byte(),
        reflected.as_bytes(),
        &TOKEN,
        &hello.nonce,
        &parent_nonce,
        3,
        "p",
    )
    .unwrap_err();
    assert!(
        matches!(&err, LinkError::Refused(m) if m.contains("without proving")),
        "{err}"
    );
    // Posing as a worker: a welcome's proof (over nonces of the stranger's choosing,
    // the parent's challenge among them) as a hello's.
    let welcome = welcome_mac(&TOKEN, &worker_nonce, &parent_nonce, 3);
    let forged = Hello {
        rank: 3,
        pid: 4242,
        host: "node-1".into(),
        nonce: worker_nonce.clone(),
        mac: to_hex(&welcome),
    };
    assert_eq!(
        Hello::check(Kind::Hello.byte(), &forged.encode(), &TOKEN, &parent_nonce).unwrap_err(),
        "wrong token"
    );
    let swapped = welcome_mac(&TOKEN, &parent_nonce, &worker_nonce, 3);
    let forged = Hello {
        mac: to_hex(&swapped),
        ..forged
    };
    assert_eq!(
        Hello::check(Kind::Hello.byte(), &forged.encode(), &TOKEN, &parent_nonce).unwrap_err(),
        "wrong token"
    );
}

/// Both ends of an admitted link turn TCP keepalive on (a peer machine that vanishes
/// ends a blocking `recv` as a loss, not never); a payload too big for a frame is refused
/// by its sender, before it is sealed, and the link goes on with the next.
#[test]
fn both_ends_keep_alive_and_an_oversized_payload_is_refused_before_it_is_sent() {
    fn keepalive_on(stream: &TcpStream) -> bool {
        use std::os::fd::AsRawFd;
        let mut on: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt(2) on the stream's own open socket, writing at most `len`
        // bytes into `on`, which lives through the call.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_KEEPALIVE,
                (&mut on as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        on != 0
    }
    let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
    let ticket = listener.ticket().clone();
    let worker = std::thread::spawn(move || {
        let link = ParentLink::connect(&ticket, 0, Duration::from_secs(10)).unwrap();
        assert!(keepalive_on(link.stream()), "the worker's end");
        let too_big = vec![0u8; MAX_FRAME - SEAL_BYTES];
        match link.send_ready(&too_big) {
            Err(crate::Error::Link(LinkError::BadLength { length, max })) => {
                assert_eq!((length, max), (MAX_FRAME as u64 + 1, MAX_FRAME));
            }
            other => panic!("expected BadLength, got {other:?}"),
        }
        // The largest payload that fits, then a small one: both arrive, in turn.
        link.send_ready(&too_big[1..]).unwrap();
        link.send_ready(b"next").unwrap();
        link
    });
    let mut admitted = listener.accept(|_| Ok(())).unwrap();
    assert!(keepalive_on(admitted.stream()), "the parent's end");
    match admitted.recv().unwrap() {
        WorkerMessage::Ready(p) => assert_eq!(p.len(), MAX_FRAME - SEAL_BYTES - 1),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        admitted.recv().unwrap(),
        WorkerMessage::Ready(b"next".to_vec())
    );
    drop(worker.join().unwrap());
}

/// A worker that half-closes its end, here in the middle of a frame: the parent's `recv`
/// ends with the link's loss (not a hang, not a frame), and the other direction still
/// carries the parent's stop to the worker.
#[test]
fn a_half_closed_link_ends_the_parents_reads_as_a_loss() {
    use std::io::Write;
    let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
    let ticket = listener.ticket().clone();
    let worker = std::thread::spawn(move || {
        let mut link = ParentLink::connect(&ticket, 0, Duration::from_secs(10)).unwrap();
        link.send_ready(b"up").unwrap();
        let mut raw = link.stream();
        raw.write_all(&[0, 0, 0, 100, Kind::Ready.byte(), 1, 2])
            .unwrap(); // 7 of 104 bytes
        raw.shutdown(std::net::Shutdown::Write).unwrap();
        link.recv().unwrap()
    });
    let mut admitted = listener.accept(|_| Ok(())).unwrap();
    assert_eq!(
        admitted.recv().unwrap(),
        WorkerMessage::Ready(b"up".to_vec())
    );
    match admitted.recv() {
        Err(crate::Error::Link(e)) => {
            assert!(matches!(e, LinkError::Closed), "{e}");
            assert!(e.is_loss());
        }
        other => panic!("expected the link's loss, got {other:?}"),
    }
    admitted.send_stop(Duration::from_secs(2)).unwrap();
    assert_eq!(
        worker.join().unwrap(),
        ParentMessage::Stop {
            grace: Duration::from_secs(2)
        }
    );
}

/// After the handshake, a sealed frame of a kind that is never the peer's to send (a
/// handshake's, or this side's own) ends the link with `UnexpectedKind` on either end;
/// a kind this version does not know is skipped (a newer peer's), and the next frame
/// arrives.
#[test]
fn a_sealed_frame_of_the_wrong_kind_ends_the_link() {
    for wrong in [
        Kind::Challenge.byte(),
        Kind::Hello.byte(),
        Kind::Answer.byte(),
        Kind::Stop.byte(),
        Kind::SiblingFailed.byte(),
    ] {
        let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
        let ticket = listener.ticket().clone();
        let worker = std::thread::spawn(move || {
            let link = ParentLink::connect(&ticket, 0, Duration::from_secs(10)).unwrap();
            let sender = link.sender();
            sender.send(b'Z', b"a newer worker's").unwrap();
            sender.send(Kind::Ready.byte(), b"up").unwrap();
            sender.send(wrong, b"{}").unwrap();
            link
        });
        let mut admitted = listener.accept(|_| Ok(())).unwrap();
        assert_eq!(
            admitted.recv().unwrap(),
            WorkerMessage::Ready(b"up".to_vec())
        );
        match admitted.recv() {
            Err(crate::Error::Link(LinkError::UnexpectedKind { kind })) => {
                assert_eq!(kind, char::from(wrong));
            }
            other => panic!(
                "{}: expected UnexpectedKind, got {other:?}",
                char::from(wrong)
            ),
        }
        drop(worker.join().unwrap());
    }
    for wrong in [
        Kind::Challenge.byte(),
        Kind::Hello.byte(),
        Kind::Answer.byte(),
        Kind::Ready.byte(),
        Kind::Leaving.byte(),
    ] {
        let listener = WorkerListener::bind("127.0.0.1:0").unwrap();
        let ticket = listener.ticket().clone();
        let worker = std::thread::spawn(move || {
            let mut link = ParentLink::connect(&ticket, 0, Duration::from_secs(10)).unwrap();
            let first = link.recv().unwrap();
            (first, link.recv().map(|_| ()))
        });
        let admitted = listener.accept(|_| Ok(())).unwrap();
        let sender = admitted.sender();
        sender.send(b'Z', b"a newer parent's").unwrap();
        admitted.send_sibling_failed(b"Worker_1 died").unwrap();
        sender.send(wrong, b"{}").unwrap();
        let (first, second) = worker.join().unwrap();
        assert_eq!(
            first,
            ParentMessage::SiblingFailed(b"Worker_1 died".to_vec())
        );
        match second {
            Err(crate::Error::Link(LinkError::UnexpectedKind { kind })) => {
                assert_eq!(kind, char::from(wrong));
            }
            other => panic!(
                "{}: expected UnexpectedKind, got {other:?}",
                char::from(wrong)
            ),
        }
    }
}

proptest! {
    /// Whatever bytes arrive, reading and opening a frame returns an error or a frame,
    /// never a panic; and a frame with any one byte flipped never opens.
    #[test]
    fn hostile_bytes_never_panic(wire in proptest::collection::vec(any::<u8>(), 0..200), flip in 0usize..200) {
        let (mut w_out, p_in, ..) = sealers(&TOKEN);
        if let Ok((k, body)) = read_frame(&mut Cursor::new(&wire), 1 << 10) {
            let _ = p_in.clone().open(k, &body);
        }
        let _ = Hello::check(Kind::Hello.byte(), &wire, &TOKEN, &to_hex(&[1; 32]));
        let _ = read_challenge(Kind::Challenge.byte(), &wire, "p");
        let body = w_out.seal(Kind::Ready.byte(), &wire);
        let i = flip % body.len();
        let mut bad = body.clone();
        bad[i] ^= 0x5a;
        prop_assert!(p_in.clone().open(Kind::Ready.byte(), &bad).is_err());
        prop_assert_eq!(p_in.clone().open(Kind::Ready.byte(), &body).unwrap(), &wire[..]);
    }

    #[test]
    fn a_hello_round_trips_for_any_rank_pid_and_host(rank: u32, pid: u32, host in "\\PC{0,60}") {
        let nonce = to_hex(&[3; 32]);
        let hello = Hello::new(&TOKEN, &nonce, rank, pid, &host).unwrap();
        prop_assert_eq!(Hello::check(Kind::Hello.byte(), &hello.encode(), &TOKEN, &nonce).unwrap(), hello);
        prop_assert!(secret_from_text(&new_nonce().unwrap()).is_some());
    }
}

/// A connected pair on loopback: (the accepted end, the connecting end).
fn tcp_pair(listener: &std::net::TcpListener) -> (TcpStream, TcpStream) {
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    (server, client)
}

/// Whether the peer of `client` hung up (its reads, past what it sent, see the end or a
/// reset), waiting 50 ms for it at most.
fn hung_up(client: &TcpStream) -> bool {
    use std::io::Read;
    client
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut buf = [0u8; 256];
    loop {
        match (&*client).read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                )
            }
        }
    }
}

#[test]
fn kinds_are_one_enum_of_distinct_bytes_each_named_and_sent_by_one_side() {
    let mut bytes: Vec<u8> = Kind::ALL.iter().map(|k| k.byte()).collect();
    bytes.sort_unstable();
    bytes.dedup();
    assert_eq!(bytes.len(), Kind::ALL.len());
    for &kind in Kind::ALL {
        assert_eq!(Kind::from_byte(kind.byte()), Some(kind));
        assert!(!kind.name().is_empty());
    }
    assert_eq!(Kind::from_byte(b'Z'), None);
    assert_eq!(
        Kind::ALL.iter().filter(|k| k.from_parent()).count(),
        4,
        "challenge, answer, stop, sibling failed"
    );
    assert_eq!(Kind::ALL.iter().filter(|k| k.in_handshake()).count(), 3);
}

#[test]
fn a_full_table_drops_the_oldest_waiting_connection_of_the_host_with_most() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let slots = HandshakeSlots::new(4);
    let (a, b): (std::net::IpAddr, std::net::IpAddr) =
        ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
    let mut held = Vec::new();
    // A genuine worker from host b, waiting for its hello, then three strangers from a.
    let (worker, worker_client) = tcp_pair(&listener);
    let (worker_slot, none) = slots.take(&worker, b).unwrap();
    assert_eq!(none, None);
    for _ in 0..3 {
        let (server, client) = tcp_pair(&listener);
        let (slot, evicted) = slots.take(&server, a).unwrap();
        assert_eq!(evicted, None);
        held.push((server, client, slot));
    }
    assert_eq!(slots.taken(), 4);
    // Ten more strangers from a: each pushes out a's oldest, never b's worker.
    for i in 0..10 {
        let (server, client) = tcp_pair(&listener);
        let (slot, evicted) = slots.take(&server, a).unwrap();
        assert_eq!(evicted, Some(a), "stranger {i}");
        let (_, gone_client, gone_slot) = held.remove(0);
        assert!(
            hung_up(&gone_client),
            "the evicted connection was shut down"
        );
        assert!(!gone_slot.hello_arrived(), "its hello comes too late");
        assert!(gone_slot.evicted());
        held.push((server, client, slot));
    }
    assert!(
        !hung_up(&worker_client),
        "the worker's connection is intact"
    );
    assert!(worker_slot.hello_arrived() && !worker_slot.evicted());
    assert_eq!(slots.taken(), 4);
    // Three connections from b: while a has more waiting, a's oldest gives way; once b
    // has more, b's oldest (the worker is past its hello now, so never it).
    let mut from_b = Vec::new();
    for want in [a, a, b] {
        let (server, client) = tcp_pair(&listener);
        let (slot, evicted) = slots.take(&server, b).unwrap();
        assert_eq!(evicted, Some(want));
        from_b.push((server, client, slot));
    }
    assert!(hung_up(&from_b[0].1) && !hung_up(&worker_client));
    let (server, _client) = tcp_pair(&listener);
    let (last, evicted) = slots.take(&server, a).unwrap();
    assert_eq!(evicted, Some(b), "b has two waiting, a one");
    assert!(hung_up(&from_b[1].1) && !hung_up(&from_b[2].1));
    // Every slot past its hello: a new connection gets none (the caller closes it).
    assert!(held[0].2.evicted() && held[1].2.evicted());
    assert!(held[2].2.hello_arrived() && from_b[2].2.hello_arrived() && last.hello_arrived());
    let (server, _client) = tcp_pair(&listener);
    assert!(slots.take(&server, a).is_none());
    // A slot dropped is free again.
    drop(worker_slot);
    assert_eq!(slots.taken(), 3);
    assert!(slots.take(&server, a).is_some());
}

/// A parent admitting with `Workers::admit_remote` on loopback: 40 silent strangers from
/// one host hold the port first (more than its 32 handshake slots); a genuine worker
/// joining then is admitted at once (a waiting stranger gives way), not after the
/// strangers' deadline; the strangers left are dropped at their handshake's deadline,
/// which frees their slots.
#[test]
fn silent_strangers_in_every_slot_do_not_keep_a_worker_out_and_go_at_the_deadline() {
    use crate::{WorkerOptions, Workers};
    let workers = Workers::new(0, 1, WorkerOptions::default()).unwrap();
    let ticket = workers
        .admit_remote(WorkerListener::bind("127.0.0.1:0").unwrap())
        .unwrap();
    let address = (ticket.host.as_str(), ticket.port);
    let start = std::time::Instant::now();
    let strangers: Vec<TcpStream> = (0..40)
        .map(|_| {
            let s = TcpStream::connect(address).unwrap();
            // Each has its challenge (its handshake started), or was dropped already.
            let _ = read_frame(&mut &s, MAX_HELLO_FRAME);
            s
        })
        .collect();
    let joined = std::time::Instant::now();
    let worker = std::thread::spawn({
        let ticket = ticket.clone();
        move || {
            let parent = ParentLink::connect(&ticket, 0, Duration::from_secs(30)).unwrap();
            parent.send_ready(b"in").unwrap();
            parent
        }
    });
    workers
        .wait_until_ready(HANDSHAKE_TIMEOUT / 2)
        .expect("admitted past the strangers, before their deadline");
    assert!(joined.elapsed() < HANDSHAKE_TIMEOUT / 2);
    let parent = worker.join().unwrap();
    // 8 dropped for newer strangers, 1 for the worker: the rest wait for their deadline.
    let open = strangers.iter().filter(|s| !hung_up(s)).count();
    assert_eq!(open, 31, "{open} strangers still held a slot");
    for s in &strangers {
        s.set_read_timeout(Some(HANDSHAKE_TIMEOUT + Duration::from_secs(5)))
            .unwrap();
        let mut byte = [0u8; 1];
        let got = std::io::Read::read(&mut &*s, &mut byte);
        assert!(matches!(got, Ok(0) | Err(_)), "{got:?}");
    }
    let took = start.elapsed();
    assert!(
        took >= HANDSHAKE_TIMEOUT - Duration::from_millis(500)
            && took <= HANDSHAKE_TIMEOUT + Duration::from_secs(5),
        "the strangers were dropped after {took:?}"
    );
    workers.close();
    drop(parent);
}
