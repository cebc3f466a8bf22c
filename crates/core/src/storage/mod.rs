//! The object store: a FIFO ring of variable-size blocks in one segment (one writer
//! allocates, any process reads by `(address, id)`), and on top of it a key → object
//! index whose objects carry an atomic reader count and whose handles are signed.
//!
//! # Segment layout
//! ```text
//! 0      StoreHeader: magic (stored last, Release), layout version, capacity, creator
//! 64     Published: what readers check a handle against, under a seqlock (`seq`)
//! 128    the handle-signing secret: 32 random bytes, written before the magic
//! 4096   the ring: `capacity` bytes of blocks packed tightly (vLLM 0.33's layout):
//!          +0 id: u32, +4 size: u32 (header included), +8 data: `size - 8` bytes
//! ```
//! Block boundaries are wherever the allocator ([`shmq_protocol::alloc`]) puts them: any byte
//! offset. Header words are therefore read and written byte by byte through `AtomicU8`
//! (an `AtomicU32` needs 4-byte alignment), and whatever needs alignment inside a block
//! is padded *inside* the block. An object's data is
//! ```text
//! [0..7 pad][count word: count u32 | tag u32][frame word: n | s << 24: u32]
//!   [if s > 0: 4 pad, s × reader word: count u32 | tag u32][n × (offset: u32, len: u32)][parts ...]
//! ```
//! (`s`: one reader word per reader slot in a store of two or more readers, see
//! "Readers" below; with none, the frame is `[count word][n][table]`, as in version 4.)
//! The pad puts the count word on an 8-byte boundary (it is an `AtomicU64`: the reader
//! count and a tag of the object's id, see "Eviction" below); the frame
//! gives each part's offset from the start of the data and its length. Parts from
//! `align_from` on (the raw tensor and array buffers of the built-in serdes) start on
//! 64-byte boundaries of the ring, which is page-aligned in memory; the others follow
//! each other without gaps, so a custom serde's `[metadata][data...]` stays contiguous.
//! Blocks are sized exactly for the offset they land on ([`shmq_protocol::alloc::FifoAllocator::allocate_with`]).
//!
//! # Which handles are valid
//! The writer publishes, under a seqlock, the live ids `[id_start, id_end)` and the ids
//! `[cleared_start, cleared_end)` of the blocks that were live at the last `clear()`,
//! with `overwritten`: since that clear the writer has written only ring bytes
//! `[0, overwritten)` (blocks are placed from offset 0 on, each at 0 or right after the
//! previous one, so what they cover is always a prefix). A reader accepts `(address, id)`
//! only if the id is live, or cleared and its block starts at or after `overwritten`
//! (vLLM 0.33 lets requests that are still draining read their objects after a
//! `clear()`, until the memory is reused), and the header at the address holds that id.
//! It checks the same again after using the payload, so an object reused meanwhile is
//! reported as modified instead of returning torn data. The writer publishes a change
//! *before* it writes over the memory concerned.
//!
//! # Eviction
//! `put` hands an object out once; each `get_cached` hands it out again. Every reader
//! increments the count once per read (one atomic compare-exchange, no lock; reads of a
//! cleared object are not counted). The count lies in the block, so a reader announces
//! its increment in the segment header (`counting`) before its last check of the
//! handle, and the writer, after freeing blocks, waits for announced increments before
//! it reuses them (up to `COUNTING_PATIENCE`: the reader may have died there). The count
//! shares an 8-byte word with a tag of the object's id, and the increment is made only
//! while the tag is there, so a reader stalled past that patience does not write into
//! the next object either (it would have to find those 8 bytes again). (The protocol on
//! these words, with its ordering arguments and loom models: [`shmq_protocol::read_count`].)
//! So the object
//! may be evicted when `count >= n_readers * handouts` (the count word and the reader
//! words added up, less the readers dropped, see "Readers"), oldest first, unless the writer
//! `touch`ed it and has not yet handed it out again or released its touches, or some
//! process *pins* it.
//!
//! # Readers, and readers that die
//! A process that opens the store as a reader takes a reader slot in the header page,
//! under a role lock that proves it alive; an object of a store of two or more readers
//! carries one count word per slot (its reader words, see the layout above), in which
//! its slot's reader counts its reads. So the writer knows which reader an object
//! still waits for, and a put that finds no room because a reader died before reading
//! fails naming it, or (`on_dead_reader = "drop"`) goes on without it: see `readers`.
//!
//! # Zero-copy views and loans
//! [`read_object_viewed`] lets a reader map parts privately (copy-on-write) and keep
//! them ([`ObjectViews::kept_parts`] decides per part: a view from a size threshold on,
//! else a copy): the block is pinned — a shared lock on a byte of the segment's file,
//! see the `pins` module — until the last such view is dropped (or its process dies). The
//! writer frees a block only after stamping its header and finding no pin, and a
//! `clear()` that finds a pinned block frees nothing at once (the blocks go oldest first
//! as usual). [`ObjectStore::loan`] gives the writer a pinned block with [`LOAN_ROOM`]
//! bytes before a page-aligned buffer; `put` of parts one of which is that buffer writes
//! the others into the room, so the buffer is never copied.
//!
//! # Signed handles
//! `sign(key, address, id)` is HMAC-SHA256, under the segment's secret, of
//! `sha256(key) ‖ address (u64 LE) ‖ id (u32 LE)`, as in vLLM 0.33. Readers check it, in
//! constant time, before they read anything at the address. The secret is readable by
//! every process that can open the segment (mode 0600: the same user), and by nobody else.
//! A reader's get and touch are [`read_signed`] (or [`read_signed_viewed`]) and
//! [`check_signed`] of a [`SignedHandle`] (key, address, id, signature): they refuse a
//! missing key or signature, or a wrong signature, with
//! [`StoreError::BadSignature`] before anything at the address is read, as the Python
//! store does (it calls them). [`read_object`] and [`check_object`] check no signature:
//! the writer's reads of its own handles, or handles that never left the process.
//!
//! # Files
//! - `store_segment`: the store segment's header, published state, secret, and byte access;
//! - `fifo`: [`BlockFifo`], the blocks in FIFO order (allocator on the writer);
//! - `object`: an object's layout, reading it, and zero-copy views ([`PartView`]);
//! - `index`: [`ObjectStore`], the key index with eviction and loans ([`StoreLoan`]);
//! - `readers`: reader slots ([`ReaderSlot`]), and how the writer judges them;
//! - `signed`: a reader's get and touch of a [`SignedHandle`], its signature checked first;
//! - `error`: [`StoreError`], what the store refuses, and [`HandleRefusal`], why.

mod error;
mod fifo;
mod index;
mod object;
mod readers;
mod signed;
mod store_segment;
#[cfg(test)]
mod tests;

pub use error::{HandleRefusal, StoreError, bad_signature_message, stale_object_message};
pub use fifo::{BlockFifo, FreeOldest, FreeOldestFirst};
pub use index::{Entry, LOAN_ROOM, ObjectStore, StoreLoan, StoreRole, store_full_message};
pub use object::{
    BlockPin, CountRead, KeptPart, ObjectFrame, ObjectViews, PartView, check_object,
    object_reader_count, read_object, read_object_viewed,
};
pub use readers::{ReaderInfo, ReaderSlot, ReaderStatus, judge_slot, reader_slots};
pub use signed::{SignedHandle, check_signed, key_and_signature, read_signed, read_signed_viewed};
pub use store_segment::{
    BlockHeader, COUNT_BYTES, MAX_PARTS, MAX_READER_SLOTS, PART_ALIGN, SECRET_BYTES,
    SIGNATURE_BYTES, STORE_LAYOUT_VERSION, STORE_MAGIC, StoreOccupancy, StoreSegment, StoreStats,
};
