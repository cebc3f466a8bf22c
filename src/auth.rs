//! The one way shmq proves a peer knows a secret: a keyed MAC (BLAKE3 in keyed mode) over
//! a domain tag and length-prefixed parts, compared in constant time. The queue's remote
//! stream ([`crate::remote`]: a reader's HELLO, every message) and the worker handshake
//! (Python's `shmq.workers`: a remote worker's answer to the parent's challenge, through
//! the bindings) both use it, each with its own tag, so a MAC made for one can never pass
//! for the other. Why a MAC of shmq's own rather than ZeroMQ's CURVE: see
//! docs/operations.md (multi-node).

use crate::error::Result;

/// Bytes of a secret (a queue's remote secret, a worker ticket's token).
pub const SECRET_BYTES: usize = 32;

/// A secret of [`SECRET_BYTES`] random bytes, from the kernel; `what` names it in an error.
pub fn new_secret(what: &str) -> Result<[u8; SECRET_BYTES]> {
    crate::random::random_bytes(what)
}

/// A fresh 16-byte nonce (or session id), from the kernel.
pub fn nonce(what: &str) -> Result<[u8; 16]> {
    crate::random::random_bytes(what)
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
}
