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
//! The MAC is BLAKE3 in keyed mode (a MAC by design, and fast, so tensor-sized
//! messages stay cheap). Messages are authenticated, not encrypted: a network where
//! eavesdropping matters needs a tunnel (WireGuard, SSH) under it.
//!
//! - The writer's end (its `shutdown()` or its normal end) is a last message of its own
//!   kind, CLOSED, with the next sequence number and a MAC: a reader that takes it has
//!   every message before it and then fails with
//!   [`QueueError::WriterShutDown`](crate::broadcast::QueueError::WriterShutDown). The reader
//!   answers `"SQB1"` (BYE), which the writer waits for a short while, so that a writer
//!   process that exits at once still gets the message out.
//! - A reader the writer drops (`SlowReaderPolicy::Drop`) is told so the same way:
//!   DROPPED, after the last message sent to it, with the next sequence number, its rank
//!   and a MAC; it then fails with [`RemoteError::ReaderDropped`] instead of waiting for
//!   messages that will not come.
//!
//! No wait of a remote reader goes on without an end (see [`RemoteReader`]): its
//! connection carries ZeroMQ's heartbeats (a PING every [`HEARTBEAT_INTERVAL`] each way,
//! answered by a PONG), and the reader watches its connection: through ZeroMQ's socket
//! monitor (made, ended) and through the kernel (`TCP_INFO`: when bytes last arrived on
//! it). Nothing at all arriving for the interval plus the heartbeat timeout is the
//! writer's silence; bytes of a message on their way are not (ZeroMQ's own heartbeat
//! timeout counts whole frames only, and a PONG waits behind the frame being sent: one
//! 32 MiB frame over 40 Mbit/s takes 6.7 s). Once the writer has said start, a
//! connection that ends without CLOSED (the writer killed: at once), or stays silent (a
//! writer that hangs, or a network that fails: within the interval plus the timeout), is
//! the writer's death, [`RemoteError::WriterGone`], after every message that arrived
//! before it; a new connection could not carry the stream on (what was in flight is
//! lost), so the reader does not make one. Before the start a lost connection is made
//! again, and the HELLO said again on it, until the reader's own deadline; only a writer
//! that cannot be reached at all for the interval plus the timeout is gone.
//!
//! A reader's `wait_until_ready` waits only for its connection (ZeroMQ's handshake,
//! which the writer's I/O thread answers whatever the writer's program is doing), not
//! for the writer's own `wait_until_ready`: the WELCOME and the start are taken by the
//! reader's first receive, so no order of the two sides' waits deadlocks. A start taken
//! after the connection that carried it ended cannot leave the reader on a dead stream:
//! the reader says HELLO on every new connection, and the writer moves a reader it sent
//! nothing to onto it (saying start again there, which the reader takes as nothing new:
//! same session, same sequence number, nothing taken yet) or refuses one it did send to;
//! and no connection up for the interval plus the timeout is the writer's end, after
//! the start too. The WELCOME also carries the queue's name (under its MAC) where its
//! writer named it, so the reader's errors name the queue.
//!
//! No wait of the writer for a remote reader goes on without an end either: the
//! writer's end of each connection carries ZeroMQ's heartbeats too (a PING every
//! [`HEARTBEAT_INTERVAL`]; the connection is closed when nothing comes from the reader,
//! no PONG and none of its own PINGs or ACKs, for the heartbeat timeout after one). A
//! reader whose connection closed (it died; or it hangs, its machine died or the network
//! between failed: within the interval plus the timeout of the last thing heard from
//! it) is gone: a warning, no more messages to it, and a writer waiting for its credit
//! goes on without it (the writer asks the kernel whether the connection the reader's
//! HELLO came on is still there, so it needs no more PINGs to find out). A reader
//! silent for less than the timeout (a pause, a link down for a moment) is not cut off.
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
//!
//! The files: this one (the options, the heartbeat, the secret), `wire` (the frames'
//! magics, kinds and header), `writer` (the writer's end; `writer/handshake`: its side of
//! joining), `error` ([`RemoteError`]), `guard` (the guard of the writer's port), `reader` (the reader's end) and
//! `tests`.

mod error;
mod guard;
mod reader;
#[cfg(test)]
mod tests;
mod wire;
mod writer;

use std::time::Duration;

use crate::error::{Error, Result};

pub use error::RemoteError;
pub use reader::RemoteReader;
pub use writer::RemoteWriter;

/// Bytes of the queue's secret.
pub use crate::auth::SECRET_BYTES;

/// How often a remote reader's connection carries a ZeroMQ heartbeat (PING) to the writer.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// Default of how long a PING may go unanswered (no PONG, no other frame from the
/// writer) before the reader gives the connection up: see [`heartbeat_timeout`].
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(4);
/// The environment variable that sets another heartbeat timeout, in seconds (0: no
/// heartbeats; then only a connection that closes ends a wait).
pub const HEARTBEAT_TIMEOUT_ENV: &str = "SHMQ_REMOTE_HEARTBEAT_TIMEOUT";

/// How long a remote reader's PING may go unanswered before it gives its connection up
/// ([`HEARTBEAT_TIMEOUT_ENV`], else [`DEFAULT_HEARTBEAT_TIMEOUT`]); `None`: no
/// heartbeats. A reader counts every byte that arrives as an answer (a PONG waits behind
/// the frame being sent: a large message on a slow link is not silence), so this bounds
/// how long a connection may carry nothing at all.
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

/// ZeroMQ's heartbeats on `s` (a PING every [`HEARTBEAT_INTERVAL`]), the same on the
/// writer's and the reader's sockets; with `zmq_gives_up`, ZeroMQ gives the connection up
/// when no whole frame comes from the peer for [`heartbeat_timeout`] after a PING (the
/// writer's socket: the reader sends it only small frames). Without, the caller watches
/// the connection itself (the reader's socket: a frame of a large message may take longer
/// than the timeout to arrive, and ZeroMQ counts only whole frames, see
/// `RemoteReader`). `what` names the socket in errors. Returns the timeout (`None`:
/// heartbeats are off).
fn set_heartbeats(s: &zmq::Socket, what: &str, zmq_gives_up: bool) -> Result<Option<Duration>> {
    let Some(timeout) = heartbeat_timeout() else {
        return Ok(None);
    };
    let opt = |o: &str| Error::transport(format!("setting {o} on the {what} socket"));
    s.set_heartbeat_ivl(millis(HEARTBEAT_INTERVAL))
        .map_err(opt("HEARTBEAT_IVL"))?;
    // 0: no timeout (libzmq starts its timer only for a timeout above 0; its default, -1,
    // would be the interval).
    let zmq_timeout = if zmq_gives_up { millis(timeout) } else { 0 };
    s.set_heartbeat_timeout(zmq_timeout)
        .map_err(opt("HEARTBEAT_TIMEOUT"))?;
    Ok(Some(timeout))
}

/// Milliseconds as ZeroMQ's options take them.
fn millis(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
}

/// A secret of [`SECRET_BYTES`] random bytes, from the kernel.
///
/// # Errors
///
/// [`Error::Os`] when the kernel refuses `getrandom`.
pub fn new_secret() -> Result<[u8; SECRET_BYTES]> {
    crate::auth::new_secret("the queue's remote secret")
}

fn random16() -> Result<[u8; 16]> {
    crate::auth::nonce("a remote session id or nonce")
}

/// What the writer does with a remote reader whose queue (`hwm` messages) is full.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SlowReaderPolicy {
    /// Wait until it takes messages again, within the enqueue's timeout, or until it is
    /// gone (its connection closed, or silent for the heartbeat timeout after a PING:
    /// see the module docs); then go on without it.
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
        crate::error::parse_choice("slow_remote_reader", s, &choices)
    }
}

/// What a send does once the writer has lost a remote reader: gone (its connection
/// closed, or nothing came from it within the heartbeat bound) or dropped as slow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LostReaderPolicy {
    /// Warn once (naming its rank and host) and go on without it.
    #[default]
    Warn,
    /// That warning, and then the send that found it lost and every later one fail with
    /// [`RemoteError::LostReaders`] naming the readers lost so far (after the message
    /// went to the others).
    Raise,
}

impl std::str::FromStr for LostReaderPolicy {
    type Err = Error;
    /// `"warn"` or `"raise"` (the Python argument `on_lost_remote_reader`).
    fn from_str(s: &str) -> Result<LostReaderPolicy> {
        match s {
            "warn" => Ok(LostReaderPolicy::Warn),
            "raise" => Ok(LostReaderPolicy::Raise),
            _ => Err(Error::InvalidArgument(format!(
                "on_lost_remote_reader must be 'warn' or 'raise', got '{s}'"
            ))),
        }
    }
}

/// How the remote stream is bounded (see the module docs: credit), and what the writer
/// does with a reader that falls behind or that it loses.
///
/// # Examples
///
/// A queue whose one reader is remote (it reads over TCP, from another machine in real
/// use), its stream bounded to 100 messages and its loss an error of the writer's:
///
/// ```
/// use std::time::Duration;
/// use shmq_core::remote::{LostReaderPolicy, SlowReaderPolicy};
/// use shmq_core::{QueueOptions, Reader, Writer};
///
/// let t = Duration::from_secs(10);
/// let mut opts = QueueOptions::local(1);
/// opts.n_local_reader = 0; // rank 0 is remote
/// opts.connect_ip = Some("127.0.0.1".into()); // where the readers connect
/// opts.remote.hwm = 100;
/// opts.remote.slow_reader = SlowReaderPolicy::Block; // wait for it, never drop it
/// opts.remote.on_lost_reader = LostReaderPolicy::Raise;
/// opts.remote.check()?;
/// let mut writer = Writer::new(opts)?;
/// let mut reader = Reader::open(writer.handle(), 0)?; // connects to the writer's port
/// std::thread::scope(|s| {
///     s.spawn(|| -> shmq_core::Result<()> {
///         writer.wait_until_ready(t)?; // the remote reader has said HELLO
///         writer.enqueue(b"over tcp", t)?;
///         Ok(())
///     });
///     reader.wait_until_ready(t)?;
///     assert_eq!(reader.dequeue(t)?, b"over tcp");
///     Ok::<(), shmq_core::Error>(())
/// })?;
/// # Ok::<(), shmq_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteOptions {
    /// Messages sent to one remote reader and not yet taken by it, at most.
    pub hwm: i32,
    /// Bytes (of message frames) sent to one remote reader and not yet taken by it, at
    /// most; a larger message goes once the reader has taken everything before it.
    pub max_queued_bytes: u64,
    pub slow_reader: SlowReaderPolicy,
    pub on_lost_reader: LostReaderPolicy,
}

/// Default of [`RemoteOptions::max_queued_bytes`]: 256 MiB.
pub const DEFAULT_MAX_QUEUED_BYTES: u64 = 256 << 20;

impl RemoteOptions {
    /// `InvalidArgument` unless `hwm` is at least 1 message and `max_queued_bytes` at
    /// least 1 byte ([`Writer::new`](crate::Writer::new) checks).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an `hwm` of 0 messages or a `max_queued_bytes` of 0
    /// bytes.
    ///
    /// # Examples
    ///
    /// See [the type's example](RemoteOptions).
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
            on_lost_reader: LostReaderPolicy::Warn,
        }
    }
}

fn socket(ctx: &zmq::Context, kind: zmq::SocketType, what: &str) -> Result<zmq::Socket> {
    ctx.socket(kind)
        .map_err(Error::transport(format!("creating the {what} socket")))
}

/// How long ZeroMQ's own handshake may take on a connection, on either side (ms).
const HANDSHAKE_IVL_MS: i32 = 5000;
