//! The broadcast queue: one writer, many readers.
//!
//! - [`ring`]: the shared-memory ring of chunks and its flag protocol.
//! - [`queue`]: [`Writer`] and [`Reader`], which combine the ring (local readers) with
//!   the ZeroMQ transport (oversized messages and remote readers).

pub mod queue;
pub mod ring;

pub use queue::{Handle, QueueOptions, Reader, Writer};
pub use ring::{ChunkInfo, ChunkKind, Ring, RingHandle, RingReader, RingWriter};
