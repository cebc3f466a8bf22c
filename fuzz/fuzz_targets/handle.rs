//! `Handle`'s text form (`FromStr`), as a reader parses a handle it was sent: any text
//! is an error or a handle, never a panic; a parsed handle prints to text that parses
//! back to the same handle; the error never shows more than the text's start (a handle
//! carries the remote stream's secret). A parsed handle with a remote address is also
//! opened as a remote reader (its address goes to ZeroMQ as it is): a reader or an
//! error, never a panic (an address with a NUL was one).
#![no_main]

use libfuzzer_sys::fuzz_target;
use shmq::{Handle, Reader};

/// Whether connecting to `endpoint` is quick: not a TCP address with a host name (a DNS
/// lookup could wait for a name server, and there is none to ask here).
fn connects_quickly(endpoint: &str) -> bool {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return true;
    };
    let host = rest.rsplit_once(':').map_or(rest, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.parse::<std::net::IpAddr>().is_ok() || host == "*"
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match text.parse::<Handle>() {
        Ok(h) => {
            let printed = h.to_string();
            let again: Handle = printed
                .parse()
                .unwrap_or_else(|e| panic!("{printed:?} (printed from {h:?}) does not parse: {e}"));
            assert_eq!(again, h, "{printed:?}");
            if let (Some(addr), Some(_)) = (&h.remote_subscribe_addr, h.remote_secret) {
                if connects_quickly(addr) {
                    // A rank that is not local: the remote reader. (The smallest one: the
                    // largest plus one overflows when a handle names rank usize::MAX.)
                    let rank = (0..)
                        .find(|r| !h.local_reader_ranks.contains(r))
                        .expect("fewer ranks than usize values");
                    let _ = Reader::open(&h, rank);
                }
            }
            // Debug output (logs) never shows the secret: it is the same for any secret.
            if let Some(k) = h.remote_secret {
                let other = Handle {
                    remote_secret: Some(k.map(|b| !b)),
                    ..h.clone()
                };
                assert_eq!(format!("{h:?}"), format!("{other:?}"));
            }
        }
        Err(e) => {
            // The secret is the last field: the error names only the first 20 characters.
            let shown = e.to_string();
            let head: String = text.chars().take(20).collect();
            let trimmed = text.trim();
            if let Some(start) = trimmed.match_indices('|').nth(6).map(|(i, _)| i + 1) {
                let secret = &trimmed[start..];
                // Judged for secret-like fields only (16+ hex digits), which the error's
                // own words cannot contain.
                if secret.len() >= 16
                    && secret.bytes().all(|b| b.is_ascii_hexdigit())
                    && trimmed[..start].chars().count() >= 20
                    && !format!("{head:?}").contains(secret)
                {
                    assert!(
                        !shown.contains(secret),
                        "the error shows the secret: {shown}"
                    );
                }
            }
        }
    }
});
