//! The worker link: how a worker the parent did not start (on another machine) joins a
//! parent over one TCP connection, authenticated with the core's [`shmq_core::auth`].
//!
//! The parent listens ([`WorkerListener::bind`]) and hands out a [`Ticket`], its address
//! and a random token; a worker connects with it ([`ParentLink::connect`]). Each side
//! proves it knows the token over the other's fresh nonce (the token never crosses the
//! wire), then every frame is sealed with [`shmq_core::auth::message_mac`] over the
//! session (both nonces) and its sequence number: a frame altered, replayed, reflected,
//! out of turn or of a kind that is not the peer's to send ends the link with an error
//! (a kind this version does not know is skipped), and so does the connection's loss, which is
//! how the parent learns a worker died.
//!
//! Frames are `[4-byte big-endian length][1-byte kind][payload]`; after the handshake the
//! payload starts with the frame's 8-byte big-endian sequence number and its 32-byte seal:
//!
//! ```text
//! parent -> worker   C  {"nonce": hex, "version": 2}              challenge
//! worker -> parent   H  {"rank", "pid", "host", "nonce", "mac"}   mac: hello_mac()
//! parent -> worker   A  {"ok": true, "mac"}                       mac: welcome_mac()
//!                    A  {"ok": false, "error": str}               refused, then closed
//!   -- sealed from here --
//! worker -> parent   R  payload (bytes; Python: pickle(info))     ready
//! worker -> parent   X  {"exitcode", "stderr": [lines]}           leaving
//! parent -> worker   S  {"grace": seconds}                        stop
//! parent -> worker   F  notice (bytes)                            a sibling failed
//! ```
//!
//! Limits, so that a stranger on the port (or posing as the parent) and an admitted peer
//! cost bounded time and memory: each end's handshake has one deadline for all of it
//! (the parent's [`HANDSHAKE_TIMEOUT`] from its accept, a worker's `timeout` of
//! [`ParentLink::connect`]), however slowly the bytes come; a handshake frame is at most
//! [`MAX_HELLO_FRAME`] and an admitted link's frame at most [`MAX_FRAME`], either way,
//! a longer length refused as it is read, before any of the body
//! ([`LinkError::HandshakeFrameTooLong`], [`LinkError::FrameTooLong`]: the handshake or
//! the link is over); a body is read as it comes, into a buffer that grows with what
//! arrived, and each end holds one frame at a time.
//!
//! A parent that admits on a port strangers can reach ([`Workers::admit_remote`](crate::Workers::admit_remote))
//! holds at most [`MAX_HANDSHAKES`] connections in their handshake at once; past that, the
//! oldest still waiting for its hello of the host with the most gives way
//! ([`HandshakeSlots`]), so that strangers flooding from one host cannot keep a genuine
//! worker out.
//!
//! The Python package's `shmq.workers` drives this module through the bindings at both
//! ends (a `WorkerProcesses` parent admits with [`Workers::admit_remote`](crate::Workers::admit_remote), `connect_to_parent`
//! is [`ParentLink::connect`]; the frames' kinds are [`Kind`], `shmq._core.LinkKind`), so
//! Rust and Python parents and workers admit one another and behave alike.
//!
//! ```no_run
//! # mod shmq { pub mod workers { pub use shmq_workers::*; } } // the `shmq` crate
//! use std::time::Duration;
//! use shmq::workers::link::{ParentLink, ParentMessage, WorkerListener, WorkerMessage};
//!
//! // The parent:
//! let listener = WorkerListener::bind("127.0.0.1:0")?;
//! let ticket = listener.ticket().to_string(); // give it to the worker, over a trusted channel
//! # std::thread::spawn(move || -> shmq::workers::Result<()> {
//! // The worker (another process, another machine):
//! let mut parent = ParentLink::connect(&ticket.parse()?, 0, Duration::from_secs(30))?;
//! parent.send_ready(b"set up")?;
//! if let ParentMessage::Stop { .. } = parent.recv()? {
//!     parent.send_leaving(0, &[])?;
//! }
//! # Ok(()) });
//! // Back in the parent: admit rank 0 only.
//! let mut worker = listener.accept(|hello| match hello.rank {
//!     0 => Ok(()),
//!     r => Err(format!("rank {r} is not expected")),
//! })?;
//! assert!(matches!(worker.recv()?, WorkerMessage::Ready(p) if p == b"set up"));
//! worker.send_stop(Duration::from_secs(5))?;
//! let left = worker.recv(); // Leaving, or an error: the link is lost (the worker died)
//! # let _ = left;
//! # Ok::<(), shmq::workers::Error>(())
//! ```

mod endpoint;
mod frame;
mod handshake;
mod slots;
#[cfg(test)]
mod tests;

pub use endpoint::{
    LinkSender, ParentLink, ParentMessage, RemoteWorker, WorkerListener, WorkerMessage,
};
pub use frame::{
    frame_length, read_frame, read_frame_from, write_frame, SealIn, SealOut, Side, SEAL_BYTES,
};
pub use handshake::{
    challenge_payload, hello_mac, new_nonce, read_answer, read_challenge, refusal_payload,
    welcome_mac, welcome_payload, Hello,
};
pub use slots::{HandshakeSlot, HandshakeSlots, MAX_HANDSHAKES};

use std::time::Duration;

use shmq_core::auth::{secret_from_text, secret_to_text, SECRET_BYTES};

/// The link's protocol, in the parent's challenge (an older shmq's had none).
pub const PROTOCOL_VERSION: u64 = 2;
/// The largest frame of an admitted link, either way (its kind, number, seal and payload:
/// a worker's ready payload is at most this less 41 bytes). A longer length is refused
/// as it is read, before any of the frame's body, and ends the link
/// ([`LinkError::FrameTooLong`]); a sender refuses to send one ([`LinkSender::send`]).
/// Each end holds one frame at a time, read as its bytes come (its buffer grows with
/// them, at most doubling what arrived, never to the claimed length up front), so a
/// peer that floods frames costs the receiver about twice this at most, and nothing
/// once each frame is handled.
pub const MAX_FRAME: usize = 16 << 20;
/// The largest handshake frame (challenge, hello, answer), which either end reads
/// before the other proved the token: a longer length is refused as it is read, before
/// any of the frame's body ([`LinkError::HandshakeFrameTooLong`]). The hello is about
/// 300 bytes, the challenge about 100; a refusal's reason is cut to fit.
pub const MAX_HELLO_FRAME: usize = 4096;
/// How long the parent gives one connection for its whole handshake, from its accept to
/// the worker's hello (one deadline for every read and write of it, however slowly the
/// bytes come; the welcome of a worker that proved the token then has this long again).
/// A worker's side has one deadline of its own for its whole handshake (the `timeout`
/// of [`ParentLink::connect`]).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Defines [`Kind`] and its tables from one list: each kind's variant, byte, Python
/// name, and whether the parent sends it and whether it is a handshake's.
macro_rules! kinds {
    ($($(#[$doc:meta])* $variant:ident = $byte:literal, $name:literal, parent: $parent:literal, handshake: $handshake:literal;)*) => {
        /// The kinds of the link's frames, the one list of them (the Python package gets
        /// them from the bindings, as `shmq._core.LinkKind`). A frame carries its kind as
        /// one byte, the variant's value. Adding one: a line in this list, what sends and
        /// what receives it ([`RemoteWorker::recv`] and [`ParentLink::recv`] match every
        /// kind, so they do not compile until they handle it), its line in the module
        /// docs' table, and `LinkKind` in the stubs (`python/shmq/_core.pyi`, which
        /// stubtest checks against this list).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Kind {
            $($(#[$doc])* $variant = $byte,)*
        }

        impl Kind {
            /// Every kind, in the order of the module docs' table.
            pub const ALL: &'static [Kind] = &[$(Kind::$variant),*];

            /// Its name as the Python package spells it (`LinkKind.SIBLING_FAILED`).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Kind::$variant => $name,)*
                }
            }

            /// Whether it is the parent's to send (else a worker's).
            pub const fn from_parent(self) -> bool {
                match self {
                    $(Kind::$variant => $parent,)*
                }
            }

            /// Whether it is a handshake's (unsealed, before the link is admitted).
            pub const fn in_handshake(self) -> bool {
                match self {
                    $(Kind::$variant => $handshake,)*
                }
            }
        }
    };
}

kinds! {
    /// parent -> worker: the challenge.
    Challenge = b'C', "CHALLENGE", parent: true, handshake: true;
    /// worker -> parent: the hello.
    Hello = b'H', "HELLO", parent: false, handshake: true;
    /// parent -> worker: the answer (welcome or refusal).
    Answer = b'A', "ANSWER", parent: true, handshake: true;
    /// worker -> parent: ready.
    Ready = b'R', "READY", parent: false, handshake: false;
    /// worker -> parent: leaving.
    Leaving = b'X', "LEAVING", parent: false, handshake: false;
    /// parent -> worker: stop.
    Stop = b'S', "STOP", parent: true, handshake: false;
    /// parent -> worker: a sibling failed.
    SiblingFailed = b'F', "SIBLING_FAILED", parent: true, handshake: false;
}

impl Kind {
    /// Its byte on the wire.
    pub const fn byte(self) -> u8 {
        self as u8
    }

    /// The kind of a frame's byte, or `None` for one this version does not know.
    pub fn from_byte(byte: u8) -> Option<Kind> {
        Kind::ALL.iter().copied().find(|k| k.byte() == byte)
    }
}

/// What a worker needs to join: the parent's address and its token. Its text form is
/// `shmq-workers://HOST:PORT/TOKEN` (an IPv6 host in brackets, the token
/// 64 hexadecimal digits), as the Python package's `WorkerTicket`.
#[derive(Clone, PartialEq, Eq)]
pub struct Ticket {
    /// The parent's host (name or address, without brackets).
    pub host: String,
    /// The parent's port.
    pub port: u16,
    /// The secret.
    pub token: [u8; SECRET_BYTES],
}

const TICKET_PREFIX: &str = "shmq-workers://";

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("Ticket")
            .field("host", &self.host)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Display for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        write!(
            f,
            "{TICKET_PREFIX}{host}:{}/{}",
            self.port,
            secret_to_text(&self.token)
        )
    }
}

impl std::str::FromStr for Ticket {
    type Err = crate::Error;

    fn from_str(text: &str) -> crate::Result<Ticket> {
        let shown: String = text.chars().take(40).collect();
        let bad = || {
            crate::Error::Core(shmq_core::Error::InvalidArgument(format!(
                "not a worker ticket (expected {TICKET_PREFIX}HOST:PORT/TOKEN, TOKEN 64 \
                 hexadecimal digits): {shown:?}"
            )))
        };
        let rest = text.strip_prefix(TICKET_PREFIX).ok_or_else(bad)?;
        let (address, token) = rest.split_once('/').ok_or_else(bad)?;
        let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        Ok(Ticket {
            host: host.to_owned(),
            port: port.parse().map_err(|_| bad())?,
            token: secret_from_text(token).ok_or_else(bad)?,
        })
    }
}

/// What ends a link or refuses a handshake.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// The connection failed (or a read or write timed out).
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The peer closed the connection.
    #[error("connection closed")]
    Closed,
    /// The deadline of a read passed.
    #[error("the deadline passed")]
    TimedOut,
    /// A frame whose length is 0 or over the limit (its body is not read).
    #[error("bad frame length {length} (at most {max} here)")]
    BadLength { length: u64, max: usize },
    /// A handshake frame (challenge, hello, answer) whose length is over
    /// [`MAX_HELLO_FRAME`]: refused as the length was read, before any of its body was
    /// read or allocated. No shmq worker link sends one: the handshake is over.
    #[error(
        "{peer} sent a handshake frame of {length} bytes, over the handshake's limit of \
         {max} bytes (refused before reading it: not a shmq worker link)"
    )]
    HandshakeFrameTooLong {
        peer: String,
        length: u64,
        max: usize,
    },
    /// A frame of an admitted link whose length is over [`MAX_FRAME`]: refused as the
    /// length was read, before any of its body was read or allocated. The link is over.
    #[error(
        "{peer} sent a frame of {length} bytes, over the link's limit of {max} bytes \
         (refused before reading it): the link is over"
    )]
    FrameTooLong {
        peer: String,
        length: u64,
        max: usize,
    },
    /// A sealed frame too short to hold its number and seal.
    #[error("a frame without its seal (is another process on this connection?)")]
    Unsealed,
    /// A frame whose seal is not the peer's.
    #[error("a frame failed authentication (is another process on this connection?)")]
    BadSeal,
    /// A genuine frame out of turn: frames were lost.
    #[error("frame {got} arrived where frame {due} was due: frames were lost")]
    OutOfTurn { got: u64, due: u64 },
    /// A sealed frame of a kind that has no place after the handshake on this side (a
    /// handshake's, or one that only this side sends).
    #[error("unexpected frame kind {kind:?}")]
    UnexpectedKind { kind: char },
    /// A handshake message or frame that is not what the protocol says.
    #[error("{0}")]
    Malformed(String),
    /// The peer refused this side, or this side the peer: why.
    #[error("{0}")]
    Refused(String),
}

impl LinkError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> LinkError {
        match source.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => LinkError::TimedOut,
            std::io::ErrorKind::UnexpectedEof => LinkError::Closed,
            _ => LinkError::Io {
                context: context.into(),
                source,
            },
        }
    }

    /// Whether the link was lost (closed, reset, timed out) rather than refused or
    /// tampered with.
    pub fn is_loss(&self) -> bool {
        matches!(
            self,
            LinkError::Io { .. } | LinkError::Closed | LinkError::TimedOut
        )
    }
}
