//! The tensor arena's leases: when the writer may reuse a range of the data region that
//! it lent to readers. `shmq_core::arena` applies it to the lease table of its segment;
//! `crates/protocol/tests/loom.rs` model-checks it.
//!
//! A lease is a [`LeaseRecord`] (generation, the writer's own hold, the range) followed
//! by one hold count per reader ([`Lease`] is the two together). Its life:
//! 1. [`Lease::take`] (writer): bump the generation, record the range, and set the
//!    writer's hold, so that the lease is not reused while the message that will carry
//!    it is still being put together (or, for a loan, while the loan lives).
//! 2. The writer fills the range, then [`Lease::add_holds`]: one hold per live reader
//!    (Relaxed), and for a copied part [`Lease::drop_writer_hold`] (Release); the message
//!    that names the lease is published after this (by the ring, with Release).
//! 3. A reader that got the message (Acquire) checks the record against the reference
//!    it carries ([`Lease::read`]), reads the bytes, and drops its hold
//!    ([`Lease::release`], Release, saturating at zero).
//! 4. [`Lease::is_unused`] (writer): the writer's hold, then every reader's, with
//!    Acquire: zero everywhere means every holder's reads (and a loan's writes) happened
//!    before; only then [`Lease::retire`] bumps the generation and the range goes back to
//!    the allocator.
//!
//! Why no range is reused under a hold: the holds are added before the message is
//! published and a reader drops its hold only after it has seen the message, so its
//! decrement reads (a value at least) the writer's increment; the writer sees zero only
//! after the last holder's Release decrement. The writer's hold is loaded first: the
//! Release store that drops it comes after the reader holds were added (program order
//! in the publisher, which for a loan may be another thread of the writer's process),
//! so a writer that sees it dropped sees those holds.
//!
//! A reader proved dead never drops its holds; the writer drops them for it
//! ([`Lease::drop_holds_of`]). Which reader is dead is not this module's business (in
//! shmq the ring's liveness locks, which the kernel releases only when the process is
//! gone, decide), and only a reader proved dead may be passed: a live reader's views
//! would be reused under it.

use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// The fixed part of a lease record, as it lies in the arena's lease table
/// (`#[repr(C)]`, atomics only, no pointers; the per-reader hold counts, `u32`s, follow
/// at [`HOLDS_OFFSET`]).
#[repr(C)]
pub struct LeaseRecord {
    /// Bumped on every take and every retire: a reference to older contents fails the
    /// reader's check.
    pub(crate) generation: AtomicU32,
    /// 1 while the writer holds the lease (a message being put together, a live loan).
    pub(crate) writer_hold: AtomicU32,
    /// The range in the data region.
    pub(crate) offset: AtomicU64,
    pub(crate) len: AtomicU64,
}

/// One reader's hold count on a lease, changed only by [`Lease`]'s methods. Zero bytes:
/// no hold.
#[repr(transparent)]
pub struct Hold(AtomicU32);

impl Hold {
    pub fn new() -> Hold {
        Hold(AtomicU32::new(0))
    }
}

impl Default for Hold {
    fn default() -> Self {
        Hold::new()
    }
}

/// Where the hold counts start in a lease record.
pub const HOLDS_OFFSET: usize = 32;
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<LeaseRecord>() <= HOLDS_OFFSET);
#[cfg(not(loom))]
const _: () = assert!(std::mem::align_of::<LeaseRecord>() == 8);

impl LeaseRecord {
    /// A record never used, for tests and models (in a segment, records start as zero
    /// bytes, which is the same thing).
    pub fn new() -> LeaseRecord {
        LeaseRecord {
            generation: AtomicU32::new(0),
            writer_hold: AtomicU32::new(0),
            offset: AtomicU64::new(0),
            len: AtomicU64::new(0),
        }
    }
}

impl Default for LeaseRecord {
    fn default() -> Self {
        LeaseRecord::new()
    }
}

/// One lease: its record and its hold counts, one per reader.
#[derive(Clone, Copy)]
pub struct Lease<'a> {
    pub record: &'a LeaseRecord,
    pub holds: &'a [Hold],
}

impl Lease<'_> {
    /// Writer: take the lease for the range `offset..offset + len`, held by the writer.
    /// Returns the new generation (what references to the new contents carry).
    pub fn take(&self, offset: u64, len: u64) -> u32 {
        let r = self.record;
        // Relaxed: these reach readers only through a message, which the ring publishes
        // with Release after this (and readers load with Acquire).
        let generation = r.generation.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        r.offset.store(offset, Ordering::Relaxed);
        r.len.store(len, Ordering::Relaxed);
        // Relaxed: read by the writer's process only (`is_unused`), in this thread, or,
        // for a loan dropped in another thread, after the Release store that drops it.
        r.writer_hold.store(1, Ordering::Relaxed);
        generation
    }

    /// Writer: the lease's generation now (only the writer stores it).
    pub fn generation(&self) -> u32 {
        // Relaxed: only the writer stores the generation.
        self.record.generation.load(Ordering::Relaxed)
    }

    /// Writer, before the message that names the lease is published: one hold for each
    /// reader in `readers`.
    pub fn add_holds(&self, readers: impl Iterator<Item = usize>) {
        for reader in readers {
            // Relaxed: the message carrying the reference is published with Release after
            // this, and the reader's decrement comes after it has seen that message (an
            // RMW on the same word: it reads this increment or later). The writer sees it
            // in `is_unused` by program order, or through `drop_writer_hold`'s Release.
            self.holds[reader].0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writer (or a loan's owner): drop the writer's hold.
    pub fn drop_writer_hold(&self) {
        // Release: pairs with the Acquire load in `is_unused`: the holds added before (and
        // a loan's writes into the range) are seen before the lease can be judged unused.
        self.record.writer_hold.store(0, Ordering::Release);
    }

    /// Writer: whether every hold on the lease has been dropped.
    pub fn is_unused(&self) -> bool {
        // Acquire, and the writer's hold first: pairs with the Release store in
        // `drop_writer_hold` (the reader holds added before it are visible below), and
        // with the Release decrements in `release`: whatever a holder did with the bytes
        // happened before the writer reuses them.
        self.record.writer_hold.load(Ordering::Acquire) == 0
            && self.holds.iter().all(|h| h.0.load(Ordering::Acquire) == 0)
    }

    /// Writer, once the lease [`is_unused`](Self::is_unused): retire its contents.
    pub fn retire(&self) {
        // Relaxed: only this writer stores it; a new generation makes references to the
        // old contents fail their check in a reader (stale or forged messages), and the
        // next `take` bumps it again.
        self.record.generation.fetch_add(1, Ordering::Relaxed);
    }

    /// Writer: whether `reader` holds the lease now (a hint of which readers to probe
    /// for death).
    pub fn is_held_by(&self, reader: usize) -> bool {
        // Relaxed: a hint; a hold added or dropped meanwhile is seen on a later check.
        self.holds[reader].0.load(Ordering::Relaxed) != 0
    }

    /// Writer: drop every hold of `reader`, which must be proved dead.
    pub fn drop_holds_of(&self, reader: usize) {
        // Relaxed: the dead reader no longer touches the bytes (proved by the caller), and
        // the Acquire loads in `is_unused` order the writer's later reuse after this store
        // anyway (same thread).
        self.holds[reader].0.store(0, Ordering::Relaxed);
    }

    /// Reader: the record's generation, offset and length, to check a reference against.
    pub fn read(&self) -> (u32, u64, u64) {
        let r = self.record;
        // Relaxed: the writer stored these before publishing the message that names the
        // lease (Release there, Acquire when the reader took the message).
        (
            r.generation.load(Ordering::Relaxed),
            r.offset.load(Ordering::Relaxed),
            r.len.load(Ordering::Relaxed),
        )
    }

    /// Reader `reader`: drop one hold, once done with the bytes.
    pub fn release(&self, reader: usize) {
        // Release: pairs with the Acquire loads in `is_unused`: the reader's reads of the
        // bytes happen before the writer reuses them. Saturating: a count the writer
        // already zeroed (it thought the reader dead) must not wrap around and pin the
        // lease forever.
        let _ = self.holds[reader]
            .0
            .fetch_update(Ordering::Release, Ordering::Relaxed, |h| h.checked_sub(1));
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_unused_only_once_every_hold_is_gone() {
        let record = LeaseRecord::new();
        let holds: Vec<Hold> = (0..3).map(|_| Hold::new()).collect();
        let lease = Lease {
            record: &record,
            holds: &holds,
        };
        assert!(lease.is_unused());
        let generation = lease.take(4096, 8192);
        assert_eq!(lease.read(), (generation, 4096, 8192));
        assert_eq!(lease.generation(), generation);
        assert!(!lease.is_unused(), "the writer holds a lease it just took");
        lease.add_holds([0, 2].into_iter());
        lease.drop_writer_hold();
        assert!(!lease.is_unused());
        assert!(lease.is_held_by(0) && !lease.is_held_by(1) && lease.is_held_by(2));
        lease.release(0);
        lease.release(0); // saturates: no wrap-around
        assert!(!lease.is_held_by(0));
        assert!(!lease.is_unused(), "reader 2 still holds it");
        lease.drop_holds_of(2);
        lease.release(2); // a reader thought dead drops a hold already dropped
        assert!(lease.is_unused());
        lease.retire();
        assert_ne!(
            lease.generation(),
            generation,
            "references to the old contents pass"
        );
    }
}
