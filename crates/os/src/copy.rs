//! Large copies into shared memory.
//!
//! A part copied into the tensor arena is read by other processes, not by this core.
//! Ordinary stores first read every destination line into the cache ("read for
//! ownership", a third more memory traffic) and leave the bytes in the caches; streaming
//! (non-temporal) stores write whole lines straight to memory, which is faster for large
//! copies. But a reader on another core of the same chip that consumes the part soon
//! after reads it from the shared last-level cache if it is still there, and from memory
//! if it was streamed, which is slower (both measured in `docs/performance.md`, "Copies
//! and mappings"). So a copy
//! streams only when it is too large to stay in the last-level cache anyway (at least
//! half of it, and at least [`STREAM_MIN`] bytes), where the CPU has streaming stores
//! (x86-64 with AVX); else it is a plain `memcpy`.

/// Copies of fewer bytes than this never stream.
pub const STREAM_MIN: usize = 2 << 20;

/// Copies of up to this many bytes in all are *short*: a few microseconds at most, less
/// than handing the CPU to another thread and taking it back (a lock's release and
/// retake). A caller that holds a lock others may wait on (the Python binding: the GIL)
/// keeps it across a short copy that needs no wait, and lets it go for longer ones.
/// Queue messages, store objects and encoder-cache parts alike.
pub const SHORT_COPY_MAX: usize = 64 * 1024;

/// Copy `src` into `dst` (same length), streaming copies too large for the caches.
pub fn copy_large(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_large needs equal lengths");
    #[cfg(target_arch = "x86_64")]
    {
        if src.len() >= stream_min() && has_avx() {
            // SAFETY: AVX is available (checked at run time); `dst` and `src` are valid
            // for `len` bytes and do not overlap (a `&mut` and a `&` slice never do).
            unsafe { stream_copy_avx(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
            return;
        }
    }
    dst.copy_from_slice(src);
}

/// The size from which copies stream: half the last-level cache (as sysfs tells it; 32
/// MiB where it does not), at least [`STREAM_MIN`].
pub fn stream_min() -> usize {
    use std::sync::OnceLock;
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| (last_level_cache_bytes().unwrap_or(32 << 20) / 2).max(STREAM_MIN))
}

/// The largest cache of CPU 0 (`/sys/devices/system/cpu/cpu0/cache/index*/size`).
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| {
        let size = std::fs::read_to_string(e.ok()?.path().join("size")).ok()?;
        let size = size.trim();
        let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit())?);
        let n: usize = digits.parse().ok()?;
        Some(match unit {
            "K" => n << 10,
            "M" => n << 20,
            "G" => n << 30,
            _ => n,
        })
    })
    .max()
}

#[cfg(target_arch = "x86_64")]
fn has_avx() -> bool {
    use std::sync::OnceLock;
    static AVX: OnceLock<bool> = OnceLock::new();
    *AVX.get_or_init(|| std::arch::is_x86_feature_detected!("avx"))
}

/// # Safety
/// The CPU supports AVX; `dst` and `src` are valid for `n` bytes and do not overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn stream_copy_avx(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    // Streaming stores need 32-byte aligned destinations: copy up to the first boundary
    // the ordinary way (the arena's parts start on a page, so usually nothing).
    let head = ((32 - dst as usize % 32) % 32).min(n);
    // Every access below stays within `n` bytes of `dst` and `src` (the loop stops 128
    // bytes short of the end; the tail copies the rest), which the caller guarantees
    // valid and disjoint; `dst + i` is 32-byte aligned in the loop (`head` made it so
    // and `i` grows by 128). Another process may read the destination meanwhile only if
    // it breaks the arena protocol (the lease is fresh): it would see some of the bytes,
    // and could not make this copy fault.
    // SAFETY: `head <= n`: see above.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut i = head;
    while i + 128 <= n {
        // SAFETY: see above.
        unsafe {
            let a = _mm256_loadu_si256(src.add(i) as *const __m256i);
            let b = _mm256_loadu_si256(src.add(i + 32) as *const __m256i);
            let c = _mm256_loadu_si256(src.add(i + 64) as *const __m256i);
            let d = _mm256_loadu_si256(src.add(i + 96) as *const __m256i);
            _mm256_stream_si256(dst.add(i) as *mut __m256i, a);
            _mm256_stream_si256(dst.add(i + 32) as *mut __m256i, b);
            _mm256_stream_si256(dst.add(i + 64) as *mut __m256i, c);
            _mm256_stream_si256(dst.add(i + 96) as *mut __m256i, d);
        }
        i += 128;
    }
    // SAFETY: see above; `i <= n`.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i) };
    // Streaming stores are weakly ordered even on x86: fence them so that the Release
    // store that publishes the part (the ring's `written` flag) orders them too.
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_at_every_alignment() {
        let src: Vec<u8> = (0..(STREAM_MIN + 777))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let mut dst = vec![0u8; src.len() + 64];
        for off in [0, 1, 7, 31, 33] {
            for len in [0, 5, 200, STREAM_MIN, STREAM_MIN + 700] {
                dst.fill(0);
                copy_large(&mut dst[off..off + len], &src[..len]);
                assert_eq!(&dst[off..off + len], &src[..len], "off {off} len {len}");
                assert!(dst[..off].iter().all(|&b| b == 0));
                assert!(dst[off + len..].iter().all(|&b| b == 0));
                // The streaming copy itself, whatever size streams on this machine.
                #[cfg(target_arch = "x86_64")]
                if has_avx() {
                    dst.fill(0);
                    let d = &mut dst[off..off + len];
                    // SAFETY: AVX checked; `d` and `src[..len]` are valid, disjoint, `len` long.
                    unsafe { stream_copy_avx(d.as_mut_ptr(), src.as_ptr(), len) };
                    assert_eq!(
                        &dst[off..off + len],
                        &src[..len],
                        "streamed: off {off} len {len}"
                    );
                    assert!(dst[..off].iter().all(|&b| b == 0));
                    assert!(dst[off + len..].iter().all(|&b| b == 0));
                }
            }
        }
    }
}
