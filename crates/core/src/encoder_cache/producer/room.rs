//! Finding room for an entry: an entry record and a data range, evicting what every
//! consumer has loaded (oldest first), and the pages of the data region, reserved in
//! /dev/shm as needed and given back when free, leaving a headroom for the machine's
//! other segments.

use std::time::{Duration, Instant};

use super::{Inner, State, lock};
use crate::encoder_cache::slots;
use crate::error::{Error, OsError, Result};
use shmq_os::segment::{shm_statvfs, warn_shm_too_small};

/// How often a producer that cannot find room looks for dead consumers (besides the
/// wait's own liveness checks).
const SWEEP_INTERVAL: Duration = Duration::from_millis(200);
/// Keys remembered as "evicted after every consumer loaded them", for `wait_loaded`.
const LOADED_MEMORY: usize = 4096;
/// The data region is reserved in `/dev/shm` in steps of at least this much (to keep the
/// system calls rare), or exactly what an entry needs where a step does not fit.
const RESERVE_STEP: usize = 64 << 20;
/// While it has entries it may evict, the cache leaves this share of /dev/shm free (at
/// most [`HEADROOM_MAX`]) for the machine's other segments (queues, stores): it evicts
/// rather than take pages from there. With nothing to evict it uses all there is, and
/// gives it back at a later reservation that finds something to evict.
const HEADROOM_SHARE: u64 = 8;
const HEADROOM_MAX: u64 = 64 << 20;

/// Whether taking `more` bytes of /dev/shm would leave less than the headroom free.
fn crowds_shm(more: usize) -> bool {
    shm_statvfs().is_some_and(|(free, total)| {
        free.saturating_sub(more as u64) < (total / HEADROOM_SHARE).min(HEADROOM_MAX)
    })
}

impl Inner {
    /// Find an entry record and a data range for `len` bytes (whole pages), backed in
    /// /dev/shm, evicting loaded entries oldest first. `None`: no room now (in the
    /// capacity, the entry records, or /dev/shm: `st.shm_short` says which).
    ///
    /// /dev/shm running out is handled like the capacity running out: what may go is
    /// evicted (the same rule: loaded by every consumer that must, mapped by none), and
    /// the pages of free ranges are given back to /dev/shm before trying again. The
    /// loop ends: a pass either evicts an entry, or gives pages back that were not given
    /// back before (which only an eviction or a free makes possible again), or returns.
    /// The same happens, short of failing, when new pages would leave less than the
    /// headroom of /dev/shm free (see [`HEADROOM_SHARE`]).
    pub(super) fn try_reserve(&self, st: &mut State, len: usize) -> Result<Option<(u32, usize)>> {
        self.free_zombies(st);
        loop {
            if !st.free_entries.is_empty() {
                if let Some(offset) = st.alloc.take(len) {
                    // New pages that would cut into the headroom: evict first if anything
                    // may go (its range, still backed, is likely what the next take gives),
                    // then give the pages of free ranges back; only then grow into it.
                    let more: usize = st
                        .backing
                        .missing(offset, offset + len)
                        .iter()
                        .map(|(a, b)| b - a)
                        .sum();
                    if more > 0 && crowds_shm(more) {
                        if let Some(victim) = self.oldest_evictable(st) {
                            st.alloc.give_back(offset, len);
                            self.retire(st, victim, true);
                            continue;
                        }
                        if self.release_free_pages(st) > 0 {
                            st.alloc.give_back(offset, len);
                            continue;
                        }
                    }
                    match self.back(st, offset, len) {
                        Ok(()) => {
                            st.shm_short = false;
                            let entry = st.free_entries.pop().expect("checked above");
                            // In use from now on (so no release below can touch it).
                            st.in_use.insert(offset, len);
                            self.restore_headroom(st);
                            return Ok(Some((entry, offset)));
                        }
                        Err(Error::Os(OsError::NoSpace { .. })) => {
                            st.alloc.give_back(offset, len);
                            if !st.shm_short {
                                warn_shm_too_small(
                                    "the encoder cache evicts what its consumers have loaded \
                                     and gives the pages back, and `save` waits for room (then \
                                     raises MemoryError)",
                                );
                            }
                            st.shm_short = true;
                            if self.release_free_pages(st) > 0 {
                                continue;
                            }
                        }
                        Err(e) => {
                            st.alloc.give_back(offset, len);
                            return Err(e);
                        }
                    }
                } else {
                    st.shm_short = false;
                }
            } else {
                st.shm_short = false;
            }
            if self.evict_oldest_loaded(st) {
                continue;
            }
            if st.last_sweep.elapsed() >= SWEEP_INTERVAL {
                st.last_sweep = Instant::now();
                if slots::reclaim_dead(&self.map, Some(&mut st.stuck)) > 0 {
                    self.free_zombies(st);
                    continue;
                }
            }
            return Ok(None);
        }
    }

    /// If less than the headroom of /dev/shm is free (the cache grew into it while
    /// nothing could go), give back the pages of free ranges and evict what may go, until
    /// it is free again or nothing more may go.
    fn restore_headroom(&self, st: &mut State) {
        while crowds_shm(0) {
            if self.release_free_pages(st) > 0 {
                continue;
            }
            match self.oldest_evictable(st) {
                Some(victim) => self.retire(st, victim, true),
                None => break,
            }
        }
    }

    /// The oldest READY entry that every consumer has loaded and none maps.
    fn oldest_evictable(&self, st: &State) -> Option<u32> {
        st.order
            .values()
            .copied()
            .find(|&e| self.fully_loaded(e as usize) && self.pins_zero(e as usize))
    }

    /// Evict the oldest READY entry that every consumer has loaded and none maps.
    fn evict_oldest_loaded(&self, st: &mut State) -> bool {
        match self.oldest_evictable(st) {
            Some(e) => {
                self.retire(st, e, true);
                true
            }
            None => false,
        }
    }

    /// Take READY entry `e` out of the index and free it (or keep it as a zombie while a
    /// consumer maps it).
    pub(super) fn retire(&self, st: &mut State, e: u32, loaded: bool) {
        let rec = self.map.entry(e as usize);
        let local = &mut st.entries[e as usize];
        let generation = local.generation;
        // The producer's half of the pin handshake (`EntryState::retire`): stored before
        // the pin counts are read below.
        rec.state.retire(generation);
        let (key, ikey) = local.key.take().expect("a READY entry has a key");
        let seq = local.seq;
        st.order.remove(&seq);
        st.keys.remove(&key);
        st.index.remove(&self.map.index(), &ikey);
        st.evictions += 1;
        // Relaxed: a statistic.
        self.map.header().stat_evictions.set(st.evictions);
        if loaded || self.fully_loaded(e as usize) {
            if st.loaded_evicted_order.len() >= LOADED_MEMORY {
                if let Some(old) = st.loaded_evicted_order.pop_front() {
                    st.loaded_evicted.remove(&old);
                }
            }
            if st.loaded_evicted.insert(key.clone()) {
                st.loaded_evicted_order.push_back(key);
            }
        }
        if self.pins_zero(e as usize) {
            self.free_entry(st, e);
        } else {
            st.zombies.push(e);
        }
        self.publish_stats(st);
    }

    fn free_zombies(&self, st: &mut State) {
        let mut k = 0;
        while k < st.zombies.len() {
            let e = st.zombies[k];
            if self.pins_zero(e as usize) {
                st.zombies.swap_remove(k);
                self.free_entry(st, e);
            } else {
                k += 1;
            }
        }
    }

    /// Entry `e` (RETIRED with no pins, or WRITING and abandoned) becomes FREE in the next
    /// generation; its range goes back to the allocator.
    pub(super) fn free_entry(&self, st: &mut State, e: u32) {
        let local = &mut st.entries[e as usize];
        local.generation += 1;
        local.key = None;
        local.cancelled = false;
        let (offset, len, generation) = (local.offset, local.len, local.generation);
        // Release (`EntryState::free`): the bytes are not touched until a new save.
        self.map.entry(e as usize).state.free(generation);
        st.in_use.remove(&offset);
        st.alloc.give_back(offset, len);
        st.free_entries.push(e);
        self.publish_stats(st);
    }

    /// Make sure `offset..offset + len` of the data region is backed in /dev/shm: the
    /// holes in it reserved again, and the mark raised past it (a step at a time, or
    /// exactly to its end when a step does not fit). [`OsError::NoSpace`] if /dev/shm has
    /// no room for it (what was reserved before the failure stays reserved and recorded).
    /// Reserve the data region's first step now, as the producer is made (where
    /// /dev/shm has room for it; else the first save reserves what it needs): the first
    /// save then finds its pages ready instead of reserving tens of MiB on its caller's
    /// path (the encoder's step, in vLLM).
    pub(super) fn back_first_step(&self) {
        let page = self.map.geo.page_size;
        if self.map.geo.capacity >= page {
            let mut st = lock(&self.state);
            // Best effort: a failure here is met again, and reported, by a save.
            let _ = self.back(&mut st, 0, page);
        }
    }

    fn back(&self, st: &mut State, offset: usize, len: usize) -> Result<()> {
        let end = offset + len;
        for (a, b) in st.backing.missing(offset, end.min(st.backing.mark())) {
            self.commit(a, b - a)?;
            st.backing.fill(a, b);
        }
        let from = st.backing.mark();
        if end <= from {
            return Ok(());
        }
        let mut step = end
            .max(from.saturating_add(RESERVE_STEP))
            .min(self.map.geo.capacity);
        // A step ahead of need only while it leaves the headroom free.
        if step > end && crowds_shm(step - from) {
            step = end;
        }
        let mut last = Ok(());
        for target in [step, end] {
            last = self.commit(from, target - from);
            match last {
                Ok(()) => {
                    st.backing.fill(from, target);
                    return Ok(());
                }
                Err(Error::Os(OsError::NoSpace { .. })) if target != end => {}
                Err(_) => break,
            }
        }
        last
    }

    /// Reserve `from..from + len` of the data region in /dev/shm (the pages are not
    /// backed yet), and fault the producer's page tables in.
    fn commit(&self, from: usize, len: usize) -> Result<()> {
        // Asked first: tmpfs would allocate page by page up to the failure and then
        // undo it all, which a producer polling for room would do again and again.
        if let Some((free, _)) = shm_statvfs() {
            if len as u64 > free {
                return Err(Error::Os(OsError::NoSpace {
                    name: self.map.segment.name().to_owned(),
                    needed: len as u64,
                    available: free,
                }));
            }
        }
        self.map
            .segment
            .reserve_range(self.map.geo.data_offset + from, len)?;
        // Fault the producer's page tables in now rather than page by page during the
        // first copies (best effort: older kernels lack it).
        // SAFETY: the range lies inside the mapping (from + len <= capacity); its pages
        // are reserved and hold no entry a consumer may map (they are free or handed to
        // the entry about to be written); MADV_POPULATE_WRITE changes no byte.
        unsafe {
            libc::madvise(
                self.map.data().add(from) as *mut libc::c_void,
                len,
                libc::MADV_POPULATE_WRITE,
            );
        }
        Ok(())
    }

    /// Give the pages of every free range of the data region back to /dev/shm (a hole
    /// punched in the file). Returns the bytes given back.
    fn release_free_pages(&self, st: &mut State) -> usize {
        let mark = st.backing.mark();
        let mut free = Vec::new();
        let mut at = 0;
        for (&offset, &len) in &st.in_use {
            if offset > at {
                free.push((at, offset.min(mark)));
            }
            at = at.max(offset + len);
            if at >= mark {
                break;
            }
        }
        if at < mark {
            free.push((at, mark));
        }
        let mut released = 0;
        for (a, b) in free {
            for (x, y) in st.backing.backed(a, b) {
                // SAFETY: `x..y` lies inside the data region (below the mark, which is at
                // most the capacity), page-aligned (ranges are whole pages from a
                // page-aligned start). It is free: no entry holds it, so no consumer
                // maps it (an entry's range is freed only once no pin is left, and a
                // consumer reads an entry only while pinned) and the producer writes it
                // only after `back` reserved it again. MADV_REMOVE punches a hole in the
                // shared file: its pages return to /dev/shm and leave every mapping of it
                // (ours, consumers' idle private windows), none of which touches it.
                let rc = unsafe {
                    libc::madvise(
                        self.map.data().add(x) as *mut libc::c_void,
                        y - x,
                        libc::MADV_REMOVE,
                    )
                };
                if rc == 0 {
                    st.backing.punch(x, y);
                    released += y - x;
                }
            }
        }
        if released > 0 {
            self.publish_stats(st);
        }
        released
    }

    pub(super) fn publish_stats(&self, st: &State) {
        let h = self.map.header();
        // Relaxed: statistics for inspection.
        h.stat_entries.set(st.order.len() as u64);
        h.stat_bytes
            .set((self.map.geo.capacity - st.alloc.free_bytes()) as u64);
        h.stat_reserved.set(st.backing.backed_bytes() as u64);
        h.stat_saves.set(st.saves);
    }

    pub(super) fn sweep(&self) {
        let mut st = lock(&self.state);
        st.last_sweep = Instant::now();
        slots::reclaim_dead(&self.map, Some(&mut st.stuck));
        self.free_zombies(&mut st);
    }
}
