//! The object store's read counts: how readers tell the writer they are done with an
//! object, so that it may free (and later overwrite) its block. `shmq_core::storage` lays
//! the words out in its segment (each type here is one shared word,
//! `#[repr(transparent)]`, so the layout is the atomic's);
//! `crates/protocol/tests/loom.rs` model-checks them.
//!
//! # A count ([`ReadCount`]): `tag << 32 | count`
//! The word lies in the object's block (the count word, and one word per reader slot).
//! The writer sets it to `tag << 32` when it stores the object ([`ReadCount::reset`]),
//! before the handle is handed out; a reader adds one ([`ReadCount::count_one`]) after
//! its reads of the payload, Release, and only while the word still carries its object's
//! tag (a compare-exchange), so a reader stalled past the reuse of the block does not
//! write into the next object. The writer reads the counts ([`ReadCount::reads`],
//! Acquire) and frees the block once they add up: every counted reader's reads of the
//! payload happened before.
//!
//! # The counting window ([`CountingWindow`])
//! A count lies in the block, so it must not be incremented once the block may be reused.
//! A reader therefore announces itself ([`CountingWindow::count`]: SeqCst increment, SeqCst
//! fence), checks that the object is still live, counts, and withdraws (Release). The
//! writer, after it published that blocks are freed, fences (SeqCst) and waits until no
//! announcement is left ([`CountingWindow::wait`], Acquire loads): either it sees the
//! reader's announcement (and waits for its withdrawal, which comes after the count), or
//! the reader's check sees the blocks freed (and counts nothing). A reader that died
//! inside the window never withdraws: how long to wait for one is the caller's
//! (`wait`'s closure); one stalled past that finds its tag gone (`count_one`).

use crate::sync::{fence, AtomicU64, Ordering};

/// One count of an object's reads (see the module docs).
#[repr(transparent)]
pub struct ReadCount(AtomicU64);

impl ReadCount {
    /// A word that counts nothing yet (for tests and models).
    pub fn new(tag: u32) -> ReadCount {
        ReadCount(AtomicU64::new(u64::from(tag) << 32))
    }

    /// Writer, storing a fresh object: its `tag`, count 0. Relaxed: the channel that
    /// carries the handle to readers orders it, as it does the payload.
    pub fn reset(&self, tag: u32) {
        self.0.store(u64::from(tag) << 32, Ordering::Relaxed);
    }

    /// Reader, after its reads of the payload: count one read of the object tagged `tag`.
    /// Returns false (counting nothing) if the word no longer carries the tag: the block
    /// was reused (only a reader stalled past the writer's patience sees that) or a peer
    /// wrote the word. The count saturates rather than wrap into the tag.
    pub fn count_one(&self, tag: u32) -> bool {
        // Relaxed: the value only seeds the compare-exchange, which checks it.
        let mut seen = self.0.load(Ordering::Relaxed);
        loop {
            if (seen >> 32) as u32 != tag {
                return false;
            }
            let next = (seen & !0xffff_ffff) | u64::from((seen as u32).saturating_add(1));
            // Release on success: pairs with the Acquire load in `reads`: our reads of the
            // payload happen before the writer's eviction decision (and its reuse of the
            // block). Relaxed on failure: the value read is only the next attempt's
            // expectation.
            match self
                .0
                .compare_exchange_weak(seen, next, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(now) => seen = now,
            }
        }
    }

    /// Writer (or an inspector): the reads counted.
    pub fn reads(&self) -> u32 {
        // Acquire: pairs with the Release compare-exchange in `count_one`: the counted
        // readers' use of the payload happens before the writer frees (and later
        // overwrites) it.
        self.0.load(Ordering::Acquire) as u32
    }
}

/// How many readers are between their last check of an object and the increment of its
/// count (see the module docs).
#[repr(transparent)]
pub struct CountingWindow(AtomicU64);

impl CountingWindow {
    /// Nobody counting (for tests and models; in a segment, zero bytes).
    pub fn new() -> CountingWindow {
        CountingWindow(AtomicU64::new(0))
    }

    /// Reader: run `check_and_count` (check the object is live, then count the read)
    /// inside the window, where the writer's [`wait`](Self::wait) cannot miss it.
    pub fn count<T>(&self, check_and_count: impl FnOnce() -> T) -> T {
        // SeqCst, then a SeqCst fence: with the writer's fence and load in `wait`, either
        // the check sees the block freed, or the writer waits for our withdrawal before it
        // reuses the memory (store buffering ruled out on both sides).
        self.0.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let out = check_and_count();
        // Release: pairs with the writer's Acquire load in `wait`: the count above happens
        // before the writer reuses the block.
        self.0.fetch_sub(1, Ordering::Release);
        out
    }

    /// Writer, after publishing that blocks are freed: load the announcements until
    /// `settled` says so (it gets each value seen: 0 means nobody counts; a value left by
    /// readers that died is the caller's to discount), so the blocks can be reused.
    pub fn wait(&self, mut settled: impl FnMut(u64) -> bool) {
        // SeqCst fence (and the loads after it): with the reader's SeqCst increment and
        // fence, either we see its increment (and wait for its withdrawal), or it sees
        // the blocks freed.
        fence(Ordering::SeqCst);
        loop {
            // Acquire: pairs with the reader's Release withdrawal: its count (into the old
            // block) happens before we reuse the memory.
            if settled(self.0.load(Ordering::Acquire)) {
                return;
            }
        }
    }
}

impl Default for CountingWindow {
    fn default() -> Self {
        CountingWindow::new()
    }
}

/// How many zero-copy views of the store's objects are held (or being taken) in any
/// process: while it is 0, the writer need not probe for the views' pins (read locks on
/// the segment's file). A reader that dies keeps it above 0, which only makes the writer
/// probe.
///
/// The handshake (Dekker's pattern, SeqCst): a reader [`hold`](Self::hold)s (SeqCst
/// increment), takes its pin, then [`confirm`](Self::confirm)s (SeqCst fence, then its
/// check that the object is still live); the writer marks the block as no longer its
/// object, then asks [`may_be_held`](Self::may_be_held) (SeqCst fence and load). Either
/// the writer sees the hold (and probes the pins) or the reader's check sees the mark
/// (and drops its pin).
#[repr(transparent)]
pub struct PinHint(AtomicU64);

impl PinHint {
    /// No view (for tests and models; in a segment, zero bytes).
    pub fn new() -> PinHint {
        PinHint(AtomicU64::new(0))
    }

    /// Reader (or the writer's loans), before taking a pin.
    pub fn hold(&self) {
        // SeqCst: pairs with the writer's SeqCst fence and load in `may_be_held`.
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    /// Reader, after [`hold`](Self::hold) and taking its pin: whether `still_live` (its
    /// check that the object is still the block's) passes where the writer cannot miss
    /// the hold. On false the caller drops the pin ([`release`](Self::release)).
    pub fn confirm(&self, still_live: impl FnOnce() -> bool) -> bool {
        // SeqCst fence: the checks come after the increment (and the pin) in the order the
        // writer's `may_be_held` is part of. If they pass, the writer will see the hold
        // before it frees or clears the block; if the writer marked it first, they fail.
        fence(Ordering::SeqCst);
        still_live()
    }

    /// Drop a hold, once done with the block (its views gone).
    pub fn release(&self) {
        // Release: once the writer's (SeqCst) load reads 0 it reuses the block without
        // probing, so everything done with the block under this hold (a loan filled on
        // another thread, a view's reads) must come before.
        self.0.fetch_sub(1, Ordering::Release);
    }

    /// Drop a hold under which nothing was done (taking the pin failed).
    pub fn release_unused(&self) {
        // Relaxed: no pin was taken, so nothing was done with the block under it.
        self.0.fetch_sub(1, Ordering::Relaxed);
    }

    /// Writer, after marking a block as no longer its object: whether some view may still
    /// show it (then probe the pins).
    pub fn may_be_held(&self) -> bool {
        // SeqCst fence and load: with the reader's SeqCst increment and fence in
        // `hold`/`confirm`, either this load sees the increment or the reader's check sees
        // our mark. Also Acquire: a 0 read here comes after every Release in `release`.
        fence(Ordering::SeqCst);
        self.0.load(Ordering::SeqCst) != 0
    }

    /// The holds now (statistics). Relaxed: a hint.
    pub fn held(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Default for PinHint {
    fn default() -> Self {
        PinHint::new()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_count_counts_only_its_own_tag_and_saturates() {
        let c = ReadCount::new(7);
        assert!(c.count_one(7) && c.count_one(7));
        assert!(!c.count_one(8), "another object's tag");
        assert_eq!(c.reads(), 2);
        c.reset(9);
        assert_eq!(c.reads(), 0);
        assert!(!c.count_one(7), "the block was reused");
        c.0.store((9 << 32) | u64::from(u32::MAX), Ordering::Relaxed);
        assert!(c.count_one(9));
        assert_eq!(c.reads(), u32::MAX, "saturates, does not wrap into the tag");
    }

    #[test]
    fn the_window_and_the_hint_count_what_is_inside() {
        let w = CountingWindow::new();
        let inside = w.count(|| w.0.load(Ordering::Relaxed));
        assert_eq!(inside, 1);
        let mut seen = Vec::new();
        w.wait(|n| {
            seen.push(n);
            true
        });
        assert_eq!(seen, [0]);
        let h = PinHint::new();
        assert!(!h.may_be_held());
        h.hold();
        assert!(h.confirm(|| true) && h.may_be_held() && h.held() == 1);
        h.release();
        h.hold();
        h.release_unused();
        assert!(!h.may_be_held());
    }
}
