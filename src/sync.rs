//! The atomics of the cross-process protocols, in one place so that `loom` can stand in
//! for them: `RUSTFLAGS="--cfg loom" cargo test --release --test loom` model-checks the
//! ring's flag protocol, the slot seqlock and the sleep/wake handshake (see
//! `tests/loom.rs`).

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};
