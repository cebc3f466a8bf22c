//! The key index: key → entry, in shared memory, read by any process while its one
//! writer (the producer) changes it.
//!
//! # Table
//! Open addressing with linear probing over `n` fixed-size [`IndexSlot`]s (`n` a power of
//! two, at least twice the number of entries, so at most half the slots hold keys). A
//! slot is *empty*, *full* (a key, its hash, the entry index and the entry's
//! generation) or a *tombstone* (a removed key: probing goes on past it). A lookup starts
//! at `hash & (n - 1)` and walks forward until it finds the key or an empty slot.
//!
//! Keys are byte strings of 1 to [`MAX_KEY_LEN`] bytes (the engines' keys are content
//! hashes: 64 hex digits). They are stored as 64-bit words so that every byte of a slot
//! is read and written through atomics: a reader in another process races with the
//! writer by design, and atomics make that race defined behaviour.
//!
//! # Readers never see a torn slot: a seqlock per slot
//! Each slot has a sequence number `seq`, even when the slot is stable and odd while the
//! writer rewrites it, bumped by 2 per rewrite (so a reader cannot mistake A → B → A for
//! "unchanged"). The writer stores `seq + 1`, a Release fence, the fields (Relaxed), then
//! `seq + 2` with Release. A reader loads `seq` (Acquire), the fields (Relaxed), an
//! Acquire fence, and `seq` again: if both loads saw the same even value, no write
//! overlapped its reads (if it had read any field stored after the writer's fence, the
//! fence pair would make its second load see the odd value or a later one). This is the
//! fence-based seqlock of H. Boehm, "Can seqlocks get along with programming language
//! memory models?" (MSPC 2012), as in crossbeam's `SeqLock`.
//!
//! # Probe chains stay whole while the writer works
//! A key present during a whole lookup is always found: every slot between a present
//! key's home and its position is non-empty at every moment, because
//! - removing a key leaves a tombstone, not an empty slot;
//! - a tombstone becomes empty only when the slot after it is empty (then no chain runs
//!   through it: a chain through it would continue into that empty slot); removal walks
//!   backwards turning such tombstones into empty slots, so the table does not silt up;
//! - inserting fills an empty slot or a tombstone, which keeps chains non-empty.
//!
//! A lookup that races with an insert or removal of *its* key may answer either way,
//! like any check-then-act on shared state.
//!
//! # Rebuilds: an index-wide epoch
//! Tombstones in the middle of chains still accumulate under churn. When they pass an
//! eighth of the table, the writer rebuilds it in place from its own list of live keys.
//! A rebuild moves keys, which breaks the chain argument above, so it is bracketed by a
//! second, index-wide seqlock (`epoch`, odd during a rebuild): a lookup that overlapped
//! a rebuild (its two epoch loads differ, or the first was odd) starts again.
//!
//! # Trust
//! The index is in memory that any process of the same user can write. Nothing read from
//! it is trusted: lengths are bounded, probes stop after `n` slots, retries are bounded
//! (a lookup that cannot get a stable read answers [`Lookup::Busy`]), and the entry
//! index it returns is checked by the caller against the entry table.

use crate::sync::{fence, yield_now, AtomicU32, AtomicU64, Ordering};

/// A key or an insertion the index refuses, in words for the user (shmq's
/// `Error::InvalidArgument`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexError(pub String);

impl std::fmt::Display for IndexError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for IndexError {}

type Result<T> = std::result::Result<T, IndexError>;

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 160;
const KEY_WORDS: usize = MAX_KEY_LEN / 8;

const EMPTY: u32 = 0;
const FULL: u32 = 1;
const TOMBSTONE: u32 = 2;

/// How long a lookup keeps retrying a read that a write overlapped (a slot, or the
/// epoch during a rebuild) before it gives up with [`Lookup::Busy`]. A write takes
/// nanoseconds and a rebuild well under a millisecond, so this is only reached if the
/// writer is descheduled mid-write for that long, has died mid-write, or the memory is
/// corrupt.
#[cfg(not(loom))]
const GIVE_UP_AFTER: std::time::Duration = std::time::Duration::from_millis(100);
/// Retries under loom (the model has no clock).
#[cfg(loom)]
const MAX_RETRIES: u32 = 3;

/// One slot of the index (192 bytes, three cache lines). Lives in shared memory:
/// `#[repr(C)]`, atomics only, no pointers.
#[repr(C)]
pub struct IndexSlot {
    /// Seqlock sequence: odd while the writer rewrites the slot.
    seq: AtomicU32,
    /// `EMPTY`, `FULL` or `TOMBSTONE` (anything else: read as a tombstone).
    tag: AtomicU32,
    key_len: AtomicU32,
    entry: AtomicU32,
    entry_gen: AtomicU64,
    hash: AtomicU64,
    key: [AtomicU64; KEY_WORDS],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<IndexSlot>() == 192);
#[cfg(not(loom))]
const _: () = assert!(std::mem::align_of::<IndexSlot>() == 8);

/// Size of one slot in the segment.
pub const SLOT_BYTES: usize = 192;

impl IndexSlot {
    /// An empty slot, for tests and models (in a segment, slots start as zero bytes,
    /// which is the same thing).
    pub fn new() -> IndexSlot {
        IndexSlot {
            seq: AtomicU32::new(0),
            tag: AtomicU32::new(EMPTY),
            key_len: AtomicU32::new(0),
            entry: AtomicU32::new(0),
            entry_gen: AtomicU64::new(0),
            hash: AtomicU64::new(0),
            key: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Default for IndexSlot {
    fn default() -> Self {
        IndexSlot::new()
    }
}

/// A key prepared for the index: its bytes as little-endian words (zero-padded) and its
/// hash. The hash is part of the segment layout: every process must compute the same.
#[derive(Clone, PartialEq, Eq)]
pub struct Key {
    words: [u64; KEY_WORDS],
    len: usize,
    hash: u64,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({:?})", String::from_utf8_lossy(&self.bytes()))
    }
}

impl Key {
    /// `bytes` as a key: 1 to [`MAX_KEY_LEN`] bytes.
    ///
    /// # Errors
    ///
    /// An [`IndexError`] when `bytes` is empty or longer than [`MAX_KEY_LEN`].
    pub fn new(bytes: &[u8]) -> Result<Key> {
        if bytes.is_empty() || bytes.len() > MAX_KEY_LEN {
            return Err(IndexError(format!(
                "an encoder cache key must be 1 to {MAX_KEY_LEN} bytes long, got {} bytes",
                bytes.len()
            )));
        }
        let mut words = [0u64; KEY_WORDS];
        for (w, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *w = u64::from_le_bytes(b);
        }
        let len = bytes.len();
        Ok(Key {
            words,
            len,
            hash: hash_words(&words[..len.div_ceil(8)], len),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// The key's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out: Vec<u8> = self.words.iter().flat_map(|w| w.to_le_bytes()).collect();
        out.truncate(self.len);
        out
    }

    fn used_words(&self) -> &[u64] {
        &self.words[..self.len.div_ceil(8)]
    }
}

/// A 64-bit hash of a key's words: a multiply-xorshift per word and the SplitMix64
/// finaliser. Fixed forever for layout version 1 (readers in other processes recompute
/// it); content-hash keys are random already, so this only has to mix well.
fn hash_words(words: &[u64], len: usize) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64 ^ (len as u64);
    for &w in words {
        h = (h ^ w).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 31;
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

/// What a lookup found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The key, with the entry index and entry generation stored beside it.
    Found {
        entry: u32,
        generation: u64,
    },
    Absent,
    /// No stable read could be had (writer dead mid-write, or corrupt memory).
    Busy,
}

/// One consistent read of a slot, as far as a lookup for one key cares.
enum SlotView {
    Empty,
    /// A tombstone, or a key other than the one looked for.
    Other,
    Match {
        entry: u32,
        generation: u64,
    },
}

/// The index's rebuild epoch (odd during a rebuild), changed only by [`IndexWriter`].
/// Zero bytes: no rebuild yet.
#[repr(transparent)]
pub struct IndexEpoch(AtomicU32);

impl IndexEpoch {
    pub fn new() -> IndexEpoch {
        IndexEpoch(AtomicU32::new(0))
    }
}

impl Default for IndexEpoch {
    fn default() -> Self {
        IndexEpoch::new()
    }
}

/// The index over a table of slots and its epoch word. Lookups take `&self` and may run
/// in any process; the writer's operations are on [`IndexWriter`].
#[derive(Clone, Copy)]
pub struct KeyIndex<'a> {
    epoch: &'a IndexEpoch,
    slots: &'a [IndexSlot],
}

impl<'a> KeyIndex<'a> {
    /// The index over `slots` (a power of two of them) with its rebuild `epoch`.
    pub fn new(epoch: &'a IndexEpoch, slots: &'a [IndexSlot]) -> KeyIndex<'a> {
        assert!(
            slots.len().is_power_of_two(),
            "the index needs a power-of-two number of slots"
        );
        KeyIndex { epoch, slots }
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// One seqlock read of `slot` against `key`; `None` if a write overlapped it.
    fn read_slot(slot: &IndexSlot, key: &Key) -> Option<SlotView> {
        // Acquire: pairs with the Release store of the even `seq` that ends a write, so
        // the fields read below are at least that write's.
        let s1 = slot.seq.load(Ordering::Acquire);
        if s1 & 1 == 1 {
            return None;
        }
        // Relaxed field loads: whether they belong together is decided by the second
        // `seq` load after the fence below, not by their own ordering.
        let view = match slot.tag.load(Ordering::Relaxed) {
            EMPTY => SlotView::Empty,
            FULL => {
                let len = slot.key_len.load(Ordering::Relaxed) as usize;
                let matches = len == key.len
                    && slot.hash.load(Ordering::Relaxed) == key.hash
                    && key
                        .used_words()
                        .iter()
                        .zip(&slot.key)
                        .all(|(w, s)| s.load(Ordering::Relaxed) == *w);
                if matches {
                    SlotView::Match {
                        entry: slot.entry.load(Ordering::Relaxed),
                        generation: slot.entry_gen.load(Ordering::Relaxed),
                    }
                } else {
                    SlotView::Other
                }
            }
            // A tombstone; or a corrupt tag, which is safest read as "go on probing".
            _ => SlotView::Other,
        };
        // Acquire fence: pairs with the writer's Release fence after it made `seq` odd. If
        // any load above saw a store made after that fence, the load below sees the odd
        // `seq` (or a later one) and the read is discarded.
        fence(Ordering::Acquire);
        // Relaxed: ordered after the field loads by the fence above.
        let s2 = slot.seq.load(Ordering::Relaxed);
        (s1 == s2).then_some(view)
    }

    /// Look `key` up. Lock-free for readers; answers from a state the index really had
    /// during the call (or `Busy`, see [`Lookup`]).
    pub fn lookup(&self, key: &Key) -> Lookup {
        let mut retries = Retries::default();
        'again: loop {
            // Acquire: pairs with the Release store that ends a rebuild.
            let e1 = self.epoch.0.load(Ordering::Acquire);
            if e1 & 1 == 1 {
                if !backoff(&mut retries) {
                    return Lookup::Busy;
                }
                continue;
            }
            let mut i = key.hash as usize & self.mask();
            let mut found = Lookup::Absent;
            for _ in 0..self.slots.len() {
                let view = loop {
                    match Self::read_slot(&self.slots[i], key) {
                        Some(v) => break v,
                        None if backoff(&mut retries) => {}
                        None => return Lookup::Busy,
                    }
                };
                match view {
                    SlotView::Empty => break,
                    SlotView::Other => i = (i + 1) & self.mask(),
                    SlotView::Match { entry, generation } => {
                        found = Lookup::Found { entry, generation };
                        break;
                    }
                }
            }
            // Acquire fence: pairs with the Release fence at the start of a rebuild (see
            // `read_slot`: same argument, index-wide).
            fence(Ordering::Acquire);
            // Relaxed: ordered by the fence.
            if self.epoch.0.load(Ordering::Relaxed) == e1 {
                return found;
            }
            if !backoff(&mut retries) {
                return Lookup::Busy;
            }
            continue 'again;
        }
    }
}

/// Failed attempts at a stable read, and since when (the clock is read only once the
/// first few quick retries failed).
#[derive(Default)]
struct Retries {
    count: u32,
    #[cfg(not(loom))]
    since: Option<std::time::Instant>,
}

/// Count one failed attempt and wait a little before the next; false once it is time to
/// give up.
fn backoff(retries: &mut Retries) -> bool {
    retries.count += 1;
    #[cfg(loom)]
    {
        yield_now();
        retries.count <= MAX_RETRIES
    }
    #[cfg(not(loom))]
    {
        if retries.count < 16 {
            std::hint::spin_loop();
            return true;
        }
        if retries.count % 64 == 16 {
            let since = *retries.since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > GIVE_UP_AFTER {
                return false;
            }
        }
        yield_now();
        true
    }
}

/// The writer's side of the index: only one exists per table (the producer), and it is
/// only used under the producer's lock. It keeps the counts that decide rebuilds.
#[derive(Debug, Default)]
pub struct IndexWriter {
    live: usize,
    tombstones: usize,
}

impl IndexWriter {
    /// A writer for a table that is all empty (a new segment).
    pub fn new() -> IndexWriter {
        IndexWriter::default()
    }

    /// Keys in the index.
    pub fn live(&self) -> usize {
        self.live
    }

    /// Tombstones in the table.
    pub fn tombstones(&self) -> usize {
        self.tombstones
    }

    /// Rewrite `slot` under its seqlock: `write` stores the fields (Relaxed).
    fn write_slot(slot: &IndexSlot, write: impl FnOnce(&IndexSlot)) {
        // Relaxed RMW, then a Release fence: pairs with the reader's Acquire fence in
        // `KeyIndex::read_slot` — a reader that sees any field stored below sees the odd
        // `seq` (or a later value) in its second load. (An RMW rather than a load and a
        // store: the same effect, and loom's model checker sees the race with readers.)
        let mut s = slot.seq.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        if s & 1 == 0 {
            // The old value was odd (corrupt, or a writer died mid-write): make it odd
            // again so that readers keep telling writes apart.
            s = slot.seq.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        }
        fence(Ordering::Release);
        write(slot);
        // Release: pairs with the reader's first (Acquire) `seq` load: a reader that sees
        // the new even value sees every field stored above.
        slot.seq.store(s.wrapping_add(1), Ordering::Release);
    }

    fn fill(slot: &IndexSlot, key: &Key, entry: u32, generation: u64) {
        Self::write_slot(slot, |s| {
            // Relaxed: published by the seqlock (see `write_slot`).
            for (w, v) in s.key.iter().zip(key.used_words()) {
                w.store(*v, Ordering::Relaxed);
            }
            s.key_len.store(key.len as u32, Ordering::Relaxed);
            s.hash.store(key.hash, Ordering::Relaxed);
            s.entry.store(entry, Ordering::Relaxed);
            s.entry_gen.store(generation, Ordering::Relaxed);
            s.tag.store(FULL, Ordering::Relaxed);
        });
    }

    fn set_tag(slot: &IndexSlot, tag: u32) {
        // Relaxed: published by the seqlock (see `write_slot`).
        Self::write_slot(slot, |s| s.tag.store(tag, Ordering::Relaxed));
    }

    // Relaxed loads of the writer's own table: only this writer stores these fields, so
    // it reads back its own latest values.
    fn tag(slot: &IndexSlot) -> u32 {
        slot.tag.load(Ordering::Relaxed)
    }

    fn holds(slot: &IndexSlot, key: &Key) -> bool {
        Self::tag(slot) == FULL
            && slot.key_len.load(Ordering::Relaxed) as usize == key.len
            && slot.hash.load(Ordering::Relaxed) == key.hash
            && key
                .used_words()
                .iter()
                .zip(&slot.key)
                .all(|(w, s)| s.load(Ordering::Relaxed) == *w)
    }

    /// Whether the table should be rebuilt (tombstones pass an eighth of it).
    pub fn needs_rebuild(&self, index: &KeyIndex<'_>) -> bool {
        self.tombstones > index.slots.len() / 8
    }

    /// Insert `key` (which the caller knows is absent) for `entry` of `generation`.
    /// Fails only if the table is full, which the producer's sizing rules out.
    ///
    /// # Errors
    ///
    /// An [`IndexError`] when every slot of the table is taken (which the producer's sizing
    /// rules out).
    pub fn insert(
        &mut self,
        index: &KeyIndex<'_>,
        key: &Key,
        entry: u32,
        generation: u64,
    ) -> Result<()> {
        let mut i = key.hash as usize & index.mask();
        for _ in 0..index.slots.len() {
            let slot = &index.slots[i];
            match Self::tag(slot) {
                FULL => i = (i + 1) & index.mask(),
                tag => {
                    if tag != EMPTY {
                        self.tombstones = self.tombstones.saturating_sub(1);
                    }
                    Self::fill(slot, key, entry, generation);
                    self.live += 1;
                    return Ok(());
                }
            }
        }
        Err(IndexError("the encoder cache's key index is full".into()))
    }

    /// Remove `key`; whether it was there.
    pub fn remove(&mut self, index: &KeyIndex<'_>, key: &Key) -> bool {
        let mask = index.mask();
        let mut i = key.hash as usize & mask;
        for _ in 0..index.slots.len() {
            let slot = &index.slots[i];
            if Self::tag(slot) == EMPTY {
                return false;
            }
            if Self::holds(slot, key) {
                Self::set_tag(slot, TOMBSTONE);
                self.live -= 1;
                self.tombstones += 1;
                // Turn the tombstones that end a chain into empty slots, backwards: each
                // is followed by an empty slot, so no chain runs through it (module docs).
                let mut j = i;
                while Self::tag(&index.slots[(j + 1) & mask]) == EMPTY
                    && Self::tag(&index.slots[j]) != EMPTY
                    && Self::tag(&index.slots[j]) != FULL
                {
                    Self::set_tag(&index.slots[j], EMPTY);
                    self.tombstones = self.tombstones.saturating_sub(1);
                    j = j.wrapping_sub(1) & mask;
                    if j == i {
                        break;
                    }
                }
                return true;
            }
            i = (i + 1) & mask;
        }
        false
    }

    /// Rebuild the table from `live` (every key the writer holds, with its entry and
    /// generation), under the epoch seqlock.
    ///
    /// # Errors
    ///
    /// An [`IndexError`] when the table cannot hold every key of `live` (the keys that
    /// fitted are in it).
    pub fn rebuild<'k>(
        &mut self,
        index: &KeyIndex<'_>,
        live: impl IntoIterator<Item = (&'k Key, u32, u64)>,
    ) -> Result<()> {
        // Relaxed RMW, then Release fence: pairs with the Acquire fence at the end of
        // `KeyIndex::lookup` (a lookup that saw any slot change made below sees the odd
        // epoch, or a later one, and starts again).
        let mut e = index
            .epoch
            .0
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(1);
        if e & 1 == 0 {
            e = index
                .epoch
                .0
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_add(1);
        }
        fence(Ordering::Release);
        for slot in index.slots {
            if Self::tag(slot) != EMPTY {
                Self::set_tag(slot, EMPTY);
            }
        }
        self.live = 0;
        self.tombstones = 0;
        let mut result = Ok(());
        for (key, entry, generation) in live {
            if let Err(e) = self.insert(index, key, entry, generation) {
                result = Err(e);
            }
        }
        // Release: pairs with the Acquire epoch load at the start of a lookup.
        index.epoch.0.store(e.wrapping_add(1), Ordering::Release);
        result
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn table(n: usize) -> (IndexEpoch, Vec<IndexSlot>) {
        (
            IndexEpoch::new(),
            (0..n).map(|_| IndexSlot::new()).collect(),
        )
    }

    /// Keys whose home slot (in a table of `n`) is `home`.
    fn keys_at(home: usize, n: usize, count: usize) -> Vec<Key> {
        (0..)
            .map(|i| Key::new(format!("key-{home}-{i}").as_bytes()).unwrap())
            .filter(|k| k.hash() as usize & (n - 1) == home)
            .take(count)
            .collect()
    }

    #[test]
    fn keys_are_bounded_and_round_trip() {
        assert!(Key::new(b"").is_err());
        assert!(Key::new(&[b'a'; MAX_KEY_LEN + 1]).is_err());
        let long = [b'z'; MAX_KEY_LEN];
        assert_eq!(Key::new(&long).unwrap().bytes(), long);
        let k = Key::new("日本-abc".as_bytes()).unwrap();
        assert_eq!(k.bytes(), "日本-abc".as_bytes());
        // Keys differing only past a word boundary or in length are different keys.
        assert_ne!(
            Key::new(b"abcdefgh1").unwrap(),
            Key::new(b"abcdefgh2").unwrap()
        );
        assert_ne!(
            Key::new(b"a").unwrap().hash(),
            Key::new(b"a\0").unwrap().hash()
        );
    }

    #[test]
    fn insert_lookup_remove_with_collisions() {
        let (epoch, slots) = table(8);
        let index = KeyIndex::new(&epoch, &slots);
        let mut w = IndexWriter::new();
        let ks = keys_at(7, 8, 3); // home 7: the chain wraps around to 0 and 1
        for (i, k) in ks.iter().enumerate() {
            w.insert(&index, k, i as u32, 10 + i as u64).unwrap();
        }
        for (i, k) in ks.iter().enumerate() {
            assert_eq!(
                index.lookup(k),
                Lookup::Found {
                    entry: i as u32,
                    generation: 10 + i as u64
                }
            );
        }
        assert_eq!(index.lookup(&Key::new(b"nope").unwrap()), Lookup::Absent);
        // Removing the middle key leaves a tombstone: the last stays reachable.
        assert!(w.remove(&index, &ks[1]));
        assert!(!w.remove(&index, &ks[1]));
        assert_eq!(w.tombstones(), 1);
        assert_eq!(index.lookup(&ks[1]), Lookup::Absent);
        assert!(matches!(
            index.lookup(&ks[2]),
            Lookup::Found { entry: 2, .. }
        ));
        // Removing the last turns both trailing tombstones into empty slots.
        assert!(w.remove(&index, &ks[2]));
        assert_eq!(w.tombstones(), 0);
        assert_eq!(w.live(), 1);
        assert!(matches!(
            index.lookup(&ks[0]),
            Lookup::Found { entry: 0, .. }
        ));
    }

    #[test]
    fn random_operations_match_a_map_and_rebuilds_keep_every_key() {
        let n = 64;
        let (epoch, slots) = table(n);
        let index = KeyIndex::new(&epoch, &slots);
        let mut w = IndexWriter::new();
        let mut model: HashMap<Vec<u8>, (Key, u32)> = HashMap::new();
        let mut rng = 0x1234_5678u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut rebuilds = 0;
        for step in 0..20_000u32 {
            let k = Key::new(format!("k{}", next() % 100).as_bytes()).unwrap();
            let present = model.contains_key(&k.bytes());
            if present && next() % 2 == 0 {
                assert!(w.remove(&index, &k));
                model.remove(&k.bytes());
            } else if !present && model.len() < n / 2 {
                w.insert(&index, &k, step, step as u64).unwrap();
                model.insert(k.bytes(), (k.clone(), step));
            }
            if w.needs_rebuild(&index) {
                rebuilds += 1;
                let live: Vec<(Key, u32)> = model.values().cloned().collect();
                w.rebuild(&index, live.iter().map(|(k, e)| (k, *e, *e as u64)))
                    .unwrap();
            }
            if step % 97 == 0 {
                for i in 0..100 {
                    let k = Key::new(format!("k{i}").as_bytes()).unwrap();
                    let want = model
                        .get(&k.bytes())
                        .map(|(_, e)| Lookup::Found {
                            entry: *e,
                            generation: *e as u64,
                        })
                        .unwrap_or(Lookup::Absent);
                    assert_eq!(index.lookup(&k), want, "step {step}");
                }
            }
            assert_eq!(w.live(), model.len());
        }
        assert!(rebuilds > 0, "the workload never rebuilt the table");
        assert_eq!(epoch.0.load(Ordering::Relaxed) % 2, 0);
    }

    #[test]
    fn corrupt_slots_are_read_safely() {
        let (epoch, slots) = table(4);
        let index = KeyIndex::new(&epoch, &slots);
        for s in &slots {
            s.tag.store(FULL, Ordering::Relaxed);
            s.key_len.store(u32::MAX, Ordering::Relaxed);
        }
        // Every slot full of garbage: the probe stops after one lap.
        assert_eq!(index.lookup(&Key::new(b"k").unwrap()), Lookup::Absent);
        // A slot stuck mid-write: Busy, not a hang.
        slots[Key::new(b"k").unwrap().hash() as usize & 3]
            .seq
            .store(1, Ordering::Relaxed);
        assert_eq!(index.lookup(&Key::new(b"k").unwrap()), Lookup::Busy);
    }

    #[test]
    fn a_reader_thread_never_sees_a_wrong_entry() {
        // Two keys with the same home keep being swapped in and out of the same slots
        // while a reader looks one of them up: it finds it with its own entry, or not at
        // all; and a third key further down the chain is never lost.
        let n = 4;
        let (epoch, slots) = table(n);
        let index = KeyIndex::new(&epoch, &slots);
        let ks = keys_at(1, n, 3);
        let mut w = IndexWriter::new();
        w.insert(&index, &ks[2], 2, 2).unwrap();
        let stop = crate::sync::local::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for round in 0..20_000u64 {
                    w.insert(&index, &ks[0], 0, round).unwrap();
                    w.remove(&index, &ks[0]);
                    w.insert(&index, &ks[1], 1, round).unwrap();
                    w.remove(&index, &ks[1]);
                    if round % 1000 == 0 {
                        let live = [(&ks[2], 2u32, 2u64)];
                        w.rebuild(&index, live).unwrap();
                    }
                }
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
            });
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match index.lookup(&ks[0]) {
                    Lookup::Found { entry, .. } => assert_eq!(entry, 0),
                    Lookup::Absent | Lookup::Busy => {}
                }
                assert_eq!(
                    index.lookup(&ks[2]),
                    Lookup::Found {
                        entry: 2,
                        generation: 2
                    }
                );
            }
        });
    }
}
