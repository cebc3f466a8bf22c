//! shmq: shared-memory IPC for model-serving engines.
//!
//! The crate is layered; each module uses only the ones listed before it:
//! - [`error`]: the one error type;
//! - [`segment`]: named POSIX shared-memory segments;
//! - [`sync`], [`futex`], [`doorbell`]: the atomics (swappable for loom), the
//!   process-shared futex and the sleep/wake handshake built on them;
//! - [`process`]: naming a process by pid and start time, to tell whether it is alive;
//! - [`private_map`]: private copy-on-write views of a segment (what readers hand out);
//! - [`wait`]: how blocked writers and readers wait (spin, yield, then sleep);
//! - [`transport`]: ZeroMQ publish/subscribe sockets and the ready handshake;
//! - [`alloc`], [`storage`]: the object store's FIFO allocator and the store on it;
//! - [`arena`]: the tensor arena: large message parts in shared memory, read as private
//!   views, and loans to fill in place;
//! - [`broadcast`]: the broadcast ring and the queue ([`Writer`], [`Reader`]) built on it;
//! - [`encoder_cache`]: the encoder-cache hand-off: a producer's entries by key to every
//!   consumer process as private views, with a key index any process can ask;
//! - [`admin`]: finding, describing and removing segments (cleanup after crashes);
//! - `python` (feature `python`): the PyO3 bindings, module `shmq._core`.
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
pub mod doorbell;
pub mod encoder_cache;
pub mod error;
#[cfg(not(loom))]
pub mod futex;
#[cfg(not(loom))]
pub mod private_map;
#[cfg(not(loom))]
pub mod process;
#[cfg(not(loom))]
pub mod segment;
#[cfg(not(loom))]
pub mod storage;
pub mod sync;
#[cfg(not(loom))]
pub mod transport;
#[cfg(not(loom))]
pub mod wait;

#[cfg(all(feature = "python", not(loom)))]
mod python;

#[cfg(not(loom))]
pub use arena::{ArenaView, Loan};
#[cfg(not(loom))]
pub use broadcast::{Handle, OwnedPart, QueueOptions, Reader, Writer};
pub use error::{Error, Result};
