//! The relay: one copy of the stream per node. A [`Relay`] is an ordinary remote reader
//! of a queue (one rank of its writer's remote stream) and the ordinary writer of a queue
//! of its own on its machine, whose local readers read through shared memory: every
//! message crosses the network once per node, not once per reader.
//!
//! Messages pass through whole, as they came: raw bytes stay raw bytes, a message of
//! parts (a Python writer's pickled object and its out-of-band buffers) stays the same
//! parts, a typed array the same array; nothing is unpickled or decoded. The bytes are
//! copied once, from the ZeroMQ frames into the ring (or the tensor arena, for large
//! parts), where every local reader reads them without a copy.
//!
//! Each side sees the relay as what it is, so a death is a peer death on both sides:
//! - to the writer it is one remote reader: killed, its connection closes and the writer
//!   stops sending to it (with a warning naming its rank and host); stopped or cut off,
//!   ZeroMQ's heartbeats close the connection (see [`crate::remote`]);
//! - to its local readers it is their writer: killed, they get [`QueueError::DeadWriter`].
//!
//! What comes from upstream is passed on: a writer that shuts down
//! ([`QueueError::WriterShutDown`] after its last message) shuts the relay's queue down
//! after the same messages, so its readers end the same way; a writer that dies
//! ([`RemoteError::WriterGone`]) or drops the relay ([`RemoteError::ReaderDropped`]) ends
//! [`Relay::run`] with that error, and the relay's process must then die too (without
//! shutting its queue down) for the local readers to see a death: `python -m shmq relay`
//! exits at once. A local reader that dies ends `run` with [`QueueError::DeadReader`]
//! unless the local queue drops dead readers (`on_dead_reader`).
//!
//! [`RemoteError::WriterGone`]: crate::error::RemoteError::WriterGone
//! [`RemoteError::ReaderDropped`]: crate::error::RemoteError::ReaderDropped

use std::time::{Duration, Instant};

use crate::broadcast::{
    ArrayRef, Canceller, Handle, Message, QueueOptions, Reader, Received, Writer,
};
use crate::error::{DequeueError, Error, QueueError, Result};
use crate::wait::{Hook, WaitSpec};

/// How [`Relay::run`] ended without an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayEnd {
    /// The upstream writer shut its queue down: every message before it was passed on,
    /// and the relay's own queue is shut down after them.
    UpstreamShutDown,
    /// [`RelayStopper::stop`] (or the relay's [`close`](Relay::close)).
    Stopped,
}

/// Ends a relay's [`run`](Relay::run) from any thread, without its lock: both sides'
/// blocked calls end, and the relay's local queue is shut down.
#[derive(Clone, Debug)]
pub struct RelayStopper {
    upstream: Canceller,
    local: Canceller,
}

impl RelayStopper {
    /// End the relay's `run` and shut its local queue down (see [`RelayStopper`]).
    ///
    /// # Examples
    ///
    /// See [`Relay`'s example](Relay).
    pub fn stop(&self) {
        self.upstream.cancel();
        // The local readers learn it from the ring, with no lock on the writer needed.
        self.local.close_ring();
        self.local.cancel();
    }

    /// Whether [`stop`](Self::stop) was called (or either side was cancelled).
    ///
    /// # Examples
    ///
    /// See [`Relay`'s example](Relay).
    pub fn is_stopped(&self) -> bool {
        self.upstream.is_cancelled() || self.local.is_cancelled()
    }
}

/// A remote reader of one queue that writes every message, whole, into a queue of its
/// own for the readers on its machine (see the module docs).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use shmq_core::relay::{Relay, RelayEnd};
/// use shmq_core::{QueueOptions, Reader, Writer};
///
/// let t = Duration::from_secs(10);
/// // The upstream queue: its one reader, rank 0, is remote (on another node in real use).
/// let mut up = QueueOptions::local(1);
/// up.n_local_reader = 0;
/// up.connect_ip = Some("127.0.0.1".into());
/// let mut upstream = Writer::new(up)?;
/// // The relay reads rank 0 and writes a queue of its own for one local reader.
/// let mut relay = Relay::new(upstream.handle(), 0, QueueOptions::local(1))?;
/// assert_eq!(relay.rank(), 0);
/// let mut reader = Reader::open(relay.local().handle(), 0)?;
/// std::thread::scope(|s| {
///     let sender = s.spawn(|| -> shmq_core::Result<()> {
///         upstream.wait_until_ready(t)?;
///         upstream.enqueue(b"step 1", t)?;
///         upstream.close(); // the relay passes the end on after the message
///         Ok(())
///     });
///     let local = s.spawn(|| -> shmq_core::Result<Vec<u8>> {
///         reader.wait_until_ready(t)?;
///         Ok(reader.dequeue(t)?)
///     });
///     relay.wait_until_ready(Some(t), None)?;
///     assert!(matches!(relay.run(None)?, RelayEnd::UpstreamShutDown));
///     sender.join().expect("no panic")?;
///     assert_eq!(local.join().expect("no panic")?, b"step 1");
///     assert_eq!(relay.forwarded(), (1, 6));
///     Ok::<(), shmq_core::Error>(())
/// })?;
/// relay.close();
/// # Ok::<(), shmq_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Relay {
    upstream: Reader,
    local: Writer,
    stopper: RelayStopper,
    forwarded: u64,
    forwarded_bytes: u64,
    ended: bool,
}

impl Relay {
    /// Join the queue of `upstream` as its remote reader `rank` and make the local queue
    /// `local` (its readers: `local.n_local_reader`, their ranks
    /// `local.local_reader_ranks`). The sizes of the local ring are the caller's: a
    /// message larger than a chunk goes over the local overflow socket, as in any queue.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a `rank` that is a local reader of the upstream queue
    /// or out of range, or `local` options out of range; else as
    /// [`Reader::open`](crate::Reader::open) (upstream) and
    /// [`Writer::new`](crate::Writer::new) (the local queue).
    ///
    /// # Examples
    ///
    /// See [the type's example](Relay).
    pub fn new(upstream: &Handle, rank: usize, local: QueueOptions) -> Result<Relay> {
        if upstream.local_reader_ranks.contains(&rank) {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is a local reader of the upstream queue (local ranks {:?}): a \
                 relay is one of its remote readers, for a machine its ring does not reach",
                upstream.local_reader_ranks
            )));
        }
        if local.n_local_reader == 0 {
            return Err(Error::InvalidArgument(
                "a relay needs at least one local reader (n_local_reader)".into(),
            ));
        }
        let upstream = Reader::open(upstream, rank)?;
        let local = Writer::new(local)?;
        let stopper = RelayStopper {
            upstream: upstream.canceller(),
            local: local.canceller(),
        };
        Ok(Relay {
            upstream,
            local,
            stopper,
            forwarded: 0,
            forwarded_bytes: 0,
            ended: false,
        })
    }

    /// The handle of the relay's own queue, for its readers.
    ///
    /// # Examples
    ///
    /// See [the type's example](Relay).
    pub fn handle(&self) -> &Handle {
        self.local.handle()
    }

    /// The rank the relay reads as, upstream.
    ///
    /// # Examples
    ///
    /// See [the type's example](Relay).
    pub fn rank(&self) -> usize {
        self.upstream.rank()
    }

    /// What ends this relay's [`run`](Self::run) from another thread.
    ///
    /// # Examples
    ///
    /// See [the type's example](Relay).
    pub fn stopper(&self) -> RelayStopper {
        self.stopper.clone()
    }

    /// Messages passed on so far, and their bytes (all parts).
    ///
    /// # Examples
    ///
    /// See [the type's example](Relay).
    pub fn forwarded(&self) -> (u64, u64) {
        (self.forwarded, self.forwarded_bytes)
    }

    /// The relay's own queue (its ring, its arena, its metrics).
    ///
    /// # Examples
    ///
    /// See [the type's example](Relay).
    pub fn local(&self) -> &Writer {
        &self.local
    }

    /// Wait until the relay's local readers have joined, then until the upstream writer
    /// says start, all within `timeout` (the local readers first: they are on this
    /// machine and come up quickly, while the upstream writer may wait for other nodes).
    /// `hook` as in [`run`](Self::run).
    ///
    /// # Errors
    ///
    /// As the local writer's and the upstream reader's `wait_until_ready`:
    /// [`Error::Timeout`] when `timeout` passes first (naming who was waited for),
    /// [`QueueError::DeadWriter`] or a remote stream refused upstream,
    /// [`QueueError::DeadReader`] for a local reader that died first; `hook`'s error.
    ///
    /// # Examples
    ///
    /// See [the type's example](Relay).
    pub fn wait_until_ready(
        &mut self,
        timeout: Option<Duration>,
        mut hook: Option<&mut (dyn FnMut() -> Result<()> + Send)>,
    ) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let left = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
        self.local.wait_until_ready(WaitSpec {
            timeout: left(),
            hook: reborrow(&mut hook),
            ..Default::default()
        })?;
        Ok(self.upstream.wait_until_ready(WaitSpec {
            timeout: left(),
            hook: reborrow(&mut hook),
            ..Default::default()
        })?)
    }

    /// Pass messages on until the upstream writer shuts down, the relay is stopped, or
    /// `hook` (called every few milliseconds while no message is there: the Python
    /// binding checks signals in it) returns an error, which ends `run` with that error
    /// and can be followed by another `run` (nothing is lost: a message is taken from
    /// upstream only once it can be passed on). A wait for room in the local ring is not
    /// cut short by `hook` (a message taken must be passed on); it ends when a local
    /// reader takes a message or dies, or at [`RelayStopper::stop`].
    ///
    /// # Errors
    ///
    /// What a receive upstream or a send downstream fails with: the upstream writer died or
    /// its stream was refused ([`RemoteError`](crate::error::RemoteError)), a local reader
    /// died, `/dev/shm` full; `hook`'s error (other than [`Error::Cancelled`], which ends
    /// the run as [`RelayEnd::Stopped`]).
    ///
    /// # Examples
    ///
    /// See [the type's example](Relay).
    pub fn run(
        &mut self,
        mut hook: Option<&mut (dyn FnMut() -> Result<()> + Send)>,
    ) -> Result<RelayEnd> {
        if self.ended {
            return Ok(RelayEnd::UpstreamShutDown);
        }
        loop {
            if self.stopper.is_stopped() {
                self.local.close();
                return Ok(RelayEnd::Stopped);
            }
            let spec = WaitSpec {
                timeout: None,
                // An idle upstream is the normal state of a relay: no "still waiting".
                quiet: true,
                hook: reborrow(&mut hook),
                resume: None,
            };
            match self.upstream.wait_message(spec) {
                Ok(()) => {}
                Err(DequeueError::WriterShutDown { .. }) => {
                    self.ended = true;
                    self.local.close();
                    return Ok(RelayEnd::UpstreamShutDown);
                }
                Err(DequeueError::Cancelled) if self.stopper.is_stopped() => continue,
                Err(e) => return Err(e.into()),
            }
            let local = &mut self.local;
            let taken = self.upstream.take_message_now(|m| pass_on(local, m))?;
            match taken {
                Some(Ok(bytes)) => {
                    self.forwarded += 1;
                    self.forwarded_bytes += bytes as u64;
                }
                Some(Err(Error::Queue(QueueError::ShutDown) | Error::Cancelled))
                    if self.stopper.is_stopped() => {}
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
    }

    /// Shut the relay's queue down (its readers get [`QueueError::WriterShutDown`] after the
    /// messages passed on before) and leave the upstream stream.
    ///
    /// # Examples
    ///
    /// See [the type's example](Relay).
    pub fn close(&mut self) {
        self.stopper.stop();
        self.local.close();
    }
}

/// The caller's hook, lent to one wait.
fn reborrow<'b>(hook: &'b mut Option<&mut (dyn FnMut() -> Result<()> + Send)>) -> Option<Hook<'b>> {
    match hook {
        Some(h) => Some(&mut **h),
        None => None,
    }
}

/// Write message `m` into the local queue as it came; returns its size in bytes.
fn pass_on(local: &mut Writer, m: Received<'_>) -> Result<usize> {
    // No timeout: a message taken upstream must be passed on. The wait ends when a
    // local reader takes a chunk or dies (the writer's liveness checks), or at `stop`.
    let forever = || WaitSpec::from(None);
    match m {
        Received::Bytes(b) => Ok(local.enqueue(b, forever()).map(|()| b.len())?),
        Received::Parts(parts) => {
            let slices: Vec<&[u8]> = parts.iter().map(|p| &**p).collect();
            let bytes = slices.iter().map(|s| s.len()).sum();
            match slices.as_slice() {
                // A one-part message is sent as a body (the cheap chunk kind): readers
                // cannot tell it from one of parts (see `Message::Body`).
                [body] => local.enqueue(Message::Body(body), forever()),
                all => local.enqueue(Message::Parts(all), forever()),
            }?;
            Ok(bytes)
        }
        Received::Array { meta, data } => {
            // Exactly the bytes its elements reach (checked when received): a writer may
            // have sent more, which `ArrayRef` refuses for a contiguous array.
            let data = &data[..meta.span()?];
            local.enqueue(&ArrayRef::with_strides(meta, data)?, forever())?;
            Ok(data.len())
        }
    }
}
