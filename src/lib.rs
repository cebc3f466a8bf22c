//! shmq: shared-memory IPC for model-serving engines.
//!
//! # Crates, lowest first
//! The layers are crates of one cargo workspace, so an upward import does not compile;
//! this crate is the one a Rust user depends on, and re-exports them all:
//! - `shmq-protocol` (`crates/protocol`): the cross-process protocols on atomics — the
//!   ring's chunk flags, the doorbell's sleep/wake handshake, the store's and the key
//!   index's seqlocks, the FIFO allocator ([`alloc`]) and the futex; what loom
//!   model-checks (`crates/protocol/tests/loom.rs`);
//! - `shmq-os` (`crates/os`): the operating-system layer — named segments and their
//!   header check, liveness of peers (role locks, pidfds), processes, the `SIGBUS` of a
//!   truncating peer, the mapping budget, private copy-on-write views, store pins, fork
//!   safety — with its errors ([`error::OsError`]) and the warnings' hook ([`warning`],
//!   [`copy`], [`liveness`], [`process`], [`private_map`]);
//! - `shmq-core` (`crates/core`): the queue ([`broadcast`]), the store ([`storage`]), the
//!   arena ([`arena`]), the encoder cache ([`encoder_cache`]), the remote stream
//!   ([`remote`]) and its relay ([`relay`]), waits ([`wait`]), the MAC ([`auth`]),
//!   cleanup ([`admin`]); and the error type ([`Error`], in [`error`]): its own variants,
//!   and one per layer or module with errors of its own, each defined beside what raises
//!   it (the operating-system layer's, the queue's, the store's, the encoder cache's, the
//!   remote stream's), which `?` converts into;
//! - `shmq-workers` (`crates/workers`): worker supervision ([`workers`]), with its own
//!   error ([`workers::Error`]) that wraps the core's;
//! - `shmq-python` (`bindings/python`): the PyO3 binding, module `shmq._core`; it sees
//!   only this crate's public API. No crate a Rust user builds depends on pyo3, and this
//!   crate has no cargo features.
//!
//! # Building: libzmq
//! The `zmq` crate compiles libzmq from its C++ source (most of a first build). The
//! repository's `.cargo/config.toml` adds libzmq's Linux build flags (eventfd,
//! `SOCK_CLOEXEC`, `accept4`), which cargo does not apply to a project that depends on
//! this crate: put the same `[env]` lines in your own `.cargo/config.toml`, or link a
//! system libzmq (built with them, and no C++ to compile):
//! `[target.x86_64-unknown-linux-gnu.zmq] rustc-link-lib = ["zmq"]` there, after
//! `apt-get install libzmq3-dev`. `docs/guide.md` ("Building libzmq") has the details.
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

pub use shmq_core::*;
// Inlined, so that `cargo doc -p shmq` has pages for `shmq::workers` (a re-exported crate
// is otherwise only a line under "Re-exports", linking to a crate with no pages there).
#[doc(inline)]
pub use shmq_workers as workers;

/// The crate's README (`README.crate.md`, what a registry shows): its Rust examples run as
/// doc tests, so that they compile and work as written.
#[cfg(doctest)]
#[doc = include_str!("../README.crate.md")]
pub struct ReadmeDoctests;
