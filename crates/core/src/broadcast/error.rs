//! The queue's errors: a peer that died, and the ends of a queue that was shut down.

/// An error of the queue, and of a remote stream's reader where the writer shut down (in
/// `shmq::Error`, [`crate::Error::Queue`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueueError {
    /// A local reader died while the writer waited for it to free a chunk. `queue`: the
    /// queue as the message names it (one process may hold several queues): its name in
    /// quotes and its ring segment where its writer named it, else its segment in quotes
    /// (`Ring::queue_words`).
    #[error("{}", dead_reader_message(*reader, *pid, *chunk, queue.as_deref()))]
    DeadReader {
        reader: usize,
        pid: u32,
        chunk: usize,
        queue: Option<String>,
    },

    /// The writer died while a reader waited for its next message; `queue` as for
    /// [`QueueError::DeadReader`].
    #[error("{}", dead_writer_message(*pid, queue.as_deref()))]
    DeadWriter { pid: u32, queue: Option<String> },

    /// A call on a queue writer that was shut down (`shmq::Writer::close`,
    /// or its `shmq::broadcast::Canceller`'s `cancel()` from another thread;
    /// Python's `shutdown()`): it sends nothing more. Also how an `enqueue` blocked in
    /// another thread ends when the writer is shut down.
    #[error(
        "the queue was shut down: this writer's shutdown() was called (or the writer was \
         closed), so it sends no more messages"
    )]
    ShutDown,

    /// The writer shut the queue down (`shmq::Writer::close`, Python's
    /// `shutdown()`, or its normal end: dropped): the reader
    /// has received every message sent before, and no more will come. Not a death: see
    /// [`QueueError::DeadWriter`]. `queue`: as for [`QueueError::DeadReader`]; for a
    /// remote stream's reader, the name the writer said in its WELCOME and its address
    /// (`'steps' (at tcp://…)`), `None` where the writer did not name the queue.
    #[error("{}", writer_shut_down_message(queue.as_deref()))]
    WriterShutDown { queue: Option<String> },

    /// The writer shut the queue down and went away before the last message it had sent
    /// over the overflow socket reached this reader (its process exited at once, before
    /// ZeroMQ delivered it): that message is lost.
    #[error(
        "the writer's process ended before a message it sent over the queue's socket (one \
         too large for a chunk, with no room for it in the tensor arena) reached this reader: \
         that message is lost; the messages after it are still read"
    )]
    WriterGoneMidMessage,

    /// A writer of a [`Gather`](crate::broadcast::Gather) died, after every message it
    /// sent was received: it is left out (see `Gather::died`) and the next receive goes
    /// on with the others. `writer`: its index in the Gather; `name`: the name it was
    /// given; `cause`: its queue's error ([`QueueError::DeadWriter`], or a segment no
    /// longer whole).
    #[error("writer {name:?} (#{writer}) of this Gather died: {cause}")]
    GatherWriterDied {
        /// The writer's index in the Gather.
        writer: usize,
        /// The name the writer was given.
        name: String,
        /// Its queue's error.
        #[source]
        cause: Box<crate::Error>,
    },

    /// Every writer of a [`Gather`](crate::broadcast::Gather) has ended its queue (or
    /// died, which was reported before): no more messages will come. `ended` and
    /// `died`: the writers' names.
    #[error("every writer of this Gather has ended its queue (ended: {ended:?}, died: {died:?})")]
    GatherEnded {
        /// The writers that ended their queue normally.
        ended: Vec<String>,
        /// The writers that died.
        died: Vec<String>,
    },
}

/// The message of [`QueueError::DeadReader`], naming the queue (its ring segment) if known.
fn dead_reader_message(reader: usize, pid: u32, chunk: usize, queue: Option<&str>) -> String {
    let of_queue = queue.map_or_else(String::new, |q| format!(" of queue {q}"));
    format!(
        "reader {reader} (pid {pid}) died before reading chunk {chunk}{of_queue}; the writer \
         cannot go on without losing its messages (to go on without dead readers, make the \
         queue with on_dead_reader=\"drop\" in Python, or with QueueOptions::on_dead_reader \
         set to DeadReaderPolicy::Drop in Rust)"
    )
}

/// The message of [`QueueError::DeadWriter`], naming the queue (its ring segment) if known.
fn dead_writer_message(pid: u32, queue: Option<&str>) -> String {
    let on_queue = queue.map_or_else(String::new, |q| format!(" on queue {q}"));
    format!("the writer (pid {pid}) died; no more messages will come{on_queue}")
}

/// The message of [`QueueError::WriterShutDown`], naming the queue (its ring segment) if known.
fn writer_shut_down_message(queue: Option<&str>) -> String {
    let of_queue = queue.map_or_else(String::new, |q| format!(" of queue {q}"));
    format!(
        "the writer{of_queue} shut down: every message it sent before has been received, and \
         no more will come"
    )
}
