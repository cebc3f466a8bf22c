//! The remote stream's errors.

/// An error of the remote stream (in `shmq::Error`, [`crate::Error::Remote`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// A remote reader's writer is gone without shutting the queue down: the connection
    /// that carried the stream ended (the writer died, hangs, or the network failed: see
    /// `remote`), or before the start no connection to it could be made. The reader has
    /// every message that arrived before (`received` of them).
    /// `queue`: the queue's name, where its writer named it (its WELCOME says it).
    #[error(
        "the writer{} at {endpoint} is gone: {reason}; {received} messages received from it; \
         no more will come",
        of_queue(queue.as_deref())
    )]
    WriterGone {
        endpoint: String,
        received: u64,
        reason: String,
        queue: Option<String>,
    },

    /// The writer stopped sending to this remote reader because it fell behind
    /// (`slow_remote_reader="drop"`), and said so after the messages it had sent to it
    /// (`received` of them).
    #[error(
        "remote reader rank {rank}{} was dropped by the writer at {endpoint}: it fell behind the \
         queue's bounds (slow_remote_reader=\"drop\"); {received} messages received before; no \
         more will come (make the queue with slow_remote_reader=\"block\", or raise \
         remote_hwm / remote_max_queued_bytes; in Rust, QueueOptions::remote's slow_reader \
         (SlowReaderPolicy::Block), hwm and max_queued_bytes)",
        of_queue(queue.as_deref())
    )]
    ReaderDropped {
        rank: u64,
        endpoint: String,
        received: u64,
        /// The queue's name, where its writer named it.
        queue: Option<String>,
    },

    /// The writer lost remote readers (gone: their connection closed or nothing came
    /// from them within the heartbeat bound; or dropped as slow) and was made with
    /// [`LostReaderPolicy::Raise`](super::LostReaderPolicy::Raise): `readers` are the
    /// lost ones, `(rank, host as ZeroMQ saw it)`; `queue` the queue's name, where its
    /// writer named it. The message that found them went to the others.
    #[error(
        "remote reader {}{} is gone: its connection closed, or nothing came from it within the \
         heartbeat bound (SHMQ_REMOTE_HEARTBEAT_TIMEOUT), or it fell behind; no more messages \
         go to it (on_lost_remote_reader=\"raise\")",
        lost_names(.readers),
        of_queue(queue.as_deref())
    )]
    LostReaders {
        readers: Vec<(u64, Option<String>)>,
        queue: Option<String>,
    },

    /// The remote stream refused something: a writer that does not prove it holds the
    /// queue's secret, a message that fails authentication or comes out of order, a
    /// reader the writer refused.
    #[error("{0}")]
    Refused(String),
}

/// " of queue 'steps'" for a queue its writer named `steps`; nothing for one it did not.
pub(crate) fn of_queue(queue: Option<&str>) -> String {
    queue.map_or_else(String::new, |q| format!(" of queue '{q}'"))
}

/// "rank 1 (host 10.0.0.2), rank 2 (host unknown)".
fn lost_names(readers: &[(u64, Option<String>)]) -> String {
    let names: Vec<String> = readers
        .iter()
        .map(|(rank, host)| {
            let host = host.as_deref().filter(|h| !h.is_empty());
            format!("rank {rank} (host {})", host.unwrap_or("unknown"))
        })
        .collect();
    names.join(", ")
}
