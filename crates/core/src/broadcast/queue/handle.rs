//! [`Handle`]: what a reader process needs to join a queue, and its one-line text form
//! (`Display` / `FromStr`), checked field by field when parsed.
//!
//! The text form is the one both languages speak (see [`Handle`]).

use std::fmt;
use std::str::FromStr;

use super::super::ring::RingHandle;
use crate::auth::{secret_from_text, secret_to_text};
use crate::error::{Error, Result};
use crate::remote::SECRET_BYTES;

/// Everything a reader process needs to join a queue. Send it to readers however you
/// like; `Display`/`FromStr` give its one-line text form.
///
/// That text is the one both languages speak: Python's `shmq.Handle` prints it
/// (`str(handle)`) and parses it (`Handle.from_str(text)`) through this code, so a
/// handle printed by a Rust writer opens a Python reader and the other way round. Eight
/// fields separated by `|`, empty for "none":
///
/// ```text
/// shmq-handle-3|<ranks>|<ring>|<local addr>|<remote addr>|<ipv6>|<arena>|<secret>
/// ```
///
/// - `ranks`: the local readers' ranks, comma-separated (`0,1`);
/// - `ring`: the shared-memory ring as `n_reader,max_chunk_bytes,max_chunks,name`
///   (Python's `buffer_handle` tuple);
/// - `local addr` / `remote addr`: the ZeroMQ addresses of the local overflow socket
///   and of the remote readers' stream (`ipc://...`, `tcp://host:port`);
/// - `ipv6`: `1` if the remote address is IPv6, else `0`;
/// - `arena`: the tensor arena's segment name (Python's `arena_name`);
/// - `secret`: the remote readers' secret, its 32 bytes as 64 lowercase hexadecimal
///   digits (Python's `remote_secret` holds the same string; uppercase digits parse
///   too).
///
/// The text carries the secret: send it over a trusted channel, as the handle itself.
/// `Debug` (and Python's `repr`) leave the secret out; a parse error names only the
/// text's first characters and which field is wrong, never a field's value.
///
/// ```
/// # use shmq_core as shmq; // what the `shmq` crate re-exports
/// let text = "shmq-handle-3|0,1|2,65536,4,shmq_ring_1_ab|ipc:///tmp/s/local||0||";
/// let handle: shmq::Handle = text.parse()?;
/// assert_eq!(handle.local_reader_ranks, [0, 1]);
/// assert_eq!(handle.buffer.as_ref().map(|b| b.max_chunk_bytes), Some(65536));
/// assert_eq!(handle.to_string(), text);
/// assert!("shmq-handle-2|0".parse::<shmq::Handle>().is_err()); // another version
/// # Ok::<(), shmq::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Handle {
    pub local_reader_ranks: Vec<usize>,
    pub buffer: Option<RingHandle>,
    pub local_subscribe_addr: Option<String>,
    pub remote_subscribe_addr: Option<String>,
    pub remote_addr_ipv6: bool,
    /// The tensor arena's segment, if the queue has one.
    pub arena: Option<String>,
    /// The secret remote readers prove they hold (only with remote readers). It is what
    /// keeps strangers off the writer's port: send the handle over a trusted channel.
    pub remote_secret: Option<[u8; SECRET_BYTES]>,
}

const HANDLE_TAG: &str = "shmq-handle-3";

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secret: debug output ends up in logs.
        f.debug_struct("Handle")
            .field("local_reader_ranks", &self.local_reader_ranks)
            .field("buffer", &self.buffer)
            .field("local_subscribe_addr", &self.local_subscribe_addr)
            .field("remote_subscribe_addr", &self.remote_subscribe_addr)
            .field("remote_addr_ipv6", &self.remote_addr_ipv6)
            .field("arena", &self.arena)
            .field("remote_secret", &self.remote_secret.map(|_| "<hidden>"))
            .finish()
    }
}

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ranks: Vec<String> = self
            .local_reader_ranks
            .iter()
            .map(|r| r.to_string())
            .collect();
        let buffer = self
            .buffer
            .as_ref()
            .map(|b| {
                format!(
                    "{},{},{},{}",
                    b.n_reader, b.max_chunk_bytes, b.max_chunks, b.name
                )
            })
            .unwrap_or_default();
        write!(
            f,
            "{HANDLE_TAG}|{}|{}|{}|{}|{}|{}|{}",
            ranks.join(","),
            buffer,
            self.local_subscribe_addr.as_deref().unwrap_or(""),
            self.remote_subscribe_addr.as_deref().unwrap_or(""),
            u8::from(self.remote_addr_ipv6),
            self.arena.as_deref().unwrap_or(""),
            self.remote_secret
                .map(|k| secret_to_text(&k))
                .unwrap_or_default()
        )
    }
}

impl FromStr for Handle {
    type Err = Error;
    /// Parse the text form (see the module docs); surrounding whitespace is ignored.
    /// A text that is not a handle is `Error::InvalidArgument` saying what is wrong.
    fn from_str(s: &str) -> Result<Handle> {
        // The text may hold the secret: name only its start (and the field) in the error.
        let bad = |why: &str| {
            let head: String = s.chars().take(20).collect();
            Error::InvalidArgument(format!("not a shmq queue handle ({why}): {head:?}..."))
        };
        let parts: Vec<&str> = s.trim().split('|').collect();
        if parts[0] != HANDLE_TAG {
            let why = if parts[0].starts_with("shmq-handle-") {
                format!("a handle of another shmq version: this one reads {HANDLE_TAG}")
            } else {
                format!("it must start with \"{HANDLE_TAG}|\"")
            };
            return Err(bad(&why));
        }
        if parts.len() != 8 {
            return Err(bad(&format!(
                "8 fields separated by '|' expected, found {}",
                parts.len()
            )));
        }
        let num = |t: &str, field: &str| {
            t.parse::<usize>()
                .map_err(|_| bad(&format!("{field} must be a non-negative integer")))
        };
        let local_reader_ranks = if parts[1].is_empty() {
            vec![]
        } else {
            parts[1]
                .split(',')
                .map(|r| num(r, "a local reader rank"))
                .collect::<Result<_>>()?
        };
        let buffer = if parts[2].is_empty() {
            None
        } else {
            let b: Vec<&str> = parts[2].splitn(4, ',').collect();
            if b.len() != 4 || b[3].is_empty() {
                return Err(bad(
                    "the ring must be n_reader,max_chunk_bytes,max_chunks,name",
                ));
            }
            Some(RingHandle {
                n_reader: num(b[0], "the ring's n_reader")?,
                max_chunk_bytes: num(b[1], "the ring's max_chunk_bytes")?,
                max_chunks: num(b[2], "the ring's max_chunks")?,
                name: b[3].to_owned(),
            })
        };
        let opt = |t: &str| (!t.is_empty()).then(|| t.to_owned());
        let remote_addr_ipv6 = match parts[5] {
            "0" => false,
            "1" => true,
            _ => return Err(bad("the IPv6 flag must be 0 or 1")),
        };
        Ok(Handle {
            local_reader_ranks,
            buffer,
            local_subscribe_addr: opt(parts[3]),
            remote_subscribe_addr: opt(parts[4]),
            remote_addr_ipv6,
            arena: opt(parts[6]),
            remote_secret: match parts[7] {
                "" => None,
                k => Some(secret_from_text(k).ok_or_else(|| {
                    bad(&format!(
                        "the secret must be {} hexadecimal digits",
                        2 * SECRET_BYTES
                    ))
                })?),
            },
        })
    }
}
