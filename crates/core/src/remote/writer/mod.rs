//! The writer's end of the remote stream: binding the port, credit, sending, dropping
//! slow readers and closing; joining (HELLO, WELCOME, READY) is in [`handshake`].

mod handshake;

use std::time::{Duration, Instant};

use super::guard::{Guard, peer_of, spawn_guard};
use super::wire::*;
use super::{
    HANDSHAKE_IVL_MS, LostReaderPolicy, RemoteError, RemoteOptions, SECRET_BYTES, SlowReaderPolicy,
    random16, set_heartbeats, socket,
};
use crate::auth::{mac, message_mac};
use crate::error::{Error, Result};
use crate::wait::Wait;
use shmq_os::fork::LeakInChild;

/// How often a writer out of credit asks the reader again (an ACK can be lost: the
/// reader sends it without waiting).
const PING_INTERVAL: Duration = Duration::from_millis(50);
/// PINGs sent to one reader and not yet answered by an ACK, at most: the reader answers
/// the first it reads with everything it took before it, so more would only fill its
/// queue while it does not read.
const MAX_UNANSWERED_PINGS: u32 = 4;

/// How long closing the writer's socket may still flush queued messages.
const LINGER_MS: i32 = 1000;

/// A remote reader the writer accepted.
#[derive(Debug)]
struct Peer {
    /// Its connection (ZeroMQ's routing id): the latest one its HELLO came on.
    id: Vec<u8>,
    rank: u64,
    /// The nonce of its HELLO: the same again is the same reader (on a new connection,
    /// or saying HELLO again); another is another reader for the rank.
    nonce: [u8; 16],
    /// The writer told it to start (READY).
    started: bool,
    dropped: bool,
    /// Its address as ZeroMQ saw the connection ("Peer-Address"), for warnings.
    host: Option<String>,
    /// Its connection as the kernel knows it: the descriptor ZeroMQ gave with its HELLO
    /// ("__fd") and that socket's peer address then (see [`RemoteWriter::connection_closed`]).
    conn: Option<(i32, Vec<u8>)>,
    /// Data messages and bytes sent to it, and the reader's running totals of those it
    /// has taken (its last ACK): the difference is what its credit counts.
    sent_msgs: u64,
    sent_bytes: u64,
    taken_msgs: u64,
    taken_bytes: u64,
    /// The sequence number of the last message it was sent (its READY's, until data).
    last_seq: u64,
    /// When the writer last asked it for an ACK, since its last ACK.
    pinged: Option<Instant>,
    /// PINGs sent to it since its last ACK.
    unanswered_pings: u32,
}

/// What a look at a reader's connection found (see [`RemoteWriter::probe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    /// The message was queued for it.
    Sent,
    /// ZeroMQ closed its connection (the reader went away, or the network did).
    Gone,
}

impl Peer {
    /// Whether a message of `bytes` may go to it now.
    fn has_credit(&self, options: &RemoteOptions, bytes: u64) -> bool {
        let msgs = self.sent_msgs - self.taken_msgs;
        let queued = self.sent_bytes - self.taken_bytes;
        msgs == 0
            || (msgs < options.hwm.max(1) as u64
                && queued.saturating_add(bytes) <= options.max_queued_bytes)
    }
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
    /// The heartbeat timeout of the readers' connections (`None`: no heartbeats).
    heartbeat: Option<Duration>,
    /// What the guard of the port must know (see [`spawn_guard`]).
    pub(super) guard: std::sync::Arc<Guard>,
    /// The queue's name, where its writer named it: said to each reader in its WELCOME
    /// (under the MAC), and in this writer's own warnings and errors.
    label: Option<String>,
}

impl Drop for RemoteWriter {
    fn drop(&mut self) {
        // Relaxed: see `run_guard`. Not joined: in a forked child it does not exist.
        self.guard
            .stop
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
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
    ///
    /// # Errors
    ///
    /// [`Error::Transport`] when the socket cannot be made, set up or bound on `ip` (not an
    /// address of this host, a malformed one); [`Error::InvalidArgument`] for `options` out
    /// of range.
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
        // The credit bounds what is queued for a reader: `hwm` data messages and
        // `max_queued_bytes` bytes, and a few control messages (PINGs are bounded too).
        // ZeroMQ's own bound is off: it counts a queue's room in batches (its low-water
        // mark), so it can refuse a message well before it holds `hwm` of them, and the
        // last message to a dropped reader (DROPPED) must always find room.
        s.set_sndhwm(0).map_err(opt("SNDHWM"))?;
        // A connection that does not finish ZeroMQ's own handshake (a plain TCP client
        // that says nothing) is closed by ZeroMQ within this, not its default 30 s; the
        // guard bounds how many there are meanwhile.
        s.set_handshake_ivl(HANDSHAKE_IVL_MS)
            .map_err(opt("HANDSHAKE_IVL"))?;
        // What readers send is tiny (HELLOs); a flood of garbage is dropped at 1000.
        s.set_rcvhwm(1000).map_err(opt("RCVHWM"))?;
        s.set_maxmsgsize(HELLO as i64 * 4)
            .map_err(opt("MAXMSGSIZE"))?;
        s.set_linger(LINGER_MS).map_err(opt("LINGER"))?;
        // ZeroMQ's heartbeats on the writer's side too: a PING to each reader every
        // interval, and a connection that carries nothing from its reader for the
        // timeout after one (no PONG, none of the reader's own PINGs or ACKs) is closed.
        // So a reader whose machine or network went away, or that hangs, is gone for the
        // writer within the interval plus the timeout of the last thing heard from it,
        // as the writer is for the reader, and a writer waiting for its credit stops
        // waiting then (see `slow`). The reader's own PINGs come every interval whatever
        // the writer sends, so a large frame on its way does not make it look silent.
        let heartbeat = set_heartbeats(&s, "remote", true)?;
        s.set_ipv6(ipv6).map_err(opt("IPV6"))?;
        crate::transport::check_endpoint(&addr)?;
        s.bind(&addr).map_err(crate::transport::endpoint_error(
            "binding the remote socket".into(),
            &addr,
        ))?;
        let guard = spawn_guard(ctx, &s)?;
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
                heartbeat,
                guard,
                label: None,
            },
            ipv6,
        ))
    }

    /// Name the queue (its writer's name for it, checked by
    /// [`check_label`](crate::broadcast::ring::check_label)): readers are told it in their
    /// WELCOME and name the queue by it in their errors, as this writer does in its
    /// warnings. Before the first reader is welcomed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a label that is empty, too long, or has a character a
    /// queue's name cannot have.
    pub fn set_label(&mut self, label: &str) -> Result<()> {
        crate::broadcast::ring::check_label(label)?;
        self.label = Some(label.to_owned());
        Ok(())
    }

    /// " of queue 'steps'" where the queue was named, else nothing.
    pub(super) fn of_queue(&self) -> String {
        super::error::of_queue(self.label.as_deref())
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

    /// How many accepted readers are no longer sent to (gone, or dropped as slow).
    pub fn dropped_count(&self) -> usize {
        self.peers.iter().filter(|p| p.dropped).count()
    }

    /// [`RemoteError::LostReaders`] naming the readers no longer sent to, when there are
    /// any and the writer was made with [`LostReaderPolicy::Raise`]; `Ok` otherwise (the
    /// queue's writer asks after each send).
    ///
    /// # Errors
    ///
    /// [`RemoteError::LostReaders`] naming the readers no longer sent to, under
    /// [`LostReaderPolicy::Raise`].
    pub fn check_lost(&self) -> Result<()> {
        if self.options.on_lost_reader != LostReaderPolicy::Raise || self.dropped_count() == 0 {
            return Ok(());
        }
        let readers = self.peers.iter().filter(|p| p.dropped);
        let readers = readers.map(|p| (p.rank, p.host.clone())).collect();
        Err(RemoteError::LostReaders {
            readers,
            queue: self.label.clone(),
        }
        .into())
    }

    /// Find the readers whose connection ZeroMQ closed since the last send (it closes
    /// one when the heartbeats go unanswered: a reader that died, hangs, or is cut off),
    /// as a send would: each is gone (warned about once, no more sent to it). Sends and
    /// waits for nothing; for a writer that sends nothing for a while. Returns
    /// [`dropped_count`](Self::dropped_count).
    pub fn check_connections(&mut self) -> usize {
        for k in 0..self.peers.len() {
            if !self.peers[k].dropped && self.connection_closed(k) {
                self.gone(k);
            }
        }
        self.dropped_count()
    }

    /// Whether sending a message of `bytes` would wait for a reader (or drop it): one
    /// still sent to is out of credit, after taking the ACKs that arrived.
    ///
    /// # Errors
    ///
    /// [`Error::Transport`] when the socket fails while the ACKs are taken;
    /// [`RemoteError::LostReaders`] under [`LostReaderPolicy::Raise`] when a reader was
    /// found lost.
    pub fn would_wait(&mut self, bytes: u64) -> Result<bool> {
        let short = |w: &Self| {
            w.peers
                .iter()
                .any(|p| !p.dropped && !p.has_credit(&w.options, bytes))
        };
        if !short(self) {
            return Ok(false);
        }
        self.serve_hellos()?;
        Ok(short(self))
    }

    /// Wait until every reader still sent to has credit for a message of `bytes` (or is
    /// dropped, per the policy); sends nothing. [`send`](Self::send) does this first; a
    /// caller that must do all its waiting before it sends anything anywhere (see
    /// `Wait::commit`) calls it before.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] or the hook's error when `wait` ends first;
    /// [`RemoteError::LostReaders`] under [`LostReaderPolicy::Raise`] for a reader lost
    /// meanwhile; [`Error::Transport`] when the socket fails.
    pub fn wait_for_credit(&mut self, bytes: u64, wait: &mut Wait) -> Result<()> {
        for k in 0..self.peers.len() {
            while !self.peers[k].dropped && !self.peers[k].has_credit(&self.options, bytes) {
                // Its ACKs may be waiting in the socket.
                self.serve_hellos()?;
                if !self.peers[k].has_credit(&self.options, bytes) {
                    self.slow(k, wait)?;
                }
            }
        }
        Ok(())
    }

    /// Wait until every reader still sent to has taken every message sent so far (its
    /// ACK says so), asking each that has not for an ACK as a writer out of credit does;
    /// a reader whose connection goes meanwhile is dropped (warned about once), as in a
    /// send. Sends no message. A reader answers such a request when it next reads from
    /// the stream, so a reader that handles each message before it asks for the next
    /// has handled every message by then: what a caller that must know a message was
    /// acted on (not only queued) waits for.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] naming the first reader still behind when `wait` runs out;
    /// [`Error::Cancelled`] or the error of `wait`'s hook; a transport error of the
    /// socket.
    pub fn wait_taken(&mut self, wait: &mut Wait) -> Result<()> {
        for k in 0..self.peers.len() {
            while !self.peers[k].dropped && self.peers[k].taken_msgs < self.peers[k].sent_msgs {
                // Its ACK may be waiting in the socket.
                self.serve_hellos()?;
                if self.peers[k].taken_msgs >= self.peers[k].sent_msgs || self.peers[k].dropped {
                    break;
                }
                if self.connection_closed(k) || self.ping(k) == Probe::Gone {
                    self.gone(k);
                    break;
                }
                // Woken by its ACK (or anything else arriving).
                let _ = self.socket.poll(zmq::POLLIN, 1);
                let p = &self.peers[k];
                let mut behind = || {
                    format!(
                        "remote reader rank {} (host {}) has acknowledged {} of the {} messages sent to it (a reader acknowledges when it next reads)",
                        p.rank,
                        p.host.as_deref().unwrap_or("unknown"),
                        p.taken_msgs,
                        p.sent_msgs,
                    )
                };
                wait.step_explained(&mut crate::wait::no_peer, &mut behind)?;
            }
        }
        Ok(())
    }

    /// Send one message (its frames) to every accepted reader.
    ///
    /// First every reader still sent to must have credit for it (waiting, or dropping
    /// it, per the policy): a wait that times out has sent the message to nobody and
    /// used no sequence number, so the stream stays whole and the enqueue can be tried
    /// again. Then it is queued for each (ZeroMQ's own queue has room for it: see
    /// `CONTROL_ROOM`; were it full all the same, the policy applies there too).
    ///
    /// # Errors
    ///
    /// As [`wait_for_credit`](Self::wait_for_credit); [`Error::Transport`] when a frame
    /// cannot be sent.
    pub fn send(&mut self, frames: &[&[u8]], wait: &mut Wait) -> Result<()> {
        if self.hellos_served.elapsed() >= HELLO_INTERVAL {
            self.serve_hellos()?;
            self.hellos_served = Instant::now();
        }
        let bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
        self.wait_for_credit(bytes, wait)?;
        self.seq += 1;
        let m = message_mac(
            &self.key,
            b"data",
            &self.session,
            self.seq,
            frames.iter().copied(),
        );
        let h = header(KIND_DATA, self.seq, &self.session, &m);
        for k in 0..self.peers.len() {
            while !self.peers[k].dropped {
                match self.send_to(k, &h, frames) {
                    Ok(()) => {
                        let p = &mut self.peers[k];
                        p.sent_msgs += 1;
                        p.sent_bytes += bytes;
                        p.last_seq = self.seq;
                        break;
                    }
                    // Disconnected for good (ZeroMQ forgot it, or is closing its queue:
                    // with no bound on the queue that is the only `EAGAIN`): it cannot
                    // come back under the same identity.
                    Err(zmq::Error::EHOSTUNREACH | zmq::Error::EAGAIN) => self.gone(k),
                    Err(e) => {
                        return Err(Error::Transport {
                            context: format!(
                                "sending to remote reader rank {}",
                                self.peers[k].rank
                            ),
                            source: e,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether reader `k`'s connection is closed: the descriptor its HELLO came on no
    /// longer holds a socket connected to the same peer address and port (ZeroMQ closed
    /// it: the reader went away, or stopped answering the heartbeats; a live connection's
    /// address pair is unique, so a descriptor reused since is another connection). Asks
    /// the kernel and sends nothing, so it also holds once the reader has been asked for
    /// credit `MAX_UNANSWERED_PINGS` times, when no more PINGs go to find out; and it
    /// does not wait for ZeroMQ to forget the connection's routing id.
    fn connection_closed(&self, k: usize) -> bool {
        self.peers[k]
            .conn
            .as_ref()
            .is_some_and(|(fd, peer)| peer_of(*fd).as_ref() != Some(peer))
    }

    /// Reader `k` is out of credit: drop it, or ask it for an ACK and wait a little (one
    /// step of `wait`: its timeout ends it). One whose connection is gone is dropped.
    fn slow(&mut self, k: usize, wait: &mut Wait) -> Result<()> {
        let (hwm, max_bytes) = (self.options.hwm, self.options.max_queued_bytes);
        if self.connection_closed(k) {
            self.gone(k);
            return Ok(());
        }
        match self.options.slow_reader {
            SlowReaderPolicy::Drop => {
                let p = &self.peers[k];
                warn_user!(
                    "shmq: remote reader rank {}{} is not keeping up ({} messages, {} bytes \
                     sent to it and not taken; the bounds are {hwm} messages, {max_bytes} \
                     bytes); no more messages go to it",
                    p.rank,
                    self.of_queue(),
                    p.sent_msgs - p.taken_msgs,
                    p.sent_bytes - p.taken_bytes,
                );
                self.drop_reader(k);
                Ok(())
            }
            SlowReaderPolicy::Block => {
                if self.ping(k) == Probe::Gone {
                    self.gone(k);
                    return Ok(());
                }
                // Woken by its ACK (or anything else arriving).
                let _ = self.socket.poll(zmq::POLLIN, 1);
                let p = &self.peers[k];
                let mut behind = || {
                    format!(
                        "remote reader rank {} (host {}) has not taken the {} messages ({} \
                         bytes) sent to it (the bounds are {hwm} messages, {max_bytes} bytes: \
                         remote_hwm, remote_max_queued_bytes; it is slow, stopped, or the \
                         network is)",
                        p.rank,
                        p.host.as_deref().unwrap_or("unknown"),
                        p.sent_msgs - p.taken_msgs,
                        p.sent_bytes - p.taken_bytes,
                    )
                };
                // A timeout names the reader waited for and what to do, whatever the
                // wait was called (a writer's "waiting for readers to free a chunk").
                wait.step_explained(&mut crate::wait::no_peer, &mut behind)
                    .map_err(|e| match e {
                        Error::Timeout { waited, .. } => Error::Timeout {
                            what: format!(
                                "the writer waiting for a remote reader to take what was sent \
                                 to it: {}; have that reader dequeue (or check the network), \
                                 enqueue with a longer timeout, raise remote_hwm / \
                                 remote_max_queued_bytes, or make the queue with \
                                 slow_remote_reader=\"drop\" to go on without a reader that \
                                 falls behind (in Rust, QueueOptions::remote's hwm, \
                                 max_queued_bytes and slow_reader: SlowReaderPolicy::Drop)",
                                behind()
                            ),
                            waited,
                        },
                        e => e,
                    })
            }
        }
    }

    /// Tell every reader still sent to that the stream ends here (the CLOSED message, see
    /// the `remote` module docs; ZeroMQ's queue has no bound here, so it is queued behind
    /// what was sent before), then wait for the readers' BYE (at most `BYE_WAIT`, and at most
    /// `grace`), so that a writer process that exits right after still gets it out. A
    /// reader not reached in time (one that does not read: the message waits behind
    /// what it has not taken) sees the writer go instead.
    pub fn close(&mut self, grace: Duration) {
        let deadline = Instant::now() + grace;
        self.seq += 1;
        let m = message_mac(&self.key, b"closed", &self.session, self.seq, []);
        let h = header(KIND_CLOSED, self.seq, &self.session, &m);
        // The readers it was queued for, whose BYE is awaited.
        let mut waiting: Vec<Vec<u8>> = Vec::new();
        for k in 0..self.peers.len() {
            if self.peers[k].dropped {
                continue;
            }
            // An error is a reader gone (or going): nothing to tell it.
            if self.send_to(k, &h, &[]).is_ok() {
                waiting.push(self.peers[k].id.clone());
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

    /// A reader's ACK (`rest`: its running totals) from connection `id`: taken if it is
    /// an accepted reader's and the totals neither go back nor exceed what was sent.
    fn take_ack(&mut self, id: &[u8], rest: &[u8]) {
        let msgs = u64::from_le_bytes(rest[..8].try_into().expect("8 bytes"));
        let bytes = u64::from_le_bytes(rest[8..16].try_into().expect("8 bytes"));
        if let Some(p) = self.peers.iter_mut().find(|p| p.id[..] == id[..]) {
            if (p.taken_msgs..=p.sent_msgs).contains(&msgs)
                && (p.taken_bytes..=p.sent_bytes).contains(&bytes)
            {
                p.taken_msgs = msgs;
                p.taken_bytes = bytes;
                p.pinged = None;
                p.unanswered_pings = 0;
            }
        }
    }

    /// Ask reader `k` for an ACK (PING), unless it was asked within `PING_INTERVAL` or
    /// has `MAX_UNANSWERED_PINGS` unanswered already; whether its connection is gone.
    fn ping(&mut self, k: usize) -> Probe {
        let p = &self.peers[k];
        if p.pinged.is_some_and(|t| t.elapsed() < PING_INTERVAL)
            || p.unanswered_pings >= MAX_UNANSWERED_PINGS
        {
            return Probe::Sent;
        }
        let probe = self.probe(k);
        let p = &mut self.peers[k];
        p.pinged = Some(Instant::now());
        if probe == Probe::Sent {
            p.unanswered_pings += 1;
        }
        probe
    }

    /// Send reader `k` a PING (harmless: it answers with an ACK only if it took
    /// something since its last), to learn whether its connection is still there.
    /// Only for a reader that was sent WELCOME on its connection (it knows the session).
    fn probe(&self, k: usize) -> Probe {
        let m = mac(&self.key, b"ping", &[&self.session]);
        let h = header(KIND_PING, 0, &self.session, &m);
        match self
            .socket
            .send_multipart([&self.peers[k].id[..], &h[..]], zmq::DONTWAIT)
        {
            // No bound on the queue: `EAGAIN` is a queue ZeroMQ is closing.
            Err(zmq::Error::EHOSTUNREACH | zmq::Error::EAGAIN) => Probe::Gone,
            // Sent, or not for another reason (it is asked again).
            _ => Probe::Sent,
        }
    }

    /// Reader `k`'s connection is gone: no more messages go to it.
    fn gone(&mut self, k: usize) {
        let silence = self.heartbeat.map_or_else(String::new, |t| {
            format!(
                ", or nothing came from it for {t:?} after a heartbeat: it hangs, or its \
                 machine or the network went away"
            )
        });
        warn_user!(
            "shmq: remote reader rank {} (host {}){} is gone (its connection \
             closed{silence}); no more messages go to it",
            self.peers[k].rank,
            self.peers[k].host.as_deref().unwrap_or("unknown"),
            self.of_queue()
        );
        self.peers[k].dropped = true;
    }

    /// Stop sending to reader `k`, and tell it so (DROPPED, after the messages sent to
    /// it before: see the `remote` module docs), so that it does not wait for more.
    /// ZeroMQ's queue has no bound here, so the message is queued unless the connection
    /// is gone.
    fn drop_reader(&mut self, k: usize) {
        let p = &mut self.peers[k];
        p.dropped = true;
        let seq = p.last_seq + 1;
        let m = message_mac(
            &self.key,
            b"dropped",
            &self.session,
            seq,
            [&p.rank.to_le_bytes()[..]],
        );
        let h = header(KIND_DROPPED, seq, &self.session, &m);
        let _ = self
            .socket
            .send_multipart([&self.peers[k].id[..], &h[..]], zmq::DONTWAIT);
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
