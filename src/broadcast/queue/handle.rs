//! [`Handle`]: what a reader process needs to join a queue, and its one-line text form
//! (`Display` / `FromStr`), checked field by field when parsed.

use std::fmt;
use std::str::FromStr;

use super::super::ring::RingHandle;
use crate::error::{Error, Result};
use crate::remote::SECRET_BYTES;

/// Everything a reader process needs to join a queue. Send it to readers however you
/// like; `Display`/`FromStr` give a one-line text form.
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

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; SECRET_BYTES]> {
    if s.len() != 2 * SECRET_BYTES || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; SECRET_BYTES];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
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
            self.remote_secret.map(|k| hex(&k)).unwrap_or_default()
        )
    }
}

impl FromStr for Handle {
    type Err = Error;
    fn from_str(s: &str) -> Result<Handle> {
        // The text may hold the secret: name only its start in the error.
        let bad = || {
            let head: String = s.chars().take(20).collect();
            Error::InvalidArgument(format!("not a shmq queue handle: {head:?}..."))
        };
        let parts: Vec<&str> = s.trim().split('|').collect();
        if parts.len() != 8 || parts[0] != HANDLE_TAG {
            return Err(bad());
        }
        let num = |t: &str| t.parse::<usize>().map_err(|_| bad());
        let local_reader_ranks = if parts[1].is_empty() {
            vec![]
        } else {
            parts[1].split(',').map(num).collect::<Result<_>>()?
        };
        let buffer = if parts[2].is_empty() {
            None
        } else {
            let b: Vec<&str> = parts[2].splitn(4, ',').collect();
            if b.len() != 4 {
                return Err(bad());
            }
            Some(RingHandle {
                n_reader: num(b[0])?,
                max_chunk_bytes: num(b[1])?,
                max_chunks: num(b[2])?,
                name: b[3].to_owned(),
            })
        };
        let opt = |t: &str| (!t.is_empty()).then(|| t.to_owned());
        Ok(Handle {
            local_reader_ranks,
            buffer,
            local_subscribe_addr: opt(parts[3]),
            remote_subscribe_addr: opt(parts[4]),
            remote_addr_ipv6: parts[5] == "1",
            arena: opt(parts[6]),
            remote_secret: match parts[7] {
                "" => None,
                k => Some(unhex(k).ok_or_else(bad)?),
            },
        })
    }
}
