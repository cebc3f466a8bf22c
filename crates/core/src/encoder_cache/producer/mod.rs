//! The producer: one per segment, the only process that allocates, publishes and evicts.
//!
//! Its bookkeeping lives in this process (under one lock): which key is in which entry,
//! the free entries and data ranges, publication order for eviction, zombies (entries
//! evicted while a consumer still had a view). The segment holds what other processes
//! need: the key index, the entry records, the consumer slots.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::wait::{Wait, WaitPolicy, WaitSpec};
use shmq_os::error::{Error, Result};
use shmq_os::private_map::page_size;
use shmq_os::process::ProcessId;
use shmq_os::segment::{shm_statvfs, unique_name, warn_shm_too_small, Segment, SHM_DIR};
use shmq_protocol::sync::Ordering;

use super::backing::Backing;
use super::entries::{self, PartsLayout, READY, RETIRED, WRITING};
use super::layout::{segment_name, Geometry, Mapped, SEGMENT_PREFIX, STATE_CLOSED};
use super::slots::{self, ConsumerInfo, StuckClaims};
use shmq_os::range_alloc::RangeAllocator;
use shmq_protocol::key_index::{IndexWriter, Key};

/// Default bytes of a producer's data region (address space; pages are reserved only as
/// they are used).
pub const DEFAULT_CAPACITY: usize = 1 << 30;
/// Default most entries (keys) one producer holds at once.
pub const DEFAULT_MAX_ENTRIES: usize = 4096;
/// Default most consumers at once.
pub const DEFAULT_MAX_CONSUMERS: usize = 16;

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

/// How a producer's segment is sized and when its entries count as loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProducerOptions {
    /// Bytes of entry data (rounded up to pages); the cache never uses more.
    pub capacity: usize,
    /// Most keys held at once.
    pub max_entries: usize,
    /// Most consumers at once (1..=64).
    pub max_consumers: usize,
    /// An entry counts as loaded only once at least this many consumers loaded it (and
    /// every live consumer that joined before it was published did). 0: as soon as the
    /// live consumers did, which is at once when there are none.
    pub min_consumers: usize,
}

impl Default for ProducerOptions {
    fn default() -> Self {
        ProducerOptions {
            capacity: DEFAULT_CAPACITY,
            max_entries: DEFAULT_MAX_ENTRIES,
            max_consumers: DEFAULT_MAX_CONSUMERS,
            min_consumers: 0,
        }
    }
}

/// What the producer's process knows of one entry.
#[derive(Debug)]
struct LocalEntry {
    generation: u64,
    /// Key of a WRITING or READY entry (None when FREE or RETIRED).
    key: Option<(String, Key)>,
    offset: usize,
    /// Whole pages.
    len: usize,
    /// Publication order (READY entries).
    seq: u64,
    /// `evict` was called while it was being written: drop it instead of publishing.
    cancelled: bool,
}

struct State {
    entries: Vec<LocalEntry>,
    /// Key → entry, for WRITING and READY entries.
    keys: HashMap<String, u32>,
    /// READY entries by publication order, oldest first.
    order: BTreeMap<u64, u32>,
    free_entries: Vec<u32>,
    /// Evicted entries whose bytes a consumer still maps.
    zombies: Vec<u32>,
    alloc: RangeAllocator,
    /// Ranges handed out to entries (WRITING, READY and zombies): offset → length.
    in_use: BTreeMap<usize, usize>,
    /// What of the data region is backed by pages of /dev/shm.
    backing: Backing,
    /// The last attempt to reserve found a range in the data region but no room in
    /// /dev/shm for it (so a failure names /dev/shm, not the capacity, as the limit).
    shm_short: bool,
    index: IndexWriter,
    stuck: StuckClaims,
    last_sweep: Instant,
    next_seq: u64,
    loaded_evicted: HashSet<String>,
    loaded_evicted_order: VecDeque<String>,
    saves: u64,
    evictions: u64,
}

pub(crate) struct Inner {
    pub(crate) map: Mapped,
    name: String,
    state: Mutex<State>,
    closed: AtomicBool,
    min_consumers: usize,
}

/// A producer: saves entries under keys for its consumers. Cheap to clone (shared).
#[derive(Clone)]
pub struct Producer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("name", &self.inner.name)
            .finish()
    }
}

/// Whether every consumer that must load a key has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadState {
    /// Every live consumer that joined before it was published loaded it (and at least
    /// `min_consumers` did); or it was evicted after that.
    Loaded,
    /// Saved (or being saved) and not yet loaded by all.
    Pending,
    /// Not held, and not known to have been loaded before it went.
    Unknown,
}

/// Occupancy of a producer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheStats {
    /// Keys held (published).
    pub entries: usize,
    /// Saves reserved and not yet published.
    pub pending: usize,
    /// Evicted entries still mapped by a consumer.
    pub zombies: usize,
    /// Bytes of the data region in use (whole pages).
    pub bytes_in_use: usize,
    /// Bytes of the data region backed in /dev/shm now.
    pub reserved: usize,
    pub capacity: usize,
    pub saves: u64,
    pub evictions: u64,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Producer {
    /// Make the segment of the producer `name` (`None`: a fresh unique name). If a
    /// segment of that name exists and its producer is dead, it is marked superseded (its
    /// consumers drop it at their next call, so they never serve its stale keys) and
    /// replaced; if its producer is alive, this fails. (Two processes that start under
    /// the same dead producer's name at the same moment are not kept apart reliably: one
    /// may remove the other's new segment. Give each encoder process its own name.)
    pub fn create(name: Option<&str>, options: ProducerOptions) -> Result<Producer> {
        let segment_name = match name {
            Some(n) => segment_name(n)?,
            None => unique_name("ec"),
        };
        let geo = Geometry::new(
            options.capacity,
            options.max_entries,
            options.max_consumers,
            page_size(),
        )?;
        if options.min_consumers > geo.max_consumers {
            return Err(Error::InvalidArgument(format!(
                "min_consumers ({}) cannot exceed max_consumers ({})",
                options.min_consumers, geo.max_consumers
            )));
        }
        replace_if_stale(&segment_name)?;
        let segment = Segment::create_sparse(&segment_name, geo.total, geo.data_offset)?;
        if name.is_some() {
            // A named cache outlives a crashed producer: what it published stays
            // readable by name until a producer of the same name replaces it.
            segment.survive_crash();
        }
        let map = Mapped::init(segment, geo, ProcessId::current());
        map.publish();
        let state = State {
            entries: (0..geo.max_entries)
                .map(|_| LocalEntry {
                    generation: 0,
                    key: None,
                    offset: 0,
                    len: 0,
                    seq: 0,
                    cancelled: false,
                })
                .collect(),
            keys: HashMap::new(),
            order: BTreeMap::new(),
            free_entries: (0..geo.max_entries as u32).rev().collect(),
            zombies: Vec::new(),
            alloc: RangeAllocator::new(geo.capacity, geo.page_size),
            in_use: BTreeMap::new(),
            backing: Backing::new(),
            shm_short: false,
            index: IndexWriter::new(),
            stuck: StuckClaims::default(),
            last_sweep: Instant::now(),
            next_seq: 0,
            loaded_evicted: HashSet::new(),
            loaded_evicted_order: VecDeque::new(),
            saves: 0,
            evictions: 0,
        };
        Ok(Producer {
            inner: Arc::new(Inner {
                name: segment_name[SEGMENT_PREFIX.len()..].to_owned(),
                map,
                state: Mutex::new(state),
                closed: AtomicBool::new(false),
                min_consumers: options.min_consumers,
            }),
        })
    }

    /// The name consumers open it by.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The segment's name in /dev/shm.
    pub fn segment_name(&self) -> &str {
        self.inner.map.segment.name()
    }

    pub fn capacity(&self) -> usize {
        self.inner.map.geo.capacity
    }

    pub fn max_entries(&self) -> usize {
        self.inner.map.geo.max_entries
    }

    fn check_open(&self) -> Result<()> {
        // Relaxed: a flag of this process; `close` also takes the lock.
        if self.inner.closed.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Error::WrongRole(format!(
                "encoder cache producer '{}' is closed",
                self.inner.name
            )));
        }
        // A peer that truncated the segment (see `shmq_os::sigbus`).
        self.inner.map.segment.check_intact()
    }

    /// Reserve room for an entry of parts of `part_lens` bytes under `key`, evicting the
    /// oldest entries every live consumer has loaded if needed (for want of capacity,
    /// entry records or /dev/shm), and waiting (as `wait` allows) while nothing can be
    /// evicted; then [`Error::CacheFull`], which names /dev/shm when that was the limit.
    /// `Ok(None)`: the key is held (or being saved) already. Fill the parts and
    /// [`publish`](Reservation::publish) it.
    pub fn reserve_with(
        &self,
        key: &str,
        part_lens: &[usize],
        wait: &mut Wait<'_>,
    ) -> Result<Option<Reservation>> {
        self.check_open()?;
        let ikey = Key::new(key.as_bytes())?;
        let layout = PartsLayout::new(part_lens)?;
        let inner = &self.inner;
        let rounded = {
            let st = lock(&inner.state);
            st.alloc.rounded(layout.total)
        }
        .ok_or(Error::TooLarge {
            size: layout.total as u64,
            max: inner.map.geo.capacity as u64,
        })?;
        let attempt = || -> Result<Option<Option<Reservation>>> {
            let mut st = lock(&inner.state);
            if st.keys.contains_key(key) {
                return Ok(Some(None));
            }
            match inner.try_reserve(&mut st, rounded)? {
                None => Ok(None),
                Some((entry, offset)) => Ok(Some(Some(Inner::start_writing(
                    inner, &mut st, entry, offset, rounded, key, &ikey,
                )))),
            }
        };
        let reservation = match attempt()? {
            Some(r) => r,
            None => {
                let mut sweep = || {
                    inner.sweep();
                    // A peer that truncated the segment ends the wait (see `shmq_os::sigbus`).
                    inner.map.segment.check_length()
                };
                let mut failure = None;
                let started = std::time::Instant::now();
                let got = wait.until_explained(
                    Some(inner.map.bell()),
                    &mut sweep,
                    &mut || inner.room_holders(),
                    || match attempt() {
                        Ok(Some(r)) => Some(r),
                        Ok(None) => None,
                        Err(e) => {
                            failure = Some(e);
                            Some(None)
                        }
                    },
                );
                inner.count_wait(started.elapsed());
                if let Some(e) = failure {
                    return Err(e);
                }
                match got {
                    Ok(r) => r,
                    Err(Error::Timeout { waited, .. }) => {
                        return Err(inner.full_error(layout.total, waited));
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let Some(mut r) = reservation else {
            return Ok(None);
        };
        layout.write_table(&mut r.bytes_mut()[..layout.total]);
        r.layout = layout;
        Ok(Some(r))
    }

    /// [`reserve_with`](Self::reserve_with) waiting at most `timeout` (`None`: forever).
    pub fn reserve(
        &self,
        key: &str,
        part_lens: &[usize],
        timeout: Option<Duration>,
    ) -> Result<Option<Reservation>> {
        let what = format!("encoder cache '{}' waiting for room", self.inner.name);
        let mut wait = self.wait(&what, timeout);
        self.reserve_with(key, part_lens, &mut wait)
    }

    /// Save `parts` under `key` (copy into shared memory, then publish). `Ok(false)`: the
    /// key is held already (keys name their content, so it is not copied again).
    pub fn save(&self, key: &str, parts: &[&[u8]], timeout: Option<Duration>) -> Result<bool> {
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        let Some(mut r) = self.reserve(key, &lens, timeout)? else {
            return Ok(false);
        };
        for (i, p) in parts.iter().enumerate() {
            shmq_os::copy::copy_large(r.part_mut(i), p);
        }
        r.publish()
    }

    /// Whether `key` is held and published.
    pub fn has(&self, key: &str) -> bool {
        let st = lock(&self.inner.state);
        st.keys
            .get(key)
            .is_some_and(|&e| self.inner.is_ready(e as usize))
    }

    /// The keys held and published, oldest first.
    pub fn keys(&self) -> Vec<String> {
        let st = lock(&self.inner.state);
        st.order
            .values()
            .filter_map(|&e| st.entries[e as usize].key.as_ref().map(|k| k.0.clone()))
            .collect()
    }

    /// Evict `key` now, whether or not consumers loaded it: it leaves the index at once;
    /// its bytes stay until the last consumer view of them is gone. A save in progress
    /// is dropped instead of published. Whether the key was held.
    pub fn evict(&self, key: &str) -> bool {
        let inner = &self.inner;
        let mut st = lock(&inner.state);
        let Some(&e) = st.keys.get(key) else {
            return false;
        };
        if inner.is_ready(e as usize) {
            inner.retire(&mut st, e, false);
        } else {
            st.entries[e as usize].cancelled = true;
            st.keys.remove(key);
        }
        true
    }

    /// Whether `key` has been loaded by every consumer that must.
    pub fn load_state(&self, key: &str) -> LoadState {
        let st = lock(&self.inner.state);
        self.inner.load_state(&st, key)
    }

    /// Wait (as `wait` allows) until every live consumer that joined before `key` was
    /// published has loaded it (and at least `min_consumers` did). Consumers that die
    /// stop counting (they are checked about twice a second). Fails with
    /// [`Error::UnknownKey`] for a key not held (or evicted before it was loaded).
    pub fn wait_loaded_with(&self, key: &str, wait: &mut Wait<'_>) -> Result<()> {
        let inner = &self.inner;
        let mut sweep = || {
            inner.sweep();
            // A peer that truncated the segment ends the wait (see `shmq_os::sigbus`).
            inner.map.segment.check_length()
        };
        let ready = || match self.load_state(key) {
            LoadState::Loaded => Some(Ok(())),
            LoadState::Pending => None,
            LoadState::Unknown => Some(Err(Error::UnknownKey(key.to_owned()))),
        };
        if let Some(r) = ready() {
            return r;
        }
        let started = std::time::Instant::now();
        let r = wait.until_explained(
            Some(inner.map.bell()),
            &mut sweep,
            &mut || format!("key {key:?}: {}", inner.who_has_not_loaded(key)),
            ready,
        );
        inner.count_wait(started.elapsed());
        match r {
            Ok(r) => r,
            Err(Error::Timeout { what, waited }) => Err(Error::Timeout {
                what: format!("{what} ({})", inner.who_has_not_loaded(key)),
                waited,
            }),
            Err(e) => Err(e),
        }
    }

    /// [`wait_loaded_with`](Self::wait_loaded_with) waiting at most `timeout`.
    pub fn wait_loaded(&self, key: &str, timeout: Option<Duration>) -> Result<()> {
        let what = format!("waiting for the consumers to load key {key:?}");
        let mut wait = self.wait(&what, timeout);
        self.wait_loaded_with(key, &mut wait)
    }

    /// Wait (as `wait` allows) until some of `keys` are no longer [`LoadState::Pending`];
    /// returns those, with their state. Empty if the wait timed out.
    pub fn wait_any_loaded_with(
        &self,
        keys: &[String],
        wait: &mut Wait<'_>,
    ) -> Result<Vec<(String, LoadState)>> {
        let inner = &self.inner;
        let mut sweep = || {
            inner.sweep();
            // A peer that truncated the segment ends the wait (see `shmq_os::sigbus`).
            inner.map.segment.check_length()
        };
        let r = wait.until(Some(inner.map.bell()), &mut sweep, || {
            let st = lock(&inner.state);
            let done: Vec<(String, LoadState)> = keys
                .iter()
                .map(|k| (k.clone(), inner.load_state(&st, k)))
                .filter(|(_, s)| *s != LoadState::Pending)
                .collect();
            (!done.is_empty()).then_some(done)
        });
        match r {
            Err(Error::Timeout { .. }) => Ok(Vec::new()),
            r => r,
        }
    }

    /// Reclaim the slots of dead consumers and free evicted entries nobody maps any more
    /// (done by every wait anyway).
    pub fn sweep(&self) {
        self.inner.sweep();
    }

    /// The consumers joined now.
    pub fn consumers(&self) -> Vec<ConsumerInfo> {
        slots::list(&self.inner.map)
    }

    pub fn stats(&self) -> CacheStats {
        let st = lock(&self.inner.state);
        let geo = &self.inner.map.geo;
        CacheStats {
            entries: st.order.len(),
            pending: st.keys.len() - st.order.len(),
            zombies: st.zombies.len(),
            bytes_in_use: geo.capacity - st.alloc.free_bytes(),
            reserved: st.backing.backed_bytes(),
            capacity: geo.capacity,
            saves: st.saves,
            evictions: st.evictions,
        }
    }

    /// The wait that `spec` describes (a timeout, a hook), for `what`, as this producer's
    /// waits go: it sleeps on the segment's doorbell, never spinning (consumers load at
    /// their own pace, so a spinning producer would only take their CPU), and it ends
    /// with [`Error::Cancelled`] once the producer is [closed](Self::close) from another
    /// thread. What the `_with` methods take.
    pub fn wait<'a, 'w: 'a>(&'a self, what: &'a str, spec: impl Into<WaitSpec<'w>>) -> Wait<'a> {
        spec.into().into_wait(
            what,
            WaitPolicy::for_processes(usize::MAX),
            &self.inner.closed,
        )
    }

    /// Stop serving: the segment is marked closed (consumers drop it at their next call;
    /// views they hold stay valid) and its name removed. Reservations not yet published
    /// fail. Idempotent.
    pub fn close(&self) -> Result<()> {
        self.inner.close()
    }

    /// Remove the segment's name now (as at interpreter exit), without closing.
    pub fn unlink(&self) -> Result<()> {
        self.inner.map.segment.unlink()
    }
}

/// If segment `name` exists and its producer is dead, mark it superseded and remove it.
fn replace_if_stale(name: &str) -> Result<()> {
    let path = format!("{SHM_DIR}/{name}");
    if !std::path::Path::new(&path).exists() {
        return Ok(());
    }
    let old = match Segment::open(name) {
        Ok(s) => s,
        Err(Error::SegmentNotFound { .. }) => return Ok(()),
        Err(e) => return Err(e),
    };
    let creator = Mapped::creator_of(&old);
    if let Some(c) = creator.filter(|c| c.is_alive()) {
        return Err(Error::InvalidArgument(format!(
            "encoder cache '{}' is already served by a live producer (pid {})",
            &name[SEGMENT_PREFIX.len().min(name.len())..],
            c.pid
        )));
    }
    let was_cache = Mapped::mark_superseded(old);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::os(format!("removing the stale segment {path}"), e)),
    }
    shmq_log!(
        info,
        "shmq: replaced {} '{name}' left by dead producer pid {}",
        if was_cache {
            "encoder cache"
        } else {
            "unfinished segment"
        },
        creator.map_or(0, |c| c.pid)
    );
    Ok(())
}

impl Inner {
    fn is_ready(&self, e: usize) -> bool {
        // Relaxed: only this process stores the word.
        entries::state_of(self.map.entry(e).state.load(Ordering::Relaxed)) == READY
    }

    fn pins_zero(&self, e: usize) -> bool {
        // SeqCst: pairs with the consumer's SeqCst pin increment and state load (Dekker;
        // see `entries`). Also Acquire: a consumer's reads of the bytes happen before
        // its Release unpin, so before we reuse them.
        (0..self.map.geo.max_consumers).all(|s| self.map.pin(e, s).load(Ordering::SeqCst) == 0)
    }

    /// Whether entry `e` (READY) has been loaded by every consumer that must.
    fn fully_loaded(&self, e: usize) -> bool {
        let rec = self.map.entry(e);
        // Relaxed: stored by this process.
        let published_at = rec.published_at.load(Ordering::Relaxed);
        // Acquire: pairs with the consumers' Release `fetch_or`.
        let acks = rec.acks.load(Ordering::Acquire);
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

    fn load_state(&self, st: &State, key: &str) -> LoadState {
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

    fn who_has_not_loaded(&self, key: &str) -> String {
        let st = lock(&self.state);
        let Some(&e) = st.keys.get(key) else {
            return "the key is no longer held".into();
        };
        if !self.is_ready(e as usize) {
            return "its save has not finished".into();
        }
        let rec = self.map.entry(e as usize);
        // Relaxed: a report.
        let (published_at, acks) = (
            rec.published_at.load(Ordering::Relaxed),
            rec.acks.load(Ordering::Relaxed),
        );
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
    fn count_wait(&self, waited: Duration) {
        let h = self.map.header();
        // Relaxed: statistics written by the producer alone (under no lock: a producer
        // that waits in two threads may lose an update, which only skews a statistic).
        h.stat_waits
            .store(h.stat_waits.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        let ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        h.stat_wait_ns.store(
            h.stat_wait_ns.load(Ordering::Relaxed).wrapping_add(ns),
            Ordering::Relaxed,
        );
    }

    /// For the "still waiting for room" warning: the oldest held keys that keep their
    /// room, and why (which consumers have not loaded them, or that one maps them).
    fn room_holders(&self) -> String {
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

    fn full_error(&self, needed: usize, waited: Duration) -> Error {
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
        Error::CacheFull {
            name: self.name.clone(),
            needed: needed as u64,
            capacity: self.map.geo.capacity as u64,
            held,
            waited,
            reason,
        }
    }

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
    fn try_reserve(&self, st: &mut State, len: usize) -> Result<Option<(u32, usize)>> {
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
                        Err(Error::NoSpace { .. }) => {
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
    fn retire(&self, st: &mut State, e: u32, loaded: bool) {
        let rec = self.map.entry(e as usize);
        let local = &mut st.entries[e as usize];
        let generation = local.generation;
        // SeqCst: the producer's half of the pin handshake (see `entries`): stored before
        // the pin counts are read below.
        rec.state
            .store(entries::word(generation, RETIRED), Ordering::SeqCst);
        let (key, ikey) = local.key.take().expect("a READY entry has a key");
        let seq = local.seq;
        st.order.remove(&seq);
        st.keys.remove(&key);
        st.index.remove(&self.map.index(), &ikey);
        st.evictions += 1;
        // Relaxed: a statistic.
        self.map
            .header()
            .stat_evictions
            .store(st.evictions, Ordering::Relaxed);
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
    fn free_entry(&self, st: &mut State, e: u32) {
        let local = &mut st.entries[e as usize];
        local.generation += 1;
        local.key = None;
        local.cancelled = false;
        let (offset, len, generation) = (local.offset, local.len, local.generation);
        // Release: a consumer that sees the new generation (and so no longer uses the
        // entry) sees everything before; the bytes are not touched until a new save.
        self.map
            .entry(e as usize)
            .state
            .store(entries::word(generation, entries::FREE), Ordering::Release);
        st.in_use.remove(&offset);
        st.alloc.give_back(offset, len);
        st.free_entries.push(e);
        self.publish_stats(st);
    }

    fn start_writing(
        this: &Arc<Inner>,
        st: &mut State,
        entry: u32,
        offset: usize,
        len: usize,
        key: &str,
        ikey: &Key,
    ) -> Reservation {
        let local = &mut st.entries[entry as usize];
        local.key = Some((key.to_owned(), ikey.clone()));
        local.offset = offset;
        local.len = len;
        local.cancelled = false;
        let generation = local.generation;
        // Relaxed: no consumer looks at a WRITING entry (the index does not name it yet).
        this.map
            .entry(entry as usize)
            .state
            .store(entries::word(generation, WRITING), Ordering::Relaxed);
        st.keys.insert(key.to_owned(), entry);
        debug_assert_eq!(st.in_use.get(&offset), Some(&len), "try_reserve records it");
        this.publish_stats(st);
        // SAFETY: offset + len <= capacity (the allocator's ranges lie in the data
        // region), so the pointer stays inside the mapping.
        let ptr = unsafe { this.map.data().add(offset) };
        Reservation {
            inner: this.clone(),
            entry,
            generation,
            ptr,
            len,
            layout: PartsLayout {
                parts: Vec::new(),
                total: 0,
            },
            done: false,
        }
    }

    /// Make sure `offset..offset + len` of the data region is backed in /dev/shm: the
    /// holes in it reserved again, and the mark raised past it (a step at a time, or
    /// exactly to its end when a step does not fit). [`Error::NoSpace`] if /dev/shm has
    /// no room for it (what was reserved before the failure stays reserved and recorded).
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
                Err(Error::NoSpace { .. }) if target != end => {}
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
                return Err(Error::NoSpace {
                    name: self.map.segment.name().to_owned(),
                    needed: len as u64,
                    available: free,
                });
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

    fn publish_stats(&self, st: &State) {
        let h = self.map.header();
        // Relaxed: statistics for inspection.
        h.stat_entries
            .store(st.order.len() as u64, Ordering::Relaxed);
        h.stat_bytes.store(
            (self.map.geo.capacity - st.alloc.free_bytes()) as u64,
            Ordering::Relaxed,
        );
        h.stat_reserved
            .store(st.backing.backed_bytes() as u64, Ordering::Relaxed);
        h.stat_saves.store(st.saves, Ordering::Relaxed);
    }

    fn sweep(&self) {
        let mut st = lock(&self.state);
        st.last_sweep = Instant::now();
        slots::reclaim_dead(&self.map, Some(&mut st.stuck));
        self.free_zombies(&mut st);
    }

    /// Publish reservation `r`'s entry: READY, then into the index.
    fn publish(&self, entry: u32, generation: u64, total: usize) -> Result<bool> {
        let mut st = lock(&self.state);
        // The bytes may have been copied into the zero pages of a truncated segment.
        if let Err(e) = self.map.segment.check_intact() {
            self.abandon_locked(&mut st, entry);
            return Err(e);
        }
        let local = &st.entries[entry as usize];
        if local.generation != generation || local.key.is_none() {
            return Err(Error::InvalidArgument(
                "this reservation is no longer valid".into(),
            ));
        }
        // Relaxed: `close` sets it under this same lock.
        if local.cancelled || self.closed.load(std::sync::atomic::Ordering::Relaxed) {
            let closed = !local.cancelled;
            self.abandon_locked(&mut st, entry);
            if closed {
                return Err(Error::WrongRole(format!(
                    "encoder cache producer '{}' is closed",
                    self.name
                )));
            }
            return Ok(false);
        }
        let (offset, (key, ikey)) = (local.offset, local.key.clone().expect("checked"));
        let rec = self.map.entry(entry as usize);
        // Relaxed: published by the Release store of READY below.
        rec.offset.store(offset as u64, Ordering::Relaxed);
        rec.len.store(total as u64, Ordering::Relaxed);
        rec.acks.store(0, Ordering::Relaxed);
        // SeqCst read-modify-write: see `slots` (late joiners).
        let published_at = self.map.header().clock.fetch_add(1, Ordering::SeqCst);
        rec.published_at.store(published_at, Ordering::Relaxed);
        // Release: pairs with the consumer's (SeqCst, so Acquire) state load in
        // `Link::load`: a consumer that sees READY sees the bytes, offset and length.
        rec.state
            .store(entries::word(generation, READY), Ordering::Release);
        let index = self.map.index();
        st.index.insert(&index, &ikey, entry, generation)?;
        if st.index.needs_rebuild(&index) {
            let live: Vec<(Key, u32, u64)> = st
                .order
                .values()
                .map(|&e| {
                    let l = &st.entries[e as usize];
                    (
                        l.key.as_ref().expect("READY has a key").1.clone(),
                        e,
                        l.generation,
                    )
                })
                .chain(std::iter::once((ikey.clone(), entry, generation)))
                .collect();
            st.index
                .rebuild(&index, live.iter().map(|(k, e, g)| (k, *e, *g)))?;
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        st.entries[entry as usize].seq = seq;
        st.order.insert(seq, entry);
        st.saves += 1;
        debug_assert_eq!(st.keys.get(&key), Some(&entry));
        self.publish_stats(&st);
        Ok(true)
    }

    fn abandon_locked(&self, st: &mut State, entry: u32) {
        if let Some((key, _)) = st.entries[entry as usize].key.take() {
            if st.keys.get(&key) == Some(&entry) {
                st.keys.remove(&key);
            }
        }
        self.free_entry(st, entry);
    }

    fn abandon(&self, entry: u32, generation: u64) {
        let mut st = lock(&self.state);
        // Relaxed: only this process stores the word.
        if st.entries[entry as usize].generation == generation
            && entries::state_of(self.map.entry(entry as usize).state.load(Ordering::Relaxed))
                == WRITING
        {
            self.abandon_locked(&mut st, entry);
        }
    }

    fn close(&self) -> Result<()> {
        let _st = lock(&self.state);
        // Relaxed: read by this process's own calls (which also take the lock), and
        // polled by its waits (`Producer::wait`), which need no ordering with anything
        // else it guards: they only end.
        if self.closed.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        // Release: pairs with the consumers' Acquire state load (they drop the segment).
        self.map
            .header()
            .state
            .store(STATE_CLOSED, Ordering::Release);
        self.map.segment.unlink()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// Room for one entry, reserved by [`Producer::reserve`]: fill its parts, then
/// [`publish`](Self::publish). Dropped unpublished, the room is given back.
pub struct Reservation {
    inner: Arc<Inner>,
    entry: u32,
    generation: u64,
    ptr: *mut u8,
    /// Bytes reserved (whole pages).
    len: usize,
    layout: PartsLayout,
    done: bool,
}

// SAFETY: the reservation's bytes are a range of the shared mapping that `inner` keeps
// alive and that only this reservation writes (the allocator hands each range to one
// entry; no consumer can load a WRITING entry).
unsafe impl Send for Reservation {}
// SAFETY: `&Reservation` gives no access to the bytes.
unsafe impl Sync for Reservation {}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("entry", &self.entry)
            .field("parts", &self.layout.parts)
            .finish()
    }
}

impl Reservation {
    /// `(offset, len)` of each part within the entry.
    pub fn parts(&self) -> &[(usize, usize)] {
        &self.layout.parts
    }

    /// The entry's bytes (part table and parts).
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr..ptr + len` is this reservation's range in the data region (see
        // Send); `&mut self` makes this the only reference to it in this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Part `i`, to fill.
    pub fn part_mut(&mut self, i: usize) -> &mut [u8] {
        let (off, len) = self.layout.parts[i];
        &mut self.bytes_mut()[off..off + len]
    }

    /// Make the entry visible to every consumer. `Ok(false)` if it was evicted while
    /// being written (it is dropped instead).
    pub fn publish(mut self) -> Result<bool> {
        self.done = true;
        self.inner
            .publish(self.entry, self.generation, self.layout.total)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.done {
            self.inner.abandon(self.entry, self.generation);
        }
    }
}
