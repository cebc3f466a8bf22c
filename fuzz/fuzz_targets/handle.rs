//! `Handle`'s text form (`FromStr`), as a reader parses a handle it was sent: any text
//! is an error or a handle, never a panic; a parsed handle prints to text that parses
//! back to the same handle; the error never shows more than the text's start (a handle
//! carries the remote stream's secret).
#![no_main]

use libfuzzer_sys::fuzz_target;
use shmq::Handle;

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
