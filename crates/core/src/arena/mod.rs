//! The tensor arena: large message parts copied once into shared memory (or written
//! there in place through a [`Loan`]) and read by every local reader as a private view.
//!
//! # Why
//! A broadcast ring copies a message into a chunk and every reader copies it out again.
//! For a 16 MiB tensor that is two copies per reader, and the ring's chunks must be as
//! large as the largest tensor. The arena keeps large parts beside the ring instead: the
//! writer copies a part in once (or not at all, for a loan) and puts a small reference
//! in the chunk; readers map the bytes and hand them out without copying.
//!
//! # Readers own what they receive
//! Every view a reader hands out shows the part's pages through a `MAP_PRIVATE` mapping:
//! reading costs nothing (the pages are the writer's), and a reader that writes into a
//! received tensor gets private copies of just the pages it writes (copy-on-write), so
//! neither the writer nor another reader ever sees that write, and a later message never
//! changes what a reader already holds. The mapping is one per reader process that stays
//! (a *window* of the whole arena, see `private_map.rs`): a view is a range of it, so a
//! reader that consumes every byte of a message pays what reading a mapping that stays
//! costs, with no `mmap`, `munmap` or first-touch page faults per message once the arena's
//! pages have been read once. When a view goes, the pages it wrote (its private copies,
//! found in `/proc/self/pagemap`) are dropped, so the next message placed there shows
//! through; only then can a view of that range be made again in this process.
//!
//! # Leases
//! Each allocation is a *lease*: a record in the lease table with the part's place in
//! the data region, a generation (bumped on every reuse of the record), one hold count
//! per reader and a hold flag for the writer's own [`Loan`]. The writer adds one hold per
//! live reader for each reference it publishes; a reader drops one hold when the view
//! made from that reference is gone (the last Python object that used it included). A
//! lease goes back to the writer's allocator only when every count is zero, so no range
//! is reused under a live view. The writer never waits for a lease: when none is free it
//! reports `None` and the caller sends the bytes the ordinary way (a copy), counting it.
//! Holds of a reader proved dead are dropped by the writer (see *Dead readers* below).
//! The protocol on a lease's words (taking it, the holds, when its range may be reused,
//! and why each ordering suffices) is [`shmq_protocol::lease`], model-checked with loom
//! there; this module applies it to the segment's lease table.
//!
//! # Layout (offsets from the start of the segment; `#[repr(C)]`, pointer-free)
//! ```text
//! 0             ArenaHeader: geometry; `magic` stored last with Release
//! 64            ArenaStats: fallbacks, bytes in use (for inspection)
//! 128           the queue's ring name (for `inspect`): length u8, then the UTF-8 bytes
//! table_offset  max_leases lease records of lease_stride bytes (multiple of 64):
//!                 +0 generation: u32   +4 writer_hold: u32
//!                 +8 offset: u64       +16 len: u64
//!                 +32 holds: [u32; n_reader]
//! data_offset   `capacity` bytes of part data (page-aligned; leases are whole pages)
//! ```
//! The data region is reserved (`fallocate`) lazily, up to the highest byte used
//! so far, so an arena that never carries a large part costs no memory, and a full
//! `/dev/shm` makes the writer fall back to copying instead of dying of `SIGBUS`.
//!
//! # Made at first use
//! A queue's arena is named when the queue is made (the name travels in the handle) but
//! the segment is created only when the first large part, a loan or a reservation needs
//! it ([`LazyArenaWriter`]); a reader opens it when the first message that refers to it
//! arrives. A queue that only ever carries small messages has no arena file at all.
//!
//! # Dead readers
//! A reader SIGKILLed while it holds views never drops its holds. The writer asks the
//! ring's liveness locks whether readers are dead when it runs short of room, and also at
//! most once every [`DEAD_CHECK_EVERY`] while leases are outstanding (one lock probe per
//! reader, not per message), and drops the holds of each reader proved dead.
//!
//! # Files
//! This one (the constants, the defaults, [`ArenaRef`]); `layout` (the segment's
//! header, statistics and lease table, and its mapping); `writer` ([`ArenaWriter`]
//! and [`Loan`]); `lazy` ([`LazyArenaWriter`]); `reader` ([`ArenaReader`],
//! [`ArenaView`], [`describe`]); `tests`.

mod layout;
mod lazy;
mod reader;
#[cfg(test)]
mod tests;
mod writer;

pub use lazy::LazyArenaWriter;
pub use reader::{ArenaInfo, ArenaReader, ArenaView, describe};
pub use writer::{ArenaWriter, Loan};

/// "SHMQARN1" little-endian: marks a finished arena segment.
pub const ARENA_MAGIC: u64 = u64::from_le_bytes(*b"SHMQARN1");
/// Bumped whenever the layout changes; openers refuse any other version.
pub const ARENA_LAYOUT_VERSION: u32 = 2;
/// Default size of the data region (virtual: only what is used gets reserved).
pub const DEFAULT_CAPACITY: usize = 1 << 30;
/// Default size from which a message part goes to the arena.
pub const DEFAULT_THRESHOLD: usize = 1 << 20;
/// The smallest part of a loan that a queue sends by reference; a smaller one is copied
/// like any other part, and its loan stays unsealed. Sealing a loan and giving it back
/// cost its process four mapping calls (`shmq_os::segment::LoanPages::seal` and
/// `unseal`), each flushing the TLB of every core that runs one of the process's
/// threads, and little per page; a copy costs per byte. `cargo bench -p shmq-os --bench
/// seal` on the 2-core machine of `docs/performance.md` ("Loans: a seal or a copy"):
/// seal and unseal 27 µs at 1 MiB against a 22 µs copy, 24 against 45 µs at 2 MiB, 16
/// against 628 µs at 16 MiB; with a busy second thread 63 against 29 µs at 1 MiB, 77
/// against 60 µs at 2 MiB, 114 µs against 1.05 ms at 16 MiB. Below 2 MiB the copy is
/// cheaper, whatever the host program's threads do.
pub const LOAN_SEAL_MIN: usize = 2 << 20;
/// Default number of lease records (parts that can be outstanding at once).
pub const DEFAULT_MAX_LEASES: usize = 1024;

/// Environment variable: bytes of a new queue's tensor arena (0 turns it off).
pub const ARENA_BYTES_ENV: &str = "SHMQ_ARENA_BYTES";
/// Environment variable: smallest message part that goes to the arena.
pub const ARENA_THRESHOLD_ENV: &str = "SHMQ_ARENA_THRESHOLD";

fn env_usize(name: &str) -> Option<usize> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse() {
        Ok(n) => Some(n),
        Err(_) => {
            warn_user!("shmq: ignoring {name}={v:?}: not a number of bytes");
            None
        }
    }
}

/// The arena size a queue gets unless told otherwise: [`ARENA_BYTES_ENV`], else
/// [`DEFAULT_CAPACITY`].
pub fn default_capacity() -> usize {
    env_usize(ARENA_BYTES_ENV).unwrap_or(DEFAULT_CAPACITY)
}

/// The arena threshold a queue gets unless told otherwise: [`ARENA_THRESHOLD_ENV`], else
/// [`DEFAULT_THRESHOLD`].
pub fn default_threshold() -> usize {
    env_usize(ARENA_THRESHOLD_ENV).unwrap_or(DEFAULT_THRESHOLD)
}

/// How long after a failed reservation (a full `/dev/shm`) the arena tries again.
const RESERVE_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// How often, at most, the writer probes the readers' liveness while leases are
/// outstanding (besides whenever room runs short).
pub const DEAD_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

pub use shmq_os::private_map::page_size;

/// A reference to bytes in the arena, as carried in a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaRef {
    pub lease: u32,
    pub generation: u32,
    /// Offset in the data region.
    pub offset: u64,
    pub len: u64,
}
