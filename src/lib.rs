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
//! Internals, under those: `segment` (named POSIX shared memory, and the header check
//! every kind of segment makes), `range_alloc` (the whole-page allocator of the arena's and
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

#[cfg(not(loom))]
pub mod admin;
pub mod alloc;
#[cfg(not(loom))]
pub mod arena;
pub mod broadcast;
#[cfg(not(loom))]
pub mod copy;
pub mod encoder_cache;
pub mod error;
#[cfg(not(loom))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(not(loom))]
pub mod process;
#[cfg(not(loom))]
pub mod storage;
#[cfg(not(loom))]
pub mod wait;
#[cfg(not(loom))]
pub mod workers;

// Internals. The loom model checks (tests/loom.rs) drive the doorbell, the store's
// seqlock and the atomics directly, so a loom build makes those public.
#[cfg(loom)]
pub mod doorbell;
#[cfg(not(loom))]
pub(crate) mod doorbell;
#[cfg(not(loom))]
pub(crate) mod fork;
#[cfg(not(loom))]
pub(crate) mod futex;
#[cfg(not(loom))]
pub mod liveness;
#[cfg(not(loom))]
pub(crate) mod pins;
#[cfg(not(loom))]
pub(crate) mod private_map;
#[cfg(not(loom))]
pub(crate) mod random;
#[cfg(not(loom))]
pub(crate) mod range_alloc;
#[cfg(not(loom))]
pub mod remote;
#[cfg(not(loom))]
pub(crate) mod segment;
#[cfg(loom)]
pub mod seqlock;
#[cfg(not(loom))]
pub(crate) mod seqlock;
#[cfg(loom)]
pub mod sync;
#[cfg(not(loom))]
pub(crate) mod sync;
#[cfg(not(loom))]
pub(crate) mod transport;

#[cfg(all(feature = "python", not(loom)))]
mod python;

#[cfg(not(loom))]
pub use arena::{ArenaView, Loan};
#[cfg(not(loom))]
pub use broadcast::{Handle, OwnedPart, QueueOptions, Reader, Writer};
pub use error::{Error, Result};
#[cfg(not(loom))]
pub use transport::default_connect_ip;
