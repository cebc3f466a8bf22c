//! shmq: shared-memory IPC for model-serving engines.
//!
//! # Crates, lowest first
//! The layers are crates of one cargo workspace, so an upward import does not compile:
//! - `shmq-protocol` (`crates/protocol`): the cross-process protocols on atomics — the
//!   ring's chunk flags, the doorbell's sleep/wake handshake, the store's and the key
//!   index's seqlocks, the FIFO allocator (re-exported here as [`alloc`]) and the futex;
//!   what loom model-checks (`crates/protocol/tests/loom.rs`);
//! - `shmq-os` (`crates/os`): the operating-system layer — named segments and their
//!   header check, liveness of peers (role locks, pidfds), processes, the `SIGBUS` of a
//!   truncating peer, the mapping budget, private copy-on-write views, store pins, fork
//!   safety — and the one error type ([`Error`]) with the warnings' hook. Its public
//!   modules are this crate's too ([`error`], [`warning`], [`copy`], [`liveness`],
//!   [`process`], [`private_map`]);
//! - `shmq` (this crate): the queue, the store, the arena, the encoder cache, the remote
//!   stream and its relay, workers; no Python;
//! - `shmq-python` (`bindings/python`): the PyO3 binding, module `shmq._core`; it sees
//!   only this crate's public API.
//!
//! # Modules, lowest first
//! Within this crate, each module uses only the modules listed before it: no arrow
//! points up, so there is no circle (`tests/layering.rs` checks the source against this
//! list, which names every module of `src/` once). Public modules are links; the others
//! are internal.
//! - [`wait`]: how blocked writers and readers wait (spin, yield, then sleep), and the
//!   terms a caller sets ([`wait::WaitSpec`]: timeout, hook, quiet, and the clock of a wait
//!   started over);
//! - [`auth`]: the keyed MAC that proves a secret (remote stream, worker handshake), and
//!   a secret's one text form;
//! - `transport`: ZeroMQ, for local readers' oversized messages;
//! - [`remote`]: the authenticated stream to remote readers (and its bounds);
//! - [`storage`]: the object store, on the FIFO allocator;
//! - [`arena`]: the tensor arena (large message parts read as private views, and
//!   [`Loan`]s to fill in place);
//! - [`broadcast`]: the broadcast ring and the queue ([`Writer`], [`Reader`]) built on it;
//! - [`relay`]: one copy of a remote stream per node: a remote reader that writes every
//!   message, whole, into a queue of its own for the readers on its machine;
//! - [`encoder_cache`]: the encoder-cache hand-off: a producer's entries by key to every
//!   consumer process as private views, with a key index any process can ask;
//! - [`admin`]: finding, describing and removing segments (cleanup after crashes);
//! - [`workers`]: worker processes with a ready pipe, a death watch and shutdown of whole
//!   process trees (the one supervision: the Python package's `WorkerProcesses` hands
//!   it the interpreters it starts), and a worker's end with its parent;
//! - `fuzzing` (hidden): entry points for the fuzz targets in `fuzz/`, not API.
//!
//! # Glossary: shmq's names and the engines' (vLLM's) names
//! | shmq (Rust) | the engines (Python; shmq keeps these names in `shmq`) |
//! |---|---|
//! | [`Writer`], [`Reader`] | `MessageQueue` (writer and reader sides) |
//! | [`Handle`] | `Handle` |
//! | [`broadcast::ring::Ring`]: the broadcast ring; its *chunks* hold one message each | `ShmRingBuffer` |
//! | [`broadcast::ring::ChunkInfo`]: a chunk a reader found; `ChunkState`: its flags | a chunk's "metadata" (written flag, read flags) |
//! | *chunk*: only the broadcast ring's fixed-size message slot ([`broadcast::ring::Ring`]) | a chunk in either ring |
//! | *block*: one variable-size allocation in the store's ring | a chunk of `SingleWriterShmRingBuffer` |
//! | [`storage::BlockFifo`]: the store's ring of variable-size blocks | `SingleWriterShmRingBuffer` |
//! | [`alloc::Block`]: one block in it | a chunk (`[id][size][data]`) |
//! | [`storage::ObjectStore`] | `SingleWriterShmObjectStorage` |
//! | [`storage::ObjectFrame`]: an object in its block (count word, part table, parts) | (none: one pickled blob) |
//! | the *count word* of an object's block: how often it was read (with a tag of its id) | the chunk's flag bytes (reader count) |
//! | [`storage::Entry`]'s `handouts`: how often the writer handed the object out | `writer_flag` (`increment_writer_flag`) |
//! | a *view*: zero-copy memory of a segment ([`storage::PartView`], [`ArenaView`], Python's `ShmView`) | a `memoryview` of the buffer |
//! | [`arena::ArenaWriter`], [`arena::ArenaReader`]: leases with per-reader holds | `ShmTensorArena` (slots) |
//! | [`Loan`] | (none: memory lent to fill in place and send without a copy) |
//! | doorbell (`DoorbellWords` + `Doorbell`) | (none: the engines poll; shmq sleeps on a futex) |
//! | [`workers::Workers`] | `CoreEngineProcManager` and its helpers (Python: `WorkerProcesses`) |
//! | [`workers::WorkerStatus`], [`workers::WorkerDeath`] | (Python: `WorkerInfo`, `WorkerDiedError`) |
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

// `warn_user!`: report a warning to the user (see [`warning`]), from the layer below.
#[macro_use]
extern crate shmq_os;

// The cross-process protocols are the crate below this one (`shmq-protocol`, which
// loom model-checks); the object store's allocator is public API here too.
pub use shmq_protocol::alloc;

// The operating-system layer below this crate (`shmq-os`): its public modules are part
// of this crate's API, at the same paths as before the split.
pub use shmq_os::{copy, error, liveness, private_map, process, warning};

pub mod admin;
pub mod arena;
pub mod auth;
pub mod broadcast;
pub mod encoder_cache;
#[doc(hidden)]
pub mod fuzzing;
pub mod relay;
pub mod remote;
pub mod storage;
pub mod wait;
pub mod workers;

pub use arena::{ArenaView, Loan};
pub use broadcast::{
    Array, ArrayMeta, ArrayRef, Dtype, Element, Handle, OwnedPart, QueueOptions, Reader, Writer,
};
pub use error::{Error, Result};
pub use transport::default_connect_ip;
pub use warning::set_warning_hook;

// Internals.
pub(crate) mod transport;
