//! The encoder cache's consumer slots: who is loading from a producer, so that the
//! producer knows whose acknowledgements to wait for and whose pins to drop when a
//! consumer dies. `shmq_core::encoder_cache` applies it to the slots of its segment (and
//! decides, with the OS's liveness locks, who is dead); `crates/protocol/tests/loom.rs`
//! model-checks it.
//!
//! A slot's `word` is `sequence << 2 | state`; every change bumps the sequence, so a
//! compare-and-swap on the word names one occupancy of the slot, never a later one.
//! ```text
//! FREE --claim (CAS)--> CLAIMED --join: fields written--> JOINED --leave (CAS)--> FREE
//!                          \                                \--dead: reclaim (CAS)--> RECLAIMING --pins zeroed--> FREE
//!                           \--stuck (the joiner died mid-join): reclaim (CAS)--> RECLAIMING ...
//! ```
//! - [`claim`]: taking a slot is one compare-and-swap from the FREE word the claimer
//!   saw: two claimers never share one (an Acquire CAS, pairing with the Release store
//!   that freed the slot, so the claimer sees the pins the last reclaim zeroed).
//! - [`join`]: the fields (pid, start time, `joined_at`) are written while the slot is
//!   CLAIMED, after a Release fence that follows the claim; JOINED is then stored with
//!   Release. [`snapshot`] is the seqlock's reader: the word (Acquire), the fields, an
//!   Acquire fence, the word again; it keeps the read only if the word did not change.
//! - [`reclaim`]: a slot judged dead *from a snapshot* is reclaimed with a
//!   compare-and-swap on exactly the word of that snapshot: of two reclaimers (the
//!   producer and a joiner looking for room) one wins, and a slot that a new consumer
//!   took meanwhile is left alone. The winner zeroes the slot's pins (the dead
//!   consumer's views died with it) and frees the slot with Release.
//! - [`leave`]: a consumer gives its slot back with a compare-and-swap on the word of its
//!   own occupancy ([`holds`] tells whether it is still current), so a consumer whose
//!   slot was reclaimed never frees its successor's.
//!
//! # Late joiners: the clock
//! The segment's `clock` orders joins against publications: a consumer takes its
//! `joined_at` from the clock, the producer takes each entry's `published_at` from it,
//! and an entry waits only for consumers that joined before it was published. A consumer
//! that joins later still sees and loads every key held, but does not hold back their
//! eviction. The claim (CLAIMED) is stored before the clock is read, and clock updates
//! are SeqCst read-modify-writes of one atomic ([`tick`]), so a producer that took a
//! later clock value sees the slot as at least CLAIMED, which it treats as "has not
//! loaded anything yet".
//!
//! Which consumer is dead is not this module's business: the caller judges a snapshot
//! (in shmq, by the slot's role lock: a lock the kernel releases only when its holder is
//! gone) and passes the judged word to [`reclaim`].

use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};
use crate::word::StatU64;

/// The join clock (see the module docs on late joiners), changed only by [`tick`].
#[repr(transparent)]
pub struct JoinClock(AtomicU64);

impl JoinClock {
    pub fn new(v: u64) -> JoinClock {
        JoinClock(AtomicU64::new(v))
    }
}

impl Default for JoinClock {
    fn default() -> Self {
        JoinClock::new(0)
    }
}

/// Slot states: the low two bits of the word.
pub const FREE: u64 = 0;
pub const CLAIMED: u64 = 1;
pub const JOINED: u64 = 2;
pub const RECLAIMING: u64 = 3;

/// The state part of a slot word.
pub fn state(word: u64) -> u64 {
    word & 3
}

/// The word after `word` with state `state` (the sequence bumped).
fn next(word: u64, state: u64) -> u64 {
    ((word >> 2).wrapping_add(1) << 2) | state
}

/// One consumer slot as it lies in the producer's segment (64 bytes, `#[repr(C)]`,
/// atomics only, no pointers; zero bytes are a FREE slot).
#[repr(C)]
pub struct ConsumerSlot {
    /// `sequence << 2 | state`; the sequence grows on every change (a seqlock for the
    /// fields below, and the tag that compare-and-swaps name a slot's occupancy by).
    pub(crate) word: AtomicU64,
    pub(crate) pid: AtomicU32,
    _pad0: u32,
    pub(crate) start_time: AtomicU64,
    /// The clock value of the join: entries published later wait for this consumer.
    pub(crate) joined_at: AtomicU64,
    /// Keys this consumer loaded (a statistic; Relaxed everywhere).
    pub loads: StatU64,
    _pad1: [u64; 3],
}

/// Size of one slot in the segment.
pub const SLOT_BYTES: usize = 64;
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<ConsumerSlot>() == SLOT_BYTES);
#[cfg(not(loom))]
const _: () = assert!(std::mem::align_of::<ConsumerSlot>() == 8);

impl ConsumerSlot {
    /// A free slot, for tests and models (in a segment, slots start as zero bytes, which
    /// is the same thing).
    pub fn new() -> ConsumerSlot {
        ConsumerSlot {
            word: AtomicU64::new(FREE),
            pid: AtomicU32::new(0),
            _pad0: 0,
            start_time: AtomicU64::new(0),
            joined_at: AtomicU64::new(0),
            loads: StatU64::new(0),
            _pad1: [0; 3],
        }
    }

    /// The slot's `joined_at` now (a model's look at its own join, just made).
    #[doc(hidden)]
    pub fn joined_at_now(&self) -> u64 {
        // Relaxed: a model's look right after its own join (program order).
        self.joined_at.load(Ordering::Relaxed)
    }

    /// Make the slot look joined at clock value `joined_at` (tests that stage a consumer
    /// that joined before or after an entry was published).
    #[doc(hidden)]
    pub fn backdate_join(&self, joined_at: u64) {
        // SeqCst: a test's staging, seen by whatever the test runs next.
        self.joined_at.store(joined_at, Ordering::SeqCst);
    }
}

impl Default for ConsumerSlot {
    fn default() -> Self {
        ConsumerSlot::new()
    }
}

/// One consistent read of a consumer slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub word: u64,
    pub pid: u32,
    pub start_time: u64,
    pub joined_at: u64,
}

impl Snapshot {
    pub fn state(&self) -> u64 {
        state(self.word)
    }
}

/// One attempt to read `slot` consistently: `None` if the word changed meanwhile.
pub fn read(slot: &ConsumerSlot) -> Option<Snapshot> {
    // Acquire: pairs with the Release store of JOINED in `join` (the fields it
    // published), and with the Release store of FREE in `reclaim` and `leave`.
    let word = slot.word.load(Ordering::Acquire);
    // Relaxed: validated by the second word load below.
    let pid = slot.pid.load(Ordering::Relaxed);
    let start_time = slot.start_time.load(Ordering::Relaxed);
    let joined_at = slot.joined_at.load(Ordering::Relaxed);
    // Acquire fence: pairs with the Release fence in `claim`: a field stored after that
    // fence, if seen above, makes the load below see the claim's word (or a later one).
    fence(Ordering::Acquire);
    // Relaxed: ordered by the fence.
    (slot.word.load(Ordering::Relaxed) == word).then_some(Snapshot {
        word,
        pid,
        start_time,
        joined_at,
    })
}

/// Read `slot` consistently, trying up to `attempts` times (yielding in between);
/// `None` if it kept changing (a peer rewriting it nonstop).
pub fn snapshot(slot: &ConsumerSlot, attempts: usize) -> Option<Snapshot> {
    for _ in 0..attempts {
        if let Some(s) = read(slot) {
            return Some(s);
        }
        crate::sync::yield_now();
    }
    None
}

/// The slot's word if it looks FREE now: a hint for [`claim`], which decides.
pub fn free_word(slot: &ConsumerSlot) -> Option<u64> {
    // Relaxed: only a hint; the CAS in `claim` decides (and acquires).
    let w = slot.word.load(Ordering::Relaxed);
    (state(w) == FREE).then_some(w)
}

/// Claim `slot` if its word is still `free` (from [`free_word`]): the CLAIMED word, or
/// `None` if another claimer (or anything else) changed the slot first.
pub fn claim(slot: &ConsumerSlot, free: u64) -> Option<u64> {
    if state(free) != FREE {
        return None;
    }
    let claimed = next(free, CLAIMED);
    // AcqRel: Acquire pairs with the Release store that freed the slot (`reclaim`, whose
    // pin zeroing comes before it, or `leave`, whose unpins do); Release keeps the claim
    // before the clock update in `join` (the clock's RMWs carry it to the producer).
    slot.word
        .compare_exchange(free, claimed, Ordering::AcqRel, Ordering::Relaxed)
        .ok()?;
    // Release fence: pairs with the Acquire fence in `read`: a reader that sees any
    // field written by `join` after this also sees the slot's word changed.
    fence(Ordering::Release);
    Some(claimed)
}

/// Finish joining a slot claimed as `claimed`: write this consumer's fields, take the
/// clock, and publish them as JOINED. Returns the JOINED word (the occupancy that
/// [`leave`] and [`holds`] name).
pub fn join(
    slot: &ConsumerSlot,
    claimed: u64,
    pid: u32,
    start_time: u64,
    clock: &JoinClock,
) -> u64 {
    // Relaxed: published by the Release store of JOINED below (and guarded against torn
    // reads by the Release fence in `claim`).
    slot.pid.store(pid, Ordering::Relaxed);
    slot.start_time.store(start_time, Ordering::Relaxed);
    slot.loads.set(0);
    // SeqCst read-modify-write of the clock (module docs, late joiners): the producer's
    // own clock RMW for a later publication reads from this one (or a later RMW), so it
    // sees the claim made before it.
    let joined_at = tick(clock);
    // Relaxed: published by the Release store below.
    slot.joined_at.store(joined_at, Ordering::Relaxed);
    let joined = next(claimed, JOINED);
    // Release: pairs with the Acquire word load in `read`: publishes the fields.
    slot.word.store(joined, Ordering::Release);
    joined
}

/// Take the next clock value (the producer when it publishes an entry, a consumer when
/// it joins; see the module docs on late joiners).
pub fn tick(clock: &JoinClock) -> u64 {
    // SeqCst RMW (so AcqRel): every clock update reads the one before it, so a later
    // value carries everything that happened before an earlier one was taken (for a
    // join: its claim). The fences carry the claim too (the Release fence in `claim`
    // before the joiner's tick, the Acquire fence in `read` after the producer's), so
    // the model passes even with Relaxed ticks; SeqCst keeps the argument to one order.
    clock.0.fetch_add(1, Ordering::SeqCst)
}

/// Give the slot back, if it is still the occupancy `word` (a slot reclaimed meanwhile
/// is left alone). Returns whether it was.
pub fn leave(slot: &ConsumerSlot, word: u64) -> bool {
    // Release: pairs with the Acquire CAS in the next `claim`: this consumer's unpins
    // (all done, its views are gone) happen before the next occupant uses the counts.
    slot.word
        .compare_exchange(word, next(word, FREE), Ordering::Release, Ordering::Relaxed)
        .is_ok()
}

/// Whether the occupancy `word` of the slot is still current (not reclaimed).
pub fn holds(slot: &ConsumerSlot, word: u64) -> bool {
    // Acquire: a slot reclaimed by a peer shows its new word; nothing else is read.
    slot.word.load(Ordering::Acquire) == word
}

/// Reclaim the slot from the occupancy `word` that the caller judged dead (or stuck
/// mid-join): `zero_pins` zeroes the occupant's pin counts (its views died with it),
/// then the slot is freed. Returns false, and calls nothing, if the slot changed since
/// `word` was read (another reclaimer won, or the occupant left or was replaced).
pub fn reclaim(slot: &ConsumerSlot, word: u64, zero_pins: impl FnOnce()) -> bool {
    if !matches!(state(word), CLAIMED | JOINED) {
        return false;
    }
    let reclaiming = next(word, RECLAIMING);
    // SeqCst: one reclaimer wins (any successful RMW would; nothing is published by it,
    // the pins are zeroed only after it and published by the Release store below).
    if slot
        .word
        .compare_exchange(word, reclaiming, Ordering::SeqCst, Ordering::Relaxed)
        .is_err()
    {
        return false;
    }
    // The pin stores are Relaxed (the caller's): published to the next occupant by the
    // Release store of FREE below, and to the producer's pin checks, which only need to
    // see zero eventually.
    zero_pins();
    // Release: pairs with the Acquire CAS in `claim`: the next occupant sees zero pins.
    slot.word.store(next(reclaiming, FREE), Ordering::Release);
    true
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_slot_goes_round_and_each_occupancy_has_its_own_word() {
        let (s, clock) = (ConsumerSlot::new(), JoinClock::new(7));
        let free = free_word(&s).unwrap();
        let claimed = claim(&s, free).unwrap();
        assert_eq!(
            claim(&s, free),
            None,
            "a second claim of the same free word"
        );
        assert_eq!(free_word(&s), None);
        let joined = join(&s, claimed, 42, 1234, &clock);
        let snap = snapshot(&s, 1).unwrap();
        assert_eq!(
            (snap.state(), snap.pid, snap.start_time, snap.joined_at),
            (JOINED, 42, 1234, 7)
        );
        assert_eq!(tick(&clock), 8);
        assert!(holds(&s, joined));
        assert!(leave(&s, joined));
        assert!(!holds(&s, joined));
        assert!(!leave(&s, joined), "left twice");
        // The next occupancy's word differs from the last one's, so a stale word names
        // nothing.
        let again = join(
            &s,
            claim(&s, free_word(&s).unwrap()).unwrap(),
            43,
            1,
            &clock,
        );
        assert_ne!(again, joined);
        assert!(!reclaim(&s, joined, || panic!(
            "an old occupancy was reclaimed"
        )));
    }

    #[test]
    fn a_reclaim_zeroes_once_and_only_from_the_judged_word() {
        let (s, clock) = (ConsumerSlot::new(), JoinClock::new(0));
        let joined = join(&s, claim(&s, 0).unwrap(), 1, 1, &clock);
        assert!(!reclaim(&s, 0, || panic!("a free word was reclaimed")));
        let mut zeroed = 0;
        assert!(reclaim(&s, joined, || zeroed += 1));
        assert!(!reclaim(&s, joined, || zeroed += 1));
        assert_eq!(zeroed, 1);
        assert_eq!(state(free_word(&s).unwrap()), FREE);
        // A joiner that died mid-join: its CLAIMED word can be reclaimed too.
        let claimed = claim(&s, free_word(&s).unwrap()).unwrap();
        assert!(reclaim(&s, claimed, || {}));
        assert!(free_word(&s).is_some());
    }
}
