//! The atomics of the cross-process protocols, in one place so that `loom` can stand in
//! for them: `RUSTFLAGS="--cfg loom" cargo test --release -p shmq-protocol --test loom` model-checks the
//! ring's flag protocol, the slot seqlock, the sleep/wake handshake, the object store's
//! seqlock (`crate::seqlock`), the encoder cache's key-index seqlock and consumer slots,
//! and the arena's lease holds (see `crates/protocol/tests/loom.rs`).

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};

/// Give the CPU away in a retry loop (under loom: let the model run another thread, so a
/// loop waiting for one cannot run forever).
#[inline]
pub fn yield_now() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}
