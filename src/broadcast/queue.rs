//! [`Writer`] and [`Reader`]: bytes in, bytes out, to local readers through the ring and
//! to remote readers through ZeroMQ.
//!
//! A message that fits in a chunk goes in the next chunk and never touches ZeroMQ. A
//! larger one puts an overflow mark in the chunk and goes over the `ipc://` socket; the
//! writer publishes it *before* committing the mark, so a reader that sees the mark
//! finds the message already on its way. Remote readers get every message over TCP.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::ring::{
    ChunkInfo, ChunkKind, DeadReaderPolicy, Ring, RingHandle, RingReader, RingWriter,
};
use crate::error::{Error, Result};
use crate::transport::{Publisher, Subscriber};
use crate::wait::{no_peer, Wait, WaitPolicy};

/// How a writer is made. `Default` gives the engines' defaults: 10 chunks of 10 MiB.
#[derive(Clone, Debug)]
pub struct QueueOptions {
    /// All readers, local and remote.
    pub n_reader: usize,
    /// Readers on this machine (they read through shared memory).
    pub n_local_reader: usize,
    /// The ranks of the local readers; `None` means `0..n_local_reader`.
    pub local_reader_ranks: Option<Vec<usize>>,
    pub max_chunk_bytes: usize,
    pub max_chunks: usize,
    /// The IP remote readers connect to (default: this host's address, see
    /// [`default_connect_ip`]). Only used when there are remote readers.
    pub connect_ip: Option<String>,
    /// How the writer waits for room (spin, yield, then sleep); `None`: the default for
    /// this many processes ([`WaitPolicy::for_processes`]).
    pub wait: Option<WaitPolicy>,
    /// What the writer does when a local reader it waits for has died.
    pub on_dead_reader: DeadReaderPolicy,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            n_reader: 1,
            n_local_reader: 1,
            local_reader_ranks: None,
            max_chunk_bytes: 10 * 1024 * 1024,
            max_chunks: 10,
            connect_ip: None,
            wait: None,
            on_dead_reader: DeadReaderPolicy::Raise,
        }
    }
}

impl QueueOptions {
    /// `n_reader` readers, all on this machine.
    pub fn local(n_reader: usize) -> Self {
        QueueOptions {
            n_reader,
            n_local_reader: n_reader,
            ..Default::default()
        }
    }
}

/// The address remote readers should use to reach this host: `SHMQ_HOST_IP` if set
/// (else vLLM's `VLLM_HOST_IP`), else the first address the host name resolves to, else
/// `127.0.0.1`.
pub fn default_connect_ip() -> String {
    if let Ok(ip) = std::env::var("SHMQ_HOST_IP").or_else(|_| std::env::var("VLLM_HOST_IP")) {
        if !ip.trim().is_empty() {
            return ip.trim().to_owned();
        }
    }
    use std::net::ToSocketAddrs;
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        if let Ok(host) = std::str::from_utf8(&buf[..end]) {
            if let Ok(addrs) = (host, 0).to_socket_addrs() {
                if let Some(a) = addrs.map(|a| a.ip()).find(|ip| !ip.is_unspecified()) {
                    return a.to_string();
                }
            }
        }
    }
    "127.0.0.1".to_owned()
}

/// Everything a reader process needs to join a queue. Send it to readers however you
/// like; `Display`/`FromStr` give a one-line text form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handle {
    pub local_reader_ranks: Vec<usize>,
    pub buffer: Option<RingHandle>,
    pub local_subscribe_addr: Option<String>,
    pub remote_subscribe_addr: Option<String>,
    pub remote_addr_ipv6: bool,
}

const HANDLE_TAG: &str = "shmq-handle-1";

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ranks: Vec<String> = self
            .local_reader_ranks
            .iter()
            .map(|r| r.to_string())
            .collect();
        let buffer = self
            .buffer
            .as_ref()
            .map(|b| {
                format!(
                    "{},{},{},{}",
                    b.n_reader, b.max_chunk_bytes, b.max_chunks, b.name
                )
            })
            .unwrap_or_default();
        write!(
            f,
            "{HANDLE_TAG}|{}|{}|{}|{}|{}",
            ranks.join(","),
            buffer,
            self.local_subscribe_addr.as_deref().unwrap_or(""),
            self.remote_subscribe_addr.as_deref().unwrap_or(""),
            u8::from(self.remote_addr_ipv6)
        )
    }
}

impl FromStr for Handle {
    type Err = Error;
    fn from_str(s: &str) -> Result<Handle> {
        let bad = || Error::InvalidArgument(format!("not a shmq queue handle: {s:?}"));
        let parts: Vec<&str> = s.trim().split('|').collect();
        if parts.len() != 6 || parts[0] != HANDLE_TAG {
            return Err(bad());
        }
        let num = |t: &str| t.parse::<usize>().map_err(|_| bad());
        let local_reader_ranks = if parts[1].is_empty() {
            vec![]
        } else {
            parts[1].split(',').map(num).collect::<Result<_>>()?
        };
        let buffer = if parts[2].is_empty() {
            None
        } else {
            let b: Vec<&str> = parts[2].splitn(4, ',').collect();
            if b.len() != 4 {
                return Err(bad());
            }
            Some(RingHandle {
                n_reader: num(b[0])?,
                max_chunk_bytes: num(b[1])?,
                max_chunks: num(b[2])?,
                name: b[3].to_owned(),
            })
        };
        let opt = |t: &str| (!t.is_empty()).then(|| t.to_owned());
        Ok(Handle {
            local_reader_ranks,
            buffer,
            local_subscribe_addr: opt(parts[3]),
            remote_subscribe_addr: opt(parts[4]),
            remote_addr_ipv6: parts[5] == "1",
        })
    }
}

/// An error for the first local reader whose process (as its slot records it) is dead.
fn dead_local_reader(ring: &Ring) -> Result<()> {
    for r in 0..ring.n_reader() {
        if let Some(p) = ring.slot_info(Some(r))?.process {
            if !p.is_alive() {
                return Err(Error::DeadReader {
                    reader: r,
                    pid: p.pid,
                    chunk: 0,
                });
            }
        }
    }
    Ok(())
}

/// The error when a chunk seen as ready is not ready a moment later: only a writer that
/// breaks the protocol (or another process writing into the segment) can cause it.
fn chunk_changed(ring: &Ring) -> Error {
    Error::BadSegment {
        name: ring.name().to_owned(),
        reason: "a chunk changed while it was being read (is another process writing into this segment?)".into(),
    }
}

/// Ends one side's blocked calls from any thread, now and from then on: sets a flag the
/// waits check and wakes sleepers on the ring. Cheap to clone; needs no lock on the side.
#[derive(Clone, Debug)]
pub struct Canceller {
    flag: Arc<AtomicBool>,
    ring: Option<Arc<Ring>>,
    writer: bool,
}

impl Canceller {
    fn new(ring: Option<Arc<Ring>>, writer: bool) -> Canceller {
        Canceller {
            flag: Arc::new(AtomicBool::new(false)),
            ring,
            writer,
        }
    }

    pub fn cancel(&self) {
        // Relaxed: the flag carries no data (see `Wait`); the wake below makes sleepers
        // look at it.
        self.flag.store(true, Ordering::Relaxed);
        if let Some(ring) = &self.ring {
            // This wakes every sleeper of that side, also in other processes; they find
            // nothing new and sleep again.
            let bell = if self.writer {
                ring.chunk_freed()
            } else {
                ring.data_ready()
            };
            bell.doorbell().wake();
        }
    }

    pub fn is_cancelled(&self) -> bool {
        // Relaxed: as in `cancel`.
        self.flag.load(Ordering::Relaxed)
    }

    /// The flag for [`Wait::cancel_on`].
    pub fn flag(&self) -> &AtomicBool {
        &self.flag
    }
}

/// The writing side of a queue.
pub struct Writer {
    ring: Option<RingWriter>,
    local: Option<Publisher>,
    remote: Option<Publisher>,
    n_local_reader: usize,
    n_remote_reader: usize,
    handle: Handle,
    overflow_count: u64,
    policy: WaitPolicy,
    canceller: Canceller,
    // Declared last so the sockets above close before their context terminates.
    _ctx: zmq::Context,
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
    pub fn new(opts: QueueOptions) -> Result<Writer> {
        if opts.n_local_reader > opts.n_reader {
            return Err(Error::InvalidArgument(format!(
                "n_local_reader ({}) cannot exceed n_reader ({})",
                opts.n_local_reader, opts.n_reader
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
        let ctx = zmq::Context::new();
        let n_remote_reader = opts.n_reader - opts.n_local_reader;
        let (ring, local) = if opts.n_local_reader > 0 {
            let ring = Arc::new(Ring::create(
                opts.n_local_reader,
                opts.max_chunk_bytes,
                opts.max_chunks,
            )?);
            let local = Publisher::bind_ipc(&ctx, ring.name())?;
            let mut writer = RingWriter::new(ring);
            writer.on_dead_reader(opts.on_dead_reader);
            (Some(writer), Some(local))
        } else {
            (None, None)
        };
        let (remote, ipv6) = if n_remote_reader > 0 {
            let ip = opts.connect_ip.clone().unwrap_or_else(default_connect_ip);
            let (p, v6) = Publisher::bind_tcp(&ctx, &ip)?;
            (Some(p), v6)
        } else {
            (None, false)
        };
        let handle = Handle {
            local_reader_ranks: ranks,
            buffer: ring.as_ref().map(|r| r.ring().handle()),
            local_subscribe_addr: local.as_ref().map(|p| p.endpoint().to_owned()),
            remote_subscribe_addr: remote.as_ref().map(|p| p.endpoint().to_owned()),
            remote_addr_ipv6: ipv6,
        };
        let canceller = Canceller::new(ring.as_ref().map(|r| r.ring().clone()), true);
        Ok(Writer {
            ring,
            local,
            remote,
            n_local_reader: opts.n_local_reader,
            n_remote_reader,
            handle,
            overflow_count: 0,
            policy: opts
                .wait
                .unwrap_or_else(|| WaitPolicy::for_processes(opts.n_local_reader + 1)),
            canceller,
            _ctx: ctx,
        })
    }

    pub fn handle(&self) -> &Handle {
        &self.handle
    }
    pub fn n_local_reader(&self) -> usize {
        self.n_local_reader
    }
    pub fn n_remote_reader(&self) -> usize {
        self.n_remote_reader
    }
    /// The ring, if there are local readers.
    pub fn ring(&self) -> Option<&Arc<Ring>> {
        self.ring.as_ref().map(|r| r.ring())
    }
    /// Index of the chunk the next message goes to (0 without local readers).
    pub fn current_index(&self) -> usize {
        self.ring.as_ref().map_or(0, |r| r.current_index())
    }
    /// Messages sent over the overflow socket so far.
    pub fn overflow_count(&self) -> u64 {
        self.overflow_count
    }
    /// How this writer's own blocking calls wait.
    pub fn wait_policy(&self) -> WaitPolicy {
        self.policy
    }
    /// Local readers dropped after they died (with [`DeadReaderPolicy::Drop`]).
    pub fn dropped_readers(&self) -> Vec<usize> {
        self.ring
            .as_ref()
            .map_or_else(Vec::new, |r| r.dropped_readers())
    }
    /// Ends this writer's blocked calls (from any thread) with [`Error::Cancelled`].
    pub fn canceller(&self) -> Canceller {
        self.canceller.clone()
    }

    /// Wait until every reader has subscribed, then tell them the queue is ready.
    pub fn wait_until_ready(&mut self, timeout: Option<Duration>) -> Result<()> {
        let canceller = self.canceller.clone();
        let what = "the writer waiting for readers to subscribe";
        let mut wait = Wait::new(what, timeout)
            .policy(self.policy)
            .cancel_on(canceller.flag());
        self.wait_until_ready_with(&mut wait)
    }

    pub fn wait_until_ready_with(&mut self, wait: &mut Wait) -> Result<()> {
        if let Some(p) = self.local.as_mut() {
            // A local reader that died before subscribing would leave us waiting forever.
            let ring = self.ring.as_ref().map(|r| r.ring().clone());
            let mut readers_alive = || match &ring {
                Some(ring) => dead_local_reader(ring),
                None => Ok(()),
            };
            p.wait_for_subscribers(self.n_local_reader, wait, &mut readers_alive)?;
        }
        if let Some(p) = self.remote.as_mut() {
            p.wait_for_subscribers(self.n_remote_reader, wait, &mut no_peer)?;
        }
        Ok(())
    }

    /// Whether a message that fits in a chunk could be written without waiting.
    pub fn can_write(&self) -> bool {
        self.ring.as_ref().is_none_or(|r| r.can_write())
    }

    /// Send `msg` to every reader, waiting while the ring is full.
    pub fn enqueue(&mut self, msg: &[u8], timeout: Option<Duration>) -> Result<()> {
        if self.can_write() {
            // No wait needed: skip setting one up (clock read, canceller clone).
            return self.enqueue_with(msg, &mut Wait::ready_now());
        }
        let canceller = self.canceller.clone();
        let what = "the writer waiting for readers to free a chunk";
        let mut wait = Wait::new(what, timeout)
            .policy(self.policy)
            .cancel_on(canceller.flag());
        self.enqueue_with(msg, &mut wait)
    }

    pub fn enqueue_with(&mut self, msg: &[u8], wait: &mut Wait) -> Result<()> {
        if let Some(ring) = self.ring.as_mut() {
            if msg.len() <= ring.ring().max_chunk_bytes() {
                ring.write(msg, wait)?;
            } else {
                ring.acquire(wait)?;
                let local = self
                    .local
                    .as_ref()
                    .expect("local readers have an overflow socket");
                local.send(msg)?;
                ring.commit(msg.len(), ChunkKind::Overflow)?;
                self.overflow_count += 1;
            }
        }
        if let Some(remote) = self.remote.as_ref() {
            remote.send(msg)?;
        }
        Ok(())
    }

    /// Zero-copy writing: wait for the next chunk and return its data to fill; publish
    /// it with [`commit_write`](Self::commit_write). Only for queues whose readers are
    /// all local (remote readers cannot see chunks).
    pub fn acquire_write(&mut self, wait: &mut Wait) -> Result<&mut [u8]> {
        if self.n_remote_reader > 0 {
            return Err(Error::WrongRole(
                "acquire_write needs all readers to be local; this queue has remote readers".into(),
            ));
        }
        let ring = self
            .ring
            .as_mut()
            .ok_or_else(|| Error::WrongRole("this queue has no shared-memory ring".into()))?;
        ring.acquire(wait)?;
        Ok(ring.data_mut().expect("acquired"))
    }

    /// Publish the chunk from [`acquire_write`](Self::acquire_write); readers see it
    /// whole (a chunk of `max_chunk_bytes`).
    pub fn commit_write(&mut self) -> Result<()> {
        let ring = self
            .ring
            .as_mut()
            .ok_or_else(|| Error::WrongRole("this queue has no shared-memory ring".into()))?;
        let n = ring.ring().max_chunk_bytes();
        ring.commit(n, ChunkKind::Raw)
    }
}

enum Source {
    Local {
        ring: RingReader,
        overflow: Subscriber,
    },
    Remote {
        sub: Subscriber,
    },
}

/// The reading side of a queue (one per reader process).
pub struct Reader {
    source: Source,
    rank: usize,
    /// A message received over a socket, waiting to be taken.
    pending: Option<zmq::Message>,
    canceller: Canceller,
    policy: WaitPolicy,
    what: String,
    _ctx: zmq::Context,
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
    pub fn open(handle: &Handle, rank: usize) -> Result<Reader> {
        Self::open_with(
            handle,
            rank,
            WaitPolicy::for_processes(handle.local_reader_ranks.len() + 1),
        )
    }

    /// [`open`](Self::open), waiting as `policy` says in this reader's blocking calls.
    pub fn open_with(handle: &Handle, rank: usize, policy: WaitPolicy) -> Result<Reader> {
        let ctx = zmq::Context::new();
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
                let overflow = Subscriber::connect(&ctx, addr, false)?;
                Source::Local { ring, overflow }
            }
            None => {
                let addr = handle.remote_subscribe_addr.as_deref().ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "rank {rank} is not a local reader ({:?}) and the queue has no remote readers",
                        handle.local_reader_ranks
                    ))
                })?;
                Source::Remote {
                    sub: Subscriber::connect(&ctx, addr, handle.remote_addr_ipv6)?,
                }
            }
        };
        let what = match &source {
            Source::Local { ring, .. } => format!(
                "local reader {} (rank {rank}) waiting for the writer",
                ring.reader_index()
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
            canceller: Canceller::new(ring, false),
            policy,
            what,
            _ctx: ctx,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn is_local(&self) -> bool {
        matches!(self.source, Source::Local { .. })
    }
    /// The local reader's index in the ring.
    pub fn reader_index(&self) -> Option<usize> {
        match &self.source {
            Source::Local { ring, .. } => Some(ring.reader_index()),
            Source::Remote { .. } => None,
        }
    }
    /// The ring, for a local reader.
    pub fn ring(&self) -> Option<&Arc<Ring>> {
        match &self.source {
            Source::Local { ring, .. } => Some(ring.ring()),
            Source::Remote { .. } => None,
        }
    }
    /// Index of the chunk this reader reads next (0 for a remote reader).
    pub fn current_index(&self) -> usize {
        match &self.source {
            Source::Local { ring, .. } => ring.current_index(),
            Source::Remote { .. } => 0,
        }
    }
    /// Describes this reader's waits in warnings and timeout errors.
    pub fn wait_description(&self) -> &str {
        &self.what
    }

    /// How this reader's blocking calls wait.
    pub fn wait_policy(&self) -> WaitPolicy {
        self.policy
    }

    /// Ends this reader's blocked calls (from any thread, without locking the reader)
    /// with [`Error::Cancelled`], now and from then on.
    pub fn canceller(&self) -> Canceller {
        self.canceller.clone()
    }

    /// Wake this reader's blocked calls with [`Error::Cancelled`], now and from now on.
    pub fn shutdown(&self) {
        self.canceller.cancel();
    }

    /// A wait for `what`, with this reader's policy and canceller.
    fn wait<'a>(
        &self,
        what: &'a str,
        timeout: Option<Duration>,
        canceller: &'a Canceller,
    ) -> Wait<'a> {
        Wait::new(what, timeout)
            .policy(self.policy)
            .cancel_on(canceller.flag())
    }

    /// Wait for the writer's go-ahead (see [`Writer::wait_until_ready`]).
    pub fn wait_until_ready(&mut self, timeout: Option<Duration>) -> Result<()> {
        let canceller = self.canceller.clone();
        let what = format!("{} to be ready", self.what);
        let mut wait = self.wait(&what, timeout, &canceller);
        self.wait_until_ready_with(&mut wait)
    }

    pub fn wait_until_ready_with(&mut self, wait: &mut Wait) -> Result<()> {
        match &self.source {
            Source::Local { overflow, ring } => {
                let ring = ring.ring().clone();
                overflow.wait_ready(wait, &mut || RingReader::check_writer(&ring))
            }
            // A remote writer's liveness cannot be checked from here.
            Source::Remote { sub } => sub.wait_ready(wait, &mut no_peer),
        }
    }

    /// Wait until the next message can be taken without blocking. For an overflow mark
    /// or a remote reader this receives the message from the socket.
    pub fn wait_message(&mut self, wait: &mut Wait) -> Result<()> {
        match &mut self.source {
            Source::Local { ring, overflow } => {
                let info = ring.wait(wait)?;
                if info.kind == ChunkKind::Overflow && self.pending.is_none() {
                    // The writer sent the message before the mark; only a writer that
                    // died in between leaves us waiting, which the liveness check sees.
                    let r = ring.ring().clone();
                    let alive = &mut || RingReader::check_writer(&r);
                    self.pending = Some(overflow.recv(wait, alive)?);
                }
            }
            Source::Remote { sub } => {
                if self.pending.is_none() {
                    // A remote writer's liveness cannot be checked from here.
                    self.pending = Some(sub.recv(wait, &mut no_peer)?);
                }
            }
        }
        Ok(())
    }

    /// Take the next message if it is here now: call `f` on its bytes (borrowed from
    /// shared memory for a message in a chunk) and move on. `None`: nothing ready yet.
    pub fn try_take<R>(&mut self, f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>> {
        match &mut self.source {
            Source::Local { ring, overflow } => {
                let Some(info) = ring.poll() else {
                    return Ok(None);
                };
                let out = match info.kind {
                    ChunkKind::Overflow => {
                        if self.pending.is_none() {
                            self.pending = overflow.try_recv()?;
                        }
                        let Some(m) = self.pending.take() else {
                            return Ok(None);
                        };
                        f(&m)
                    }
                    _ => f(ring.data(&info)),
                };
                ring.finish();
                Ok(Some(out))
            }
            Source::Remote { sub } => {
                if self.pending.is_none() {
                    self.pending = sub.try_recv()?;
                }
                Ok(self.pending.take().map(|m| f(&m)))
            }
        }
    }

    /// Wait for the next message and call `f` on its bytes.
    pub fn dequeue_with<R>(&mut self, wait: &mut Wait, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.wait_message(wait)?;
        self.try_take(f)?.ok_or_else(|| self.not_ready_any_more())
    }

    /// See [`chunk_changed`]; for a remote reader (which has no chunks) it cannot happen.
    pub fn not_ready_any_more(&self) -> Error {
        match &self.source {
            Source::Local { ring, .. } => chunk_changed(ring.ring()),
            Source::Remote { .. } => Error::WrongRole("no message is ready".into()),
        }
    }

    /// Wait for the next message and return a copy of it.
    pub fn dequeue(&mut self, timeout: Option<Duration>) -> Result<Vec<u8>> {
        if let Some(m) = self.try_take(|b| b.to_vec())? {
            return Ok(m);
        }
        let canceller = self.canceller.clone();
        let what = std::mem::take(&mut self.what);
        let mut wait = self.wait(&what, timeout, &canceller);
        let r = self.dequeue_with(&mut wait, |b| b.to_vec());
        self.what = what;
        r
    }

    /// Zero-copy reading of a chunk filled with [`Writer::acquire_write`]: wait for it
    /// and return its data; release it with [`finish_read`](Self::finish_read).
    pub fn acquire_read(&mut self, wait: &mut Wait) -> Result<ChunkInfo> {
        if !self.is_local() {
            return Err(Error::WrongRole(
                "acquire_read is only for local readers".into(),
            ));
        }
        // For an overflow mark this also receives the message, so it is consumed with
        // the chunk (and the next overflow message stays in step).
        self.wait_message(wait)?;
        match &self.source {
            Source::Local { ring, .. } => ring.poll().ok_or_else(|| chunk_changed(ring.ring())),
            Source::Remote { .. } => unreachable!("checked above"),
        }
    }

    /// Data of a chunk from [`acquire_read`](Self::acquire_read): the chunk itself, or
    /// for an overflow mark the message that came over the socket.
    pub fn chunk_data(&self, info: &ChunkInfo) -> &[u8] {
        match (&self.source, info.kind) {
            (Source::Local { .. }, ChunkKind::Overflow) => self.pending.as_deref().unwrap_or(&[]),
            (Source::Local { ring, .. }, _) => ring.data(info),
            (Source::Remote { .. }, _) => &[],
        }
    }

    /// Mark the chunk from [`acquire_read`](Self::acquire_read) as read.
    pub fn finish_read(&mut self) -> Result<()> {
        match &mut self.source {
            Source::Local { ring, .. } => {
                self.pending = None;
                ring.finish();
                Ok(())
            }
            Source::Remote { .. } => Err(Error::WrongRole(
                "finish_read is only for local readers".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_text_round_trip() {
        let h = Handle {
            local_reader_ranks: vec![0, 2, 5],
            buffer: Some(RingHandle {
                n_reader: 3,
                max_chunk_bytes: 1024,
                max_chunks: 4,
                name: "shmq_ring_1_abc".into(),
            }),
            local_subscribe_addr: Some("ipc://@shmq_ring_1_abc".into()),
            remote_subscribe_addr: Some("tcp://[::1]:5555".into()),
            remote_addr_ipv6: true,
        };
        assert_eq!(h.to_string().parse::<Handle>().unwrap(), h);
        let empty = Handle {
            local_reader_ranks: vec![],
            buffer: None,
            local_subscribe_addr: None,
            remote_subscribe_addr: None,
            remote_addr_ipv6: false,
        };
        assert_eq!(empty.to_string().parse::<Handle>().unwrap(), empty);
        assert!("nonsense".parse::<Handle>().is_err());
    }

    #[test]
    fn options_are_checked() {
        let e = Writer::new(QueueOptions {
            n_reader: 1,
            n_local_reader: 2,
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("cannot exceed"), "{e}");
        let e = Writer::new(QueueOptions {
            local_reader_ranks: Some(vec![0, 1]),
            ..QueueOptions::local(1)
        })
        .unwrap_err();
        assert!(
            e.to_string().contains("local_reader_ranks has 2 entries"),
            "{e}"
        );
    }

    #[test]
    fn local_and_remote_in_threads() {
        let mut w = Writer::new(QueueOptions {
            n_reader: 2,
            n_local_reader: 1,
            max_chunk_bytes: 64,
            max_chunks: 2,
            connect_ip: Some("127.0.0.1".into()),
            ..Default::default()
        })
        .unwrap();
        let h = w.handle().clone();
        let msgs: Vec<Vec<u8>> = (0..200).map(|i| vec![i as u8; (i * 7) % 150]).collect();
        std::thread::scope(|s| {
            for rank in [0, 1] {
                let h = h.clone();
                let msgs = msgs.clone();
                s.spawn(move || {
                    let mut r = Reader::open(&h, rank).unwrap();
                    assert_eq!(r.is_local(), rank == 0);
                    r.wait_until_ready(Some(Duration::from_secs(10))).unwrap();
                    for m in &msgs {
                        assert_eq!(&r.dequeue(Some(Duration::from_secs(10))).unwrap(), m);
                    }
                });
            }
            w.wait_until_ready(Some(Duration::from_secs(10))).unwrap();
            for m in &msgs {
                w.enqueue(m, Some(Duration::from_secs(10))).unwrap();
            }
        });
        assert!(w.overflow_count() > 0);
    }

    #[test]
    fn shutdown_wakes_a_blocked_reader() {
        let w = Writer::new(QueueOptions {
            max_chunk_bytes: 64,
            max_chunks: 2,
            ..QueueOptions::local(1)
        })
        .unwrap();
        let mut r = Reader::open(w.handle(), 0).unwrap();
        let canceller = r.canceller();
        std::thread::scope(|s| {
            s.spawn(move || {
                // Long enough for the reader to be asleep on the futex.
                std::thread::sleep(Duration::from_millis(200));
                canceller.cancel();
            });
            let started = std::time::Instant::now();
            assert!(matches!(
                r.dequeue(Some(Duration::from_secs(10))),
                Err(Error::Cancelled)
            ));
            // Woken by cancel(), not by the reader's own 500 ms liveness slice.
            let waited = started.elapsed();
            assert!(waited < Duration::from_millis(420), "{waited:?}");
        });
    }
}
