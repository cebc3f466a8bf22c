//! One reader's side of a ring ([`RingReader`]): it reads chunks in the writer's order,
//! borrows their bytes in place until it marks them read, and notices a dead writer.
//! Dropped, it leaves the queue (see `slots`), so that its writer does not take its end
//! for a death.
//! Uses the ring, its slots, the flag protocol and [`crate::wait`].

use std::sync::Arc;

use super::Ring;
use super::layout::ChunkKind;
use crate::error::{Error, QueueError, Result};
use crate::wait::Wait;
use shmq_os::liveness::{Liveness, RoleLock};
use shmq_protocol::ring as protocol;

/// A message found in the ring by a reader.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ChunkInfo {
    pub index: usize,
    pub len: usize,
    pub kind: ChunkKind,
}

/// One reader's side of a ring; it reads chunks in the writer's order.
#[derive(Debug)]
pub struct RingReader {
    ring: Arc<Ring>,
    reader: usize,
    next: usize,
    messages: u64,
    /// The fork generation it was made in: a forked child's copy does not leave the
    /// queue for its parent.
    made_in: u64,
    /// This reader's slot, held for as long as it lives.
    _role: RoleLock,
}

impl RingReader {
    /// Reader number `reader` (0-based, below the ring's `n_reader`); this process takes
    /// its slot.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `reader` is not below the ring's `n_reader`;
    /// [`Error::WrongRole`] when another live process holds that reader's slot, or the
    /// writer dropped it after its process died; [`Error::Os`] when the segment's file
    /// cannot be locked.
    pub fn new(ring: Arc<Ring>, reader: usize) -> Result<RingReader> {
        if reader >= ring.n_reader() {
            return Err(Error::InvalidArgument(format!(
                "reader index {reader} out of range: the ring has {} readers",
                ring.n_reader()
            )));
        }
        let role = ring.attach(1 + reader)?;
        Ok(RingReader {
            ring,
            reader,
            next: 0,
            messages: 0,
            made_in: shmq_os::fork::generation(),
            _role: role,
        })
    }

    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }
    pub fn reader_index(&self) -> usize {
        self.reader
    }
    /// Index of the chunk this reader reads next.
    pub fn current_idx(&self) -> usize {
        self.next
    }

    /// The next chunk, if it is readable now.
    pub fn poll(&self) -> Option<ChunkInfo> {
        let i = self.next;
        if !protocol::is_readable(&self.ring.chunk(i), self.reader) {
            return None;
        }
        // Relaxed: ordered by the Acquire load of `written` in `is_readable`.
        let len = self.ring.len_of(i).get() as usize;
        let kind = ChunkKind::from_u32(self.ring.kind_of(i).get());
        // A peer that wrote a bogus length cannot make us read outside the chunk.
        let len = match kind {
            ChunkKind::Raw => self.ring.max_chunk_bytes(),
            ChunkKind::Inline | ChunkKind::Framed | ChunkKind::Body => {
                len.min(self.ring.max_chunk_bytes())
            }
            ChunkKind::Overflow => len,
        };
        Some(ChunkInfo {
            index: i,
            len,
            kind,
        })
    }

    /// Fails if the writer is proved dead. A writer that shut the queue down first is not
    /// dead (its end is told apart by [`wait`](Self::wait)).
    ///
    /// # Errors
    ///
    /// [`QueueError::DeadWriter`] when the writer's process is proved dead (without
    /// shutting the queue down); [`Error::Os`] when the segment was truncated.
    pub fn check_writer(ring: &Ring) -> Result<()> {
        ring.check_length()?;
        if ring.writer_closed() {
            return Ok(());
        }
        let info = ring.slot_info(None)?;
        match (info.process, ring.holder_liveness(None, &info)) {
            (Some(w), Liveness::Dead) => Err(Error::Queue(QueueError::DeadWriter {
                pid: w.pid,
                queue: Some(ring.queue_words()),
            })),
            _ => Ok(()),
        }
    }

    /// Wait until the next chunk is readable; [`QueueError::WriterShutDown`] once the writer
    /// shut the queue down and every chunk it published has been read.
    ///
    /// # Errors
    ///
    /// [`QueueError::WriterShutDown`] once the writer shut the queue down and every chunk
    /// was read; [`QueueError::DeadWriter`] when the writer died; [`Error::Timeout`] or the
    /// hook's error when `wait` ends first; [`Error::Os`] when the segment was truncated.
    pub fn wait(&self, wait: &mut Wait) -> Result<ChunkInfo> {
        let ring = &*self.ring;
        ring.check_intact()?;
        let ready = || match self.poll() {
            Some(info) => Some(Ok(info)),
            // Once more after seeing the mark: a chunk published just before it
            // is visible now (see `protocol::slot_close`).
            None if ring.writer_closed() => Some(self.poll().ok_or_else(|| {
                Error::Queue(QueueError::WriterShutDown {
                    queue: Some(ring.queue_words()),
                })
            })),
            None => None,
        };
        if let Some(r) = ready() {
            return r;
        }
        // Blocked: say so in this reader's slot (the writer's warnings and the metrics
        // read it), and name the writer if the wait lasts.
        let since = ring.begin_wait(1 + self.reader, wait);
        let waited = wait.until_among(
            Some(ring.data_ready()),
            Some(ring.peers()),
            &mut || Self::check_writer(ring),
            &mut || ring.explain_writer(),
            ready,
        );
        ring.end_wait(1 + self.reader, since);
        waited?
    }

    /// The data of a chunk returned by `poll`/`wait`, valid until `finish`.
    pub fn data(&self, info: &ChunkInfo) -> &[u8] {
        let (p, n) = self.ring.data_ptr(info.index).expect("index from poll");
        let len = if info.kind == ChunkKind::Overflow {
            0
        } else {
            info.len.min(n)
        };
        // SAFETY: the chunk is readable by us and our read flag is still 0, so the writer
        // does not touch it until `finish` (which needs `&mut self`, ending this borrow).
        unsafe { std::slice::from_raw_parts(p, len) }
    }

    /// Mark the current chunk as read by this reader and move to the next one.
    pub fn finish(&mut self) {
        // Relaxed: ordered by the Acquire load of `written` that made the chunk readable
        // (the writer does not change it until our read flag is set, just below).
        let len = self.ring.len_of(self.next).get() as usize;
        protocol::finish_read(&self.ring.chunk(self.next), self.reader);
        self.messages += 1;
        self.ring
            .record_message(1 + self.reader, self.messages, len);
        self.ring.chunk_freed().doorbell().ring();
        self.next = (self.next + 1) % self.ring.max_chunks();
    }
}

impl Drop for RingReader {
    /// A reader's normal end: it leaves the queue before it lets go of its slot's lock,
    /// so its writer goes on without it instead of reporting a death. Not while a panic
    /// unwinds (a failure, which the writer hears of as a death, as of a killed process)
    /// nor in a forked child, whose copy does not hold the slot.
    fn drop(&mut self) {
        if !std::thread::panicking() && !shmq_os::fork::is_inherited(self.made_in) {
            self.ring.leave(self.reader);
        }
    }
}
