//! Consumer slots: who is loading from a producer, so that the producer knows whose
//! acknowledgements to wait for and whose pins to drop when a consumer dies.
//!
//! A slot's `word` is `sequence << 2 | state`; every change bumps the sequence, so a
//! compare-and-swap on the word names one occupancy of the slot, never a later one.
//! ```text
//! FREE --join (CAS)--> CLAIMED --fields written--> JOINED --leave (CAS)--> FREE
//!                         \                          \--dead (CAS)--> RECLAIMING --pins zeroed--> FREE
//!                          \--stuck (the joiner died mid-join, CAS)--> RECLAIMING ...
//! ```
//! Taking a slot is one compare-and-swap: two joiners never share one.
//!
//! # Late joiners
//! The header's `clock` orders joins against publications: a consumer takes its
//! `joined_at` from the clock, the producer takes each entry's `published_at` from it,
//! and an entry waits only for consumers that joined before it was published. A consumer
//! that joins later still sees and loads every key held, but does not hold back their
//! eviction. The claim (CLAIMED) is stored before the clock is read, and clock updates
//! are read-modify-writes of one atomic, so a producer that took a later clock value
//! sees the slot as at least CLAIMED, which it treats as "has not loaded anything yet".
//!
//! # Reading a slot: a seqlock on `word`
//! Fields are written only while a slot is CLAIMED (after a Release fence that follows
//! the claim); a reader loads the word (Acquire), the fields, an Acquire fence and the
//! word again, and keeps the read only if the word did not change.
//!
//! # Dead consumers
//! A consumer holds its slot's role lock (byte `1 + slot` of the segment's file, see
//! [`shmq_os::liveness`]) for as long as it is joined. A JOINED slot whose lock is free is
//! proved dead (also from another pid namespace) and is reclaimed: its pin counts are
//! zeroed (its views died with it), then it is freed. Where the lock cannot be tested,
//! the pid decides, and a pid that is not visible is "unknown": never reclaimed.

use std::time::{Duration, Instant};

use shmq_os::error::{Error, Result};
use shmq_os::liveness::{Liveness, LockProbe, RoleLock};
use shmq_os::process::ProcessId;
use shmq_protocol::sync::{fence, Ordering};

use super::layout::{ConsumerSlot, Mapped};

pub(crate) const FREE: u64 = 0;
pub(crate) const CLAIMED: u64 = 1;
pub(crate) const JOINED: u64 = 2;
pub(crate) const RECLAIMING: u64 = 3;

/// How long a slot may stay CLAIMED before it is taken for a joiner that died mid-join.
pub(crate) const STUCK_CLAIM: Duration = Duration::from_secs(5);

fn next(word: u64, state: u64) -> u64 {
    ((word >> 2).wrapping_add(1) << 2) | state
}

/// One consistent read of a consumer slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub word: u64,
    pub process: ProcessId,
    pub joined_at: u64,
}

impl Snapshot {
    pub fn state(&self) -> u64 {
        self.word & 3
    }
}

/// Read `slot` consistently; `None` if it kept changing (a peer rewriting it nonstop).
pub(crate) fn snapshot(slot: &ConsumerSlot) -> Option<Snapshot> {
    for _ in 0..1000 {
        // Acquire: pairs with the Release store that made the slot JOINED (and with the
        // Release fence after a claim, via the fence below).
        let w1 = slot.word.load(Ordering::Acquire);
        // Relaxed: validated by the second word load below.
        let pid = slot.pid.load(Ordering::Relaxed);
        let start_time = slot.start_time.load(Ordering::Relaxed);
        let joined_at = slot.joined_at.load(Ordering::Relaxed);
        // Acquire fence: pairs with the Release fence in `join` after the claim: a field
        // stored after that fence, if seen above, makes the load below see the new word.
        fence(Ordering::Acquire);
        // Relaxed: ordered by the fence.
        if slot.word.load(Ordering::Relaxed) == w1 {
            return Some(Snapshot {
                word: w1,
                process: ProcessId { pid, start_time },
                joined_at,
            });
        }
        shmq_protocol::sync::yield_now();
    }
    None
}

/// Take a free slot for `me`; reclaims slots of dead consumers when none is free.
/// Returns the slot and its word (which [`leave`] needs).
/// The role-lock byte of consumer slot `s` (byte 0 is the creator's).
fn lock_byte(s: usize) -> u64 {
    1 + s as u64
}

/// Whether the consumer in a slot read as `snap` is alive: its role lock, else its pid.
fn liveness(map: &Mapped, probe: &LockProbe, s: usize, snap: &Snapshot) -> Liveness {
    let _ = map;
    match probe.liveness(lock_byte(s)) {
        Liveness::Unknown => snap.process.liveness(),
        known => known,
    }
}

pub(crate) fn join(map: &Mapped, me: ProcessId) -> Result<(usize, u64, RoleLock)> {
    for attempt in 0..2 {
        for s in 0..map.geo.max_consumers {
            let slot = map.consumer(s);
            // Relaxed: only a hint; the CAS below decides.
            let w = slot.word.load(Ordering::Relaxed);
            if w & 3 != FREE {
                continue;
            }
            // The slot's role lock first: held by a live process means the slot is not
            // really free (a consumer reclaimed while alive).
            let Some(role) = RoleLock::acquire(map.segment.name(), lock_byte(s))? else {
                continue;
            };
            let claimed = next(w, CLAIMED);
            // AcqRel: Acquire pairs with the Release store that freed the slot (its pins
            // were zeroed before); Release keeps the claim before the clock update below.
            if slot
                .word
                .compare_exchange(w, claimed, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            // Release fence: pairs with the Acquire fence in `snapshot`: a reader that sees
            // any field written below sees the slot's word changed.
            fence(Ordering::Release);
            // Relaxed: published by the Release store of JOINED below.
            slot.pid.store(me.pid, Ordering::Relaxed);
            slot.start_time.store(me.start_time, Ordering::Relaxed);
            slot.loads.store(0, Ordering::Relaxed);
            // SeqCst read-modify-write of the clock: the producer's own clock RMW for a
            // later publication reads from this one (or a later RMW in its release
            // sequence), so it sees the claim stored above (module docs).
            let joined_at = map.header().clock.fetch_add(1, Ordering::SeqCst);
            slot.joined_at.store(joined_at, Ordering::Relaxed);
            let joined = next(claimed, JOINED);
            // Release: pairs with the Acquire word load in `snapshot`.
            slot.word.store(joined, Ordering::Release);
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
    // Release: pairs with the Acquire CAS of the next joiner: our unpins (all done, the
    // views are gone) happen before it uses the counts.
    let _ = map.consumer(s).word.compare_exchange(
        word,
        next(word, FREE),
        Ordering::Release,
        Ordering::Relaxed,
    );
}

/// Whether the occupancy `word` of slot `s` is still current.
pub(crate) fn holds(map: &Mapped, s: usize, word: u64) -> bool {
    // Acquire: a slot reclaimed by a peer shows its new word; nothing else is read.
    map.consumer(s).word.load(Ordering::Acquire) == word
}

/// Reclaim slot `s` from occupancy `word`: zero its pins (the occupant is dead: its views
/// died with it), then free it. Returns false if the slot changed meanwhile.
pub(crate) fn reclaim(map: &Mapped, s: usize, word: u64) -> bool {
    let slot = map.consumer(s);
    let reclaiming = next(word, RECLAIMING);
    // SeqCst: one reclaimer wins; nothing is published by it.
    if slot
        .word
        .compare_exchange(word, reclaiming, Ordering::SeqCst, Ordering::Relaxed)
        .is_err()
    {
        return false;
    }
    for e in 0..map.geo.max_entries {
        // Relaxed: published to the next occupant by the Release store of FREE below,
        // and to the producer's pin checks, which only need to see zero eventually.
        map.pin(e, s).store(0, Ordering::Relaxed);
    }
    // Release: pairs with the Acquire CAS in `join`: the next occupant sees zero pins.
    slot.word.store(next(reclaiming, FREE), Ordering::Release);
    // The producer may be waiting for this consumer.
    map.ring();
    true
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
            JOINED => liveness(map, &probe, s, &snap) == Liveness::Dead,
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
                alive: liveness(map, &probe, s, &snap) != Liveness::Dead,
                // Relaxed: a statistic.
                loads: map.consumer(s).loads.load(Ordering::Relaxed),
            })
        })
        .collect()
}
