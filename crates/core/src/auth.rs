//! The one way shmq proves a peer knows a secret: a keyed MAC (BLAKE3 in keyed mode) over
//! a domain tag and length-prefixed parts, compared in constant time; and the one way it
//! seals a stream's messages with it, [`message_mac`]: each message's MAC covers the
//! session (fresh for each connection) and the message's sequence number, so a message
//! altered, replayed from another session, dropped or reordered fails its check.
//!
//! Both of shmq's authenticated streams are built on these two: the queue's remote stream
//! ([`crate::remote`]: a reader's HELLO and the writer's WELCOME prove the secret to each
//! other, then every message is sealed) and the worker link (`shmq_workers::link`, which
//! Python's `shmq.workers` calls through the bindings: the same two proofs over each
//! side's fresh nonce, then every frame sealed). Their transports differ (ZeroMQ with credit for the stream, one TCP connection
//! whose loss is the worker's death for the link); each uses its own tags, so a MAC made
//! for one can never pass for the other. Why a MAC of shmq's own rather than ZeroMQ's
//! CURVE: see docs/operations.md (multi-node).

use crate::error::Result;

/// Bytes of a secret (a queue's remote secret, a worker ticket's token).
pub const SECRET_BYTES: usize = 32;

/// A secret of [`SECRET_BYTES`] random bytes, from the kernel; `what` names it in an error.
///
/// # Errors
///
/// [`Error::Os`](crate::Error::Os) naming `what` when the kernel refuses `getrandom`.
pub fn new_secret(what: &str) -> Result<[u8; SECRET_BYTES]> {
    Ok(shmq_os::random::random_bytes(what)?)
}

/// A secret's one text form, in a queue's handle and in a worker's ticket alike: its
/// [`SECRET_BYTES`] bytes as `2 * SECRET_BYTES` lowercase hexadecimal digits.
pub fn secret_to_text(secret: &[u8; SECRET_BYTES]) -> String {
    to_hex(secret)
}

/// The secret that [`secret_to_text`] wrote (upper-case digits are taken too); `None`
/// for anything else.
pub fn secret_from_text(text: &str) -> Option<[u8; SECRET_BYTES]> {
    // Digits only: `from_str_radix` alone would also take a sign ("+f").
    if text.len() != 2 * SECRET_BYTES || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; SECRET_BYTES];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Bytes as lowercase hexadecimal digits (a secret's text form; random names).
pub fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(2 * bytes.len()), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// A fresh 16-byte nonce (or session id), from the kernel.
///
/// # Errors
///
/// [`Error::Os`](crate::Error::Os) naming `what` when the kernel refuses `getrandom`.
pub fn nonce(what: &str) -> Result<[u8; 16]> {
    Ok(shmq_os::random::random_bytes(what)?)
}

/// The MAC of `parts` (each length-prefixed, after the domain `tag`) under `key`.
pub fn mac(key: &[u8; SECRET_BYTES], tag: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    for p in std::iter::once(tag).chain(parts.iter().copied()) {
        put(&mut h, p);
    }
    *h.finalize().as_bytes()
}

/// One length-prefixed item of a MAC.
fn put(h: &mut blake3::Hasher, item: &[u8]) {
    h.update(&(item.len() as u64).to_le_bytes());
    h.update(item);
}

/// The seal of message `seq` of `session`: the [`mac`] of the session, the sequence
/// number (8 bytes, little-endian) and the message's `body` parts, in the domain `tag`.
/// The receiver recomputes it and checks the number is the one it expects next, so a
/// message from another session (a replay), altered, lost or out of order is refused. The
/// remote stream seals its DATA, READY, CLOSED and DROPPED messages with it; the worker
/// link every frame after its handshake.
pub fn message_mac<'a>(
    key: &[u8; SECRET_BYTES],
    tag: &[u8],
    session: &[u8],
    seq: u64,
    body: impl IntoIterator<Item = &'a [u8]>,
) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    put(&mut h, tag);
    put(&mut h, session);
    put(&mut h, &seq.to_le_bytes());
    for p in body {
        put(&mut h, p);
    }
    *h.finalize().as_bytes()
}

/// Whether `b` is the MAC `a`, compared in constant time (blake3's `Hash` equality is).
pub fn mac_eq(a: &[u8; 32], b: &[u8]) -> bool {
    <[u8; 32]>::try_from(b).is_ok_and(|b| blake3::Hash::from(*a) == blake3::Hash::from(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_and_parts_separate_macs() {
        let key = [7u8; SECRET_BYTES];
        let m = mac(&key, b"hello", &[b"ab", b"c"]);
        assert!(mac_eq(&m, &m));
        assert!(!mac_eq(&m, &mac(&key, b"worker", &[b"ab", b"c"])));
        assert!(!mac_eq(&m, &mac(&key, b"hello", &[b"a", b"bc"])));
        assert!(!mac_eq(
            &m,
            &mac(&[8; SECRET_BYTES], b"hello", &[b"ab", b"c"])
        ));
        assert!(!mac_eq(&m, &m[..31]));
    }

    #[test]
    fn a_message_seal_is_the_mac_of_its_session_number_and_body() {
        // The wire form the remote stream always had: the seal changes nothing on it.
        let key = [3u8; SECRET_BYTES];
        let (session, seq) = ([5u8; 16], 9u64);
        let m = message_mac(&key, b"data", &session, seq, [&b"ab"[..], b"c"]);
        assert_eq!(
            m,
            mac(&key, b"data", &[&session, &seq.to_le_bytes(), b"ab", b"c"])
        );
        for other in [
            message_mac(&key, b"data", &session, seq + 1, [&b"ab"[..], b"c"]),
            message_mac(&key, b"data", &[6u8; 16], seq, [&b"ab"[..], b"c"]),
            message_mac(&key, b"ready", &session, seq, [&b"ab"[..], b"c"]),
            message_mac(&key, b"data", &session, seq, [&b"abc"[..]]),
        ] {
            assert!(!mac_eq(&m, &other));
        }
    }

    #[test]
    fn secret_text_round_trips_and_refuses_anything_else() {
        let key: [u8; SECRET_BYTES] = std::array::from_fn(|i| (i * 37) as u8);
        let text = secret_to_text(&key);
        assert_eq!(text.len(), 2 * SECRET_BYTES);
        assert_eq!(secret_from_text(&text), Some(key));
        assert_eq!(secret_from_text(&text.to_uppercase()), Some(key));
        assert_eq!(secret_from_text(&text[..62]), None);
        assert_eq!(secret_from_text(&format!("{}zz", &text[..62])), None);
        assert_eq!(secret_from_text(&format!("+{}", &text[..63])), None);
        assert_eq!(secret_from_text(&"é".repeat(32)), None);
    }
}
