//! The writer's side of a ring ([`RingWriter`]): it fills chunks in order, waits (spin,
//! yield, sleep) while the next one is still unread, and decides what to do about a
//! reader that died. Uses the ring, its slots, the flag protocol and [`crate::wait`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::layout::ChunkKind;
use super::protocol::{self, ChunkFlags};
use super::Ring;
use crate::error::{Error, Result};
use crate::liveness::{Liveness, RoleLock};
use crate::wait::Wait;

/// What a reader should do when the reader it waits for has died.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum DeadReaderPolicy {
    /// Fail the blocked call with [`Error::DeadReader`].
    #[default]
    Raise,
    /// Go on without that reader: it no longer holds chunks back.
    Drop,
}

/// The writer's side of a ring: it fills chunks in order, 0, 1, .., max_chunks-1, 0, ..
#[derive(Debug)]
pub struct RingWriter {
    ring: Arc<Ring>,
    next: usize,
    /// The chunk acquired and not yet committed, if any.
    open: Option<usize>,
    /// Readers dropped after they died (see [`DeadReaderPolicy::Drop`]).
    dropped: Vec<AtomicBool>,
    on_dead_reader: DeadReaderPolicy,
    messages: u64,
    /// The writer's slot, held for as long as this writer lives.
    _role: RoleLock,
}

impl RingWriter {
    /// The writer of `ring`; this process takes the writer's slot (an error if a live
    /// process holds it).
    pub fn new(ring: Arc<Ring>) -> Result<RingWriter> {
        let role = ring.attach(0)?;
        let dropped = (0..ring.n_reader())
            .map(|_| AtomicBool::new(false))
            .collect();
        Ok(RingWriter {
            ring,
            next: 0,
            open: None,
            dropped,
            on_dead_reader: DeadReaderPolicy::Raise,
            messages: 0,
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

    /// Index of the chunk the next message goes to.
    pub fn current_idx(&self) -> usize {
        self.next
    }

    /// Readers dropped so far.
    pub fn dropped_readers(&self) -> Vec<usize> {
        // Relaxed: only this writer stores these flags.
        (0..self.dropped.len())
            .filter(|&r| self.dropped[r].load(Ordering::Relaxed))
            .collect()
    }

    fn is_dropped(dropped: &[AtomicBool], r: usize) -> bool {
        // Relaxed: only this writer stores these flags.
        dropped[r].load(Ordering::Relaxed)
    }

    /// Whether reader `r` was dropped after it died.
    pub fn is_reader_dropped(&self, r: usize) -> bool {
        Self::is_dropped(&self.dropped, r)
    }

    /// Whether the next chunk can be written without waiting.
    pub fn can_write(&self) -> bool {
        protocol::is_free(&self.ring.chunk(self.next), |r| {
            Self::is_dropped(&self.dropped, r)
        })
    }

    /// Check the readers still holding chunk `i`: a dead one is an error or is dropped.
    fn check_readers(
        ring: &Ring,
        dropped: &[AtomicBool],
        policy: DeadReaderPolicy,
        i: usize,
    ) -> Result<()> {
        let chunk = ring.chunk(i);
        for r in 0..ring.n_reader() {
            // Relaxed: a read flag still 0 here can only be a slow or dead reader; either
            // way it is re-checked on the next poll.
            if Self::is_dropped(dropped, r) || chunk.read(r).load(Ordering::Relaxed) == 1 {
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
            match policy {
                DeadReaderPolicy::Raise => {
                    return Err(Error::DeadReader {
                        reader: r,
                        pid: process.pid,
                        chunk: i,
                    });
                }
                DeadReaderPolicy::Drop => {
                    // A CAS on the slot word judged: a process that took the slot since
                    // (the dead one's lock was free) is not dropped.
                    if ring.drop_reader(r, &info) {
                        log::warn!(
                            "shmq: reader {r} (pid {}) died; going on without it",
                            process.pid
                        );
                        // Relaxed: read only by this writer.
                        dropped[r].store(true, Ordering::Relaxed);
                    }
                }
            }
        }
        Ok(())
    }

    /// Wait until the next chunk is free, mark it not-written, and return its index. The
    /// chunk stays acquired until [`commit`](Self::commit) (or another `acquire`).
    pub fn acquire(&mut self, wait: &mut Wait) -> Result<usize> {
        let i = self.next;
        let (ring, dropped, policy) = (&*self.ring, &self.dropped[..], self.on_dead_reader);
        let chunk = ring.chunk(i);
        wait.until(
            Some(ring.chunk_freed()),
            &mut || Self::check_readers(ring, dropped, policy, i),
            || protocol::is_free(&chunk, |r| Self::is_dropped(dropped, r)).then_some(()),
        )?;
        protocol::begin_write(&chunk);
        self.open = Some(i);
        Ok(i)
    }

    /// The acquired chunk's data, to fill before `commit`.
    pub fn data_mut(&mut self) -> Option<&mut [u8]> {
        let i = self.open?;
        let (p, n) = self.ring.data_ptr(i).ok()?;
        // SAFETY: the chunk is acquired: per the protocol no reader reads it until the
        // commit, and `&mut self` keeps this the only reference in this process. (A
        // reader process that breaks the protocol could still read torn data; it cannot
        // make this process misbehave.)
        Some(unsafe { std::slice::from_raw_parts_mut(p, n) })
    }

    /// Publish the acquired chunk with `len` bytes of kind `kind` and move to the next one.
    pub fn commit(&mut self, len: usize, kind: ChunkKind) -> Result<()> {
        let i = self
            .open
            .take()
            .ok_or_else(|| Error::WrongRole("no chunk is acquired for writing".into()))?;
        let ring = &*self.ring;
        // Relaxed: published by the Release store of `written` in `protocol::publish`.
        ring.len_of(i).store(len as u64, Ordering::Relaxed);
        ring.kind_of(i).store(kind as u32, Ordering::Relaxed);
        if kind == ChunkKind::Overflow {
            // Relaxed: a statistic; only the writer stores it.
            ring.shared().overflow_count.fetch_add(1, Ordering::Relaxed);
        }
        protocol::publish(&ring.chunk(i), |r| Self::is_dropped(&self.dropped, r));
        self.messages += 1;
        // Relaxed: a statistic, stored (not added) since only the writer writes it.
        ring.slot(0)
            .messages
            .store(self.messages, Ordering::Relaxed);
        ring.data_ready().doorbell().ring();
        self.next = (i + 1) % ring.max_chunks();
        Ok(())
    }

    /// Copy `msg` into the next chunk and publish it (waiting for room).
    pub fn write(&mut self, msg: &[u8], wait: &mut Wait) -> Result<()> {
        if msg.len() > self.ring.max_chunk_bytes() {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes does not fit in a chunk of {} bytes",
                msg.len(),
                self.ring.max_chunk_bytes()
            )));
        }
        self.acquire(wait)?;
        self.data_mut().expect("acquired")[..msg.len()].copy_from_slice(msg);
        self.commit(msg.len(), ChunkKind::Inline)
    }
}
