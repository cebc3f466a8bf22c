//! Reader slots: which processes read a store, so that its writer can tell which reader
//! an object still waits for, and go on without one that died (`on_dead_reader`).
//!
//! # Slots
//! The header page holds [`MAX_READER_SLOTS`] slots. A process that opens the store as a
//! reader takes one ([`ReaderSlot::take`]): one of the first `n_readers`, under its role
//! lock (byte `1 + slot` of the segment's file, see [`shmq_os::liveness`]), held for as
//! long as it reads. A slot records its holder (pid and start time, to name it), a state,
//! and the reads it counted, under the generation-stamped seqlock of
//! [`shmq_protocol::ring`]'s slots:
//! ```text
//! EMPTY --take--> ATTACHED --close (the holder)--> LEFT --take--> ATTACHED ...
//!                     \--died: lock free--(writer, on_dead_reader="drop")--> DROPPED --take--> ATTACHED ...
//! ```
//! A reader takes an empty, left or dropped slot first, else the slot of a reader that
//! died and was not dropped (its lock is free: it takes its place, and the reads still
//! expected of it). A process that finds no slot (more live readers than `n_readers`, or
//! `n_readers` beyond [`MAX_READER_SLOTS`]) reads anonymously (its reads counted in the
//! object's count word).
//!
//! A reader that takes a dropped slot is a new reader, not the dead one's stand-in: the
//! writer sees the slot's word change from the DROPPED word it wrote (at its next put,
//! hand-out or free, [`ObjectStore::notice_rejoined`](super::ObjectStore)) and from then
//! on waits for its reads of the objects it stores or hands out; objects stored before
//! do not wait for it (the writer notes them in its own memory).
//!
//! # Which reader read what
//! An object of a store of two or more readers carries one count word per slot (of the
//! first `n_readers`), after its frame word (see `super::object`): a reader with a slot
//! counts its reads there, others in the object's count word. The object waits for
//! `n_readers × hand-outs` reads, less those of the slots the writer dropped (or that
//! were taken again after it was stored). Each slot held now (ATTACHED) must have read
//! it once per hand-out in its own word: nobody reads in a live reader's place. The rest
//! (the count word and the words of slots not held now: empty, left) must add up to what
//! remains, for the readers that have no slot or have not opened the store yet. An
//! object of a store of one reader has no reader words: its reader's reads are in the
//! count word, which is enough, since dropping that reader leaves no read to wait for.
//!
//! # Dead readers
//! A put that finds no room looks at the slots. A slot ATTACHED whose role lock is free is
//! proved dead — also from another pid namespace, where its pid means nothing: a live
//! reader, however slow, holds its lock, and one that closed said LEFT before letting it
//! go. With `on_dead_reader = "raise"` the put fails, naming the dead reader, if the oldest
//! object (which holds the room) waits for its reads; with `"drop"` the writer drops it
//! (a compare-and-swap to DROPPED on the word it judged, so a process that took the slot
//! meanwhile is not dropped) and goes on: from then on no object waits for that slot,
//! until a new reader takes it (see "Slots").
//!
//! # What a peer can do
//! Any process that may write the segment can write the slots: name another pid, make a
//! slot look taken, left or dropped (readers then take other slots, or none, and read
//! anonymously), or hold a slot's lock byte to make a dead reader look alive (the writer
//! then waits for it, as for a slow one). Which slots are dropped, for eviction, is the
//! writer's own memory, never read back from the segment; and a reader's counts were
//! always writable by peers (they decide only when an object is evicted).

use std::sync::{Arc, Mutex, PoisonError};

use super::store_segment::{
    MAX_READER_SLOTS, READER_SLOT_BYTES, READER_SLOTS_OFFSET, StoreSegment,
};
use crate::error::Result;
use shmq_os::liveness::{Liveness, RoleLock};
use shmq_os::process::ProcessId;
use shmq_protocol::ring::{
    SLOT_ATTACHED, SLOT_ATTACHING, SLOT_DROPPED, SLOT_LEFT, SlotWord, slot_attached_word,
    slot_begin_attach_reusing_dropped, slot_drop, slot_dropped_word, slot_end_attach, slot_hint,
    slot_leave, slot_read, slot_recheck, slot_state,
};
use shmq_protocol::word::{FieldU32, FieldU64, StatU64};

/// One reader slot in the header page.
#[repr(C, align(32))]
pub(super) struct ReaderSlotWords {
    /// `generation << 32 | state` ([`shmq_protocol::ring`]'s slot protocol, with its
    /// [`SLOT_LEFT`] state).
    word: SlotWord,
    /// The holder, published by `word` (its seqlock).
    pid: FieldU32,
    _pad: u32,
    start_time: FieldU64,
    /// Reads counted by its holders (a statistic, written by the holder only).
    reads: StatU64,
}
const _: () = assert!(std::mem::size_of::<ReaderSlotWords>() == READER_SLOT_BYTES);

/// The role-lock byte of reader slot `s` in the segment's file (byte 0 is the creator's;
/// pins are far above, see `store_segment::pin_byte`).
fn lock_byte(s: usize) -> u64 {
    1 + s as u64
}

impl StoreSegment {
    /// Reader slot `s` (below [`MAX_READER_SLOTS`]).
    pub(super) fn reader_slot(&self, s: usize) -> &ReaderSlotWords {
        assert!(s < MAX_READER_SLOTS, "no reader slot {s}");
        // SAFETY: READER_SLOTS_OFFSET + MAX_READER_SLOTS * READER_SLOT_BYTES <= RING_OFFSET
        // (by MAX_READER_SLOTS's definition), inside the mapping; 32-aligned (the mapping is
        // page-aligned); every field is an atomic. A peer can write anything there, which
        // changes only what the slots say (see the module docs), never memory safety.
        unsafe {
            &*(self
                .segment
                .as_ptr()
                .add(READER_SLOTS_OFFSET + s * READER_SLOT_BYTES)
                as *const ReaderSlotWords)
        }
    }

    /// Reader slot `s` counted one more read (its holder, for statistics).
    pub(super) fn count_reader_read(&self, s: usize) {
        if s < MAX_READER_SLOTS {
            // Relaxed: a statistic; an atomic add, since a forked copy of the holder may
            // count into the same slot.
            self.reader_slot(s).reads.add(1);
        }
    }
}

/// The reader slots of a store of `n_readers` readers: the first `n_readers`, at most
/// [`MAX_READER_SLOTS`].
pub fn reader_slots(n_readers: u32) -> usize {
    (n_readers as usize).min(MAX_READER_SLOTS)
}

/// How many reader words an object of a store of `n_readers` readers carries: one per
/// reader slot, none for a store of one reader (see the module docs).
pub(super) fn object_slots(n_readers: u32) -> usize {
    if n_readers < 2 {
        0
    } else {
        reader_slots(n_readers)
    }
}

/// Writer: the word of reader slot `s` now (to tell whether a slot it dropped was taken
/// again). A hint (`slot_hint`, Relaxed): only compared with the DROPPED word the writer
/// wrote itself (the coherence order of this one location is all it needs); nothing is
/// read through it.
pub(super) fn slot_word(segment: &StoreSegment, s: usize) -> u64 {
    slot_hint(&segment.reader_slot(s).word)
}

/// Writer: which of the first `slots` reader slots a reader holds now (ATTACHED), one bit
/// each: their reads must be their own (see "Which reader read what"). Relaxed: a state
/// seen late is an attach or a close racing with the writer's decision: a reader that
/// attaches then had no handle to the objects decided on yet but those handed out
/// before it held the slot (which may count others' reads for it, as before it came),
/// and one that closes is waited for once more (its reads are still in its word).
pub(super) fn attached_slots(segment: &StoreSegment, slots: usize) -> u128 {
    (0..slots.min(MAX_READER_SLOTS))
        .filter(|&s| slot_state(slot_word(segment, s)) == SLOT_ATTACHED)
        .fold(0, |mask, s| mask | 1 << s)
}
const _: () = assert!(MAX_READER_SLOTS <= 128, "a slot mask is a u128");

/// A reader slot held by this process: its reads are counted in the slot's words, and the
/// writer can tell whether it lives. Given back (LEFT) by [`leave`](Self::leave) or when
/// dropped; a process that dies gives it back through its role lock, and is then a dead
/// reader.
#[derive(Debug)]
pub struct ReaderSlot {
    segment: Arc<StoreSegment>,
    index: usize,
    /// The slot word of this occupancy (ATTACHED), to leave it by compare-and-swap.
    word: u64,
    made_in: u64,
    /// The slot's role lock, until it is left.
    lock: Mutex<Option<RoleLock>>,
}

impl ReaderSlot {
    /// Take a slot of `segment`'s first [`reader_slots`]`(n_readers)`: an empty, left or
    /// dropped one first, else that of a reader that died (whose place this one takes).
    /// `None` if every one is held by a live process: this process then reads
    /// anonymously.
    ///
    /// # Errors
    ///
    /// [`Error::Os`](crate::Error::Os) when a slot's lock cannot be taken for another
    /// reason than a holder (`fcntl` fails), or the segment's file cannot be opened.
    pub fn take(segment: &Arc<StoreSegment>, n_readers: u32) -> Result<Option<ReaderSlot>> {
        let slots = reader_slots(n_readers);
        for dead_too in [false, true] {
            for s in 0..slots {
                let slot = segment.reader_slot(s);
                // A hint; the state is checked again under the lock.
                let state = slot_state(slot_hint(&slot.word));
                let wanted = match state {
                    SLOT_ATTACHED => dead_too,
                    _ => !dead_too,
                };
                if !wanted {
                    continue;
                }
                // The slot's role lock first: a live holder keeps it, and while we hold it
                // nobody else attaches.
                let Some(lock) = RoleLock::acquire(segment.name(), lock_byte(s))? else {
                    continue;
                };
                // A CAS: if the writer dropped the slot meanwhile (it drops only the exact
                // ATTACHED word it judged), it is taken from DROPPED, which the writer sees.
                let generation = slot_begin_attach_reusing_dropped(&slot.word);
                let me = ProcessId::current();
                // Relaxed: published by the Release store in `slot_end_attach`.
                slot.pid.set(me.pid);
                slot.start_time.set(me.start_time);
                slot_end_attach(&slot.word, generation);
                return Ok(Some(ReaderSlot {
                    segment: segment.clone(),
                    index: s,
                    word: slot_attached_word(generation),
                    made_in: shmq_os::fork::generation(),
                    lock: Mutex::new(Some(lock)),
                }));
            }
        }
        Ok(None)
    }

    /// The slot's number.
    pub fn index(&self) -> usize {
        self.index
    }

    /// How this process counts its reads: in this slot's words, or (in a forked child,
    /// which does not hold the slot's lock) anonymously.
    pub fn count(&self) -> super::CountRead {
        if shmq_os::fork::is_inherited(self.made_in) {
            super::CountRead::Anonymous
        } else {
            super::CountRead::AsReader(self.index)
        }
    }
}

impl ReaderSlot {
    /// Give the slot back: its reader closed the store (the writer does not take it for a
    /// dead one; its reads are still expected, of whoever takes the slot next).
    /// Idempotent; reads counted afterwards go to the slot still, harmlessly.
    pub fn leave(&self) {
        self.leave_as(true);
    }

    /// Let the slot go as a reader that died would: its lock, not its state (tests).
    #[cfg(test)]
    pub(super) fn die(&self) {
        self.leave_as(false);
    }

    fn leave_as(&self, closed: bool) {
        let mut lock = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(lock) = lock.take() else { return };
        if shmq_os::fork::is_inherited(self.made_in) {
            return; // a forked child's copy: the slot is its parent's (the lock knows)
        }
        if closed {
            // LEFT before the lock goes (below): the writer, which judges a slot dead by
            // ATTACHED and a free lock and reads the word again after its lock probe,
            // never takes a reader that closed for a dead one (`slot_leave` says why). A
            // CAS: a slot the writer dropped (it judged us dead: we were not) stays
            // dropped.
            let _ = slot_leave(&self.segment.reader_slot(self.index).word, self.word);
        }
        drop(lock);
    }
}

impl Drop for ReaderSlot {
    fn drop(&mut self) {
        self.leave();
    }
}

/// What the writer finds in a reader slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReaderStatus {
    /// No reader has taken it yet.
    Empty,
    /// A reader is taking it now.
    Attaching,
    /// Its reader holds it and lives (or cannot be told dead: `known` is false).
    Alive { known: bool },
    /// Its reader closed the store; its reads are still expected (a reader that opens the
    /// store takes its place).
    Left,
    /// Its reader died without closing (its role lock is free).
    Dead,
    /// Dropped by the writer after its reader died.
    Dropped,
}

/// A reader slot as the writer sees it ([`judge_slot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReaderInfo {
    pub slot: usize,
    /// Its last holder, if the slot names one (read consistently).
    pub process: Option<ProcessId>,
    pub status: ReaderStatus,
    /// Reads counted by its holders.
    pub reads: u64,
    /// The slot word judged (to drop it by CAS).
    pub(super) word: u64,
}

/// Writer: what reader slot `s` of `segment` holds. A slot is `Dead` only if it was
/// ATTACHED, its role lock is free, and its word did not change across the lock probe
/// (a reader that closes says LEFT before it lets the lock go).
pub fn judge_slot(segment: &StoreSegment, s: usize) -> ReaderInfo {
    let slot = segment.reader_slot(s);
    // Relaxed field loads inside the seqlock read (ordered by its Acquire load and
    // fence); a torn read (an attach under way) names nobody.
    let read = slot_read(&slot.word, || (slot.pid.get(), slot.start_time.get()));
    // Relaxed: a statistic.
    let reads = slot.reads.get();
    let Some((word, (pid, start_time))) = read else {
        return ReaderInfo {
            slot: s,
            process: None,
            status: ReaderStatus::Attaching,
            reads,
            word: 0,
        };
    };
    let process = Some(ProcessId { pid, start_time });
    let (process, status) = match slot_state(word) {
        SLOT_ATTACHED => {
            // By its role lock; by its pid only where the lock cannot be tested (and then
            // a pid that is not visible here is `Unknown`, never `Dead`).
            let liveness = match segment.probe.as_ref().map(|p| p.liveness(lock_byte(s))) {
                Some(Liveness::Unknown) | None => ProcessId { pid, start_time }.liveness(),
                Some(known) => known,
            };
            // After the probe (a system call), the word is read again: a reader that closed
            // stored LEFT before it released its lock, so a LEFT is seen here if the
            // release was (`slot_leave`).
            let again = slot_recheck(&slot.word);
            let status = match liveness {
                _ if again != word => match slot_state(again) {
                    // It closed, or was dropped, or a new reader took the slot, meanwhile.
                    SLOT_LEFT => ReaderStatus::Left,
                    SLOT_DROPPED => ReaderStatus::Dropped,
                    _ => ReaderStatus::Alive { known: false },
                },
                Liveness::Dead => ReaderStatus::Dead,
                Liveness::Alive => ReaderStatus::Alive { known: true },
                Liveness::Unknown => ReaderStatus::Alive { known: false },
            };
            (process, status)
        }
        SLOT_LEFT => (process, ReaderStatus::Left),
        SLOT_DROPPED => (process, ReaderStatus::Dropped),
        SLOT_ATTACHING => (None, ReaderStatus::Attaching),
        _ => (None, ReaderStatus::Empty),
    };
    ReaderInfo {
        slot: s,
        process,
        status,
        reads,
        word,
    }
}

/// Writer: drop the reader of `info` (judged `Dead`): the DROPPED word written (a new
/// reader that takes the slot changes it), `None` if the slot changed since (a new reader
/// took it).
pub(super) fn drop_slot(segment: &StoreSegment, info: &ReaderInfo) -> Option<u64> {
    let dropped = slot_dropped_word(info.word);
    (info.status == ReaderStatus::Dead
        && slot_drop(&segment.reader_slot(info.slot).word, info.word))
    .then_some(dropped)
}

impl std::fmt::Display for ReaderInfo {
    /// "reader slot 1 (pid 4242)".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.process {
            Some(p) => write!(f, "reader slot {} (pid {})", self.slot, p.pid),
            None => write!(f, "reader slot {}", self.slot),
        }
    }
}
