//! The broadcast queue: one writer, many readers.
//!
//! - `protocol`: the chunk-flag protocol, on abstract atomics (model-checked);
//! - [`ring`]: the shared-memory ring of chunks, its slots and doorbells.
//! - `framing`: how a message of several parts (a body and its buffers) is laid out;
//! - [`array`](mod@array): typed arrays, the message format both languages speak for numbers.
//! - [`queue`]: [`Writer`] and [`Reader`], which combine the ring (local readers) with
//!   the ZeroMQ transport (oversized messages and remote readers).

#[cfg(not(loom))]
pub mod array;
#[cfg(not(loom))]
pub(crate) mod framing;
// The loom model checks (tests/loom.rs) drive the protocol directly.
#[cfg(loom)]
pub mod protocol;
#[cfg(not(loom))]
pub(crate) mod protocol;
#[cfg(not(loom))]
pub mod queue;
#[cfg(not(loom))]
pub mod ring;

#[cfg(not(loom))]
pub use array::{Array, ArrayMeta, ArrayRef, Dtype, Element};
#[cfg(not(loom))]
pub use queue::{
    Canceller, ChunkRead, Handle, OwnedPart, Part, QueueOptions, Reader, Received, Writer,
};
#[cfg(not(loom))]
pub use ring::{
    ChunkInfo, ChunkKind, DeadReaderPolicy, Ring, RingHandle, RingReader, RingWriter, SlotInfo,
};
