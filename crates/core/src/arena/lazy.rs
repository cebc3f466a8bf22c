//! [`LazyArenaWriter`]: a queue's arena, named when the queue is made and created
//! when first needed (see the `arena` module docs: Made at first use).

use super::layout::Geometry;
use super::{ArenaWriter, RESERVE_RETRY, page_size};
use crate::error::Result;
use shmq_os::segment::unique_name;

/// A queue's arena, named now and made when first needed (see the `arena` module
/// docs): the writer's handle on it whether or not the segment exists yet.
///
/// # Examples
///
/// A queue's writer holds one ([`Writer::arena_mut`](crate::Writer::arena_mut)); on its
/// own:
///
/// ```
/// use shmq_core::arena::LazyArenaWriter;
///
/// // For a queue of one reader whose ring is `shmq_ring_example`: 1 MiB, 8 leases.
/// let mut arena = LazyArenaWriter::new("shmq_ring_example", 1, 1 << 20, 8)?;
/// assert!(arena.get().is_none()); // no segment yet
/// assert_eq!(arena.capacity(), 1 << 20);
/// arena.make()?.reserve(4096)?; // made now, its first page taken in /dev/shm
/// assert!(arena.get().is_some() && arena.reserved() >= 4096);
/// assert_eq!((arena.outstanding(), arena.fallbacks()), (0, 0));
/// # Ok::<(), shmq_core::Error>(())
/// ```
#[derive(Debug)]
pub struct LazyArenaWriter {
    name: String,
    queue: String,
    n_reader: usize,
    capacity: usize,
    max_leases: usize,
    made: Option<ArenaWriter>,
    /// When making it last failed (say, `/dev/shm` full): tried again only after
    /// [`RESERVE_RETRY`], not on every part.
    failed_at: Option<std::time::Instant>,
    /// Parts sent by copy before the arena could be made.
    fallbacks: u64,
}

impl LazyArenaWriter {
    /// Name an arena for the queue whose ring is `queue` (checking its parameters now);
    /// nothing is created yet.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a capacity or lease
    /// count out of range (0, or too large for a segment).
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn new(
        queue: &str,
        n_reader: usize,
        capacity: usize,
        max_leases: usize,
    ) -> Result<LazyArenaWriter> {
        let geo = Geometry::new(n_reader, capacity, max_leases, page_size())?;
        Ok(LazyArenaWriter {
            name: unique_name("arena"),
            queue: queue.to_owned(),
            n_reader,
            capacity: geo.capacity,
            max_leases,
            made: None,
            failed_at: None,
            fallbacks: 0,
        })
    }

    /// The segment's name (whether or not it exists yet).
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Bytes of the data region.
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// The arena, if it has been made.
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn get(&self) -> Option<&ArenaWriter> {
        self.made.as_ref()
    }
    /// The arena, if it has been made.
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn get_mut(&mut self) -> Option<&mut ArenaWriter> {
        self.made.as_mut()
    }

    /// The arena, made now if it is not yet; the error if it cannot be made.
    ///
    /// # Errors
    ///
    /// [`Error::Os`](crate::Error::Os) when the arena's segment cannot be made (no room in
    /// `/dev/shm`, the name taken).
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn make(&mut self) -> Result<&mut ArenaWriter> {
        if self.made.is_none() {
            let a = ArenaWriter::create_named(
                &self.name,
                &self.queue,
                self.n_reader,
                self.capacity,
                self.max_leases,
            )?;
            self.failed_at = None;
            self.made = Some(a);
        }
        Ok(self.made.as_mut().expect("made above"))
    }

    /// The arena for a part that needs it: made now if it is not yet, `None` (logged
    /// once, tried again after a while) if it cannot be made.
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn for_part(&mut self) -> Option<&mut ArenaWriter> {
        if self.made.is_none() {
            if self.failed_at.is_some_and(|t| t.elapsed() < RESERVE_RETRY) {
                return None;
            }
            if let Err(e) = self.make() {
                if self.failed_at.is_none() {
                    warn_user!(
                        "shmq: cannot make tensor arena {} ({e}); large parts are copied \
                         through the queue instead until there is room",
                        self.name
                    );
                }
                self.failed_at = Some(std::time::Instant::now());
                return None;
            }
        }
        self.made.as_mut()
    }

    /// Count one part sent by copy (the arena had no room, or could not be made).
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn count_fallback(&mut self) {
        match self.made.as_mut() {
            Some(a) => a.count_fallback(),
            None => self.fallbacks += 1,
        }
    }

    /// Parts sent the ordinary way because the arena had no room (or could not be made).
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks + self.made.as_ref().map_or(0, |a| a.fallbacks())
    }
    /// Leases handed out and not yet returned (0 before the arena is made).
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn outstanding(&self) -> usize {
        self.made.as_ref().map_or(0, |a| a.outstanding())
    }
    /// Bytes of the data region reserved in `/dev/shm` so far.
    ///
    /// # Examples
    ///
    /// See [the type's example](LazyArenaWriter).
    pub fn reserved(&self) -> usize {
        self.made.as_ref().map_or(0, |a| a.reserved())
    }
}
