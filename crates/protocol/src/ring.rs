//! The chunk-flag protocol of the broadcast ring (the engines' `ShmRingBuffer` chunk
//! states, written out below), on abstract flags so it can
//! be model-checked with loom; `shmq::broadcast::ring` applies it to flags in shared memory.
//!
//! Per chunk: one `written` flag and one `read` flag per reader.
//!
//! Writer, for a chunk:
//! 1. [`is_free`]: `written == 0`, or every active reader's `read == 1`. The Acquire
//!    loads pair with the Release store in [`finish_read`]: the readers' reads of the old
//!    data happen before the writer overwrites it.
//! 2. [`begin_write`]: `written = 0`; then the writer fills the chunk.
//! 3. [`publish`]: every `read = 0` (Release; a dropped reader's is set to 1 instead so it
//!    never holds the writer back), then `written = 1` (Release: publishes the data).
//!
//! Reader `r`, for a chunk:
//! 1. [`is_readable`]: `read[r] == 0`, then `written == 1`, both Acquire. The Acquire on
//!    `written` is what makes the data visible (loom finds the race without it). Since
//!    `publish` resets `read[r]` only after the fill, a reset seen here means the data is
//!    complete; loading `read[r]` first keeps that true even for a writer that reset the
//!    flags early, because its Release then makes the earlier `written = 0` visible.
//! 2. use the data, then [`finish_read`]: `read[r] = 1` (Release).

use crate::sync::{fence, AtomicU64, AtomicU8, Ordering};

/// One chunk flag (`written`, or a reader's `read`): a byte, 0 or 1, changed only by the
/// functions below.
#[repr(transparent)]
pub struct ChunkFlag(AtomicU8);

impl ChunkFlag {
    pub fn new(v: u8) -> ChunkFlag {
        ChunkFlag(AtomicU8::new(v))
    }

    /// The flag now, where nothing is decided on it (a report, a debug dump) or only a
    /// hint (the writer's look at a reader's `read` to tell whom it waits for).
    pub fn peek(&self) -> u8 {
        // Relaxed: nothing is read through the value.
        self.0.load(Ordering::Relaxed)
    }
}

/// Access to one chunk's flags.
pub trait ChunkFlags {
    fn n_reader(&self) -> usize;
    fn written(&self) -> &ChunkFlag;
    fn read(&self, reader: usize) -> &ChunkFlag;
}

/// Whether the writer may overwrite the chunk. `dropped(r)`: reader `r` no longer counts.
pub fn is_free(f: &impl ChunkFlags, dropped: impl Fn(usize) -> bool) -> bool {
    // Relaxed: only the writer stores `written`, so it sees its own last value.
    if f.written().0.load(Ordering::Relaxed) == 0 {
        return true;
    }
    // Acquire: pairs with the Release store in `finish_read`.
    (0..f.n_reader()).all(|r| dropped(r) || f.read(r).0.load(Ordering::Acquire) == 1)
}

/// Start overwriting a free chunk.
pub fn begin_write(f: &impl ChunkFlags) {
    // Relaxed: no reader takes the chunk before the Release in `publish` (every active
    // reader has `read == 1` now, or the chunk was never written).
    f.written().0.store(0, Ordering::Relaxed);
}

/// Make the filled chunk readable.
pub fn publish(f: &impl ChunkFlags, dropped: impl Fn(usize) -> bool) {
    for r in 0..f.n_reader() {
        // Release: pairs with the first Acquire load in `is_readable` (see module docs).
        f.read(r).0.store(u8::from(dropped(r)), Ordering::Release);
    }
    // Release: pairs with the Acquire load of `written` in `is_readable`; publishes the
    // chunk's data and length.
    f.written().0.store(1, Ordering::Release);
}

/// Whether reader `r` may read the chunk now.
pub fn is_readable(f: &impl ChunkFlags, r: usize) -> bool {
    // Acquire, and this load first (see the module docs): pairs with the Release reset
    // in `publish`.
    if f.read(r).0.load(Ordering::Acquire) != 0 {
        return false;
    }
    // Acquire: pairs with the Release store of `written = 1` in `publish`.
    f.written().0.load(Ordering::Acquire) == 1
}

/// Reader `r` is done with the chunk.
pub fn finish_read(f: &impl ChunkFlags, r: usize) {
    // Release: pairs with the Acquire loads in `is_free`.
    f.read(r).0.store(1, Ordering::Release);
}

// ---------------------------------------------------------------------------------
// Slots: who holds each side of the ring, as a seqlock with a generation.
//
// A slot's `word` is `generation << 32 | state`. Attaching bumps the generation (the
// state is ATTACHING while the holder's fields are being written); a reader of the slot
// reads the word, the fields, then the word again, and trusts the fields only if the
// word is unchanged and not ATTACHING. Because every attach bumps the generation, an
// ATTACHED -> ATTACHING -> ATTACHED re-attach in between is seen, and a new pid is never
// paired with an old start time. The writer drops a dead reader with a compare-and-swap
// on the exact word it judged, so a reader that re-attached meanwhile is not dropped.

/// A slot's word (`generation << 32 | state`), changed only by the functions below.
/// Zero bytes: nobody ever attached.
#[repr(transparent)]
pub struct SlotWord(AtomicU64);

impl SlotWord {
    pub fn new() -> SlotWord {
        SlotWord(AtomicU64::new(0))
    }
}

impl Default for SlotWord {
    fn default() -> Self {
        SlotWord::new()
    }
}

/// Slot states (the low 32 bits of the word; 0: nobody ever attached).
pub const SLOT_ATTACHED: u32 = 1;
pub const SLOT_DROPPED: u32 = 2;
pub const SLOT_ATTACHING: u32 = 3;
/// The writer's slot only: the writer shut the queue down after its last message
/// (see [`slot_close`]).
pub const SLOT_CLOSED: u32 = 4;

/// An object store's reader slot only: its reader closed the store (see [`slot_leave`]).
/// Never judged dead, never waited for as a holder; taken again like an empty slot.
pub const SLOT_LEFT: u32 = 5;

/// The state part of a slot word.
pub fn slot_state(word: u64) -> u32 {
    word as u32
}

fn slot_word(generation: u32, state: u32) -> u64 {
    ((generation as u64) << 32) | state as u64
}

/// Start attaching to a slot (the caller holds the slot's role lock, so no other process
/// attaches at the same time). Returns the new generation, or `None` if the writer has
/// dropped this slot.
pub fn slot_begin_attach(word: &SlotWord) -> Option<u32> {
    begin_attach(word, false)
}

/// [`slot_begin_attach`], except that a DROPPED slot is taken too: an object store's
/// dropped slot serves a new reader (a broadcast ring's stays dropped). The writer may
/// drop the ATTACHED word of a dead holder at the same time: the CAS then retries from
/// DROPPED, and the writer sees the new generation.
pub fn slot_begin_attach_reusing_dropped(word: &SlotWord) -> u32 {
    begin_attach(word, true).expect("a dropped slot is taken, never refused")
}

fn begin_attach(word: &SlotWord, take_dropped: bool) -> Option<u32> {
    loop {
        // Relaxed: the CAS below decides; nothing is read through this value.
        let w = word.0.load(Ordering::Relaxed);
        if slot_state(w) == SLOT_DROPPED && !take_dropped {
            return None;
        }
        let generation = ((w >> 32) as u32).wrapping_add(1);
        // Relaxed CAS, then a Release fence: a slot reader that sees any of the field
        // stores that follow also sees ATTACHING (or a later word) on its re-check. The
        // CAS (not a plain store) loses to a concurrent drop by the writer.
        if word
            .0
            .compare_exchange(
                w,
                slot_word(generation, SLOT_ATTACHING),
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            fence(Ordering::Release);
            return Some(generation);
        }
    }
}

/// Finish attaching: the fields written since [`slot_begin_attach`] become readable.
pub fn slot_end_attach(word: &SlotWord, generation: u32) {
    // Release: pairs with the Acquire load in `slot_read`: the fields are visible to a
    // reader that sees this word.
    word.0
        .store(slot_word(generation, SLOT_ATTACHED), Ordering::Release);
}

/// Read a slot's fields with `read` (relaxed loads); `Some((word, fields))` if they are
/// consistent: the word did not change meanwhile and no attach was under way.
pub fn slot_read<T>(word: &SlotWord, read: impl FnOnce() -> T) -> Option<(u64, T)> {
    // Acquire: pairs with the Release store in `slot_end_attach`.
    let before = word.0.load(Ordering::Acquire);
    if slot_state(before) == SLOT_ATTACHING {
        return None;
    }
    let fields = read();
    // Acquire fence: the field loads above complete before the re-check below, so an
    // attach that wrote any of them (after its Release fence) shows in the word.
    fence(Ordering::Acquire);
    // Relaxed: ordered by the fence.
    (word.0.load(Ordering::Relaxed) == before).then_some((before, fields))
}

/// The writer shuts the queue down: every chunk it will ever publish is published. A
/// reader that finds nothing to read and then sees [`slot_is_closed`] polls once more
/// (to take a chunk published just before) and then knows the stream has ended.
pub fn slot_close(word: &SlotWord) {
    // Release: pairs with the Acquire load in `slot_is_closed`; the `written = 1` stores
    // of every chunk published before (program order in the one writer) are visible to a
    // reader that sees CLOSED. A plain store: only the writer changes its own slot once
    // attached, so there is no other store to lose; the generation is kept.
    let w = word.0.load(Ordering::Relaxed);
    word.0
        .store(slot_word((w >> 32) as u32, SLOT_CLOSED), Ordering::Release);
}

/// Whether the writer's slot says the writer shut the queue down (see [`slot_close`]).
pub fn slot_is_closed(word: &SlotWord) -> bool {
    // Acquire: pairs with the Release store in `slot_close`.
    slot_state(word.0.load(Ordering::Acquire)) == SLOT_CLOSED
}

/// Drop a slot whose holder was judged dead when its word was `seen`. Fails (returns
/// false) if the word changed since: a new holder attached, and must not be dropped.
pub fn slot_drop(word: &SlotWord, seen: u64) -> bool {
    if slot_state(seen) != SLOT_ATTACHED {
        return false;
    }
    // Relaxed: the state carries no data; `slot_begin_attach` sees DROPPED through its
    // own CAS on the same word.
    word.0
        .compare_exchange(
            seen,
            slot_word((seen >> 32) as u32, SLOT_DROPPED),
            Ordering::Relaxed,
            Ordering::Relaxed,
        )
        .is_ok()
}

/// An object store's reader leaves its slot, whose word it attached as `attached` (the
/// ATTACHED word [`slot_end_attach`] stored): LEFT, *before* it lets its role lock go.
/// A CAS: a slot the writer dropped meanwhile (it judged the holder dead) stays dropped.
/// Returns whether the slot is now LEFT.
///
/// Why a reader that left is never taken for a dead one: the writer judges a slot dead
/// by its ATTACHED word, then a free role lock, then [`slot_recheck`] (the same word
/// again). The lock is let go after this store (program order), and the kernel orders a
/// lock's release before a probe that finds it free; so a writer that finds the lock free
/// reads LEFT (or later) on its re-check, and judges the slot left, not dead.
pub fn slot_leave(word: &SlotWord, attached: u64) -> bool {
    if slot_state(attached) != SLOT_ATTACHED {
        return false;
    }
    // Release: nothing is published by it (the reads counted before were Release
    // already), but it keeps the LEFT word ordered before the lock's release for a
    // writer that synchronizes with the word itself rather than the lock. Relaxed on
    // failure: nothing is read through the value.
    word.0
        .compare_exchange(
            attached,
            slot_word((attached >> 32) as u32, SLOT_LEFT),
            Ordering::Release,
            Ordering::Relaxed,
        )
        .is_ok()
}

/// The writer, after probing a slot's role lock: the slot's word again, to compare with
/// the one it judged (see [`slot_leave`]).
pub fn slot_recheck(word: &SlotWord) -> u64 {
    // Acquire: pairs with the Release CAS in `slot_leave`: a LEFT seen here orders the
    // leaver's counted reads before the writer's decisions on the slot.
    word.0.load(Ordering::Acquire)
}

/// A slot's word now, as a hint (which slots look free, held or dropped): Relaxed, the
/// decisions on it are taken again by CAS or under the role lock.
pub fn slot_hint(word: &SlotWord) -> u64 {
    word.0.load(Ordering::Relaxed)
}

/// The DROPPED word [`slot_drop`] writes over `seen` (the writer remembers it, to tell
/// later whether a new reader took the slot).
pub fn slot_dropped_word(seen: u64) -> u64 {
    slot_word((seen >> 32) as u32, SLOT_DROPPED)
}

/// The ATTACHED word [`slot_end_attach`] stores for `generation`.
pub fn slot_attached_word(generation: u32) -> u64 {
    slot_word(generation, SLOT_ATTACHED)
}
