//! [`QueueOptions`]: how a writer is made (sizes, readers, waits, the tensor arena).

use crate::arena;
use crate::remote::RemoteOptions;
use crate::wait::WaitPolicy;

use super::super::ring::DeadReaderPolicy;

/// How a writer is made. `Default` gives the engines' defaults: 10 chunks of 10 MiB.
///
/// It is `#[non_exhaustive]` (later versions may add options), so outside this crate it
/// is not built with a struct literal: start from [`QueueOptions::local`] or
/// `QueueOptions::default()` and set the fields you need.
///
/// ```
/// # use shmq_core as shmq; // what the `shmq` crate re-exports
/// let mut opts = shmq::QueueOptions::local(2); // two readers, both on this machine
/// opts.max_chunk_bytes = 64 * 1024;
/// opts.max_chunks = 4;
/// # let _ = opts;
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct QueueOptions {
    /// All readers, local and remote.
    pub n_reader: usize,
    /// Readers on this machine (they read through shared memory).
    pub n_local_reader: usize,
    /// The ranks of the local readers; `None` means `0..n_local_reader`.
    pub local_reader_ranks: Option<Vec<usize>>,
    pub max_chunk_bytes: usize,
    pub max_chunks: usize,
    /// The IP remote readers connect to (default: this host's address, see
    /// [`default_connect_ip`](crate::default_connect_ip)). Only used when there are remote readers.
    pub connect_ip: Option<String>,
    /// How the writer waits for room (spin, yield, then sleep); `None`: the default for
    /// this many processes ([`WaitPolicy::for_processes`]).
    pub wait: Option<WaitPolicy>,
    /// What the writer does when a local reader it waits for has died.
    pub on_dead_reader: DeadReaderPolicy,
    /// Bytes of the tensor arena beside the ring (virtual: reserved as used); 0 for none.
    /// Parts of at least `arena_threshold` bytes go there (see [`crate::arena`]).
    pub arena_bytes: usize,
    /// Smallest message part that goes to the arena instead of being copied inline.
    pub arena_threshold: usize,
    /// How the remote stream is bounded (messages queued per remote reader, and what to
    /// do with one that does not keep up).
    pub remote: RemoteOptions,
    /// A name for the queue (1 to 63 bytes, no control characters), shown by `python -m
    /// shmq inspect` and `top` and in the metrics' `queue` label beside the segment's
    /// own name (`shmq_ring_<pid>_<hex>`). Kept in the ring: only a queue with local
    /// readers has one to show.
    pub name: Option<String>,
    /// Hold [`name`](Self::name) as this user's name for the queue on this machine, for as
    /// long as the writer lives (released when it is closed or dropped, or its process
    /// ends however it ends): readers that know only the name open it with
    /// [`Reader::open_by_name`](super::Reader::open_by_name), Python's
    /// `MessageQueue.open(name, rank)` included. [`Writer::new`](super::Writer::new)
    /// fails with [`NameError::Taken`](crate::names::NameError::Taken) while another live
    /// writer (of either language) holds the name; a dead writer's name is taken over.
    /// Needs a `name`. See [`crate::names`].
    pub record_name: bool,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            n_reader: 1,
            n_local_reader: 1,
            local_reader_ranks: None,
            max_chunk_bytes: 10 * 1024 * 1024,
            max_chunks: 10,
            connect_ip: None,
            wait: None,
            on_dead_reader: DeadReaderPolicy::Raise,
            arena_bytes: arena::default_capacity(),
            arena_threshold: arena::default_threshold(),
            remote: RemoteOptions::default(),
            name: None,
            record_name: false,
        }
    }
}

impl QueueOptions {
    /// `n_reader` readers, all on this machine.
    pub fn local(n_reader: usize) -> Self {
        QueueOptions {
            n_reader,
            n_local_reader: n_reader,
            ..Default::default()
        }
    }
}
