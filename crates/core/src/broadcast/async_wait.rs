//! Async receiving with no runtime of its own: [`AsyncWaiter`] turns a
//! [`ReadyTarget`] into a future ([`WaitReady`]) that any executor (tokio, async-std,
//! smol, a hand-written `block_on`) can await, and [`Reader::dequeue_async`] and its
//! siblings build the queue's async receives on it.
//!
//! # How it waits
//! A future cannot sleep on a futex itself, and a queue's doorbell is a futex word in
//! shared memory, not a descriptor an event loop could poll. So the waiter keeps threads
//! of its own, in *shards*: each shard holds up to [`MAX_TARGETS`] waits and one thread
//! that sleeps in a single [`wait_any`] on all of them (one `futex_waitv` on their
//! rings' doorbells and the shard's own [`WakeWord`]), then wakes the
//! [`Waker`]s of the waits that became ready. More waits at once get
//! more shards. Nothing polls: the sleep ends when a writer publishes (or shuts down, or
//! is found dead, which [`wait_any`] looks at twice a second), and when a wait is added
//! to or dropped from the shard (the shard's wake word, bumped by whoever changed its
//! list: see `shmq_protocol::multiwait`).
//!
//! A shard's thread starts with its first wait and ends once it has none left (its
//! last future completed or dropped): no thread outlives the waits it serves, none is
//! left in an idle process, and the waiter installs nothing process-wide. (A future
//! leaked with `mem::forget` while pending keeps its shard's thread asleep, as a
//! leaked blocking call would keep its own thread.)
//!
//! # Cancel safety
//! The receives take a message only inside one `poll`, and return it from that same
//! `poll`: a future dropped before it completes (a `select!` branch not taken, a
//! `tokio::time::timeout` that fired) has taken nothing, and the message stays for the
//! reader's next call.
//!
//! # What is not async
//! A remote reader's messages come over its TCP stream, which no futex rings: its async
//! receives fail at once with [`Error::WrongRole`]; wait for it in a thread (a blocking
//! [`Reader::dequeue`] in `std::thread::spawn` or the runtime's `spawn_blocking`). A
//! local reader's message larger than a chunk comes over the queue's socket, sent before
//! its mark in the ring: when the mark is seen before the bytes are in, the future asks
//! to be polled again at once (it yields to the executor, never blocks it) until they
//! are, which takes microseconds; a writer that died or went away meanwhile ends it with
//! the blocking call's error.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use super::array::Array;
use super::queue::{AsyncStep, OwnedPart, Reader};
use super::wait_any::{MAX_TARGETS, ReadyTarget, WakeWord, wait_any, wake};
use crate::error::{DequeueError, Error, OsError, Result};

/// Turns [`ReadyTarget`]s into futures (see the module docs): waiter threads in shards
/// of up to [`MAX_TARGETS`] waits, each asleep in one [`wait_any`], that wake the
/// futures' wakers. [`AsyncWaiter::shared`] is the one the queue's async receives use;
/// a waiter of one's own ([`AsyncWaiter::new`]) keeps its waits on threads apart.
///
/// ```
/// use std::time::Duration;
/// use shmq_core::broadcast::{wait_any::ReadyTarget, AsyncWaiter};
/// use shmq_core::{QueueOptions, Reader, Writer};
/// # fn block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     struct Unpark(std::thread::Thread);
/// #     impl std::task::Wake for Unpark {
/// #         fn wake(self: std::sync::Arc<Self>) { self.0.unpark() }
/// #     }
/// #     let waker = std::sync::Arc::new(Unpark(std::thread::current())).into();
/// #     let mut cx = std::task::Context::from_waker(&waker);
/// #     let mut f = std::pin::pin!(f);
/// #     loop {
/// #         if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) { return out; }
/// #         std::thread::park();
/// #     }
/// # }
///
/// let mut writer = Writer::new(QueueOptions::local(1))?;
/// let mut reader = Reader::open(writer.handle(), 0)?;
/// reader.wait_until_ready(Duration::from_secs(10))?;
/// std::thread::scope(|s| {
///     s.spawn(|| {
///         writer.wait_until_ready(Duration::from_secs(10))?;
///         writer.enqueue(b"hello", Duration::from_secs(10))?;
///         Ok::<(), shmq_core::Error>(())
///     });
///     // Woken by the waiter's thread once the message is in; then taken at once.
///     let target = ReadyTarget::of(&reader).expect("a local reader");
///     block_on(AsyncWaiter::shared().ready(target))?;
///     assert_eq!(reader.try_take(|b| b.to_vec())?, b"hello");
///     Ok::<(), shmq_core::Error>(())
/// })?;
/// # Ok::<(), shmq_core::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct AsyncWaiter {
    /// Every shard made so far (a shard without waits has no thread; it is kept, to be
    /// used again: their number is the most waits ever pending at once, / 127).
    shards: Mutex<Vec<Arc<Shard>>>,
}

/// Up to [`MAX_TARGETS`] waits and the thread asleep on them.
#[derive(Debug, Default)]
struct Shard {
    /// Bumped (and woken) by whoever adds a wait to the shard or drops one, so that its
    /// thread looks at its list again.
    wake: WakeWord,
    state: Mutex<ShardState>,
}

#[derive(Debug, Default)]
struct ShardState {
    entries: HashMap<u64, Entry>,
    /// How many of `entries` are [`Entry::Waiting`]: what the thread sleeps on.
    waiting: usize,
    next_token: u64,
    /// Whether the shard's thread runs (it clears this, under the lock, as it ends).
    thread: bool,
}

#[derive(Debug)]
enum Entry {
    /// Watched by the shard's thread; `waker` is woken when `target` is ready.
    Waiting { target: ReadyTarget, waker: Waker },
    /// Ready (or its writer proved dead): the future completes at its next poll.
    Done,
    /// The shard's wait failed (a kernel without `futex_waitv`): the future's error.
    Failed(Error),
}

/// A lock that a panic elsewhere does not make unusable: every update under these locks
/// is a single insert, remove or counter change, complete before anything can panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl AsyncWaiter {
    /// A waiter with no waits and no threads yet.
    pub const fn new() -> AsyncWaiter {
        AsyncWaiter {
            shards: Mutex::new(Vec::new()),
        }
    }

    /// The waiter of this process that [`Reader::dequeue_async`] and
    /// [`Gather::recv_async`](super::Gather::recv_async) use. It has threads only while
    /// futures wait in it.
    pub fn shared() -> &'static AsyncWaiter {
        static SHARED: AsyncWaiter = AsyncWaiter::new();
        &SHARED
    }

    /// A future that completes once `target` is ready ([`ReadyTarget::ready`]) or its
    /// writer is proved dead: then the reader's next call returns at once (take the
    /// message with [`Reader::try_take`], or see the error with
    /// [`ReadyTarget::check_writer`]). It registers with a shard when first polled and
    /// leaves it when it completes or is dropped. Its error: the shard's wait failed
    /// ([`OsError::Os`] of kind `Unsupported` on a kernel without `futex_waitv`, or a
    /// thread that could not be started).
    pub fn ready(&self, target: ReadyTarget) -> WaitReady<'_> {
        WaitReady {
            waiter: self,
            target: Some(target),
            registered: None,
        }
    }

    /// How many waiter threads run now (each ends with the last wait of its shard).
    pub fn threads(&self) -> usize {
        lock(&self.shards)
            .iter()
            .filter(|s| lock(&s.state).thread)
            .count()
    }

    /// Add a wait for `target` to a shard with room (a new one if none has), starting
    /// its thread if it has none; `waker` is woken when it is ready.
    fn register(&self, target: ReadyTarget, waker: Waker) -> Result<(Arc<Shard>, u64)> {
        let mut shards = lock(&self.shards);
        let shard = match shards.iter().find(|s| lock(&s.state).waiting < MAX_TARGETS) {
            Some(s) => s.clone(),
            None => {
                let s = Arc::new(Shard::default());
                shards.push(s.clone());
                s
            }
        };
        drop(shards);
        let mut state = lock(&shard.state);
        if state.waiting >= MAX_TARGETS {
            // Filled by another registration since we looked: try again.
            drop(state);
            return self.register(target, waker);
        }
        let token = state.next_token;
        state.next_token += 1;
        state
            .entries
            .insert(token, Entry::Waiting { target, waker });
        state.waiting += 1;
        if !state.thread {
            let for_thread = shard.clone();
            let spawned = std::thread::Builder::new()
                .name("shmq-async-waiter".into())
                .spawn(move || run_shard(&for_thread));
            if let Err(e) = spawned {
                state.entries.remove(&token);
                state.waiting -= 1;
                return Err(Error::Os(OsError::Os {
                    context: "starting a thread to wait for queues (shmq's async waiter)".into(),
                    source: e,
                }));
            }
            state.thread = true;
        }
        drop(state);
        // The thread may be asleep on the list it read before this insert.
        wake(&shard.wake);
        Ok((shard, token))
    }
}

/// A shard's thread: sleep on the shard's waits until some are ready, wake their
/// futures, and go again; end once no wait is left.
fn run_shard(shard: &Shard) {
    loop {
        // Read before the list: a wait added or dropped after this read bumps the word,
        // and the sleep below returns at once (see `shmq_protocol::multiwait`).
        let seen = shard.wake.current();
        let watched: Vec<(u64, ReadyTarget)> = {
            let mut state = lock(&shard.state);
            if state.waiting == 0 {
                state.thread = false;
                return;
            }
            state
                .entries
                .iter()
                .filter_map(|(&token, e)| match e {
                    Entry::Waiting { target, .. } => Some((token, target.clone())),
                    _ => None,
                })
                .collect()
        };
        let targets: Vec<&ReadyTarget> = watched.iter().map(|(_, t)| t).collect();
        let outcome = wait_any(&targets, &shard.wake, seen, None);
        let mut wakers = Vec::new();
        {
            let mut state = lock(&shard.state);
            match &outcome {
                Ok(ready) => {
                    for &i in ready {
                        let entry = state.entries.get_mut(&watched[i].0);
                        if let Some(e @ Entry::Waiting { .. }) = entry {
                            if let Entry::Waiting { waker, .. } = std::mem::replace(e, Entry::Done)
                            {
                                wakers.push(waker);
                            }
                            state.waiting -= 1;
                        }
                    }
                }
                Err(err) => {
                    for e in state.entries.values_mut() {
                        if matches!(e, Entry::Waiting { .. }) {
                            if let Entry::Waiting { waker, .. } =
                                std::mem::replace(e, Entry::Failed(copy_error(err)))
                            {
                                wakers.push(waker);
                            }
                        }
                    }
                    state.waiting = 0;
                    state.thread = false;
                }
            }
        }
        // Outside the lock: a waker may poll its future at once, which takes it.
        for w in wakers {
            w.wake();
        }
        if outcome.is_err() {
            return;
        }
    }
}

/// `err` again, for each future of a shard whose wait failed (errors are not `Clone`):
/// the operating system's error keeps its kind and text, anything else its text.
fn copy_error(err: &Error) -> Error {
    match err {
        Error::Os(OsError::Os { context, source }) => Error::Os(OsError::Os {
            context: context.clone(),
            source: std::io::Error::new(source.kind(), source.to_string()),
        }),
        other => Error::InvalidArgument(other.to_string()),
    }
}

/// The future of [`AsyncWaiter::ready`]: `Ok(())` once its target is ready or its
/// writer is proved dead. Dropping it before then withdraws the wait.
#[derive(Debug)]
#[must_use = "a future does nothing unless awaited"]
pub struct WaitReady<'a> {
    waiter: &'a AsyncWaiter,
    /// Until registered.
    target: Option<ReadyTarget>,
    registered: Option<(Arc<Shard>, u64)>,
}

impl Future for WaitReady<'_> {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        if let Some((shard, token)) = &this.registered {
            let mut state = lock(&shard.state);
            let outcome = match state.entries.get_mut(token) {
                Some(Entry::Waiting { waker, .. }) => {
                    if !waker.will_wake(cx.waker()) {
                        waker.clone_from(cx.waker());
                    }
                    return Poll::Pending;
                }
                Some(Entry::Done) | None => Ok(()),
                Some(Entry::Failed(_)) => match state.entries.remove(token) {
                    Some(Entry::Failed(e)) => Err(e),
                    _ => unreachable!("looked at under the same lock"),
                },
            };
            state.entries.remove(token);
            drop(state);
            this.registered = None;
            return Poll::Ready(outcome);
        }
        let Some(target) = this.target.take() else {
            // Polled again after it completed.
            return Poll::Ready(Ok(()));
        };
        if target.ready() {
            return Poll::Ready(Ok(()));
        }
        match this.waiter.register(target, cx.waker().clone()) {
            Ok(registered) => {
                this.registered = Some(registered);
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl Drop for WaitReady<'_> {
    fn drop(&mut self) {
        if let Some((shard, token)) = self.registered.take() {
            let mut state = lock(&shard.state);
            if let Some(Entry::Waiting { .. }) = state.entries.remove(&token) {
                state.waiting -= 1;
                drop(state);
                // Its thread sleeps on this target still: let it look again (and end,
                // if this was its last wait).
                wake(&shard.wake);
            }
        }
    }
}

/// Return `Pending` once, asking to be polled again at once: lets the executor run its
/// other tasks before the next look.
struct YieldNow(bool);

impl Future for YieldNow {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// The indices of `futures` that completed, once one has (their errors first: the first
/// error is returned). The ones still pending are dropped with the vector by the caller.
pub(crate) async fn first_ready(futures: &mut [WaitReady<'_>]) -> Result<Vec<usize>> {
    let mut done = vec![false; futures.len()];
    std::future::poll_fn(|cx| {
        let mut any = false;
        for (i, f) in futures.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            if let Poll::Ready(r) = Pin::new(f).poll(cx) {
                r?;
                done[i] = true;
                any = true;
            }
        }
        if any {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    })
    .await
    .map(|()| (0..done.len()).filter(|&i| done[i]).collect())
}

/// Async receives of a local reader (see the module docs): each is the blocking call of
/// the same name without a timeout (put the future under the runtime's own, such as
/// `tokio::time::timeout`), awaiting [`AsyncWaiter::shared`] instead of sleeping. Each
/// is cancel-safe: a future dropped before it completes has taken nothing. A remote
/// reader's fail at once with [`Error::WrongRole`] (wait for it in a thread).
impl Reader {
    /// Loop over the reader's async steps until `take` gets a message.
    async fn receive_async<R>(
        &mut self,
        mut take: impl FnMut(&mut Reader) -> Result<Option<R>>,
    ) -> Result<R, DequeueError> {
        self.receive_async_core(&mut take)
            .await
            .map_err(DequeueError::from_core)
    }

    /// [`receive_async`](Self::receive_async) with the crate's error.
    async fn receive_async_core<R>(
        &mut self,
        take: &mut impl FnMut(&mut Reader) -> Result<Option<R>>,
    ) -> Result<R> {
        loop {
            match self.async_step(take)? {
                AsyncStep::Taken(r) => return Ok(r),
                AsyncStep::Wait(target) => AsyncWaiter::shared().ready(target).await?,
                AsyncStep::Retry => YieldNow(false).await,
            }
        }
    }

    /// [`dequeue`](Self::dequeue), awaited: the next message, copied. Cancel-safe.
    ///
    /// # Errors
    ///
    /// As [`dequeue`](Self::dequeue) (a [`DequeueError`]), but never its timeout (the
    /// runtime's own ends the wait): [`Cancelled`](DequeueError::Cancelled) once the
    /// reader is shut down, [`WriterShutDown`](DequeueError::WriterShutDown) after the
    /// writer's last message, [`WriterDied`](DequeueError::WriterDied),
    /// [`MessageLost`](DequeueError::MessageLost), [`Os`](DequeueError::Os) for a segment
    /// broken by another process; [`WrongRole`](DequeueError::WrongRole) for a remote
    /// reader (wait for it in a thread); [`WrongKind`](DequeueError::WrongKind) for a message of
    /// parts or an array (consumed).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use shmq_core::{QueueOptions, Reader, Writer};
    /// # fn block_on<F: std::future::Future>(f: F) -> F::Output {
    /// #     struct Unpark(std::thread::Thread);
    /// #     impl std::task::Wake for Unpark {
    /// #         fn wake(self: std::sync::Arc<Self>) { self.0.unpark() }
    /// #     }
    /// #     let waker = std::sync::Arc::new(Unpark(std::thread::current())).into();
    /// #     let mut cx = std::task::Context::from_waker(&waker);
    /// #     let mut f = std::pin::pin!(f);
    /// #     loop {
    /// #         if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) { return out; }
    /// #         std::thread::park();
    /// #     }
    /// # }
    /// let mut writer = Writer::new(QueueOptions::local(1))?;
    /// let mut reader = Reader::open(writer.handle(), 0)?;
    /// reader.wait_until_ready(Duration::from_secs(10))?;
    /// std::thread::scope(|s| {
    ///     s.spawn(|| {
    ///         writer.wait_until_ready(Duration::from_secs(10))?;
    ///         writer.enqueue(b"step 1", Duration::from_secs(10))?;
    ///         Ok::<(), shmq_core::Error>(())
    ///     });
    ///     // Any executor: tokio's `reader.dequeue_async().await` in a task is the same.
    ///     assert_eq!(block_on(reader.dequeue_async())?, b"step 1");
    ///     Ok::<(), shmq_core::Error>(())
    /// })?;
    /// # Ok::<(), shmq_core::Error>(())
    /// ```
    pub async fn dequeue_async(&mut self) -> Result<Vec<u8>, DequeueError> {
        self.receive_async(|r| r.take_now(|b| b.to_vec())).await
    }

    /// [`dequeue_view`](Self::dequeue_view), awaited: `f` is called on the message's
    /// bytes where they are, in shared memory (within the poll that takes it).
    /// Cancel-safe: `f` is called only for the message taken.
    ///
    /// # Errors
    ///
    /// As [`dequeue`](Self::dequeue) (a [`DequeueError`]), but never its timeout (the
    /// runtime's own ends the wait): [`Cancelled`](DequeueError::Cancelled) once the
    /// reader is shut down, [`WriterShutDown`](DequeueError::WriterShutDown) after the
    /// writer's last message, [`WriterDied`](DequeueError::WriterDied),
    /// [`MessageLost`](DequeueError::MessageLost), [`Os`](DequeueError::Os) for a segment
    /// broken by another process; [`WrongRole`](DequeueError::WrongRole) for a remote
    /// reader (wait for it in a thread); [`WrongKind`](DequeueError::WrongKind) for a message of
    /// parts or an array (consumed).
    ///
    /// See [`dequeue_async`](Self::dequeue_async)'s example.
    pub async fn dequeue_view_async<R>(
        &mut self,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, DequeueError> {
        let mut f = Some(f);
        self.receive_async(|r| r.take_now(|b| (f.take().expect("called once"))(b)))
            .await
    }

    /// [`dequeue_parts`](Self::dequeue_parts), awaited. Cancel-safe.
    ///
    /// # Errors
    ///
    /// As [`dequeue`](Self::dequeue) (a [`DequeueError`]), but never its timeout (the
    /// runtime's own ends the wait): [`Cancelled`](DequeueError::Cancelled) once the
    /// reader is shut down, [`WriterShutDown`](DequeueError::WriterShutDown) after the
    /// writer's last message, [`WriterDied`](DequeueError::WriterDied),
    /// [`MessageLost`](DequeueError::MessageLost), [`Os`](DequeueError::Os) for a segment
    /// broken by another process; [`WrongRole`](DequeueError::WrongRole) for a remote
    /// reader (wait for it in a thread); [`WrongKind`](DequeueError::WrongKind) for an array
    /// (consumed).
    ///
    /// See [`dequeue_async`](Self::dequeue_async)'s example.
    pub async fn dequeue_parts_async(&mut self) -> Result<Vec<OwnedPart>, DequeueError> {
        self.receive_async(|r| r.take_message_now(super::queue::own_parts)?.transpose())
            .await
    }

    /// [`dequeue_array`](Self::dequeue_array), awaited. Cancel-safe.
    ///
    /// # Errors
    ///
    /// As [`dequeue`](Self::dequeue) (a [`DequeueError`]), but never its timeout (the
    /// runtime's own ends the wait): [`Cancelled`](DequeueError::Cancelled) once the
    /// reader is shut down, [`WriterShutDown`](DequeueError::WriterShutDown) after the
    /// writer's last message, [`WriterDied`](DequeueError::WriterDied),
    /// [`MessageLost`](DequeueError::MessageLost), [`Os`](DequeueError::Os) for a segment
    /// broken by another process; [`WrongRole`](DequeueError::WrongRole) for a remote
    /// reader (wait for it in a thread); [`WrongKind`](DequeueError::WrongKind) for a message
    /// that is not an array (consumed).
    ///
    /// See [`dequeue_async`](Self::dequeue_async)'s example.
    pub async fn dequeue_array_async(&mut self) -> Result<Array, DequeueError> {
        self.receive_async(|r| r.take_message_now(super::queue::own_array)?.transpose())
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broadcast::{QueueOptions, Writer};
    use std::time::Duration;

    const BOUND: Duration = Duration::from_secs(20);

    /// A minimal executor: poll, park until woken, poll again.
    fn block_on<F: Future>(f: F) -> F::Output {
        struct Unpark(std::thread::Thread);
        impl std::task::Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark()
            }
        }
        let waker = Arc::new(Unpark(std::thread::current())).into();
        let mut cx = Context::from_waker(&waker);
        let mut f = std::pin::pin!(f);
        loop {
            if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
                return out;
            }
            std::thread::park();
        }
    }

    /// Poll `f` once with a waker that does nothing.
    fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
        Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
    }

    fn queue() -> (Writer, Reader) {
        let w = Writer::new(QueueOptions {
            max_chunk_bytes: 64,
            max_chunks: 4,
            ..QueueOptions::local(1)
        })
        .unwrap();
        let mut r = Reader::open(w.handle(), 0).unwrap();
        r.wait_until_ready(BOUND).unwrap();
        (w, r)
    }

    /// Type-checked only: the futures can move to another thread (`tokio::spawn`).
    #[allow(dead_code)]
    fn the_futures_are_send(r: &mut Reader, g: &mut crate::broadcast::Gather) {
        fn send<T: Send>(_: T) {}
        send(r.dequeue_async());
        send(r.dequeue_view_async(|b| b.len()));
        send(r.dequeue_parts_async());
        send(r.dequeue_array_async());
        send(g.recv_async());
        send(AsyncWaiter::shared().ready(ReadyTarget::of(r).unwrap()));
    }

    #[test]
    fn a_dropped_wait_loses_no_message_and_the_thread_ends_with_the_last_wait() {
        let waiter = AsyncWaiter::new();
        let (mut w, mut r) = queue();
        std::thread::scope(|s| {
            s.spawn(|| w.wait_until_ready(BOUND).unwrap());
        });
        // A wait registered, then dropped before anything came: its thread goes.
        let mut pending = waiter.ready(ReadyTarget::of(&r).unwrap());
        assert!(poll_once(&mut pending).is_pending());
        assert_eq!(waiter.threads(), 1);
        drop(pending);
        let deadline = std::time::Instant::now() + BOUND;
        while waiter.threads() != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the thread did not end"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // A receive dropped while pending took nothing: the next one gets the message.
        let mut first = Box::pin(r.dequeue_async());
        assert!(poll_once(&mut first).is_pending());
        drop(first);
        w.enqueue(b"kept", BOUND).unwrap();
        assert_eq!(block_on(r.dequeue_async()).unwrap(), b"kept");
        // Woken from another thread, through the shared waiter.
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                w.enqueue(b"later", BOUND).unwrap();
            });
            assert_eq!(block_on(r.dequeue_async()).unwrap(), b"later");
        });
        // The writer's end, after its last message.
        w.enqueue(b"last", BOUND).unwrap();
        w.close();
        assert_eq!(block_on(r.dequeue_async()).unwrap(), b"last");
        assert!(matches!(
            block_on(r.dequeue_async()),
            Err(DequeueError::WriterShutDown { .. })
        ));
    }

    #[test]
    fn a_message_larger_than_a_chunk_is_awaited_and_a_remote_reader_is_refused() {
        let mut w = Writer::new(QueueOptions {
            n_reader: 2,
            n_local_reader: 1,
            max_chunk_bytes: 64,
            max_chunks: 2,
            connect_ip: Some("127.0.0.1".into()),
            ..Default::default()
        })
        .unwrap();
        let mut local = Reader::open(w.handle(), 0).unwrap();
        let mut remote = Reader::open(w.handle(), 1).unwrap();
        // Refused before it waits for anything: no futex rings for a TCP stream.
        assert!(matches!(
            block_on(remote.dequeue_async()),
            Err(DequeueError::WrongRole(m)) if m.contains("thread")
        ));
        std::thread::scope(|s| {
            s.spawn(|| remote.wait_until_ready(BOUND).unwrap());
            local.wait_until_ready(BOUND).unwrap();
            w.wait_until_ready(BOUND).unwrap();
        });
        // Over the queue's socket (the ring holds its mark), then one in a chunk.
        let big: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        w.enqueue(&big, BOUND).unwrap();
        w.enqueue(b"small", BOUND).unwrap();
        assert_eq!(block_on(local.dequeue_async()).unwrap(), big);
        assert_eq!(block_on(local.dequeue_async()).unwrap(), b"small");
        assert_eq!(remote.dequeue(BOUND).unwrap(), big);
        assert_eq!(remote.dequeue(BOUND).unwrap(), b"small");
    }

    #[test]
    fn more_waits_than_one_shard_takes_get_a_second_thread() {
        let waiter = AsyncWaiter::new();
        let queues: Vec<(Writer, Reader)> = (0..MAX_TARGETS + 3).map(|_| queue()).collect();
        let mut waits: Vec<WaitReady<'_>> = queues
            .iter()
            .map(|(_, r)| waiter.ready(ReadyTarget::of(r).unwrap()))
            .collect();
        for f in waits.iter_mut() {
            assert!(poll_once(f).is_pending());
        }
        assert_eq!(waiter.threads(), 2);
        // The last queue's reader is shut down: its wait (in the second shard) is ready.
        queues.last().unwrap().1.shutdown();
        let done = block_on(first_ready(&mut waits)).unwrap();
        assert_eq!(done, vec![MAX_TARGETS + 2]);
        drop(waits);
        let deadline = std::time::Instant::now() + BOUND;
        while waiter.threads() != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the threads did not end"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
