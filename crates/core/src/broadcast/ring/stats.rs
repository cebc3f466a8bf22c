//! What a ring's sides have done and are doing, readable from any process: the live
//! metrics (`python -m shmq inspect --json`, `top`, the Prometheus collector) and the
//! "still waiting" warnings that name who is behind. Everything is read from the slots'
//! statistics and the writer's counters (`layout::RingShared`), which their one writer
//! stores with Relaxed ordering; a report can be a moment stale, never wrong for long.

use super::Ring;
use super::layout::RingShared;
use shmq_os::liveness::Liveness;
use shmq_os::process::{ProcessId, coarse_now_ns};
use shmq_protocol::word::StatU64;

/// One side of a ring (the writer, or one reader), as its slot says.
#[derive(Clone, Debug, PartialEq)]
pub struct SideStats {
    /// `None` for the writer, else the reader's index in the ring.
    pub reader: Option<usize>,
    /// Who holds the slot (if anyone has), and whether it is alive.
    pub process: Option<ProcessId>,
    pub liveness: Liveness,
    /// Dropped by the writer after it died.
    pub dropped: bool,
    /// A reader that left the queue (not a death: see [`SlotInfo::left`](super::SlotInfo)).
    pub left: bool,
    /// Messages written (writer) or read (reader), and their bytes as published in the
    /// ring (a framed message's descriptors and inline parts; arena parts are counted by
    /// [`RingStats::arena_parts`] and [`RingStats::loaned_parts`]).
    pub messages: u64,
    pub bytes: u64,
    /// Waits that blocked (the other side was not ready), and their total time.
    pub waits: u64,
    pub wait_seconds: f64,
    /// How long it has been blocked in the queue now, if it is.
    pub waiting_seconds: Option<f64>,
    /// Seconds since it last wrote or read a message (`None` before its first).
    pub idle_seconds: Option<f64>,
    /// The holder's scheduler state where its pid is visible here (`T`: stopped).
    pub process_state: Option<char>,
}

/// A ring's metrics: every side, and the queue writer's counters.
#[derive(Clone, Debug, PartialEq)]
pub struct RingStats {
    pub writer: SideStats,
    pub readers: Vec<SideStats>,
    /// Messages that went over the local overflow socket (too large for a chunk, or no
    /// room in `/dev/shm`).
    pub overflow_sends: u64,
    /// Message parts copied into the tensor arena.
    pub arena_parts: u64,
    /// Message parts sent from a loan, without a copy.
    pub loaned_parts: u64,
    /// Large parts copied inline because the arena had no room.
    pub fallback_parts: u64,
    /// Messages sent to remote readers (ZeroMQ).
    pub remote_sends: u64,
}

/// The queue writer's counters kept in the ring (see [`Ring::count_parts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartCounter {
    Arena,
    Loaned,
    Fallback,
    RemoteSend,
}

fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

impl SideStats {
    /// How many messages this reader is behind the writer (0 for the writer).
    pub fn behind(&self, writer: &SideStats) -> u64 {
        match self.reader {
            Some(_) => writer.messages.saturating_sub(self.messages),
            None => 0,
        }
    }

    /// "reader 1 (rank 2): pid 4242, alive"-style words for warnings.
    fn who(&self, name: &str) -> String {
        let Some(p) = self.process else {
            return format!("{name}: not opened by any process yet");
        };
        let state = match (self.liveness, self.process_state) {
            _ if self.left => "left the queue".to_owned(),
            (Liveness::Dead, _) => "dead".to_owned(),
            _ if self.is_stopped() => "alive but stopped (SIGSTOP or a debugger)".to_owned(),
            (Liveness::Alive, _) => "alive".to_owned(),
            (Liveness::Unknown, _) => "alive or dead: unknown from here".to_owned(),
        };
        let dropped = if self.dropped {
            ", dropped by the writer"
        } else {
            ""
        };
        format!("{name}: pid {}, {state}{dropped}", p.pid)
    }

    fn is_stopped(&self) -> bool {
        matches!(self.process_state, Some('T' | 't'))
    }

    /// When it last handled a message and whether it waits in the queue now; `ready`:
    /// a message is there for it (so a wait in the queue should have ended).
    fn doing(&self, verb: &str, ready: bool) -> String {
        let last = match self.idle_seconds {
            Some(s) => format!("last {verb} {s:.1} s ago"),
            None => format!("has not {verb} a message yet"),
        };
        let now = match self.waiting_seconds {
            // Stopped inside a call of the queue: it is not waiting for anything.
            Some(_) if self.is_stopped() => "stopped inside a call of the queue".to_owned(),
            Some(s) if ready => {
                format!("in the queue for {s:.1} s although a message is ready for it (not woken?)")
            }
            Some(s) => format!("asleep in the queue for {s:.1} s"),
            None => "not in the queue (busy elsewhere)".to_owned(),
        };
        format!("{last}, {now}")
    }
}

impl Ring {
    fn side(&self, reader: Option<usize>, now: u64) -> SideStats {
        let info = self.slot_info(reader).expect("an index below n_reader");
        let liveness = self.holder_liveness(reader, &info);
        SideStats {
            reader,
            process: info.process,
            liveness,
            dropped: info.dropped,
            left: info.left,
            messages: info.messages,
            bytes: info.bytes,
            waits: info.waits,
            wait_seconds: seconds(info.wait_ns),
            waiting_seconds: info.waiting_since.map(|t| seconds(now.saturating_sub(t))),
            idle_seconds: info.last_ns.map(|t| seconds(now.saturating_sub(t))),
            process_state: info.process.and_then(|p| p.state()),
        }
    }

    /// Every side's statistics and the writer's counters, as they are now.
    pub fn stats(&self) -> RingStats {
        let now = coarse_now_ns();
        let s = self.shared();
        // Relaxed: statistics, each written by the writer alone; they order nothing.
        RingStats {
            writer: self.side(None, now),
            readers: (0..self.n_reader())
                .map(|r| self.side(Some(r), now))
                .collect(),
            overflow_sends: s.overflow_count.get(),
            arena_parts: s.arena_parts.get(),
            loaned_parts: s.loaned_parts.get(),
            fallback_parts: s.fallback_parts.get(),
            remote_sends: s.remote_sends.get(),
        }
    }

    fn counter(s: &RingShared, c: PartCounter) -> &StatU64 {
        match c {
            PartCounter::Arena => &s.arena_parts,
            PartCounter::Loaned => &s.loaned_parts,
            PartCounter::Fallback => &s.fallback_parts,
            PartCounter::RemoteSend => &s.remote_sends,
        }
    }

    /// Add `n` to one of the queue writer's counters (the writer only).
    pub fn count_parts(&self, c: PartCounter, n: u64) {
        if n == 0 {
            return;
        }
        let a = Self::counter(self.shared(), c);
        // Relaxed: a statistic written by the writer alone (a load and a store are no
        // lost update), read by others for reports only.
        a.add_own(n);
    }

    /// For the writer's "still waiting" warning while it waits for chunk `chunk`: every
    /// reader that has not read it yet (and is not dropped), named by `name(r)`, with
    /// its liveness, how far behind it is, when it last read and whether it waits in the
    /// queue (asleep there while a message is ready for it would be a lost wake-up).
    pub fn explain_readers_behind(
        &self,
        chunk: usize,
        is_dropped: &dyn Fn(usize) -> bool,
        name: &dyn Fn(usize) -> String,
    ) -> String {
        let now = coarse_now_ns();
        let writer = self.side(None, now);
        let flags = self.metadata(chunk).unwrap_or_default();
        let behind: Vec<String> = (0..self.n_reader())
            .filter(|&r| !is_dropped(r) && flags.get(1 + r) != Some(&1))
            .map(|r| {
                let side = self.side(Some(r), now);
                format!(
                    "{}, {} messages behind, {}",
                    side.who(&name(r)),
                    side.behind(&writer),
                    side.doing("read", true)
                )
            })
            .collect();
        if behind.is_empty() {
            return String::new();
        }
        format!("not read yet by {}", behind.join("; "))
    }

    /// For a reader's "still waiting" warning: the writer, with its liveness, what it
    /// has written, when it last wrote and whether it is itself waiting (for readers to
    /// free a chunk) in the queue.
    pub fn explain_writer(&self) -> String {
        let writer = self.side(None, coarse_now_ns());
        let what = match writer.waiting_seconds {
            Some(_) if writer.is_stopped() => "stopped inside a call of the queue".to_owned(),
            Some(s) => format!("waiting for readers to free a chunk for {s:.1} s"),
            None => "not in the queue (busy elsewhere)".to_owned(),
        };
        let last = match writer.idle_seconds {
            Some(s) => format!("last wrote {s:.1} s ago"),
            None => "has not written a message yet".to_owned(),
        };
        format!(
            "{}, {} messages written, {last}, {what}",
            writer.who("the writer"),
            writer.messages
        )
    }
}
