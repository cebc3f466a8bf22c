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
//! - [`async_wait`]: async receives on any executor ([`AsyncWaiter`], waiter threads
//!   asleep in `wait_any`; [`Reader::dequeue_async`] and its siblings).
//! - [`gather`]: [`Gather`], many writers' queues read as one stream, blocking or awaited.
//! - `error`: [`QueueError`], how a queue ends (a dead peer, a shutdown); the errors of
//!   the queue's operations, one type each ([`OpenError`], [`DequeueError`],
//!   [`CreateError`], [`EnqueueError`], the writer's [`TryEnqueueError`] and
//!   [`WriteChunkError`], the reader's [`TryDequeueError`] and [`FinishReadError`], the
//!   Gather's [`NewGatherError`] and [`GatherRecvError`]).

pub mod array;
pub mod async_wait;
mod error;
pub(crate) mod framing;
pub mod gather;
pub mod queue;
pub mod ring;
pub mod wait_any;

pub use array::{Array, ArrayMeta, ArrayRef, Dtype, Element};
pub use async_wait::{AsyncWaiter, WaitReady};
pub use error::{
    CreateError, DequeueError, EnqueueError, FinishReadError, GatherRecvError, NewGatherError,
    OpenError, QueueError, TryDequeueError, WriteChunkError,
};
pub use gather::{Gather, GatherCanceller};
pub use queue::{
    Canceller, ChunkRead, Handle, Message, OwnedPart, Part, QueueOptions, Reader, Received,
    TryEnqueueError, Writer,
};
pub use ring::{
    ChunkInfo, ChunkKind, DeadReaderPolicy, Ring, RingHandle, RingReader, RingWriter, SlotInfo,
};
