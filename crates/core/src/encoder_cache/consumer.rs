//! The consumer side: [`Consumer`] (loads entries as private views and acknowledges
//! them) and its index-only form (`has` from any process, e.g. a scheduler).
//!
//! A consumer is given producer names. It opens each producer's segment when it can (a
//! producer that is not there yet is retried every [`RETRY_OPEN`], and at once by a load
//! of a key no open producer holds), joins it (a consumer
//! slot, see `slots`), and drops it as soon as its producer closes it or a restarted
//! producer of the same name supersedes it, so it never answers from a dead producer's
//! stale keys: the state word is checked on every call, and about once a second the
//! name is checked to still lead to the same segment (a segment removed by
//! `shmq cleanup` and made again).

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, OsError, Result};
use shmq_os::private_map::{PrivateFile, PrivateMap, SharedView};
use shmq_os::process::ProcessId;
use shmq_os::segment_file;

use super::entries::PartsLayout;
use super::layout::{Mapped, STATE_OPEN, segment_name};
use super::slots;
use shmq_protocol::key_index::{Key, Lookup};

/// How often a producer that could not be opened is tried again.
pub const RETRY_OPEN: Duration = Duration::from_millis(100);
/// How often an open producer's name is checked to still lead to its segment.
const RECHECK_NAME: Duration = Duration::from_secs(1);

/// A consumer's occupancy of a slot in one producer segment. Views hold it, so the slot
/// is given back only after the consumer and all its views are gone (its pins are zero
/// by then).
struct Membership {
    map: Arc<Mapped>,
    slot: usize,
    word: u64,
    /// The slot's role lock, held while joined (released after `leave`, on drop).
    _role: shmq_os::liveness::RoleLock,
}

impl Drop for Membership {
    fn drop(&mut self) {
        slots::leave(&self.map, self.slot, self.word);
    }
}

/// The lock byte an index-only link holds shared while it uses a segment (far past the
/// consumers' slot bytes and any file's end: a lock needs no byte to exist).
const VIEWER_BYTE: u64 = 1 << 40;

/// One producer segment this consumer uses.
struct Link {
    map: Arc<Mapped>,
    /// To map entries privately (loaders only).
    file: Option<Arc<PrivateFile>>,
    member: Option<Arc<Membership>>,
    /// An index's shared hold on the segment (a read lock): like a joined consumer's slot
    /// lock, it keeps a named cache whose producer crashed from being removed while the
    /// index still answers from it (see `Segment::survive_crash`).
    _viewer: Option<shmq_os::liveness::RoleLock>,
    inode: u64,
    recheck_at: Instant,
}

fn inode_of(segment: &str) -> Option<u64> {
    std::fs::metadata(segment_file::path(segment))
        .ok()
        .map(|m| m.ino())
}

impl Link {
    /// Open producer segment `segment`; join it if `join`.
    fn open(segment: &str, join: bool, me: ProcessId) -> Result<Link> {
        let inode = inode_of(segment).ok_or_else(|| {
            Error::Os(OsError::SegmentNotFound {
                name: segment.to_owned(),
            })
        })?;
        let map = Arc::new(Mapped::open(segment)?);
        // Acquire: pairs with the Release stores of CLOSED/SUPERSEDED.
        if map.header().state.get() != STATE_OPEN {
            return Err(Error::Os(OsError::SegmentNotFound {
                name: segment.to_owned(),
            }));
        }
        let file = if join {
            Some(Arc::new(PrivateFile::open(segment)?))
        } else {
            None
        };
        // The name may have been replaced between the two looks: then start over later.
        if inode_of(segment) != Some(inode) {
            return Err(Error::Os(OsError::SegmentNotFound {
                name: segment.to_owned(),
            }));
        }
        let member = if join {
            let (slot, word, role) = slots::join(&map, me)?;
            Some(Arc::new(Membership {
                map: map.clone(),
                slot,
                word,
                _role: role,
            }))
        } else {
            None
        };
        let viewer = if join {
            None
        } else {
            shmq_os::liveness::RoleLock::acquire_shared(segment, VIEWER_BYTE)?
        };
        Ok(Link {
            map,
            file,
            member,
            _viewer: viewer,
            inode,
            recheck_at: Instant::now() + RECHECK_NAME,
        })
    }

    /// Whether this segment still serves its name.
    fn is_current(&mut self, now: Instant, segment: &str) -> bool {
        // Acquire: pairs with the producer's Release store of CLOSED / SUPERSEDED.
        if self.map.header().state.get() != STATE_OPEN {
            // A truncated segment (read as zeros: see `shmq_os::sigbus`) stays, so that
            // loads report the truncation.
            return self.map.segment.check_intact().is_err();
        }
        if now >= self.recheck_at {
            self.recheck_at = now + RECHECK_NAME;
            return inode_of(segment) == Some(self.inode);
        }
        true
    }

    /// The entry and generation `key` names, if it is held and READY.
    fn find(&self, key: &Key) -> Option<(usize, u64)> {
        match self.map.index().lookup(key) {
            Lookup::Found { entry, generation } if (entry as usize) < self.map.geo.max_entries => {
                Some((entry as usize, generation))
            }
            _ => None,
        }
    }

    fn has(&self, key: &Key) -> bool {
        self.find(key).is_some_and(|(entry, generation)| {
            // Acquire (`EntryState::is_ready`), and the state leaves READY before the
            // bytes can go (see `entries`).
            self.map.entry(entry).state.is_ready(generation)
        })
    }

    /// This consumer's membership, joining again if our slot was taken from us (only if
    /// a producer thought us dead: different pid namespaces).
    fn member(&mut self, me: ProcessId) -> Result<Arc<Membership>> {
        let m = self.member.as_ref().ok_or_else(|| {
            Error::WrongRole("an index-only encoder cache reader cannot load entries".into())
        })?;
        if slots::holds(&self.map, m.slot, m.word) {
            return Ok(m.clone());
        }
        let (slot, word, role) = slots::join(&self.map, me)?;
        let m = Arc::new(Membership {
            map: self.map.clone(),
            slot,
            word,
            _role: role,
        });
        self.member = Some(m.clone());
        Ok(m)
    }

    /// Pin `key`'s entry for `member`; `None` if it is not held (then nothing is pinned).
    fn pin(&self, key: &Key, member: &Membership) -> Option<Pin> {
        let (entry, generation) = self.find(key)?;
        let pin = Pin {
            member_map: self.map.clone(),
            entry,
            slot: member.slot,
            word: member.word,
        };
        // The consumer's half of the pin handshake (`EntryPin::pin`): counted, then the
        // state checked; what it read of the record is visible if it is READY.
        if !self
            .map
            .pin(entry, member.slot)
            .pin(&self.map.entry(entry).state, generation)
        {
            return None; // `pin` drops: unpinned
        }
        Some(pin)
    }

    fn acknowledge(&self, entry: usize, member: &Membership) {
        // Release, kept with other slots' acks (`EntryAcks::ack`).
        self.map.entry(entry).acks.ack(member.slot);
        // Relaxed: a statistic.
        self.map.consumer(member.slot).loads.add(1);
        self.map.ring();
    }
}

/// One pin of one entry by one consumer slot, dropped with its view.
struct Pin {
    member_map: Arc<Mapped>,
    entry: usize,
    slot: usize,
    word: u64,
}

impl Drop for Pin {
    fn drop(&mut self) {
        let map = &self.member_map;
        // A slot reclaimed from us had its pins zeroed: leave the next occupant's alone.
        if slots::holds(map, self.slot, self.word) {
            // Release, saturating (`EntryPin::unpin`): our reads of the bytes happen
            // before the producer reuses them.
            map.pin(self.entry, self.slot).unpin();
        }
        map.ring();
    }
}

/// A loaded entry: a private (copy-on-write) mapping of its bytes, so every part is
/// writable and a write stays in this view. Holds the entry (it is not evicted, or its
/// bytes not reused, while the view lives).
pub struct EntryView {
    // Field order: the pin is dropped before the mapping goes (see Drop for Pin: the
    // producer may reuse the pages afterwards; we do not read them any more).
    pin: Pin,
    map: PrivateMap,
    parts: Vec<(usize, usize)>,
    /// The producer's segment, for [`shared`](EntryView::shared).
    file: Arc<PrivateFile>,
    _member: Arc<Membership>,
}

impl std::fmt::Debug for EntryView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntryView")
            .field("entry", &self.pin.entry)
            .field("parts", &self.parts)
            .finish()
    }
}

impl EntryView {
    /// How many parts the entry has.
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn n_parts(&self) -> usize {
        self.parts.len()
    }

    /// Part `i`'s bytes.
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn part(&self, i: usize) -> &[u8] {
        let (off, len) = self.parts[i];
        &self.map[off..off + len]
    }

    /// Part `i`'s bytes, writable (private to this view).
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn part_mut(&mut self, i: usize) -> &mut [u8] {
        let (off, len) = self.parts[i];
        &mut self.map[off..off + len]
    }

    /// Where part `i` is (for handing out as a buffer): pointer and length, inside this
    /// view's own mapping, valid while the view lives.
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn part_ptr(&self, i: usize) -> (*mut u8, usize) {
        let (off, len) = self.parts[i];
        // SAFETY: `off + len <= map.len()` (checked by `PartsLayout::read`).
        (unsafe { self.map.as_ptr().add(off) }, len)
    }

    /// This process's shared read-only mapping of the producer's segment (made once per
    /// producer, on the first call: `PrivateFile::shared`) and where part `i` lies in it:
    /// what a device copies from, while this view holds the entry.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the producer's segment cannot be mapped shared (no address space
    /// left), or was truncated.
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn part_shared(&self, i: usize) -> Result<(Arc<SharedView>, usize)> {
        let (off, _) = self.parts[i];
        Ok((self.file.shared()?, self.map.file_offset() as usize + off))
    }

    /// The entry's size in the cache (part table and parts).
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the entry holds no bytes.
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// An entry that [`Consumer::pin_held`] found and pinned.
struct Held<'a> {
    /// The producer's segment name.
    segment: &'a str,
    link: &'a mut Link,
    /// This consumer's membership in the producer's segment.
    member: Arc<Membership>,
    pin: Pin,
}

/// One producer name and what this consumer has of it.
struct Producer {
    segment: String,
    link: Option<Link>,
    retry_at: Instant,
}

/// Reads producers' caches: `has` for any key, and for a loader, `load` and
/// `acknowledge`.
pub struct Consumer {
    producers: Vec<Producer>,
    join: bool,
    me: ProcessId,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field(
                "producers",
                &self
                    .producers
                    .iter()
                    .map(|p| &p.segment)
                    .collect::<Vec<_>>(),
            )
            .field("loader", &self.join)
            .finish()
    }
}

impl Consumer {
    /// A consumer of the producers named `names`: it joins each (now, or when it
    /// appears) so that each waits for it to load what it publishes from then on.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for no names, or a name that cannot be a producer's;
    /// [`Error::Os`] when a producer's segment is there but cannot be opened or joined (not
    /// this user's, no consumer slot left).
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn new<S: AsRef<str>>(names: &[S]) -> Result<Consumer> {
        Self::with_role(names, true)
    }

    /// A reader of the producers' key indexes only (`has`): it joins nothing, so no
    /// producer waits for it.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), no slot taken.
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn index_only<S: AsRef<str>>(names: &[S]) -> Result<Consumer> {
        Self::with_role(names, false)
    }

    fn with_role<S: AsRef<str>>(names: &[S], join: bool) -> Result<Consumer> {
        if names.is_empty() {
            return Err(Error::InvalidArgument(
                "an encoder cache consumer needs at least one producer name".into(),
            ));
        }
        let now = Instant::now();
        let me = ProcessId::current();
        let mut producers = Vec::with_capacity(names.len());
        for n in names {
            let segment = segment_name(n.as_ref())?;
            let link = match Link::open(&segment, join, me) {
                Ok(l) => Some(l),
                Err(Error::Os(OsError::SegmentNotFound { .. }))
                | Err(Error::Os(OsError::BadSegment { .. })) => None,
                Err(e) => return Err(e),
            };
            producers.push(Producer {
                segment,
                link,
                retry_at: now + RETRY_OPEN,
            });
        }
        Ok(Consumer {
            producers,
            join,
            me,
        })
    }

    /// Drop producers that closed or were superseded; open those that appeared.
    fn refresh(&mut self) {
        let now = Instant::now();
        for p in &mut self.producers {
            if let Some(link) = &mut p.link {
                if !link.is_current(now, &p.segment) {
                    p.link = None;
                    p.retry_at = now;
                }
            }
            if p.link.is_none() && now >= p.retry_at {
                p.retry_at = now + RETRY_OPEN;
                match Link::open(&p.segment, self.join, self.me) {
                    Ok(l) => p.link = Some(l),
                    Err(Error::Os(OsError::SegmentNotFound { .. }))
                    | Err(Error::Os(OsError::BadSegment { .. })) => {}
                    Err(e) => warn_user!(
                        "shmq: cannot use encoder cache segment '{}' yet: {e}",
                        p.segment
                    ),
                }
            }
        }
    }

    /// Whether some producer holds `key` now (a key too long to be stored is never held).
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn has(&mut self, key: &str) -> bool {
        let Ok(key) = Key::new(key.as_bytes()) else {
            return false;
        };
        self.refresh();
        self.producers
            .iter()
            .any(|p| p.link.as_ref().is_some_and(|l| l.has(&key)))
    }

    /// Map `key`'s entry privately and acknowledge it; `None` if no producer holds it.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for an index-only consumer; [`Error::Os`] when the entry cannot
    /// be mapped, or its producer's segment was truncated or holds a corrupt part table.
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn load(&mut self, key: &str) -> Result<Option<EntryView>> {
        let Some(Held {
            segment,
            link,
            member,
            pin,
        }) = self.pin_held(key)?
        else {
            return Ok(None);
        };
        let rec = link.map.entry(pin.entry);
        // Relaxed: ordered after the Release store of READY by the SeqCst state load in
        // `pin`; stable while pinned (the producer does not reuse a pinned entry).
        let (offset, len) = (rec.offset.get(), rec.len.get());
        let geo = &link.map.geo;
        if offset
            .checked_add(len)
            .is_none_or(|end| end > geo.capacity as u64)
        {
            return Err(Error::Os(OsError::BadSegment {
                name: segment.to_owned(),
                reason: format!("an entry lies outside the data region ({offset}+{len})"),
            }));
        }
        let file = link.file.as_ref().expect("loaders open the file");
        let map = file.view(geo.data_offset as u64 + offset, len as usize)?;
        let parts = PartsLayout::read(&map).map_err(|e| match e {
            Error::Os(OsError::BadSegment { reason, .. }) => Error::Os(OsError::BadSegment {
                name: segment.to_owned(),
                reason,
            }),
            e => e,
        })?;
        link.acknowledge(pin.entry, &member);
        Ok(Some(EntryView {
            pin,
            map,
            parts,
            file: file.clone(),
            _member: member,
        }))
    }

    /// Acknowledge `key` without mapping it (a consumer that has the value already, or
    /// does not need it, so that the producer may evict it). Whether it was held.
    ///
    /// # Errors
    ///
    /// [`Error::WrongRole`] for an index-only consumer; [`Error::Os`] when the producer's
    /// segment was truncated.
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn acknowledge(&mut self, key: &str) -> Result<bool> {
        let Some(Held {
            link, member, pin, ..
        }) = self.pin_held(key)?
        else {
            return Ok(false);
        };
        link.acknowledge(pin.entry, &member);
        Ok(true)
    }

    /// For `load` and `acknowledge`: the first producer that holds `key`, with the entry
    /// pinned for this consumer; `None` if no producer holds it.
    fn pin_held(&mut self, key: &str) -> Result<Option<Held<'_>>> {
        self.check_loader()?;
        let Ok(key) = Key::new(key.as_bytes()) else {
            return Ok(None);
        };
        self.refresh();
        // A load names keys someone saw held (a scheduler's `has`): if no open producer
        // has this one, a producer not opened yet may (it appeared since the last try,
        // less than `RETRY_OPEN` ago): try those now rather than answer "missing".
        // (Looked up first only when some producer is not open: the usual load, with every
        // producer open, finds the key once, below.)
        let unopened = self.producers.iter().any(|p| p.link.is_none());
        if unopened
            && !self
                .producers
                .iter()
                .any(|p| p.link.as_ref().is_some_and(|l| l.find(&key).is_some()))
        {
            let now = Instant::now();
            for p in &mut self.producers {
                if p.link.is_none() {
                    p.retry_at = now;
                }
            }
            self.refresh();
        }
        let me = self.me;
        for p in &mut self.producers {
            let Some(link) = &mut p.link else {
                continue;
            };
            let member = link.member(me)?;
            let pin = link.pin(&key, &member);
            // What this producer's segment answered may be zeros (a peer truncated it).
            link.map.segment.check_intact()?;
            if let Some(pin) = pin {
                return Ok(Some(Held {
                    segment: &p.segment,
                    link,
                    member,
                    pin,
                }));
            }
        }
        Ok(None)
    }

    fn check_loader(&self) -> Result<()> {
        if self.join {
            Ok(())
        } else {
            Err(Error::WrongRole(
                "an index-only encoder cache reader cannot load entries".into(),
            ))
        }
    }

    /// The producer names given, and whether each is open now.
    ///
    /// # Examples
    ///
    /// See [`Producer`'s example](super::Producer).
    pub fn producers(&mut self) -> Vec<(String, bool)> {
        self.refresh();
        self.producers
            .iter()
            .map(|p| (p.segment.clone(), p.link.is_some()))
            .collect()
    }
}
