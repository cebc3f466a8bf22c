//! The encoder cache's entries: the state word of an entry record, the consumers' pins on
//! it and their acknowledgements. `shmq_core::encoder_cache` lays them out in its segment
//! (each type here is one shared word, `#[repr(transparent)]`, so the layout is the
//! atomic's); `crates/protocol/tests/loom.rs` model-checks them.
//!
//! # Life cycle (an [`EntryState`]: `generation << 2 | state`)
//! ```text
//! FREE(g) --reserve--> WRITING(g) --publish--> READY(g) --evict--> RETIRED(g) --last pin gone--> FREE(g+1)
//!                           \------------------abandon----------------------------------------/
//! ```
//! Only the producer changes the word. The index stores `(entry, g)` beside each key, so
//! a consumer that found a key checks the word is exactly `READY(g)`: anything else (a
//! later generation, the entry reused for another key) means the key is gone.
//!
//! # Pins: no range is reused under a view (Dekker's pattern, SeqCst)
//! A consumer that wants a view increments its own pin count on the entry, *then* checks
//! the state is still `READY(g)` ([`EntryPin::pin`]); the producer, to evict, stores
//! `RETIRED(g)` ([`EntryState::retire`]), *then* reads every pin count
//! ([`EntryPin::is_unpinned`]), and frees the range only when all are zero (else it
//! retries later: the entry is a *zombie*, gone from the index but with its bytes
//! intact). With a SeqCst fence between the two accesses on each side (the accesses are
//! SeqCst too) at least one side sees the other: either the consumer sees `RETIRED` and
//! backs off without reading, or the producer sees the pin and keeps the bytes. The
//! fences are what the argument rests on (and what loom models: it takes SeqCst accesses
//! for AcqRel, under which its model of this handshake fails). A pin lasts as long as the consumer's view; its release
//! ([`EntryPin::unpin`], Release) orders the view's reads before the producer's reuse.
//!
//! # Acknowledgements
//! An entry's [`EntryAcks`] holds one bit per consumer slot: slot `s` loaded this
//! generation of the entry. A consumer sets its bit after its load ([`EntryAcks::ack`],
//! Release, an atomic OR, so concurrent acks are never lost); the producer reads them
//! ([`EntryAcks::loaded`], Acquire) to tell whether every consumer that must has loaded
//! the entry (then it may be evicted once unpinned), and clears them when it publishes
//! the next generation ([`EntryAcks::clear`]).

use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};

/// Entry states (the low two bits of the word).
pub const FREE: u64 = 0;
pub const WRITING: u64 = 1;
pub const READY: u64 = 2;
pub const RETIRED: u64 = 3;

/// The state word for `state` in `generation`.
pub fn word(generation: u64, state: u64) -> u64 {
    (generation << 2) | state
}

/// The state part of a state word.
pub fn state_of(word: u64) -> u64 {
    word & 3
}

/// An entry record's state word (see the module docs). Zero bytes are `FREE(0)`.
#[repr(transparent)]
pub struct EntryState(AtomicU64);

impl EntryState {
    /// A fresh word, `FREE(0)` (for tests and models; in a segment, zero bytes).
    pub fn new() -> EntryState {
        EntryState(AtomicU64::new(0))
    }

    /// Producer: the word now. Relaxed: only the producer stores it.
    pub fn own(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Producer: the entry is being written in `generation`. Relaxed: consumers look for
    /// READY only, which [`publish`](Self::publish) stores with Release.
    pub fn begin_writing(&self, generation: u64) {
        self.0.store(word(generation, WRITING), Ordering::Relaxed);
    }

    /// Producer: the entry's bytes and record are complete: READY in `generation`.
    pub fn publish(&self, generation: u64) {
        // Release: pairs with the consumers' Acquire (and SeqCst) loads of READY: the
        // offset, length and bytes stored before are visible to one that sees it.
        self.0.store(word(generation, READY), Ordering::Release);
    }

    /// Consumer: whether the entry is `READY(generation)` now.
    pub fn is_ready(&self, generation: u64) -> bool {
        // Acquire: pairs with the Release store in `publish`.
        self.0.load(Ordering::Acquire) == word(generation, READY)
    }

    /// Producer, to evict: RETIRED in `generation`; then read the pins
    /// ([`EntryPin::is_unpinned`]) before freeing the range.
    pub fn retire(&self, generation: u64) {
        // SeqCst, then a SeqCst fence: the producer's half of the pin handshake (module
        // docs): stored before the pin counts are read (`EntryPin::is_unpinned`, after
        // this), against the consumer's increment and fence.
        self.0.store(word(generation, RETIRED), Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Producer, once no consumer pins the entry (or it was abandoned while WRITING):
    /// FREE in `generation` (the next one).
    pub fn free(&self, generation: u64) {
        // Release: a consumer that sees the new generation (and so no longer uses the
        // entry) sees everything before; the bytes are not touched until a new save.
        self.0.store(word(generation, FREE), Ordering::Release);
    }
}

impl Default for EntryState {
    fn default() -> Self {
        EntryState::new()
    }
}

/// One consumer slot's pin count on one entry (see the module docs). Zero bytes: none.
#[repr(transparent)]
pub struct EntryPin(AtomicU32);

impl EntryPin {
    /// No pin (for tests and models; in a segment, zero bytes).
    pub fn new() -> EntryPin {
        EntryPin(AtomicU32::new(0))
    }

    /// Consumer: pin the entry whose state is `state`, if it is `READY(generation)`.
    /// The count is incremented either way: the caller [`unpin`](Self::unpin)s when it
    /// is done with the bytes, or at once when this returns false (nothing to read).
    #[must_use = "unpin either way"]
    pub fn pin(&self, state: &EntryState, generation: u64) -> bool {
        // SeqCst, then a SeqCst fence: the consumer's half of the pin handshake (module
        // docs): the increment is ordered before the state load below, against the
        // producer's store of RETIRED and fence.
        self.0.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // SeqCst (so also Acquire, pairing with the Release store of READY: the offset,
        // length and bytes stored before it are visible).
        state.0.load(Ordering::SeqCst) == word(generation, READY)
    }

    /// Consumer: drop one pin, once done with the bytes.
    pub fn unpin(&self) {
        // Release: pairs with the producer's SeqCst (so Acquire) load in `is_unpinned`:
        // our reads of the bytes happen before it reuses them. Saturating: a count zeroed
        // by a reclaim (`clear`) must not wrap around.
        let _ = self
            .0
            .fetch_update(Ordering::Release, Ordering::Relaxed, |p| p.checked_sub(1));
    }

    /// Producer, after [`EntryState::retire`]: whether this slot holds no pin.
    pub fn is_unpinned(&self) -> bool {
        // SeqCst, after the fence in `retire`: pairs with the consumer's increment, fence
        // and state load (Dekker; see the module docs). Also Acquire: a consumer's reads of the bytes happen before
        // its Release unpin, so before the producer reuses them.
        self.0.load(Ordering::SeqCst) == 0
    }

    /// Whoever reclaims a dead consumer's slot: drop its pins (its views died with it).
    pub fn clear(&self) {
        // Relaxed: published to the next occupant by the Release store that ends the
        // reclaim (`consumer_slot::reclaim`), and to the producer's pin checks, which only
        // need to see zero eventually.
        self.0.store(0, Ordering::Relaxed);
    }

    /// The count now (statistics, tests). Relaxed: a hint.
    pub fn count(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Default for EntryPin {
    fn default() -> Self {
        EntryPin::new()
    }
}

/// Which consumer slots loaded an entry in its current generation, one bit each (see
/// the module docs). Zero bytes: none.
#[repr(transparent)]
pub struct EntryAcks(AtomicU64);

impl EntryAcks {
    /// No acknowledgement (for tests and models; in a segment, zero bytes).
    pub fn new() -> EntryAcks {
        EntryAcks(AtomicU64::new(0))
    }

    /// Producer, before publishing a new generation: nobody has loaded it. Relaxed: the
    /// Release store of READY ([`EntryState::publish`]) publishes it; only a consumer
    /// that saw READY acks.
    pub fn clear(&self) {
        self.0.store(0, Ordering::Relaxed);
    }

    /// Consumer slot `slot` (below 64) loaded the entry.
    pub fn ack(&self, slot: usize) {
        // Release: pairs with the producer's Acquire load in `loaded`: what the consumer
        // did before (its load) happens before the producer's decisions on the ack. An
        // atomic OR: acks of several consumers at once are all kept.
        self.0.fetch_or(1 << slot, Ordering::Release);
    }

    /// Producer: the slots that acked, one bit each.
    pub fn loaded(&self) -> u64 {
        // Acquire: pairs with the Release `fetch_or` in `ack`.
        self.0.load(Ordering::Acquire)
    }

    /// The slots that acked, for a report (a warning, an error message). Relaxed: a
    /// hint, nothing is decided on it.
    pub fn loaded_hint(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Default for EntryAcks {
    fn default() -> Self {
        EntryAcks::new()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_pin_holds_only_a_ready_entry_and_saturates() {
        let (state, pin) = (EntryState::new(), EntryPin::new());
        assert!(!pin.pin(&state, 0), "a FREE entry is not pinned");
        pin.unpin();
        state.begin_writing(0);
        assert_eq!(state_of(state.own()), WRITING);
        state.publish(0);
        assert!(state.is_ready(0) && !state.is_ready(1));
        assert!(pin.pin(&state, 0));
        assert!(!pin.is_unpinned());
        state.retire(0);
        assert!(!pin.pin(&state, 0), "a RETIRED entry is not pinned");
        pin.unpin();
        assert_eq!(pin.count(), 1);
        pin.clear();
        pin.unpin(); // saturates
        assert!(pin.is_unpinned());
        state.free(1);
        assert_eq!(state.own(), word(1, FREE));
    }

    #[test]
    fn state_words() {
        let w = word(7, READY);
        assert_eq!((w >> 2, state_of(w)), (7, READY));
        assert_ne!(word(7, READY), word(8, READY));
    }

    #[test]
    fn acks_are_kept_per_slot_and_cleared() {
        let acks = EntryAcks::new();
        acks.ack(0);
        acks.ack(5);
        assert_eq!(acks.loaded(), 0b10_0001);
        assert_eq!(acks.loaded_hint(), 0b10_0001);
        acks.clear();
        assert_eq!(acks.loaded(), 0);
    }
}
