//! [`Reservation`]: an entry being written (WRITING), then published (READY and in the
//! key index), or abandoned.

use std::sync::Arc;

use super::{Inner, State, lock};
use crate::encoder_cache::entries::{self, PartsLayout, WRITING};
use crate::error::{Error, Result};
use shmq_protocol::key_index::Key;

impl Inner {
    pub(super) fn start_writing(
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
        // No consumer looks at a WRITING entry (the index does not name it yet).
        this.map
            .entry(entry as usize)
            .state
            .begin_writing(generation);
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

    /// Publish reservation `r`'s entry: READY, then into the index.
    fn publish(&self, entry: u32, generation: u64, total: usize) -> Result<bool> {
        let mut st = lock(&self.state);
        // The bytes may have been copied into the zero pages of a truncated segment.
        if let Err(e) = self.map.segment.check_intact() {
            self.abandon_locked(&mut st, entry);
            return Err(e.into());
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
        rec.offset.set(offset as u64);
        rec.len.set(total as u64);
        rec.acks.clear();
        // SeqCst read-modify-write: see `slots` (late joiners).
        let published_at = shmq_protocol::consumer_slot::tick(&self.map.header().clock);
        rec.published_at.set(published_at);
        // Release (`EntryState::publish`): a consumer that sees READY sees the bytes,
        // offset and length.
        rec.state.publish(generation);
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
        // Only this process stores the word (`EntryState::own`).
        if st.entries[entry as usize].generation == generation
            && entries::state_of(self.map.entry(entry as usize).state.own()) == WRITING
        {
            self.abandon_locked(&mut st, entry);
        }
    }
}

/// Room for one entry, reserved by [`Producer::reserve`](super::Producer::reserve): fill
/// its parts, then [`publish`](Self::publish). Dropped unpublished, the room is given
/// back.
pub struct Reservation {
    inner: Arc<Inner>,
    entry: u32,
    generation: u64,
    ptr: *mut u8,
    /// Bytes reserved (whole pages).
    len: usize,
    pub(super) layout: PartsLayout,
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
    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
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
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the segment was truncated while the entry was written (the entry
    /// is dropped).
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
