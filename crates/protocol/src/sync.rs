//! The atomics of the cross-process protocols, in one place so that `loom` can stand in
//! for them: `RUSTFLAGS="--cfg loom" cargo test --release -p shmq-protocol --test loom` model-checks the
//! ring's flag protocol, the slot seqlock, the sleep/wake handshake, the object store's
//! seqlock (`crate::seqlock`) and read counts (`crate::read_count`), the encoder cache's
//! key-index seqlock, consumer slots and entries (`crate::entry`), and the arena's lease
//! holds (see `crates/protocol/tests/loom.rs`).
//!
//! Every atomic of the workspace is named here (clippy's `disallowed_types` refuses std's
//! anywhere else: see `clippy.toml`): the ones above for what processes share, and
//! [`local`] for what stays in one process. A name is a type alias of std's, which clippy
//! does not see through. The shared ones are this crate's alone: clippy refuses them in
//! every other crate (the root `clippy.toml`; this crate's own `clippy.toml` leaves them
//! out), which uses the typed objects of the protocol modules and of [`crate::word`]
//! instead, so that no protocol on shared memory is written outside this crate and its
//! loom models.

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};
#[cfg(not(loom))]
pub use std::sync::atomic::{fence, Ordering};

/// The atomics of shared memory, std's outside loom.
#[cfg(not(loom))]
#[allow(
    clippy::disallowed_types,
    reason = "the one place std's atomics are named for the protocols"
)]
mod std_shared {
    pub type AtomicU8 = std::sync::atomic::AtomicU8;
    pub type AtomicU32 = std::sync::atomic::AtomicU32;
    pub type AtomicU64 = std::sync::atomic::AtomicU64;
}
#[cfg(not(loom))]
pub use std_shared::{AtomicU32, AtomicU64, AtomicU8};

/// Atomics that stay in one process (flags between its threads, statics a signal handler
/// reads, counters for unique names): always std's, never loom's, since no model covers
/// them and loom's cannot live in a `static` or be made in a `const`. A cross-process
/// protocol never uses these (its words are the ones above, in shared memory).
#[allow(
    clippy::disallowed_types,
    reason = "the one place std's process-local atomics are named"
)]
pub mod local {
    pub use std::sync::atomic::{fence, Ordering};
    pub type AtomicBool = std::sync::atomic::AtomicBool;
    pub type AtomicI32 = std::sync::atomic::AtomicI32;
    pub type AtomicU8 = std::sync::atomic::AtomicU8;
    pub type AtomicU32 = std::sync::atomic::AtomicU32;
    pub type AtomicU64 = std::sync::atomic::AtomicU64;
    pub type AtomicUsize = std::sync::atomic::AtomicUsize;
    pub type AtomicPtr<T> = std::sync::atomic::AtomicPtr<T>;
}

/// Give the CPU away in a retry loop (under loom: let the model run another thread, so a
/// loop waiting for one cannot run forever).
#[inline]
pub fn yield_now() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}
