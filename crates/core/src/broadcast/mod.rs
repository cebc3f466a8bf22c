//! The broadcast queue: one writer, many readers.
//!
//! - the chunk-flag protocol, on abstract atomics, is `shmq_protocol::ring` (model-checked
//!   with loom);
//! - [`ring`]: the shared-memory ring of chunks, its slots and doorbells.
//! - `framing`: how a message of several parts (a body and its buffers) is laid out;
//! - [`array`](mod@array): typed arrays, the message format both languages speak for numbers.
//! - [`queue`]: [`Writer`] and [`Reader`], which combine the ring (local readers) with
//!   the ZeroMQ transport (oversized messages and remote readers).
//! - [`wait_any`]: one thread waiting for several local readers at once (`futex_waitv`).
//! - `error`: [`QueueError`], how a queue ends (a dead peer, a shutdown).

pub mod array;
mod error;
pub(crate) mod framing;
pub mod queue;
pub mod ring;
pub mod wait_any;

pub use array::{Array, ArrayMeta, ArrayRef, Dtype, Element};
pub use error::QueueError;
pub use queue::{
    Canceller, ChunkRead, Handle, OwnedPart, Part, QueueOptions, Reader, Received, Writer,
};
pub use ring::{
    ChunkInfo, ChunkKind, DeadReaderPolicy, Ring, RingHandle, RingReader, RingWriter, SlotInfo,
};
