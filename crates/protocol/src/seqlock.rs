//! The object store's seqlock (the state its writer publishes for readers to check
//! handles against, `storage::Published`), on abstract atomics so that loom can check it
//! (`crates/protocol/tests/loom.rs`); `shmq::storage` applies it to the words in shared memory.
//!
//! One writer, any number of readers, a sequence word `seq` that is even when the fields
//! are consistent and odd while the writer updates them (it only ever grows, by 2 per
//! update, so a reader never mistakes A→B→A for "unchanged"):
//!
//! - [`write`](fn@write): `seq += 1` (odd), Release fence, the field stores (Relaxed), then
//!   `seq += 1` (even) with Release, then a Release fence.
//! - [`read`]: load `seq` (Acquire); if even, the field loads (Relaxed), an Acquire
//!   fence, and `seq` again (Relaxed): the fields are consistent if it is unchanged.
//!
//! Why each ordering is needed (`crates/protocol/tests/loom.rs` fails without any of the first three):
//! - the Acquire load of `seq` pairs with the Release store that ends [`write`](fn@write): a reader
//!   that sees an update's even `seq` sees that update's fields;
//! - the Release fence after the odd store pairs with the Acquire fence in [`read`]: a
//!   reader that sees any field of an update under way sees the odd (or a later) `seq`
//!   on its re-check, and retries. The same pair covers a reader that reads memory the
//!   update gave up and then checks the published state again (the store's
//!   `still_valid`): if what it read is the writer's later data, written after that
//!   fence, its re-check sees the update (at least begun), never the old state;
//! - the Release fence that ends [`write`](fn@write) orders the *whole* update (not only its start)
//!   before whatever the writer does next. The model passes without it (the opening
//!   fence suffices for the properties above); it is kept as the store's writer had it,
//!   for one fence per update, off the readers' path.

use crate::sync::{fence, AtomicU64, Ordering};

/// A seqlock's sequence word (even: no update under way), changed only by [`write`](fn@write).
/// Zero bytes: no update yet.
#[repr(transparent)]
pub struct SeqWord(AtomicU64);

impl SeqWord {
    pub fn new() -> SeqWord {
        SeqWord(AtomicU64::new(0))
    }
}

impl Default for SeqWord {
    fn default() -> Self {
        SeqWord::new()
    }
}

/// Writer only (one at a time): run `update`, which stores the fields (Relaxed), as one
/// seqlock update.
pub fn write<R>(seq: &SeqWord, update: impl FnOnce() -> R) -> R {
    // Relaxed: only the writer stores `seq`, so it reads its own last value.
    let s = seq.0.load(Ordering::Relaxed);
    // Relaxed, then a Release fence: pairs with the Acquire fence in `read`; a reader that
    // sees any field stored by `update` also sees this odd value (or a later one).
    seq.0.store(s.wrapping_add(1), Ordering::Relaxed);
    fence(Ordering::Release);
    let out = update();
    // Release: pairs with the Acquire load in `read`: publishes the fields.
    seq.0.store(s.wrapping_add(2), Ordering::Release);
    // Release fence: the update happens before every later store of the writer, for a
    // reader whose Acquire fence follows a load of one of those stores.
    fence(Ordering::Release);
    out
}

/// A reader that used data the published state vouched for (read after a [`read`]),
/// before it checks the published state again (another [`read`]): the Acquire fence
/// orders its reads of the data before that check's loads, so if they show the data
/// still vouched for, the writer had not started reusing it (it publishes before it
/// writes: see the module docs).
pub fn before_recheck() {
    fence(Ordering::Acquire);
}

/// One attempt to read the fields with `read` (Relaxed loads): `Some` if no update
/// overlapped it, `None` if one did (or is under way: the caller may retry).
pub fn read<T>(seq: &SeqWord, read: impl FnOnce() -> T) -> Option<T> {
    // Acquire: pairs with the Release store that ends `write`: the fields loaded below
    // are at least as new as the update that store completed.
    let s = seq.0.load(Ordering::Acquire);
    if s % 2 != 0 {
        return None;
    }
    let fields = read();
    // Acquire fence: pairs with the Release fence after the odd store in `write`; the
    // field loads above complete before the re-check below, so an update that stored any
    // of them shows in `seq`.
    fence(Ordering::Acquire);
    // Relaxed: ordered by the fence.
    (seq.0.load(Ordering::Relaxed) == s).then_some(fields)
}
