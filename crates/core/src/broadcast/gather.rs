//! [`Gather`]: many writers to one reader. Several single-writer queues (workers'
//! results back to a scheduler: one queue per worker, the scheduler its one local
//! reader) read as one stream, with one wait for all of them.
//!
//! Each writer keeps its own queue, so its messages keep their order and its death is
//! told apart from the others'. The reader takes the next message from whichever queue
//! has one (writers served in turns when several do), sleeping on every queue's doorbell
//! at once ([`wait_any`]: one `futex_waitv`, no thread per queue, no polling), or
//! awaiting them all through [`AsyncWaiter::shared`] ([`Gather::recv_async`]).
//!
//! - A writer that ends its queue normally ([`Writer::close`](super::Writer::close), the
//!   writer dropped, its process exiting normally) is no error: its last messages are
//!   received, then it is left out ([`Gather::ended`]). Once every writer has ended, a
//!   receive fails with [`QueueError::GatherEnded`].
//! - A writer that dies (killed, `_exit`, a crash) is reported after every message it
//!   sent: a receive fails with [`QueueError::GatherWriterDied`] naming it, it is left
//!   out ([`Gather::died`]), and the next receive goes on with the others. Found within
//!   about half a second, also while the others keep sending.
//!
//! This is Python's `shmq.Gather` (python/shmq/gather.py) for Rust, with writers named
//! by their index in the Gather (and a name of the caller's, for errors).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::async_wait::{AsyncWaiter, WaitReady, first_ready};
use super::queue::{AsyncStep, Canceller, Reader};
use super::wait_any::{MAX_TARGETS, ReadyTarget, WakeWord, wait_any, wake};
use super::{DequeueError, GatherRecvError, NewGatherError, QueueError};
use crate::error::{Error, Result};
use crate::wait::deadline_after;
use shmq_protocol::sync::local::{AtomicBool, Ordering};

/// How often a busy Gather looks at its writers' liveness (a wait looks on its own), as
/// a queue's own wait does.
const LIVENESS_INTERVAL: Duration = Duration::from_millis(500);

/// Messages from several writers, each on its own queue, read as one stream (see the
/// module docs).
///
/// ```
/// use std::time::Duration;
/// use shmq_core::broadcast::Gather;
/// use shmq_core::{QueueOptions, Reader, Writer};
///
/// // Two workers' result queues (each made by its worker, in its own process, in real use).
/// let mut writers: Vec<Writer> = (0..2)
///     .map(|_| Writer::new(QueueOptions::local(1)))
///     .collect::<Result<_, _>>()?;
/// let readers = writers
///     .iter()
///     .enumerate()
///     .map(|(i, w)| Ok((format!("worker {i}"), Reader::open(w.handle(), 0)?)))
///     .collect::<shmq_core::Result<Vec<_>>>()?;
/// let mut gather = Gather::new(readers)?;
/// gather.wait_until_ready(Some(Duration::from_secs(10)))?;
/// std::thread::scope(|s| {
///     for (i, w) in writers.iter_mut().enumerate() {
///         s.spawn(move || {
///             w.wait_until_ready(Duration::from_secs(10))?;
///             w.enqueue(format!("result of {i}").as_bytes(), Duration::from_secs(10))?;
///             w.close(); // this worker is done
///             Ok::<(), shmq_core::Error>(())
///         });
///     }
///     let mut got = Vec::new();
///     loop {
///         match gather.recv_timeout(Duration::from_secs(10)) {
///             Ok((writer, bytes)) => got.push((writer, bytes)),
///             Err(shmq_core::broadcast::GatherRecvError::Ended { .. }) => break,
///             Err(e) => return Err(shmq_core::Error::from(e)),
///         }
///     }
///     got.sort();
///     assert_eq!(got, [(0, b"result of 0".to_vec()), (1, b"result of 1".to_vec())]);
///     let mut ended = gather.ended().to_vec(); // in the order the writers ended
///     ended.sort();
///     assert_eq!(ended, [0, 1]);
///     Ok(())
/// })?;
/// # Ok::<(), shmq_core::Error>(())
/// ```
pub struct Gather {
    sources: Vec<Source>,
    /// The writers still sending, in turn order.
    live: Vec<usize>,
    ended: Vec<usize>,
    died: Vec<usize>,
    /// Where the next round over `live` starts (the one after the last served).
    turn: usize,
    /// Ends a blocking receive's wait (see [`GatherCanceller::cancel`]).
    wake: Arc<WakeWord>,
    shut: Arc<AtomicBool>,
    next_liveness: Instant,
}

struct Source {
    name: String,
    reader: Reader,
}

/// What one round over the live writers found.
enum Round<R> {
    Taken(R),
    /// This writer's next message is larger than a chunk and still on its way over its
    /// queue's socket: take it with a receive that waits.
    InFlight(usize),
    Nothing,
}

/// Ends a [`Gather`]'s receives from any thread (see [`cancel`](Self::cancel)). Cheap
/// to clone; needs no lock on the Gather.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use shmq_core::broadcast::{Gather, GatherRecvError};
/// use shmq_core::{QueueOptions, Reader, Writer};
///
/// let mut writer = Writer::new(QueueOptions::local(1))?;
/// let reader = Reader::open(writer.handle(), 0)?;
/// let mut gather = Gather::new([("worker 0", reader)])?;
/// assert_eq!((gather.len(), gather.name(0), gather.live()), (1, "worker 0", &[0][..]));
/// let canceller = gather.canceller(); // to a worker monitor, say
/// std::thread::scope(|s| {
///     s.spawn(|| {
///         std::thread::sleep(Duration::from_millis(20));
///         canceller.cancel(); // wakes the receive blocked below
///     });
///     assert!(matches!(gather.recv(), Err(GatherRecvError::Cancelled)));
/// });
/// assert!(canceller.is_cancelled());
/// gather.close(); // its reader leaves the queue; the writer goes on without it
/// writer.close();
/// # Ok::<(), shmq_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct GatherCanceller {
    shut: Arc<AtomicBool>,
    readers: Vec<Canceller>,
    wake: Arc<WakeWord>,
}

impl GatherCanceller {
    /// Wake the Gather's receive blocked in this process (a blocking one in another
    /// thread, or an awaited one) with [`Error::Cancelled`], the error of a reader's
    /// [`Reader::shutdown`]; every later receive fails so too. Safe from any thread and
    /// more than once. The writers are not told: each queue is cancelled on this side
    /// only.
    ///
    /// # Examples
    ///
    /// See [the type's example](GatherCanceller).
    pub fn cancel(&self) {
        // Relaxed: a receive reads the wake word (Acquire) before it looks at this flag;
        // the Release bump in `wake` below orders this store before it, and a receive
        // that read the word before the bump sleeps on its old value, which the bump
        // changes (see `shmq_protocol::multiwait`).
        self.shut.store(true, Ordering::Relaxed);
        for c in &self.readers {
            // Ends a blocking dequeue of a message on its way, and makes each reader's
            // target ready (an awaited receive's wake-up).
            c.cancel();
        }
        wake(&self.wake);
    }

    /// Whether [`cancel`](Self::cancel) was called.
    ///
    /// # Examples
    ///
    /// See [the type's example](GatherCanceller).
    pub fn is_cancelled(&self) -> bool {
        // Relaxed: as in `cancel`.
        self.shut.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for Gather {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = |ids: &[usize]| -> Vec<&str> {
            ids.iter().map(|&i| self.sources[i].name.as_str()).collect()
        };
        f.debug_struct("Gather")
            .field("live", &names(&self.live))
            .field("ended", &names(&self.ended))
            .field("died", &names(&self.died))
            .finish()
    }
}

impl Gather {
    /// A Gather of `readers`: each a local reader (opened with a rank in its handle's
    /// local ranks) of its own writer's queue, with a name for errors. At least one, at
    /// most [`MAX_TARGETS`] (127), names distinct. Writer `i` of the results is the
    /// `i`-th reader given. On an error the readers are dropped (each leaves its queue).
    ///
    /// # Errors
    ///
    /// [`NewGatherError`], its text saying which: no reader given, more than 127, a name
    /// given twice, or a reader that is not local (a remote reader's queue cannot be
    /// waited for with the others).
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn new<S: Into<String>>(
        readers: impl IntoIterator<Item = (S, Reader)>,
    ) -> Result<Gather, NewGatherError> {
        Gather::new_core(readers).map_err(|e| match e {
            Error::InvalidArgument(reason) => NewGatherError { reason },
            e => NewGatherError {
                reason: e.to_string(),
            },
        })
    }

    /// [`new`](Self::new) with the crate's error.
    fn new_core<S: Into<String>>(readers: impl IntoIterator<Item = (S, Reader)>) -> Result<Gather> {
        let sources: Vec<Source> = readers
            .into_iter()
            .map(|(name, reader)| Source {
                name: name.into(),
                reader,
            })
            .collect();
        if sources.is_empty() {
            return Err(Error::InvalidArgument(
                "a Gather needs at least one queue".into(),
            ));
        }
        if sources.len() > MAX_TARGETS {
            return Err(Error::InvalidArgument(format!(
                "a Gather reads at most {MAX_TARGETS} queues, got {}",
                sources.len()
            )));
        }
        for (i, s) in sources.iter().enumerate() {
            if sources[..i].iter().any(|o| o.name == s.name) {
                return Err(Error::InvalidArgument(format!(
                    "a Gather's queues need distinct names, {:?} is given twice",
                    s.name
                )));
            }
            if !s.reader.is_local() {
                return Err(Error::InvalidArgument(format!(
                    "queue {:?} is not a local reader: a Gather reads queues on this machine \
                     (Reader::open with a rank among the handle's local ranks)",
                    s.name
                )));
            }
        }
        let readers = sources.iter().map(|s| s.reader.canceller()).collect();
        let (wake, shut) = (Arc::new(WakeWord::default()), Arc::default());
        let canceller = GatherCanceller {
            shut: Arc::clone(&shut),
            readers,
            wake: Arc::clone(&wake),
        };
        // A reader already shut down makes the Gather so (its receives would fail).
        if sources.iter().any(|s| s.reader.canceller().is_cancelled()) {
            canceller.cancel();
        }
        Ok(Gather {
            live: (0..sources.len()).collect(),
            sources,
            ended: Vec::new(),
            died: Vec::new(),
            turn: 0,
            wake,
            shut,
            next_liveness: Instant::now() + LIVENESS_INTERVAL,
        })
    }

    /// How many writers the Gather was made with.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn len(&self) -> usize {
        self.sources.len()
    }

    /// Always false: a Gather has at least one writer.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// Writer `writer`'s name. Panics if there is no such writer.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn name(&self, writer: usize) -> &str {
        &self.sources[writer].name
    }

    /// Writer `writer`'s queue (its reader). Panics if there is no such writer.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn reader(&self, writer: usize) -> &Reader {
        &self.sources[writer].reader
    }

    /// The writers still sending, in the order they are served next.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn live(&self) -> &[usize] {
        &self.live
    }

    /// The writers that ended their queue normally, in the order they were found so.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn ended(&self) -> &[usize] {
        &self.ended
    }

    /// The writers that died, in the order they were reported.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn died(&self) -> &[usize] {
        &self.died
    }

    /// Each queue's [`Reader::wait_until_ready`] (each writer calls its own).
    ///
    /// # Errors
    ///
    /// The first queue's [`DequeueError`] (see [`Reader::wait_until_ready`]):
    /// [`Timeout`](DequeueError::Timeout) when a writer has not subscribed its reader
    /// within `timeout` (each queue waits up to `timeout`),
    /// [`WriterDied`](DequeueError::WriterDied) for a writer that died first,
    /// [`Cancelled`](DequeueError::Cancelled) for a reader shut down.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn wait_until_ready(&mut self, timeout: Option<Duration>) -> Result<(), DequeueError> {
        for s in &mut self.sources {
            s.reader.wait_until_ready(timeout)?;
        }
        Ok(())
    }

    /// What ends this Gather's receives from another thread (see
    /// [`GatherCanceller::cancel`]): give it to a worker monitor, so that a worker's
    /// failure wakes the wait for results.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn canceller(&self) -> GatherCanceller {
        GatherCanceller {
            shut: Arc::clone(&self.shut),
            readers: self.sources.iter().map(|s| s.reader.canceller()).collect(),
            wake: Arc::clone(&self.wake),
        }
    }

    /// [`GatherCanceller::cancel`] from the Gather's own thread: every later receive
    /// fails with [`Error::Cancelled`].
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn shutdown(&self) {
        self.canceller().cancel();
    }

    /// Shut the Gather down and let go of its readers: each leaves its queue (its writer
    /// goes on without it, as after a reader's normal end, not a death).
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn close(self) {
        self.shutdown();
        drop(self);
    }

    /// The next message of any writer: `(writer, bytes)`, `writer` its index in the
    /// Gather. Each writer's messages come in the order it sent them; writers with
    /// messages are served in turns. Blocks until one comes (see the module docs for how
    /// a writer's end and death are told).
    ///
    /// # Errors
    ///
    /// A [`GatherRecvError`]: [`Ended`](GatherRecvError::Ended) once every
    /// writer has ended its queue; [`WriterDied`](GatherRecvError::WriterDied) for a
    /// writer that died (after its last message; the next receive goes on with the
    /// others); [`Cancelled`](GatherRecvError::Cancelled) once the Gather (or one of its
    /// readers) is shut down; [`WrongKind`](GatherRecvError::WrongKind) for a message
    /// of parts or an array (consumed); [`Os`](GatherRecvError::Os) for a segment broken
    /// by another process.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn recv(&mut self) -> Result<(usize, Vec<u8>), GatherRecvError> {
        self.recv_view(None, |w, b| (w, b.to_vec()))
    }

    /// [`recv`](Self::recv), failing with [`Error::Timeout`] after `timeout` without a
    /// message.
    ///
    /// # Errors
    ///
    /// A [`GatherRecvError`]: [`Timeout`](GatherRecvError::Timeout) after `timeout`
    /// without a message; [`Ended`](GatherRecvError::Ended) once every
    /// writer has ended its queue; [`WriterDied`](GatherRecvError::WriterDied) for a
    /// writer that died (after its last message; the next receive goes on with the
    /// others); [`Cancelled`](GatherRecvError::Cancelled) once the Gather (or one of its
    /// readers) is shut down; [`WrongKind`](GatherRecvError::WrongKind) for a message
    /// of parts or an array (consumed); [`Os`](GatherRecvError::Os) for a segment broken
    /// by another process.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<(usize, Vec<u8>), GatherRecvError> {
        self.recv_view(Some(timeout), |w, b| (w, b.to_vec()))
    }

    /// The next message of any writer, as [`recv`](Self::recv) (`timeout`: `None`
    /// waits for good), with `f` called on the writer's index and the message's bytes
    /// where they are, in shared memory: no copy (as [`Reader::dequeue_view`]). Raw
    /// bytes only: a message of several parts is an error naming it (consumed).
    ///
    /// # Errors
    ///
    /// A [`GatherRecvError`]: [`Timeout`](GatherRecvError::Timeout) after `timeout`
    /// without a message; [`Ended`](GatherRecvError::Ended) once every
    /// writer has ended its queue; [`WriterDied`](GatherRecvError::WriterDied) for a
    /// writer that died (after its last message; the next receive goes on with the
    /// others); [`Cancelled`](GatherRecvError::Cancelled) once the Gather (or one of its
    /// readers) is shut down; [`WrongKind`](GatherRecvError::WrongKind) for a message
    /// of parts or an array (consumed); [`Os`](GatherRecvError::Os) for a segment broken
    /// by another process.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub fn recv_view<R>(
        &mut self,
        timeout: Option<Duration>,
        f: impl FnOnce(usize, &[u8]) -> R,
    ) -> Result<R, GatherRecvError> {
        self.recv_view_core(timeout, f)
            .map_err(GatherRecvError::from_core)
    }

    /// [`recv_view`](Self::recv_view) with the crate's error.
    fn recv_view_core<R>(
        &mut self,
        timeout: Option<Duration>,
        f: impl FnOnce(usize, &[u8]) -> R,
    ) -> Result<R> {
        let start = Instant::now();
        let deadline = timeout.and_then(|t| deadline_after(start, t));
        let mut f = Some(f);
        loop {
            self.check_open()?;
            if self.live.is_empty() {
                return Err(self.all_ended());
            }
            self.look_at_writers()?;
            let round =
                self.round(&mut |r, w| r.take_now(|b| (f.take().expect("called once"))(w, b)))?;
            let remaining = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            match round {
                Round::Taken(r) => return Ok(r),
                Round::InFlight(w) => {
                    let f = f.take().expect("not called yet");
                    let got = self.sources[w].reader.dequeue_view(remaining, |b| f(w, b));
                    return got.map_err(|e| self.died_if_dead(w, e.into()));
                }
                Round::Nothing => {}
            }
            if self.live.is_empty() {
                continue;
            }
            if remaining == Some(Duration::ZERO) {
                return Err(Error::Timeout {
                    what: format!(
                        "a Gather receiving from writers {:?}",
                        self.names(&self.live)
                    ),
                    waited: start.elapsed(),
                });
            }
            let seen = self.wake.current();
            // A cancel before that read woke nobody: seen here.
            self.check_open()?;
            let ids = self.live.clone();
            let targets = self.targets(&ids);
            let refs: Vec<&ReadyTarget> = targets.iter().collect();
            let ready = wait_any(&refs, &self.wake, seen, remaining)?;
            self.check_dead(&ids, &targets, &ready)?;
        }
    }

    /// [`recv`](Self::recv), awaited (through [`AsyncWaiter::shared`], on any
    /// executor). No timeout of its own: put it under the runtime's
    /// (`tokio::time::timeout`). Cancel-safe: a future dropped before it completes has
    /// taken nothing, and the message is the next receive's.
    ///
    /// # Errors
    ///
    /// A [`GatherRecvError`]: [`Ended`](GatherRecvError::Ended) once every
    /// writer has ended its queue; [`WriterDied`](GatherRecvError::WriterDied) for a
    /// writer that died (after its last message; the next receive goes on with the
    /// others); [`Cancelled`](GatherRecvError::Cancelled) once the Gather (or one of its
    /// readers) is shut down; [`WrongKind`](GatherRecvError::WrongKind) for a message
    /// of parts or an array (consumed); [`Os`](GatherRecvError::Os) for a segment broken
    /// by another process.
    ///
    /// # Examples
    ///
    /// See [the type's example](Gather).
    pub async fn recv_async(&mut self) -> Result<(usize, Vec<u8>), GatherRecvError> {
        self.recv_async_core()
            .await
            .map_err(GatherRecvError::from_core)
    }

    /// [`recv_async`](Self::recv_async) with the crate's error.
    async fn recv_async_core(&mut self) -> Result<(usize, Vec<u8>)> {
        loop {
            self.check_open()?;
            if self.live.is_empty() {
                return Err(self.all_ended());
            }
            self.look_at_writers()?;
            match self.round(&mut |r, w| r.take_now(|b| (w, b.to_vec())))? {
                Round::Taken(r) => return Ok(r),
                Round::InFlight(w) => {
                    // Cancel-safe too: a dropped dequeue_async leaves the message.
                    let got = self.sources[w].reader.dequeue_async().await;
                    return got
                        .map(|b| (w, b))
                        .map_err(|e| self.died_if_dead(w, e.into()));
                }
                Round::Nothing => {}
            }
            if self.live.is_empty() {
                continue;
            }
            let ids = self.live.clone();
            let targets = self.targets(&ids);
            let mut waits: Vec<WaitReady<'static>> = targets
                .iter()
                .map(|t| AsyncWaiter::shared().ready(t.clone()))
                .collect();
            let ready = first_ready(&mut waits).await?;
            drop(waits);
            self.check_dead(&ids, &targets, &ready)?;
        }
    }

    fn check_open(&self) -> Result<()> {
        // Relaxed: see `GatherCanceller::cancel`.
        if self.shut.load(Ordering::Relaxed) {
            return Err(Error::Cancelled);
        }
        Ok(())
    }

    fn names(&self, ids: &[usize]) -> Vec<String> {
        ids.iter().map(|&i| self.sources[i].name.clone()).collect()
    }

    fn all_ended(&self) -> Error {
        Error::Queue(QueueError::GatherEnded {
            ended: self.names(&self.ended),
            died: self.names(&self.died),
        })
    }

    /// The ready targets of writers `ids` (local readers: checked when made).
    fn targets(&self, ids: &[usize]) -> Vec<ReadyTarget> {
        ids.iter()
            .map(|&i| ReadyTarget::of(&self.sources[i].reader).expect("a local reader"))
            .collect()
    }

    /// One round over the live writers, from the one after the last served: the first
    /// message `take` gets, or a writer whose next message is on its way. Writers found
    /// ended are left out.
    fn round<R>(
        &mut self,
        take: &mut impl FnMut(&mut Reader, usize) -> Result<Option<R>>,
    ) -> Result<Round<R>> {
        let mut k = 0;
        while k < self.live.len() {
            let i = (self.turn + k) % self.live.len();
            let w = self.live[i];
            let reader = &mut self.sources[w].reader;
            if !ReadyTarget::of(reader).is_some_and(|t| t.ready()) {
                k += 1;
                continue;
            }
            match reader.async_step(&mut |r| take(r, w)) {
                Ok(AsyncStep::Taken(r)) => {
                    self.turn = i + 1;
                    return Ok(Round::Taken(r));
                }
                // Not ready after all (a message another call took meanwhile).
                Ok(AsyncStep::Wait(_)) => k += 1,
                Ok(AsyncStep::Retry) => {
                    self.turn = i + 1;
                    return Ok(Round::InFlight(w));
                }
                Err(Error::Queue(QueueError::WriterShutDown { .. })) => {
                    self.live.remove(i);
                    self.ended.push(w);
                }
                Err(e) => {
                    // A message that could not be read is consumed: the next round
                    // starts after its writer, as after one taken.
                    self.turn = i + 1;
                    return Err(self.died_if_dead(w, e));
                }
            }
        }
        Ok(Round::Nothing)
    }

    /// `e`, or for a writer proved dead the Gather's report of it (the writer left out).
    fn died_if_dead(&mut self, writer: usize, e: Error) -> Error {
        match e {
            e @ Error::Queue(QueueError::DeadWriter { .. }) => self.dead(writer, e),
            e => e,
        }
    }

    /// Leave out `writer`, which died of `cause`; the error that says so.
    fn dead(&mut self, writer: usize, cause: Error) -> Error {
        self.live.retain(|&w| w != writer);
        if !self.died.contains(&writer) {
            self.died.push(writer);
        }
        Error::Queue(QueueError::GatherWriterDied {
            writer,
            name: self.sources[writer].name.clone(),
            cause: Box::new(cause),
        })
    }

    /// After a wait: the report of the first writer among `ready` (indices into `ids`
    /// and `targets`) proved dead with nothing left to read.
    fn check_dead(
        &mut self,
        ids: &[usize],
        targets: &[ReadyTarget],
        ready: &[usize],
    ) -> Result<()> {
        for &i in ready {
            if !targets[i].ready() {
                match targets[i].check_writer() {
                    Err(e @ Error::Queue(QueueError::DeadWriter { .. })) => {
                        return Err(self.dead(ids[i], e));
                    }
                    Err(e) => return Err(e),
                    Ok(()) => {}
                }
            }
        }
        Ok(())
    }

    /// Twice a second at most, while messages keep coming (a wait looks on its own):
    /// report a writer proved dead with nothing left to read, so that a busy stream from
    /// the others does not hide a death.
    fn look_at_writers(&mut self) -> Result<()> {
        let now = Instant::now();
        if now < self.next_liveness {
            return Ok(());
        }
        self.next_liveness = now + LIVENESS_INTERVAL;
        let ids = self.live.clone();
        let targets = self.targets(&ids);
        let all: Vec<usize> = (0..ids.len()).collect();
        self.check_dead(&ids, &targets, &all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broadcast::{QueueOptions, Writer};

    const BOUND: Duration = Duration::from_secs(20);

    fn queue() -> (Writer, Reader) {
        let w = Writer::new(QueueOptions {
            max_chunk_bytes: 64,
            max_chunks: 4,
            ..QueueOptions::local(1)
        })
        .unwrap();
        let r = Reader::open(w.handle(), 0).unwrap();
        (w, r)
    }

    #[test]
    fn the_arguments_are_checked() {
        let none: Vec<(String, Reader)> = Vec::new();
        let e = Gather::new(none).unwrap_err();
        assert_eq!(e.to_string(), "a Gather needs at least one queue");
        let (_w1, r1) = queue();
        let (_w2, r2) = queue();
        let twice = Gather::new([("a", r1), ("a", r2)]);
        assert!(matches!(twice, Err(NewGatherError { reason }) if reason.contains("\"a\"")));
    }

    #[test]
    fn ends_times_out_and_is_shut_down_from_another_thread() {
        let (mut queues, readers): (Vec<Writer>, Vec<(String, Reader)>) = (0..3)
            .map(|i| {
                let (w, r) = queue();
                (w, (format!("w{i}"), r))
            })
            .unzip();
        let mut gather = Gather::new(readers).unwrap();
        std::thread::scope(|s| {
            for w in queues.iter_mut() {
                s.spawn(|| w.wait_until_ready(BOUND).unwrap());
            }
            gather.wait_until_ready(Some(BOUND)).unwrap();
        });
        assert!(matches!(
            gather.recv_timeout(Duration::from_millis(20)),
            Err(GatherRecvError::Timeout { .. })
        ));
        // In turns: writer 0's, then writer 2's first (the round goes on after writer 0),
        // then writer 2's second.
        queues[2].enqueue(b"2a", BOUND).unwrap();
        queues[2].enqueue(b"2b", BOUND).unwrap();
        queues[0].enqueue(b"0a", BOUND).unwrap();
        let got: Vec<(usize, Vec<u8>)> = (0..3).map(|_| gather.recv().unwrap()).collect();
        assert_eq!(
            got,
            [
                (0, b"0a".to_vec()),
                (2, b"2a".to_vec()),
                (2, b"2b".to_vec())
            ]
        );
        // Writer 1 ends its queue: left out, not an error.
        queues[1].close();
        assert!(matches!(
            gather.recv_timeout(Duration::from_millis(20)),
            Err(GatherRecvError::Timeout { .. })
        ));
        assert_eq!(gather.ended(), [1]);
        // A shutdown from another thread ends a blocked receive.
        let canceller = gather.canceller();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                canceller.cancel();
            });
            assert!(matches!(gather.recv(), Err(GatherRecvError::Cancelled)));
        });
        assert!(matches!(gather.recv(), Err(GatherRecvError::Cancelled)));
        gather.close();
    }
}
