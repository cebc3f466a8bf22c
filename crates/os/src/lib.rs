//! shmq's operating-system layer: named shared-memory segments and what keeps them safe
//! among processes that do not trust each other's timing — who is alive (role locks on a
//! segment's file, pidfds), what a truncating peer's `SIGBUS` becomes, private
//! copy-on-write views, the mapping budget, fork safety — and their errors, which the
//! layers above wrap in theirs. It knows nothing of queues, stores or arenas (the `shmq`
//! crate above it does); the protocols on atomics are the crate beside it
//! (`shmq-protocol`), whose `sync::local` names this crate's own atomics.
//!
//! # Modules, lowest first
//! Each module uses only the modules listed before it.
//! - [`error`]: this layer's errors ([`Error`]: segments, refused arguments, a fork,
//!   failed system calls), which the core's error wraps;
//! - [`warning`]: where shmq's warnings go (a hook, the `log` crate, or stderr);
//! - [`copy`]: large copies into shared memory;
//! - [`random`]: secrets and nonces from the kernel;
//! - [`fork`]: what a forked child must not do with what it inherited;
//! - [`segment_file`]: a segment's file in `/dev/shm` (where the segments' files are,
//!   `SHM_DIR`): the one place that turns a segment's name into an open descriptor
//!   (read-write or read-only, a new open file description each time), or removes it;
//! - [`liveness`]: telling a live peer from a dead one by the role locks it holds on
//!   bytes of a segment's file (also across pid namespaces): alive, dead, or unknown;
//!   the end of a process tree (pidfds, [`liveness::kill_descendants`]);
//! - [`process`]: naming a process by pid and start time; its descendants;
//! - [`names_dir`]: this user's directory of names (queues and stores opened by name):
//!   the directory and its fallbacks, record files made unnamed, locked and linked, and
//!   the race-free removal of dead ones;
//! - [`sigbus`]: a peer that truncates a mapped segment: the `SIGBUS` handler that turns
//!   the fault into zero pages and an error, and what shmq guarantees against the same
//!   user's processes;
//! - [`map_budget`]: shmq's own mappings counted against the process's
//!   `vm.max_map_count`;
//! - [`segment`]: named POSIX shared memory, and the header check every kind of segment
//!   makes;
//! - [`range_alloc`]: the whole-page allocator of the arena's and the encoder cache's
//!   data regions;
//! - [`region`](mod@region): what every region of shared memory handed out (loan, view) gives: its
//!   pointer, length and bytes;
//! - [`private_map`]: private copy-on-write views of a segment;
//! - [`pins`]: a process's views holding store blocks (file locks the writer checks
//!   before it frees).

/// Report a warning to the user: `format!` arguments (see [`warning`]); for this crate
/// and the ones above it.
#[macro_export]
macro_rules! warn_user {
    ($($arg:tt)*) => { $crate::warning::emit(module_path!(), format_args!($($arg)*)) };
}

/// `log::info!` / `debug!` / `error!` (the level first: `shmq_log!(info, "...")`) under
/// shmq's one log target, [`warning::log_target`], whichever layer crate logs.
#[macro_export]
macro_rules! shmq_log {
    ($level:ident, $($arg:tt)+) => {
        log::$level!(target: &*$crate::warning::log_target(module_path!()), $($arg)+)
    };
}

pub mod error;
pub mod warning;
pub use error::{Error, Result};

pub mod copy;
pub mod fork;
pub mod liveness;
pub mod map_budget;
pub mod names_dir;
pub mod pins;
pub mod private_map;
pub mod process;
pub mod random;
pub mod range_alloc;
pub mod region;
pub mod segment;
pub mod segment_file;
pub mod sigbus;
