//! shmq: shared-memory IPC for model-serving engines.
//!
//! # The API, by what it does (each module uses only the ones listed before it)
//! - [`error`]: the one error type ([`Error`], one variant per shape of failure);
//! - [`process`]: naming a process by pid and start time;
//! - [`liveness`]: telling a live peer from a dead one by the role locks it holds (also
//!   across pid namespaces): alive, dead, or unknown;
//! - [`wait`]: how blocked writers and readers wait (spin, yield, then sleep), and the
//!   terms a caller sets ([`wait::WaitSpec`]: timeout, hook, quiet);
//! - [`alloc`], [`storage`]: the object store's FIFO allocator and the store on it;
//! - [`copy`], [`arena`]: large copies into shared memory; the tensor arena (large
//!   message parts read as private views, and [`Loan`]s to fill in place);
//! - [`remote`]: the authenticated stream to remote readers (and its bounds);
//! - [`broadcast`]: the broadcast ring and the queue ([`Writer`], [`Reader`]) built on it;
//! - [`encoder_cache`]: the encoder-cache hand-off: a producer's entries by key to every
//!   consumer process as private views, with a key index any process can ask;
//! - [`admin`]: finding, describing and removing segments (cleanup after crashes);
//! - [`workers`]: worker processes with a ready pipe, a death watch and shutdown of whole
//!   process trees (the Rust side of the Python package's `WorkerProcesses`);
//! - `python` (feature `python`): the PyO3 bindings, module `shmq._core`.
//!
//! Internals, under those: `sigbus` (a peer that truncates a mapped segment: the `SIGBUS`
//! handler that turns the fault into zero pages and an error, and what shmq guarantees
//! against the same user's processes), `segment` (named POSIX shared memory, and the
//! header check every kind of segment makes), `range_alloc` (the whole-page allocator of the arena's and
//! the encoder cache's data regions), `fork` (what a forked child must not do with what it
//! inherited), `random` (secrets and nonces from the kernel), `sync` / `futex` / `doorbell` / `seqlock`
//! (loom-swappable atomics, the process-shared futex, the sleep/wake handshake, the object
//! store's seqlock), `private_map` (private copy-on-write views), `pins` (a process's views holding store
//! chunks: file locks the writer checks before it frees), `transport` (ZeroMQ, for
//! local readers' oversized messages).
//!
//! # Glossary: shmq's names and the engines' (vLLM's) names
//! | shmq (Rust) | the engines (Python; shmq keeps these names in `shmq`) |
//! |---|---|
//! | [`Writer`], [`Reader`] | `MessageQueue` (writer and reader sides) |
//! | [`Handle`] | `Handle` |
//! | [`broadcast::ring::Ring`]: the broadcast ring; its *chunks* hold one message each | `ShmRingBuffer` |
//! | [`broadcast::ring::ChunkInfo`]: a chunk a reader found; `ChunkState`: its flags | a chunk's "metadata" (written flag, read flags) |
//! | [`storage::ChunkFifo`]: the store's ring of variable-size chunks | `SingleWriterShmRingBuffer` |
//! | [`alloc::Chunk`]: one allocation in it | a chunk (`[id][size][data]`) |
//! | [`storage::ObjectStore`] | `SingleWriterShmObjectStorage` |
//! | [`arena::ArenaWriter`], [`arena::ArenaReader`]: leases with per-reader holds | `ShmTensorArena` (slots) |
//! | [`Loan`] | (none: memory lent to fill in place and send without a copy) |
//! | doorbell (`DoorbellWords` + `Doorbell`) | (none: the engines poll; shmq sleeps on a futex) |
//! | [`workers::Workers`] | `CoreEngineProcManager` and its helpers |
//! | `current_idx` | `current_idx` |
//!
//! ```no_run
//! use shmq::{QueueOptions, Reader, Writer};
//! let mut writer = Writer::new(QueueOptions::local(1))?;
//! let handle = writer.handle().to_string(); // send this to the reader process
//! // in the reader process:
//! let mut reader = Reader::open(&handle.parse()?, 0)?;
//! # std::thread::spawn(move || { reader.wait_until_ready(None).unwrap(); reader.dequeue(None).unwrap(); });
//! writer.wait_until_ready(None)?;
//! writer.enqueue(b"step 1", None)?;
//! # Ok::<(), shmq::Error>(())
//! ```
#![deny(clippy::undocumented_unsafe_blocks)]

/// Declares its items only outside loom builds. The loom model checks (`tests/loom.rs`)
/// compile the protocols' atomics alone (`sync`, `doorbell`, `seqlock`, and the parts of
/// `alloc`, `broadcast` and `encoder_cache` they drive, which switch themselves), so
/// everything else is switched off here, in one place.
macro_rules! not_loom {
    ($($item:item)*) => { $( #[cfg(not(loom))] $item )* };
}

/// Internals that the loom model checks drive directly: public in a loom build, crate-only
/// otherwise.
macro_rules! public_under_loom {
    ($($name:ident)*) => {
        $(
            #[cfg(loom)]
            pub mod $name;
            #[cfg(not(loom))]
            pub(crate) mod $name;
        )*
    };
}

pub mod alloc;
pub mod broadcast;
pub mod encoder_cache;
pub mod error;
pub use error::{Error, Result};

// Internals the loom model checks drive.
public_under_loom! { doorbell seqlock sync }

not_loom! {
    pub mod admin;
    pub mod arena;
    pub mod copy;
    #[doc(hidden)]
    pub mod fuzzing;
    pub mod process;
    pub mod storage;
    pub mod wait;
    pub mod workers;

    pub use arena::{ArenaView, Loan};
    pub use broadcast::{Handle, OwnedPart, QueueOptions, Reader, Writer};
    pub use transport::default_connect_ip;

    // Internals.
    pub(crate) mod fork;
    pub(crate) mod futex;
    pub mod liveness;
    pub(crate) mod pins;
    pub(crate) mod private_map;
    pub(crate) mod random;
    pub(crate) mod range_alloc;
    pub mod remote;
    pub(crate) mod segment;
    pub(crate) mod sigbus;
    pub(crate) mod transport;

    #[cfg(feature = "python")]
    mod python;
}
