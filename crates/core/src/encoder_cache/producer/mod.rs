//! The producer: one per segment, the only process that allocates, publishes and evicts.
//!
//! Its bookkeeping lives in this process (under one lock): which key is in which entry,
//! the free entries and data ranges, publication order for eviction, zombies (entries
//! evicted while a consumer still had a view). The segment holds what other processes
//! need: the key index, the entry records, the consumer slots.
//!
//! The files: this one (the options, [`Producer`]'s calls, the process's bookkeeping);
//! `room` (finding room: reserving, evicting, backing pages in /dev/shm); `loaded`
//! (whether entries are loaded and mapped, and the reports of what holds the room);
//! `reservation` ([`Reservation`]: an entry being written, then published).

mod loaded;
mod reservation;
mod room;

pub use reservation::Reservation;

use shmq_protocol::sync::local::AtomicBool;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{CacheError, Error, OsError, Result};
use crate::wait::{Wait, WaitPolicy, WaitSpec};
use shmq_os::private_map::page_size;
use shmq_os::process::ProcessId;
use shmq_os::segment::{Segment, with_unique_name};
use shmq_os::segment_file;

use super::backing::Backing;
use super::entries::PartsLayout;
use super::layout::{Geometry, Mapped, SEGMENT_PREFIX, STATE_CLOSED, segment_name};
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
///
/// # Examples
///
/// A producer (an encoder) saves entries; a [`Consumer`](super::Consumer) of it (a
/// model runner, in another process in real use) loads them as private views:
///
/// ```
/// use std::time::Duration;
/// use shmq_core::encoder_cache::{Consumer, LoadState, Producer, ProducerOptions};
///
/// let producer = Producer::create(None, ProducerOptions::default())?;
/// let mut consumer = Consumer::new(&[producer.name()])?;
/// let timeout = Some(Duration::from_secs(10));
/// assert!(producer.save("image-1", &[b"body", &[7u8; 5000]], timeout)?);
/// assert!(!producer.save("image-1", &[b"again"], timeout)?); // held already
/// assert!(consumer.has("image-1") && producer.has("image-1"));
/// assert_eq!(producer.load_state("image-1"), LoadState::Pending);
///
/// let entry = consumer.load("image-1")?.expect("held");
/// assert_eq!((entry.n_parts(), entry.part(0)), (2, &b"body"[..]));
/// producer.wait_loaded("image-1", timeout)?; // every consumer has it now
/// assert_eq!(producer.load_state("image-1"), LoadState::Loaded);
/// assert_eq!(producer.keys(), ["image-1"]);
///
/// assert!(producer.evict("image-1")); // the view stays valid while it lives
/// assert_eq!(entry.part(1).len(), 5000);
/// producer.close()?;
/// # Ok::<(), shmq_core::Error>(())
/// ```
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
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad `name` or options out of range; [`Error::Os`]
    /// when the segment cannot be made (a live producer holds the name, no room in
    /// `/dev/shm`).
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn create(name: Option<&str>, options: ProducerOptions) -> Result<Producer> {
        let named = name.map(segment_name).transpose()?;
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
        let segment = match &named {
            Some(segment_name) => {
                replace_if_stale(segment_name)?;
                Segment::create_sparse(segment_name, geo.total, geo.data_offset)?
            }
            // A fresh name: no stale segment to replace, and another is drawn while one
            // is taken.
            None => with_unique_name("ec", |n| {
                Segment::create_sparse(n, geo.total, geo.data_offset)
            })?,
        };
        let segment_name = segment.name().to_owned();
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
        let producer = Producer {
            inner: Arc::new(Inner {
                name: segment_name[SEGMENT_PREFIX.len()..].to_owned(),
                map,
                state: Mutex::new(state),
                closed: AtomicBool::new(false),
                min_consumers: options.min_consumers,
            }),
        };
        producer.inner.back_first_step();
        Ok(producer)
    }

    /// The name consumers open it by.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The segment's name in /dev/shm.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn segment_name(&self) -> &str {
        self.inner.map.segment.name()
    }

    /// Bytes of the cache's entries.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn capacity(&self) -> usize {
        self.inner.map.geo.capacity
    }

    /// The most entries the cache holds at once.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
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
        Ok(self.inner.map.segment.check_intact()?)
    }

    /// Reserve room for an entry of parts of `part_lens` bytes under `key`, evicting the
    /// oldest entries every live consumer has loaded if needed (for want of capacity,
    /// entry records or /dev/shm), and waiting (as `wait` allows) while nothing can be
    /// evicted; then [`CacheError::Full`], which names /dev/shm when that was the limit.
    /// `Ok(None)`: the key is held (or being saved) already. Fill the parts and
    /// [`publish`](Reservation::publish) it.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] once the producer is closed; [`Error::InvalidArgument`] for a
    /// key of 0 or too many bytes, or too many parts; [`CacheError::TooLarge`] for an entry
    /// that can never fit; [`CacheError::Full`] when `wait` ends before the consumers free
    /// enough room; the hook's error, or [`Error::Os`] when the segment was truncated.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
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
        .ok_or(Error::Cache(CacheError::TooLarge {
            size: layout.total as u64,
            max: inner.map.geo.capacity as u64,
        }))?;
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
                    Ok(inner.map.segment.check_length()?)
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
    ///
    /// # Errors
    ///
    /// As [`reserve_with`](Self::reserve_with), [`CacheError::Full`] after `timeout`.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
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
    ///
    /// # Errors
    ///
    /// As [`reserve`](Self::reserve); [`Error::Os`] when the segment was truncated while
    /// the parts were copied.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
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
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn has(&self, key: &str) -> bool {
        let st = lock(&self.inner.state);
        st.keys
            .get(key)
            .is_some_and(|&e| self.inner.is_ready(e as usize))
    }

    /// The keys held and published, oldest first.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
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
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
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
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn load_state(&self, key: &str) -> LoadState {
        let st = lock(&self.inner.state);
        self.inner.load_state(&st, key)
    }

    /// Wait (as `wait` allows) until every live consumer that joined before `key` was
    /// published has loaded it (and at least `min_consumers` did). Consumers that die
    /// stop counting (they are checked about twice a second). Fails with
    /// [`CacheError::UnknownKey`] for a key not held (or evicted before it was loaded).
    ///
    /// # Errors
    ///
    /// [`CacheError::UnknownKey`] when `key` is not held (never saved, or evicted);
    /// [`Error::Timeout`] when `wait` runs out first; the hook's error, or [`Error::Os`]
    /// when the segment was truncated.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn wait_loaded_with(&self, key: &str, wait: &mut Wait<'_>) -> Result<()> {
        let inner = &self.inner;
        let mut sweep = || {
            inner.sweep();
            // A peer that truncated the segment ends the wait (see `shmq_os::sigbus`).
            Ok(inner.map.segment.check_length()?)
        };
        let ready = || match self.load_state(key) {
            LoadState::Loaded => Some(Ok(())),
            LoadState::Pending => None,
            LoadState::Unknown => Some(Err(Error::Cache(CacheError::UnknownKey(key.to_owned())))),
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
    ///
    /// # Errors
    ///
    /// As [`wait_loaded_with`](Self::wait_loaded_with), [`Error::Timeout`] after `timeout`.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn wait_loaded(&self, key: &str, timeout: Option<Duration>) -> Result<()> {
        let what = format!("waiting for the consumers to load key {key:?}");
        let mut wait = self.wait(&what, timeout);
        self.wait_loaded_with(key, &mut wait)
    }

    /// Wait (as `wait` allows) until some of `keys` are no longer [`LoadState::Pending`];
    /// returns those, with their state. Empty if the wait timed out.
    ///
    /// # Errors
    ///
    /// The hook's error when `wait` ends with one, or [`Error::Os`] when the segment was
    /// truncated (a timeout is an empty answer, not an error).
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn wait_any_loaded_with(
        &self,
        keys: &[String],
        wait: &mut Wait<'_>,
    ) -> Result<Vec<(String, LoadState)>> {
        let inner = &self.inner;
        let mut sweep = || {
            inner.sweep();
            // A peer that truncated the segment ends the wait (see `shmq_os::sigbus`).
            Ok(inner.map.segment.check_length()?)
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
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn sweep(&self) {
        self.inner.sweep();
    }

    /// The consumers joined now.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn consumers(&self) -> Vec<ConsumerInfo> {
        slots::list(&self.inner.map)
    }

    /// The cache's counters and what it holds now.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
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
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
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
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the segment's name cannot be removed for another reason than
    /// being gone already.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn close(&self) -> Result<()> {
        self.inner.close()
    }

    /// Remove the segment's name now (as at interpreter exit), without closing.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the segment's name cannot be removed for another reason than
    /// being gone already.
    ///
    /// # Examples
    ///
    /// See [the type's example](Producer).
    pub fn unlink(&self) -> Result<()> {
        Ok(self.inner.map.segment.unlink()?)
    }
}

/// If segment `name` exists and its producer is dead, mark it superseded and remove it.
fn replace_if_stale(name: &str) -> Result<()> {
    let path = segment_file::path(name);
    if !std::path::Path::new(&path).exists() {
        return Ok(());
    }
    let old = match Segment::open(name) {
        Ok(s) => s,
        Err(OsError::SegmentNotFound { .. }) => return Ok(()),
        Err(e) => return Err(e.into()),
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
    match segment_file::unlink(name) {
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
    fn close(&self) -> Result<()> {
        let _st = lock(&self.state);
        // Relaxed: read by this process's own calls (which also take the lock), and
        // polled by its waits (`Producer::wait`), which need no ordering with anything
        // else it guards: they only end.
        if self.closed.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        // Release: pairs with the consumers' Acquire state load (they drop the segment).
        self.map.header().state.publish(STATE_CLOSED);
        Ok(self.map.segment.unlink()?)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
