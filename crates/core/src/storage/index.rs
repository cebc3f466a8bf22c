//! [`ObjectStore`]: the writer's key → object index over a [`BlockFifo`]: put, hand-outs,
//! touches, eviction of what every reader has finished with, and loans.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::fifo::BlockFifo;
use super::object::{BlockPin, object_layout, pin_own, reads_by, unslotted_reads};
use super::readers::{
    ReaderInfo, ReaderStatus, attached_slots, drop_slot, judge_slot, object_slots, reader_slots,
    slot_word,
};
use super::store_segment::{
    BlockHeader, COUNT_BYTES, COUNT_WORD_BYTES, MAX_PARTS, PART_ALIGN, SIGNATURE_BYTES,
    StoreSegment, count_word_at, frame_word, part_table_offset,
};
use crate::broadcast::DeadReaderPolicy;
use crate::error::{Error, HandleRefusal, OsError, Result, StoreError};
use shmq_os::region::RawRegion;
use shmq_os::segment::{LoanPages, warn_shm_too_small};
use shmq_protocol::alloc::{Block, Freed, Full, HEADER_BYTES};

/// Bytes a store loan keeps before its buffer for the rest of the object `put` with it
/// (the count, the frame and the other parts: the pickle or msgpack stream and small
/// buffers); an object whose other parts need more is copied instead.
pub const LOAN_ROOM: u64 = 64 * 1024;
/// Loaned buffers start at multiples of this (ring offset): readers map them page by page.
pub(super) const LOAN_ALIGN: u64 = 4096;

/// Where a loaned buffer is (the writer's bookkeeping).
#[derive(Clone, Debug)]
pub(super) struct LoanSpot {
    pub(super) address: u64,
    /// The block's header.
    pub(super) header: BlockHeader,
    /// The buffer's offset from the start of the block's data.
    buffer_at: u64,
    pub(super) len: u64,
    /// The buffer's pages (whole pages: the block is sized for that), sealed by `put`.
    pages: Arc<LoanPages>,
}

/// Memory loaned by the store's writer: `len` bytes of a block in the ring, to fill in
/// place and `put` without a copy. The block stays (pinned) while the loan lives, also
/// once put: drop it after the put to let the object be evicted in its turn. A `put`
/// seals it, as a queue's [`Loan`](crate::Loan) is sealed when sent: the writer's
/// mapping of its pages becomes a private copy-on-write view, so the object readers get
/// is what was put, whatever the writer writes into the loan afterwards.
#[derive(Debug)]
pub struct StoreLoan {
    pub(super) bytes: RawRegion,
    pages: Arc<LoanPages>,
    pub(super) _pin: Arc<BlockPin>,
}

impl Drop for StoreLoan {
    fn drop(&mut self) {
        if shmq_os::fork::is_inherited(self._pin.made_in) {
            return; // a forked child's copy: its mapping is its own
        }
        // Shared again before the pin goes (after this body) and the block can be reused.
        if !self.pages.unseal(&self._pin.segment.segment) {
            // Still private here (the process is out of mappings): a later object written
            // there would reach nobody. The block stays pinned until a retry succeeds
            // (at this process's next seal, loan or allocation), never for good.
            let (pages, pin) = (self.pages.clone(), self._pin.clone());
            shmq_os::segment::defer_unseal(Box::new(move || pages.unseal(&pin.segment.segment)));
        }
    }
}

// SAFETY: the loan is the only handle to its bytes in this process (the writer's
// bookkeeping keeps only their place), and the pin keeps the block from reuse; moving or
// sharing it between threads is like a Vec's.
unsafe impl Send for StoreLoan {}
// SAFETY: as for Send: `&StoreLoan` gives the pointer out, not access.
unsafe impl Sync for StoreLoan {}

shmq_os::region!(StoreLoan, bytes, mut);

/// The writer's bookkeeping for one object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub address: u64,
    pub id: u32,
    /// Times handed out by `put`/`get_cached`.
    pub handouts: u32,
    /// Reader slots (one bit each) this object does not wait for: slots of dropped readers
    /// that a new reader took after the object was stored (see `super::readers`).
    pub exempt: u128,
}

impl Entry {
    /// Whether `handle` `(address, id)` names this entry's object.
    ///
    /// # Errors
    ///
    /// [`HandleRefusal::NotCurrent`] when the entry's object is not at `handle` (it was
    /// evicted and `key` put again, or the handle is forged).
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](ObjectStore).
    pub fn check_handle(&self, handle: (u64, u32)) -> Result<(), HandleRefusal> {
        if (self.address, self.id) == handle {
            Ok(())
        } else {
            Err(HandleRefusal::NotCurrent {
                handle,
                current: (self.address, self.id),
            })
        }
    }
}

/// Which side of a store this process is, and whether the writer counts its own reads
/// (vLLM 0.33's `reader_lock`): the rules `SingleWriterShmObjectStorage` applies by role,
/// in one place (the Python store and Rust callers alike ask these).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreRole {
    pub is_writer: bool,
    /// Whether a get in the writer's process counts as a read.
    pub count_writer_reads: bool,
}

impl StoreRole {
    /// Whether a get counts as a read (the `count` of [`read_object`](super::read_object)):
    /// always on a reader; on the writer only when it counts its own reads.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](ObjectStore).
    pub fn counts_reads(self) -> bool {
        !self.is_writer || self.count_writer_reads
    }

    /// Whether a get checks the handle's signature first: on a reader, whose handles
    /// come from elsewhere (the writer made its own).
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](ObjectStore).
    pub fn checks_signatures(self) -> bool {
        !self.is_writer
    }

    /// Whether `touch(key, ...)` keeps the key's object from eviction (the writer that does
    /// not count its reads: until `get_cached(key)` or `release_touches()`) rather than
    /// check the handle it is given.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](ObjectStore).
    pub fn touch_protects(self) -> bool {
        self.is_writer && !self.count_writer_reads
    }

    /// Whether `verify_signature` also checks that the handle is its key's current
    /// object: on the writer, which has the index.
    ///
    /// # Examples
    ///
    /// See [`ObjectStore`'s example](ObjectStore).
    pub fn checks_current_entry(self) -> bool {
        self.is_writer
    }
}

/// Key → object index over a [`BlockFifo`] (the spec's `ObjectStorage`, minus serde).
/// Methods take the ring explicitly so the ring can be shared with its own API.
///
/// # Examples
///
/// The store's writer puts objects under keys and hands out signed handles; a reader
/// (any process) opens the ring by name and reads an object by its handle:
///
/// ```
/// use shmq_core::storage::{
///     BlockFifo, CountRead, ObjectStore, SignedHandle, StoreRole, read_object, read_signed,
/// };
///
/// let mut ring = BlockFifo::create(1 << 16, None)?; // 64 KiB, this process writes
/// let mut store = ObjectStore::new(4096, 1)?; // objects of at most 4 KiB, one reader
/// // An object of two parts; parts from index 1 on start on 64-byte boundaries.
/// let (address, id) = store.put(&mut ring, "prompt-1", &[b"meta", b"data"], 1)?;
/// assert!(store.is_cached(ring.segment(), "prompt-1")?);
/// let signature = store.signature(ring.segment(), "prompt-1").expect("held");
///
/// // A reader: the handle and its signature come from the writer (over a queue, say).
/// let reader = BlockFifo::open(ring.segment().name(), None)?;
/// let role = StoreRole { is_writer: false, count_writer_reads: false };
/// let handle = SignedHandle::new("prompt-1", address, id, &signature);
/// let parts = read_signed(reader.segment(), role, handle, CountRead::Anonymous, |o| {
///     (0..o.len()).map(|i| o.part(i).to_vec()).collect::<Vec<_>>()
/// })?;
/// assert_eq!(parts, [b"meta", b"data"]);
///
/// // The writer hands the same object out again (each reader reads it once more).
/// assert_eq!(store.get_cached(ring.segment(), "prompt-1")?, Some((address, id)));
/// let len = read_object(reader.segment(), address, id, true, |o| o.len())?;
/// assert_eq!(len, 2);
/// store.clear(&mut ring)?; // every object forgotten (handles read on until reused)
/// assert!(!store.is_cached(ring.segment(), "prompt-1")?);
/// # Ok::<(), shmq_core::Error>(())
/// ```
#[derive(Debug)]
pub struct ObjectStore {
    max_object_size: u64,
    n_readers: u32,
    /// Reader words in each object (see `super::readers`).
    slots: usize,
    /// Reader slots dropped after their readers died (this writer's own record: eviction
    /// never trusts the segment's word for it), one per reader slot: the DROPPED word the
    /// writer wrote there, until a new reader takes the slot (and changes the word).
    dropped: Vec<Option<u64>>,
    on_dead_reader: DeadReaderPolicy,
    /// The dead reader the last `put` or `loan` found holding the room (and raised for):
    /// `None` after one that did not fail so.
    dead_reader: Option<ReaderInfo>,
    pub(super) keys: HashMap<Arc<str>, Entry>,
    pub(super) ids: HashMap<u32, Arc<str>>,
    /// Ids the writer `touch`ed: not evicted until handed out again or released.
    pub(super) touched: HashSet<u32>,
    /// Loaned buffers not yet put, by block id.
    pub(super) loans: HashMap<u32, LoanSpot>,
}

impl ObjectStore {
    /// The writer's index of a store whose objects are at most `max_object_size` bytes,
    /// read by `n_readers` readers; it holds no object yet.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `max_object_size` is not larger than the reader
    /// count's bytes.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn new(max_object_size: u64, n_readers: u32) -> Result<ObjectStore> {
        if max_object_size <= COUNT_BYTES as u64 {
            return Err(Error::InvalidArgument(format!(
                "max_object_size must exceed {COUNT_BYTES} bytes"
            )));
        }
        Ok(ObjectStore {
            max_object_size,
            n_readers,
            slots: object_slots(n_readers),
            dropped: vec![None; reader_slots(n_readers)],
            on_dead_reader: DeadReaderPolicy::Raise,
            dead_reader: None,
            keys: HashMap::new(),
            ids: HashMap::new(),
            touched: HashSet::new(),
            loans: HashMap::new(),
        })
    }

    /// The largest object `put` takes, in bytes.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn max_object_size(&self) -> u64 {
        self.max_object_size
    }
    /// How many readers each object waits for.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn n_readers(&self) -> u32 {
        self.n_readers
    }

    /// What a put (or loan) that finds no room does about a reader that died without
    /// reading what holds the room (see `super::readers`): fail naming it
    /// ([`DeadReaderPolicy::Raise`], the default), or go on without it
    /// ([`DeadReaderPolicy::Drop`]).
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn set_on_dead_reader(&mut self, policy: DeadReaderPolicy) {
        self.on_dead_reader = policy;
    }
    /// What the store does with a reader that died.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn on_dead_reader(&self) -> DeadReaderPolicy {
        self.on_dead_reader
    }

    /// Reader slots dropped after their readers died.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn dropped_readers(&self) -> Vec<usize> {
        (0..self.dropped.len())
            .filter(|&s| self.is_dropped(s))
            .collect()
    }

    /// The reader slots of `segment` (this store's ring's) as this writer sees them: who
    /// holds each, whether it lives, what it read (see `super::readers`).
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn readers(&self, segment: &StoreSegment) -> Vec<ReaderInfo> {
        (0..self.dropped.len())
            .map(|s| {
                let mut info = judge_slot(segment, s);
                // Dropped for this writer until the word it wrote there changes (a new
                // reader took the slot: `notice_rejoined` will take it back).
                if self.dropped[s].is_some_and(|w| w == slot_word(segment, s)) {
                    info.status = ReaderStatus::Dropped;
                }
                info
            })
            .collect()
    }

    /// The dead reader that made the last `put` or `loan` fail (with
    /// [`DeadReaderPolicy::Raise`]): that failure's `StoreError::Full` is a reader's death.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn dead_reader(&self) -> Option<&ReaderInfo> {
        self.dead_reader.as_ref()
    }

    /// Go on without every reader proved dead (see `super::readers`): from now on no
    /// object waits for its slot. Returns the slots dropped now.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn drop_dead_readers(&mut self, segment: &StoreSegment) -> Vec<usize> {
        self.notice_rejoined(segment);
        let mut now = Vec::new();
        for s in 0..self.dropped.len() {
            if self.is_dropped(s) {
                continue;
            }
            let info = judge_slot(segment, s);
            if let Some(word) = drop_slot(segment, &info) {
                self.dropped[s] = Some(word);
                warn_user!(
                    "shmq: {info} of object store '{}' died; going on without it \
                     (on_dead_reader=\"drop\")",
                    segment.name()
                );
                now.push(s);
            }
        }
        now
    }

    /// Take back the dropped slots that a new reader took since (their word is no longer
    /// the DROPPED word this writer wrote): from now on objects wait for the new reader's
    /// reads, except those stored before (marked `exempt`: the new reader was not there
    /// when they were handed out). Called before every put, loan, hand-out and free, so
    /// that no object handed out after the writer could see the new reader is exempt.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn notice_rejoined(&mut self, segment: &StoreSegment) {
        for s in 0..self.dropped.len() {
            let Some(word) = self.dropped[s] else {
                continue;
            };
            if slot_word(segment, s) == word {
                continue;
            }
            self.dropped[s] = None;
            for e in self.keys.values_mut() {
                e.exempt |= 1 << s;
            }
        }
    }

    fn is_dropped(&self, s: usize) -> bool {
        self.dropped.get(s).is_some_and(Option::is_some)
    }

    /// Whether an object exempt from the slots of `exempt` waits for reader slot `s`.
    fn waits_for(&self, exempt: u128, s: usize) -> bool {
        !self.is_dropped(s) && exempt & (1 << s) == 0
    }

    /// How the reads counted in an object (block data `data`, handed out `handouts`
    /// times, exempt from the slots of `exempt`) stand against what it waits for, with the
    /// reader slots of `attached` held now (see "Which reader read what" in
    /// `super::readers`): `(counted, wanted)`, reads counted for and reads waited for
    /// (each reader's counted up to what it owes), and whether it may be evicted.
    fn tally(&self, data: &[u8], handouts: u32, exempt: u128, attached: u128) -> (u64, u64, bool) {
        let h = u64::from(handouts);
        let slots = self.dropped.len();
        let not_waited = (0..slots).filter(|&s| !self.waits_for(exempt, s)).count() as u64;
        let wanted = u64::from(self.n_readers).saturating_sub(not_waited) * h;
        // The reads that may stand for any reader without a slot of its own now.
        let (mut pool, mut pool_wanted) = (unslotted_reads(data), wanted);
        let (mut counted, mut short) = (0, false);
        for s in (0..slots).filter(|&s| self.waits_for(exempt, s)) {
            // No word for the slot (a store of one reader): its reads are in the count word.
            let Some(c) = reads_by(data, s).map(u64::from) else {
                continue;
            };
            if attached & (1 << s) != 0 {
                // Held now: only its own reads count for it.
                pool_wanted = pool_wanted.saturating_sub(h);
                counted += c.min(h);
                short |= c < h;
            } else {
                pool += c;
            }
        }
        counted += pool.min(pool_wanted);
        (counted, wanted, !short && pool >= pool_wanted)
    }
    /// `key`'s entry, if it has an object.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn entry(&self, key: &str) -> Option<&Entry> {
        self.keys.get(key)
    }
    /// Every key and its entry.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn entries(&self) -> impl Iterator<Item = (&str, &Entry)> + '_ {
        self.keys.iter().map(|(k, e)| (&**k, e))
    }
    /// The key of the object of block `id`, if it is held.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn key_of(&self, id: u32) -> Option<&str> {
        self.ids.get(&id).map(|k| &**k)
    }
    /// Whether the object of block `id` is kept from eviction by a `touch`.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn is_touched(&self, id: u32) -> bool {
        self.touched.contains(&id)
    }
    /// Number of stored objects.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn len(&self) -> usize {
        self.keys.len()
    }
    /// Whether the store holds no object.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Count one more hand-out of the object with id `id` (vLLM's
    /// `increment_writer_flag`); false if no stored object has that id.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn hand_out(&mut self, segment: &StoreSegment, id: u32) -> bool {
        self.notice_rejoined(segment);
        let Some(e) = self.ids.get(&id).and_then(|k| self.keys.get_mut(k)) else {
            return false;
        };
        e.handouts += 1;
        true
    }

    /// Whether the object with id `id`, whose block data is `data`, may be evicted: not
    /// touched, and read `n_readers` times per hand-out (by readers not dropped: a dropped
    /// reader's reads do not count, and nothing waits for them), each reader slot held now
    /// (`attached`, from [`attached_slots`]) in its own word (see `super::readers`).
    fn is_free(&self, id: u32, data: &[u8], attached: u128) -> bool {
        if self.touched.contains(&id) {
            return false;
        }
        let (handouts, exempt) = self
            .ids
            .get(&id)
            .and_then(|k| self.keys.get(k))
            .map_or((0, 0), |e| (e.handouts, e.exempt));
        self.tally(data, handouts, exempt, attached).2
    }

    /// vLLM's `default_is_free_check(id, buf)` where `buf` is memory of this process at
    /// address `addr`, `len` bytes: whether the object may be evicted (as `free_unused`
    /// judges), if it lies inside `segment`'s ring (a block's data); `InvalidArgument` if
    /// it does not (anything else could be any memory, and is never read).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `addr..addr + len` does not lie inside the store's
    /// ring in this process.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn is_free_at(
        &self,
        segment: &StoreSegment,
        id: u32,
        addr: usize,
        len: usize,
    ) -> Result<bool> {
        let ring = segment.ring_ptr() as usize;
        if addr < ring || addr.saturating_add(len) > ring + segment.capacity() as usize {
            return Err(Error::InvalidArgument(
                "default_is_free_check needs a chunk view of this store's ring".to_owned(),
            ));
        }
        // SAFETY: `addr .. addr + len` was checked just above to lie inside the ring, which
        // `segment` keeps mapped while it is borrowed, and the pointer is derived from the
        // ring's own; the bytes are only read as the count, atomically (any process
        // mapping the segment may write them meanwhile).
        let data = unsafe { std::slice::from_raw_parts(segment.ring_ptr().add(addr - ring), len) };
        Ok(self.is_free(id, data, attached_slots(segment, self.dropped.len())))
    }

    /// Store an object made of `parts` under `key`; returns `(address, id)`. Parts from
    /// `align_from` on start at 64-byte boundaries of the ring; the others follow each
    /// other. When the ring is full, first frees objects every reader has finished with.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for a reader; [`StoreError::KeyExists`] when `key` has an
    /// object; [`StoreError::TooLarge`] for an object over `max_object_size`;
    /// [`Error::InvalidArgument`] for an `align_from` past the parts; [`StoreError::Full`]
    /// when the ring has no room even after freeing what every reader has finished with;
    /// [`Error::Os`] when `/dev/shm` has no room or the segment was truncated.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn put(
        &mut self,
        ring: &mut BlockFifo,
        key: &str,
        parts: &[&[u8]],
        align_from: usize,
    ) -> Result<(u64, u32)> {
        if !ring.is_writer() {
            return Err(Error::WrongRole("Only the writer can put objects.".into()));
        }
        // A truncated store is refused before anything is written (see `is_cached`).
        ring.segment().check_length()?;
        self.notice_rejoined(ring.segment());
        if self.keys.contains_key(key) {
            return Err(Error::Store(StoreError::KeyExists(key.to_owned())));
        }
        if parts.len() > MAX_PARTS {
            return Err(Error::InvalidArgument(format!(
                "an object has at most {MAX_PARTS} parts, got {}",
                parts.len()
            )));
        }
        // vLLM's measure: the count plus the serialized bytes (not the frame or padding).
        let size = COUNT_BYTES as u64 + parts.iter().map(|p| p.len() as u64).sum::<u64>();
        if size > self.max_object_size {
            return Err(Error::Store(StoreError::TooLarge {
                size,
                max: self.max_object_size,
            }));
        }
        if let Some(placed) = self.put_in_loan(ring, key, parts, align_from)? {
            return Ok(placed);
        }
        let lens = || parts.iter().map(|p| p.len() as u64);
        let (n, slots) = (parts.len(), self.slots);
        let size_at = |block_offset: u64| {
            object_layout(
                block_offset + HEADER_BYTES,
                lens(),
                n,
                slots,
                align_from,
                |_, _| (),
            )
        };
        let (block, h) = self.allocate(ring, size_at)?;
        let segment = ring.segment();
        let (p, len) = segment.data_ptr(&h);
        let data_offset = h.offset + HEADER_BYTES;
        let count_at = count_word_at(data_offset);
        segment.init_counts(&h, slots);
        let frame_at = (count_at + COUNT_WORD_BYTES) as usize;
        let table_at = (count_at + part_table_offset(slots)) as usize;
        let write = |at: usize, bytes: &[u8]| {
            debug_assert!(at + bytes.len() <= len);
            // SAFETY: the block is ours (just allocated, not yet handed out; readers only
            // read it after they get its handle), and `object_layout` sized it so that
            // every write made here stays inside its `len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.add(at), bytes.len()) };
        };
        write(frame_at, &frame_word(n, slots).to_le_bytes());
        let end = object_layout(data_offset, lens(), n, slots, align_from, |i, at| {
            let entry_at = table_at + 8 * i;
            write(entry_at, &(at as u32).to_le_bytes());
            write(entry_at + 4, &(parts[i].len() as u32).to_le_bytes());
            write(at as usize, parts[i]);
        });
        debug_assert_eq!(end as usize, len);
        // What was written may have gone to the zero pages of a truncated segment: then
        // it is no object (the block goes in its turn; the store is lost anyway).
        segment.check_intact()?;
        self.register(key, block.address, block.id);
        Ok((block.address, block.id))
    }

    /// A new block of `size_at(its offset)` data bytes, and its header; if the ring is
    /// full, first free what every reader has finished with.
    fn allocate(
        &mut self,
        ring: &mut BlockFifo,
        size_at: impl Fn(u64) -> u64 + Copy,
    ) -> Result<(Block, BlockHeader)> {
        // Full, or no room in /dev/shm for where the block lands: free what every reader
        // has finished with (when everything goes, the ring restarts at 0, in memory
        // already reserved) and try once more; loans dropped while the process was out of
        // mappings give their blocks back first, where they can now.
        self.dead_reader = None;
        let block = match ring.allocate_with(size_at) {
            Err(Error::Store(StoreError::Full(_)) | Error::Os(OsError::NoSpace { .. })) => {
                shmq_os::segment::retry_deferred_unseals();
                loop {
                    self.free_unused(ring)?;
                    match ring.allocate_with(size_at) {
                        Ok(block) => break block,
                        Err(Error::Store(StoreError::Full(mut full))) => {
                            // Readers that died go now, with "drop" (each round drops at
                            // least one, so this ends): what waited only for them is freed.
                            if self.on_dead_reader == DeadReaderPolicy::Drop
                                && !self.drop_dead_readers(ring.segment()).is_empty()
                            {
                                continue;
                            }
                            if let Some((held_by, dead)) = self.room_holder(ring) {
                                full.held_by = Some(held_by);
                                self.dead_reader =
                                    dead.filter(|_| self.on_dead_reader == DeadReaderPolicy::Raise);
                            }
                            return Err(Error::Store(StoreError::Full(full)));
                        }
                        Err(e) => {
                            if matches!(e, Error::Os(OsError::NoSpace { .. })) {
                                warn_shm_too_small(
                                    "the object store cannot grow into the rest of its ring, \
                                     and a put that finds no room raises MemoryError",
                                );
                            }
                            return Err(e);
                        }
                    }
                }
            }
            other => other?,
        };
        let header = BlockHeader {
            offset: block.offset(ring.segment().capacity()),
            id: block.id,
            size: block.size,
        };
        Ok((block, header))
    }

    /// For a put that finds no room after freeing what could go: what holds it, and the
    /// dead reader it waits for, if it does. Objects go oldest first, so the oldest live
    /// one is what keeps the room: its key, and why it stays (reads it still waits for,
    /// and from which readers; a touch; a zero-copy view still held), with what to do.
    fn room_holder(&self, ring: &BlockFifo) -> Option<(String, Option<ReaderInfo>)> {
        let alloc = ring.allocator()?;
        let live = alloc.live().len();
        let c = *alloc.live().next()?;
        let seg = ring.segment();
        let h = BlockHeader {
            offset: c.offset(seg.capacity()),
            id: c.id,
            size: c.size,
        };
        let what = match self.ids.get(&c.id) {
            Some(key) => format!("key {key:?}"),
            None => "a loan or an object being written".to_owned(),
        };
        let (p, n) = seg.data_ptr(&h);
        // SAFETY: a live block of this writer's lies inside the ring (allocator
        // invariant); only its reader count is read, which a peer can only make wrong.
        let data = unsafe { std::slice::from_raw_parts(p, n) };
        let (handouts, exempt) = self
            .ids
            .get(&c.id)
            .and_then(|k| self.keys.get(k))
            .map_or((0, 0), |e| (e.handouts, e.exempt));
        let attached = attached_slots(seg, self.dropped.len());
        let (read, wanted, free) = self.tally(data, handouts, exempt, attached);
        let mut dead = None;
        let why = if self.touched.contains(&c.id) {
            "touched, so kept for a reader that will read it".to_owned()
        } else if !free {
            let (waits, first_dead) = self.waiting_for(seg, data, handouts, exempt);
            dead = first_dead;
            format!("read {read} times of the {wanted} it waits for: {waits}")
        } else if seg.is_pinned(h.id) {
            "read by every reader, but a zero-copy view of it is still held (drop it, or get \
             with copy=True)"
                .to_owned()
        } else {
            "free to go".to_owned()
        };
        Some((
            format!("what holds the room: the oldest of the {live} live objects, {what}, {why}"),
            dead,
        ))
    }

    /// Which readers an object (block data `data`, handed out `handouts` times) still
    /// waits for, in words, with what to do; and the first of them that died, if the
    /// policy is to raise for it.
    fn waiting_for(
        &self,
        segment: &StoreSegment,
        data: &[u8],
        handouts: u32,
        exempt: u128,
    ) -> (String, Option<ReaderInfo>) {
        let mut said = Vec::new();
        let mut dead = None;
        for s in (0..self.dropped.len()).filter(|&s| self.waits_for(exempt, s)) {
            // An object without reader words (a store of one reader) counts every read in
            // its count word: what is missing is that reader's.
            if reads_by(data, s).is_some_and(|c| c >= handouts) {
                continue;
            }
            let info = judge_slot(segment, s);
            let pid = info.process.map(|p| p.pid);
            said.push(match (info.status, pid) {
                (ReaderStatus::Dead, _) => {
                    dead.get_or_insert(info);
                    format!("{info} died before reading it")
                }
                (ReaderStatus::Alive { known: true }, Some(pid)) => format!(
                    "reader slot {s} (pid {pid}, alive) has not read it yet: a put finds room \
                     once it has"
                ),
                (ReaderStatus::Alive { .. }, _) => format!(
                    "{info} has not read it yet (whether it lives cannot be told from here)"
                ),
                (ReaderStatus::Left, _) => format!(
                    "{info} closed the store before reading it (its reads are still expected: \
                     a reader that opens the store takes its place)"
                ),
                (ReaderStatus::Empty | ReaderStatus::Attaching, _) => format!(
                    "no reader has opened the store for reader slot {s} yet (n_readers={} \
                     counts it)",
                    self.n_readers
                ),
                (ReaderStatus::Dropped, _) => format!("{info} was dropped"),
            });
        }
        let mut text = if said.is_empty() {
            "readers have not got it".to_owned()
        } else {
            said.join("; ")
        };
        if dead.is_some() && self.on_dead_reader == DeadReaderPolicy::Raise {
            text.push_str(
                " (to go on without dead readers, make the store with on_dead_reader=\"drop\" \
                 in Python, or call ObjectStore::set_on_dead_reader(DeadReaderPolicy::Drop) in \
                 Rust)",
            );
        }
        text.push_str(
            "; to empty a full store, call the writer's clear(): readers' handles to the \
             objects it forgets read them until new objects are written over them",
        );
        (text, dead)
    }

    fn register(&mut self, key: &str, address: u64, id: u32) {
        let key: Arc<str> = key.into();
        let entry = Entry {
            address,
            id,
            handouts: 1,
            exempt: 0,
        };
        self.keys.insert(key.clone(), entry);
        self.ids.insert(id, key);
    }

    /// Loan `nbytes` of a new block to fill in place (writer only): `put` of an object
    /// one of whose buffers (from `align_from` on) is exactly this memory writes the rest
    /// of the object around it, with no copy. `StoreError::Full` if there is no room even
    /// after freeing what every reader has finished with.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for a reader; [`Error::InvalidArgument`] for an `nbytes` of 0;
    /// [`StoreError::TooLarge`] or [`StoreError::Full`] as [`put`](Self::put);
    /// [`Error::Os`] when `/dev/shm` has no room or the segment was truncated.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn loan(&mut self, ring: &mut BlockFifo, nbytes: u64) -> Result<StoreLoan> {
        if !ring.is_writer() {
            return Err(Error::WrongRole("Only the writer can loan memory.".into()));
        }
        shmq_os::segment::retry_deferred_unseals();
        self.notice_rejoined(ring.segment());
        if nbytes == 0 {
            return Err(Error::InvalidArgument("Size must be greater than 0".into()));
        }
        let size = COUNT_BYTES as u64 + nbytes;
        if size > self.max_object_size {
            return Err(Error::Store(StoreError::TooLarge {
                size,
                max: self.max_object_size,
            }));
        }
        let buffer_at = |block_offset: u64| {
            let data = block_offset + HEADER_BYTES;
            (data + LOAN_ROOM).next_multiple_of(LOAN_ALIGN) - data
        };
        // The buffer ends on a page boundary too: sealing it (see `StoreLoan`) must not
        // touch the next block's memory.
        let size_at =
            |block_offset: u64| buffer_at(block_offset) + nbytes.next_multiple_of(LOAN_ALIGN);
        let (block, header) = self.allocate(ring, size_at)?;
        let segment = ring.segment();
        let data_offset = header.offset + HEADER_BYTES;
        // Nobody has this block's handle yet; the channel that carries it orders these
        // stores. An empty object (no parts, no reader words) until it is put.
        segment.init_counts(&header, 0);
        segment.store_u32(
            data_offset + count_word_at(data_offset) + COUNT_WORD_BYTES,
            frame_word(0, 0),
        );
        // If pinning fails, the block (an empty object nobody knows) goes in its turn.
        let pin = pin_own(segment, header.id)?;
        let (p, _) = segment.data_ptr(&header);
        let at = buffer_at(header.offset);
        // SAFETY: buffer_at + nbytes (rounded up to LOAN_ALIGN) is the block's data size
        // (size_at above).
        let ptr = unsafe { p.add(at as usize) };
        let pages = Arc::new(LoanPages::new(
            ptr,
            nbytes.next_multiple_of(LOAN_ALIGN) as usize,
        ));
        let spot = LoanSpot {
            address: block.address,
            header,
            buffer_at: at,
            len: nbytes,
            pages: pages.clone(),
        };
        self.loans.insert(block.id, spot);
        Ok(StoreLoan {
            // SAFETY: `len` bytes of the loan's block, mapped and not reused while the pin
            // lives, and handed to this loan alone. Readers only get the block's handle
            // once it is put; from then on they read what the writer wrote, and a writer
            // that keeps writing races only with its own readers' view of the data (byte
            // values, never memory safety).
            bytes: unsafe { RawRegion::new(ptr, nbytes as usize) },
            pages,
            _pin: pin,
        })
    }

    /// Put `parts` around a loaned buffer that is exactly one of them (from `align_from`
    /// on), if the others fit in the room before it; `None` to copy instead.
    fn put_in_loan(
        &mut self,
        ring: &BlockFifo,
        key: &str,
        parts: &[&[u8]],
        align_from: usize,
    ) -> Result<Option<(u64, u32)>> {
        if self.loans.is_empty() {
            return Ok(None);
        }
        let segment = ring.segment();
        let base = segment.ring_ptr() as usize;
        let mut found = None;
        for (i, part) in parts.iter().enumerate().skip(align_from) {
            let at = (part.as_ptr() as usize).wrapping_sub(base) as u64;
            let hit = self.loans.iter().find(|(_, s)| {
                s.header.offset + HEADER_BYTES + s.buffer_at == at && s.len == part.len() as u64
            });
            if let Some((&id, spot)) = hit {
                if found.is_some() {
                    return Ok(None); // two loans in one object: copied into one block
                }
                found = Some((i, id, spot.clone()));
            }
        }
        let Some((k, id, spot)) = found else {
            return Ok(None);
        };
        if ring.allocator().is_none_or(|a| a.get(id).is_none()) {
            self.loans.remove(&id);
            return Ok(None);
        }
        let data_offset = spot.header.offset + HEADER_BYTES;
        let slots = self.slots;
        let count_at = count_word_at(data_offset);
        let frame_at = count_at + COUNT_WORD_BYTES;
        let table_at = count_at + part_table_offset(slots);
        let mut at = table_at + 8 * parts.len() as u64;
        let mut offsets = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            if i == k {
                offsets.push(spot.buffer_at);
                continue;
            }
            if i >= align_from {
                at = (data_offset + at).next_multiple_of(PART_ALIGN) - data_offset;
            }
            offsets.push(at);
            at += part.len() as u64;
        }
        if at > spot.buffer_at {
            return Ok(None); // the rest does not fit before the buffer: copy
        }
        // Sealed before the handle is returned (and so before any reader can have it). A
        // loan whose pages cannot be sealed (out of mappings) is still shared: copied, so
        // that the writer's later writes reach no reader.
        if !spot.pages.seal(&segment.segment) {
            return Ok(None);
        }
        let (p, len) = segment.data_ptr(&spot.header);
        let write = |at: u64, bytes: &[u8]| {
            debug_assert!(at as usize + bytes.len() <= spot.buffer_at as usize);
            // SAFETY: the block is this writer's (live, loaned, its handle not yet given
            // out), and every write here ends before the buffer (checked just above), which
            // lies inside the block's `len` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.add(at as usize), bytes.len())
            };
        };
        debug_assert!(spot.buffer_at + spot.len <= len as u64);
        // The reader words end before the part table, so before the buffer (checked above).
        segment.init_counts(&spot.header, slots);
        write(frame_at, &frame_word(parts.len(), slots).to_le_bytes());
        for (i, part) in parts.iter().enumerate() {
            let entry_at = table_at + 8 * i as u64;
            write(entry_at, &(offsets[i] as u32).to_le_bytes());
            write(entry_at + 4, &(part.len() as u32).to_le_bytes());
            if i != k {
                write(offsets[i], part);
            }
        }
        // As in `put`: written to the zero pages of a truncated segment, it is no object.
        segment.check_intact()?;
        self.loans.remove(&id);
        self.register(key, spot.address, id);
        Ok(Some((spot.address, id)))
    }

    /// Whether `key` has an object in the store. The index is this process's own: a
    /// store truncated by another process (its objects lost, zeros where they were) is
    /// the truncation error instead, never "cached" (an `fstat` on the writer).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when another process truncated the store (its objects lost).
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn is_cached(&self, segment: &StoreSegment, key: &str) -> Result<bool> {
        segment.check_length()?;
        Ok(self.keys.contains_key(key))
    }

    /// Hand `key`'s object out once more (every reader will read it once more); this
    /// also ends a `touch` of it. `None` if `key` has no object; the truncation error
    /// if the store lost its objects (see [`is_cached`](Self::is_cached)).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when another process truncated the store (its objects lost).
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn get_cached(&mut self, segment: &StoreSegment, key: &str) -> Result<Option<(u64, u32)>> {
        segment.check_length()?;
        self.notice_rejoined(segment);
        let Some(e) = self.keys.get_mut(key) else {
            return Ok(None);
        };
        e.handouts += 1;
        self.touched.remove(&e.id);
        Ok(Some((e.address, e.id)))
    }

    /// Keep `key`'s object from being evicted until the next `get_cached(key)` or
    /// `release_touches()`; unknown keys are ignored.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn touch(&mut self, key: &str) {
        if let Some(e) = self.keys.get(key) {
            self.touched.insert(e.id);
        }
    }

    /// Stop protecting every touched object.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn release_touches(&mut self) {
        self.touched.clear();
    }

    /// The signature of `key`'s current handle.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn signature(&self, segment: &StoreSegment, key: &str) -> Option<[u8; SIGNATURE_BYTES]> {
        let e = self.keys.get(key)?;
        Some(segment.sign(key, e.address, e.id))
    }

    /// The writer's first check of a handle a request brings back: `key` (`None`: none
    /// was given) must have an entry, the handle's [`Entry::check_handle`] must be it.
    ///
    /// # Errors
    ///
    /// [`HandleRefusal::NoKey`] when no key was given; [`HandleRefusal::NoEntry`] when
    /// `key` has no object.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn current(&self, key: Option<&str>) -> Result<&Entry, HandleRefusal> {
        self.keys
            .get(key.ok_or(HandleRefusal::NoKey)?)
            .ok_or(HandleRefusal::NoEntry)
    }

    /// The writer's check of a handle a request brings back: it must be `key`'s current
    /// entry and carry the right signature.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] with [`StoreError::BadSignature`] when `key` has no object here,
    /// the handle is not its current one ([`HandleRefusal`]), or the signature is not the
    /// store's for it.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn verify_current(
        &self,
        segment: &StoreSegment,
        key: &str,
        address: u64,
        id: u32,
        signature: &[u8],
    ) -> Result<()> {
        self.current(Some(key))?.check_handle((address, id))?;
        segment.verify(key, address, id, signature)
    }

    /// Free objects, oldest first, that every reader has finished with, up to about
    /// `2 * max_object_size` bytes. Returns the freed ids.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for a reader's ring; [`Error::Os`] when the segment was
    /// truncated.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn free_unused(&mut self, ring: &mut BlockFifo) -> Result<Freed> {
        let limit = 2 * self.max_object_size;
        self.notice_rejoined(ring.segment());
        let attached = attached_slots(ring.segment(), self.dropped.len());
        let freed = ring.free_while(limit, |id, data| self.is_free(id, data, attached))?;
        for id in freed.ids() {
            if let Some(key) = self.ids.remove(&id) {
                self.keys.remove(&key);
            }
            self.loans.remove(&id);
        }
        Ok(freed)
    }

    /// Forget every object and block.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for a reader's ring; [`Error::Os`] when the segment was
    /// truncated.
    ///
    /// # Examples
    ///
    /// See [the type's example](ObjectStore).
    pub fn clear(&mut self, ring: &mut BlockFifo) -> Result<()> {
        ring.clear()?;
        self.keys.clear();
        self.ids.clear();
        self.touched.clear();
        // Loans whose blocks a view kept (see `BlockFifo::clear`) can still be put.
        if let Some(alloc) = ring.allocator() {
            self.loans.retain(|id, _| alloc.get(*id).is_some());
        }
        Ok(())
    }
}

/// The message of a put's `StoreError::Full` in the store's words: vLLM's "Not enough space in
/// the data buffer" and what holds the room, without the ring's advice to call `free_buf()`
/// (a `RingBuffer` method: a store frees what it can by itself before it says so). A block
/// that can never fit keeps `StoreError::Full`'s own message.
pub fn store_full_message(full: &Full) -> String {
    if full.needed > full.capacity || full.needed > u64::from(u32::MAX) {
        return Error::Store(StoreError::Full(full.clone())).to_string();
    }
    let head = format!(
        "Not enough space in the data buffer ({} bytes needed, {} of {} bytes in use)",
        full.needed, full.live, full.capacity
    );
    match &full.held_by {
        Some(held) => format!("{head}; {held}"),
        None => format!(
            "{head}; to empty a full store, call the writer's clear(): readers' handles to \
             the objects it forgets read them until new objects are written over them"
        ),
    }
}
