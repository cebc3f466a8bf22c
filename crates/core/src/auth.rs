//! The one way shmq proves a peer knows a secret: a keyed MAC (BLAKE3 in keyed mode) over
//! a domain tag and length-prefixed parts, compared in constant time. The queue's remote
//! stream ([`crate::remote`]: a reader's HELLO, every message) and the worker handshake
//! (Python's `shmq.workers`: a remote worker's answer to the parent's challenge, through
//! the bindings) both use it, each with its own tag, so a MAC made for one can never pass
//! for the other. Why a MAC of shmq's own rather than ZeroMQ's CURVE: see
//! docs/operations.md (multi-node).

use shmq_os::error::Result;

/// Bytes of a secret (a queue's remote secret, a worker ticket's token).
pub const SECRET_BYTES: usize = 32;

/// A secret of [`SECRET_BYTES`] random bytes, from the kernel; `what` names it in an error.
pub fn new_secret(what: &str) -> Result<[u8; SECRET_BYTES]> {
    shmq_os::random::random_bytes(what)
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
pub fn nonce(what: &str) -> Result<[u8; 16]> {
    shmq_os::random::random_bytes(what)
}

/// The MAC of `parts` (each length-prefixed, after the domain `tag`) under `key`.
pub fn mac(key: &[u8; SECRET_BYTES], tag: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&(tag.len() as u64).to_le_bytes());
    h.update(tag);
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p);
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
