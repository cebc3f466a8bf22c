//! The queue's errors: [`QueueError`], a peer that died and the ends of a queue that was
//! shut down (in `shmq::Error`); and one type per operation of the queue's Rust API, each
//! with exactly the ways that operation fails (as crossbeam's `TrySendError`):
//! [`OpenError`] (a reader's `open`), [`DequeueError`] (its receives and its
//! `wait_until_ready`, and the async receives), [`TryDequeueError`] (its `try_take`),
//! [`FinishReadError`] (its `finish_read`), [`CreateError`] (a writer's `new`),
//! [`EnqueueError`] (its send and its `wait_until_ready`), [`WriteChunkError`] (its
//! `acquire_write` and `commit_write`), [`NewGatherError`] and [`GatherRecvError`] (a
//! Gather's `new` and its receives). Each converts into `shmq::Error`, with the same text.

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

use std::time::Duration;

use crate::error::{Error, NameError, OsError, RemoteError, Result};

/// Why [`Reader::open`](crate::Reader::open), [`open_with`](crate::Reader::open_with) or
/// [`open_by_name`](crate::Reader::open_by_name) made no reader. Its text is the one
/// [`Error`] has for the same failure, and it converts into that [`Error`] (`?` in a
/// function returning `shmq::Result`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The handle has no reader `rank`, or does not hold together (its text says which);
    /// [`Error::InvalidArgument`] as a `shmq::Error`.
    #[error("{0}")]
    BadHandle(String),
    /// The writer had already died. As a `shmq::Error`,
    /// [`QueueError::DeadWriter`].
    #[error("{}", dead_writer_message(*pid, queue.as_deref()))]
    WriterDied {
        /// The writer's process id.
        pid: u32,
        /// The queue, as [`QueueError::DeadWriter`] names it.
        queue: Option<String>,
    },
    /// No live writer has this name, or its writer died (`open_by_name` only); the
    /// user's names directory is [`OpenError::Os`]'s `NamesDirRefused`.
    #[error(transparent)]
    Name(NameError),
    /// The ring or arena segment could not be opened: gone, not this user's, not a
    /// queue's, or a system call failed (see [`OsError`]).
    #[error(transparent)]
    Os(OsError),
    /// A socket could not be set up or connect (ZeroMQ); [`Error::Transport`] as a
    /// `shmq::Error`.
    #[error("ZeroMQ error while {context}: {source}")]
    Transport {
        /// What the reader was doing.
        context: String,
        /// ZeroMQ's error.
        #[source]
        source: zmq::Error,
    },
    /// A failure of another layer (none is known to reach here; kept so that a
    /// `shmq::Error` always has a place).
    #[error(transparent)]
    Other(Box<Error>),
}

impl OpenError {
    /// The reader's failure as this type says it (the parts of the reader return
    /// `shmq::Error`).
    pub(crate) fn from_core(e: Error) -> OpenError {
        match e {
            Error::InvalidArgument(why) => OpenError::BadHandle(why),
            Error::Queue(QueueError::DeadWriter { pid, queue }) => {
                OpenError::WriterDied { pid, queue }
            }
            Error::Name(e) => OpenError::Name(e),
            Error::Os(e) => OpenError::Os(e),
            Error::Transport { context, source } => OpenError::Transport { context, source },
            e => OpenError::Other(Box::new(e)),
        }
    }
}

impl From<OpenError> for Error {
    fn from(e: OpenError) -> Error {
        match e {
            OpenError::BadHandle(why) => Error::InvalidArgument(why),
            OpenError::WriterDied { pid, queue } => {
                Error::Queue(QueueError::DeadWriter { pid, queue })
            }
            OpenError::Name(e) => Error::Name(e),
            OpenError::Os(e) => Error::Os(e),
            OpenError::Transport { context, source } => Error::Transport { context, source },
            OpenError::Other(e) => *e,
        }
    }
}

/// Why a receive of a [`Reader`](crate::Reader) ([`dequeue`](crate::Reader::dequeue)
/// and its siblings, [`wait_message`](crate::Reader::wait_message),
/// [`acquire_read`](crate::Reader::acquire_read)) returned no message, or its
/// [`wait_until_ready`](crate::Reader::wait_until_ready) failed (a subset of the same
/// ways). Its text is the
/// one [`Error`] has for the same failure, and it converts into that [`Error`] (`?` in a
/// function returning `shmq::Result`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DequeueError {
    /// The wait reached its deadline. `what`: who waited for what; `waited`: how long.
    #[error("timed out after {waited:.3?}: {what}")]
    Timeout { what: String, waited: Duration },
    /// The reader was shut down ([`Reader::shutdown`](crate::Reader::shutdown), its
    /// [`canceller`](crate::Reader::canceller)), or the wait's hook ended it so.
    #[error("cancelled")]
    Cancelled,
    /// The writer shut the queue down and every message it sent before was received:
    /// no more will come. Not a death. As a `shmq::Error`,
    /// [`QueueError::WriterShutDown`].
    #[error("{}", writer_shut_down_message(queue.as_deref()))]
    WriterShutDown {
        /// The queue, as [`QueueError::WriterShutDown`] names it.
        queue: Option<String>,
    },
    /// The writer died. As a `shmq::Error`, [`QueueError::DeadWriter`].
    #[error("{}", dead_writer_message(*pid, queue.as_deref()))]
    WriterDied {
        /// The writer's process id.
        pid: u32,
        /// The queue, as [`QueueError::DeadWriter`] names it.
        queue: Option<String>,
    },
    /// The writer's process ended before a message it sent over the queue's socket
    /// reached this reader: that message is lost, the next receive reads on. As a
    /// `shmq::Error`, [`QueueError::WriterGoneMidMessage`].
    #[error("{}", QueueError::WriterGoneMidMessage)]
    MessageLost,
    /// The message is of another kind than this call takes (parts or an array for
    /// `dequeue`, ...), or malformed; it was consumed. The text names what it is.
    /// [`Error::InvalidArgument`] as a `shmq::Error`.
    #[error("{0}")]
    WrongKind(String),
    /// Not a call for this reader (`acquire_read` of a remote reader).
    /// [`Error::WrongRole`] as a `shmq::Error`.
    #[error("{0}")]
    WrongRole(String),
    /// A remote reader's stream was lost or refused (see [`RemoteError`]).
    #[error(transparent)]
    Remote(RemoteError),
    /// A segment broken by another process (truncated, not whole), or a system call
    /// that failed (see [`OsError`]).
    #[error(transparent)]
    Os(OsError),
    /// ZeroMQ failed (the socket of a message larger than a chunk, or a remote
    /// reader's); [`Error::Transport`] as a `shmq::Error`.
    #[error("ZeroMQ error while {context}: {source}")]
    Transport {
        /// What the reader was doing.
        context: String,
        /// ZeroMQ's error.
        #[source]
        source: zmq::Error,
    },
    /// Another error: the one the wait's hook ended it with (other than
    /// [`Error::Cancelled`]), a reader used in a forked child.
    #[error(transparent)]
    Other(Box<Error>),
}

impl DequeueError {
    /// The receive's failure as this type says it (the parts of the reader return
    /// `shmq::Error`).
    pub(crate) fn from_core(e: Error) -> DequeueError {
        match e {
            Error::Timeout { what, waited } => DequeueError::Timeout { what, waited },
            Error::Cancelled => DequeueError::Cancelled,
            Error::Queue(QueueError::WriterShutDown { queue }) => {
                DequeueError::WriterShutDown { queue }
            }
            Error::Queue(QueueError::DeadWriter { pid, queue }) => {
                DequeueError::WriterDied { pid, queue }
            }
            Error::Queue(QueueError::WriterGoneMidMessage) => DequeueError::MessageLost,
            Error::InvalidArgument(why) => DequeueError::WrongKind(why),
            Error::WrongRole(why) => DequeueError::WrongRole(why),
            Error::Remote(e) => DequeueError::Remote(e),
            Error::Os(e) => DequeueError::Os(e),
            Error::Transport { context, source } => DequeueError::Transport { context, source },
            e => DequeueError::Other(Box::new(e)),
        }
    }
}

impl From<DequeueError> for Error {
    fn from(e: DequeueError) -> Error {
        match e {
            DequeueError::Timeout { what, waited } => Error::Timeout { what, waited },
            DequeueError::Cancelled => Error::Cancelled,
            DequeueError::WriterShutDown { queue } => {
                Error::Queue(QueueError::WriterShutDown { queue })
            }
            DequeueError::WriterDied { pid, queue } => {
                Error::Queue(QueueError::DeadWriter { pid, queue })
            }
            DequeueError::MessageLost => Error::Queue(QueueError::WriterGoneMidMessage),
            DequeueError::WrongKind(why) => Error::InvalidArgument(why),
            DequeueError::WrongRole(why) => Error::WrongRole(why),
            DequeueError::Remote(e) => Error::Remote(e),
            DequeueError::Os(e) => Error::Os(e),
            DequeueError::Transport { context, source } => Error::Transport { context, source },
            DequeueError::Other(e) => *e,
        }
    }
}

/// Why [`Writer::enqueue`](crate::Writer::enqueue) (or
/// [`try_enqueue`](crate::Writer::try_enqueue), in
/// [`TryEnqueueError::Failed`](crate::broadcast::TryEnqueueError::Failed)) did not send
/// the message, or [`Writer::wait_until_ready`](crate::Writer::wait_until_ready) failed (a
/// subset of the same ways: [`Timeout`](EnqueueError::Timeout),
/// [`ReaderDied`](EnqueueError::ReaderDied) for a reader that died before subscribing,
/// [`ShutDown`](EnqueueError::ShutDown), [`Remote`](EnqueueError::Remote), the hook's). Its text is the one [`Error`] has for the same failure, and it converts
/// into that [`Error`] (`?` in a function returning `shmq::Result`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// The wait for room reached its deadline; nothing was sent.
    #[error("timed out after {waited:.3?}: {what}")]
    Timeout { what: String, waited: Duration },
    /// The wait's hook ended it with [`Error::Cancelled`] before anything was sent.
    #[error("cancelled")]
    Cancelled,
    /// The writer is shut down ([`Writer::close`](crate::Writer::close), its
    /// canceller; also a send blocked in another thread then). As a `shmq::Error`,
    /// [`QueueError::ShutDown`].
    #[error("{}", QueueError::ShutDown)]
    ShutDown,
    /// A local reader died holding the chunk needed (the queue's `on_dead_reader` is
    /// `Raise`). As a `shmq::Error`, [`QueueError::DeadReader`].
    #[error("{}", dead_reader_message(*reader, *pid, *chunk, queue.as_deref()))]
    ReaderDied {
        /// The reader's index among the local readers.
        reader: usize,
        /// Its process id.
        pid: u32,
        /// The chunk it had not read.
        chunk: usize,
        /// The queue, as [`QueueError::DeadReader`] names it.
        queue: Option<String>,
    },
    /// The message cannot be sent as it is (a part count beyond the framing's limit,
    /// ...); [`Error::InvalidArgument`] as a `shmq::Error`.
    #[error("{0}")]
    BadMessage(String),
    /// A remote reader was lost (under `LostReaderPolicy::Raise`), or its stream refused
    /// (see [`RemoteError`]).
    #[error(transparent)]
    Remote(RemoteError),
    /// `/dev/shm` had no room for what the message needs (the tensor arena), or a system
    /// call failed (see [`OsError`]).
    #[error(transparent)]
    Os(OsError),
    /// ZeroMQ failed (the socket of a message larger than a chunk, or the remote
    /// readers'); [`Error::Transport`] as a `shmq::Error`.
    #[error("ZeroMQ error while {context}: {source}")]
    Transport {
        /// What the writer was doing.
        context: String,
        /// ZeroMQ's error.
        #[source]
        source: zmq::Error,
    },
    /// Another error: the one the wait's hook ended it with (other than
    /// [`Error::Cancelled`]), a writer used in a forked child, the arena's refusal.
    #[error(transparent)]
    Other(Box<Error>),
}

impl EnqueueError {
    /// The send's failure as this type says it (the parts of the writer return
    /// `shmq::Error`).
    pub(crate) fn from_core(e: Error) -> EnqueueError {
        match e {
            Error::Timeout { what, waited } => EnqueueError::Timeout { what, waited },
            Error::Cancelled => EnqueueError::Cancelled,
            Error::Queue(QueueError::ShutDown) => EnqueueError::ShutDown,
            Error::Queue(QueueError::DeadReader {
                reader,
                pid,
                chunk,
                queue,
            }) => EnqueueError::ReaderDied {
                reader,
                pid,
                chunk,
                queue,
            },
            Error::InvalidArgument(why) => EnqueueError::BadMessage(why),
            Error::Remote(e) => EnqueueError::Remote(e),
            Error::Os(e) => EnqueueError::Os(e),
            Error::Transport { context, source } => EnqueueError::Transport { context, source },
            e => EnqueueError::Other(Box::new(e)),
        }
    }
}

impl From<EnqueueError> for Error {
    fn from(e: EnqueueError) -> Error {
        match e {
            EnqueueError::Timeout { what, waited } => Error::Timeout { what, waited },
            EnqueueError::Cancelled => Error::Cancelled,
            EnqueueError::ShutDown => Error::Queue(QueueError::ShutDown),
            EnqueueError::ReaderDied {
                reader,
                pid,
                chunk,
                queue,
            } => Error::Queue(QueueError::DeadReader {
                reader,
                pid,
                chunk,
                queue,
            }),
            EnqueueError::BadMessage(why) => Error::InvalidArgument(why),
            EnqueueError::Remote(e) => Error::Remote(e),
            EnqueueError::Os(e) => Error::Os(e),
            EnqueueError::Transport { context, source } => Error::Transport { context, source },
            EnqueueError::Other(e) => *e,
        }
    }
}

/// Why [`Writer::new`](crate::Writer::new) made no queue. Its text is the one [`Error`]
/// has for the same failure, and it converts into that [`Error`] (`?` in a function
/// returning `shmq::Result`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CreateError {
    /// Options that do not fit together or are out of range (more local readers than
    /// readers, ranks out of range, a bad `name`, `record_name` without one, remote
    /// options out of range); the text names the option. [`Error::InvalidArgument`] as a
    /// `shmq::Error`.
    #[error("{0}")]
    BadOptions(String),
    /// The queue's `name` could not be recorded: another live writer holds it, or it could
    /// not be decided (see [`NameError`]).
    #[error(transparent)]
    Name(NameError),
    /// The ring or the arena could not be made (no room in `/dev/shm`, ...), or a system
    /// call failed (see [`OsError`]).
    #[error(transparent)]
    Os(OsError),
    /// A socket could not be bound (ZeroMQ); [`Error::Transport`] as a `shmq::Error`.
    #[error("ZeroMQ error while {context}: {source}")]
    Transport {
        /// What the writer was doing.
        context: String,
        /// ZeroMQ's error.
        #[source]
        source: zmq::Error,
    },
    /// A failure of another layer (none is known to reach here; kept so that a
    /// `shmq::Error` always has a place).
    #[error(transparent)]
    Other(Box<Error>),
}

impl CreateError {
    /// The writer's failure as this type says it (the parts of the writer return
    /// `shmq::Error`).
    pub(crate) fn from_core(e: Error) -> CreateError {
        match e {
            Error::InvalidArgument(why) => CreateError::BadOptions(why),
            Error::Name(e) => CreateError::Name(e),
            Error::Os(e) => CreateError::Os(e),
            Error::Transport { context, source } => CreateError::Transport { context, source },
            e => CreateError::Other(Box::new(e)),
        }
    }
}

impl From<CreateError> for Error {
    fn from(e: CreateError) -> Error {
        match e {
            CreateError::BadOptions(why) => Error::InvalidArgument(why),
            CreateError::Name(e) => Error::Name(e),
            CreateError::Os(e) => Error::Os(e),
            CreateError::Transport { context, source } => Error::Transport { context, source },
            CreateError::Other(e) => *e,
        }
    }
}

/// Why [`Reader::try_take`](crate::Reader::try_take) or
/// [`try_take_message`](crate::Reader::try_take_message) took no message (as crossbeam's
/// `TryRecvError`): none is here yet, or the receive failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TryDequeueError {
    /// No message is here now (nothing was taken);
    /// [`wait_message`](crate::Reader::wait_message) or
    /// [`dequeue`](crate::Reader::dequeue) waits for one. Not a failure: as a
    /// `shmq::Error`, the [`Error::Timeout`] of a wait that ended at once.
    #[error("no message is here yet (taking one now would wait)")]
    Empty,
    /// The receive failed, as [`dequeue`](crate::Reader::dequeue) would have (never
    /// [`DequeueError::Timeout`]).
    #[error(transparent)]
    Failed(#[from] DequeueError),
}

impl TryDequeueError {
    /// A take of the crate's parts (`Ok(None)`: nothing yet) as this type says it.
    pub(crate) fn from_taken<R>(taken: Result<Option<R>>) -> std::result::Result<R, Self> {
        match taken {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(TryDequeueError::Empty),
            Err(e) => Err(TryDequeueError::Failed(DequeueError::from_core(e))),
        }
    }

    /// Whether no message was here (not a failure).
    pub fn is_empty(&self) -> bool {
        matches!(self, TryDequeueError::Empty)
    }
}

impl From<TryDequeueError> for Error {
    fn from(e: TryDequeueError) -> Error {
        match e {
            TryDequeueError::Empty => Error::Timeout {
                what: TryDequeueError::Empty.to_string(),
                waited: Duration::ZERO,
            },
            TryDequeueError::Failed(e) => e.into(),
        }
    }
}

/// Why [`Reader::finish_read`](crate::Reader::finish_read) or
/// [`finish_chunk`](crate::Reader::finish_chunk) failed. The chunk is marked as read
/// all the same where the reader has one (the writer may reuse it). Its text is the one
/// [`Error`] has for the same failure, and it converts into that [`Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FinishReadError {
    /// Not a call for this reader: a remote reader has no chunks.
    /// [`Error::WrongRole`] as a `shmq::Error`.
    #[error("{0}")]
    WrongRole(String),
    /// The view's private mapping could not be given back, or what was read may have
    /// been zeros: another process truncated the ring or the arena (see [`OsError`]).
    #[error(transparent)]
    Os(OsError),
    /// Another error: the reader used in a forked child.
    #[error(transparent)]
    Other(Box<Error>),
}

impl FinishReadError {
    /// The call's failure as this type says it.
    pub(crate) fn from_core(e: Error) -> FinishReadError {
        match e {
            Error::WrongRole(why) => FinishReadError::WrongRole(why),
            Error::Os(e) => FinishReadError::Os(e),
            e => FinishReadError::Other(Box::new(e)),
        }
    }
}

impl From<FinishReadError> for Error {
    fn from(e: FinishReadError) -> Error {
        match e {
            FinishReadError::WrongRole(why) => Error::WrongRole(why),
            FinishReadError::Os(e) => Error::Os(e),
            FinishReadError::Other(e) => *e,
        }
    }
}

/// Why [`Writer::acquire_write`](crate::Writer::acquire_write) handed out no chunk, or
/// [`commit_write`](crate::Writer::commit_write) published none. Its text is the one
/// [`Error`] has for the same failure, and it converts into that [`Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WriteChunkError {
    /// The wait for a free chunk reached its deadline (`acquire_write`).
    #[error("timed out after {waited:.3?}: {what}")]
    Timeout { what: String, waited: Duration },
    /// The wait's hook ended it with [`Error::Cancelled`] (`acquire_write`).
    #[error("cancelled")]
    Cancelled,
    /// The writer is shut down. As a `shmq::Error`, [`QueueError::ShutDown`].
    #[error("{}", QueueError::ShutDown)]
    ShutDown,
    /// A local reader died holding the next chunk (the queue's `on_dead_reader` is
    /// `Raise`). As a `shmq::Error`, [`QueueError::DeadReader`].
    #[error("{}", dead_reader_message(*reader, *pid, *chunk, queue.as_deref()))]
    ReaderDied {
        /// The reader's index among the local readers.
        reader: usize,
        /// Its process id.
        pid: u32,
        /// The chunk it had not read.
        chunk: usize,
        /// The queue, as [`QueueError::DeadReader`] names it.
        queue: Option<String>,
    },
    /// Not a queue for writing in place (it has remote readers, or no ring), or a
    /// `commit_write` without a chunk acquired. [`Error::WrongRole`] as a `shmq::Error`.
    #[error("{0}")]
    WrongRole(String),
    /// `/dev/shm` has no room for the whole chunk, or a system call failed (see
    /// [`OsError`]).
    #[error(transparent)]
    Os(OsError),
    /// Another error: the one the wait's hook ended it with (other than
    /// [`Error::Cancelled`]), a writer used in a forked child.
    #[error(transparent)]
    Other(Box<Error>),
}

impl WriteChunkError {
    /// The call's failure as this type says it.
    pub(crate) fn from_core(e: Error) -> WriteChunkError {
        match e {
            Error::Timeout { what, waited } => WriteChunkError::Timeout { what, waited },
            Error::Cancelled => WriteChunkError::Cancelled,
            Error::Queue(QueueError::ShutDown) => WriteChunkError::ShutDown,
            Error::Queue(QueueError::DeadReader {
                reader,
                pid,
                chunk,
                queue,
            }) => WriteChunkError::ReaderDied {
                reader,
                pid,
                chunk,
                queue,
            },
            Error::WrongRole(why) => WriteChunkError::WrongRole(why),
            Error::Os(e) => WriteChunkError::Os(e),
            e => WriteChunkError::Other(Box::new(e)),
        }
    }
}

impl From<WriteChunkError> for Error {
    fn from(e: WriteChunkError) -> Error {
        match e {
            WriteChunkError::Timeout { what, waited } => Error::Timeout { what, waited },
            WriteChunkError::Cancelled => Error::Cancelled,
            WriteChunkError::ShutDown => Error::Queue(QueueError::ShutDown),
            WriteChunkError::ReaderDied {
                reader,
                pid,
                chunk,
                queue,
            } => Error::Queue(QueueError::DeadReader {
                reader,
                pid,
                chunk,
                queue,
            }),
            WriteChunkError::WrongRole(why) => Error::WrongRole(why),
            WriteChunkError::Os(e) => Error::Os(e),
            WriteChunkError::Other(e) => *e,
        }
    }
}

/// Why [`Gather::new`](crate::broadcast::Gather::new) made no Gather: the readers given
/// do not make one (none, more than 127, a name given twice, a reader that is not
/// local; the text says which). The readers were dropped. As a `shmq::Error`,
/// [`Error::InvalidArgument`] with the same text.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
#[non_exhaustive]
pub struct NewGatherError {
    /// What is wrong with the readers given.
    pub reason: String,
}

impl From<NewGatherError> for Error {
    fn from(e: NewGatherError) -> Error {
        Error::InvalidArgument(e.reason)
    }
}

/// Why a receive of a [`Gather`](crate::broadcast::Gather) (`recv`, `recv_timeout`,
/// `recv_view`, `recv_async`) returned no message. Its text is the one [`Error`] has
/// for the same failure, and it converts into that [`Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatherRecvError {
    /// The wait reached its deadline (`recv_timeout`, `recv_view` with a timeout).
    #[error("timed out after {waited:.3?}: {what}")]
    Timeout { what: String, waited: Duration },
    /// The Gather was shut down ([`Gather::shutdown`](crate::broadcast::Gather::shutdown),
    /// its canceller), or one of its readers was.
    #[error("cancelled")]
    Cancelled,
    /// A writer died, after every message it sent was received: it is left out and the
    /// next receive goes on with the others. As a `shmq::Error`,
    /// [`QueueError::GatherWriterDied`].
    #[error("writer {name:?} (#{writer}) of this Gather died: {cause}")]
    WriterDied {
        /// The writer's index in the Gather.
        writer: usize,
        /// The name it was given.
        name: String,
        /// Its queue's error.
        cause: Box<Error>,
    },
    /// Every writer has ended its queue (or died, which was reported before): no more
    /// messages will come. As a `shmq::Error`, [`QueueError::GatherEnded`].
    #[error("every writer of this Gather has ended its queue (ended: {ended:?}, died: {died:?})")]
    Ended {
        /// The writers that ended their queue normally.
        ended: Vec<String>,
        /// The writers that died.
        died: Vec<String>,
    },
    /// The message is not raw bytes (parts, an array), or malformed; it was consumed.
    /// [`Error::InvalidArgument`] as a `shmq::Error`.
    #[error("{0}")]
    WrongKind(String),
    /// A segment broken by another process, or a system call that failed (see
    /// [`OsError`]).
    #[error(transparent)]
    Os(OsError),
    /// ZeroMQ failed (the socket of a message larger than a chunk);
    /// [`Error::Transport`] as a `shmq::Error`.
    #[error("ZeroMQ error while {context}: {source}")]
    Transport {
        /// What the reader was doing.
        context: String,
        /// ZeroMQ's error.
        #[source]
        source: zmq::Error,
    },
    /// Another error (a Gather used in a forked child, ...).
    #[error(transparent)]
    Other(Box<Error>),
}

impl GatherRecvError {
    /// The receive's failure as this type says it.
    pub(crate) fn from_core(e: Error) -> GatherRecvError {
        match e {
            Error::Timeout { what, waited } => GatherRecvError::Timeout { what, waited },
            Error::Cancelled => GatherRecvError::Cancelled,
            Error::Queue(QueueError::GatherWriterDied {
                writer,
                name,
                cause,
            }) => GatherRecvError::WriterDied {
                writer,
                name,
                cause,
            },
            Error::Queue(QueueError::GatherEnded { ended, died }) => {
                GatherRecvError::Ended { ended, died }
            }
            Error::InvalidArgument(why) => GatherRecvError::WrongKind(why),
            Error::Os(e) => GatherRecvError::Os(e),
            Error::Transport { context, source } => GatherRecvError::Transport { context, source },
            e => GatherRecvError::Other(Box::new(e)),
        }
    }
}

impl From<GatherRecvError> for Error {
    fn from(e: GatherRecvError) -> Error {
        match e {
            GatherRecvError::Timeout { what, waited } => Error::Timeout { what, waited },
            GatherRecvError::Cancelled => Error::Cancelled,
            GatherRecvError::WriterDied {
                writer,
                name,
                cause,
            } => Error::Queue(QueueError::GatherWriterDied {
                writer,
                name,
                cause,
            }),
            GatherRecvError::Ended { ended, died } => {
                Error::Queue(QueueError::GatherEnded { ended, died })
            }
            GatherRecvError::WrongKind(why) => Error::InvalidArgument(why),
            GatherRecvError::Os(e) => Error::Os(e),
            GatherRecvError::Transport { context, source } => Error::Transport { context, source },
            GatherRecvError::Other(e) => *e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::Kind;

    /// One error of each shape the queue's operations meet, as the reader's and
    /// writer's parts return them.
    fn core_errors() -> Vec<Error> {
        vec![
            Error::Timeout {
                what: "local reader 0 (rank 0) of queue 'q' waiting for the writer".into(),
                waited: Duration::from_millis(1500),
            },
            Error::Cancelled,
            Error::InvalidArgument("a message of 2 parts; dequeue takes raw bytes".into()),
            Error::WrongRole("acquire_read is only for local readers".into()),
            Error::Queue(QueueError::WriterShutDown {
                queue: Some("'q'".into()),
            }),
            Error::Queue(QueueError::WriterShutDown { queue: None }),
            Error::Queue(QueueError::DeadWriter {
                pid: 42,
                queue: Some("'q'".into()),
            }),
            Error::Queue(QueueError::DeadReader {
                reader: 1,
                pid: 43,
                chunk: 7,
                queue: None,
            }),
            Error::Queue(QueueError::ShutDown),
            Error::Queue(QueueError::WriterGoneMidMessage),
            Error::Remote(RemoteError::Refused("no".into())),
            Error::Os(OsError::SegmentNotFound {
                name: "shmq-x".into(),
            }),
            Error::Name(NameError::NotFound {
                kind: Kind::Queue,
                name: "steps".into(),
                uid: 1000,
            }),
            Error::Transport {
                context: "connecting".into(),
                source: zmq::Error::EINVAL,
            },
            Error::Store(crate::storage::StoreError::KeyExists("k".into())),
            Error::Queue(QueueError::GatherWriterDied {
                writer: 1,
                name: "w1".into(),
                cause: Box::new(Error::Queue(QueueError::DeadWriter {
                    pid: 44,
                    queue: None,
                })),
            }),
            Error::Queue(QueueError::GatherEnded {
                ended: vec!["w0".into()],
                died: vec!["w1".into()],
            }),
        ]
    }

    /// Each operation's error says exactly what the `shmq::Error` it came from said, and
    /// converts back into that same `shmq::Error` (variant, fields and text): what the
    /// Python binding maps to exceptions, so no Python message or type changes.
    #[test]
    fn each_operations_error_has_the_text_of_and_converts_back_into_the_same_error() {
        for e in core_errors() {
            let (text, debug) = (e.to_string(), format!("{e:?}"));
            let open = OpenError::from_core(e);
            assert_eq!(open.to_string(), text);
            let e = Error::from(open);
            assert_eq!(format!("{e:?}"), debug);
            let dequeue = DequeueError::from_core(e);
            assert_eq!(dequeue.to_string(), text);
            let e = Error::from(dequeue);
            assert_eq!(format!("{e:?}"), debug);
            let enqueue = EnqueueError::from_core(e);
            assert_eq!(enqueue.to_string(), text);
            let e = Error::from(enqueue);
            assert_eq!(format!("{e:?}"), debug);
            let create = CreateError::from_core(e);
            assert_eq!(create.to_string(), text);
            let e = Error::from(create);
            assert_eq!(format!("{e:?}"), debug);
            let try_dequeue = TryDequeueError::Failed(DequeueError::from_core(e));
            assert_eq!(try_dequeue.to_string(), text);
            let e = Error::from(try_dequeue);
            assert_eq!(format!("{e:?}"), debug);
            let finish = FinishReadError::from_core(e);
            assert_eq!(finish.to_string(), text);
            let e = Error::from(finish);
            assert_eq!(format!("{e:?}"), debug);
            let write_chunk = WriteChunkError::from_core(e);
            assert_eq!(write_chunk.to_string(), text);
            let e = Error::from(write_chunk);
            assert_eq!(format!("{e:?}"), debug);
            let gather_recv = GatherRecvError::from_core(e);
            assert_eq!(gather_recv.to_string(), text);
            let e = Error::from(gather_recv);
            assert_eq!(format!("{e:?}"), debug);
            assert_eq!(e.to_string(), text);
        }
    }

    /// The errors with no `shmq::Error` of their own: a Gather's bad readers are an
    /// `InvalidArgument` with the same text; a `try_take` with nothing here, a timeout
    /// of no wait.
    #[test]
    fn new_gather_and_empty_convert_into_the_nearest_error() {
        let reason = "a Gather needs at least one queue".to_string();
        let e = NewGatherError {
            reason: reason.clone(),
        };
        assert_eq!(e.to_string(), reason);
        assert!(matches!(Error::from(e), Error::InvalidArgument(m) if m == reason));
        let empty = TryDequeueError::Empty;
        assert!(empty.is_empty());
        let text = empty.to_string();
        assert!(matches!(
            Error::from(empty),
            Error::Timeout { what, waited } if what == text && waited.is_zero()
        ));
        let taken = TryDequeueError::from_taken(Ok(Some(7)));
        assert!(matches!(taken, Ok(7)));
        let failed = TryDequeueError::from_taken::<()>(Err(Error::Cancelled));
        assert!(matches!(
            failed,
            Err(TryDequeueError::Failed(DequeueError::Cancelled))
        ));
        assert!(!failed.unwrap_err().is_empty());
        // The writer's twin: a full queue converts as an empty one does.
        let full = crate::broadcast::TryEnqueueError::Full;
        let text = full.to_string();
        assert!(matches!(
            Error::from(full),
            Error::Timeout { what, waited } if what == text && waited.is_zero()
        ));
        let failed = crate::broadcast::TryEnqueueError::Failed(EnqueueError::ShutDown);
        assert!(matches!(
            Error::from(failed),
            Error::Queue(QueueError::ShutDown)
        ));
    }

    /// The ways each operation fails are variants of its own, not `Other`.
    #[test]
    fn the_operations_failures_are_variants_of_their_own() {
        let e = || core_errors().into_iter();
        let dequeue: Vec<_> = e().map(DequeueError::from_core).collect();
        assert!(matches!(dequeue[0], DequeueError::Timeout { .. }));
        assert!(matches!(dequeue[1], DequeueError::Cancelled));
        assert!(matches!(dequeue[2], DequeueError::WrongKind(_)));
        assert!(matches!(dequeue[3], DequeueError::WrongRole(_)));
        assert!(matches!(dequeue[4], DequeueError::WriterShutDown { .. }));
        assert!(matches!(
            dequeue[6],
            DequeueError::WriterDied { pid: 42, .. }
        ));
        assert!(matches!(dequeue[9], DequeueError::MessageLost));
        assert!(matches!(dequeue[10], DequeueError::Remote(_)));
        assert!(matches!(dequeue[11], DequeueError::Os(_)));
        assert!(matches!(dequeue[13], DequeueError::Transport { .. }));
        let enqueue: Vec<_> = e().map(EnqueueError::from_core).collect();
        assert!(matches!(enqueue[0], EnqueueError::Timeout { .. }));
        assert!(matches!(enqueue[2], EnqueueError::BadMessage(_)));
        assert!(matches!(
            enqueue[7],
            EnqueueError::ReaderDied {
                reader: 1,
                pid: 43,
                chunk: 7,
                ..
            }
        ));
        assert!(matches!(enqueue[8], EnqueueError::ShutDown));
        let create: Vec<_> = e().map(CreateError::from_core).collect();
        assert!(matches!(create[2], CreateError::BadOptions(_)));
        assert!(matches!(create[11], CreateError::Os(_)));
        assert!(matches!(create[13], CreateError::Transport { .. }));
        let open: Vec<_> = e().map(OpenError::from_core).collect();
        assert!(matches!(open[2], OpenError::BadHandle(_)));
        assert!(matches!(open[6], OpenError::WriterDied { pid: 42, .. }));
        assert!(matches!(
            open[12],
            OpenError::Name(NameError::NotFound { .. })
        ));
        let finish: Vec<_> = e().map(FinishReadError::from_core).collect();
        assert!(matches!(finish[3], FinishReadError::WrongRole(_)));
        assert!(matches!(finish[11], FinishReadError::Os(_)));
        let write_chunk: Vec<_> = e().map(WriteChunkError::from_core).collect();
        assert!(matches!(write_chunk[0], WriteChunkError::Timeout { .. }));
        assert!(matches!(write_chunk[1], WriteChunkError::Cancelled));
        assert!(matches!(write_chunk[3], WriteChunkError::WrongRole(_)));
        assert!(matches!(
            write_chunk[7],
            WriteChunkError::ReaderDied { pid: 43, .. }
        ));
        assert!(matches!(write_chunk[8], WriteChunkError::ShutDown));
        assert!(matches!(write_chunk[11], WriteChunkError::Os(_)));
        let gather: Vec<_> = e().map(GatherRecvError::from_core).collect();
        assert!(matches!(gather[0], GatherRecvError::Timeout { .. }));
        assert!(matches!(gather[1], GatherRecvError::Cancelled));
        assert!(matches!(gather[2], GatherRecvError::WrongKind(_)));
        assert!(matches!(gather[11], GatherRecvError::Os(_)));
        assert!(matches!(gather[13], GatherRecvError::Transport { .. }));
        assert!(matches!(
            &gather[15],
            GatherRecvError::WriterDied { writer: 1, name, .. } if name == "w1"
        ));
        assert!(matches!(
            &gather[16],
            GatherRecvError::Ended { ended, died } if ended == &["w0"] && died == &["w1"]
        ));
    }
}
