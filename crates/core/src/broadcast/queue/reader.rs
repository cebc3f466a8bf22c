//! The reading side of a queue ([`Reader`]): a local reader takes messages from the ring
//! (parts in the tensor arena as private views, oversized messages from the overflow
//! socket), a remote reader from its TCP subscription. Uses the ring's reader, the
//! arena, the framing and the transport.
//!
//! Zero-copy reading of one chunk ([`Reader::acquire_read`], [`Reader::finish_read`])
//! hands out a [`ChunkView`]: a private (copy-on-write) mapping of the chunk, made
//! here, whose life cycle ([`ChunkEnd`]: detached or retired when the chunk is given
//! back) is the reader's, so every user of the reader (Rust, or the Python bindings) gets
//! the same semantics.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::array::{Array, ArrayMeta};
use super::super::framing::{self, Format, PartRef};
use super::super::ring::{ChunkKind, Ring, RingReader};
use super::super::wait_any::ReadyTarget;
use super::{Canceller, Handle, chunk_changed};
use crate::arena::{ArenaReader, ArenaView};
use crate::error::{
    DequeueError, Error, FinishReadError, OpenError, QueueError, Result, TryDequeueError,
};
use crate::remote::RemoteReader;
use crate::transport::Subscriber;
use crate::wait::{Wait, WaitHistory, WaitPolicy, WaitSpec};
use shmq_os::fork::{self, LeakInChild};
use shmq_os::private_map::{PrivateFile, PrivateMap};

enum Source {
    Local {
        ring: RingReader,
        overflow: Subscriber,
        /// The queue's tensor arena, if it has one (opened at first use).
        arena: ArenaSlot,
        /// The ring's file, to map chunks privately for `acquire_read` (opened at
        /// first use).
        chunk_file: Option<PrivateFile>,
    },
    Remote {
        sub: RemoteReader,
    },
}

/// A local reader's view of the queue's tensor arena: named in the handle, opened when
/// the first message that refers to it comes (the writer makes the segment at first use,
/// before it sends any such message).
struct ArenaSlot {
    name: Option<String>,
    index: usize,
    open: Option<Arc<ArenaReader>>,
}

impl ArenaSlot {
    /// The arena as `refs` need it: opened now if one of them is in the arena and it is
    /// not open yet; `None` if the queue has none (or `refs` need none and it is not open).
    fn for_refs(&mut self, refs: &[PartRef]) -> Result<Option<&Arc<ArenaReader>>> {
        if self.open.is_none() && refs.iter().any(|r| matches!(r, PartRef::Arena(_))) {
            if let Some(name) = self.name.as_deref() {
                self.open = Some(Arc::new(ArenaReader::open(name, self.index)?));
            }
        }
        Ok(self.open.as_ref())
    }

    /// An error once the arena, if it is open here, was found truncated: a view this
    /// reader handed out may read zeros now, so every call says so, also one whose
    /// message has no part in the arena (atomic loads: see `ArenaReader::check_faults`).
    fn check_faults(&self) -> Result<()> {
        self.open.as_ref().map_or(Ok(()), |a| a.check_faults())
    }
}

/// How long a local reader still waits for what the writer sent over the socket (its
/// go-ahead, an overflow message) after it saw the writer shut down (and, for a message,
/// go away): sent just before, it may still be on its way.
const READY_GRACE: Duration = Duration::from_secs(1);

/// A message as a reader takes it: plain bytes, or a message of several parts (a body
/// and the buffers it refers to, see [`Message::Parts`](super::Message::Parts)).
#[derive(Debug)]
#[non_exhaustive]
pub enum Received<'a> {
    Bytes(&'a [u8]),
    Parts(Vec<Part<'a>>),
    /// A typed array ([`Message::Array`](super::Message::Array), Python's
    /// `enqueue_array`): its fields, checked against its data.
    Array {
        meta: ArrayMeta,
        data: Part<'a>,
    },
}

impl Received<'_> {
    /// What the message is, in words, for an error naming a mismatch.
    pub fn kind_words(&self) -> String {
        match self {
            Received::Bytes(_) => "raw bytes (enqueue, or Python's enqueue_bytes)".into(),
            Received::Parts(p) => format!(
                "a message of {} part(s) (a Python writer's enqueue of a pickled object, or \
                 enqueue_parts)",
                p.len()
            ),
            Received::Array { meta, .. } => format!(
                "a typed array ({} {:?}: enqueue_array)",
                meta.dtype, meta.shape
            ),
        }
    }
}

/// The message that `parts` of `format` make: an array's header is read and checked
/// against its data here (an error if it is malformed; the parts are dropped with it).
fn received(format: Format, parts: Vec<Part<'_>>) -> Result<Received<'_>> {
    match format {
        Format::Parts => Ok(Received::Parts(parts)),
        Format::Array => {
            let [header, data]: [Part<'_>; 2] = parts.try_into().map_err(|p: Vec<Part<'_>>| {
                Error::InvalidArgument(format!(
                    "malformed array message: {} parts, not 2 (a header and the data)",
                    p.len()
                ))
            })?;
            let meta = ArrayMeta::decode(&header, data.len())?;
            Ok(Received::Array { meta, data })
        }
    }
}

/// One part of a received message.
#[derive(Debug)]
pub enum Part<'a> {
    /// Bytes in the chunk (or in a frame), valid while the message is being taken.
    Borrowed(&'a [u8]),
    /// A ZeroMQ frame, owned (its bytes are writable and stay valid as long as it does).
    Frame(zmq::Message),
    /// Bytes in the tensor arena, mapped privately (see [`ArenaView`]).
    Arena(ArenaView),
}

impl std::ops::Deref for Part<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Part::Borrowed(b) => b,
            Part::Frame(m) => m,
            Part::Arena(v) => v,
        }
    }
}

/// A part of a received message that outlives the chunk it came in: a copy of bytes
/// from the chunk, a ZeroMQ frame, or a private view of the tensor arena (no copy).
#[derive(Debug)]
pub enum OwnedPart {
    Copied(Vec<u8>),
    Frame(zmq::Message),
    Arena(ArenaView),
}

impl std::ops::Deref for OwnedPart {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            OwnedPart::Copied(v) => v,
            OwnedPart::Frame(m) => m,
            OwnedPart::Arena(v) => v,
        }
    }
}

impl std::ops::DerefMut for OwnedPart {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            OwnedPart::Copied(v) => v,
            OwnedPart::Frame(m) => m,
            OwnedPart::Arena(v) => v,
        }
    }
}

impl From<Part<'_>> for OwnedPart {
    fn from(p: Part<'_>) -> OwnedPart {
        match p {
            Part::Borrowed(b) => OwnedPart::Copied(b.to_vec()),
            Part::Frame(m) => OwnedPart::Frame(m),
            Part::Arena(v) => OwnedPart::Arena(v),
        }
    }
}

/// A message as [`Reader::dequeue_parts`] returns it: its parts, owned (a plain message
/// is one part); a typed array is an error naming it (consumed).
pub(crate) fn own_parts(m: Received<'_>) -> Result<Vec<OwnedPart>> {
    match m {
        Received::Bytes(b) => Ok(vec![OwnedPart::Copied(b.to_vec())]),
        Received::Parts(p) => Ok(p.into_iter().map(OwnedPart::from).collect()),
        other => Err(Error::InvalidArgument(format!(
            "this message was sent as {}; read it with dequeue_array (the message is \
             consumed)",
            other.kind_words()
        ))),
    }
}

/// A message as [`Reader::dequeue_array`] returns it: a typed array; any other message
/// is an error naming what it is (consumed).
pub(crate) fn own_array(m: Received<'_>) -> Result<Array> {
    match m {
        Received::Array { meta, data } => Ok(Array::new(meta, data.into())),
        other => Err(Error::InvalidArgument(format!(
            "this message was sent as {}, not as a typed array; read it with {} (the \
             message is consumed)",
            other.kind_words(),
            if matches!(other, Received::Bytes(_)) {
                "dequeue"
            } else {
                "dequeue_parts"
            }
        ))),
    }
}

/// What one look of an async receive found ([`Reader::async_step`]).
#[derive(Debug)]
pub(crate) enum AsyncStep<R> {
    /// The message, taken.
    Taken(R),
    /// Nothing yet: wait until this target is ready, then look again.
    Wait(ReadyTarget),
    /// A message larger than a chunk, whose mark is in the ring and whose bytes are still
    /// on their way over the socket (sent before the mark): look again at once.
    Retry,
}

/// The parts named by `refs`: inline ones borrowed from `block`, frames taken from
/// `frames`, arena ones mapped from `arena`. On an error, the arena holds of the parts
/// not mapped are dropped (the message is consumed either way).
fn resolve_parts<'a>(
    refs: &[PartRef],
    block: &'a [u8],
    frames: &mut [Option<zmq::Message>],
    arena: Option<&Arc<ArenaReader>>,
) -> Result<Vec<Part<'a>>> {
    let mut out = Vec::with_capacity(refs.len());
    for (i, r) in refs.iter().enumerate() {
        let part = match *r {
            PartRef::Inline { offset, len } => Ok(Part::Borrowed(&block[offset..offset + len])),
            PartRef::Frame { index } => frames
                .get_mut(index)
                .and_then(Option::take)
                .map(Part::Frame)
                .ok_or_else(|| Error::InvalidArgument("malformed message: a frame named twice".into())),
            PartRef::Arena(a) => match arena {
                Some(arena) => arena.view(&a).map(Part::Arena),
                None => Err(Error::InvalidArgument(
                    "a message refers to the tensor arena, which this reader cannot map (a remote reader?)"
                        .into(),
                )),
            },
        };
        match part {
            Ok(p) => out.push(p),
            Err(e) => {
                release_arena_refs(&refs[i + 1..], arena);
                return Err(e);
            }
        }
    }
    Ok(out)
}

/// Drop this reader's holds on the arena parts in `refs` (a message not used).
fn release_arena_refs(refs: &[PartRef], arena: Option<&Arc<ArenaReader>>) {
    if let Some(arena) = arena {
        for r in refs {
            if let PartRef::Arena(a) = r {
                arena.release(a);
            }
        }
    }
}

/// Call `f` on the message carried by `frames`: one frame is plain bytes, more are a
/// descriptor block and the frames it names (a message of parts is never one frame: the
/// writer adds an empty one if it would be).
fn take_frames<R>(
    frames: Vec<zmq::Message>,
    arena: Option<&mut ArenaSlot>,
    f: impl FnOnce(Received<'_>) -> R,
) -> Result<R> {
    if frames.len() == 1 {
        return Ok(f(Received::Bytes(&frames[0])));
    }
    let mut frames: Vec<Option<zmq::Message>> = frames.into_iter().map(Some).collect();
    let block = frames[0].take().expect("at least two frames");
    let (format, refs) = framing::decode_as(&block, frames.len())?;
    let arena = match arena {
        Some(slot) => slot.for_refs(&refs)?,
        None => None,
    };
    let parts = resolve_parts(&refs, &block, &mut frames, arena)?;
    Ok(f(received(format, parts)?))
}

/// A chunk as [`Reader::acquire_read`] hands it out, to read (and write) in place.
///
/// For a message in the ring: a mapping of the chunk's bytes of its own, private
/// (copy-on-write): writes through it stay in this process and never reach the ring.
/// What becomes of it when the chunk is given back is for [`Reader::finish_read`] to say
/// ([`ChunkEnd`]): either way it never shows the writer's next message in that chunk.
/// For an oversized message (an overflow mark, [`is_overflow`](Self::is_overflow)): the
/// message as it came over the socket (its first frame), owned.
///
/// The view and the reader share the mapping (the reader keeps it until
/// `finish_chunk`, to detach or retire it there): only for callers that hold no borrow
/// of the view's bytes across that call ([`Reader::acquire_chunk_unborrowed`] is
/// `unsafe` for this; the safe API is [`ChunkRead`], which borrows the reader).
pub struct ChunkView {
    data: ChunkData,
}

enum ChunkData {
    /// A private mapping of the chunk's data, shared with the reader until `finish_read`.
    Mapped(Arc<PrivateMap>),
    /// An overflow message's bytes (the first frame from the socket).
    Message(zmq::Message),
}

impl ChunkView {
    /// Whether this is an overflow message (bytes from the socket, not a mapping of the
    /// chunk).
    pub fn is_overflow(&self) -> bool {
        matches!(self.data, ChunkData::Message(_))
    }

    /// The private mapping of the chunk (`None` for an overflow message), for the Python
    /// bindings' view, which keeps it alive.
    pub fn private_map(&self) -> Option<&Arc<PrivateMap>> {
        match &self.data {
            ChunkData::Mapped(m) => Some(m),
            ChunkData::Message(_) => None,
        }
    }
}

impl fmt::Debug for ChunkView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChunkView")
            .field("overflow", &self.is_overflow())
            .field("len", &self.len())
            .finish()
    }
}

impl std::ops::Deref for ChunkView {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.data {
            ChunkData::Mapped(m) => m,
            ChunkData::Message(m) => m,
        }
    }
}

impl std::ops::DerefMut for ChunkView {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.data {
            // SAFETY: the mapping is private to this process and stays mapped as long as
            // the Arc; the reader's copy of the Arc touches its bytes only in
            // `finish_read` (detach: writes each page's byte with its own value; retire:
            // zero pages in place), which the caller calls with no borrow of them alive
            // (see the type's docs).
            ChunkData::Mapped(m) => unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), m.len()) },
            ChunkData::Message(m) => m,
        }
    }
}

/// What [`Reader::finish_read`] does with the private mapping of the chunk that
/// [`Reader::acquire_read`] handed out (nothing, for an overflow message).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkEnd {
    /// The caller still uses the view: give it a private copy of every page it has not
    /// written yet (one copy of the bytes), so it keeps the message it showed.
    Detach,
    /// The caller is done with the view: replace its pages in place by zero pages (no
    /// copy), so that whatever still points into it reads zeros from then on.
    Retire,
}

/// A chunk from [`Reader::acquire_read`], read (and written) in place through a private
/// copy-on-write mapping of it: writes stay in this process and never reach the ring.
/// It borrows the reader, so it is gone before [`Reader::finish_read`] gives the chunk
/// back. For an oversized message ([`is_overflow`](Self::is_overflow)) it is the message
/// as it came over the socket.
pub struct ChunkRead<'r> {
    view: ChunkView,
    _reader: PhantomData<&'r mut Reader>,
}

impl ChunkRead<'_> {
    /// Whether this is an overflow message (bytes from the socket, not the chunk).
    pub fn is_overflow(&self) -> bool {
        self.view.is_overflow()
    }
}

impl fmt::Debug for ChunkRead<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.view.fmt(f)
    }
}

impl std::ops::Deref for ChunkRead<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.view
    }
}

impl std::ops::DerefMut for ChunkRead<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.view
    }
}

/// The reading side of a queue (one per reader process).
pub struct Reader {
    source: Source,
    rank: usize,
    /// A message received over a socket (all its frames), waiting to be taken.
    pending: Option<Vec<zmq::Message>>,
    /// The writer's go-ahead has come: `wait_until_ready` returns at once from then on
    /// (the writer sends it once; waiting for a second would wait forever).
    ready: bool,
    canceller: Canceller,
    policy: WaitPolicy,
    /// This reader's recent waits (how long its waits poll before sleeping).
    history: Arc<WaitHistory>,
    /// What this reader's waits are for (in warnings and timeout errors).
    what: Arc<str>,
    ready_what: Arc<str>,
    /// The mapping of the chunk [`acquire_read`](Reader::acquire_read) handed out, until
    /// [`finish_read`](Reader::finish_read) detaches or retires it.
    open_chunk: Option<Arc<PrivateMap>>,
    /// Since when this reader's wait has seen the writer gone (before an overflow
    /// message came): after [`READY_GRACE`] the wait fails.
    /// Kept here, not in the wait's closure, so that a wait started over (see
    /// [`WaitClock`](crate::wait::WaitClock)) still ends; a new wait starts afresh.
    writer_gone_since: Option<Instant>,
    _ctx: LeakInChild<zmq::Context>,
}

impl fmt::Debug for Reader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reader")
            .field("rank", &self.rank)
            .field("local", &self.is_local())
            .finish()
    }
}

impl Reader {
    /// Join the queue of `handle` as the reader of rank `rank`: local if `rank` is in
    /// `handle.local_reader_ranks` (its reader index is the position there), else remote.
    ///
    /// # Errors
    ///
    /// An [`OpenError`]: [`BadHandle`](OpenError::BadHandle) for a `rank` the handle does
    /// not have, or a handle that does not hold together; [`Os`](OpenError::Os) when the
    /// ring or arena segment cannot be opened (gone, not this user's, or not a queue's);
    /// [`Transport`](OpenError::Transport) when a socket cannot connect;
    /// [`WriterDied`](OpenError::WriterDied) for a writer already dead.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// let writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let reader = shmq::Reader::open(writer.handle(), 0)?;
    /// assert!(reader.is_local());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open(handle: &Handle, rank: usize) -> Result<Reader, OpenError> {
        Self::open_with(
            handle,
            rank,
            WaitPolicy::for_processes(handle.local_reader_ranks.len() + 1),
        )
    }

    /// Join the queue named `name` on this machine as the reader of rank `rank`, without
    /// its handle: as [`open`](Self::open) with the handle its writer recorded under the
    /// name. The writer holds the name while it lives: a Rust writer made with
    /// [`QueueOptions::name`](super::QueueOptions::name) and
    /// [`record_name`](super::QueueOptions::record_name), or a Python
    /// `MessageQueue(..., name=...)` (the two share one directory of names and one record
    /// format: see [`crate::names`]). Names are scoped to the user: another user's queue
    /// of the same name is not found.
    ///
    /// # Errors
    ///
    /// An [`OpenError`]: [`Name`](OpenError::Name) with
    /// [`NameError::NotFound`](crate::names::NameError::NotFound) when no live writer
    /// holds the name (never made, closed, or a damaged record), or
    /// [`NameError::Gone`](crate::names::NameError::Gone) when its writer died (its record
    /// is removed then, and the name is free); [`Os`](OpenError::Os) with
    /// [`NamesDirRefused`](crate::error::OsError::NamesDirRefused) when the user's
    /// directory of names may be entered by others; [`BadHandle`](OpenError::BadHandle)
    /// for a recorded handle that does not parse; and [`open`](Self::open)'s.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// use std::time::Duration;
    /// // The writer, in one process:
    /// let mut opts = shmq::QueueOptions::local(1);
    /// opts.name = Some("steps".into());
    /// opts.record_name = true;
    /// let writer = shmq::Writer::new(opts)?;
    /// // A reader, in another process of the same user (or Python's
    /// // `MessageQueue.open("steps", 0)`):
    /// let mut reader = shmq::Reader::open_by_name("steps", 0)?;
    /// reader.wait_until_ready(Duration::from_secs(10))?;
    /// # drop(writer);
    /// # Ok::<(), shmq::Error>(())
    /// ```
    pub fn open_by_name(name: &str, rank: usize) -> Result<Reader, OpenError> {
        let handle = Self::handle_by_name(name).map_err(OpenError::from_core)?;
        Self::open(&handle, rank)
    }

    /// The handle the writer of the queue `name` recorded (see
    /// [`open_by_name`](Self::open_by_name)).
    fn handle_by_name(name: &str) -> Result<Handle> {
        let record = crate::names::lookup(crate::names::Kind::Queue, name)?;
        record
            .text("handle")
            .ok_or_else(|| {
                Error::from(crate::names::NameError::NotFound {
                    kind: crate::names::Kind::Queue,
                    name: name.to_owned(),
                    uid: shmq_os::names_dir::uid(),
                })
            })?
            .parse()
    }

    /// [`open`](Self::open), waiting as `policy` says in this reader's blocking calls.
    ///
    /// # Errors
    ///
    /// An [`OpenError`]: [`BadHandle`](OpenError::BadHandle) for a `rank` the handle does
    /// not have, or a handle that does not hold together; [`Os`](OpenError::Os) when the
    /// ring or arena segment cannot be opened (gone, not this user's, or not a queue's);
    /// [`Transport`](OpenError::Transport) when a socket cannot connect;
    /// [`WriterDied`](OpenError::WriterDied) for a writer already dead.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// let writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let policy = shmq::wait::WaitPolicy::for_processes(2);
    /// let reader = shmq::Reader::open_with(writer.handle(), 0, policy)?;
    /// assert_eq!(reader.wait_policy(), policy);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open_with(
        handle: &Handle,
        rank: usize,
        policy: WaitPolicy,
    ) -> Result<Reader, OpenError> {
        Self::open_core(handle, rank, policy).map_err(OpenError::from_core)
    }

    /// [`open_with`](Self::open_with), its errors as the parts of the reader say them.
    fn open_core(handle: &Handle, rank: usize, policy: WaitPolicy) -> Result<Reader> {
        let ctx = crate::transport::shared_context();
        let source = match handle.local_reader_ranks.iter().position(|&r| r == rank) {
            Some(index) => {
                let buffer = handle.buffer.as_ref().ok_or_else(|| {
                    Error::InvalidArgument("the handle has local readers but no buffer".into())
                })?;
                let addr = handle.local_subscribe_addr.as_deref().ok_or_else(|| {
                    Error::InvalidArgument(
                        "the handle has local readers but no local address".into(),
                    )
                })?;
                let ring = Arc::new(Ring::open(&buffer.name)?);
                let ring = RingReader::new(ring, index)?;
                let arena = ArenaSlot {
                    name: handle.arena.clone(),
                    index,
                    open: None,
                };
                let overflow = Subscriber::connect(&ctx, addr, false)?;
                Source::Local {
                    ring,
                    overflow,
                    arena,
                    chunk_file: None,
                }
            }
            None => {
                let addr = handle.remote_subscribe_addr.as_deref().ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "rank {rank} is not a local reader ({:?}) and the queue has no remote readers",
                        handle.local_reader_ranks
                    ))
                })?;
                let secret = handle.remote_secret.ok_or_else(|| {
                    Error::InvalidArgument(
                        "the handle has no secret for remote readers (made by an older shmq?)"
                            .into(),
                    )
                })?;
                Source::Remote {
                    sub: RemoteReader::connect(
                        &ctx,
                        addr,
                        handle.remote_addr_ipv6,
                        secret,
                        rank as u64,
                    )?,
                }
            }
        };
        let what = match &source {
            Source::Local { ring, .. } => format!(
                "local reader {} (rank {rank}) of queue {} waiting for the writer",
                ring.reader_index(),
                ring.ring().queue_words()
            ),
            Source::Remote { .. } => format!("remote reader (rank {rank}) waiting for the writer"),
        };
        let ring = match &source {
            Source::Local { ring, .. } => Some(ring.ring().clone()),
            Source::Remote { .. } => None,
        };
        Ok(Reader {
            source,
            rank,
            pending: None,
            ready: false,
            canceller: Canceller::new(ring, false),
            policy,
            history: Arc::default(),
            ready_what: format!("{what} to be ready").into(),
            what: what.into(),
            open_chunk: None,
            writer_gone_since: None,
            _ctx: LeakInChild::new(ctx),
        })
    }

    /// This reader's rank in the queue.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert_eq!(reader.rank(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Whether this reader reads through shared memory (else over TCP).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert!(reader.is_local()); // rank 0 is in the handle's local ranks
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn is_local(&self) -> bool {
        matches!(self.source, Source::Local { .. })
    }
    /// The local reader's index in the ring.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert_eq!(reader.reader_index(), Some(0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reader_index(&self) -> Option<usize> {
        match &self.source {
            Source::Local { ring, .. } => Some(ring.reader_index()),
            Source::Remote { .. } => None,
        }
    }
    /// The ring, for a local reader.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert_eq!(reader.ring().map(|r| r.n_reader()), Some(1));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn ring(&self) -> Option<&Arc<Ring>> {
        match &self.source {
            Source::Local { ring, .. } => Some(ring.ring()),
            Source::Remote { .. } => None,
        }
    }
    /// Index of the chunk this reader reads next (0 for a remote reader).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(b"one", Duration::from_secs(10))?;
    /// reader.dequeue(Duration::from_secs(10))?;
    /// assert_eq!(reader.current_idx(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn current_idx(&self) -> usize {
        match &self.source {
            Source::Local { ring, .. } => ring.current_idx(),
            Source::Remote { .. } => 0,
        }
    }
    /// Describes this reader's waits in warnings and timeout errors.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// assert!(!reader.wait_description().is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_description(&self) -> &str {
        &self.what
    }

    /// How this reader's blocking calls wait.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// let policy = reader.wait_policy();
    /// # let _ = policy;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_policy(&self) -> WaitPolicy {
        self.policy
    }

    /// Ends this reader's blocked calls (from any thread, without locking the reader)
    /// with [`DequeueError::Cancelled`] (`Error::Cancelled` for the calls that return
    /// `shmq::Error`), now and from then on.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// let canceller = reader.canceller();
    /// std::thread::spawn(move || canceller.cancel()).join().unwrap();
    /// assert!(matches!(reader.dequeue(None), Err(shmq::broadcast::DequeueError::Cancelled)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn canceller(&self) -> Canceller {
        self.canceller.clone()
    }

    /// Wake this reader's blocked calls with [`DequeueError::Cancelled`]
    /// (`Error::Cancelled` for the calls that return `shmq::Error`), now and from now on.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// reader.shutdown();
    /// assert!(matches!(reader.dequeue(None), Err(shmq::broadcast::DequeueError::Cancelled)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shutdown(&self) {
        self.canceller.cancel();
    }

    /// The wait `spec` describes, for `what`, with this reader's policy and canceller.
    fn wait<'a, 'w: 'a>(
        &self,
        what: &'a str,
        spec: WaitSpec<'w>,
        canceller: &'a Canceller,
    ) -> Wait<'a> {
        spec.into_wait(what, self.policy, canceller.flag())
            .learning(&self.history)
    }

    /// This reader's side of the handshake (see [`Writer::wait_until_ready`](super::Writer::wait_until_ready)).
    ///
    /// A local reader waits for nothing: it subscribed when it was made, the writer
    /// sends nothing before every reader's subscription is in, and the writer's go-ahead
    /// is taken by the first receive that meets it (see `transport::Subscriber`). So no message
    /// can be lost once this returns, and no order of `wait_until_ready` calls across
    /// queues (a worker's steps then results, a scheduler's results then steps)
    /// deadlocks: a reader's readiness never waits on its writer's. A writer that has
    /// died is a [`QueueError::DeadWriter`] now; one that shut down is
    /// the next receive's error.
    ///
    /// A remote reader waits only for its connection to the writer's port (ZeroMQ's
    /// handshake, which the writer's I/O thread answers whatever its program does); the
    /// writer's WELCOME and start are taken by its first receive, so across machines too
    /// no order of the calls deadlocks. A writer that cannot be reached ends the wait
    /// (see `remote`). Once ready, later calls return at once.
    ///
    /// # Errors
    ///
    /// A [`DequeueError`]: [`Timeout`](DequeueError::Timeout) when `wait` runs out first;
    /// [`Cancelled`](DequeueError::Cancelled) once [`shutdown`](Self::shutdown) (or the
    /// [`canceller`](Self::canceller)) was called; [`WriterShutDown`](DequeueError::WriterShutDown)
    /// once the writer shut the queue down and every message it sent before was received;
    /// [`WriterDied`](DequeueError::WriterDied) for a writer that died;
    /// [`Remote`](DequeueError::Remote) for a remote reader's lost or refused stream;
    /// [`Transport`](DequeueError::Transport) for a failed socket;
    /// [`Other`](DequeueError::Other) with the error of `wait`'s hook.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// reader.wait_until_ready(Duration::from_secs(10))?; // a local reader: at once
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_until_ready<'w>(
        &mut self,
        wait: impl Into<WaitSpec<'w>>,
    ) -> Result<(), DequeueError> {
        let (canceller, what) = (self.canceller.clone(), self.ready_what.clone());
        let mut wait = self.wait(&what, wait.into(), &canceller);
        self.wait_until_ready_in(&mut wait)
            .map_err(DequeueError::from_core)
    }

    /// [`wait_until_ready`](Self::wait_until_ready) under a wait already built.
    fn wait_until_ready_in(&mut self, wait: &mut Wait) -> Result<()> {
        fork::check(self._ctx.made_in(), "queue reader")?;
        if self.ready {
            return Ok(());
        }
        match &mut self.source {
            Source::Local { overflow, ring, .. } => {
                RingReader::check_writer(ring.ring())?;
                overflow.take_ready_if_here()?;
            }
            // The connection only (see above); a remote writer that cannot be reached,
            // or goes, ends the wait (see `remote`).
            Source::Remote { sub } => sub.wait_ready(wait)?,
        }
        self.ready = true;
        Ok(())
    }

    /// Wait until the next message can be taken without blocking (then take it with
    /// [`try_take_message`](Self::try_take_message)). For an overflow mark or a remote
    /// reader this receives the message from the socket.
    ///
    /// # Errors
    ///
    /// A [`DequeueError`]: [`Timeout`](DequeueError::Timeout) when `wait` runs out first;
    /// [`Cancelled`](DequeueError::Cancelled) once [`shutdown`](Self::shutdown) (or the
    /// [`canceller`](Self::canceller)) was called; [`WriterShutDown`](DequeueError::WriterShutDown)
    /// once the writer shut the queue down and every message it sent before was received;
    /// [`WriterDied`](DequeueError::WriterDied) for a writer that died;
    /// [`MessageLost`](DequeueError::MessageLost) for a message larger than a chunk whose
    /// writer's process ended before it arrived; [`Remote`](DequeueError::Remote) for a
    /// remote reader's lost or refused stream; [`Os`](DequeueError::Os) for a segment
    /// broken by another process; [`Transport`](DequeueError::Transport) for a failed
    /// socket; [`Other`](DequeueError::Other) with the error of `wait`'s hook.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(b"here", Duration::from_secs(10))?;
    /// reader.wait_message(Duration::from_secs(10))?;
    /// assert_eq!(reader.try_take(|b| b.to_vec())?, b"here");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait_message<'w>(&mut self, wait: impl Into<WaitSpec<'w>>) -> Result<(), DequeueError> {
        let (canceller, what) = (self.canceller.clone(), self.what.clone());
        let mut wait = self.wait(&what, wait.into(), &canceller);
        self.wait_message_in(&mut wait)
            .map_err(DequeueError::from_core)
    }

    /// [`wait_message`](Self::wait_message) under a wait already built.
    fn wait_message_in(&mut self, wait: &mut Wait) -> Result<()> {
        fork::check(self._ctx.made_in(), "queue reader")?;
        if !wait.is_resumed() {
            self.writer_gone_since = None;
        }
        match &mut self.source {
            Source::Local {
                ring,
                overflow,
                arena,
                ..
            } => {
                arena.check_faults()?;
                let info = ring.wait(wait)?;
                if info.kind == ChunkKind::Overflow && self.pending.is_none() {
                    // The writer sent the message before the mark; only a writer that
                    // died in between leaves us waiting, which the liveness check sees.
                    // One that shut down and went away has sent it too, but its process
                    // may have ended before ZeroMQ delivered it: after a grace, lost.
                    let r = ring.ring().clone();
                    let gone_since = &mut self.writer_gone_since;
                    let alive = &mut || {
                        if r.writer_closed() && r.writer_gone() {
                            let since = *gone_since.get_or_insert_with(Instant::now);
                            if since.elapsed() >= READY_GRACE {
                                return Err(Error::Queue(QueueError::WriterGoneMidMessage));
                            }
                        }
                        RingReader::check_writer(&r)
                    };
                    match overflow.recv_frames(wait, alive) {
                        Ok(frames) => self.pending = Some(frames),
                        Err(e @ Error::Queue(QueueError::WriterGoneMidMessage)) => {
                            // Lost: its mark is consumed, so that the next call reads
                            // the messages after it (still in the ring), not this again.
                            if ring.poll().is_some() {
                                ring.finish();
                            }
                            self.writer_gone_since = None;
                            return Err(e);
                        }
                        Err(e) => return Err(e),
                    }
                    self.writer_gone_since = None;
                }
            }
            Source::Remote { sub } => {
                if self.pending.is_none() {
                    // A remote writer gone without shutdown ends the wait (see `remote`).
                    self.pending = Some(sub.recv_frames(wait)?);
                }
            }
        }
        Ok(())
    }

    /// Take the next message if it is here now: call `f` on it (bytes borrowed from
    /// shared memory for a message in a chunk) and move on.
    ///
    /// # Errors
    ///
    /// [`TryDequeueError::Empty`] when no message is here yet (nothing taken, `f` not
    /// called); else [`TryDequeueError::Failed`] with what [`dequeue`](Self::dequeue)
    /// would fail with (never its [`Timeout`](DequeueError::Timeout)): the writer shut
    /// down or died, the reader shut down, a malformed message
    /// ([`WrongKind`](DequeueError::WrongKind), consumed), a segment broken by another
    /// process.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// use shmq::broadcast::{Message, Received, TryDequeueError};
    /// let nothing = reader.try_take_message(|_| ());
    /// assert!(matches!(nothing, Err(TryDequeueError::Empty))); // nothing yet
    /// writer.enqueue(Message::Parts(&[b"body", b"buffer"]), Duration::from_secs(10))?;
    /// reader.wait_message(Duration::from_secs(10))?;
    /// let n = reader.try_take_message(|m| match m {
    ///     Received::Parts(parts) => parts.len(),
    ///     _ => 0,
    /// })?;
    /// assert_eq!(n, 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_take_message<R>(
        &mut self,
        f: impl FnOnce(Received<'_>) -> R,
    ) -> std::result::Result<R, TryDequeueError> {
        TryDequeueError::from_taken(self.take_message_now(f))
    }

    /// [`try_take_message`](Self::try_take_message) as the crate's parts use it:
    /// `Ok(None)` when nothing is here yet.
    pub(crate) fn take_message_now<R>(
        &mut self,
        f: impl FnOnce(Received<'_>) -> R,
    ) -> Result<Option<R>> {
        fork::check(self._ctx.made_in(), "queue reader")?;
        match &mut self.source {
            Source::Local {
                ring,
                overflow,
                arena,
                ..
            } => {
                ring.ring().check_intact()?;
                arena.check_faults()?;
                let Some(info) = ring.poll() else {
                    return Ok(None);
                };
                let out = match info.kind {
                    ChunkKind::Overflow => {
                        if self.pending.is_none() {
                            self.pending = overflow.try_recv_frames()?;
                        }
                        let Some(frames) = self.pending.take() else {
                            return Ok(None);
                        };
                        take_frames(frames, Some(arena), f)
                    }
                    ChunkKind::Framed => {
                        let data = ring.data(&info);
                        framing::decode_as(data, 0)
                            .and_then(|(format, refs)| {
                                let arena = arena.for_refs(&refs)?;
                                received(format, resolve_parts(&refs, data, &mut [], arena)?)
                            })
                            .map(f)
                    }
                    ChunkKind::Body => {
                        Ok(f(Received::Parts(vec![Part::Borrowed(ring.data(&info))])))
                    }
                    _ => Ok(f(Received::Bytes(ring.data(&info)))),
                };
                // Consumed even if it could not be read: the next message is the next one.
                ring.finish();
                // A message read from the zero pages of a truncated segment is no message.
                ring.ring().check_intact()?;
                arena.check_faults()?;
                out.map(Some)
            }
            Source::Remote { sub } => {
                if self.pending.is_none() {
                    self.pending = sub.try_recv_frames()?;
                }
                match self.pending.take() {
                    Some(frames) => take_frames(frames, None, f).map(Some),
                    None => Ok(None),
                }
            }
        }
    }

    /// Take the next plain message if it is here now: call `f` on its bytes. A message
    /// of several parts (a Python writer's pickled object included) is an error here,
    /// naming the mismatch; it is consumed and the reader goes on with the next one.
    ///
    /// # Errors
    ///
    /// As [`try_take_message`](Self::try_take_message); a message of parts or an array
    /// is [`TryDequeueError::Failed`] with [`DequeueError::WrongKind`] naming what it is
    /// (consumed).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(b"raw", Duration::from_secs(10))?;
    /// reader.wait_message(Duration::from_secs(10))?;
    /// assert_eq!(reader.try_take(|b| b.len())?, 3);
    /// assert!(reader.try_take(|b| b.len()).is_err_and(|e| e.is_empty()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn try_take<R>(
        &mut self,
        f: impl FnOnce(&[u8]) -> R,
    ) -> std::result::Result<R, TryDequeueError> {
        TryDequeueError::from_taken(self.take_now(f))
    }

    /// [`try_take`](Self::try_take) as the crate's parts use it: `Ok(None)` when nothing
    /// is here yet.
    pub(crate) fn take_now<R>(&mut self, f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>> {
        match self.take_message_now(|m| match m {
            Received::Bytes(b) => Ok(f(b)),
            other => Err(Error::InvalidArgument(format!(
                "this message was sent as {}, not as raw bytes; read it with {}, or have a \
                 Python writer send raw bytes with enqueue_bytes (the message is consumed)",
                other.kind_words(),
                if matches!(other, Received::Array { .. }) {
                    "dequeue_array"
                } else {
                    "dequeue_parts"
                }
            ))),
        })? {
            Some(r) => r.map(Some),
            None => Ok(None),
        }
    }

    /// Wait for the next message (as [`dequeue`](Self::dequeue) does: this reader's wait
    /// policy and canceller, `wait` a timeout or a [`WaitSpec`]) and call `f` on its bytes
    /// where they are, in shared memory: no copy. Raw bytes only, as `dequeue`.
    ///
    /// # Errors
    ///
    /// [`DequeueError::WrongKind`] for a message of another kind than this call takes,
    /// naming what it is (consumed: the reader goes on with the next one); else as
    /// [`dequeue`](Self::dequeue).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(b"in place", Duration::from_secs(10))?;
    /// let len = reader.dequeue_view(Duration::from_secs(10), |b| b.len())?;
    /// assert_eq!(len, 8);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn dequeue_view<'w, R>(
        &mut self,
        wait: impl Into<WaitSpec<'w>>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, DequeueError> {
        self.dequeue_view_core(wait.into(), f)
            .map_err(DequeueError::from_core)
    }

    /// [`dequeue_view`](Self::dequeue_view), its errors as the parts of the reader say
    /// them.
    fn dequeue_view_core<R>(
        &mut self,
        wait: WaitSpec<'_>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R> {
        let mut f = Some(f);
        if let Some(r) = self.take_now(|b| (f.take().expect("called once"))(b))? {
            return Ok(r);
        }
        let (canceller, what) = (self.canceller.clone(), self.what.clone());
        let mut wait = self.wait(&what, wait, &canceller);
        self.dequeue_in(&mut wait, f.take().expect("not called yet"))
    }

    /// Wait for the next message and call `f` on its bytes, under a wait already built.
    fn dequeue_in<R>(&mut self, wait: &mut Wait, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.wait_message_in(wait)?;
        self.take_now(f)?.ok_or_else(|| self.not_ready_any_more())
    }

    /// See `chunk_changed`; for a remote reader (which has no chunks) it cannot happen.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// let e = reader.not_ready_any_more();
    /// assert!(!e.to_string().is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn not_ready_any_more(&self) -> Error {
        match &self.source {
            Source::Local { ring, .. } => chunk_changed(ring.ring()),
            Source::Remote { .. } => Error::WrongRole("no message is ready".into()),
        }
    }

    /// One look of an async receive (`broadcast::async_wait`), which never blocks:
    /// `take` the next message if it is here; else say what to wait for, or the error
    /// the blocking call would end with now (the writer's shutdown once every message
    /// is read, its death, this reader cancelled). A remote reader's is an error: no
    /// futex rings for its TCP stream.
    pub(crate) fn async_step<R>(
        &mut self,
        take: &mut impl FnMut(&mut Reader) -> Result<Option<R>>,
    ) -> Result<AsyncStep<R>> {
        if !self.is_local() {
            return Err(Error::WrongRole(
                "a remote reader cannot be awaited: its messages come over TCP, which no \
                 futex wakes; wait for it in a thread (a blocking dequeue in \
                 std::thread::spawn or your runtime's spawn_blocking)"
                    .into(),
            ));
        }
        loop {
            if let Some(r) = take(self)? {
                self.writer_gone_since = None;
                return Ok(AsyncStep::Taken(r));
            }
            // Nothing taken. As a blocking wait ends: cancelled, then what the ring says.
            if self.canceller.is_cancelled() {
                return Err(Error::Cancelled);
            }
            let Source::Local { ring, .. } = &mut self.source else {
                unreachable!("checked above")
            };
            let r = ring.ring().clone();
            match ring.poll() {
                Some(info) if info.kind == ChunkKind::Overflow => {
                    // The bytes are on their way (see `wait_message_in`, whose checks
                    // these are): only a writer that died, or shut down and went away
                    // before ZeroMQ delivered them, leaves them missing.
                    RingReader::check_writer(&r)?;
                    if r.writer_closed() && r.writer_gone() {
                        let since = *self.writer_gone_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= READY_GRACE {
                            // Lost: its mark is consumed (the next call reads on).
                            ring.finish();
                            self.writer_gone_since = None;
                            return Err(Error::Queue(QueueError::WriterGoneMidMessage));
                        }
                    }
                    return Ok(AsyncStep::Retry);
                }
                // Published after `take` looked: take it.
                Some(_) => continue,
                None if r.writer_closed() => {
                    // Once more after seeing the mark (see `RingReader::wait`).
                    if ring.poll().is_some() {
                        continue;
                    }
                    return Err(Error::Queue(QueueError::WriterShutDown {
                        queue: Some(r.queue_words()),
                    }));
                }
                None => {
                    RingReader::check_writer(&r)?;
                    let target = ReadyTarget::of(self).expect("a local reader has a target");
                    return Ok(AsyncStep::Wait(target));
                }
            }
        }
    }

    /// Wait for the next message and return a copy of it.
    ///
    /// # Errors
    ///
    /// A [`DequeueError`]: [`Timeout`](DequeueError::Timeout) when `wait` runs out first;
    /// [`Cancelled`](DequeueError::Cancelled) once [`shutdown`](Self::shutdown) (or the
    /// [`canceller`](Self::canceller)) was called; [`WriterShutDown`](DequeueError::WriterShutDown)
    /// once the writer shut the queue down and every message it sent before was received;
    /// [`WriterDied`](DequeueError::WriterDied) for a writer that died;
    /// [`MessageLost`](DequeueError::MessageLost) for a message larger than a chunk whose
    /// writer's process ended before it arrived; [`Remote`](DequeueError::Remote) for a
    /// remote reader's lost or refused stream; [`Os`](DequeueError::Os) for a segment
    /// broken by another process; [`Transport`](DequeueError::Transport) for a failed
    /// socket; [`Other`](DequeueError::Other) with the error of `wait`'s hook;
    /// [`WrongKind`](DequeueError::WrongKind) for a message of parts or an array
    /// (consumed: the reader goes on with the next one).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(b"hello", Duration::from_secs(10))?;
    /// assert_eq!(reader.dequeue(Duration::from_secs(10))?, b"hello");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn dequeue<'w>(&mut self, wait: impl Into<WaitSpec<'w>>) -> Result<Vec<u8>, DequeueError> {
        self.dequeue_view(wait, <[u8]>::to_vec)
    }

    /// Wait for the next message and return its parts (a plain message is one part):
    /// small parts copied out of the chunk, large ones as private views of the tensor
    /// arena that hold their bytes until dropped (no copy).
    ///
    /// # Errors
    ///
    /// As [`dequeue`](Self::dequeue) (a typed array is refused, consumed).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(shmq::Message::Parts(&[b"body", &[7u8; 4096]]), Duration::from_secs(10))?;
    /// let parts = reader.dequeue_parts(Duration::from_secs(10))?;
    /// assert_eq!((parts.len(), parts[1].len()), (2, 4096));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn dequeue_parts<'w>(
        &mut self,
        wait: impl Into<WaitSpec<'w>>,
    ) -> Result<Vec<OwnedPart>, DequeueError> {
        self.dequeue_owned(wait.into(), own_parts)
            .map_err(DequeueError::from_core)
    }

    /// The next message as `own` makes it (waiting as `wait` says), its errors as the
    /// parts of the reader say them.
    fn dequeue_owned<T>(
        &mut self,
        wait: WaitSpec<'_>,
        own: fn(Received<'_>) -> Result<T>,
    ) -> Result<T> {
        if let Some(m) = self.take_message_now(own)? {
            return m;
        }
        let (canceller, what) = (self.canceller.clone(), self.what.clone());
        let mut wait = self.wait(&what, wait, &canceller);
        self.wait_message_in(&mut wait)?;
        self.take_message_now(own)?
            .ok_or_else(|| self.not_ready_any_more())?
    }

    /// Wait for the next message, a typed array (see [`crate::broadcast::array`]), and
    /// return it: its data copied out of the chunk if small, a private view of the tensor
    /// arena (or the frame it came in) if large: no copy. Any other message is an error
    /// naming what it is; it is consumed and the reader goes on with the next one.
    ///
    /// # Errors
    ///
    /// [`DequeueError::WrongKind`] for a message of another kind than this call takes,
    /// naming what it is (consumed: the reader goes on with the next one); else as
    /// [`dequeue`](Self::dequeue).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(&shmq::ArrayRef::new(&[1i64, 2, 3, 4], &[2, 2])?, Duration::from_secs(10))?;
    /// let array = reader.dequeue_array(Duration::from_secs(10))?;
    /// assert_eq!(array.shape(), [2, 2]);
    /// assert_eq!(array.to_vec::<i64>()?, [1, 2, 3, 4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn dequeue_array<'w>(
        &mut self,
        wait: impl Into<WaitSpec<'w>>,
    ) -> Result<Array, DequeueError> {
        self.dequeue_owned(wait.into(), own_array)
            .map_err(DequeueError::from_core)
    }

    /// Zero-copy reading of a chunk filled with
    /// [`Writer::acquire_write`](super::Writer::acquire_write): wait for it and return a
    /// private view of it ([`ChunkRead`]: writes through it stay in this process). The
    /// view borrows the reader: drop it, then give the chunk back with
    /// [`finish_read`](Self::finish_read). For an overflow mark the view is the message
    /// that came over the socket. Only for a local reader.
    ///
    /// # Errors
    ///
    /// A [`DequeueError`]: [`Timeout`](DequeueError::Timeout) when `wait` runs out first;
    /// [`Cancelled`](DequeueError::Cancelled) once [`shutdown`](Self::shutdown) (or the
    /// [`canceller`](Self::canceller)) was called; [`WriterShutDown`](DequeueError::WriterShutDown)
    /// once the writer shut the queue down and every message it sent before was received;
    /// [`WriterDied`](DequeueError::WriterDied) for a writer that died;
    /// [`MessageLost`](DequeueError::MessageLost) for a message larger than a chunk whose
    /// writer's process ended before it arrived; [`Remote`](DequeueError::Remote) for a
    /// remote reader's lost or refused stream; [`Os`](DequeueError::Os) for a segment
    /// broken by another process; [`Transport`](DequeueError::Transport) for a failed
    /// socket; [`Other`](DequeueError::Other) with the error of `wait`'s hook;
    /// [`WrongRole`](DequeueError::WrongRole) for a remote reader.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(b"zero-copy", Duration::from_secs(10))?;
    /// let chunk = reader.acquire_read(Duration::from_secs(10))?;
    /// assert_eq!(&chunk[..], b"zero-copy");
    /// drop(chunk);
    /// reader.finish_read()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire_read<'w>(
        &mut self,
        wait: impl Into<WaitSpec<'w>>,
    ) -> Result<ChunkRead<'_>, DequeueError> {
        let view = self.acquire_chunk(wait).map_err(DequeueError::from_core)?;
        Ok(ChunkRead {
            view,
            _reader: PhantomData,
        })
    }

    /// [`acquire_read`](Self::acquire_read) whose view does not borrow the reader (the
    /// Python binding's: its view may outlive the chunk); the caller says at
    /// [`finish_chunk`](Self::finish_chunk) what becomes of it, and holds no borrow of
    /// its bytes across that call.
    pub(crate) fn acquire_chunk<'w>(&mut self, wait: impl Into<WaitSpec<'w>>) -> Result<ChunkView> {
        let (canceller, what) = (self.canceller.clone(), self.what.clone());
        let mut wait = self.wait(&what, wait.into(), &canceller);
        self.acquire_chunk_with(&mut wait)
    }

    /// [`acquire_read`](Self::acquire_read) for a binding whose view may outlive the
    /// chunk (Python's `acquire_read`: its buffer object is made of the view's pointer).
    ///
    /// # Safety
    /// No borrow of the returned view's bytes (through `Deref` / `DerefMut`) may be alive
    /// across [`finish_chunk`](Self::finish_chunk), which writes the mapping's pages in
    /// place (`Detach`: each page's byte with its own value; `Retire`: zero pages).
    /// Pointers kept past it read the detached copy or zeros, never the writer's next
    /// message.
    ///
    /// # Errors
    ///
    /// As [`acquire_read`](Self::acquire_read).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// use shmq::broadcast::queue::ChunkEnd;
    /// writer.enqueue(b"kept", Duration::from_secs(10))?;
    /// // SAFETY: no borrow of the view's bytes lives across `finish_chunk` below.
    /// let view = unsafe { reader.acquire_chunk_unborrowed(Duration::from_secs(10))? };
    /// assert_eq!(&view[..], b"kept");
    /// reader.finish_chunk(ChunkEnd::Detach)?;
    /// assert_eq!(&view[..], b"kept"); // a private copy now
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub unsafe fn acquire_chunk_unborrowed<'w>(
        &mut self,
        wait: impl Into<WaitSpec<'w>>,
    ) -> Result<ChunkView, DequeueError> {
        self.acquire_chunk(wait).map_err(DequeueError::from_core)
    }

    /// [`acquire_chunk`](Self::acquire_chunk) under a wait of the caller's own.
    pub(crate) fn acquire_chunk_with(&mut self, wait: &mut Wait) -> Result<ChunkView> {
        if !self.is_local() {
            return Err(Error::WrongRole(
                "acquire_read is only for local readers".into(),
            ));
        }
        // For an overflow mark this also receives the message, so it is consumed with
        // the chunk (and the next overflow message stays in step).
        self.wait_message_in(wait)?;
        let Source::Local {
            ring, chunk_file, ..
        } = &mut self.source
        else {
            unreachable!("checked above")
        };
        let info = ring.poll().ok_or_else(|| chunk_changed(ring.ring()))?;
        if info.kind == ChunkKind::Overflow {
            // The message came over the socket and is gone after finish_read: the view
            // owns its first frame. A message of several frames keeps them until then
            // (finish_read gives its arena parts back), so the view gets a copy.
            let message = match self.pending.as_mut() {
                Some(f) if f.len() == 1 => std::mem::replace(&mut f[0], zmq::Message::new()),
                Some(f) => zmq::Message::from(&f[0][..]),
                None => zmq::Message::new(),
            };
            return Ok(ChunkView {
                data: ChunkData::Message(message),
            });
        }
        let len = ring.data(&info).len();
        let r = ring.ring();
        // A mapping of the chunk of its own, private (copy-on-write): what the caller
        // makes of it can be detached from the chunk when the chunk is given back.
        let file = match chunk_file {
            Some(file) => file,
            None => chunk_file.insert(PrivateFile::open(r.name())?),
        };
        let map = Arc::new(file.map(r.data_file_offset(info.index)?, len)?);
        self.open_chunk = Some(map.clone());
        Ok(ChunkView {
            data: ChunkData::Mapped(map),
        })
    }

    /// Give back the chunk from [`acquire_read`](Self::acquire_read) (mark it as read),
    /// once its view is dropped. A message of several parts read this way gives its
    /// arena parts back.
    ///
    /// # Errors
    ///
    /// [`FinishReadError::WrongRole`] for a remote reader (it has no chunks);
    /// [`FinishReadError::Os`] when the chunk's private mapping cannot be given back, or
    /// when another process truncated the ring or the arena (what was read may have been
    /// zeros); [`FinishReadError::Other`] for a reader used in a forked child.
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// writer.enqueue(b"read in place", Duration::from_secs(10))?;
    /// let n = reader.acquire_read(Duration::from_secs(10))?.len();
    /// reader.finish_read()?;
    /// assert_eq!(n, 13);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn finish_read(&mut self) -> Result<(), FinishReadError> {
        self.finish_chunk(ChunkEnd::Retire)
    }

    /// Give back the chunk from
    /// [`acquire_chunk_unborrowed`](Self::acquire_chunk_unborrowed); the writer's next
    /// message in it never shows through its view. `end` says what becomes of the
    /// view's mapping first: [`ChunkEnd::Detach`] if the caller still uses the view,
    /// [`ChunkEnd::Retire`] if not.
    ///
    /// # Errors
    ///
    /// As [`finish_read`](Self::finish_read).
    ///
    /// # Examples
    ///
    /// ```
    /// # use shmq_core as shmq; // what the `shmq` crate re-exports
    /// # use std::time::Duration;
    /// let mut writer = shmq::Writer::new(shmq::QueueOptions::local(1))?;
    /// let mut reader = shmq::Reader::open(writer.handle(), 0)?;
    /// writer.wait_until_ready(Duration::from_secs(10))?;
    /// use shmq::broadcast::queue::ChunkEnd;
    /// writer.enqueue(b"done with", Duration::from_secs(10))?;
    /// // SAFETY: the view is dropped before `finish_chunk`.
    /// let view = unsafe { reader.acquire_chunk_unborrowed(Duration::from_secs(10))? };
    /// assert_eq!(&view[..], b"done with");
    /// drop(view);
    /// reader.finish_chunk(ChunkEnd::Retire)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn finish_chunk(&mut self, end: ChunkEnd) -> Result<(), FinishReadError> {
        self.finish_chunk_core(end)
            .map_err(FinishReadError::from_core)
    }

    /// [`finish_chunk`](Self::finish_chunk) with the crate's error.
    fn finish_chunk_core(&mut self, end: ChunkEnd) -> Result<()> {
        fork::check(self._ctx.made_in(), "queue reader")?;
        if let Some(map) = self.open_chunk.take() {
            match end {
                ChunkEnd::Detach => map.detach(),
                ChunkEnd::Retire => map.retire()?,
            }
        }
        match &mut self.source {
            Source::Local { ring, arena, .. } => {
                let pending = self.pending.take();
                if let Some(info) = ring.poll() {
                    let block: Option<(&[u8], usize)> = match (info.kind, &pending) {
                        (ChunkKind::Framed, _) => Some((ring.data(&info), 0)),
                        (ChunkKind::Overflow, Some(f)) if f.len() > 1 => Some((&f[0][..], f.len())),
                        _ => None,
                    };
                    if let Some(refs) = block.and_then(|(b, n)| framing::decode(b, n).ok()) {
                        if let Ok(arena) = arena.for_refs(&refs) {
                            release_arena_refs(&refs, arena);
                        }
                    }
                }
                ring.finish();
                // What the caller read may have been zeros (a peer truncated the ring or
                // the arena).
                ring.ring().check_intact()?;
                arena.check_faults()
            }
            Source::Remote { .. } => Err(Error::WrongRole(
                "finish_read is only for local readers".into(),
            )),
        }
    }
}
