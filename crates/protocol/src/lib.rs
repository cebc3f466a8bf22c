//! shmq's cross-process protocols: what two processes agree on through atomics in shared
//! memory, written on abstract atomics ([`sync`]) so that loom can stand in for them.
//! `RUSTFLAGS="--cfg loom" cargo test --release -p shmq-protocol --test loom` model-checks
//! them (`crates/protocol/tests/loom.rs`); the `shmq` crate applies them to its segments. Nothing here
//! maps memory or knows a segment. A loom build compiles every module but `futex`; where
//! loom needs another path, the module says so next to it (`sync`'s atomics, the
//! doorbell's OS futex, the key index's retry clock).
//!
//! # Modules, lowest first
//! - [`sync`]: the atomics, which loom swaps for its own (and, never swapped, the
//!   workspace's process-local ones: `sync::local`);
//! - `futex` (not in a loom build): the process-shared Linux futex on a 32-bit word;
//! - [`doorbell`]: the sleep/wake handshake between the two sides of a ring;
//! - [`multiwait`]: one sleep on several doorbells at once (`futex_waitv`);
//! - [`seqlock`]: the object store's seqlock (the state its writer publishes);
//! - [`ring`]: the chunk-flag protocol of the broadcast ring, and its reader slots
//!   (with the object store's LEFT state);
//! - [`key_index`]: the encoder cache's key index (a seqlock per slot, open addressing);
//! - [`consumer_slot`]: the encoder cache's consumer slots (claim, join, leave, the
//!   reclaim of a dead consumer's slot, the join clock);
//! - [`entry`]: the encoder cache's entries (state, consumers' pins, acknowledgements);
//! - [`read_count`]: the object store's read counts, its counting window and its pin
//!   hint;
//! - [`lease`]: the tensor arena's leases (the writer's and the readers' holds, and
//!   when a range may be reused);
//! - [`alloc`]: the object store's FIFO allocator, as pure arithmetic;
//! - [`word`]: the shared words that carry no protocol of their own (statistics, fields
//!   another protocol publishes, published words such as a segment's magic), typed so
//!   that no code outside this crate names a raw shared atomic or picks an ordering.

pub mod alloc;
pub mod consumer_slot;
pub mod doorbell;
pub mod entry;
#[cfg(not(loom))]
pub mod futex;
pub mod key_index;
pub mod lease;
pub mod multiwait;
pub mod read_count;
pub mod ring;
pub mod seqlock;
pub mod sync;
pub mod word;
