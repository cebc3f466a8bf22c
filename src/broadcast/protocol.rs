//! The chunk-flag protocol of the broadcast ring (the engines' `ShmRingBuffer` chunk
//! states, written out below), on abstract flags so it can
//! be model-checked with loom; [`super::ring`] applies it to flags in shared memory.
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

use crate::sync::{AtomicU8, Ordering};

/// Access to one chunk's flags.
pub trait ChunkFlags {
    fn n_reader(&self) -> usize;
    fn written(&self) -> &AtomicU8;
    fn read(&self, reader: usize) -> &AtomicU8;
}

/// Whether the writer may overwrite the chunk. `dropped(r)`: reader `r` no longer counts.
pub fn is_free(f: &impl ChunkFlags, dropped: impl Fn(usize) -> bool) -> bool {
    // Relaxed: only the writer stores `written`, so it sees its own last value.
    if f.written().load(Ordering::Relaxed) == 0 {
        return true;
    }
    // Acquire: pairs with the Release store in `finish_read`.
    (0..f.n_reader()).all(|r| dropped(r) || f.read(r).load(Ordering::Acquire) == 1)
}

/// Start overwriting a free chunk.
pub fn begin_write(f: &impl ChunkFlags) {
    // Relaxed: no reader takes the chunk before the Release in `publish` (every active
    // reader has `read == 1` now, or the chunk was never written).
    f.written().store(0, Ordering::Relaxed);
}

/// Make the filled chunk readable.
pub fn publish(f: &impl ChunkFlags, dropped: impl Fn(usize) -> bool) {
    for r in 0..f.n_reader() {
        // Release: pairs with the first Acquire load in `is_readable` (see module docs).
        f.read(r).store(u8::from(dropped(r)), Ordering::Release);
    }
    // Release: pairs with the Acquire load of `written` in `is_readable`; publishes the
    // chunk's data and length.
    f.written().store(1, Ordering::Release);
}

/// Whether reader `r` may read the chunk now.
pub fn is_readable(f: &impl ChunkFlags, r: usize) -> bool {
    // Acquire, and this load first (see the module docs): pairs with the Release reset
    // in `publish`.
    if f.read(r).load(Ordering::Acquire) != 0 {
        return false;
    }
    // Acquire: pairs with the Release store of `written = 1` in `publish`.
    f.written().load(Ordering::Acquire) == 1
}

/// Reader `r` is done with the chunk.
pub fn finish_read(f: &impl ChunkFlags, r: usize) {
    // Release: pairs with the Acquire loads in `is_free`.
    f.read(r).store(1, Ordering::Release);
}
