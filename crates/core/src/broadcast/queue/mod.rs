//! [`Writer`] and [`Reader`]: bytes in, bytes out, to local readers through the ring and
//! to remote readers through ZeroMQ.
//!
//! A message that fits in a chunk goes in the next chunk and never touches ZeroMQ. A
//! larger one puts an overflow mark in the chunk and goes over the `ipc://` socket; the
//! writer publishes it *before* committing the mark, so a reader that sees the mark
//! finds the message already on its way. Remote readers get every message over TCP.
//!
//! The writer's end ([`Writer::close`], Python's `shutdown()`, or the writer dropped) is told to
//! every reader after its last message, without needing room in the ring: the writer's
//! slot in the ring header turns CLOSED (see `protocol::slot_close`), which a local
//! reader looks at when it finds no chunk to read — it polls once more, then fails with
//! [`QueueError::WriterShutDown`] — and remote readers get a last authenticated CLOSED message
//! on their stream (see [`crate::remote`]). A writer that dies without it is seen as dead
//! ([`QueueError::DeadWriter`]) instead. The writer's own calls fail with [`QueueError::ShutDown`]
//! from then on, also one blocked in another thread (the canceller is set first).
//!
//! Files: `options` (how a writer is made), `handle` (what a reader needs to join),
//! `cancel` (ending blocked calls from another thread), `writer` and `reader`.

mod cancel;
mod handle;
mod options;
mod reader;
#[cfg(test)]
mod tests;
mod writer;

use super::ring::Ring;
use crate::error::{Error, OsError, QueueError, Result};
use shmq_os::liveness::Liveness;

pub use cancel::Canceller;
pub use handle::Handle;
pub use options::QueueOptions;
pub(crate) use reader::{AsyncStep, own_array, own_parts};
pub use reader::{ChunkEnd, ChunkRead, ChunkView, OwnedPart, Part, Reader, Received};
pub use writer::{Message, TryEnqueueError, Writer};

/// An error for the first local reader proved dead. One that left is not: before the
/// queue is ready its rank is free for another reader, which the writer waits for.
fn dead_local_reader(ring: &Ring) -> Result<()> {
    for r in 0..ring.n_reader() {
        if reader_is_dead(ring, r) && !ring.reader_left(r) {
            let pid = ring.slot_info(Some(r))?.process.map_or(0, |p| p.pid);
            return Err(Error::Queue(QueueError::DeadReader {
                reader: r,
                pid,
                chunk: 0,
                queue: Some(ring.queue_words()),
            }));
        }
    }
    Ok(())
}

/// Whether local reader `r` is proved gone (its slot's role lock is free while the slot
/// names a holder): dead, or left (see [`Ring::reader_left`]), which is what the arena
/// asks before it drops a reader's holds. A reader that cannot be judged is not gone.
fn reader_is_dead(ring: &Ring, r: usize) -> bool {
    ring.slot_info(Some(r))
        .is_ok_and(|info| ring.holder_liveness(Some(r), &info) == Liveness::Dead)
}

/// The error when a chunk seen as ready is not ready a moment later: only a writer that
/// breaks the protocol (or another process writing into the segment) can cause it.
fn chunk_changed(ring: &Ring) -> Error {
    Error::Os(OsError::BadSegment {
        name: ring.name().to_owned(),
        reason: "a chunk changed while it was being read (is another process writing into this segment?)".into(),
    })
}
