//! Whether the producer's entries are loaded (by every consumer that must) and mapped,
//! and the reports, in warnings and errors, of what holds the room.

use std::collections::HashMap;
use std::time::Duration;

use super::{Inner, LoadState, State, lock};
use crate::encoder_cache::entries::{self, READY};
use crate::encoder_cache::slots;
use crate::error::{CacheError, Error};
use shmq_os::segment::{SHM_DIR, shm_statvfs};

impl Inner {
    pub(super) fn is_ready(&self, e: usize) -> bool {
        // Only this process stores the word (`EntryState::own`).
        entries::state_of(self.map.entry(e).state.own()) == READY
    }

    pub(super) fn pins_zero(&self, e: usize) -> bool {
        // The producer's half of the pin handshake, after `retire` (`EntryPin::is_unpinned`):
        // a consumer's reads of the bytes happen before its unpin, so before we reuse them.
        (0..self.map.geo.max_consumers).all(|s| self.map.pin(e, s).is_unpinned())
    }

    /// Whether entry `e` (READY) has been loaded by every consumer that must.
    pub(super) fn fully_loaded(&self, e: usize) -> bool {
        let rec = self.map.entry(e);
        // Relaxed: stored by this process.
        let published_at = rec.published_at.get();
        // Acquire (`EntryAcks::loaded`).
        let acks = rec.acks.loaded();
        if (acks.count_ones() as usize) < self.min_consumers {
            return false;
        }
        (0..self.map.geo.max_consumers).all(|s| {
            if acks & (1 << s) != 0 {
                return true;
            }
            match slots::snapshot(self.map.consumer(s)) {
                // Not readable: be safe.
                None => false,
                Some(snap) => match snap.state() {
                    slots::FREE => true,
                    slots::JOINED => snap.joined_at > published_at,
                    // Joining or being reclaimed: treat as not loaded yet.
                    _ => false,
                },
            }
        })
    }

    pub(super) fn load_state(&self, st: &State, key: &str) -> LoadState {
        match st.keys.get(key) {
            Some(&e) if self.is_ready(e as usize) => {
                if self.fully_loaded(e as usize) {
                    LoadState::Loaded
                } else {
                    LoadState::Pending
                }
            }
            Some(_) => LoadState::Pending,
            None if st.loaded_evicted.contains(key) => LoadState::Loaded,
            None => LoadState::Unknown,
        }
    }

    pub(super) fn who_has_not_loaded(&self, key: &str) -> String {
        let st = lock(&self.state);
        let Some(&e) = st.keys.get(key) else {
            return "the key is no longer held".into();
        };
        if !self.is_ready(e as usize) {
            return "its save has not finished".into();
        }
        let rec = self.map.entry(e as usize);
        // Relaxed: a report.
        let (published_at, acks) = (rec.published_at.get(), rec.acks.loaded_hint());
        let waiting: Vec<String> = slots::list(&self.map)
            .into_iter()
            .filter(|c| acks & (1 << c.slot) == 0)
            .filter(|c| {
                slots::snapshot(self.map.consumer(c.slot))
                    .is_some_and(|s| s.joined_at < published_at)
            })
            .map(|c| format!("pid {}", c.process.pid))
            .collect();
        let loaded = acks.count_ones();
        if waiting.is_empty() {
            format!(
                "loaded by {loaded} consumer(s), fewer than min_consumers={}",
                self.min_consumers
            )
        } else {
            format!("not yet loaded by consumer(s) {}", waiting.join(", "))
        }
    }

    /// A wait of the producer ended after `waited`: count it (for the metrics).
    pub(super) fn count_wait(&self, waited: Duration) {
        let h = self.map.header();
        // Relaxed: statistics written by the producer alone (under no lock: a producer
        // that waits in two threads may lose an update, which only skews a statistic).
        h.stat_waits.add_own(1);
        let ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        h.stat_wait_ns.add_own(ns);
    }

    /// For the "still waiting for room" warning: the oldest held keys that keep their
    /// room, and why (which consumers have not loaded them, or that one maps them).
    pub(super) fn room_holders(&self) -> String {
        let oldest: Vec<(String, u32)> = {
            let st = lock(&self.state);
            let by_entry: HashMap<u32, &String> = st.keys.iter().map(|(k, &e)| (e, k)).collect();
            st.order
                .values()
                .take(3)
                .filter_map(|e| by_entry.get(e).map(|k| ((*k).clone(), *e)))
                .collect()
        };
        let named: Vec<String> = oldest
            .iter()
            .map(|(k, e)| {
                if !self.fully_loaded(*e as usize) {
                    format!("key {k:?} ({})", self.who_has_not_loaded(k))
                } else if !self.pins_zero(*e as usize) {
                    format!("key {k:?} (loaded, still mapped by a consumer)")
                } else {
                    format!("key {k:?} (free to evict)")
                }
            })
            .collect();
        let st = lock(&self.state);
        format!(
            "{} entries hold the room, the oldest: {}; {} evicted ones are still mapped",
            st.order.len(),
            if named.is_empty() {
                "none".to_owned()
            } else {
                named.join(", ")
            },
            st.zombies.len()
        )
    }

    pub(super) fn full_error(&self, needed: usize, waited: Duration) -> Error {
        let st = lock(&self.state);
        let held = st.order.len();
        let mut not_loaded = 0;
        let mut pinned = 0;
        for &e in st.order.values() {
            if !self.fully_loaded(e as usize) {
                not_loaded += 1;
            } else if !self.pins_zero(e as usize) {
                pinned += 1;
            }
        }
        let pending = st.keys.len() - held;
        let holders = format!(
            "{not_loaded} held entries are not yet loaded by every live consumer, {pinned} are \
             loaded but still mapped by a consumer, {} evicted ones are still mapped, {pending} \
             saves are in progress",
            st.zombies.len()
        );
        let reason = if st.shm_short {
            let mib = |b: u64| b >> 20;
            format!(
                "{SHM_DIR} ran out before the cache's capacity did ({} MiB free; this cache's \
                 entries hold {} MiB of it): {holders} (evict keys, let the \
                 consumers load them, or give the container more shared memory: `docker run \
                 --shm-size=...` or `--ipc=host`; on Kubernetes an emptyDir with `medium: \
                 Memory` at {SHM_DIR})",
                mib(shm_statvfs().map_or(0, |(free, _)| free)),
                mib(st.backing.backed_bytes() as u64),
            )
        } else {
            format!("{holders} (evict keys, let the consumers load them, or make the cache larger)")
        };
        Error::Cache(CacheError::Full {
            name: self.name.clone(),
            needed: needed as u64,
            capacity: self.map.geo.capacity as u64,
            held,
            waited,
            reason,
        })
    }
}
