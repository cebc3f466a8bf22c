//! shmq's core (use it through the `shmq` crate, which re-exports it): the queue, the
//! store, the arena, the encoder cache, the remote stream and its relay, over the layers
//! below it (`shmq-os`, `shmq-protocol`); worker supervision (`shmq-workers`) is above.
//!
//! # Modules, lowest first
//! A reading order: each module uses only the ones listed before it. The layers that
//! must not be crossed are crates, which the compiler keeps apart. Public modules are
//! links; the others are internal.
//! - [`error`]: the core's error ([`Error`]): its own variants (waits, arguments,
//!   roles, ZeroMQ) and one per layer or module with errors of its own
//!   ([`error::OsError`], [`broadcast::QueueError`], [`storage::StoreError`],
//!   [`encoder_cache::CacheError`], [`remote::RemoteError`]), which `?` converts into;
//! - [`wait`]: how blocked writers and readers wait (spin, yield, then sleep), and the
//!   terms a caller sets ([`wait::WaitSpec`]: timeout, hook, quiet, and the clock of a wait
//!   started over);
//! - [`auth`]: the keyed MAC that proves a secret (remote stream, worker handshake), and
//!   a secret's one text form;
//! - `transport`: ZeroMQ, for local readers' oversized messages;
//! - [`remote`]: the authenticated stream to remote readers (and its bounds);
//! - [`names`]: queues and stores by name, for the processes of one user on this
//!   machine, in either language (the record format Python's and Rust's writers share);
//! - [`storage`]: the object store, on the FIFO allocator;
//! - [`arena`]: the tensor arena (large message parts read as private views, and
//!   [`Loan`]s to fill in place);
//! - [`broadcast`]: the broadcast ring and the queue ([`Writer`], [`Reader`]) built on it,
//!   its async receives on any executor ([`AsyncWaiter`]) and [`Gather`] (many writers'
//!   queues read as one stream);
//! - [`relay`]: one copy of a remote stream per node: a remote reader that writes every
//!   message, whole, into a queue of its own for the readers on its machine;
//! - [`encoder_cache`]: the encoder-cache hand-off: a producer's entries by key to every
//!   consumer process as private views, with a key index any process can ask;
//! - [`admin`]: finding, describing and removing segments (cleanup after crashes);
//! - `fuzzing` (hidden): entry points for the fuzz targets in `fuzz/`, not API.

// `warn_user!`: report a warning to the user (see [`warning`]), from the layer below.
#[macro_use]
extern crate shmq_os;

// The cross-process protocols are the crate below this one (`shmq-protocol`, which
// loom model-checks); the object store's allocator is public API here too.
pub use shmq_protocol::alloc;

// The operating-system layer below this crate (`shmq-os`): its public modules are part
// of this crate's API, at the same paths as before the split.
pub use shmq_os::{copy, liveness, private_map, process, warning};

pub mod admin;
pub mod arena;
pub mod auth;
pub mod broadcast;
pub mod encoder_cache;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod names;
pub mod relay;
pub mod remote;
pub mod storage;
pub mod wait;

pub use arena::{ArenaView, Loan};
pub use broadcast::{
    Array, ArrayMeta, ArrayRef, AsyncWaiter, Dtype, Element, Gather, GatherCanceller, Handle,
    Message, OwnedPart, QueueOptions, Reader, Writer,
};
pub use error::{Error, Result};
pub use transport::default_connect_ip;
pub use warning::set_warning_hook;

// Internals.
pub(crate) mod transport;
