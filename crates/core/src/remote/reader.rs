//! The reader's end of the remote stream: connecting, saying HELLO, checking every
//! message (session, sequence number, MAC), acknowledging what it took, and watching
//! its connection to the writer.

use std::time::{Duration, Instant};

use super::wire::*;
use super::{
    HANDSHAKE_IVL_MS, HEARTBEAT_INTERVAL, SECRET_BYTES, millis, random16, set_heartbeats, socket,
};
use crate::auth::{mac, mac_eq, message_mac};
use crate::error::{Error, QueueError, RemoteError, Result};
use crate::transport::{POLL_SLICE, poll_slice};
use crate::wait::Wait;
use shmq_os::fork::LeakInChild;

/// How often a reader says HELLO again until the writer has said start.
const HELLO_AGAIN: Duration = Duration::from_secs(1);
/// How often, at most, a reader asks the kernel when bytes last arrived from the writer.
const SILENCE_CHECK: Duration = Duration::from_millis(100);

/// A remote reader's end of the stream.
///
/// Its socket is a DEALER connected to the writer's port, with ZeroMQ's heartbeats on
/// ([`HEARTBEAT_INTERVAL`], [`heartbeat_timeout`](super::heartbeat_timeout)) and its own handshake bounded, and a
/// socket monitor that tells it when a connection is made (its descriptor, and ZeroMQ's
/// handshake done) and when one ends (closed by the writer's side or the kernel). The
/// reader, not ZeroMQ, gives a silent connection up: ZeroMQ's heartbeat timeout ends
/// only when a whole frame arrives, and a frame of a large message on a slow link may
/// take longer than that while its bytes keep arriving (and the writer's PONG waits
/// behind it). So the reader asks the kernel (`TCP_INFO`'s `tcpi_last_data_recv`) when
/// bytes last arrived on the connection: nothing at all (no message byte, no PING or
/// PONG of the writer's, which come every interval) for the interval plus the timeout
/// is the writer's silence. Before the writer says start, the reader says HELLO on every new
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
    /// The queue's name, as the writer's WELCOME said it (under its MAC), if it named the
    /// queue and the name is one a queue may have.
    queue: Option<String>,
    /// Sequence number of the last message taken.
    seq: u64,
    /// Whether the writer's start message came: it comes once per connection the writer
    /// moved this reader to, and one that is not that (a replayed recording, which would
    /// rewind `seq`, or one after a message was taken) is refused.
    started: bool,
    /// How the stream ended, once it has: every call fails with its error from then on.
    pub(super) ended: Option<Ended>,
    /// The connection to the writer, as ZeroMQ's socket monitor tells it.
    link: Link,
    /// Credit (see the `remote` module docs): data messages and bytes taken (running
    /// totals), those last acknowledged, and how many of each between ACKs (an eighth of
    /// the writer's bounds, from its WELCOME).
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
pub(super) enum Ended {
    /// The writer's CLOSED came: [`QueueError::WriterShutDown`].
    Closed,
    /// The writer's DROPPED came: [`RemoteError::ReaderDropped`].
    Dropped,
    /// The writer is gone, for the reason given: [`RemoteError::WriterGone`].
    Gone(String),
    /// The writer refused this reader (its answer authenticated): [`RemoteError::Refused`]
    /// with these words. For good: it does not take the reader later (a rank taken, or
    /// messages sent to it on a connection that ended).
    Refused(String),
}

/// What a remote reader knows of its connection to the writer.
struct Link {
    /// ZeroMQ's monitor of the reader's socket (a PAIR connected to it): events per
    /// connection made (`CONNECTED`, with its descriptor; `HANDSHAKE_SUCCEEDED`) and
    /// ended (`DISCONNECTED`). Only these: libzmq sends monitor events blocking, from its
    /// I/O thread, and the events of retried connections (one per reconnect interval
    /// while the writer is gone) would fill the monitor of a reader that does not look at
    /// it for long (a connection that is refused makes none of these).
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
    /// The connection's descriptor (from the monitor's CONNECTED event: ZeroMQ's own)
    /// and its peer address then: the descriptor is the same connection only while its
    /// peer address is the same (ZeroMQ may close it, and the number be reused, before
    /// the monitor says so).
    conn: Option<(i32, Vec<u8>)>,
    /// When the kernel was last asked about the connection's silence.
    silence_checked: Instant,
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

unsafe extern "C" {
    /// libzmq's, linked in by the zmq crate (whose own `monitor` cannot pass the null
    /// endpoint that stops a monitor).
    fn zmq_socket_monitor(
        socket: *mut std::ffi::c_void,
        endpoint: *const std::ffi::c_char,
        events: std::ffi::c_int,
    ) -> std::ffi::c_int;
}

impl RemoteReader {
    /// Connect to `endpoint` as rank `rank` and say HELLO.
    ///
    /// # Errors
    ///
    /// [`Error::Transport`] when the socket cannot be made, set up, monitored or connected
    /// to `endpoint` (a malformed address); [`Error::Os`] when the kernel gives no random
    /// session id.
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
        // ZeroMQ does not give the connection up: the reader does, see the type's docs.
        let heartbeat = set_heartbeats(&s, "remote reader", false)?;
        if let Some(timeout) = heartbeat {
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
        let events = zmq::SocketEvent::CONNECTED as i32
            | zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32
            | zmq::SocketEvent::DISCONNECTED as i32;
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
            queue: None,
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
                conn: None,
                silence_checked: now,
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
                zmq::SocketEvent::CONNECTED => {
                    // The event's value is the connection's descriptor.
                    let fd = i32::from_ne_bytes([ev[2], ev[3], ev[4], ev[5]]);
                    self.link.conn = super::guard::peer_of(fd).map(|peer| (fd, peer));
                }
                zmq::SocketEvent::HANDSHAKE_SUCCEEDED => {
                    self.link.up = true;
                    self.link.down_since = None;
                    // HELLO on every new connection, after the start too: the start is
                    // taken by the first receive, which may come after the connection
                    // that carried it ended (its end then seen before the start, so
                    // not as the stream's). The writer moves a reader it sent nothing
                    // to onto the new connection (and says start again: nothing new,
                    // see `accept`), and refuses one it did send to (messages lost).
                    self.say_hello();
                }
                zmq::SocketEvent::DISCONNECTED => {
                    self.link.up = false;
                    self.link.conn = None;
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
        if matches!(how, Ended::Gone(_) | Ended::Refused(_)) {
            // Best effort: only stops ZeroMQ from connecting again.
            let _ = self.socket.disconnect(&self.endpoint);
        }
        self.ended = Some(how);
        self.ended_error().expect("just ended")
    }

    /// The error of the stream's end, if it has ended.
    fn ended_error(&self) -> Option<Error> {
        Some(match self.ended.as_ref()? {
            Ended::Closed => Error::Queue(QueueError::WriterShutDown {
                queue: self
                    .queue
                    .as_ref()
                    .map(|q| format!("'{q}' (at {})", self.endpoint)),
            }),
            Ended::Dropped => Error::Remote(RemoteError::ReaderDropped {
                rank: self.rank,
                endpoint: self.endpoint.clone(),
                received: self.taken.msgs,
                queue: self.queue.clone(),
            }),
            Ended::Refused(why) => Error::Remote(RemoteError::Refused(why.clone())),
            Ended::Gone(reason) => Error::Remote(RemoteError::WriterGone {
                endpoint: self.endpoint.clone(),
                received: self.taken.msgs,
                reason: reason.clone(),
                queue: self.queue.clone(),
            }),
        })
    }

    /// The stream broke after the start: the reason the writer is gone.
    fn broken_reason(&self) -> String {
        "its connection closed without the writer's shutdown (the writer died or hangs, the \
         network between failed, or the writer's process ended before what it had sent \
         reached this reader: what did not arrive is lost)"
            .to_owned()
    }

    /// The reason the writer is gone if its connection is up but nothing at all (no byte
    /// of a message, none of ZeroMQ's heartbeats) has arrived on it for the interval plus
    /// the heartbeat timeout (see the type's docs). Asks the kernel at most every
    /// `SILENCE_CHECK`; no answer (heartbeats off, no connection, or its descriptor not
    /// known or no longer the connection's) is no verdict.
    fn silent(&mut self) -> Option<String> {
        let bound = self.link.unreachable_after()?;
        if !self.link.up || self.link.silence_checked.elapsed() < SILENCE_CHECK {
            return None;
        }
        self.link.silence_checked = Instant::now();
        let (fd, peer) = self.link.conn.as_ref()?;
        let quiet = last_data_received(*fd)?;
        // The descriptor is still the connection (checked after the question: a
        // descriptor reused before it would show another peer now).
        if super::guard::peer_of(*fd).as_ref() != Some(peer) || quiet < bound {
            return None;
        }
        Some(format!(
            "nothing arrived on its connection for {quiet:.1?} (not a byte of a message, none \
             of the heartbeats it sends every {HEARTBEAT_INTERVAL:?}) without the writer's \
             shutdown (the writer hangs or died, or the network between failed)"
        ))
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
        Error::Remote(RemoteError::Refused(format!(
            "remote reader rank {}{} at {}: {why}",
            self.rank,
            super::error::of_queue(self.queue.as_deref()),
            self.endpoint
        )))
    }

    /// The writer as waits name it: "the writer of queue 'steps' at tcp://…", or "the
    /// writer at tcp://…" before its WELCOME, or where it did not name the queue.
    fn writer_words(&self) -> String {
        format!(
            "the writer{} at {}",
            super::error::of_queue(self.queue.as_deref()),
            self.endpoint
        )
    }

    /// Check one message from the socket; `Ok(None)` for one to ignore (not from the
    /// writer, or a handshake message).
    pub(super) fn accept(
        &mut self,
        mut frames: Vec<zmq::Message>,
    ) -> Result<Option<Vec<zmq::Message>>> {
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
                    // For good, every later call too: a refused reader that went on
                    // waiting would wait on a connection the writer never sends to
                    // (after the start: the writer sent on a connection that ended, and
                    // what it sent there is lost).
                    let Error::Remote(RemoteError::Refused(why)) = self.refuse(&format!(
                        "the writer refused it: {}",
                        String::from_utf8_lossy(text)
                    )) else {
                        unreachable!("refuse makes a Refused error")
                    };
                    return Err(self.end(Ended::Refused(why)));
                }
                if known.is_some() {
                    // The answer to a HELLO said again: nothing new.
                    return Ok(None);
                }
                self.session = Some(session);
                // The queue's name after the bounds, kept only if it is one a queue may
                // have (no control, bidirectional-text or zero-width characters: it goes
                // into messages the user reads).
                self.queue = text
                    .get(16..)
                    .filter(|t| !t.is_empty())
                    .and_then(|t| std::str::from_utf8(t).ok())
                    .filter(|t| crate::broadcast::ring::check_label(t).is_ok())
                    .map(str::to_owned);
                // The writer's bounds: acknowledge every eighth of them (a writer that
                // did not say gets an ACK for every message).
                if let (Some(m), Some(b)) = (text.get(..8), text.get(8..16)) {
                    let m = u64::from_le_bytes(m.try_into().expect("8 bytes"));
                    let b = u64::from_le_bytes(b.try_into().expect("8 bytes"));
                    self.taken.every_msgs = (m / 8).max(1);
                    self.taken.every_bytes = (b / 8).max(1);
                }
                // From here on the writer's credit bounds what it sends (see the `remote`
                // module docs); ZeroMQ's bound, which counts its room in batches, could stop
                // taking frames from the network before that, and with them the
                // heartbeats' answers. Best effort: the bound stays as it was otherwise.
                let _ = self.socket.set_rcvhwm(0);
                Ok(None)
            }
            (KIND_READY, Some(s)) if s == session => {
                let want = message_mac(&self.key, b"ready", &session, seq, []);
                if !mac_eq(&want, got_mac) {
                    return Err(self.refuse("a start message failed authentication"));
                }
                if self.started {
                    if seq == self.seq && self.taken.msgs == 0 {
                        // Said again on a new connection, before any message: the writer
                        // moved this reader there (its HELLO on the new connection), and
                        // nothing was sent on the old one. Nothing new, nothing lost: the
                        // stream goes on on this connection, if it is up (an end seen
                        // now may be this very connection's: it stays the stream's end).
                        self.watch_link();
                        self.link.broken &= !self.link.up;
                        return Ok(None);
                    }
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
            (KIND_DATA | KIND_DROPPED, Some(s)) if s == session && !self.started => Err(self.refuse(
                "a message arrived before the writer said start (does the writer send before its wait_until_ready?)",
            )),
            (KIND_DATA, Some(s)) if s == session => {
                let body = frames.iter().map(|m| &m[..]);
                if !mac_eq(&message_mac(&self.key, b"data", &session, seq, body), got_mac) {
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
                let want = message_mac(&self.key, b"closed", &session, seq, []);
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
                let want = message_mac(
                    &self.key,
                    b"dropped",
                    &session,
                    seq,
                    [&self.rank.to_le_bytes()[..]],
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
            Err(Error::Remote(RemoteError::Refused(why))) => {
                self.watch_link();
                if self.link.broken {
                    return Err(self.end(Ended::Gone(self.broken_reason())));
                }
                Err(Error::Remote(RemoteError::Refused(why)))
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
    ///
    /// # Errors
    ///
    /// [`RemoteError::WriterGone`] once the writer is gone (its connection lost, or no
    /// heartbeat within the bound); [`RemoteError::ReaderDropped`] when it dropped this
    /// reader; [`QueueError::WriterShutDown`] after its last message;
    /// [`RemoteError::Refused`] for a message that fails authentication or comes out of
    /// order; [`Error::Transport`] when the socket fails.
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
                        // No connection up for as long as a silent one lasts (before the
                        // start, or after a start taken once the connection that carried
                        // it had ended), or one up and silent: the writer is gone.
                        if let Some(reason) = self.unreachable().or_else(|| self.silent()) {
                            return Err(self.end(Ended::Gone(reason)));
                        }
                        if !self.started && self.link.hello_at.elapsed() >= HELLO_AGAIN {
                            self.say_hello();
                        }
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
    ///
    /// # Errors
    ///
    /// As [`try_recv_frames`](Self::try_recv_frames), and [`Error::Timeout`] or the hook's
    /// error when `wait` ends first.
    pub fn recv_frames(&mut self, wait: &mut Wait) -> Result<Vec<zmq::Message>> {
        loop {
            let slice = wait.remaining().map_or(POLL_SLICE, |r| r.min(POLL_SLICE));
            if let Some(f) = self.recv_frames_for(slice)? {
                return Ok(f);
            }
            // The connection is watched (see the type's docs): the warning says where
            // the writer is and how far the stream got.
            let (writer, seq) = (self.writer_words(), self.seq);
            let state = if self.session.is_none() {
                // Its WELCOME answers the HELLO: the writer serves HELLOs in its own calls
                // of the queue (a wait, a send), and never answers a wrong secret.
                "no answer to this reader's hello yet: the writer has not called \
                 wait_until_ready or sent since, or this reader's secret (its handle) is \
                 not the queue's"
                    .to_owned()
            } else if !self.started {
                "accepted, not told to start yet: the writer's wait_until_ready has not \
                 returned"
                    .to_owned()
            } else {
                format!("started, {seq} messages received from it so far")
            };
            wait.step_explained(&mut crate::wait::no_peer, &mut || {
                format!("{writer} (on another host): {state}")
            })?;
        }
    }

    /// Wait until this reader is connected to the writer's port: ZeroMQ's handshake,
    /// which the writer's I/O thread answers whatever the writer's program is doing. It
    /// does not wait for the writer's own `wait_until_ready` (its WELCOME and start are
    /// taken by the first receive, which says HELLO again until they come), so no order
    /// of the two sides' waits, across any number of queues, deadlocks. A writer that
    /// cannot be reached for as long as a silent connection lasts ends the wait.
    ///
    /// # Errors
    ///
    /// [`RemoteError::Refused`] when the writer refuses this reader or does not prove the
    /// queue's secret; [`RemoteError::WriterGone`] when it is gone; [`Error::Timeout`] or
    /// the hook's error when `wait` ends first; [`Error::Transport`] when the socket fails.
    pub fn wait_ready(&mut self, wait: &mut Wait) -> Result<()> {
        loop {
            if let Some(e) = self.ended_error() {
                return Err(e);
            }
            while let Some(raw) = self.try_recv_raw()? {
                match self.accept_checked(raw)? {
                    Some(frames) if frames.is_empty() => return Ok(()),
                    Some(_) => {
                        return Err(self.refuse("a message arrived before the writer said start"));
                    }
                    None => {}
                }
            }
            self.watch_link();
            if self.link.up {
                return Ok(());
            }
            if let Some(reason) = self.unreachable().or_else(|| self.silent()) {
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

/// How long ago data (not a bare ACK) last arrived on TCP socket `fd`, as its kernel
/// says (`TCP_INFO`'s `tcpi_last_data_recv`); `None` if it cannot say (not a TCP socket,
/// or closed).
fn last_data_received(fd: i32) -> Option<Duration> {
    // SAFETY: all-zero bytes are a valid `tcp_info` (integers only).
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is writable for `len` bytes, and getsockopt writes at most that and
    // sets `len`. `fd` is ZeroMQ's descriptor, which its I/O thread may close (and the
    // number be reused) at any time: that only makes the call fail or describe another
    // socket, which the caller rules out by its peer address afterwards; nothing is
    // written to the socket.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    // The field is in every kernel's `tcp_info` since 2.6; a shorter answer lacks it.
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_last_data_recv) + 4;
    (rc == 0 && len as usize >= needed)
        .then(|| Duration::from_millis(u64::from(info.tcpi_last_data_recv)))
}

#[cfg(test)]
/// A reader of rank 1 whose handshake gave it `session`, before the start message
/// (its socket is connected to nothing: messages go to `accept` by hand).
pub(super) fn reader_in_session(
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
        queue: None,
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
            conn: None,
            silence_checked: Instant::now(),
        },
        taken: Taken::default(),
    }
}
