//! Bytes from the kernel's random source (`getrandom(2)`): the store's signing secret, the
//! remote stream's secret and its nonces. Uses only libc.

use crate::error::{Error, Result};

/// `N` random bytes for `what` (named in the error if the kernel refuses).
///
/// # Errors
///
/// [`Error::Os`] naming `what` when the kernel refuses `getrandom` (`ENOSYS` on a very old
/// kernel, a seccomp filter).
pub fn random_bytes<const N: usize>(what: &str) -> Result<[u8; N]> {
    let mut out = [0u8; N];
    let mut filled = 0;
    while filled < N {
        // SAFETY: the pointer and length describe the unfilled tail of `out`.
        let n = unsafe { libc::getrandom(out[filled..].as_mut_ptr().cast(), N - filled, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::os(format!("getrandom for {what}"), e));
            }
        } else {
            filled += n as usize;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_draws_differ() {
        let a = super::random_bytes::<32>("a test").unwrap();
        let b = super::random_bytes::<32>("a test").unwrap();
        assert_ne!(a, b);
    }
}
