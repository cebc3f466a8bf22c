//! shmq: shared-memory IPC for model-serving engines.
//!
//! The crate is layered; each module uses only the ones listed before it:
//! - [`error`]: the one error type;
//! - [`segment`]: named POSIX shared-memory segments;
//! - [`wait`]: how blocked writers and readers wait (spin, then yield);
//! - [`transport`]: ZeroMQ publish/subscribe sockets and the ready handshake;
//! - [`broadcast`]: the broadcast ring and the queue ([`Writer`], [`Reader`]) built on it;
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

pub mod alloc;
pub mod broadcast;
pub mod error;
pub mod segment;
pub mod storage;
pub mod transport;
pub mod wait;

#[cfg(feature = "python")]
mod python;

pub use broadcast::{Handle, QueueOptions, Reader, Writer};
pub use error::{Error, Result};
