//! The writer's side of a ring ([`RingWriter`]): it fills chunks in order, waits (spin,
//! yield, sleep) while the next one is still unread, and decides what to do about a
//! reader that died. Uses the ring, its slots, the flag protocol and [`crate::wait`].
//!
//! # Memory is committed as it is used
//! The ring's segment is sparse: at creation only the header, the slots and the chunk
//! states are reserved in `/dev/shm` (`fallocate`); chunk data is reserved by the
//! writer, per chunk, up to what a message needs, before it writes there
//! ([`RingWriter::reserve`]; in steps of [`RESERVE_STEP`], so small messages make one
//! syscall per chunk in all). What a chunk has reserved (its high-water mark) is kept in
//! the writer's own memory and never shrinks. Readers read only the `len` bytes the
//! writer published, which it reserved and wrote, so no process touches a page that is
//! not there (a read of a missing tmpfs page would allocate it, and `SIGBUS` if
//! `/dev/shm` is full). When `/dev/shm` has no room for a message, `reserve` says so
//! (and one warning per process says how to raise `/dev/shm`): the queue then sends the
//! message over its overflow socket, as it does one larger than a chunk. The data
//! handed out for filling ([`RingWriter::data_mut`]) is only the reserved part, and a
//! commit longer than it is refused, so nothing unreserved is ever published.

use shmq_protocol::sync::Ordering;
use shmq_protocol::sync::local::AtomicU8;
use std::sync::Arc;

use super::Ring;
use super::layout::ChunkKind;
use crate::error::{Error, OsError, QueueError, Result};
use crate::wait::Wait;
use shmq_os::liveness::{Liveness, RoleLock};
use shmq_os::segment::{round_up, warn_shm_too_small};
use shmq_protocol::ring::{self as protocol, ChunkFlags};

/// Chunk data is reserved in `/dev/shm` in steps of this many bytes (or to the end of
/// the chunk), so a chunk's first small message reserves room for many more.
pub const RESERVE_STEP: usize = 64 << 10;

/// What the warning says happens when a chunk cannot be reserved.
const NO_ROOM_FALLBACK: &str = "messages that find no room in the broadcast ring go over \
     its local overflow socket (slower)";

impl Ring {
    /// Reserve the first `len` bytes of chunk `i`'s data in `/dev/shm` (they may have been
    /// already: `fallocate` leaves allocated pages as they are). For whoever writes
    /// or reads chunk data beyond what the writer published (the whole-chunk views of the
    /// bindings); the writer keeps its own high-water marks instead.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `i` is not below the ring's number of chunks;
    /// [`Error::Os`] with [`OsError::NoSpace`] when `/dev/shm` has no room for the bytes.
    pub fn reserve_data(&self, i: usize, len: usize) -> Result<()> {
        let offset = self.data_file_offset(i)? as usize;
        Ok(self
            .segment
            .reserve_range(offset, len.min(self.geo.data_stride))?)
    }
}

/// What a reader should do when the reader it waits for has died.
///
/// A reader that *left* (its reader dropped, or its process ended normally: see
/// `slots`) is not a death: the writer goes on without it whatever the policy, and says
/// so once (an `info` log record, "reader 1 (rank 1, pid 4242) left queue ...").
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum DeadReaderPolicy {
    /// Fail the blocked call with [`QueueError::DeadReader`].
    #[default]
    Raise,
    /// Go on without that reader: it no longer holds chunks back.
    Drop,
}

impl std::str::FromStr for DeadReaderPolicy {
    type Err = Error;
    /// `"raise"` or `"drop"` (the Python argument `on_dead_reader`).
    fn from_str(s: &str) -> Result<DeadReaderPolicy> {
        let choices = [
            ("raise", DeadReaderPolicy::Raise),
            ("drop", DeadReaderPolicy::Drop),
        ];
        crate::error::parse_choice("on_dead_reader", s, &choices)
    }
}

/// A reader the writer waits for.
const ACTIVE: u8 = 0;
/// A reader dropped after it died ([`DeadReaderPolicy::Drop`]).
const DIED: u8 = 1;
/// A reader that left the queue (see `slots`): the writer goes on without it.
const LEFT: u8 = 2;

/// The writer's side of a ring: it fills chunks in order, 0, 1, .., max_chunks-1, 0, ..
#[derive(Debug)]
pub struct RingWriter {
    ring: Arc<Ring>,
    next: usize,
    /// The chunk acquired and not yet committed, if any.
    open: Option<usize>,
    /// Each reader's standing: [`ACTIVE`], [`DIED`] (dropped after it died, see
    /// [`DeadReaderPolicy::Drop`]) or [`LEFT`]; only the last two are skipped.
    dropped: Vec<AtomicU8>,
    on_dead_reader: DeadReaderPolicy,
    messages: u64,
    /// The queue's rank of each reader, to name them in warnings (`None`: by index).
    ranks: Option<Vec<usize>>,
    /// Bytes of each chunk's data reserved in `/dev/shm` so far (see the module docs).
    reserved: Vec<usize>,
    /// The writer's slot, held for as long as this writer lives.
    _role: RoleLock,
}

impl RingWriter {
    /// The writer of `ring`; this process takes the writer's slot (an error if a live
    /// process holds it).
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] when another live process holds the writer's slot;
    /// [`Error::Os`] when the segment's file cannot be locked.
    pub fn new(ring: Arc<Ring>) -> Result<RingWriter> {
        let role = ring.attach(0)?;
        let dropped = (0..ring.n_reader())
            .map(|_| AtomicU8::new(ACTIVE))
            .collect();
        let reserved = vec![0; ring.max_chunks()];
        Ok(RingWriter {
            ring,
            next: 0,
            open: None,
            dropped,
            on_dead_reader: DeadReaderPolicy::Raise,
            messages: 0,
            ranks: None,
            reserved,
            _role: role,
        })
    }

    /// What to do when a reader that holds a chunk back has died.
    pub fn on_dead_reader(&mut self, policy: DeadReaderPolicy) {
        self.on_dead_reader = policy;
    }

    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }

    /// Name reader `r` as rank `ranks[r]` in warnings (a queue's readers have ranks).
    pub fn set_reader_ranks(&mut self, ranks: Vec<usize>) {
        self.ranks = Some(ranks);
    }

    /// Index of the chunk the next message goes to.
    pub fn current_idx(&self) -> usize {
        self.next
    }

    /// Readers dropped so far after they died (not those that left).
    pub fn dropped_readers(&self) -> Vec<usize> {
        self.readers_in(DIED)
    }

    /// Readers that left the queue and that this writer goes on without (it learns of a
    /// departure when it next waits for that reader).
    pub fn left_readers(&self) -> Vec<usize> {
        self.readers_in(LEFT)
    }

    fn readers_in(&self, standing: u8) -> Vec<usize> {
        // Relaxed: only this writer stores these flags.
        (0..self.dropped.len())
            .filter(|&r| self.dropped[r].load(Ordering::Relaxed) == standing)
            .collect()
    }

    /// Whether reader `r` no longer holds chunks back (it died and was dropped, or left).
    fn is_dropped(dropped: &[AtomicU8], r: usize) -> bool {
        // Relaxed: only this writer stores these flags.
        dropped[r].load(Ordering::Relaxed) != ACTIVE
    }

    /// Whether reader `r` no longer holds chunks back: dropped after it died, or gone
    /// from the queue (it left).
    pub fn is_reader_dropped(&self, r: usize) -> bool {
        Self::is_dropped(&self.dropped, r)
    }

    /// Whether reader `r` is skipped from now on: dropped, or seen to have left just
    /// now (then marked [`LEFT`], and said once). For the writer's waits only: it reads
    /// the reader's slot, which the writer's fast path does not.
    fn is_gone(
        ring: &Ring,
        dropped: &[AtomicU8],
        r: usize,
        name: &dyn Fn(usize) -> String,
    ) -> bool {
        if Self::is_dropped(dropped, r) {
            return true;
        }
        if !ring.reader_left(r) {
            return false;
        }
        // Relaxed: only this writer stores these flags.
        dropped[r].store(LEFT, Ordering::Relaxed);
        let pid = ring
            .slot_info(Some(r))
            .ok()
            .and_then(|info| info.process)
            .map_or_else(String::new, |p| format!("pid {}: ", p.pid));
        shmq_log!(
            info,
            "shmq: {} left queue {} ({pid}its reader was closed, or its process ended \
             normally); going on without it",
            name(r),
            ring.queue_words()
        );
        true
    }

    /// Reader `r` in warnings: "reader 1 (rank 2)" when the queue's ranks are known.
    fn namer(ranks: Option<&[usize]>) -> impl Fn(usize) -> String + '_ {
        move |r: usize| match ranks.and_then(|k| k.get(r)) {
            Some(rank) => format!("reader {r} (rank {rank})"),
            None => format!("reader {r}"),
        }
    }

    /// Whether the next chunk can be written without waiting. A chunk held back only by
    /// readers that left is free (their departure is noted here).
    pub fn can_write(&self) -> bool {
        let chunk = self.ring.chunk(self.next);
        protocol::is_free(&chunk, |r| Self::is_dropped(&self.dropped, r)) || {
            let name = Self::namer(self.ranks.as_deref());
            protocol::is_free(&chunk, |r| {
                Self::is_gone(&self.ring, &self.dropped, r, &name)
            })
        }
    }

    /// Check the readers still holding chunk `i`: one that left is skipped from now on, a
    /// dead one is an error or is dropped.
    fn check_readers(
        ring: &Ring,
        dropped: &[AtomicU8],
        policy: DeadReaderPolicy,
        i: usize,
        name: &dyn Fn(usize) -> String,
    ) -> Result<()> {
        ring.check_length()?;
        let chunk = ring.chunk(i);
        for r in 0..ring.n_reader() {
            // Relaxed: a read flag still 0 here can only be a slow, gone or dead reader;
            // either way it is re-checked on the next poll.
            if Self::is_gone(ring, dropped, r, name) || chunk.read(r).peek() == 1 {
                continue;
            }
            let info = ring.slot_info(Some(r))?;
            // Only a holder proved dead counts: one that cannot be judged (`Unknown`) is
            // waited for like a slow one.
            let (Some(process), Liveness::Dead) =
                (info.process, ring.holder_liveness(Some(r), &info))
            else {
                continue;
            };
            // A reader leaves (its slot CLOSED) before it frees its lock: one whose slot
            // said ATTACHED above and whose lock is free now may have left in between.
            if Self::is_gone(ring, dropped, r, name) {
                continue;
            }
            match policy {
                DeadReaderPolicy::Raise => {
                    return Err(Error::Queue(QueueError::DeadReader {
                        reader: r,
                        pid: process.pid,
                        chunk: i,
                        queue: Some(ring.queue_words()),
                    }));
                }
                DeadReaderPolicy::Drop => {
                    // A CAS on the slot word judged: a process that took the slot since
                    // (the dead one's lock was free) is not dropped.
                    if ring.drop_reader(r, &info) {
                        warn_user!(
                            "shmq: reader {r} (pid {}) of queue {} died; going on without it",
                            process.pid,
                            ring.queue_words()
                        );
                        // Relaxed: read only by this writer.
                        dropped[r].store(DIED, Ordering::Relaxed);
                    }
                }
            }
        }
        Ok(())
    }

    /// Wait until the next chunk is free, mark it not-written, and return its index. The
    /// chunk stays acquired until [`commit`](Self::commit) (or another `acquire`).
    ///
    /// # Errors
    ///
    /// [`QueueError::DeadReader`] when a reader died holding the chunk (under
    /// [`DeadReaderPolicy::Raise`]); [`Error::Timeout`] or the hook's error when `wait`
    /// ends first; [`Error::Os`] when the segment was truncated.
    pub fn acquire(&mut self, wait: &mut Wait) -> Result<usize> {
        self.ring.check_intact()?;
        let i = self.next;
        let (ring, dropped, policy) = (&*self.ring, &self.dropped[..], self.on_dead_reader);
        let chunk = ring.chunk(i);
        let free = || protocol::is_free(&chunk, |r| Self::is_dropped(dropped, r));
        if !free() {
            // Blocked: say so in the writer's slot (readers' warnings and the metrics
            // read it), and name the readers behind if the wait lasts. A reader that
            // leaves frees the chunk at once (it rings the doorbell on its way out).
            let name = Self::namer(self.ranks.as_deref());
            let since = ring.begin_wait(0, wait);
            let waited = wait.until_among(
                Some(ring.chunk_freed()),
                Some(ring.peers()),
                &mut || Self::check_readers(ring, dropped, policy, i, &name),
                &mut || ring.explain_readers_behind(i, &|r| Self::is_dropped(dropped, r), &name),
                || {
                    protocol::is_free(&chunk, |r| Self::is_gone(ring, dropped, r, &name))
                        .then_some(())
                },
            );
            ring.end_wait(0, since);
            waited?;
        }
        protocol::begin_write(&chunk);
        self.open = Some(i);
        Ok(i)
    }

    /// Make sure the first `len` bytes of the next chunk's data (the acquired one, if
    /// any) are reserved in `/dev/shm`; `false` if `/dev/shm` has no room for them (the
    /// caller sends the message another way; one warning per process says so). The
    /// chunk need not be acquired: reserving changes no byte a reader may be reading.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when `fallocate` fails for another reason than no room (`Ok(false)`),
    /// or the segment's file cannot be opened.
    pub fn reserve(&mut self, len: usize) -> Result<bool> {
        let i = self.next;
        let len = len.min(self.ring.max_chunk_bytes());
        if len <= self.reserved[i] {
            return Ok(true);
        }
        let stride = self.ring.geo.data_stride;
        // A step at a time (few syscalls), or exactly the pages needed when /dev/shm has
        // no room for a whole step.
        let step = round_up(len, RESERVE_STEP).map_or(stride, |s| s.min(stride));
        let pages = round_up(len, 4096).map_or(stride, |s| s.min(stride));
        for target in [step, pages] {
            match self.ring.reserve_data(i, target) {
                Ok(()) => {
                    self.reserved[i] = target;
                    return Ok(true);
                }
                Err(Error::Os(OsError::NoSpace { .. })) => continue,
                Err(e) => return Err(e),
            }
        }
        warn_shm_too_small(NO_ROOM_FALLBACK);
        Ok(false)
    }

    /// Bytes of chunk `i`'s data reserved in `/dev/shm` by this writer so far.
    pub fn reserved(&self, i: usize) -> usize {
        self.reserved.get(i).copied().unwrap_or(0)
    }

    /// The acquired chunk's data, to fill before `commit`: the part reserved so far (see
    /// [`reserve`](Self::reserve)), never a page that is not there.
    pub fn data_mut(&mut self) -> Option<&mut [u8]> {
        let i = self.open?;
        let (p, n) = self.ring.data_ptr(i).ok()?;
        let n = n.min(self.reserved[i]);
        // SAFETY: the chunk is acquired: per the protocol no reader reads it until the
        // commit, and `&mut self` keeps this the only reference in this process. The `n`
        // bytes are inside the chunk and reserved in /dev/shm, so writing them cannot
        // fault. (A reader process that breaks the protocol could still read torn data,
        // and a same-uid peer that truncates the file could still make this fault, which
        // `shmq_os::sigbus` turns into zero pages and an error at `commit`.)
        Some(unsafe { std::slice::from_raw_parts_mut(p, n) })
    }

    /// Publish the acquired chunk with `len` bytes of kind `kind` and move to the next one.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] without a chunk acquired; [`Error::InvalidArgument`] for a
    /// `len` beyond the bytes reserved in `/dev/shm` (the chunk stays acquired);
    /// [`Error::Os`] when the segment was truncated while the chunk was written.
    pub fn commit(&mut self, len: usize, kind: ChunkKind) -> Result<()> {
        let i = self
            .open
            .take()
            .ok_or_else(|| Error::WrongRole("no chunk is acquired for writing".into()))?;
        if kind != ChunkKind::Overflow && len > self.reserved[i] {
            self.open = Some(i);
            return Err(Error::InvalidArgument(format!(
                "cannot publish {len} bytes of chunk {i}: only {} are reserved in /dev/shm \
                 (reserve them first)",
                self.reserved[i]
            )));
        }
        let ring = &*self.ring;
        // What was written may have gone to the zero pages of a truncated segment: then
        // it is not published (the chunk stays acquired; the queue is lost anyway).
        if let Err(e) = ring.check_intact() {
            self.open = Some(i);
            return Err(e);
        }
        // Relaxed: published by the Release store of `written` in `protocol::publish`.
        ring.len_of(i).set(len as u64);
        ring.kind_of(i).set(kind as u32);
        if kind == ChunkKind::Overflow {
            // Relaxed: a statistic; only the writer stores it.
            ring.shared().overflow_count.add(1);
        }
        protocol::publish(&ring.chunk(i), |r| Self::is_dropped(&self.dropped, r));
        self.messages += 1;
        ring.record_message(0, self.messages, len);
        ring.data_ready().doorbell().ring();
        self.next = (i + 1) % ring.max_chunks();
        Ok(())
    }

    /// Copy `msg` into the next chunk and publish it (waiting for room). An
    /// [`OsError::NoSpace`] if `/dev/shm` has no room for it (nothing is acquired then;
    /// a caller with another way to send it checks [`reserve`](Self::reserve) first).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a message larger than a chunk; [`OsError::NoSpace`]
    /// when `/dev/shm` has no room for it; else as [`acquire`](Self::acquire) and
    /// [`commit`](Self::commit).
    pub fn write(&mut self, msg: &[u8], wait: &mut Wait) -> Result<()> {
        if msg.len() > self.ring.max_chunk_bytes() {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes does not fit in a chunk of {} bytes",
                msg.len(),
                self.ring.max_chunk_bytes()
            )));
        }
        if !self.reserve(msg.len())? {
            return Err(Error::Os(OsError::NoSpace {
                name: self.ring.name().to_owned(),
                needed: msg.len() as u64,
                available: shmq_os::segment::shm_free_bytes().unwrap_or(0),
            }));
        }
        self.acquire(wait)?;
        self.data_mut().expect("acquired")[..msg.len()].copy_from_slice(msg);
        self.commit(msg.len(), ChunkKind::Inline)
    }
}

#[cfg(test)]
mod reservation_tests {
    use std::os::unix::fs::MetadataExt;
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::broadcast::ring::RingReader;

    /// Bytes of the segment's file that tmpfs holds (allocated, not just sized).
    fn allocated(ring: &Ring) -> u64 {
        let m = std::fs::metadata(shmq_os::segment_file::path(ring.name())).unwrap();
        m.blocks() * 512
    }

    #[test]
    fn a_large_ring_commits_only_what_messages_use() {
        // 10 chunks of 24 MiB (vLLM's sizes): 240 MiB of address space.
        let ring = Arc::new(Ring::create(1, 24 << 20, 10).unwrap());
        assert!(allocated(&ring) < 64 << 10, "{}", allocated(&ring));
        let mut w = RingWriter::new(ring.clone()).unwrap();
        let mut r = RingReader::new(ring.clone(), 0).unwrap();
        let wait = || Wait::new("test", Some(Duration::from_secs(5)));
        for i in 0..30u32 {
            w.write(&i.to_le_bytes(), &mut wait()).unwrap();
            let info = r.wait(&mut wait()).unwrap();
            assert_eq!(r.data(&info), i.to_le_bytes());
            r.finish();
        }
        // One step per chunk, nothing more.
        assert_eq!(w.reserved(0), RESERVE_STEP);
        assert!(
            allocated(&ring) <= 11 * RESERVE_STEP as u64,
            "{}",
            allocated(&ring)
        );
        // A 3 MiB message reserves its chunk up to 3 MiB only.
        let big = vec![7u8; 3 << 20];
        let i = w.current_idx();
        w.write(&big, &mut wait()).unwrap();
        assert_eq!(w.reserved(i), 3 << 20);
        let info = r.wait(&mut wait()).unwrap();
        assert_eq!(r.data(&info), &big[..]);
        r.finish();
    }

    #[test]
    fn data_and_commits_stay_inside_what_is_reserved() {
        let ring = Arc::new(Ring::create(1, 1 << 20, 2).unwrap());
        let mut w = RingWriter::new(ring).unwrap();
        w.acquire(&mut Wait::ready_now()).unwrap();
        assert_eq!(w.data_mut().unwrap().len(), 0, "nothing reserved yet");
        assert!(matches!(
            w.commit(10, ChunkKind::Inline),
            Err(Error::InvalidArgument(_))
        ));
        assert!(w.reserve(10).unwrap());
        assert_eq!(w.data_mut().unwrap().len(), RESERVE_STEP);
        w.commit(10, ChunkKind::Inline).unwrap();
        // An overflow mark carries no data: no reservation needed.
        w.acquire(&mut Wait::ready_now()).unwrap();
        w.commit(5 << 20, ChunkKind::Overflow).unwrap();
    }
}
