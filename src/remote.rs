//! The remote stream: every message to the readers on other machines, over TCP, to
//! readers that proved they hold the queue's secret, each message authenticated.
//!
//! Anyone who can reach the writer's port can connect to it, and anyone can bind that
//! port once the writer is gone; neither may count as a reader, receive messages, or
//! make a reader unpickle bytes of its own. So:
//!
//! - The writer makes a 32-byte secret; it travels in the [`Handle`](crate::Handle), over
//!   the user's own trusted channel (like the handle itself).
//! - The writer's socket is a ZeroMQ ROUTER: it sends to each reader it accepted, and to
//!   nobody else. A reader (DEALER) says HELLO with its rank, a fresh nonce and a MAC of
//!   both under the secret; the writer accepts one reader per rank, at most as many as
//!   it has remote readers, and answers WELCOME with the session id and a MAC that binds
//!   it to the reader's nonce — so a reader knows it talks to the writer, not to a
//!   process that took a dead writer's port. Anything else that arrives is dropped.
//! - Every message carries the session id, a sequence number (1, 2, ...) and a MAC of
//!   all its frames; a reader refuses a message that fails any of the three, before
//!   anything is unpickled.
//! - Sends are bounded: each reader has a queue of at most `hwm` messages in the writer
//!   ([`RemoteOptions`]); when it is full the writer waits for that reader (`Block`, the
//!   default: bounded by the enqueue's timeout) or stops sending to it (`Drop`).
//!
//! The MAC is BLAKE3 in keyed mode (a MAC by design; several GB/s, so tensor-sized
//! messages stay cheap). Messages are authenticated, not encrypted: a network where
//! eavesdropping matters needs a tunnel (WireGuard, SSH) under it.
//!
//! - The writer's end (its `shutdown()` or its normal end) is a last message of its own
//!   kind, CLOSED, with the next sequence number and a MAC: a reader that takes it has
//!   every message before it and then fails with [`Error::WriterShutDown`]. The reader
//!   answers `"SQB1"` (BYE), which the writer waits for a short while, so that a writer
//!   process that exits at once still gets the message out.
//!
//! Frames, writer to reader: `[header, frame 1, ..]`, `header` =
//! `"SQM1" | kind u8 | 3 zero bytes | seq u64 | session [16] | mac [32]` (64 bytes).
//! Reader to writer: one frame, `"SQH1" | rank u64 | nonce [16] | mac [32]`.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::fork::LeakInChild;
use crate::transport::poll_slice;
use crate::wait::Wait;

/// Bytes of the queue's secret.
pub const SECRET_BYTES: usize = 32;
const HEADER: usize = 64;
const HELLO: usize = 4 + 8 + 16 + 32;
const MAGIC_MESSAGE: &[u8; 4] = b"SQM1";
const MAGIC_HELLO: &[u8; 4] = b"SQH1";
/// A reader's acknowledgement of the CLOSED message (see `RemoteWriter::close`).
const MAGIC_BYE: &[u8; 4] = b"SQB1";
const KIND_DATA: u8 = 0;
const KIND_WELCOME: u8 = 1;
const KIND_READY: u8 = 2;
const KIND_REFUSED: u8 = 3;
const KIND_CLOSED: u8 = 4;
/// How long closing the writer's socket may still flush queued messages.
const LINGER_MS: i32 = 1000;

/// A secret of [`SECRET_BYTES`] random bytes, from the kernel.
pub fn new_secret() -> Result<[u8; SECRET_BYTES]> {
    crate::random::random_bytes("the queue's remote secret")
}

fn random16() -> Result<[u8; 16]> {
    crate::random::random_bytes("a remote session id or nonce")
}

/// The MAC of the parts `parts` (each length-prefixed, after a domain tag).
fn mac(key: &[u8; SECRET_BYTES], tag: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&(tag.len() as u64).to_le_bytes());
    h.update(tag);
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p);
    }
    *h.finalize().as_bytes()
}

/// Compare MACs in constant time (blake3's `Hash` equality is constant-time).
fn mac_eq(a: &[u8; 32], b: &[u8]) -> bool {
    <[u8; 32]>::try_from(b).is_ok_and(|b| blake3::Hash::from(*a) == blake3::Hash::from(b))
}

fn header(kind: u8, seq: u64, session: &[u8; 16], mac: &[u8; 32]) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(MAGIC_MESSAGE);
    h[4] = kind;
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    h[16..32].copy_from_slice(session);
    h[32..64].copy_from_slice(mac);
    h
}

/// What the writer does with a remote reader whose queue (`hwm` messages) is full.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SlowReaderPolicy {
    /// Wait until it takes messages again, within the enqueue's timeout.
    #[default]
    Block,
    /// Stop sending to it (it sees a gap and fails); the others go on.
    Drop,
}

/// How the remote stream is bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteOptions {
    /// Messages queued in the writer per remote reader, at most.
    pub hwm: i32,
    pub slow_reader: SlowReaderPolicy,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            hwm: 1000,
            slow_reader: SlowReaderPolicy::Block,
        }
    }
}

fn socket(ctx: &zmq::Context, kind: zmq::SocketType, what: &str) -> Result<zmq::Socket> {
    ctx.socket(kind)
        .map_err(Error::transport(format!("creating the {what} socket")))
}

/// A remote reader the writer accepted.
#[derive(Debug)]
struct Peer {
    id: Vec<u8>,
    rank: u64,
    dropped: bool,
    /// Its address as ZeroMQ saw the connection ("Peer-Address"), for warnings.
    host: Option<String>,
}

/// The writer's end of the remote stream.
pub struct RemoteWriter {
    socket: LeakInChild<zmq::Socket>,
    endpoint: String,
    key: [u8; SECRET_BYTES],
    session: [u8; 16],
    /// Ranks that are the local readers' (never accepted here).
    local_ranks: Vec<usize>,
    expected: usize,
    peers: Vec<Peer>,
    seq: u64,
    ready: bool,
    options: RemoteOptions,
    /// When the HELLOs were last looked at while sending (see `send`).
    hellos_served: Instant,
}

/// How long closing waits for the readers' BYE (see [`RemoteWriter::close`]).
const BYE_WAIT: Duration = Duration::from_millis(200);

/// How often a sending writer looks for HELLOs (late or duplicate readers): often enough
/// to answer them promptly, rarely enough to cost nothing per message.
const HELLO_INTERVAL: Duration = Duration::from_millis(10);

impl std::fmt::Debug for RemoteWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteWriter")
            .field("endpoint", &self.endpoint)
            .field("peers", &self.peers)
            .finish()
    }
}

impl RemoteWriter {
    /// Bind on `ip` (IPv4, or IPv6 with or without brackets), a port chosen by the OS,
    /// for `expected` remote readers (any ranks but `local_ranks`). Returns the writer
    /// and whether the address is IPv6.
    pub fn bind(
        ctx: &zmq::Context,
        ip: &str,
        key: [u8; SECRET_BYTES],
        expected: usize,
        local_ranks: Vec<usize>,
        options: RemoteOptions,
    ) -> Result<(RemoteWriter, bool)> {
        let bare = ip.trim_start_matches('[').trim_end_matches(']');
        let ipv6 = bare.contains(':');
        let addr = if ipv6 {
            format!("tcp://[{bare}]:*")
        } else {
            format!("tcp://{bare}:*")
        };
        let s = socket(ctx, zmq::ROUTER, "remote")?;
        let opt = |what: &str| Error::transport(format!("setting {what} on the remote socket"));
        s.set_router_mandatory(true)
            .map_err(opt("ROUTER_MANDATORY"))?;
        s.set_sndhwm(options.hwm.max(1)).map_err(opt("SNDHWM"))?;
        // What readers send is tiny (HELLOs); a flood of garbage is dropped at 1000.
        s.set_rcvhwm(1000).map_err(opt("RCVHWM"))?;
        s.set_maxmsgsize(HELLO as i64 * 4)
            .map_err(opt("MAXMSGSIZE"))?;
        s.set_linger(LINGER_MS).map_err(opt("LINGER"))?;
        s.set_ipv6(ipv6).map_err(opt("IPV6"))?;
        crate::transport::check_endpoint(&addr)?;
        s.bind(&addr).map_err(crate::transport::endpoint_error(
            "binding the remote socket".into(),
            &addr,
        ))?;
        let endpoint = s
            .get_last_endpoint()
            .map_err(Error::transport("reading the bound endpoint"))?
            .map_err(|_| Error::InvalidArgument("the bound endpoint is not UTF-8".into()))?;
        Ok((
            RemoteWriter {
                socket: LeakInChild::new(s),
                endpoint,
                key,
                session: random16()?,
                local_ranks,
                expected,
                peers: Vec::new(),
                seq: 0,
                ready: false,
                options,
                hellos_served: Instant::now(),
            },
            ipv6,
        ))
    }

    /// The address readers connect to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Ranks accepted so far.
    pub fn readers(&self) -> Vec<u64> {
        self.peers.iter().map(|p| p.rank).collect()
    }

    /// Each accepted reader: rank, address (as ZeroMQ saw it) and whether it was dropped.
    pub fn peers(&self) -> Vec<(u64, Option<String>, bool)> {
        self.peers
            .iter()
            .map(|p| (p.rank, p.host.clone(), p.dropped))
            .collect()
    }

    /// Take the HELLOs that have arrived: accept the good ones, refuse duplicates and
    /// extra ranks, ignore anything else.
    fn serve_hellos(&mut self) -> Result<()> {
        loop {
            // Frame by frame (not `recv_multipart`) to keep the last frame's metadata:
            // the peer's address, which names the reader in warnings.
            let mut frames: Vec<Vec<u8>> = Vec::with_capacity(2);
            let mut host = None;
            loop {
                let flags = if frames.is_empty() { zmq::DONTWAIT } else { 0 };
                let mut m = match self.socket.recv_msg(flags) {
                    Ok(m) => m,
                    Err(zmq::Error::EAGAIN) if frames.is_empty() => return Ok(()),
                    Err(e) => {
                        return Err(Error::Transport {
                            context: "receiving from a remote reader".into(),
                            source: e,
                        })
                    }
                };
                let more = m.get_more();
                if !more {
                    host = m.gets("Peer-Address").map(str::to_owned);
                }
                frames.push(m.to_vec());
                if !more {
                    break;
                }
            }
            // [identity, hello]; anything else is not a shmq reader.
            let [id, hello] = &frames[..] else { continue };
            if hello.len() != HELLO || &hello[..4] != MAGIC_HELLO {
                continue;
            }
            let rank = u64::from_le_bytes(hello[4..12].try_into().expect("8 bytes"));
            let nonce = &hello[12..28];
            let want = mac(&self.key, b"hello", &[&rank.to_le_bytes(), nonce]);
            if !mac_eq(&want, &hello[28..60]) {
                log::warn!(
                    "shmq: refused a connection to {} that does not hold the queue's secret",
                    self.endpoint
                );
                continue;
            }
            let reason = if self.peers.iter().any(|p| p.rank == rank) {
                Some(format!("rank {rank} has joined already"))
            } else if self.local_ranks.contains(&(rank as usize)) {
                Some(format!("rank {rank} is a local reader"))
            } else if self.peers.len() >= self.expected {
                Some(format!(
                    "the queue has {} remote readers already",
                    self.expected
                ))
            } else {
                None
            };
            let (kind, text) = match &reason {
                Some(r) => (KIND_REFUSED, r.as_bytes().to_vec()),
                None => (KIND_WELCOME, Vec::new()),
            };
            let m = mac(
                &self.key,
                if kind == KIND_WELCOME {
                    b"welcome"
                } else {
                    b"refused"
                },
                &[&rank.to_le_bytes(), nonce, &self.session, &text],
            );
            let h = header(kind, 0, &self.session, &m);
            // Best effort: a peer gone meanwhile is simply not there.
            let _ = self
                .socket
                .send_multipart([&id[..], &h[..], &text[..]], zmq::DONTWAIT);
            if reason.is_none() {
                self.peers.push(Peer {
                    id: id.clone(),
                    rank,
                    dropped: false,
                    host,
                });
                if self.ready {
                    // Joined after the start: it gets READY at once and messages from
                    // now on (it has not missed any it was counted for).
                    let m = mac(
                        &self.key,
                        b"ready",
                        &[&self.session, &self.seq.to_le_bytes()],
                    );
                    let h = header(KIND_READY, self.seq, &self.session, &m);
                    let _ = self.socket.send_multipart([&id[..], &h[..]], zmq::DONTWAIT);
                }
            }
        }
    }

    /// Wait until every remote reader has joined, then tell them all to start.
    pub fn wait_for_readers(&mut self, wait: &mut Wait) -> Result<()> {
        if self.ready {
            return Ok(());
        }
        loop {
            self.serve_hellos()?;
            if self.peers.len() >= self.expected {
                break;
            }
            poll_slice(&self.socket, wait, || "waiting for remote readers".into())?;
            wait.step(&mut crate::wait::no_peer)?;
        }
        let m = mac(
            &self.key,
            b"ready",
            &[&self.session, &self.seq.to_le_bytes()],
        );
        let h = header(KIND_READY, self.seq, &self.session, &m);
        for p in &self.peers {
            self.socket
                .send_multipart([&p.id[..], &h[..]], 0)
                .map_err(Error::transport("telling a remote reader to start"))?;
        }
        self.ready = true;
        Ok(())
    }

    /// Send one message (its frames) to every accepted reader.
    pub fn send(&mut self, frames: &[&[u8]], wait: &mut Wait) -> Result<()> {
        if self.hellos_served.elapsed() >= HELLO_INTERVAL {
            self.serve_hellos()?;
            self.hellos_served = Instant::now();
        }
        self.seq += 1;
        let seq = self.seq.to_le_bytes();
        let mut parts: Vec<&[u8]> = Vec::with_capacity(frames.len() + 2);
        parts.push(&self.session);
        parts.push(&seq);
        parts.extend_from_slice(frames);
        let m = mac(&self.key, b"data", &parts);
        drop(parts);
        let h = header(KIND_DATA, self.seq, &self.session, &m);
        for k in 0..self.peers.len() {
            if self.peers[k].dropped {
                continue;
            }
            loop {
                match self.send_to(k, &h, frames) {
                    Ok(()) => break,
                    Err(zmq::Error::EAGAIN) => match self.options.slow_reader {
                        SlowReaderPolicy::Drop => {
                            log::warn!(
                                "shmq: remote reader rank {} is not keeping up ({} messages queued); \
                                 no more messages go to it",
                                self.peers[k].rank,
                                self.options.hwm
                            );
                            self.peers[k].dropped = true;
                            break;
                        }
                        SlowReaderPolicy::Block => {
                            std::thread::sleep(Duration::from_micros(200));
                            let p = &self.peers[k];
                            let hwm = self.options.hwm;
                            wait.step_explained(&mut crate::wait::no_peer, &mut || {
                                format!(
                                    "remote reader rank {} (host {}) has not taken the {hwm} \
                                     messages queued for it (it is slow, stopped, or the \
                                     network is)",
                                    p.rank,
                                    p.host.as_deref().unwrap_or("unknown")
                                )
                            })?;
                        }
                    },
                    Err(zmq::Error::EHOSTUNREACH) => {
                        // Disconnected for good (ZeroMQ forgot it): it cannot come back
                        // under the same identity.
                        log::warn!(
                            "shmq: remote reader rank {} is gone; no more messages go to it",
                            self.peers[k].rank
                        );
                        self.peers[k].dropped = true;
                        break;
                    }
                    Err(e) => {
                        return Err(Error::Transport {
                            context: format!(
                                "sending to remote reader rank {}",
                                self.peers[k].rank
                            ),
                            source: e,
                        })
                    }
                }
            }
        }
        Ok(())
    }

    /// Tell every reader still sent to that the stream ends here (the CLOSED message, see
    /// the module docs), waiting at most `grace` for room in a full reader's queue, then
    /// for the readers' BYE (at most `BYE_WAIT`), so that a writer process that exits
    /// right after still gets it out. A reader not reached is given up on: it sees the
    /// writer go instead.
    pub fn close(&mut self, grace: Duration) {
        let deadline = Instant::now() + grace;
        self.seq += 1;
        let m = mac(
            &self.key,
            b"closed",
            &[&self.session, &self.seq.to_le_bytes()],
        );
        let h = header(KIND_CLOSED, self.seq, &self.session, &m);
        // The readers it was queued for, whose BYE is awaited.
        let mut waiting: Vec<Vec<u8>> = Vec::new();
        for k in 0..self.peers.len() {
            if self.peers[k].dropped {
                continue;
            }
            loop {
                match self.send_to(k, &h, &[]) {
                    Ok(()) => waiting.push(self.peers[k].id.clone()),
                    Err(zmq::Error::EAGAIN) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_micros(200));
                        continue;
                    }
                    Err(zmq::Error::EAGAIN) => log::warn!(
                        "shmq: remote reader rank {} did not take the writer's last message \
                         within {grace:?}; it will see the writer go instead",
                        self.peers[k].rank
                    ),
                    Err(_) => {} // gone (or going): nothing to tell it
                }
                break;
            }
        }
        // Acknowledgements, [identity, BYE], for at most BYE_WAIT (a reader that is busy
        // elsewhere has the message in its socket by then); anything else is dropped.
        let deadline = deadline.min(Instant::now() + BYE_WAIT);
        while !waiting.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let slice = left.min(Duration::from_millis(5)).as_millis().max(1) as i64;
            if !matches!(self.socket.poll(zmq::POLLIN, slice), Ok(n) if n > 0) {
                continue;
            }
            while let Ok(frames) = self.socket.recv_multipart(zmq::DONTWAIT) {
                if let [id, bye] = &frames[..] {
                    if &bye[..] == MAGIC_BYE {
                        waiting.retain(|w| w[..] != id[..]);
                    }
                }
            }
        }
    }

    fn send_to(&self, k: usize, h: &[u8], frames: &[&[u8]]) -> std::result::Result<(), zmq::Error> {
        // The identity frame is where a full queue shows (EAGAIN): nothing of this
        // message has been queued then. Once it is accepted, the rest follows.
        self.socket
            .send(&self.peers[k].id[..], zmq::SNDMORE | zmq::DONTWAIT)?;
        let last = frames.is_empty();
        self.socket.send(h, if last { 0 } else { zmq::SNDMORE })?;
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() {
                zmq::SNDMORE
            } else {
                0
            };
            self.socket.send(*f, more)?;
        }
        Ok(())
    }
}

/// A remote reader's end of the stream.
pub struct RemoteReader {
    socket: LeakInChild<zmq::Socket>,
    endpoint: String,
    key: [u8; SECRET_BYTES],
    rank: u64,
    nonce: [u8; 16],
    /// The writer's session, once it proved it holds the secret.
    session: Option<[u8; 16]>,
    /// Sequence number of the last message taken.
    seq: u64,
    /// Whether the writer's start message came: it comes once, and a second one (a
    /// replayed recording, which would rewind `seq`) is refused.
    started: bool,
    /// The writer's CLOSED message came: every call fails with `WriterShutDown` now.
    closed: bool,
}

impl std::fmt::Debug for RemoteReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteReader")
            .field("endpoint", &self.endpoint)
            .field("rank", &self.rank)
            .finish()
    }
}

impl RemoteReader {
    /// Connect to `endpoint` as rank `rank` and say HELLO.
    pub fn connect(
        ctx: &zmq::Context,
        endpoint: &str,
        ipv6: bool,
        key: [u8; SECRET_BYTES],
        rank: u64,
    ) -> Result<RemoteReader> {
        let s = socket(ctx, zmq::DEALER, "remote reader")?;
        let opt =
            |what: &str| Error::transport(format!("setting {what} on the remote reader socket"));
        s.set_rcvhwm(0).map_err(opt("RCVHWM"))?;
        s.set_linger(0).map_err(opt("LINGER"))?;
        s.set_ipv6(ipv6).map_err(opt("IPV6"))?;
        crate::transport::check_endpoint(endpoint)?;
        s.connect(endpoint)
            .map_err(crate::transport::endpoint_error(
                "connecting".into(),
                endpoint,
            ))?;
        let nonce = random16()?;
        let m = mac(&key, b"hello", &[&rank.to_le_bytes(), &nonce]);
        let mut hello = [0u8; HELLO];
        hello[..4].copy_from_slice(MAGIC_HELLO);
        hello[4..12].copy_from_slice(&rank.to_le_bytes());
        hello[12..28].copy_from_slice(&nonce);
        hello[28..60].copy_from_slice(&m);
        s.send(&hello[..], 0)
            .map_err(Error::transport(format!("saying hello to {endpoint}")))?;
        Ok(RemoteReader {
            socket: LeakInChild::new(s),
            endpoint: endpoint.to_owned(),
            key,
            rank,
            nonce,
            session: None,
            seq: 0,
            started: false,
            closed: false,
        })
    }

    fn refuse(&self, why: &str) -> Error {
        Error::Remote(format!(
            "remote reader rank {} of {}: {why}",
            self.rank, self.endpoint
        ))
    }

    /// Check one message from the socket; `Ok(None)` for one to ignore (not from the
    /// writer, or a handshake message).
    fn accept(&mut self, mut frames: Vec<zmq::Message>) -> Result<Option<Vec<zmq::Message>>> {
        if frames.is_empty() || frames[0].len() != HEADER || &frames[0][..4] != MAGIC_MESSAGE {
            return Err(self.refuse("a message that is not from a shmq writer arrived (is another process using the writer's port?)"));
        }
        let h = frames.remove(0);
        let (kind, seq) = (
            h[4],
            u64::from_le_bytes(h[8..16].try_into().expect("8 bytes")),
        );
        let session: [u8; 16] = h[16..32].try_into().expect("16 bytes");
        let got_mac = &h[32..64];
        match (kind, self.session) {
            (KIND_WELCOME | KIND_REFUSED, None) => {
                let text: &[u8] = frames.first().map_or(&[], |m| &m[..]);
                let tag: &[u8] = if kind == KIND_WELCOME { b"welcome" } else { b"refused" };
                let want = mac(&self.key, tag, &[&self.rank.to_le_bytes(), &self.nonce, &session, text]);
                if !mac_eq(&want, got_mac) {
                    return Err(self.refuse(
                        "the writer's answer does not prove it holds the queue's secret (is another process using the writer's port?)",
                    ));
                }
                if kind == KIND_REFUSED {
                    return Err(self.refuse(&format!(
                        "the writer refused it: {}",
                        String::from_utf8_lossy(text)
                    )));
                }
                self.session = Some(session);
                Ok(None)
            }
            (KIND_READY, Some(s)) if s == session => {
                let want = mac(&self.key, b"ready", &[&session, &seq.to_le_bytes()]);
                if !mac_eq(&want, got_mac) {
                    return Err(self.refuse("a start message failed authentication"));
                }
                if self.started {
                    return Err(self.refuse(
                        "a second start message arrived (a replay? is another process using the writer's port?)",
                    ));
                }
                self.started = true;
                self.seq = seq;
                Ok(Some(Vec::new()))
            }
            (KIND_DATA, Some(s)) if s == session => {
                let seq_bytes = seq.to_le_bytes();
                let mut parts: Vec<&[u8]> = vec![&session, &seq_bytes];
                parts.extend(frames.iter().map(|m| &m[..]));
                if !mac_eq(&mac(&self.key, b"data", &parts), got_mac) {
                    return Err(self.refuse(
                        "a message failed authentication (is another process using the writer's port?)",
                    ));
                }
                if seq != self.seq + 1 {
                    return Err(self.refuse(&format!(
                        "message {seq} arrived after message {}: messages were lost (a slow reader dropped by the writer?)",
                        self.seq
                    )));
                }
                self.seq = seq;
                Ok(Some(frames))
            }
            (KIND_CLOSED, Some(s)) if s == session => {
                let want = mac(&self.key, b"closed", &[&session, &seq.to_le_bytes()]);
                if !mac_eq(&want, got_mac) {
                    return Err(self.refuse("a closing message failed authentication"));
                }
                if seq <= self.seq || (self.started && seq != self.seq + 1) {
                    return Err(self.refuse(&format!(
                        "the closing message {seq} arrived after message {}: messages were lost (a slow reader dropped by the writer?)",
                        self.seq
                    )));
                }
                self.seq = seq;
                self.closed = true;
                // Best effort: the writer waits for it only a short while.
                let _ = self.socket.send(&MAGIC_BYE[..], zmq::DONTWAIT);
                Err(Error::WriterShutDown)
            }
            _ => Err(self.refuse(
                "a message of another session arrived (is another process using the writer's port?)",
            )),
        }
    }

    fn try_recv_raw(&self) -> Result<Option<Vec<zmq::Message>>> {
        let first = match self.socket.recv_msg(zmq::DONTWAIT) {
            Ok(m) => m,
            Err(zmq::Error::EAGAIN) => return Ok(None),
            Err(e) => {
                return Err(Error::Transport {
                    context: format!("receiving from {}", self.endpoint),
                    source: e,
                })
            }
        };
        let mut frames = vec![first];
        while frames.last().is_some_and(|m| m.get_more()) {
            frames.push(self.socket.recv_msg(0).map_err(Error::transport(format!(
                "receiving a frame from {}",
                self.endpoint
            )))?);
        }
        Ok(Some(frames))
    }

    /// The next message (its frames, authenticated), if one has arrived.
    pub fn try_recv_frames(&mut self) -> Result<Option<Vec<zmq::Message>>> {
        if self.closed {
            return Err(Error::WriterShutDown);
        }
        while let Some(raw) = self.try_recv_raw()? {
            match self.accept(raw)? {
                Some(frames) if !frames.is_empty() => return Ok(Some(frames)),
                _ => continue, // handshake traffic
            }
        }
        Ok(None)
    }

    /// Wait for the next message.
    pub fn recv_frames(&mut self, wait: &mut Wait) -> Result<Vec<zmq::Message>> {
        loop {
            if let Some(f) = self.try_recv_frames()? {
                return Ok(f);
            }
            let context = || format!("waiting for a message from {}", self.endpoint);
            if !poll_slice(&self.socket, wait, context)? {
                // A remote writer's liveness cannot be checked from here: the warning
                // says where it is and how far the stream got.
                let (endpoint, seq) = (&self.endpoint, self.seq);
                wait.step_explained(&mut crate::wait::no_peer, &mut || {
                    format!(
                        "the writer at {endpoint} (on another host: its liveness cannot be \
                         checked from here), {seq} messages received from it so far"
                    )
                })?;
            }
        }
    }

    /// Wait until the writer accepted this reader and said start.
    pub fn wait_ready(&mut self, wait: &mut Wait) -> Result<()> {
        loop {
            if self.closed {
                return Err(Error::WriterShutDown);
            }
            while let Some(raw) = self.try_recv_raw()? {
                match self.accept(raw)? {
                    Some(frames) if frames.is_empty() => return Ok(()),
                    Some(_) => {
                        return Err(self.refuse("a message arrived before the writer said start"))
                    }
                    None => {}
                }
            }
            poll_slice(&self.socket, wait, || {
                format!("waiting for {}", self.endpoint)
            })?;
            wait.step(&mut crate::wait::no_peer)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait() -> Wait<'static> {
        Wait::new("test", Some(Duration::from_secs(10)))
    }

    #[test]
    fn readers_with_the_secret_get_authenticated_messages_and_others_nothing() {
        let ctx = zmq::Context::new();
        let key = new_secret().unwrap();
        let (mut w, _) =
            RemoteWriter::bind(&ctx, "127.0.0.1", key, 1, vec![0], RemoteOptions::default())
                .unwrap();
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
        let e = twin.wait_ready(&mut wait()).unwrap_err();
        assert!(e.to_string().contains("rank 1 has joined already"), "{e}");
    }

    /// A reader of rank 1 whose handshake gave it `session`, before the start message
    /// (its socket is connected to nothing: messages go to `accept` by hand).
    fn reader_in_session(
        ctx: &zmq::Context,
        key: [u8; SECRET_BYTES],
        session: [u8; 16],
    ) -> RemoteReader {
        RemoteReader {
            socket: LeakInChild::new(ctx.socket(zmq::DEALER).unwrap()),
            endpoint: "test".into(),
            key,
            rank: 1,
            nonce: [0; 16],
            session: Some(session),
            seq: 0,
            started: false,
            closed: false,
        }
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
        assert!(matches!(e, Error::Remote(_)), "{e}");
        assert!(!r.closed);
        // The real one: the end, and from then on every receive says so.
        let e = r.accept(closed(&key, 1)).unwrap_err();
        assert!(matches!(e, Error::WriterShutDown), "{e}");
        assert!(matches!(r.try_recv_frames(), Err(Error::WriterShutDown)));
        // A replay of it cannot rewind the stream.
        assert!(matches!(r.accept(closed(&key, 1)), Err(Error::Remote(_))));
    }

    #[test]
    fn a_forged_message_is_refused() {
        let ctx = zmq::Context::new();
        let key = new_secret().unwrap();
        let mut r = reader_in_session(&ctx, key, [5; 16]);
        let msg = |h: [u8; HEADER], body: &[u8]| {
            vec![zmq::Message::from(&h[..]), zmq::Message::from(body)]
        };
        // Right session, wrong key.
        let m = mac(&[9; 32], b"data", &[&[5; 16], &1u64.to_le_bytes(), b"x"]);
        assert!(r
            .accept(msg(header(KIND_DATA, 1, &[5; 16], &m), b"x"))
            .is_err());
        // Right key, body changed after the MAC.
        let m = mac(&key, b"data", &[&[5; 16], &1u64.to_le_bytes(), b"x"]);
        assert!(r
            .accept(msg(header(KIND_DATA, 1, &[5; 16], &m), b"y"))
            .is_err());
        // A good one, then a replay of it.
        assert!(r
            .accept(msg(header(KIND_DATA, 1, &[5; 16], &m), b"x"))
            .unwrap()
            .is_some());
        assert!(r
            .accept(msg(header(KIND_DATA, 1, &[5; 16], &m), b"x"))
            .is_err());
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
        assert!(r
            .accept(vec![zmq::Message::from(&ready[..])])
            .unwrap()
            .is_some());
        assert!(r.accept(data()).unwrap().is_some());
        // Someone who recorded the stream replays the start and the first message.
        let e = r.accept(vec![zmq::Message::from(&ready[..])]).unwrap_err();
        assert!(e.to_string().contains("a second start message"), "{e}");
        assert!(r.accept(data()).is_err(), "a replayed message was taken");
    }
}
