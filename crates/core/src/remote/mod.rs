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
//! - Sends are bounded, in messages and in bytes, by credit ([`RemoteOptions`]): the
//!   writer counts what it sent to each reader, and each reader tells it (ACK,
//!   `"SQA1" | messages u64 | bytes u64`, running totals) how much of that it has taken
//!   (returned to its caller). At most `hwm` messages and `max_queued_bytes` bytes sent
//!   to a reader and not yet taken by it exist anywhere: in the writer's ZeroMQ queue,
//!   in both kernels' TCP buffers and in the reader's ZeroMQ queue together, so neither
//!   process's memory grows with a reader that stops reading (ZeroMQ reports no
//!   per-peer queue depth, and its high-water marks count messages, not bytes, on each
//!   side separately: they cannot give this bound). When a reader is out of credit the
//!   writer waits for it (`Block`, the default: bounded by the enqueue's timeout) or
//!   stops sending to it (`Drop`). A message larger than `max_queued_bytes` goes once
//!   the reader has taken everything before it. The reader acknowledges every eighth
//!   of either bound, and at once when the writer, out of credit, asks (PING, a message
//!   of its own kind, MAC'd): so the writer never waits on an acknowledgement that is
//!   not coming. The WELCOME carries both bounds (under its MAC) so the reader knows
//!   when to acknowledge. An ACK needs no MAC: ZeroMQ routes by connection, so only the
//!   reader's own connection can send it, and the writer accepts only running totals
//!   that do not exceed what it sent.
//! - Connections that never prove the secret are closed: at most `MAX_UNAUTHENTICATED`
//!   at once, each for at most `HELLO_TIMEOUT` (see `spawn_guard`), so that idle
//!   ZeroMQ clients cannot use up the writer's file descriptors.
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
//! - A reader the writer drops (`SlowReaderPolicy::Drop`) is told so the same way:
//!   DROPPED, after the last message sent to it, with the next sequence number, its rank
//!   and a MAC; it then fails with [`Error::ReaderDropped`] instead of waiting for
//!   messages that will not come.
//!
//! No wait of a remote reader goes on without an end (see [`RemoteReader`]): its
//! connection carries ZeroMQ's heartbeats (a PING every [`HEARTBEAT_INTERVAL`], the
//! connection given up when one goes unanswered for the heartbeat timeout), and the
//! reader watches its connection through ZeroMQ's socket monitor. Once the writer has
//! said start, a connection that ends without CLOSED (the writer killed: at once; a
//! writer that hangs, or a network that fails: within the interval plus the timeout) is
//! the writer's death, [`Error::RemoteWriterGone`], after every message that arrived
//! before it; a new connection could not carry the stream on (what was in flight is
//! lost), so the reader does not make one. Before the start a lost connection is made
//! again, and the HELLO said again on it, until the reader's own deadline; only a writer
//! that cannot be reached at all for the interval plus the timeout is gone.
//!
//! Joining is idempotent: a HELLO said again (same nonce) on a new connection moves the
//! reader to it, and a rank whose reader went away before the queue was ready is free
//! for another (the writer looks: ZeroMQ forgets a closed connection, so a send to it
//! fails with `EHOSTUNREACH`). One bad connection never fails the writer's wait: it is
//! forgotten and the wait goes on.
//!
//! Frames, writer to reader: `[header, frame 1, ..]`, `header` =
//! `"SQM1" | kind u8 | 3 zero bytes | seq u64 | session [16] | mac [32]` (64 bytes).
//! Reader to writer: one frame, `"SQH1" | rank u64 | nonce [16] | mac [32]`.

use std::time::{Duration, Instant};

use crate::transport::{poll_slice, POLL_SLICE};
use crate::wait::Wait;
use shmq_os::error::{Error, Result};
use shmq_os::fork::LeakInChild;

/// Bytes of the queue's secret.
pub use crate::auth::SECRET_BYTES;
use crate::auth::{mac, mac_eq};
const HEADER: usize = 64;
const HELLO: usize = 4 + 8 + 16 + 32;
const MAGIC_MESSAGE: &[u8; 4] = b"SQM1";
const MAGIC_HELLO: &[u8; 4] = b"SQH1";
/// A reader's acknowledgement of the CLOSED message (see `RemoteWriter::close`).
const MAGIC_BYE: &[u8; 4] = b"SQB1";
/// A reader's running totals of messages and bytes taken (see the module docs).
const MAGIC_ACK: &[u8; 4] = b"SQA1";
const ACK: usize = 4 + 8 + 8;
const KIND_DATA: u8 = 0;
const KIND_WELCOME: u8 = 1;
const KIND_READY: u8 = 2;
const KIND_REFUSED: u8 = 3;
const KIND_CLOSED: u8 = 4;
/// The writer, out of credit for a reader, asks it to acknowledge what it has taken.
const KIND_PING: u8 = 5;
/// The writer dropped this reader (see the module docs).
const KIND_DROPPED: u8 = 6;
/// How often a writer out of credit asks the reader again (an ACK can be lost: the
/// reader sends it without waiting).
const PING_INTERVAL: Duration = Duration::from_millis(50);
/// PINGs sent to one reader and not yet answered by an ACK, at most: the reader answers
/// the first it reads with everything it took before it, so more would only fill its
/// queue while it does not read.
const MAX_UNANSWERED_PINGS: u32 = 4;

/// How often a remote reader's connection carries a ZeroMQ heartbeat (PING) to the writer.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// Default of how long a PING may go unanswered (no PONG, no other frame from the
/// writer) before the reader gives the connection up: see [`heartbeat_timeout`].
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(4);
/// The environment variable that sets another heartbeat timeout, in seconds (0: no
/// heartbeats; then only a connection that closes ends a wait).
pub const HEARTBEAT_TIMEOUT_ENV: &str = "SHMQ_REMOTE_HEARTBEAT_TIMEOUT";
/// How often a reader says HELLO again until the writer has said start.
const HELLO_AGAIN: Duration = Duration::from_secs(1);

/// How long a remote reader's PING may go unanswered before it gives its connection up
/// ([`HEARTBEAT_TIMEOUT_ENV`], else [`DEFAULT_HEARTBEAT_TIMEOUT`]); `None`: no
/// heartbeats. A frame that takes longer than this to cross the network (a tensor of
/// 256 MiB on a 1 Gbit/s link takes about 2 s) delays every PONG behind it, so a slow
/// network with large messages needs a longer one.
pub fn heartbeat_timeout() -> Option<Duration> {
    let default = Some(DEFAULT_HEARTBEAT_TIMEOUT);
    let Ok(text) = std::env::var(HEARTBEAT_TIMEOUT_ENV) else {
        return default;
    };
    match text.trim().parse::<f64>() {
        Ok(0.0) => None,
        // ZeroMQ takes milliseconds in an int, and the TTL it sends in 16 bits of tenths.
        Ok(s) if (0.001..=6000.0).contains(&s) => Some(Duration::from_secs_f64(s)),
        _ => {
            warn_user!(
                "shmq: {HEARTBEAT_TIMEOUT_ENV}={text:?} is not a number of seconds from \
                 0.001 to 6000 (or 0 for none); using {DEFAULT_HEARTBEAT_TIMEOUT:?}"
            );
            default
        }
    }
}

/// How long closing the writer's socket may still flush queued messages.
const LINGER_MS: i32 = 1000;

/// A secret of [`SECRET_BYTES`] random bytes, from the kernel.
pub fn new_secret() -> Result<[u8; SECRET_BYTES]> {
    crate::auth::new_secret("the queue's remote secret")
}

fn random16() -> Result<[u8; 16]> {
    crate::auth::nonce("a remote session id or nonce")
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

impl std::str::FromStr for SlowReaderPolicy {
    type Err = Error;
    /// `"block"` or `"drop"` (the Python argument `slow_remote_reader`).
    fn from_str(s: &str) -> Result<SlowReaderPolicy> {
        let choices = [
            ("block", SlowReaderPolicy::Block),
            ("drop", SlowReaderPolicy::Drop),
        ];
        shmq_os::error::parse_choice("slow_remote_reader", s, &choices)
    }
}

/// How the remote stream is bounded (see the module docs: credit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteOptions {
    /// Messages sent to one remote reader and not yet taken by it, at most.
    pub hwm: i32,
    /// Bytes (of message frames) sent to one remote reader and not yet taken by it, at
    /// most; a larger message goes once the reader has taken everything before it.
    pub max_queued_bytes: u64,
    pub slow_reader: SlowReaderPolicy,
}

/// Default of [`RemoteOptions::max_queued_bytes`]: 256 MiB.
pub const DEFAULT_MAX_QUEUED_BYTES: u64 = 256 << 20;

impl RemoteOptions {
    /// `InvalidArgument` unless `hwm` is at least 1 message and `max_queued_bytes` at
    /// least 1 byte ([`Writer::new`](crate::Writer::new) checks).
    pub fn check(&self) -> Result<()> {
        if self.hwm < 1 {
            return Err(Error::InvalidArgument(format!(
                "remote_hwm must be at least 1 message, got {}",
                self.hwm
            )));
        }
        if self.max_queued_bytes == 0 {
            return Err(Error::InvalidArgument(
                "remote_max_queued_bytes must be at least 1 byte, got 0".to_owned(),
            ));
        }
        Ok(())
    }
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            hwm: 1000,
            max_queued_bytes: DEFAULT_MAX_QUEUED_BYTES,
            slow_reader: SlowReaderPolicy::Block,
        }
    }
}

fn socket(ctx: &zmq::Context, kind: zmq::SocketType, what: &str) -> Result<zmq::Socket> {
    ctx.socket(kind)
        .map_err(Error::transport(format!("creating the {what} socket")))
}

/// How long a connection to the writer may stay without a HELLO that proves the
/// secret, counted from its acceptance to a look at the HELLOs by the writer after that.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long ZeroMQ's own handshake may take on a connection, on either side (ms).
const HANDSHAKE_IVL_MS: i32 = 5000;
/// Connections without such a HELLO at once, at most: beyond it the oldest are closed.
const MAX_UNAUTHENTICATED: usize = 64;
/// How often the guard looks at its connections when nothing happens.
const GUARD_TICK_MS: i64 = 200;
/// How long the guard of a dropped writer reads its monitor at most, waiting for ZeroMQ's
/// MONITOR_STOPPED (the socket's linger, `LINGER_MS`, and then some).
const GUARD_DRAIN: Duration = Duration::from_secs(5);

/// What the writer's thread tells the guard thread (see [`spawn_guard`]).
#[derive(Debug)]
struct Guard {
    /// Descriptors of connections whose HELLO proved the secret.
    authenticated: std::sync::Mutex<std::collections::HashSet<i32>>,
    /// When the writer last took every HELLO that had arrived, in ms since `epoch`.
    served_ms: std::sync::atomic::AtomicU64,
    epoch: Instant,
    /// The writer is gone: the guard closes nothing more, and ends once ZeroMQ stopped
    /// the monitor (at most `GUARD_DRAIN` later).
    stop: std::sync::atomic::AtomicBool,
}

impl Guard {
    fn served(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        // Release: the descriptors marked authenticated before this look (under the
        // mutex, itself ordered) are seen by a guard that reads this value (Acquire).
        self.served_ms
            .store(ms, std::sync::atomic::Ordering::Release);
    }
}

/// The peer address of socket `fd`, as bytes (None if it is not a connected socket).
fn peer_of(fd: i32) -> Option<Vec<u8>> {
    // SAFETY: all-zero bytes are a valid `sockaddr_storage`.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `addr` is writable for `len` bytes, and getpeername writes at most that
    // and sets `len`; a stale `fd` only makes it fail (EBADF, ENOTSOCK, ENOTCONN).
    let rc = unsafe {
        libc::getpeername(
            fd,
            (&mut addr as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    let len = (len as usize).min(std::mem::size_of::<libc::sockaddr_storage>());
    // SAFETY: `addr` is a plain struct of `size_of` bytes, `len` is within it.
    let bytes = unsafe {
        std::slice::from_raw_parts((&addr as *const libc::sockaddr_storage).cast::<u8>(), len)
    };
    Some(bytes.to_vec())
}

/// Close the connection on `fd` if it is still the one accepted from `peer`: ZeroMQ
/// sees it end and frees the descriptor.
fn close_connection(fd: i32, peer: &Option<Vec<u8>>) {
    // The descriptor may have been closed by ZeroMQ and reused since: only a socket
    // with the same peer address and port (a live TCP connection's address pair is
    // unique) is the same connection.
    if peer.is_none() || peer_of(fd) != *peer {
        return;
    }
    // SAFETY: shutdown changes no memory; on the checked socket it ends the connection
    // (ZeroMQ, which owns the descriptor, reads its end and closes it).
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// The guard of the writer's port: a thread that watches the connections the ROUTER
/// accepts (ZeroMQ's socket monitor: the descriptor of each) and closes those that do
/// not prove the secret in time, so that connections which never say HELLO cannot use
/// up the writer's descriptors. ZeroMQ itself cannot: a ROUTER cannot close a peer,
/// and its handshake and heartbeat timeouts end only connections that fail ZeroMQ's
/// own handshake or stop answering, while a ZeroMQ peer that never says HELLO answers
/// both. So the guard closes (`shutdown(2)`) a connection
/// - without a good HELLO `HELLO_TIMEOUT` after its acceptance, once the writer has
///   looked at the HELLOs after that time (a reader whose HELLO waits in the socket of
///   a writer busy elsewhere is not closed for it), and
/// - the oldest such connections beyond `MAX_UNAUTHENTICATED`, at once (under a flood
///   this can close a real reader still in its handshake: it sees the writer go).
///
/// The writer marks a connection good by its descriptor, which ZeroMQ gives with each
/// message (the `__fd` property).
fn spawn_guard(ctx: &zmq::Context, router: &zmq::Socket) -> Result<std::sync::Arc<Guard>> {
    let name = format!(
        "inproc://shmq-remote-guard-{}",
        crate::auth::to_hex(&random16()?)
    );
    let events = zmq::SocketEvent::ACCEPTED as i32
        | zmq::SocketEvent::DISCONNECTED as i32
        | zmq::SocketEvent::CLOSED as i32
        | zmq::SocketEvent::MONITOR_STOPPED as i32;
    router
        .monitor(&name, events)
        .map_err(Error::transport("monitoring the remote socket"))?;
    let mon = socket(ctx, zmq::PAIR, "remote monitor")?;
    mon.connect(&name).map_err(Error::transport(
        "connecting to the remote socket's monitor",
    ))?;
    let guard = std::sync::Arc::new(Guard {
        authenticated: Default::default(),
        served_ms: std::sync::atomic::AtomicU64::new(0),
        epoch: Instant::now(),
        stop: std::sync::atomic::AtomicBool::new(false),
    });
    let g = guard.clone();
    std::thread::Builder::new()
        .name("shmq-remote-guard".into())
        .spawn(move || run_guard(mon, &g))
        .map_err(|e| Error::Remote(format!("starting the remote port's guard thread: {e}")))?;
    Ok(guard)
}

fn run_guard(mon: zmq::Socket, guard: &Guard) {
    use std::sync::atomic::Ordering;
    // Connections not (yet) proved good: descriptor, acceptance, peer address.
    let mut pending: Vec<(i32, Instant, Option<Vec<u8>>)> = Vec::new();
    // Once the writer is gone, the guard closes nothing more but goes on reading the
    // monitor until ZeroMQ says it stopped (the socket's close emits its last events
    // from ZeroMQ's threads after the writer dropped it). A monitor nobody reads blocks
    // the thread that emits into it (libzmq sends monitor events blocking): with the
    // process's shared context (`transport::shared_context`) that is the I/O thread of
    // every other socket of the process, whose new listeners then accept nothing.
    let mut draining_until: Option<Instant> = None;
    loop {
        // Relaxed: the flag carries no data; it is seen at most a tick later.
        if draining_until.is_none() && guard.stop.load(Ordering::Relaxed) {
            draining_until = Some(Instant::now() + GUARD_DRAIN);
        }
        if draining_until.is_some_and(|t| Instant::now() >= t) {
            return;
        }
        if matches!(mon.poll(zmq::POLLIN, GUARD_TICK_MS), Ok(n) if n > 0) {
            while let Ok(frames) = mon.recv_multipart(zmq::DONTWAIT) {
                let Some(ev) = frames.first().filter(|f| f.len() == 6) else {
                    continue;
                };
                let kind = u16::from_ne_bytes([ev[0], ev[1]]);
                let fd = i32::from_ne_bytes([ev[2], ev[3], ev[4], ev[5]]);
                match zmq::SocketEvent::from_raw(kind) {
                    zmq::SocketEvent::ACCEPTED => pending.push((fd, Instant::now(), peer_of(fd))),
                    zmq::SocketEvent::DISCONNECTED | zmq::SocketEvent::CLOSED => {
                        pending.retain(|p| p.0 != fd);
                        guard
                            .authenticated
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&fd);
                    }
                    zmq::SocketEvent::MONITOR_STOPPED => return,
                    _ => {}
                }
            }
        }
        if draining_until.is_some() {
            continue;
        }
        // Acquire: pairs with `Guard::served` (the HELLOs taken by then are marked).
        let served = guard.epoch + Duration::from_millis(guard.served_ms.load(Ordering::Acquire));
        {
            let good = guard
                .authenticated
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            pending.retain(|p| !good.contains(&p.0));
        }
        pending.retain(|(fd, at, peer)| {
            let late = *at + HELLO_TIMEOUT <= served;
            if late {
                close_connection(*fd, peer);
            }
            !late
        });
        if pending.len() > MAX_UNAUTHENTICATED {
            let extra = pending.len() - MAX_UNAUTHENTICATED;
            for (fd, _, peer) in pending.drain(..extra) {
                close_connection(fd, &peer);
            }
        }
    }
}

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
    /// What the guard of the port must know (see [`spawn_guard`]).
    guard: std::sync::Arc<Guard>,
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
                guard,
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
            let mut fd = None;
            loop {
                let flags = if frames.is_empty() { zmq::DONTWAIT } else { 0 };
                let mut m = match self.socket.recv_msg(flags) {
                    Ok(m) => m,
                    Err(zmq::Error::EAGAIN) if frames.is_empty() => {
                        self.guard.served();
                        return Ok(());
                    }
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
                    fd = m.gets("__fd").and_then(|f| f.parse::<i32>().ok());
                }
                frames.push(m.to_vec());
                if !more {
                    break;
                }
            }
            // [identity, hello] or [identity, ack]; anything else is not a shmq reader.
            let [id, hello] = &frames[..] else { continue };
            if hello.len() == ACK && &hello[..4] == MAGIC_ACK {
                self.take_ack(id, &hello[4..]);
                continue;
            }
            if hello.len() != HELLO || &hello[..4] != MAGIC_HELLO {
                continue;
            }
            let rank = u64::from_le_bytes(hello[4..12].try_into().expect("8 bytes"));
            let nonce: [u8; 16] = hello[12..28].try_into().expect("16 bytes");
            let want = mac(&self.key, b"hello", &[&rank.to_le_bytes(), &nonce]);
            if !mac_eq(&want, &hello[28..60]) {
                warn_user!(
                    "shmq: refused a connection to {} that does not hold the queue's secret",
                    self.endpoint
                );
                continue;
            }
            if let Some(fd) = fd {
                // Proved the secret: the guard leaves its connection alone.
                self.guard
                    .authenticated
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(fd);
            }
            self.hello(id, rank, nonce, host)?;
        }
    }

    /// A HELLO that proved the secret, from connection `id`: accept the reader, move a
    /// known one to this connection, or refuse it (with the reason, under a MAC).
    fn hello(&mut self, id: &[u8], rank: u64, nonce: [u8; 16], host: Option<String>) -> Result<()> {
        let known = self.peers.iter().position(|p| p.rank == rank);
        if let Some(k) = known {
            let p = &self.peers[k];
            if p.nonce == nonce && p.id[..] == id[..] {
                // Said again on the same connection: the answer is on its way.
                return Ok(());
            }
            if p.nonce == nonce && !p.dropped && p.sent_msgs == 0 {
                // The same reader on a new connection (its first one closed: a flood
                // the port's guard cut, a network blip): it lost nothing, so it goes on
                // there. The old connection is gone (a DEALER has one at a time).
                let p = &mut self.peers[k];
                p.id = id.to_vec();
                p.host = host;
                p.pinged = None;
                p.unanswered_pings = 0;
                let started = p.started;
                self.welcome(id, rank, &nonce);
                if started {
                    self.peers[k].started = false;
                    self.start(k)?;
                }
                return Ok(());
            }
            if p.nonce != nonce && !self.ready && self.probe(k) == Probe::Gone {
                // Another reader for a rank whose reader went away before the start:
                // the rank is free again.
                warn_user!(
                    "shmq: remote reader rank {rank} (host {}) went away before the queue was \
                     ready; a new reader takes its rank",
                    self.peers[k].host.as_deref().unwrap_or("unknown")
                );
                self.peers.remove(k);
            }
        }
        let reason = if let Some(p) = self.peers.iter().find(|p| p.rank == rank) {
            Some(if p.nonce == nonce {
                format!(
                    "rank {rank} lost its connection after messages were sent to it (or was \
                     dropped): it cannot join again"
                )
            } else {
                format!("rank {rank} has joined already")
            })
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
        if let Some(reason) = reason {
            let m = mac(
                &self.key,
                b"refused",
                &[
                    &rank.to_le_bytes(),
                    &nonce,
                    &self.session,
                    reason.as_bytes(),
                ],
            );
            let h = header(KIND_REFUSED, 0, &self.session, &m);
            // Best effort: a peer gone meanwhile is simply not there.
            let _ = self
                .socket
                .send_multipart([id, &h[..], reason.as_bytes()], zmq::DONTWAIT);
            return Ok(());
        }
        self.welcome(id, rank, &nonce);
        self.peers.push(Peer {
            id: id.to_vec(),
            rank,
            nonce,
            started: false,
            dropped: false,
            host,
            sent_msgs: 0,
            sent_bytes: 0,
            taken_msgs: 0,
            taken_bytes: 0,
            last_seq: self.seq,
            pinged: None,
            unanswered_pings: 0,
        });
        if self.ready {
            // Joined after the start: it gets READY at once and messages from now on
            // (it has not missed any it was counted for).
            self.start(self.peers.len() - 1)?;
        }
        Ok(())
    }

    /// Answer a HELLO with WELCOME: the session, and the bounds, so the reader knows
    /// when to acknowledge; under a MAC bound to the reader's nonce. Best effort: a
    /// reader whose connection went meanwhile says HELLO again on its next one.
    fn welcome(&self, id: &[u8], rank: u64, nonce: &[u8; 16]) {
        let mut text = (self.options.hwm.max(1) as u64).to_le_bytes().to_vec();
        text.extend_from_slice(&self.options.max_queued_bytes.to_le_bytes());
        let m = mac(
            &self.key,
            b"welcome",
            &[&rank.to_le_bytes(), nonce, &self.session, &text],
        );
        let h = header(KIND_WELCOME, 0, &self.session, &m);
        let _ = self
            .socket
            .send_multipart([id, &h[..], &text[..]], zmq::DONTWAIT);
    }

    /// Tell reader `k` to start (READY, at the current sequence number). A reader whose
    /// connection is gone is forgotten instead: before the start its rank is free again,
    /// after it (see `hello`) it is dropped.
    fn start(&mut self, k: usize) -> Result<()> {
        let m = mac(
            &self.key,
            b"ready",
            &[&self.session, &self.seq.to_le_bytes()],
        );
        let h = header(KIND_READY, self.seq, &self.session, &m);
        match self
            .socket
            .send_multipart([&self.peers[k].id[..], &h[..]], zmq::DONTWAIT)
        {
            Ok(()) => {
                let p = &mut self.peers[k];
                p.started = true;
                p.last_seq = self.seq;
                Ok(())
            }
            // Gone (ZeroMQ closed its connection: `EHOSTUNREACH`), or going (its queue
            // is closing: `EAGAIN`, the only cause with no bound on the queue).
            Err(zmq::Error::EHOSTUNREACH | zmq::Error::EAGAIN) => {
                let p = &self.peers[k];
                warn_user!(
                    "shmq: remote reader rank {} (host {}) went away before it was told to \
                     start; {}",
                    p.rank,
                    p.host.as_deref().unwrap_or("unknown"),
                    if self.ready {
                        "no messages go to it"
                    } else {
                        "waiting for a reader of its rank again"
                    }
                );
                if self.ready {
                    self.peers[k].dropped = true;
                } else {
                    self.peers.remove(k);
                }
                Ok(())
            }
            Err(e) => Err(Error::Transport {
                context: format!("telling remote reader rank {} to start", self.peers[k].rank),
                source: e,
            }),
        }
    }

    /// Wait until every remote reader has joined, then tell them all to start. A reader
    /// that went away meanwhile is forgotten, and the wait goes on for its rank.
    pub fn wait_for_readers(&mut self, wait: &mut Wait) -> Result<()> {
        if self.ready {
            return Ok(());
        }
        loop {
            self.serve_hellos()?;
            if self.peers.len() >= self.expected {
                // From the last: `start` may forget the reader it is given.
                for k in (0..self.peers.len()).rev() {
                    if !self.peers[k].started {
                        self.start(k)?;
                    }
                }
                if self.peers.len() >= self.expected {
                    break;
                }
                continue;
            }
            poll_slice(&self.socket, wait, || "waiting for remote readers".into())?;
            wait.step(&mut crate::wait::no_peer)?;
        }
        self.ready = true;
        Ok(())
    }

    /// Whether sending a message of `bytes` would wait for a reader (or drop it): one
    /// still sent to is out of credit, after taking the ACKs that arrived.
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

    /// Send one message (its frames) to every accepted reader.
    ///
    /// First every reader still sent to must have credit for it (waiting, or dropping
    /// it, per the policy): a wait that times out has sent the message to nobody and
    /// used no sequence number, so the stream stays whole and the enqueue can be tried
    /// again. Then it is queued for each (ZeroMQ's own queue has room for it: see
    /// `CONTROL_ROOM`; were it full all the same, the policy applies there too).
    pub fn send(&mut self, frames: &[&[u8]], wait: &mut Wait) -> Result<()> {
        if self.hellos_served.elapsed() >= HELLO_INTERVAL {
            self.serve_hellos()?;
            self.hellos_served = Instant::now();
        }
        let bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
        self.wait_for_credit(bytes, wait)?;
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
                        })
                    }
                }
            }
        }
        Ok(())
    }

    /// Reader `k` is out of credit: drop it, or ask it for an ACK and wait a little (one
    /// step of `wait`: its timeout ends it). One whose connection is gone is dropped.
    fn slow(&mut self, k: usize, wait: &mut Wait) -> Result<()> {
        let (hwm, max_bytes) = (self.options.hwm, self.options.max_queued_bytes);
        match self.options.slow_reader {
            SlowReaderPolicy::Drop => {
                let p = &self.peers[k];
                warn_user!(
                    "shmq: remote reader rank {} is not keeping up ({} messages, {} bytes sent \
                     to it and not taken; the bounds are {hwm} messages, {max_bytes} bytes); \
                     no more messages go to it",
                    p.rank,
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
                                 falls behind",
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
    /// the module docs; ZeroMQ's queue has no bound here, so it is queued behind what
    /// was sent before), then wait for the readers' BYE (at most `BYE_WAIT`, and at most
    /// `grace`), so that a writer process that exits right after still gets it out. A
    /// reader not reached in time (one that does not read: the message waits behind
    /// what it has not taken) sees the writer go instead.
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
        warn_user!(
            "shmq: remote reader rank {} (host {}) is gone (its connection closed); no more \
             messages go to it",
            self.peers[k].rank,
            self.peers[k].host.as_deref().unwrap_or("unknown")
        );
        self.peers[k].dropped = true;
    }

    /// Stop sending to reader `k`, and tell it so (DROPPED, after the messages sent to
    /// it before: see the module docs), so that it does not wait for more. ZeroMQ's
    /// queue has no bound here, so the message is queued unless the connection is gone.
    fn drop_reader(&mut self, k: usize) {
        let p = &mut self.peers[k];
        p.dropped = true;
        let seq = p.last_seq + 1;
        let m = mac(
            &self.key,
            b"dropped",
            &[&self.session, &seq.to_le_bytes(), &p.rank.to_le_bytes()],
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

/// A remote reader's end of the stream.
///
/// Its socket is a DEALER connected to the writer's port, with ZeroMQ's heartbeats on
/// ([`HEARTBEAT_INTERVAL`], [`heartbeat_timeout`]) and its own handshake bounded, and a
/// socket monitor that tells it when a connection is made (ZeroMQ's handshake done) and
/// when one ends (closed by the writer's side or the kernel, or given up for want of a
/// heartbeat's answer). Before the writer says start, the reader says HELLO on every new
/// connection and every `HELLO_AGAIN` (a HELLO taken from a connection the writer's
/// port guard closed under a flood, or lost with it, is said again); after it, the end
/// of the connection is the end of the stream.
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
    /// How the stream ended, once it has: every call fails with its error from then on.
    ended: Option<Ended>,
    /// The connection to the writer, as ZeroMQ's socket monitor tells it.
    link: Link,
    /// Credit (see the module docs): data messages and bytes taken (running totals),
    /// those last acknowledged, and how many of each between ACKs (an eighth of the
    /// writer's bounds, from its WELCOME).
    taken: Taken,
}

#[derive(Debug, Default)]
struct Taken {
    msgs: u64,
    bytes: u64,
    acked_msgs: u64,
    acked_bytes: u64,
    every_msgs: u64,
    every_bytes: u64,
}

/// How a remote reader's stream ended.
#[derive(Clone, Debug)]
enum Ended {
    /// The writer's CLOSED came: [`Error::WriterShutDown`].
    Closed,
    /// The writer's DROPPED came: [`Error::ReaderDropped`].
    Dropped,
    /// The writer is gone, for the reason given: [`Error::RemoteWriterGone`].
    Gone(String),
}

/// What a remote reader knows of its connection to the writer.
struct Link {
    /// ZeroMQ's monitor of the reader's socket (a PAIR connected to it): one event per
    /// connection made (`HANDSHAKE_SUCCEEDED`) and ended (`DISCONNECTED`). Only these
    /// two: libzmq sends monitor events blocking, from its I/O thread, and the events of
    /// retried connections (one per reconnect interval while the writer is gone) would
    /// fill the monitor of a reader that does not look at it for long.
    events: LeakInChild<zmq::Socket>,
    /// A connection to the writer is up: ZeroMQ's handshake done, and not ended since.
    up: bool,
    /// Since when no connection has been up (the connect, or the end of the last one).
    down_since: Option<Instant>,
    /// A connection ended after the writer said start: the stream ends after what
    /// arrived before.
    broken: bool,
    /// When HELLO was last said.
    hello_at: Instant,
    /// The heartbeat timeout in force (`None`: no heartbeats).
    heartbeat: Option<Duration>,
}

impl Link {
    /// How long the reader goes without any connection to the writer before the start
    /// until the writer counts as gone: as long as a silent connection lasts.
    fn unreachable_after(&self) -> Option<Duration> {
        self.heartbeat.map(|t| HEARTBEAT_INTERVAL + t)
    }
}

impl std::fmt::Debug for RemoteReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteReader")
            .field("endpoint", &self.endpoint)
            .field("rank", &self.rank)
            .finish()
    }
}

impl Drop for RemoteReader {
    fn drop(&mut self) {
        // In a forked child the sockets are the parent's and are leaked, untouched.
        if shmq_os::fork::is_inherited(self.socket.made_in()) {
            return;
        }
        // Stop the monitor before its reading end closes: libzmq would otherwise emit the
        // events of the socket's closing (from its I/O thread, blocking) into a monitor
        // that nobody reads any more, and that thread serves every socket of the process.
        // SAFETY: `zmq_socket_monitor` with a null endpoint stops the monitor of the
        // socket it is given (zmq_socket_monitor(3)); the pointer is this reader's own
        // open socket, used by no other thread (the reader is dropped, `&mut self`).
        unsafe {
            zmq_socket_monitor(self.socket.as_mut_ptr(), std::ptr::null(), 0);
        }
    }
}

extern "C" {
    /// libzmq's, linked in by the zmq crate (whose own `monitor` cannot pass the null
    /// endpoint that stops a monitor).
    fn zmq_socket_monitor(
        socket: *mut std::ffi::c_void,
        endpoint: *const std::ffi::c_char,
        events: std::ffi::c_int,
    ) -> std::ffi::c_int;
}

/// Milliseconds as ZeroMQ's options take them.
fn millis(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
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
        // Until the writer proved the secret, only it and the handshake are bounded by
        // this; from its WELCOME on, its credit bounds the stream (see `accept`).
        s.set_rcvhwm(1000).map_err(opt("RCVHWM"))?;
        s.set_linger(0).map_err(opt("LINGER"))?;
        s.set_ipv6(ipv6).map_err(opt("IPV6"))?;
        let heartbeat = heartbeat_timeout();
        if let Some(timeout) = heartbeat {
            s.set_heartbeat_ivl(millis(HEARTBEAT_INTERVAL))
                .map_err(opt("HEARTBEAT_IVL"))?;
            s.set_heartbeat_timeout(millis(timeout))
                .map_err(opt("HEARTBEAT_TIMEOUT"))?;
            // A writer that accepts the connection but never finishes ZeroMQ's
            // handshake (a stopped process: its kernel accepts for it) is given up too.
            s.set_handshake_ivl(millis(timeout).max(HANDSHAKE_IVL_MS))
                .map_err(opt("HANDSHAKE_IVL"))?;
        }
        // The monitor first, so that it sees the first connection.
        let name = format!(
            "inproc://shmq-remote-reader-{}",
            crate::auth::to_hex(&random16()?)
        );
        let events =
            zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32 | zmq::SocketEvent::DISCONNECTED as i32;
        s.monitor(&name, events)
            .map_err(Error::transport("monitoring the remote reader socket"))?;
        let mon = socket(ctx, zmq::PAIR, "remote reader monitor")?;
        mon.connect(&name).map_err(Error::transport(
            "connecting to the remote reader socket's monitor",
        ))?;
        crate::transport::check_endpoint(endpoint)?;
        s.connect(endpoint)
            .map_err(crate::transport::endpoint_error(
                "connecting".into(),
                endpoint,
            ))?;
        let now = Instant::now();
        let reader = RemoteReader {
            socket: LeakInChild::new(s),
            endpoint: endpoint.to_owned(),
            key,
            rank,
            nonce: random16()?,
            session: None,
            seq: 0,
            started: false,
            ended: None,
            link: Link {
                events: LeakInChild::new(mon),
                up: false,
                down_since: Some(now),
                broken: false,
                hello_at: now,
                heartbeat,
            },
            taken: Taken::default(),
        };
        // Queued until the connection is made (a DEALER queues for a connect).
        reader
            .socket
            .send(&reader.hello()[..], 0)
            .map_err(Error::transport(format!("saying hello to {endpoint}")))?;
        Ok(reader)
    }

    /// This reader's HELLO: rank, nonce and their MAC.
    fn hello(&self) -> [u8; HELLO] {
        let m = mac(
            &self.key,
            b"hello",
            &[&self.rank.to_le_bytes(), &self.nonce],
        );
        let mut hello = [0u8; HELLO];
        hello[..4].copy_from_slice(MAGIC_HELLO);
        hello[4..12].copy_from_slice(&self.rank.to_le_bytes());
        hello[12..28].copy_from_slice(&self.nonce);
        hello[28..60].copy_from_slice(&m);
        hello
    }

    /// Say HELLO again (best effort: it is said again later).
    fn say_hello(&mut self) {
        let _ = self.socket.send(&self.hello()[..], zmq::DONTWAIT);
        self.link.hello_at = Instant::now();
    }

    /// Take the monitor's events: a connection made (before the start: HELLO on it), a
    /// connection ended (after the start: the stream breaks).
    fn watch_link(&mut self) {
        while let Ok(frames) = self.link.events.recv_multipart(zmq::DONTWAIT) {
            let Some(ev) = frames.first().filter(|f| f.len() == 6) else {
                continue;
            };
            match zmq::SocketEvent::from_raw(u16::from_ne_bytes([ev[0], ev[1]])) {
                zmq::SocketEvent::HANDSHAKE_SUCCEEDED => {
                    self.link.up = true;
                    self.link.down_since = None;
                    if !self.started {
                        self.say_hello();
                    }
                }
                zmq::SocketEvent::DISCONNECTED => {
                    self.link.up = false;
                    self.link.down_since.get_or_insert_with(Instant::now);
                    if self.started {
                        self.link.broken = true;
                    }
                }
                _ => {}
            }
        }
    }

    /// End the stream (`how`): no more connections to the writer's port, and every call
    /// fails with the error of `how` from now on; that error.
    fn end(&mut self, how: Ended) -> Error {
        if matches!(how, Ended::Gone(_)) {
            // Best effort: only stops ZeroMQ from connecting again.
            let _ = self.socket.disconnect(&self.endpoint);
        }
        self.ended = Some(how);
        self.ended_error().expect("just ended")
    }

    /// The error of the stream's end, if it has ended.
    fn ended_error(&self) -> Option<Error> {
        Some(match self.ended.as_ref()? {
            Ended::Closed => Error::WriterShutDown,
            Ended::Dropped => Error::ReaderDropped {
                rank: self.rank,
                endpoint: self.endpoint.clone(),
                received: self.taken.msgs,
            },
            Ended::Gone(reason) => Error::RemoteWriterGone {
                endpoint: self.endpoint.clone(),
                received: self.taken.msgs,
                reason: reason.clone(),
            },
        })
    }

    /// The stream broke after the start: the reason the writer is gone.
    fn broken_reason(&self) -> String {
        let silence = self.link.heartbeat.map_or_else(String::new, |t| {
            format!(" or stopped answering ZeroMQ's heartbeats for {t:?}")
        });
        format!(
            "its connection closed{silence} without the writer's shutdown (the writer died or \
             hangs, or the network between failed)"
        )
    }

    /// Before the start: the reason the writer is gone, if no connection to it has been
    /// up for as long as a silent one lasts.
    fn unreachable(&self) -> Option<String> {
        let after = self.link.unreachable_after()?;
        let since = self.link.down_since?;
        (since.elapsed() >= after).then(|| {
            format!(
                "this reader cannot reach the writer: no connection to it for {:.1?} \
                 (ZeroMQ's handshake not done; the writer died before this reader joined, \
                 or the network is down)",
                since.elapsed()
            )
        })
    }

    /// Tell the writer what was taken (an ACK), if `now` or an eighth of a bound was
    /// taken since the last one.
    fn ack(&mut self, now: bool) {
        let t = &self.taken;
        let due = now
            || t.msgs - t.acked_msgs >= t.every_msgs.max(1)
            || t.bytes - t.acked_bytes >= t.every_bytes.max(1);
        if !due || (t.msgs == t.acked_msgs && t.bytes == t.acked_bytes) {
            return;
        }
        let mut a = [0u8; ACK];
        a[..4].copy_from_slice(MAGIC_ACK);
        a[4..12].copy_from_slice(&t.msgs.to_le_bytes());
        a[12..20].copy_from_slice(&t.bytes.to_le_bytes());
        // Best effort: the totals are running, and the writer asks again.
        if self.socket.send(&a[..], zmq::DONTWAIT).is_ok() {
            self.taken.acked_msgs = self.taken.msgs;
            self.taken.acked_bytes = self.taken.bytes;
        }
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
            (KIND_WELCOME | KIND_REFUSED, known) if known.is_none_or(|s| s == session) => {
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
                if known.is_some() {
                    // The answer to a HELLO said again: nothing new.
                    return Ok(None);
                }
                self.session = Some(session);
                // The writer's bounds: acknowledge every eighth of them (a writer that
                // did not say gets an ACK for every message).
                if let (Some(m), Some(b)) = (text.get(..8), text.get(8..16)) {
                    let m = u64::from_le_bytes(m.try_into().expect("8 bytes"));
                    let b = u64::from_le_bytes(b.try_into().expect("8 bytes"));
                    self.taken.every_msgs = (m / 8).max(1);
                    self.taken.every_bytes = (b / 8).max(1);
                }
                // From here on the writer's credit bounds what it sends (see the module
                // docs); ZeroMQ's bound, which counts its room in batches, could stop
                // taking frames from the network before that, and with them the
                // heartbeats' answers. Best effort: the bound stays as it was otherwise.
                let _ = self.socket.set_rcvhwm(0);
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
                // The connections that ended before this one (which carried the start:
                // its handshake's event came before the message) are not the stream's.
                self.watch_link();
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
                self.taken.msgs += 1;
                self.taken.bytes += frames.iter().map(|f| f.len() as u64).sum::<u64>();
                self.ack(false);
                Ok(Some(frames))
            }
            (KIND_PING, Some(s)) if s == session => {
                if !mac_eq(&mac(&self.key, b"ping", &[&session]), got_mac) {
                    return Err(self.refuse("a credit request failed authentication"));
                }
                self.ack(true);
                Ok(None)
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
                // Best effort: the writer waits for it only a short while.
                let _ = self.socket.send(&MAGIC_BYE[..], zmq::DONTWAIT);
                Err(self.end(Ended::Closed))
            }
            (KIND_DROPPED, Some(s)) if s == session => {
                let want = mac(
                    &self.key,
                    b"dropped",
                    &[&session, &seq.to_le_bytes(), &self.rank.to_le_bytes()],
                );
                if !mac_eq(&want, got_mac) {
                    return Err(self.refuse("a message that it was dropped failed authentication"));
                }
                if seq != self.seq + 1 {
                    return Err(self.refuse(&format!(
                        "the message that it was dropped ({seq}) arrived after message {}: \
                         messages were lost",
                        self.seq
                    )));
                }
                self.seq = seq;
                Err(self.end(Ended::Dropped))
            }
            _ => Err(self.refuse(
                "a message of another session arrived (is another process using the writer's port?)",
            )),
        }
    }

    /// [`accept`](Self::accept), where a message that is not the writer's, after the
    /// stream's connection ended, is the writer's end (something else took its port, and
    /// ZeroMQ connected to it before the reader stopped it): the writer is gone.
    fn accept_checked(&mut self, frames: Vec<zmq::Message>) -> Result<Option<Vec<zmq::Message>>> {
        match self.accept(frames) {
            Err(Error::Remote(why)) => {
                self.watch_link();
                if self.link.broken {
                    return Err(self.end(Ended::Gone(self.broken_reason())));
                }
                Err(Error::Remote(why))
            }
            r => r,
        }
    }

    /// The next raw message (its frames), waiting up to `timeout` for it (not at all
    /// when zero). The wait is the receive itself (ZeroMQ's receive timeout), not a poll
    /// then a receive: half the system calls per message. An interrupted wait (EINTR)
    /// returns `None`, so the caller's wait runs its checks (signals) first.
    fn recv_raw(&self, timeout: Duration) -> Result<Option<Vec<zmq::Message>>> {
        let what = || format!("receiving from {}", self.endpoint);
        let first = if timeout.is_zero() {
            self.socket.recv_msg(zmq::DONTWAIT)
        } else {
            let ms = i32::try_from(timeout.as_millis().max(1)).unwrap_or(i32::MAX);
            self.socket
                .set_rcvtimeo(ms)
                .map_err(|e| Error::transport(what())(e))?;
            self.socket.recv_msg(0)
        };
        let first = match first {
            Ok(m) => m,
            Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => return Ok(None),
            Err(e) => return Err(Error::transport(what())(e)),
        };
        let mut frames = vec![first];
        // The other frames of a message arrive with its first (ZeroMQ delivers messages
        // whole), so these receives do not wait.
        while frames.last().is_some_and(|m| m.get_more()) {
            frames.push(self.socket.recv_msg(0).map_err(Error::transport(format!(
                "receiving a frame from {}",
                self.endpoint
            )))?);
        }
        Ok(Some(frames))
    }

    fn try_recv_raw(&self) -> Result<Option<Vec<zmq::Message>>> {
        self.recv_raw(Duration::ZERO)
    }

    /// The next message (its frames, authenticated), if one has arrived. Once the stream
    /// has ended (the writer shut down, dropped this reader, or is gone), its error.
    pub fn try_recv_frames(&mut self) -> Result<Option<Vec<zmq::Message>>> {
        self.recv_frames_for(Duration::ZERO)
    }

    /// The next message (its frames, authenticated), if one arrives within `timeout`.
    fn recv_frames_for(&mut self, timeout: Duration) -> Result<Option<Vec<zmq::Message>>> {
        if let Some(e) = self.ended_error() {
            return Err(e);
        }
        let deadline = (!timeout.is_zero()).then(|| Instant::now() + timeout);
        loop {
            let left = deadline.map_or(Duration::ZERO, |d| {
                d.saturating_duration_since(Instant::now())
            });
            let raw = match self.recv_raw(left)? {
                Some(raw) => raw,
                None => {
                    // Nothing came: has the stream's connection ended? Then what
                    // arrived before it is taken first (a receive that finds nothing
                    // takes ZeroMQ's pending work first, so it sees all of it).
                    self.watch_link();
                    if !self.link.broken {
                        return Ok(None);
                    }
                    match self.try_recv_raw()? {
                        Some(raw) => raw,
                        None => return Err(self.end(Ended::Gone(self.broken_reason()))),
                    }
                }
            };
            match self.accept_checked(raw)? {
                Some(frames) if !frames.is_empty() => return Ok(Some(frames)),
                _ => continue, // handshake traffic
            }
        }
    }

    /// Wait for the next message.
    pub fn recv_frames(&mut self, wait: &mut Wait) -> Result<Vec<zmq::Message>> {
        loop {
            let slice = wait.remaining().map_or(POLL_SLICE, |r| r.min(POLL_SLICE));
            if let Some(f) = self.recv_frames_for(slice)? {
                return Ok(f);
            }
            // The connection is watched (see the type's docs): the warning says where
            // the writer is and how far the stream got.
            let (endpoint, seq) = (&self.endpoint, self.seq);
            wait.step_explained(&mut crate::wait::no_peer, &mut || {
                format!(
                    "the writer at {endpoint} (on another host; its connection is up), {seq} \
                     messages received from it so far"
                )
            })?;
        }
    }

    /// Wait until the writer accepted this reader and said start, saying HELLO again on
    /// every new connection and every `HELLO_AGAIN` until then.
    pub fn wait_ready(&mut self, wait: &mut Wait) -> Result<()> {
        loop {
            if let Some(e) = self.ended_error() {
                return Err(e);
            }
            while let Some(raw) = self.try_recv_raw()? {
                match self.accept_checked(raw)? {
                    Some(frames) if frames.is_empty() => return Ok(()),
                    Some(_) => {
                        return Err(self.refuse("a message arrived before the writer said start"))
                    }
                    None => {}
                }
            }
            self.watch_link();
            if let Some(reason) = self.unreachable() {
                return Err(self.end(Ended::Gone(reason)));
            }
            if self.link.hello_at.elapsed() >= HELLO_AGAIN {
                self.say_hello();
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
        let e = twin.wait_ready(&mut wait()).unwrap_err();
        assert!(e.to_string().contains("rank 1 has joined already"), "{e}");
    }

    #[test]
    fn a_reader_that_takes_nothing_stops_the_writer_at_its_credit() {
        let ctx = zmq::Context::new();
        let key = new_secret().unwrap();
        let options = RemoteOptions {
            hwm: 100,
            max_queued_bytes: 3 << 20,
            slow_reader: SlowReaderPolicy::Block,
        };
        let (mut w, _) = RemoteWriter::bind(&ctx, "127.0.0.1", key, 1, vec![0], options).unwrap();
        let mut r = RemoteReader::connect(&ctx, w.endpoint(), false, key, 1).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| r.wait_ready(&mut wait()).unwrap());
            w.wait_for_readers(&mut wait()).unwrap();
        });
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
    fn a_reader_whose_writer_goes_without_shutdown_gets_what_arrived_then_an_error() {
        let ctx = zmq::Context::new();
        let key = new_secret().unwrap();
        let (mut w, _) =
            RemoteWriter::bind(&ctx, "127.0.0.1", key, 1, vec![0], RemoteOptions::default())
                .unwrap();
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
            matches!(e, Error::RemoteWriterGone { received: 2, .. }),
            "{e}"
        );
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        // And from then on, at once.
        assert!(matches!(
            r.try_recv_frames(),
            Err(Error::RemoteWriterGone { .. })
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
                Error::ReaderDropped {
                    rank: 1,
                    received: 4,
                    ..
                }
            ),
            "{e}"
        );
        // The writer's end does not change what the reader was told.
        w.close(Duration::from_millis(100));
        assert!(matches!(
            r.try_recv_frames(),
            Err(Error::ReaderDropped { .. })
        ));
    }

    #[test]
    fn a_rank_whose_reader_went_before_the_start_is_free_again() {
        let ctx = zmq::Context::new();
        let key = new_secret().unwrap();
        let (mut w, _) =
            RemoteWriter::bind(&ctx, "127.0.0.1", key, 2, vec![0], RemoteOptions::default())
                .unwrap();
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
            ended: None,
            link: Link {
                events: LeakInChild::new(ctx.socket(zmq::PAIR).unwrap()),
                up: false,
                down_since: None,
                broken: false,
                hello_at: Instant::now(),
                heartbeat: None,
            },
            taken: Taken::default(),
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
        assert!(r.ended.is_none());
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
