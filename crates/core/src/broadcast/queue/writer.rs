//! The writing side of a queue ([`Writer`]): local readers through the ring (and the
//! tensor arena for large parts), messages too large for a chunk and remote readers
//! through ZeroMQ. Uses the ring's writer, the arena, the framing and the transport.
//!
//! The order of a send: every wait first (the remote readers' credit, then the ring's
//! next chunk: see `Wait::commit`), then the remote readers' message, then the local
//! readers' chunk. Remote first: a local reader's wake-up (the ring's doorbell) can take
//! the writer's core from it on a loaded machine (vLLM's executor and its worker on one
//! core), and the remote reader, whose message must still be sealed and cross the
//! network, would wait behind it; in a tensor-parallel step every reader's part is
//! needed, so the farthest one goes first. A send that fails after the remote readers
//! got the message (a socket error) leaves the acquired chunk unpublished: the next
//! send takes it again.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::super::array::ArrayRef;
use super::super::framing::{self, Format, PartRef};
use super::super::ring::{ChunkKind, MAX_READERS, PartCounter, Ring, RingWriter};
use super::{Canceller, Handle, QueueOptions, dead_local_reader, reader_is_dead};
use crate::arena::{self, ArenaRef, ArenaWriter, LazyArenaWriter, Loan};
use crate::error::{
    CreateError, EnqueueError, Error, OsError, QueueError, Result, WriteChunkError,
};
use crate::names::{self, NameClaim};
use crate::remote::{self, RemoteWriter};
use crate::transport::{Publisher, default_connect_ip};
use crate::wait::{Wait, WaitHistory, WaitPolicy, WaitSpec};
use shmq_os::fork::{self, LeakInChild};

/// What the writer's waits are for, in warnings and timeout errors.
const WAITING_FOR_SUBSCRIBERS: &str = "the writer waiting for every reader to subscribe";
const WAITING_FOR_A_CHUNK: &str = "the writer waiting for readers to free a chunk";
/// A writer without local readers has no chunks: it waits only for remote readers (a
/// timeout names the one it waited for: `RemoteWriter`'s `slow`).
const WAITING_FOR_REMOTE_READERS: &str =
    "the writer waiting for remote readers to take the messages sent to them";
/// How long shutting down may wait to tell remote readers (a full send queue); local
/// readers are told through the ring without waiting.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// For the writer's wait for subscribers (its warnings and its timeout): the queue by
/// the user's name, how many local readers subscribed, and which ranks have made their
/// reader (a reader subscribes when it is made, and never waits for the writer) and
/// which have not yet.
fn explain_subscribers(ring: &Ring, ranks: &[usize], subscribed: usize) -> String {
    let queue = format!("queue {}", ring.queue_words());
    let (mut made, mut missing) = (Vec::new(), Vec::new());
    for r in 0..ring.n_reader() {
        let rank = ranks.get(r).copied().unwrap_or(r);
        match ring.slot_info(Some(r)).ok().and_then(|i| i.process) {
            Some(p) => made.push(format!("rank {rank} (pid {})", p.pid)),
            None => missing.push(format!("rank {rank}")),
        }
    }
    let list = |v: &[String]| {
        if v.is_empty() {
            "none".to_owned()
        } else {
            v.join(", ")
        }
    };
    format!(
        "{queue}: {subscribed} of {} local readers subscribed; readers made: {}; not made yet: {} \
         (each is made by create_from_handle or MessageQueue.open in its own process)",
        ring.n_reader(),
        list(&made),
        list(&missing)
    )
}

/// Where each part of a message goes for local readers: the body and small parts inline,
/// parts inside a loan by reference, other large parts copied into the arena when it has
/// room (else inline: the fallback, counted by the arena). The arena is made here when
/// the first part that needs it comes.
fn place_parts(
    parts: &[&[u8]],
    mut arena: Option<&mut LazyArenaWriter>,
    threshold: usize,
    ring: &RingWriter,
) -> Vec<PartRef> {
    let mut at = framing::header_len(parts.len());
    let (mut loaned, mut copied, mut fallbacks) = (0, 0, 0);
    // The parts that lie in loans not sent before, all found before any is sealed (two
    // parts of one loan in one message are both references). Loans exist only once the
    // arena is made. A part smaller than `LOAN_SEAL_MIN` is copied instead: sealing its
    // loan would cost more than the copy.
    let in_loans: Vec<Option<ArenaRef>> = parts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let a = arena.as_deref().and_then(|lazy| lazy.get())?;
            (i > 0 && p.len() >= arena::LOAN_SEAL_MIN)
                .then(|| a.find_loan(p))
                .flatten()
        })
        .collect();
    let refs = parts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if i > 0 {
                if let Some(lazy) = arena.as_deref_mut() {
                    // Sealed now, before the message can be seen: a loan whose pages
                    // cannot be sealed (out of mappings) is still shared with the
                    // readers, so it is copied like any other part.
                    if let Some(r) =
                        in_loans[i].filter(|r| lazy.get().is_some_and(|a| a.seal_loan(r)))
                    {
                        loaned += 1;
                        return PartRef::Arena(r);
                    }
                    if p.len() >= threshold {
                        match lazy.for_part() {
                            Some(a) => {
                                if let Some(r) =
                                    a.copy_in(p, &mut |r| reader_is_dead(ring.ring(), r))
                                {
                                    copied += 1;
                                    return PartRef::Arena(r);
                                }
                            }
                            None => lazy.count_fallback(),
                        }
                        fallbacks += 1;
                    }
                }
            }
            let offset = framing::align(at);
            at = offset + p.len();
            PartRef::Inline {
                offset,
                len: p.len(),
            }
        })
        .collect();
    let ring = ring.ring();
    ring.count_parts(PartCounter::Loaned, loaned);
    ring.count_parts(PartCounter::Arena, copied);
    ring.count_parts(PartCounter::Fallback, fallbacks);
    refs
}

/// The bytes a message of `refs` takes in a chunk: its header and its inline parts.
fn chunk_bytes(parts: &[&[u8]], refs: &[PartRef]) -> usize {
    let inline: usize = refs
        .iter()
        .zip(parts)
        .filter(|(r, _)| matches!(r, PartRef::Inline { .. }))
        .map(|(_, p)| framing::align(p.len()))
        .sum();
    framing::header_len(parts.len()) + inline
}

/// A message too large for a chunk even with its large parts in the arena: its inline
/// parts, the largest first and the body included, are copied into the arena too until
/// the rest fits in the chunk. It then reaches the local readers through shared memory,
/// never over the overflow socket, whose messages still queued in this process are lost
/// when it exits (issue 54); only a message the arena has no room for still goes over
/// the socket. The inline parts left are laid out again after the header. Parts of at
/// least `threshold` bytes other than the body found no room already ([`place_parts`]
/// tried them and counted the fallback): they are not tried again.
fn into_arena_until_it_fits(
    parts: &[&[u8]],
    refs: &mut [PartRef],
    lazy: &mut LazyArenaWriter,
    threshold: usize,
    ring: &RingWriter,
) {
    let max = ring.ring().max_chunk_bytes();
    let mut total = chunk_bytes(parts, refs);
    if total <= max {
        return;
    }
    let untried = |i: usize| i == 0 || parts[i].len() < threshold;
    let mut inline: Vec<usize> = (0..parts.len())
        .filter(|&i| {
            matches!(refs[i], PartRef::Inline { .. }) && !parts[i].is_empty() && untried(i)
        })
        .collect();
    // What stays inline whatever moves: if that alone is too large, nothing is tried.
    let mut candidate = vec![false; parts.len()];
    inline.iter().for_each(|&i| candidate[i] = true);
    let fixed: usize = framing::header_len(parts.len())
        + (0..parts.len())
            .filter(|&i| matches!(refs[i], PartRef::Inline { .. }) && !candidate[i])
            .map(|i| framing::align(parts[i].len()))
            .sum::<usize>();
    if fixed > max {
        return;
    }
    inline.sort_by_key(|&i| std::cmp::Reverse(parts[i].len()));
    let mut copied = 0;
    for i in inline {
        if total <= max {
            break;
        }
        let Some(arena) = lazy.for_part() else {
            break;
        };
        let Some(r) = arena.copy_in(parts[i], &mut |r| reader_is_dead(ring.ring(), r)) else {
            break;
        };
        refs[i] = PartRef::Arena(r);
        total -= framing::align(parts[i].len());
        copied += 1;
    }
    let mut at = framing::header_len(parts.len());
    for (r, p) in refs.iter_mut().zip(parts) {
        if let PartRef::Inline { offset, len } = r {
            *offset = framing::align(at);
            *len = p.len();
            at = *offset + p.len();
        }
    }
    ring.ring().count_parts(PartCounter::Arena, copied);
}

/// The arena parts among a message's references.
fn arena_parts(refs: &[PartRef]) -> impl Iterator<Item = &ArenaRef> {
    refs.iter().filter_map(|r| match r {
        PartRef::Arena(a) => Some(a),
        _ => None,
    })
}

/// One hold per reader not dropped on each arena part of a message. Before the message
/// is visible: a reader may drop its hold as soon as it has read the message.
fn publish_holds(arena: Option<&ArenaWriter>, ring: &RingWriter, refs: &[PartRef]) {
    if let Some(arena) = arena {
        let n = ring.ring().n_reader();
        for r in arena_parts(refs) {
            arena.publish(r, (0..n).filter(|&i| !ring.is_reader_dropped(i)));
        }
    }
}

/// A message as [`Writer::enqueue`] sends it: one of its four shapes, as a reader gets it
/// back ([`Received`](super::Received)). A byte slice (or array, or `Vec`) converts into
/// [`Message::Bytes`], an [`ArrayRef`] into [`Message::Array`].
///
/// ```
/// # use shmq_core as shmq; // what the `shmq` crate re-exports
/// use shmq::broadcast::{ArrayRef, Message};
/// let header = b"pickle stream";
/// let tensor = vec![0u8; 1 << 20];
/// let _raw: Message<'_> = b"raw bytes".into();
/// let _parts = Message::Parts(&[header, &tensor]);
/// let floats = [1.0f32, 2.0, 3.0, 4.0];
/// let array = ArrayRef::new(&floats, &[2, 2])?;
/// let _array: Message<'_> = (&array).into();
/// # Ok::<(), shmq::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum Message<'a> {
    /// Raw bytes (a reader's `Received::Bytes`; Python's `dequeue_bytes()`).
    Bytes(&'a [u8]),
    /// A message of one part, its body, sent as cheaply as raw bytes (a reader's
    /// `Received::Parts` of one part; Python's `enqueue` of a pickled object with no
    /// out-of-band buffers).
    Body(&'a [u8]),
    /// A message of parts: the body, then the buffers it refers to.
    Parts(&'a [&'a [u8]]),
    /// A typed array (see [`crate::broadcast::array`]).
    Array(&'a ArrayRef<'a>),
}

impl<'a> From<&'a [u8]> for Message<'a> {
    fn from(bytes: &'a [u8]) -> Self {
        Message::Bytes(bytes)
    }
}

impl<'a, const N: usize> From<&'a [u8; N]> for Message<'a> {
    fn from(bytes: &'a [u8; N]) -> Self {
        Message::Bytes(bytes)
    }
}

impl<'a> From<&'a Vec<u8>> for Message<'a> {
    fn from(bytes: &'a Vec<u8>) -> Self {
        Message::Bytes(bytes)
    }
}

impl<'a> From<&'a ArrayRef<'a>> for Message<'a> {
    fn from(array: &'a ArrayRef<'a>) -> Self {
        Message::Array(array)
    }
}

/// Why [`Writer::try_enqueue`] sent nothing (as crossbeam's `TrySendError`): the queue
/// had no room for it now, or the send failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TryEnqueueError {
    /// Sending it now would wait (the next chunk is not free yet, or a remote reader is
    /// out of credit); nothing was sent. [`Writer::enqueue`] waits for room.
    #[error("the queue has no room for the message now (sending it would wait)")]
    Full,
    /// The send failed, as [`Writer::enqueue`] would have.
    #[error(transparent)]
    Failed(#[from] EnqueueError),
}

impl From<TryEnqueueError> for Error {
    /// [`Full`](TryEnqueueError::Full) as a wait that ran out at once
    /// ([`Error::Timeout`] of no wait, with the same text), as
    /// [`TryDequeueError::Empty`](crate::broadcast::TryDequeueError::Empty) converts;
    /// [`Failed`](TryEnqueueError::Failed) as its [`EnqueueError`] converts.
    fn from(e: TryEnqueueError) -> Error {
        match e {
            TryEnqueueError::Full => Error::Timeout {
                what: TryEnqueueError::Full.to_string(),
                waited: Duration::ZERO,
            },
            TryEnqueueError::Failed(e) => e.into(),
        }
    }
}

/// The writing side of a queue.
pub struct Writer {
    ring: Option<RingWriter>,
    /// Large message parts for local readers (with the ring).
    /// Made when first needed (see [`LazyArenaWriter`]).
    arena: Option<LazyArenaWriter>,
    arena_threshold: usize,
    local: Option<Publisher>,
    remote: Option<RemoteWriter>,
    n_local_reader: usize,
    n_remote_reader: usize,
    handle: Handle,
    overflow_count: u64,
    policy: WaitPolicy,
    /// This writer's recent waits (how long its waits poll before sleeping).
    history: Arc<WaitHistory>,
    /// What this writer's waits are for, naming its queue (in warnings and timeouts):
    /// for its readers' subscriptions, for room (a chunk, or remote readers' credit),
    /// for a chunk.
    waiting_for_subscribers: Arc<str>,
    waiting_for_room: Arc<str>,
    waiting_for_a_chunk: Arc<str>,
    /// Set by [`Writer::close`], or by a clone's `cancel()` from any thread: this writer's
    /// calls fail from then on.
    canceller: Canceller,
    /// The readers have been told that the queue is shut down ([`Writer::close`]).
    closed: bool,
    /// The queue's name, held in this user's directory of names while the writer lives
    /// ([`QueueOptions::record_name`]); released by [`Writer::close`].
    name_claim: Option<NameClaim>,
    // Declared last so the sockets above close before their context terminates.
    _ctx: LeakInChild<zmq::Context>,
}

impl fmt::Debug for Writer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Writer")
            .field("handle", &self.handle)
            .finish()
    }
}

impl Writer {
    /// Create the queue: the ring (if there are local readers) and the sockets.
    ///
    /// # Errors
    ///
    /// A [`CreateError`]: [`BadOptions`](CreateError::BadOptions) for options that do not
    /// fit together (more local readers than readers, ranks out of range, a bad `name`,
    /// `record_name` without one, remote options out of range); [`Name`](CreateError::Name)
    /// with [`NameError::Taken`](crate::names::NameError::Taken) for a `name` another live
    /// writer holds (`record_name`); [`Os`](CreateError::Os) when the ring or the arena
    /// cannot be made (no room in `/dev/shm`...); [`Transport`](CreateError::Transport)
    /// when a socket cannot be bound.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// let mut opts = shmq::QueueOptions::local(2);
    /// opts.max_chunk_bytes = 64 * 1024;
    /// let writer = shmq::Writer::new(opts)?;
    /// assert_eq!((writer.n_local_reader(), writer.n_remote_reader()), (2, 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(opts: QueueOptions) -> Result<Writer, CreateError> {
        Self::new_core(opts).map_err(CreateError::from_core)
    }

    /// [`new`](Self::new), its errors as the parts of the writer say them.
    fn new_core(opts: QueueOptions) -> Result<Writer> {
        opts.remote.check()?;
        if opts.n_local_reader > opts.n_reader {
            return Err(Error::InvalidArgument(format!(
                "n_local_reader ({}) cannot exceed n_reader ({}): n_reader counts all readers, \
                 local and remote",
                opts.n_local_reader, opts.n_reader
            )));
        }
        // Checked before the default ranks are made (one per local reader): a huge count
        // would abort the process on the allocation instead of reaching the ring's check.
        if opts.n_local_reader > MAX_READERS {
            return Err(Error::InvalidArgument(format!(
                "n_local_reader must be at most {MAX_READERS} (the most readers a ring has), \
                 got {}",
                opts.n_local_reader
            )));
        }
        let ranks = opts
            .local_reader_ranks
            .clone()
            .unwrap_or_else(|| (0..opts.n_local_reader).collect());
        if ranks.len() != opts.n_local_reader {
            return Err(Error::InvalidArgument(format!(
                "local_reader_ranks has {} entries but n_local_reader is {}",
                ranks.len(),
                opts.n_local_reader
            )));
        }
        let mut seen = ranks.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ranks.len() {
            return Err(Error::InvalidArgument(format!(
                "local_reader_ranks has duplicates: {ranks:?}"
            )));
        }
        // The remote socket uses the process's context; the local publisher has one of
        // its own: dropping it flushes the overflow messages still queued
        // (`transport::shared_context` says why).
        if let Some(name) = &opts.name {
            super::super::ring::check_label(name)?;
        }
        if opts.record_name && opts.name.is_none() {
            return Err(Error::InvalidArgument(
                "record_name needs a name: set QueueOptions::name to the name to hold".into(),
            ));
        }
        let shared = crate::transport::shared_context();
        let ctx = if opts.n_local_reader > 0 {
            zmq::Context::new()
        } else {
            shared.clone()
        };
        let n_remote_reader = opts.n_reader - opts.n_local_reader;
        let (ring, local, arena) = if opts.n_local_reader > 0 {
            let ring = Arc::new(Ring::create(
                opts.n_local_reader,
                opts.max_chunk_bytes,
                opts.max_chunks,
            )?);
            if let Some(name) = &opts.name {
                ring.set_label(name)?;
            }
            let local = Publisher::bind_ipc(&ctx, ring.name())?;
            // Named now (readers learn the name from the handle), made at first use.
            let arena = (opts.arena_bytes > 0)
                .then(|| {
                    LazyArenaWriter::new(
                        ring.name(),
                        opts.n_local_reader,
                        opts.arena_bytes,
                        arena::DEFAULT_MAX_LEASES,
                    )
                })
                .transpose()?;
            let mut writer = RingWriter::new(ring)?;
            writer.on_dead_reader(opts.on_dead_reader);
            writer.set_reader_ranks(ranks.clone());
            (Some(writer), Some(local), arena)
        } else {
            (None, None, None)
        };
        let (remote, ipv6, secret) = if n_remote_reader > 0 {
            let ip = opts.connect_ip.clone().unwrap_or_else(default_connect_ip);
            let secret = remote::new_secret()?;
            let (mut p, v6) = RemoteWriter::bind(
                &shared,
                &ip,
                secret,
                n_remote_reader,
                ranks.clone(),
                opts.remote,
            )?;
            if let Some(name) = &opts.name {
                // Remote readers are told it in their WELCOME, and name the queue by it.
                p.set_label(name)?;
            }
            (Some(p), v6, Some(secret))
        } else {
            (None, false, None)
        };
        let handle = Handle {
            local_reader_ranks: ranks,
            buffer: ring.as_ref().map(|r| r.ring().handle()),
            local_subscribe_addr: local.as_ref().map(|p| p.endpoint().to_owned()),
            remote_subscribe_addr: remote.as_ref().map(|p| p.endpoint().to_owned()),
            remote_addr_ipv6: ipv6,
            remote_secret: secret,
            arena: arena.as_ref().map(|a| a.name().to_owned()),
        };
        let canceller = Canceller::new(ring.as_ref().map(|r| r.ring().clone()), true);
        // The queue in the waits' words: by its name where its writer named it.
        let of_queue = ring.as_ref().map_or_else(String::new, |r| {
            format!(" of queue {}", r.ring().queue_words())
        });
        let named = |what: &str| -> Arc<str> {
            match what.strip_prefix("the writer") {
                Some(rest) => format!("the writer{of_queue}{rest}").into(),
                None => what.into(),
            }
        };
        let waiting_for_room = if ring.is_some() {
            WAITING_FOR_A_CHUNK
        } else {
            WAITING_FOR_REMOTE_READERS
        };
        // Taken last, with the handle to record; on a refusal the queue made above is
        // dropped (closed) again.
        let name_claim = match (&opts.name, opts.record_name) {
            (Some(name), true) => {
                let details = serde_json::json!({ "handle": handle.to_string() }).to_string();
                Some(names::claim(names::Kind::Queue, name, &details)?)
            }
            _ => None,
        };
        Ok(Writer {
            name_claim,
            ring,
            arena,
            arena_threshold: opts.arena_threshold.max(1),
            local,
            remote,
            n_local_reader: opts.n_local_reader,
            n_remote_reader,
            handle,
            overflow_count: 0,
            policy: opts
                .wait
                .unwrap_or_else(|| WaitPolicy::for_processes(opts.n_local_reader + 1)),
            history: Arc::default(),
            waiting_for_subscribers: named(WAITING_FOR_SUBSCRIBERS),
            waiting_for_room: named(waiting_for_room),
            waiting_for_a_chunk: named(WAITING_FOR_A_CHUNK),
            canceller,
            closed: false,
            _ctx: LeakInChild::new(ctx),
        })
    }

    /// Shut the queue down: this writer's calls fail with [`QueueError::ShutDown`]
    /// ([`EnqueueError::ShutDown`] for `enqueue` and `wait_until_ready`) from now on (also
    /// calls blocked in other threads: see [`Canceller`]), and every reader, after the
    /// messages sent before, gets [`QueueError::WriterShutDown`]
    /// ([`DequeueError::WriterShutDown`](crate::broadcast::DequeueError::WriterShutDown)
    /// from its receives). Local readers learn
    /// it from the writer's slot in the ring (no chunk needed, so this never waits for
    /// room); remote readers from a closing message on the stream, sent within
    /// `CLOSE_GRACE` (1 s; a reader whose queue stays full that long sees the writer go
    /// instead). Runs when the writer is dropped too. Nothing in a forked child, which
    /// does not own its parent's writer.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(b"last", Duration::from_secs(10))?;
    /// writer.close();
    /// assert!(writer.is_shut_down());
    /// assert!(writer.enqueue(b"more", Duration::from_secs(10)).is_err());
    /// // The reader gets what was sent before, then the end of the queue.
    /// assert_eq!(reader.dequeue(Duration::from_secs(10))?, b"last");
    /// assert!(reader.dequeue(Duration::from_secs(10)).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn close(&mut self) {
        if self.closed || fork::is_inherited(self._ctx.made_in()) {
            return;
        }
        self.closed = true;
        // The name first: a reader that opens it from now on is told there is no such
        // queue rather than joining one that is ending.
        self.name_claim = None;
        self.canceller.cancel();
        if let Some(ring) = self.ring.as_ref() {
            ring.ring().close_writer();
            self.keep_arena_for_readers();
        }
        if let Some(remote) = self.remote.as_mut() {
            remote.close(CLOSE_GRACE);
        }
    }

    /// At the writer's end: while a live local reader still holds a part in the tensor
    /// arena (a message it has not read yet: it may not even have opened the arena,
    /// which it does at the first message that needs it), the arena's name must outlive
    /// this process, or that message is lost. Its removal goes to this process's
    /// janitor, which removes it once every reader of the ring has left or died (see
    /// `shmq_os::segment::Segment::hand_removal_to_janitor`). Without a janitor (Rust
    /// programs that set none, `SHMQ_NO_JANITOR=1`) the name goes with the writer, as
    /// before, and so do such messages.
    fn keep_arena_for_readers(&mut self) {
        let (Some(ring), Some(arena)) = (
            self.ring.as_ref(),
            self.arena.as_mut().and_then(|a| a.get_mut()),
        ) else {
            return;
        };
        let ring = ring.ring();
        arena.reclaim_dead(&mut |r| reader_is_dead(ring, r));
        if arena.has_reader_holds() && arena.hand_removal_to_janitor(ring.name()) {
            shmq_log!(
                debug,
                "shmq: tensor arena {} outlives its writer until the readers of {} leave",
                arena.name(),
                ring.name()
            );
        }
    }

    /// Whether the writer was shut down ([`close`](Self::close), or its [`Canceller`]'s
    /// `cancel()` from any thread).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert!(!writer.is_shut_down());
    /// writer.canceller().cancel(); // from any thread
    /// assert!(writer.is_shut_down());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn is_shut_down(&self) -> bool {
        self.closed || self.canceller.is_cancelled()
    }

    /// [`QueueError::ShutDown`] once the writer was shut down.
    fn check_open(&self) -> Result<()> {
        if self.is_shut_down() {
            return Err(Error::Queue(QueueError::ShutDown));
        }
        Ok(())
    }

    /// A wait of this writer's ended by its canceller says so ([`QueueError::ShutDown`]): the
    /// canceller is only ever set to shut the writer down (`close`, `cancel()`).
    fn why(&self, e: Error) -> Error {
        match e {
            Error::Cancelled if self.canceller.is_cancelled() => Error::Queue(QueueError::ShutDown),
            e => e,
        }
    }

    /// What a reader needs to join the queue ([`Reader::open`](super::Reader::open)); its
    /// text form (`Display`, `FromStr`) crosses processes and languages.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// let writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// // What a reader (of this or another process) opens the queue with.
    /// let text = writer.handle().to_string();
    /// let mut other = shmq::Reader::open(&text.parse()?, 0);
    /// # let _ = &mut other;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// How many readers read through shared memory (on this machine).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// let mut opts = shmq::QueueOptions::local(3);
    /// opts.n_local_reader = 2; // and one remote reader
    /// opts.connect_ip = Some("127.0.0.1".into());
    /// let writer = shmq::Writer::new(opts)?;
    /// assert_eq!(writer.n_local_reader(), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn n_local_reader(&self) -> usize {
        self.n_local_reader
    }

    /// How many readers read over TCP (on other machines).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// let mut opts = shmq::QueueOptions::local(3);
    /// opts.n_local_reader = 2; // and one remote reader
    /// opts.connect_ip = Some("127.0.0.1".into());
    /// let writer = shmq::Writer::new(opts)?;
    /// assert_eq!(writer.n_remote_reader(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn n_remote_reader(&self) -> usize {
        self.n_remote_reader
    }

    /// The ring, if there are local readers.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// let ring = writer.ring().expect("a local reader: a ring");
    /// assert_eq!(ring.n_reader(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn ring(&self) -> Option<&Arc<Ring>> {
        self.ring.as_ref().map(|r| r.ring())
    }
    /// Index of the chunk the next message goes to (0 without local readers).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert_eq!(writer.current_idx(), 0);
    /// writer.enqueue(b"one", Duration::from_secs(10))?;
    /// assert_eq!(writer.current_idx(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn current_idx(&self) -> usize {
        self.ring.as_ref().map_or(0, |r| r.current_idx())
    }
    /// Messages sent over the overflow socket so far.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// let big = vec![0u8; writer.ring().unwrap().max_chunk_bytes() + 1];
    /// writer.enqueue(&big, Duration::from_secs(10))?; // larger than a chunk
    /// assert_eq!(writer.overflow_count(), 1);
    /// assert_eq!(reader.dequeue(Duration::from_secs(10))?, big);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn overflow_count(&self) -> u64 {
        self.overflow_count
    }
    /// How this writer's own blocking calls wait.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// let writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let policy = writer.wait_policy();
    /// # let _ = policy;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_policy(&self) -> WaitPolicy {
        self.policy
    }
    /// Local readers dropped after they died (with [`DeadReaderPolicy::Drop`](super::super::ring::DeadReaderPolicy::Drop)).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// // Empty until a local reader dies under `on_dead_reader: Drop`.
    /// assert!(writer.dropped_readers().is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn dropped_readers(&self) -> Vec<usize> {
        self.ring
            .as_ref()
            .map_or_else(Vec::new, |r| r.dropped_readers())
    }
    /// Local readers that left the queue (their reader dropped, or their process ended
    /// normally) and that this writer goes on without: not deaths, whatever
    /// `on_dead_reader` says (the writer learns of a departure when it next waits for
    /// that reader).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut opts = shmq::QueueOptions::local(1);
    /// opts.max_chunks = 1;
    /// let mut writer = shmq::Writer::new(opts)?;
    /// let reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(b"never read", Duration::from_secs(10))?;
    /// drop(reader); // it leaves the queue
    /// // The writer finds it gone when it waits for its chunk, and goes on without it.
    /// writer.enqueue(b"to nobody", Duration::from_secs(10))?;
    /// assert_eq!(writer.left_readers(), [0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn left_readers(&self) -> Vec<usize> {
        self.ring
            .as_ref()
            .map_or_else(Vec::new, |r| r.left_readers())
    }
    /// Ends this writer's blocked calls (from any thread) with [`Error::Cancelled`].
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// let canceller = writer.canceller();
    /// std::thread::spawn(move || canceller.cancel()).join().unwrap();
    /// assert!(writer.is_shut_down());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn canceller(&self) -> Canceller {
        self.canceller.clone()
    }

    /// Wait until every reader has subscribed, then tell them the queue is ready.
    ///
    /// # Errors
    ///
    /// An [`EnqueueError`]: [`Timeout`](EnqueueError::Timeout) when `wait` runs out first;
    /// [`ReaderDied`](EnqueueError::ReaderDied) for a local reader that died before
    /// subscribing; [`ShutDown`](EnqueueError::ShutDown) once the writer is shut down (also
    /// from another thread, by its [`Canceller`]); [`Remote`](EnqueueError::Remote) for a
    /// remote reader that could not connect; [`Cancelled`](EnqueueError::Cancelled) or
    /// [`Other`](EnqueueError::Other) with the error of `wait`'s hook.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let handle = writer.handle().clone();
    /// let reader = std::thread::spawn(move || shmq::Reader::open(&handle, 0));
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// # drop(reader.join().unwrap()?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_until_ready<'w>(
        &mut self,
        wait: impl Into<WaitSpec<'w>>,
    ) -> Result<(), EnqueueError> {
        self.wait_until_ready_core(wait.into())
            .map_err(EnqueueError::from_core)
    }

    /// [`wait_until_ready`](Self::wait_until_ready), its errors as the parts of the
    /// writer say them.
    fn wait_until_ready_core(&mut self, wait: WaitSpec<'_>) -> Result<()> {
        let (canceller, what) = (self.canceller.clone(), self.waiting_for_subscribers.clone());
        let mut wait = wait.into_wait(&what, self.policy, canceller.flag());
        fork::check(self._ctx.made_in(), "queue writer")?;
        self.check_open()?;
        let r = self.wait_until_ready_unchecked(&mut wait);
        r.map_err(|e| self.why(e))
    }

    fn wait_until_ready_unchecked(&mut self, wait: &mut Wait) -> Result<()> {
        if let Some(p) = self.local.as_mut() {
            // A local reader that died before subscribing would leave us waiting forever.
            let ring = self.ring.as_ref().map(|r| r.ring().clone());
            let mut readers_alive = || match &ring {
                Some(ring) => dead_local_reader(ring),
                None => Ok(()),
            };
            let ranks = &self.handle.local_reader_ranks;
            let mut explain = |subscribed: usize| match &ring {
                Some(ring) => explain_subscribers(ring, ranks, subscribed),
                None => String::new(),
            };
            p.wait_for_subscribers(self.n_local_reader, wait, &mut readers_alive, &mut explain)?;
        }
        if let Some(p) = self.remote.as_mut() {
            p.wait_for_readers(wait)?;
        }
        Ok(())
    }

    /// Whether a message that fits in a chunk could be written without waiting.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert!(writer.can_write());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn can_write(&self) -> bool {
        self.ring.as_ref().is_none_or(|r| r.can_write())
    }

    /// Send `message` to every reader, waiting while the ring is full (and, for remote
    /// readers, while one of them is out of credit) as `wait` says: a timeout (a
    /// `Duration`, `None` for none), or a [`WaitSpec`] with a hook. A message that needs no
    /// wait is sent at once, with no wait set up.
    ///
    /// The shapes of a message ([`Message`]; a byte slice converts into raw bytes, an
    /// [`ArrayRef`] into an array):
    /// - [`Message::Bytes`]: raw bytes; a Rust reader's [`Received::Bytes`], Python's
    ///   `dequeue_bytes()`.
    /// - [`Message::Body`]: a message of one part, its body, as cheap as raw bytes (in the
    ///   ring a chunk of kind `Body`, the bytes copied as they are, no part descriptors):
    ///   what `Message::Parts(&[body])` sends as readers see it (`dequeue_parts` gets one
    ///   part). Python's `enqueue` of a pickled object with no out-of-band buffers.
    /// - [`Message::Parts`]: `parts[0]` is the body (for Python, the pickle stream) and the
    ///   rest are buffers it refers to. Local readers get parts of at least the arena
    ///   threshold as references into the tensor arena (copied there once; parts that lie
    ///   inside a live [`Loan`] of this writer are not copied at all), smaller ones copied
    ///   into the chunk; remote readers get every part as a ZeroMQ frame.
    /// - [`Message::Array`]: a typed array (see [`crate::broadcast::array`]): its data
    ///   travels as a large part does. A Rust reader takes it with
    ///   [`Reader::dequeue_array`](super::Reader::dequeue_array), a Python reader with
    ///   `dequeue()` (a numpy array) or `dequeue_array()`.
    ///
    /// [`Received::Bytes`]: super::Received::Bytes
    ///
    /// # Errors
    ///
    /// An [`EnqueueError`]: [`Timeout`](EnqueueError::Timeout) when `wait` runs out before
    /// there is room; [`ReaderDied`](EnqueueError::ReaderDied) for a local reader that died
    /// holding the chunk needed (unless `on_dead_reader` drops it);
    /// [`ShutDown`](EnqueueError::ShutDown) once the writer is shut down (also a send
    /// blocked in another thread); [`Remote`](EnqueueError::Remote) for a remote reader
    /// lost under `LostReaderPolicy::Raise`; [`BadMessage`](EnqueueError::BadMessage) for a
    /// message that cannot be sent (a part count beyond the framing's limit);
    /// [`Os`](EnqueueError::Os) when `/dev/shm` has no room for what it needs;
    /// [`Transport`](EnqueueError::Transport) for a failed socket;
    /// [`Cancelled`](EnqueueError::Cancelled) or [`Other`](EnqueueError::Other) with the
    /// error of `wait`'s hook.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// use shmq::broadcast::{ArrayRef, Message};
    /// writer.enqueue(b"raw bytes", Duration::from_secs(10))?;
    /// writer.enqueue(Message::Parts(&[b"body", b"buffer"]), None)?; // no timeout
    /// writer.enqueue(&ArrayRef::new(&[1.0f32, 2.0], &[2])?, Duration::from_secs(10))?;
    /// assert_eq!(reader.dequeue(Duration::from_secs(10))?, b"raw bytes");
    /// let parts = reader.dequeue_parts(Duration::from_secs(10))?;
    /// assert_eq!((&*parts[0], &*parts[1]), (&b"body"[..], &b"buffer"[..]));
    /// let array = reader.dequeue_array(Duration::from_secs(10))?;
    /// assert_eq!(array.to_vec::<f32>()?, [1.0, 2.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn enqueue<'m, 'w>(
        &mut self,
        message: impl Into<Message<'m>>,
        wait: impl Into<WaitSpec<'w>>,
    ) -> Result<(), EnqueueError> {
        let spec = wait.into();
        let sent = match message.into() {
            Message::Bytes(msg) => self.send_whole(msg, false, spec),
            Message::Body(body) => self.send_whole(body, true, spec),
            Message::Parts(parts) => self.send_parts(Format::Parts, parts, spec),
            Message::Array(array) => {
                let header = array.meta().encode();
                self.send_parts(Format::Array, &[&header, array.data()], spec)
            }
        };
        sent.map_err(EnqueueError::from_core)
    }

    /// Send `message` (see [`enqueue`](Self::enqueue)) if that needs no wait.
    ///
    /// # Errors
    ///
    /// [`TryEnqueueError::Full`], with nothing sent, if sending would wait (the next
    /// chunk is not free yet, or a remote reader is out of credit); else
    /// [`TryEnqueueError::Failed`] with what [`enqueue`](Self::enqueue) would fail with.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// use shmq::broadcast::TryEnqueueError;
    /// let mut opts = shmq::QueueOptions::local(1);
    /// opts.max_chunks = 1;
    /// let mut writer = shmq::Writer::new(opts)?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(std::time::Duration::from_secs(10))?;
    /// writer.try_enqueue(b"first")?;
    /// // One chunk, not read yet: a second message would wait.
    /// assert!(matches!(writer.try_enqueue(b"second"), Err(TryEnqueueError::Full)));
    /// assert_eq!(reader.dequeue(std::time::Duration::from_secs(10))?, b"first");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_enqueue<'m>(
        &mut self,
        message: impl Into<Message<'m>>,
    ) -> std::result::Result<(), TryEnqueueError> {
        let sent = match message.into() {
            Message::Bytes(msg) => self.try_send_whole(msg, false),
            Message::Body(body) => self.try_send_whole(body, true),
            Message::Parts(parts) => self.try_send_parts(Format::Parts, parts),
            Message::Array(array) => {
                let header = array.meta().encode();
                self.try_send_parts(Format::Array, &[&header, array.data()])
            }
        };
        match sent.map_err(EnqueueError::from_core)? {
            true => Ok(()),
            false => Err(TryEnqueueError::Full),
        }
    }

    /// Whether sending `bytes` to the remote readers would wait for one (out of credit):
    /// then the send needs a real wait (its timeout), not `Wait::ready_now`.
    fn remote_would_wait(&mut self, bytes: u64) -> Result<bool> {
        self.remote
            .as_mut()
            .map_or(Ok(false), |r| r.would_wait(bytes))
    }

    /// [`enqueue`](Self::enqueue) of raw bytes or a body (`as_body`): at once if that
    /// needs no wait, else with the wait `spec` describes.
    fn send_whole(&mut self, msg: &[u8], as_body: bool, spec: WaitSpec<'_>) -> Result<()> {
        if self.try_send_whole(msg, as_body)? {
            return Ok(());
        }
        let (canceller, what) = (self.canceller.clone(), self.waiting_for_room.clone());
        let mut wait = spec
            .into_wait(&what, self.policy, canceller.flag())
            .learning(&self.history);
        self.send_whole_with(msg, as_body, &mut wait)
    }

    /// Send `msg` (raw, or as a one-part body: `as_body`) if that needs no wait; `false`
    /// if it would. A body goes to remote readers with a one-part header.
    fn try_send_whole(&mut self, msg: &[u8], as_body: bool) -> Result<bool> {
        let header = if as_body { framing::header_len(1) } else { 0 };
        if !self.can_write() || self.remote_would_wait((msg.len() + header) as u64)? {
            return Ok(false);
        }
        // No wait needed: skip setting one up (clock read, canceller clone).
        self.send_whole_with(msg, as_body, &mut Wait::ready_now())?;
        Ok(true)
    }

    fn send_whole_with(&mut self, msg: &[u8], as_body: bool, wait: &mut Wait) -> Result<()> {
        fork::check(self._ctx.made_in(), "queue writer")?;
        self.check_open()?;
        let r = self.enqueue_unchecked(msg, as_body, wait);
        r.map_err(|e| self.why(e))?;
        self.check_lost_remote_readers()
    }

    /// Send `msg`: raw bytes, or (`body`) a message of one part, its body. In the ring
    /// they differ only by the chunk's kind; over a socket a body goes as a message of
    /// parts does (a descriptor block naming the frame after it), raw bytes as one frame.
    fn enqueue_unchecked(&mut self, msg: &[u8], body: bool, wait: &mut Wait) -> Result<()> {
        // A body too large for a chunk is a message of one part: through the arena, as
        // any part (see `into_arena_until_it_fits`), the same message for every reader.
        let too_large = |ring: &RingWriter| msg.len() > ring.ring().max_chunk_bytes();
        if body && self.arena.is_some() && self.ring.as_ref().is_some_and(too_large) {
            return self.enqueue_parts_unchecked(Format::Parts, &[msg], wait);
        }
        let block = || framing::encode_vec(Format::Parts, &[PartRef::Frame { index: 1 }]);
        // Every wait comes before anything is sent (see `Wait::commit`).
        if let Some(remote) = self.remote.as_mut() {
            let extra = if body { framing::header_len(1) } else { 0 };
            remote.wait_for_credit((msg.len() + extra) as u64, wait)?;
        }
        // A message that fits in a chunk but finds no room in /dev/shm for it goes over
        // the overflow socket too (see `RingWriter::reserve`).
        let mut inline = false;
        if let Some(ring) = self.ring.as_mut() {
            inline = msg.len() <= ring.ring().max_chunk_bytes() && ring.reserve(msg.len())?;
            ring.acquire(wait)?;
        }
        // The remote readers first (see the module docs: the order of a send).
        if let Some(remote) = self.remote.as_mut() {
            wait.commit();
            if body {
                remote.send(&[&block(), msg], wait)?;
            } else {
                remote.send(&[msg], wait)?;
            }
            self.count_remote_send();
        }
        if let Some(ring) = self.ring.as_mut() {
            wait.commit();
            if inline {
                ring.data_mut().expect("acquired")[..msg.len()].copy_from_slice(msg);
                let kind = if body {
                    ChunkKind::Body
                } else {
                    ChunkKind::Inline
                };
                ring.commit(msg.len(), kind)?;
            } else {
                let local = self
                    .local
                    .as_ref()
                    .expect("local readers have an overflow socket");
                if body {
                    local.send_frames(&[&block(), msg])?;
                } else {
                    local.send(msg)?;
                }
                ring.commit(msg.len(), ChunkKind::Overflow)?;
                self.overflow_count += 1;
            }
        }
        Ok(())
    }

    fn send_parts(&mut self, format: Format, parts: &[&[u8]], spec: WaitSpec<'_>) -> Result<()> {
        if self.try_send_parts(format, parts)? {
            return Ok(());
        }
        let (canceller, what) = (self.canceller.clone(), self.waiting_for_room.clone());
        let mut wait = spec
            .into_wait(&what, self.policy, canceller.flag())
            .learning(&self.history);
        self.send_parts_with(format, parts, &mut wait)
    }

    fn try_send_parts(&mut self, format: Format, parts: &[&[u8]]) -> Result<bool> {
        // The remote frames: the parts and a small block of references (over-counted
        // here, which only errs on the side of a real wait).
        let bytes = parts.iter().map(|p| p.len() as u64 + 16).sum::<u64>() + 64;
        if !self.can_write() || self.remote_would_wait(bytes)? {
            return Ok(false);
        }
        self.send_parts_with(format, parts, &mut Wait::ready_now())?;
        Ok(true)
    }

    fn send_parts_with(&mut self, format: Format, parts: &[&[u8]], wait: &mut Wait) -> Result<()> {
        fork::check(self._ctx.made_in(), "queue writer")?;
        self.check_open()?;
        let r = self.enqueue_parts_unchecked(format, parts, wait);
        r.map_err(|e| self.why(e))?;
        self.check_lost_remote_readers()
    }

    /// Send one message of `parts` to every reader: the remote readers' credit first
    /// (every wait comes before anything is sent), then the local readers' chunk, in the
    /// ring ([`enqueue_ring`](Self::enqueue_ring)) or, too large for one, over the
    /// overflow socket ([`enqueue_overflow`](Self::enqueue_overflow)), then the remote
    /// readers' frames ([`enqueue_remote`](Self::enqueue_remote)).
    fn enqueue_parts_unchecked(
        &mut self,
        format: Format,
        parts: &[&[u8]],
        wait: &mut Wait,
    ) -> Result<()> {
        if parts.is_empty() {
            return Err(Error::InvalidArgument(
                "a message needs at least one part (its body)".into(),
            ));
        }
        // The remote readers' frames: a block of references to the parts that follow it.
        let remote_block = self.remote.is_some().then(|| {
            let refs: Vec<PartRef> = (1..=parts.len())
                .map(|index| PartRef::Frame { index })
                .collect();
            framing::encode_vec(format, &refs)
        });
        // Every wait comes before anything is sent (see `Wait::commit`).
        if let (Some(remote), Some(block)) = (self.remote.as_mut(), &remote_block) {
            let bytes = block.len() as u64 + parts.iter().map(|p| p.len() as u64).sum::<u64>();
            remote.wait_for_credit(bytes, wait)?;
        }
        if self.ring.is_none() {
            if let Some(block) = &remote_block {
                self.enqueue_remote(block, parts, wait)?;
            }
            return Ok(());
        }
        let (refs, total) = self.place_local(parts, wait)?;
        // A message that fits in a chunk but finds no room in /dev/shm for it goes over
        // the overflow socket (see `RingWriter::reserve`): asked before anything is sent.
        let ring = self.ring.as_mut().expect("checked above");
        let fits = total <= ring.ring().max_chunk_bytes();
        let inline = match fits.then(|| ring.reserve(total)).transpose() {
            Ok(room) => room == Some(true),
            Err(e) => return Err(self.abandon_parts(&refs, e)),
        };
        // The remote readers first (see the module docs: the order of a send).
        if let Some(block) = &remote_block {
            if let Err(e) = self.enqueue_remote(block, parts, wait) {
                return Err(self.abandon_parts(&refs, e));
            }
        }
        if inline {
            self.enqueue_ring(format, parts, &refs, total)
        } else {
            self.enqueue_overflow(format, parts, &refs, total)
        }
    }

    /// A message placed for the local readers (`refs`) that will not be sent after all
    /// (`e`): its parts in the arena go back; returns `e`. The chunk stays acquired for
    /// the next message.
    fn abandon_parts(&self, refs: &[PartRef], e: Error) -> Error {
        if let Some(arena) = self.arena.as_ref().and_then(|a| a.get()) {
            arena_parts(refs).for_each(|r| arena.abandon(r));
        }
        e
    }

    /// The local readers' message, up to its sending: the next chunk (the last wait),
    /// then each part's place (inline, or in the arena). Returns the parts' references
    /// and the bytes the message takes in a chunk (header and inline parts).
    fn place_local(&mut self, parts: &[&[u8]], wait: &mut Wait) -> Result<(Vec<PartRef>, usize)> {
        let ring = self.ring.as_mut().expect("the caller checked");
        ring.acquire(wait)?;
        wait.commit();
        let mut refs = place_parts(parts, self.arena.as_mut(), self.arena_threshold, ring);
        if let Some(lazy) = self.arena.as_mut() {
            into_arena_until_it_fits(parts, &mut refs, lazy, self.arena_threshold, ring);
        }
        // Parts copied into the zero pages of a truncated arena reach nobody.
        if let Some(arena) = self.arena.as_ref().and_then(|a| a.get()) {
            if let Err(e) = arena.check_intact() {
                for r in &refs {
                    if let PartRef::Arena(a) = r {
                        arena.abandon(a);
                    }
                }
                return Err(e);
            }
        }
        let total = chunk_bytes(parts, &refs);
        Ok((refs, total))
    }

    /// The local readers' message in the chunk acquired and reserved for it (`total`
    /// bytes): the references, the inline parts, the arena holds, then the commit.
    fn enqueue_ring(
        &mut self,
        format: Format,
        parts: &[&[u8]],
        refs: &[PartRef],
        total: usize,
    ) -> Result<()> {
        let ring = self.ring.as_mut().expect("acquired");
        let data = ring.data_mut().expect("acquired");
        framing::encode_as(format, refs, data);
        for (r, p) in refs.iter().zip(parts) {
            if let PartRef::Inline { offset, len } = *r {
                data[offset..offset + len].copy_from_slice(p);
            }
        }
        publish_holds(self.arena.as_ref().and_then(|a| a.get()), ring, refs);
        ring.commit(total, ChunkKind::Framed)
    }

    /// The local readers' message too large for a chunk even so (or with no room in
    /// /dev/shm for it): the descriptors and the inline parts go over the overflow socket
    /// as frames, and the chunk acquired for it says so.
    fn enqueue_overflow(
        &mut self,
        format: Format,
        parts: &[&[u8]],
        refs: &[PartRef],
        total: usize,
    ) -> Result<()> {
        let mut frames: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
        let mut next = 1;
        let over: Vec<PartRef> = refs
            .iter()
            .zip(parts)
            .map(|(r, p)| match r {
                PartRef::Inline { .. } => {
                    frames.push(p);
                    next += 1;
                    PartRef::Frame { index: next - 1 }
                }
                other => *other,
            })
            .collect();
        let block = framing::encode_vec(format, &over);
        frames.insert(0, &block);
        // A message of parts is never one frame: one frame is raw bytes (see
        // `framing`). Parts all in the arena get an empty frame that none names.
        if frames.len() == 1 {
            frames.push(&[]);
        }
        let sent = self
            .local
            .as_ref()
            .expect("local readers have an overflow socket")
            .send_frames(&frames);
        if let Err(e) = sent {
            if let Some(arena) = self.arena.as_ref().and_then(|a| a.get()) {
                arena_parts(refs).for_each(|r| arena.abandon(r));
            }
            return Err(e);
        }
        let ring = self.ring.as_mut().expect("acquired");
        publish_holds(self.arena.as_ref().and_then(|a| a.get()), ring, refs);
        ring.commit(total, ChunkKind::Overflow)?;
        self.overflow_count += 1;
        Ok(())
    }

    /// The remote readers' message: `block` (the references) and then every part, each
    /// a frame; their credit was waited for before anything was sent.
    fn enqueue_remote(&mut self, block: &[u8], parts: &[&[u8]], wait: &mut Wait) -> Result<()> {
        let remote = self.remote.as_mut().expect("the block is made for it");
        wait.commit();
        let mut frames: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
        frames.push(block);
        frames.extend_from_slice(parts);
        remote.send(&frames, wait)?;
        self.count_remote_send();
        Ok(())
    }

    /// Lend `len` bytes of the tensor arena to fill in place; a message part that lies
    /// inside a live loan is sent by reference, without a copy. `None` when the queue has
    /// no arena (no local readers, or `arena_bytes` 0) or it has no room now. Makes the
    /// arena if it is not made yet.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// let mut loan = writer.loan(1 << 20).expect("an arena with room");
    /// loan.fill(7); // filled in place, sent by reference
    /// writer.enqueue(shmq::Message::Parts(&[b"body", &loan]), Duration::from_secs(10))?;
    /// let parts = reader.dequeue_parts(Duration::from_secs(10))?;
    /// assert!(parts[1].iter().all(|&b| b == 7));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn loan(&mut self, len: usize) -> Option<Loan> {
        if fork::is_inherited(self._ctx.made_in()) {
            return None;
        }
        let ring = self.ring.as_ref()?;
        self.arena
            .as_mut()?
            .for_part()?
            .loan(len, &mut |r| reader_is_dead(ring.ring(), r))
    }

    /// Drop the arena holds of readers proved dead and return the leases nobody holds
    /// any more ([`ArenaWriter::reclaim_dead`]); nothing if the arena is not made.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.reclaim_arena(); // nothing to do: no reader died
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reclaim_arena(&mut self) {
        let (Some(ring), Some(a)) = (
            self.ring.as_ref(),
            self.arena.as_mut().and_then(|a| a.get_mut()),
        ) else {
            return;
        };
        a.reclaim_dead(&mut |r| reader_is_dead(ring.ring(), r));
    }

    /// A message went to the remote readers: counted in the ring (where the metrics of
    /// a queue live; a queue without local readers has no ring, and only
    /// [`remote_peers`](Self::remote_peers) to show).
    fn count_remote_send(&self) {
        if let Some(ring) = self.ring.as_ref() {
            ring.ring().count_parts(PartCounter::RemoteSend, 1);
        }
    }

    /// The remote readers accepted so far: rank, address as ZeroMQ saw it, dropped.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// // A queue with local readers only has no remote peers.
    /// assert!(writer.remote_peers().is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn remote_peers(&self) -> Vec<(u64, Option<String>, bool)> {
        self.remote.as_ref().map_or_else(Vec::new, |r| r.peers())
    }

    /// How many remote readers this writer no longer sends to (gone, or dropped as
    /// slow): cheap, no allocation, for a check after every send.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert_eq!(writer.remote_dropped_count(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn remote_dropped_count(&self) -> usize {
        self.remote.as_ref().map_or(0, |r| r.dropped_count())
    }

    /// After a send: with [`LostReaderPolicy::Raise`](crate::remote::LostReaderPolicy::Raise)
    /// (`QueueOptions::remote`), [`RemoteError::LostReaders`](crate::error::RemoteError::LostReaders)
    /// once a remote reader is no longer sent to; the message went to the others.
    fn check_lost_remote_readers(&self) -> Result<()> {
        self.remote.as_ref().map_or(Ok(()), |r| r.check_lost())
    }

    /// Look for remote readers whose connection closed while this writer sent nothing
    /// (see [`RemoteWriter::check_connections`]); returns
    /// [`remote_dropped_count`](Self::remote_dropped_count).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert_eq!(writer.check_remote_peers(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_remote_peers(&mut self) -> usize {
        self.remote.as_mut().map_or(0, |r| r.check_connections())
    }

    /// Wait until every remote reader still sent to has taken every message enqueued so
    /// far (see [`RemoteWriter::wait_taken`]: it asks each for an acknowledgement); at
    /// once without remote readers. A reader that handles each message before it
    /// dequeues the next has handled them all when this returns: how a writer on one
    /// machine knows that what it sent was acted on at the other end (shmq's
    /// encoder-cache connector waits so for node 0's cache to hold an item before the
    /// encoder answers its request). A remote reader whose connection goes meanwhile is
    /// dropped, as in a send, and not waited for.
    ///
    /// # Errors
    ///
    /// An [`EnqueueError`]: [`Timeout`](EnqueueError::Timeout) naming the reader still
    /// behind; [`ShutDown`](EnqueueError::ShutDown) once the writer is shut down;
    /// [`Cancelled`](EnqueueError::Cancelled) or [`Other`](EnqueueError::Other) with the
    /// error of `wait`'s hook; [`Transport`](EnqueueError::Transport) for the socket's.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// // No remote reader: nothing to wait for.
    /// writer.wait_remote_taken(Duration::from_secs(1))?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_remote_taken<'w>(
        &mut self,
        wait: impl Into<WaitSpec<'w>>,
    ) -> Result<(), EnqueueError> {
        let canceller = self.canceller.clone();
        let what = "the writer waiting for its remote readers to take what was sent";
        let mut wait = wait.into().into_wait(what, self.policy, canceller.flag());
        let r = fork::check(self._ctx.made_in(), "queue writer")
            .map_err(Error::from)
            .and_then(|()| self.check_open())
            .and_then(|()| match self.remote.as_mut() {
                Some(remote) => remote.wait_taken(&mut wait),
                None => Ok(()),
            });
        r.map_err(|e| EnqueueError::from_core(self.why(e)))
    }

    /// Parts sent by copy because the arena had no room.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert_eq!(writer.arena_fallbacks(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn arena_fallbacks(&self) -> u64 {
        self.arena.as_ref().map_or(0, |a| a.fallbacks())
    }

    /// The tensor arena, if the queue has one (made or not yet).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// let arena = writer.arena().expect("local readers: an arena");
    /// # let _ = arena;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn arena(&self) -> Option<&LazyArenaWriter> {
        self.arena.as_ref()
    }

    /// The tensor arena, to make it ([`LazyArenaWriter::make`]) or return leases whose
    /// holds are gone ([`ArenaWriter::reclaim`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// let arena = writer.arena_mut().expect("local readers: an arena");
    /// arena.make()?.reserve(1 << 20)?; // the first MiB taken in /dev/shm now
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn arena_mut(&mut self) -> Option<&mut LazyArenaWriter> {
        self.arena.as_mut()
    }

    /// Zero-copy writing: wait for the next chunk and return its data to fill; publish
    /// it with [`commit_write`](Self::commit_write). Only for queues whose readers are
    /// all local (remote readers cannot see chunks).
    ///
    /// # Errors
    ///
    /// [`WriteChunkError::WrongRole`] for a queue with remote readers or without a ring;
    /// [`WriteChunkError::Os`] when `/dev/shm` has no room for the whole chunk;
    /// [`WriteChunkError::Timeout`] when `wait` runs out before the next chunk is free;
    /// [`WriteChunkError::ReaderDied`] for a local reader that died holding it (under
    /// `DeadReaderPolicy::Raise`); [`WriteChunkError::ShutDown`] once the writer is shut
    /// down; [`WriteChunkError::Cancelled`] or [`WriteChunkError::Other`] with the error
    /// of `wait`'s hook.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// let chunk = writer.acquire_write(Duration::from_secs(10))?;
    /// chunk[..5].copy_from_slice(b"hello");
    /// writer.commit_write()?;
    /// let got = reader.dequeue(Duration::from_secs(10))?; // the whole chunk
    /// assert_eq!(&got[..5], b"hello");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire_write<'w>(
        &mut self,
        wait: impl Into<WaitSpec<'w>>,
    ) -> Result<&mut [u8], WriteChunkError> {
        self.acquire_write_core(wait.into())
            .map_err(WriteChunkError::from_core)?;
        let ring = self.ring.as_mut().expect("acquired");
        Ok(ring.data_mut().expect("acquired"))
    }

    /// [`acquire_write`](Self::acquire_write) with the crate's error, the chunk not
    /// borrowed.
    fn acquire_write_core(&mut self, wait: WaitSpec<'_>) -> Result<()> {
        let (canceller, what) = (self.canceller.clone(), self.waiting_for_a_chunk.clone());
        let mut wait = wait
            .into_wait(&what, self.policy, canceller.flag())
            .learning(&self.history);
        fork::check(self._ctx.made_in(), "queue writer")?;
        self.check_open()?;
        if let Err(e) = self.acquire_write_unchecked(&mut wait) {
            return Err(self.why(e));
        }
        Ok(())
    }

    /// Wait for the next chunk (no data borrowed: see `acquire_write`).
    fn acquire_write_unchecked(&mut self, wait: &mut Wait) -> Result<()> {
        if self.n_remote_reader > 0 {
            return Err(Error::WrongRole(
                "acquire_write needs all readers to be local; this queue has remote readers".into(),
            ));
        }
        let ring = self
            .ring
            .as_mut()
            .ok_or_else(|| Error::WrongRole("this queue has no shared-memory ring".into()))?;
        // The caller may fill the whole chunk: reserve all of it in /dev/shm first.
        let whole = ring.ring().max_chunk_bytes();
        if !ring.reserve(whole)? {
            return Err(Error::Os(OsError::NoSpace {
                name: ring.ring().name().to_owned(),
                needed: whole as u64,
                available: shmq_os::segment::shm_free_bytes().unwrap_or(0),
            }));
        }
        ring.acquire(wait).map(drop)
    }

    /// Publish the chunk from [`acquire_write`](Self::acquire_write); readers see it
    /// whole (a chunk of `max_chunk_bytes`).
    ///
    /// # Errors
    ///
    /// [`WriteChunkError::ShutDown`] once the writer is shut down;
    /// [`WriteChunkError::WrongRole`], and nothing published, for a queue without a
    /// ring or without a chunk acquired first; [`WriteChunkError::Os`] when another
    /// process truncated the ring while the chunk was written; [`WriteChunkError::Other`]
    /// for a writer used in a forked child.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.acquire_write(Duration::from_secs(10))?.fill(1);
    /// writer.commit_write()?;
    /// assert!(reader.dequeue(Duration::from_secs(10))?.iter().all(|&b| b == 1));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn commit_write(&mut self) -> Result<(), WriteChunkError> {
        self.commit_write_core().map_err(WriteChunkError::from_core)
    }

    /// [`commit_write`](Self::commit_write) with the crate's error.
    fn commit_write_core(&mut self) -> Result<()> {
        fork::check(self._ctx.made_in(), "queue writer")?;
        self.check_open()?;
        let ring = self
            .ring
            .as_mut()
            .ok_or_else(|| Error::WrongRole("this queue has no shared-memory ring".into()))?;
        let n = ring.ring().max_chunk_bytes();
        ring.commit(n, ChunkKind::Raw)
    }
}

impl Drop for Writer {
    /// The writer's normal end tells the readers, as [`close`](Self::close) does (a
    /// writer that dies without it is seen as dead instead).
    fn drop(&mut self) {
        self.close();
    }
}
