//! The remote stream's errors.

/// An error of the remote stream (in `shmq::Error`, [`crate::Error::Remote`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// A remote reader's writer is gone without shutting the queue down: the connection
    /// that carried the stream ended (the writer died, hangs, or the network failed: see
    /// `remote`), or before the start no connection to it could be made. The reader has
    /// every message that arrived before (`received` of them).
    #[error(
        "the writer at {endpoint} is gone: {reason}; {received} messages received from it; \
         no more will come"
    )]
    WriterGone {
        endpoint: String,
        received: u64,
        reason: String,
    },

    /// The writer stopped sending to this remote reader because it fell behind
    /// (`slow_remote_reader="drop"`), and said so after the messages it had sent to it
    /// (`received` of them).
    #[error(
        "remote reader rank {rank} was dropped by the writer at {endpoint}: it fell behind the \
         queue's bounds (slow_remote_reader=\"drop\"); {received} messages received before; no \
         more will come (make the queue with slow_remote_reader=\"block\", or raise \
         remote_hwm / remote_max_queued_bytes; in Rust, QueueOptions::remote's slow_reader \
         (SlowReaderPolicy::Block), hwm and max_queued_bytes)"
    )]
    ReaderDropped {
        rank: u64,
        endpoint: String,
        received: u64,
    },

    /// The remote stream refused something: a writer that does not prove it holds the
    /// queue's secret, a message that fails authentication or comes out of order, a
    /// reader the writer refused.
    #[error("{0}")]
    Refused(String),
}
