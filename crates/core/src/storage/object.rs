//! One object in a block: where its count and parts go, reading it by handle (checked
//! before and after), and zero-copy views of its parts that pin the block.

use std::sync::Arc;

use super::store_segment::{
    BlockHeader, COUNT_WORD_BYTES, MAX_READER_SLOTS, PART_ALIGN, RING_OFFSET, StoreSegment,
    count_word_at, frame_parts, frame_slots, id_in, part_table_offset, pin_byte,
    reader_word_offset,
};
use crate::error::{Error, OsError, Result, StoreError};
use shmq_os::pins::Pin;
use shmq_os::private_map::PrivateMap;
use shmq_protocol::alloc::HEADER_BYTES;
use shmq_protocol::read_count::ReadCount;

/// Where the count word and the parts of an object go: offsets from the start of the
/// block's data, which is at ring offset `data_offset`. The frame is `[pad to 8][count
/// word (8)][frame word (4): n parts, s reader words][if s > 0: pad (4), s × reader word
/// (8)][n × (offset, len) (4 + 4)]`, then the parts (see `super::readers` for the reader
/// words; with none, the frame is version 4's `[count word][n][table]`).
pub(super) fn object_layout(
    data_offset: u64,
    lens: impl Iterator<Item = u64>,
    n: usize,
    slots: usize,
    align_from: usize,
    mut place: impl FnMut(usize, u64),
) -> u64 {
    let mut at = count_word_at(data_offset) + part_table_offset(slots) + 8 * n as u64;
    for (i, len) in lens.enumerate() {
        if i >= align_from {
            at = (data_offset + at).next_multiple_of(PART_ALIGN) - data_offset;
        }
        place(i, at);
        at += len;
    }
    at
}

/// The object in a block's data, its frame checked against the block's bounds.
pub struct ObjectFrame<'a> {
    /// The block's data (after the 8-byte header).
    pub(super) data: &'a [u8],
    /// Where the part table is in `data` (after the reader words, if any).
    pub(super) table_at: usize,
    pub(super) n: usize,
}

impl<'a> ObjectFrame<'a> {
    /// Parse the frame of the object whose block data is `data` (at ring offset
    /// `data_offset`); any frame that points outside the data is an error.
    fn parse(data: &'a [u8], data_offset: u64) -> Option<ObjectFrame<'a>> {
        let count_at = count_word_at(data_offset) as usize;
        let word = |at: usize| -> Option<u32> {
            let b = data.get(at..at.checked_add(4)?)?;
            Some(u32::from_le_bytes(b.try_into().ok()?))
        };
        let frame = word(count_at + COUNT_WORD_BYTES as usize)?;
        let (n, slots) = (frame_parts(frame), frame_slots(frame));
        if slots > MAX_READER_SLOTS {
            return None;
        }
        let table_at = count_at + part_table_offset(slots) as usize;
        let frame_end = table_at.checked_add(n.checked_mul(8)?)?;
        if frame_end > data.len() {
            return None;
        }
        let view = ObjectFrame { data, table_at, n };
        for i in 0..n {
            let (off, len) = view.entry(i);
            if off < frame_end || off.checked_add(len)? > data.len() {
                return None;
            }
        }
        Some(view)
    }

    pub(super) fn entry(&self, i: usize) -> (usize, usize) {
        let at = self.table_at + 8 * i;
        let w = |k: usize| u32::from_le_bytes(self.data[k..k + 4].try_into().unwrap()) as usize;
        (w(at), w(at + 4))
    }

    /// Number of parts.
    pub fn len(&self) -> usize {
        self.n
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    /// Part `i`: inside the block. The frame is read again here from shared memory; if
    /// it changed since `parse` checked it (the writer reused the block after a `clear()`
    /// while a reader used it, or another process wrote it), the range may be anything:
    /// it is then clamped to nothing, and `read_object`'s check after the read reports a
    /// reused object as modified. (Found by `fuzz/fuzz_targets/store_reader.rs`.)
    pub fn part(&self, i: usize) -> &'a [u8] {
        &self.data[self.part_range(i)]
    }
    /// Where part `i` lies in the block's data, clamped as `part` says (an empty range
    /// at 0 when the frame no longer fits).
    pub(super) fn part_range(&self, i: usize) -> std::ops::Range<usize> {
        let (off, len) = self.entry(i);
        match off.checked_add(len) {
            Some(end) if end <= self.data.len() => off..end,
            _ => 0..0,
        }
    }
    /// From the start of the first part to the end of the last (the parts of a custom
    /// serde follow each other without gaps: this is its `[metadata][data...]`).
    pub fn span(&self) -> &'a [u8] {
        if self.n == 0 {
            return &self.data[self.table_at..self.table_at];
        }
        let (first, _) = self.entry(0);
        let (last, len) = self.entry(self.n - 1);
        let end = last.saturating_add(len).max(first);
        // Clamped as in `part`: the frame may have changed since it was checked.
        self.data.get(first..end).unwrap_or(&[])
    }
}

/// The count of the 8-byte word at `at` in `data` (a block's data: the count word or a
/// reader word), if it lies inside `data`.
fn count_in(data: &[u8], at: usize) -> Option<u32> {
    if data.len() < at.checked_add(COUNT_WORD_BYTES as usize)? {
        return None;
    }
    // SAFETY: inside `data` (checked above) and 8-aligned (`at` is the count word's place,
    // 8-aligned in memory as the ring is page-aligned, plus a multiple of 8); a
    // `ReadCount` is one `AtomicU64` (repr(transparent)). shmq accesses count words only
    // atomically (a Python view from `access_buf` could write one: that changes the
    // count, which only decides when the object may be evicted).
    let word = unsafe { &*(data.as_ptr().add(at) as *const ReadCount) };
    // The protocol's ordering (Acquire, pairing with the readers' counts): `read_count`.
    Some(word.reads())
}

/// Every read counted in the object whose block data is `data`: its count word's (readers
/// without a slot) and its reader words' (`super::readers`). Reader words are per slot,
/// as many as the frame word says; a frame that does not fit `data` has none.
fn counted_reads(data: &[u8]) -> u64 {
    let count_at = count_word_at(data.as_ptr() as u64) as usize;
    // Not an object (a raw allocation through the ring's own API): nothing counts.
    let Some(main) = count_in(data, count_at) else {
        return 0;
    };
    let frame_at = count_at + COUNT_WORD_BYTES as usize;
    let Some(frame) = data.get(frame_at..frame_at + 4) else {
        return main.into();
    };
    let slots = frame_slots(u32::from_le_bytes(frame.try_into().expect("4 bytes")));
    (0..slots.min(MAX_READER_SLOTS))
        .map_while(|s| count_in(data, count_at + reader_word_offset(s) as usize))
        .fold(u64::from(main), |sum, c| sum + u64::from(c))
}

/// The reads counted in the object's count word alone (those of readers without a slot,
/// and every read of a store of one reader); 0 for a block that is not an object.
pub(super) fn unslotted_reads(data: &[u8]) -> u64 {
    let count_at = count_word_at(data.as_ptr() as u64) as usize;
    count_in(data, count_at).map_or(0, u64::from)
}

/// The reads reader slot `s` counted in the object whose block data is `data`; `None` if
/// the object has no reader word for it (it has none for slots of a store of one
/// reader: that reader's reads are in the count word).
pub(super) fn reads_by(data: &[u8], s: usize) -> Option<u32> {
    let count_at = count_word_at(data.as_ptr() as u64) as usize;
    let frame_at = count_at + COUNT_WORD_BYTES as usize;
    let frame = data.get(frame_at..frame_at + 4)?;
    if s >= frame_slots(u32::from_le_bytes(frame.try_into().expect("4 bytes"))) {
        return None;
    }
    count_in(data, count_at + reader_word_offset(s) as usize)
}

/// The reader count of the object whose block data is `data`: every read counted in it,
/// by any reader (for inspection; what counts for eviction is `ObjectStore`'s `tally`).
pub(super) fn reader_count(data: &[u8]) -> u32 {
    counted_reads(data).min(u64::from(u32::MAX)) as u32
}

/// How a read is counted (see `read_object`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CountRead {
    /// Not at all (the writer's own gets, without a reader lock).
    No,
    /// In the object's count word: a reader without a slot.
    Anonymous,
    /// In the reader word of slot `s` (a [`ReaderSlot`](super::ReaderSlot)'s
    /// [`count`](super::ReaderSlot::count)): the writer can then tell which reader read
    /// what, and go on without it if it dies. An object without a word for the slot
    /// counts the read in its count word.
    AsReader(usize),
}

impl From<bool> for CountRead {
    /// `true`: [`CountRead::Anonymous`]; `false`: [`CountRead::No`].
    fn from(count: bool) -> CountRead {
        if count {
            CountRead::Anonymous
        } else {
            CountRead::No
        }
    }
}

/// Count one read of the object in block `h`, in reader slot `slot`'s word if the object
/// has one for it, else in its count word: add one to the count if the word still
/// carries the object's tag; else (the block was reused after the reader's last check,
/// which only a reader stalled longer than the writer's patience can see, or a peer
/// wrote the word) count nothing. Returns whether it counted.
pub(super) fn count_one_read(segment: &StoreSegment, h: &BlockHeader, slot: Option<usize>) -> bool {
    let word = slot
        .and_then(|s| segment.reader_word_of(h, s))
        .unwrap_or_else(|| segment.count_word_of(h));
    // Tag-checked, saturating, Release: `shmq_protocol::read_count::ReadCount`.
    word.count_one(segment.count_tag(h.id))
}

/// The header of the object at `address` if `(address, id)` names a live (or cleared
/// but intact) object.
fn object_header(segment: &StoreSegment, address: u64, id: u32) -> Result<BlockHeader> {
    let stale = || {
        Error::Store(StoreError::StaleObject {
            address,
            id: id as u64,
        })
    };
    // vLLM's arithmetic never gives a block an address of two laps or more.
    if address / 2 >= segment.capacity() {
        return Err(stale());
    }
    let snap = segment.snapshot().ok_or_else(stale)?;
    let offset = address % segment.capacity();
    if !snap.names(id, offset) {
        return Err(stale());
    }
    let h = segment.header_at(address).map_err(|_| stale())?;
    if h.id != id {
        return Err(stale());
    }
    Ok(h)
}

/// Whether `(address, id)` still names the object whose header is `h`: to call after
/// using its payload.
fn still_valid(segment: &StoreSegment, h: &BlockHeader) -> bool {
    // The payload reads before it complete before the loads below (an Acquire fence:
    // `seqlock::before_recheck`); if they show the object still valid, the writer had
    // not started reusing it (it publishes before it writes, see
    // `BlockFifo::allocate_with`/`free_while`).
    shmq_protocol::seqlock::before_recheck();
    validity(segment, h) != Validity::Stale
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Validity {
    Stale,
    /// Live: the writer frees it only through `free_while` (which waits for counters).
    Live,
    /// Cleared, not yet overwritten: readable, but nothing counts its reads any more.
    Cleared,
}

fn validity(segment: &StoreSegment, h: &BlockHeader) -> Validity {
    if segment.load_u32(h.offset) != h.id {
        return Validity::Stale;
    }
    match segment.snapshot() {
        Some(s) if id_in(h.id, s.id_start, s.id_end) => Validity::Live,
        Some(s) if s.names(h.id, h.offset) => Validity::Cleared,
        _ => Validity::Stale,
    }
}

/// Check that `(address, id)` names a live object (what a reader's `touch` does).
///
/// # Errors
///
/// [`StoreError::StaleObject`] when `(address, id)` names no live object (evicted, reused,
/// cleared, forged or out of range); [`Error::Os`] when the segment was truncated.
pub fn check_object(segment: &StoreSegment, address: u64, id: u32) -> Result<()> {
    intact_first(segment, object_header(segment, address, id).map(|_| ()))
}

/// `r`, unless the segment was found truncated meanwhile (its reads then read zeros:
/// whatever they concluded, the truncation is the error; see `shmq_os::sigbus`).
fn intact_first<T>(segment: &StoreSegment, r: Result<T>) -> Result<T> {
    segment.check_intact()?;
    r
}

/// Read the object at `(address, id)`: check the handle, call `f` on its parts, check
/// the handle again, and count this as one read as `count` says (`true`: anonymously,
/// `false`: not at all). Any process may call it.
///
/// # Errors
///
/// [`StoreError::StaleObject`] when the handle names no live object, before the read or
/// after it (evicted meanwhile: what `f` saw is not to be trusted); [`Error::Os`] when the
/// segment was truncated.
pub fn read_object<R>(
    segment: &StoreSegment,
    address: u64,
    id: u32,
    count: impl Into<CountRead>,
    f: impl FnOnce(&ObjectFrame<'_>) -> R,
) -> Result<R> {
    let count = count.into();
    segment.check_intact()?;
    let h = intact_first(segment, object_header(segment, address, id))?;
    let r = intact_first(segment, read_header(segment, h, address, id, count, f))?;
    if count != CountRead::No {
        segment.count_get();
    }
    Ok(r)
}

/// [`read_object`] from a header found valid for `(address, id)`.
pub(super) fn read_header<R>(
    segment: &StoreSegment,
    h: BlockHeader,
    address: u64,
    id: u32,
    count: CountRead,
    f: impl FnOnce(&ObjectFrame<'_>) -> R,
) -> Result<R> {
    let stale = || {
        Error::Store(StoreError::StaleObject {
            address,
            id: id as u64,
        })
    };
    let (p, n) = segment.data_ptr(&h);
    // SAFETY: the range is inside the ring (header_at). The writer does not overwrite a
    // live object until every reader has counted its read, which we do only after `f`;
    // a stale handle, or a peer writing the ring, may change these bytes under us: the
    // frame is bounds-checked before use and the handle checked again after `f`.
    let data = unsafe { std::slice::from_raw_parts(p, n) };
    let view = ObjectFrame::parse(data, h.offset + HEADER_BYTES).ok_or_else(stale)?;
    let out = f(&view);
    let slot = match count {
        CountRead::No => None,
        CountRead::Anonymous => Some(None),
        CountRead::AsReader(s) => Some(Some(s)),
    };
    let Some(slot) = slot else {
        return if still_valid(segment, &h) {
            Ok(out)
        } else {
            Err(stale())
        };
    };
    // The count lies in the block: it must not be incremented once the block may be
    // reused (that would write into another object). So the check and the count happen
    // inside the counting window (`shmq_protocol::read_count::CountingWindow`): either
    // the check sees the block freed, or the writer (`wait_for_counting_readers`) waits
    // for us before it reuses the memory. The writer waits only COUNTING_PATIENCE (a
    // reader may have died here); one stalled longer finds its object's tag gone from the
    // count word and counts nothing (`count_one_read`).
    let validity = segment.counting().count(|| {
        let validity = validity(segment, &h);
        if validity == Validity::Live && count_one_read(segment, &h, slot) {
            if let Some(s) = slot {
                segment.count_reader_read(s);
            }
        }
        validity
    });
    if validity == Validity::Stale {
        return Err(stale());
    }
    Ok(out)
}

/// Keeps an object's block from being freed or overwritten while zero-copy views of it
/// live in this process (a read lock on a byte of the segment's file, see
/// `pins` module); shared by the views of one `get`.
#[derive(Debug)]
pub struct BlockPin {
    pub(super) segment: Arc<StoreSegment>,
    pub(super) _pin: Pin,
    pub(super) made_in: u64,
}

impl Drop for BlockPin {
    fn drop(&mut self) {
        // A forked child's copy counts nothing: the hint is its parent's to decrement.
        if !shmq_os::fork::is_inherited(self.made_in) {
            // Release (`PinHint::release`): everything done with the block under this pin
            // (a loan filled on another thread, a view's reads) comes before the writer's
            // reuse.
            self.segment.pin_hint().release();
        }
    }
}

/// A private, copy-on-write mapping of one part of a stored object: zero-copy to read;
/// a write copies the touched pages, never reaching the writer or another reader. The
/// object's block is not reused while it lives.
#[derive(Debug)]
pub struct PartView {
    pub(super) map: PrivateMap,
    pub(super) _pin: Arc<BlockPin>,
}

shmq_os::region!(PartView, map);

/// What [`read_object_viewed`] offers to map parts of the object it reads. The block is
/// pinned at the first [`ObjectViews::map`] (objects read without views cost no pin).
pub struct ObjectViews<'a> {
    pub(super) segment: &'a Arc<StoreSegment>,
    pub(super) header: BlockHeader,
    pub(super) pin: std::cell::OnceCell<Option<Arc<BlockPin>>>,
}

impl ObjectViews<'_> {
    /// A private mapping of part `i` of `object` (the object being read); `None` when
    /// the object cannot be viewed (a cleared object, or pinning failed): copy instead.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the segment's file cannot be mapped privately, or was truncated.
    pub fn map(&self, object: &ObjectFrame<'_>, i: usize) -> Result<Option<PartView>> {
        let pin = self
            .pin
            .get_or_init(|| pin_block(self.segment, &self.header));
        let Some(pin) = pin else { return Ok(None) };
        // The part as `part` clamps it (the frame is shared memory a peer may change:
        // read it once, as a range, not as a pointer into the data; a clamped part is
        // an empty range at 0). Found by `fuzz/fuzz_targets/store_reader.rs`.
        let range = object.part_range(i);
        let (off, len) = (range.start, range.len());
        let at = RING_OFFSET as u64 + self.header.offset + HEADER_BYTES + off as u64;
        let map = match self.segment.private_file()?.view(at, len) {
            Ok(map) => map,
            // Out of mappings (`vm.max_map_count`, ~65k: a process holding that many
            // views) or of address space: this part is copied instead, like one below
            // the view threshold.
            Err(OsError::Os { source, .. }) if source.raw_os_error() == Some(libc::ENOMEM) => {
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Some(PartView {
            map,
            _pin: pin.clone(),
        }))
    }
}

/// A part of an object read through [`ObjectViews::kept_part`] (or
/// [`ObjectViews::kept_parts`]), as the caller may keep it beyond the read.
#[derive(Debug)]
pub enum KeptPart<'a> {
    /// A private copy-on-write mapping of the part: zero-copy, and the object's block
    /// is not reused while it (or another view of the same read) lives.
    View(PartView),
    /// The part's bytes in shared memory, to be copied before the read returns (they
    /// are valid only during the read): the part is below the view threshold, or it
    /// could not be viewed (a cleared object, pinning failed, or no mapping to be had,
    /// as [`ObjectViews::map`] says).
    Copy(&'a [u8]),
}

impl<'a> ObjectViews<'a> {
    /// Part `i` of `object` (the object being read) in the form the caller keeps it: a
    /// private view ([`KeptPart::View`]) if it is `view_from` bytes or more and
    /// [`ObjectViews::map`] maps it, else its bytes to copy ([`KeptPart::Copy`]). An
    /// error is `map`'s (mapping failed other than for want of memory).
    ///
    /// # Errors
    ///
    /// As [`map`](Self::map), for a part viewed.
    pub fn kept_part<'o>(
        &self,
        object: &ObjectFrame<'o>,
        i: usize,
        view_from: usize,
    ) -> Result<KeptPart<'o>> {
        let part = object.part(i);
        if part.len() >= view_from {
            if let Some(view) = self.map(object, i)? {
                return Ok(KeptPart::View(view));
            }
        }
        Ok(KeptPart::Copy(part))
    }

    /// [`ObjectViews::kept_part`] of each part of `object` after the first, in order
    /// (the first part — a serde's metadata — is the caller's to read in place during
    /// the read). Lazy: each part is mapped when the iterator reaches it.
    pub fn kept_parts<'s, 'o: 's>(
        &'s self,
        object: &'s ObjectFrame<'o>,
        view_from: usize,
    ) -> impl Iterator<Item = Result<KeptPart<'o>>> + 's {
        (1..object.len()).map(move |i| self.kept_part(object, i, view_from))
    }
}

/// Pin the block with id `id`: the writer's loans use this directly (no
/// check needed: the writer itself is what would free the block, and its frees probe
/// for pins); readers through [`pin_block`].
pub(super) fn pin_own(segment: &Arc<StoreSegment>, id: u32) -> Result<Arc<BlockPin>> {
    // The handshake with the writer's `is_pinned`: `shmq_protocol::read_count::PinHint`.
    segment.pin_hint().hold();
    let made_in = shmq_os::fork::generation();
    match segment.pins.pin(pin_byte(id)) {
        Ok(pin) => Ok(Arc::new(BlockPin {
            segment: segment.clone(),
            _pin: pin,
            made_in,
        })),
        Err(e) => {
            // No pin was taken, so nothing was done with the block under it.
            segment.pin_hint().release_unused();
            Err(e.into())
        }
    }
}

/// Pin the block of `h` if it holds a live object (not a cleared one, which the writer
/// reuses without looking for pins); `None` if it does not, or cannot be pinned.
pub(super) fn pin_block(segment: &Arc<StoreSegment>, h: &BlockHeader) -> Option<Arc<BlockPin>> {
    let pin = pin_own(segment, h.id).ok()?;
    // After the hold and the lock, where the writer's `is_pinned` cannot miss them
    // (`PinHint::confirm`): if the checks pass, the writer will see the pin before it
    // frees or clears the block; if the writer marked it first, they fail (and dropping
    // the pin undoes it).
    let live = segment.pin_hint().confirm(|| {
        segment.load_u32(h.offset) == h.id
            && segment
                .snapshot()
                .is_some_and(|s| id_in(h.id, s.id_start, s.id_end))
    });
    live.then_some(pin)
}

/// [`read_object`], and `f` may also map parts privately (through `views`) to keep
/// them beyond the call: the block then stays until the last of them is dropped.
///
/// # Errors
///
/// As [`read_object`]; and [`Error::Os`] when a part cannot be mapped.
pub fn read_object_viewed<R>(
    segment: &Arc<StoreSegment>,
    address: u64,
    id: u32,
    count: impl Into<CountRead>,
    f: impl FnOnce(&ObjectFrame<'_>, &ObjectViews<'_>) -> R,
) -> Result<R> {
    let count = count.into();
    segment.check_intact()?;
    let h = intact_first(segment, object_header(segment, address, id))?;
    let views = ObjectViews {
        segment,
        header: h,
        pin: std::cell::OnceCell::new(),
    };
    let r = read_header(segment, h, address, id, count, |object| f(object, &views));
    let r = intact_first(segment, r)?;
    if count != CountRead::No {
        segment.count_get();
    }
    Ok(r)
}

/// The reader count of the object at `(address, id)` (for inspection and tests).
///
/// # Errors
///
/// [`StoreError::StaleObject`] when `(address, id)` names no live object; [`Error::Os`]
/// when the segment was truncated.
pub fn object_reader_count(segment: &StoreSegment, address: u64, id: u32) -> Result<u32> {
    let h = intact_first(segment, object_header(segment, address, id))?;
    let (p, n) = segment.data_ptr(&h);
    // SAFETY: inside the ring (header_at), which `segment` keeps mapped; only the count
    // is read from it, atomically, whatever a peer writes there meanwhile.
    Ok(reader_count(unsafe { std::slice::from_raw_parts(p, n) }))
}
