//! Consumer slots: who is loading from a producer, so that the producer knows whose
//! acknowledgements to wait for and whose pins to drop when a consumer dies.
//!
//! The protocol on the slot's word (claim, join, leave, the reclaim of a dead
//! consumer's slot, the join clock that orders joins against publications) is
//! [`shmq_protocol::consumer_slot`], model-checked with loom there. This module applies it
//! to the producer's segment and decides who is dead.
//!
//! # Dead consumers
//! A consumer holds its slot's role lock (byte `1 + slot` of the segment's file, see
//! [`shmq_os::liveness`]) for as long as it is joined. A JOINED slot whose lock is free is
//! proved dead (also from another pid namespace) and is reclaimed: its pin counts are
//! zeroed (its views died with it), then it is freed. Where the lock cannot be tested,
//! the pid decides, and a pid that is not visible is "unknown": never reclaimed. A slot
//! stuck CLAIMED for longer than `STUCK_CLAIM` (its joiner died mid-join) is reclaimed
//! too, by the producer.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use shmq_os::liveness::{Liveness, LockProbe, RoleLock};
use shmq_os::process::ProcessId;
use shmq_protocol::consumer_slot as protocol;
pub(crate) use shmq_protocol::consumer_slot::{CLAIMED, FREE, JOINED};

use super::layout::{ConsumerSlot, Mapped};

/// How long a slot may stay CLAIMED before it is taken for a joiner that died mid-join.
pub(crate) const STUCK_CLAIM: Duration = Duration::from_secs(5);

/// How many times a slot is read before it counts as changing nonstop.
const SNAPSHOT_ATTEMPTS: usize = 1000;

/// One consistent read of a consumer slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub word: u64,
    pub process: ProcessId,
    pub joined_at: u64,
}

impl Snapshot {
    pub fn state(&self) -> u64 {
        protocol::state(self.word)
    }
}

/// Read `slot` consistently; `None` if it kept changing (a peer rewriting it nonstop).
pub(crate) fn snapshot(slot: &ConsumerSlot) -> Option<Snapshot> {
    protocol::snapshot(slot, SNAPSHOT_ATTEMPTS).map(|s| Snapshot {
        word: s.word,
        process: ProcessId {
            pid: s.pid,
            start_time: s.start_time,
        },
        joined_at: s.joined_at,
    })
}

/// The role-lock byte of consumer slot `s` (byte 0 is the creator's).
fn lock_byte(s: usize) -> u64 {
    1 + s as u64
}

/// Whether the consumer in slot `s`, read as `snap`, is alive: its role lock, else its
/// pid.
fn liveness(probe: &LockProbe, s: usize, snap: &Snapshot) -> Liveness {
    match probe.liveness(lock_byte(s)) {
        Liveness::Unknown => snap.process.liveness(),
        known => known,
    }
}

/// Take a free slot for `me`; reclaims slots of dead consumers when none is free.
/// Returns the slot, its word (which [`leave`] and [`holds`] need) and its role lock.
pub(crate) fn join(map: &Mapped, me: ProcessId) -> Result<(usize, u64, RoleLock)> {
    for attempt in 0..2 {
        for s in 0..map.geo.max_consumers {
            let slot = map.consumer(s);
            let Some(free) = protocol::free_word(slot) else {
                continue;
            };
            // The slot's role lock first: held by a live process means the slot is not
            // really free (a consumer reclaimed while alive).
            let Some(role) = RoleLock::acquire(map.segment.name(), lock_byte(s))? else {
                continue;
            };
            let Some(claimed) = protocol::claim(slot, free) else {
                continue;
            };
            let joined = protocol::join(slot, claimed, me.pid, me.start_time, &map.header().clock);
            return Ok((s, joined, role));
        }
        if attempt == 0 && reclaim_dead(map, None) == 0 {
            break;
        }
    }
    Err(Error::InvalidArgument(format!(
        "encoder cache '{}' has no free consumer slot: all {} are taken by live consumers \
         (make the producer with a larger max_consumers)",
        map.segment.name(),
        map.geo.max_consumers
    )))
}

/// Give slot `s` back, if it is still the occupancy `word` (a slot reclaimed meanwhile
/// is left alone).
pub(crate) fn leave(map: &Mapped, s: usize, word: u64) {
    protocol::leave(map.consumer(s), word);
}

/// Whether the occupancy `word` of slot `s` is still current.
pub(crate) fn holds(map: &Mapped, s: usize, word: u64) -> bool {
    protocol::holds(map.consumer(s), word)
}

/// Reclaim slot `s` from occupancy `word`: zero its pins (the occupant is dead: its views
/// died with it), then free it. Returns false if the slot changed meanwhile.
pub(crate) fn reclaim(map: &Mapped, s: usize, word: u64) -> bool {
    let reclaimed = protocol::reclaim(map.consumer(s), word, || {
        for e in 0..map.geo.max_entries {
            // Published by the Release store of FREE that ends the reclaim
            // (`EntryPin::clear`).
            map.pin(e, s).clear();
        }
    });
    if reclaimed {
        // The producer may be waiting for this consumer.
        map.ring();
    }
    reclaimed
}

/// Reclaim every JOINED slot whose process is dead, and (given a tracker) every slot stuck
/// CLAIMED for longer than [`STUCK_CLAIM`]. Returns how many were reclaimed.
pub(crate) fn reclaim_dead(map: &Mapped, mut stuck: Option<&mut StuckClaims>) -> usize {
    let mut n = 0;
    let probe = LockProbe::open(map.segment.name());
    for s in 0..map.geo.max_consumers {
        let Some(snap) = snapshot(map.consumer(s)) else {
            continue;
        };
        let dead = match snap.state() {
            JOINED => liveness(&probe, s, &snap) == Liveness::Dead,
            CLAIMED => stuck
                .as_deref_mut()
                .is_some_and(|t| t.is_stuck(s, snap.word)),
            _ => false,
        };
        if dead && reclaim(map, s, snap.word) {
            shmq_log!(
                info,
                "shmq: consumer pid {} of encoder cache '{}' is gone; its holds were dropped",
                snap.process.pid,
                map.segment.name()
            );
            n += 1;
        }
    }
    n
}

/// When each slot was first seen CLAIMED with its current word (the producer's memory of
/// joins in progress).
#[derive(Debug, Default)]
pub(crate) struct StuckClaims {
    seen: Vec<Option<(u64, Instant)>>,
}

impl StuckClaims {
    fn is_stuck(&mut self, s: usize, word: u64) -> bool {
        if self.seen.len() <= s {
            self.seen.resize(s + 1, None);
        }
        match self.seen[s] {
            Some((w, since)) if w == word => since.elapsed() >= STUCK_CLAIM,
            _ => {
                self.seen[s] = Some((word, Instant::now()));
                false
            }
        }
    }
}

/// Who is a consumer of a producer now, for display.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConsumerInfo {
    pub slot: usize,
    pub process: ProcessId,
    pub alive: bool,
    pub loads: u64,
}

pub(crate) fn list(map: &Mapped) -> Vec<ConsumerInfo> {
    let probe = LockProbe::open(map.segment.name());
    (0..map.geo.max_consumers)
        .filter_map(|s| {
            let snap = snapshot(map.consumer(s))?;
            (snap.state() == JOINED).then(|| ConsumerInfo {
                slot: s,
                process: snap.process,
                alive: liveness(&probe, s, &snap) != Liveness::Dead,
                // Relaxed: a statistic.
                loads: map.consumer(s).loads.get(),
            })
        })
        .collect()
}
