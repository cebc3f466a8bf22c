//! The encoder-cache hand-off: a producer's tensors, by key, to every consumer process,
//! with no copy on the consumer side and no RPC.
//!
//! Serving engines split multimodal models into an *encoder* (the producer) that turns
//! each image into embedding tensors keyed by a content hash, and *language-model
//! workers* (the consumers) that need them; a *scheduler* asks which keys are ready.
//!
//! # Design
//! - **One segment per producer**, named `shmq_ec_<name>`. Several producers serve the
//!   same consumers by each having a segment: a consumer is given the producers' names
//!   and looks a key up in each. One segment per producer keeps every segment
//!   single-writer (no cross-process allocator, no writer locks), and a producer that
//!   dies takes nobody else's keys with it.
//! - **The key index** ([`key_index`]) is in the segment: open addressing over
//!   fixed-size slots, each under its own seqlock, so `has(key)` from any process is a
//!   few atomic loads (O(1), no system call, no file on disk) and never sees a torn key.
//!   The index stores the entry's generation beside the key, and an entry's state word
//!   must still be `READY` in that generation: a "present" key whose data is gone is
//!   never reported.
//! - **Entries** ([`entries`]) live in a data region reserved lazily in `/dev/shm` (a
//!   full `/dev/shm` is an error at `save`, not a `SIGBUS`; see `backing`). Each holds
//!   parts (for Python: a protocol-5 pickle and its out-of-band tensor buffers). A
//!   consumer maps an entry privately (`MAP_PRIVATE`, see `shmq_os::private_map`): the
//!   view is zero-copy, writable, and a write stays private to that view.
//! - **Pins and acknowledgements per consumer slot** ([`slots`]): each consumer has a
//!   slot (pid + start time); each entry has one pin count per slot (views alive) and one
//!   acknowledgement bit per slot (loaded). An entry may be evicted only when no pin is
//!   held and every live consumer that joined before it was published has acknowledged
//!   it; a late joiner sees every key held but holds back nothing published before it
//!   joined. A consumer proved dead has its slot reclaimed and its pins zeroed, so it
//!   stops counting within a second of the producer next looking.
//! - **The producer** ([`Producer`]) evicts oldest-loaded-first under pressure; when
//!   nothing can go it waits (on a futex doorbell the consumers ring after each
//!   acknowledgement and unpin) up to a timeout, then fails with
//!   [`CacheError::Full`] saying what holds the room. Entries
//!   evicted while a consumer maps them leave the index at once and free their bytes
//!   when the last view goes. `/dev/shm` running out before the capacity does is the
//!   same pressure: the producer evicts by the same rule, gives the pages of free ranges
//!   back to `/dev/shm` (`MADV_REMOVE`), tries again, and when nothing can go waits and
//!   fails with the same error, naming `/dev/shm` as the limit. While something may go,
//!   it also leaves a headroom of `/dev/shm` free for other segments (an eighth, at most
//!   64 MiB) rather than grow into it, and a save gives back what it grew into there
//!   while nothing could go. [`Producer::reserve`]
//!   hands out room to fill in place (zero-copy for Rust producers); [`Producer::save`]
//!   copies.
//! - **Producer death and restarts**: a producer that dies (SIGKILL) leaves its segment
//!   as it was. What it published stays held and loadable: an entry is READY only once
//!   its bytes are written, and enters the index only after that, so every key the
//!   index shows is complete. A save it had not finished (WRITING) was never in the
//!   index, so `has` never shows it, in any process, before or after the death. (An
//!   index slot it was rewriting when it died stays odd: lookups that pass it give up
//!   after `key_index`'s bounded retries and answer "not held", which may also hide a
//!   complete key further down that probe chain.) A producer started under the name of
//!   a dead one marks the old segment superseded before removing it; consumers check
//!   that mark on every call (one load) and open the new segment, so they never serve
//!   the old keys.
//!
//! Memory ordering is argued at each atomic access; the protocols' invariants are in the
//! docs of [`key_index`] (seqlock, chains, rebuild epoch), [`entries`] (pins: Dekker's
//! pattern) and [`slots`] (consumer slots, the join clock).
//! `crates/protocol/tests/loom.rs` model-checks the key-index seqlock.
//!
//! ```no_run
//! # use shmq_core as shmq; // what the `shmq` crate re-exports
//! use shmq::encoder_cache::{Consumer, Producer, ProducerOptions};
//! let producer = Producer::create(Some("encoder-0"), ProducerOptions::default())?;
//! producer.save("sha256:ab12...", &[b"embedding bytes"], None)?;
//! // In a consumer process:
//! let mut consumer = Consumer::new(&["encoder-0"])?;
//! if let Some(view) = consumer.load("sha256:ab12...")? {
//!     assert_eq!(view.part(0), b"embedding bytes");
//! }
//! # Ok::<(), shmq::Error>(())
//! ```

// The key index's protocol is in `shmq-protocol` (model-checked with loom).
pub use shmq_protocol::key_index;

mod backing;
mod consumer;
pub mod entries;
mod error;
pub mod layout;
mod producer;
pub mod slots;

pub use consumer::{Consumer, EntryView, RETRY_OPEN};
pub use error::CacheError;
pub use producer::{
    CacheStats, DEFAULT_CAPACITY, DEFAULT_MAX_CONSUMERS, DEFAULT_MAX_ENTRIES, LoadState, Producer,
    ProducerOptions, Reservation,
};
pub use slots::ConsumerInfo;

/// What `inspect` shows of an encoder-cache segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheInfo {
    pub creator: shmq_os::process::ProcessId,
    /// "open", "closed" or "superseded".
    pub state: &'static str,
    pub capacity: u64,
    pub max_entries: usize,
    pub max_consumers: usize,
    pub entries: u64,
    pub bytes_in_use: u64,
    pub reserved: u64,
    pub saves: u64,
    pub evictions: u64,
    /// Producer waits (for room, or for consumers to load), and their total time in ns.
    pub waits: u64,
    pub wait_ns: u64,
    pub consumers: Vec<ConsumerInfo>,
}

/// Describe the encoder-cache segment `segment` (fails if it is not one).
///
/// # Errors
///
/// [`crate::Error::Os`] when `segment` cannot be opened (gone, not this user's) or is not a
/// finished encoder-cache segment of this layout version.
pub fn describe(segment: &str) -> crate::Result<CacheInfo> {
    let map = layout::Mapped::open(segment)?;
    let h = map.header();
    // Relaxed: statistics and a state for display.
    let state = match h.state.peek() {
        layout::STATE_OPEN => "open",
        layout::STATE_CLOSED => "closed",
        layout::STATE_SUPERSEDED => "superseded",
        _ => "unknown",
    };
    Ok(CacheInfo {
        creator: map.creator(),
        state,
        capacity: map.geo.capacity as u64,
        max_entries: map.geo.max_entries,
        max_consumers: map.geo.max_consumers,
        entries: h.stat_entries.get(),
        bytes_in_use: h.stat_bytes.get(),
        reserved: h.stat_reserved.get(),
        saves: h.stat_saves.get(),
        evictions: h.stat_evictions.get(),
        waits: h.stat_waits.get(),
        wait_ns: h.stat_wait_ns.get(),
        consumers: slots::list(&map),
    })
}
#[cfg(test)]
mod tests;
