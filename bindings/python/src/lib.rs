//! PyO3 bindings: the module `shmq._core`. Only conversions, GIL release around waits
//! and error mapping live here; the Python package `shmq` builds the public API on it.
//!
//! Contents of `shmq._core`:
//! - `Ring`: a broadcast ring segment (`ShmRingBuffer` in Python);
//! - `Writer`, `Reader`: the two sides of a broadcast queue (`MessageQueue`), a writer
//!   made with a `QueueOptions`; `BytesMessage`, `PartsMessage`, `ArrayMessage`: what a
//!   reader's `dequeue` returns, one class per kind of message; `count()`: the check of every count argument;
//!   `handle_to_text()`, `handle_from_text()`: its handle's text form (`str(Handle)`,
//!   `Handle.from_str`), the Rust `Handle`'s `Display` / `FromStr`;
//! - `Relay`: one copy of a remote stream per node (`shmq.Relay`);
//! - `BlockFifo`, `ObjectStore`: the object store's ring and index (`RingBuffer`,
//!   `ObjectStorage`);
//! - `ShmView`: a zero-copy buffer over shared memory (wrap it in `memoryview`);
//! - `EncoderCacheProducer`, `EncoderCacheReservation`, `EncoderCacheConsumer`: the
//!   encoder-cache hand-off (`shmq.encoder_cache`);
//! - `list_segments()`, `remove_orphans()`, `describe_segment()`, `segment_metrics()`:
//!   cleanup, inspection and live metrics;
//! - `remove_created()`: the exit hook's removal of what this process created;
//!   `new_janitor_socket()`, `has_janitor()`, `forget_inherited_janitor()`: the janitor
//!   that removes them when the process dies without its exit hook (`shmq._janitor`);
//!   `exit_with_process()`, `die_with_process()`, `become_subreaper()`,
//!   `kill_descendants()`: a worker's end with its parent, and with its own exit
//!   (`shmq.workers`); `WorkerGroup`, `worker_died_message()`: the
//!   core's worker supervision, which `shmq.workers.WorkerProcesses` hands its workers to;
//!   `LinkSeal`, `link_*()`: the worker link's handshake messages and seals
//!   (`shmq::workers::link`), which `shmq.workers.protocol` sends;
//! - `ReadyTarget`, `WakeWord`, `ready_target()`, `wait_any()`: one thread waiting for
//!   several local readers at once (`MessageQueue.dequeue_async`, `shmq.Gather`);
//!   `CancelFlag`: a cancel event checked without the GIL (a cancelled coroutine's wait
//!   in an executor thread);
//! - `NameClaim`, `names_claim()`, `names_lookup()`, `names_directory()`,
//!   `names_record_path()`, `NAMES_DIRECTORY_ENV`: queues and stores by name, the
//!   protocol Rust's `Reader::open_by_name` shares (`shmq._names`);
//! - `default_connect_ip()`, `segment_prefix`, `SHM_DIR`, `PeerDiedError`,
//!   `QueueShutDownError`, `MessageLostError`.

mod admin;
mod auth;
mod broadcast;
mod encoder_cache;
mod errors;
mod link;
mod names;
mod options;
mod parts;
mod relay;
mod storage;
mod view;
mod wait;
mod wait_any;
mod workers;

use crate::errors::OrRaise;
use pyo3::prelude::*;

/// Copies into shared memory of up to this many bytes in all are made with the GIL held
/// (when no wait is needed): the core's `copy::SHORT_COPY_MAX`.
const COPY_WITH_GIL_MAX: usize = shmq::copy::SHORT_COPY_MAX;

/// The IP remote readers should connect to (`SHMQ_HOST_IP`, else the host's address).
#[pyfunction]
fn default_connect_ip() -> String {
    shmq::default_connect_ip()
}

/// Remove every segment and socket directory this process created that is still there
/// (the exit hook of `shmq._cleanup`); returns how many there were.
#[pyfunction]
fn remove_created() -> usize {
    shmq::admin::remove_created()
}

/// Make this process's janitor socket (see `segment::set_janitor`): every segment this
/// process made and still has is sent to it now, later ones as they come. Returns the
/// janitor's end, a close-on-exec descriptor the caller passes to the janitor process it
/// starts (`shmq._janitor`) and then closes.
#[pyfunction]
fn new_janitor_socket() -> PyResult<i32> {
    use std::os::fd::IntoRawFd;
    Ok(shmq::admin::new_janitor_socket().or_raise()?.into_raw_fd())
}

/// Whether this process has a janitor (one inherited through `fork` does not count).
#[pyfunction]
fn has_janitor() -> bool {
    shmq::admin::has_janitor()
}

/// Close a janitor socket this process inherited through `fork` (its janitor is the
/// parent's, which would otherwise wait for this process to end too).
#[pyfunction]
fn forget_inherited_janitor() {
    shmq::admin::forget_inherited_janitor_now()
}

/// Die with process `pid`, cleanly: once it has exited, a thread of this process kills
/// this process's descendants, removes what it created, and SIGKILLs it (see
/// `workers::exit_with_process`). Workers' bootstrap calls it with their parent's pid.
#[pyfunction]
fn exit_with_process(pid: u32) -> PyResult<()> {
    shmq::workers::exit_with_process(pid).or_raise()
}

/// Make this process get `signal` when process `pid` exits (see
/// `workers::die_with_process`).
#[pyfunction]
fn die_with_process(pid: u32, signal: i32) -> PyResult<()> {
    shmq::workers::die_with_process(pid, signal).or_raise()
}

/// Adopt this process's orphaned descendants (`PR_SET_CHILD_SUBREAPER`).
#[pyfunction]
fn become_subreaper() -> PyResult<()> {
    shmq::workers::become_subreaper().or_raise()
}

/// SIGKILL every running descendant of this process; returns how many were signalled.
#[pyfunction]
fn kill_descendants(py: Python<'_>) -> usize {
    py.detach(shmq::liveness::kill_descendants)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Route the core's `log` records (e.g. "still waiting" warnings) to Python logging.
    let _ = pyo3_log::try_init();
    m.add_class::<broadcast::Ring>()?;
    m.add_class::<options::QueueOptions>()?;
    m.add_function(wrap_pyfunction!(options::count, m)?)?;
    m.add_class::<broadcast::Writer>()?;
    m.add_class::<broadcast::Reader>()?;
    m.add_class::<broadcast::BytesMessage>()?;
    m.add_class::<broadcast::PartsMessage>()?;
    m.add_class::<broadcast::ArrayMessage>()?;
    m.add_class::<relay::Relay>()?;
    m.add_class::<storage::BlockFifo>()?;
    m.add_class::<storage::ObjectStore>()?;
    m.add_class::<view::ShmView>()?;
    encoder_cache::register(m)?;
    wait_any::register(m)?;
    m.add_class::<workers::WorkerGroup>()?;
    m.add_function(wrap_pyfunction!(workers::worker_died_message, m)?)?;
    link::register(m)?;
    names::register(m)?;
    m.add_function(wrap_pyfunction!(default_connect_ip, m)?)?;
    m.add_function(wrap_pyfunction!(auth::auth_mac, m)?)?;
    m.add_function(wrap_pyfunction!(auth::auth_check, m)?)?;
    m.add_function(wrap_pyfunction!(auth::auth_message_mac, m)?)?;
    m.add_function(wrap_pyfunction!(auth::auth_message_check, m)?)?;
    m.add_function(wrap_pyfunction!(auth::secret_from_text, m)?)?;
    m.add_function(wrap_pyfunction!(auth::new_secret_text, m)?)?;
    m.add_function(wrap_pyfunction!(remove_created, m)?)?;
    m.add_function(wrap_pyfunction!(new_janitor_socket, m)?)?;
    m.add_function(wrap_pyfunction!(has_janitor, m)?)?;
    m.add_function(wrap_pyfunction!(forget_inherited_janitor, m)?)?;
    m.add_function(wrap_pyfunction!(exit_with_process, m)?)?;
    m.add_function(wrap_pyfunction!(die_with_process, m)?)?;
    m.add_function(wrap_pyfunction!(become_subreaper, m)?)?;
    m.add_function(wrap_pyfunction!(kill_descendants, m)?)?;
    m.add_function(wrap_pyfunction!(wait::timeout_seconds, m)?)?;
    m.add_class::<wait::CancelFlag>()?;
    m.add_function(wrap_pyfunction!(broadcast::handle_to_text, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast::handle_from_text, m)?)?;
    m.add_function(wrap_pyfunction!(admin::list_segments, m)?)?;
    m.add_function(wrap_pyfunction!(admin::remove_orphans, m)?)?;
    m.add_function(wrap_pyfunction!(admin::describe_segment, m)?)?;
    m.add_function(wrap_pyfunction!(admin::segment_metrics, m)?)?;
    m.add("PeerDiedError", m.py().get_type::<errors::PeerDiedError>())?;
    m.add(
        "QueueShutDownError",
        m.py().get_type::<errors::QueueShutDownError>(),
    )?;
    m.add(
        "MessageLostError",
        m.py().get_type::<errors::MessageLostError>(),
    )?;
    m.add("segment_prefix", shmq::admin::NAME_PREFIX)?;
    // Where segments live: the Python package spells `/dev/shm` only through this.
    m.add("SHM_DIR", shmq::admin::SHM_DIR)?;
    // The store's layout constants, for the Python classes that show vLLM's names for
    // them (`RingBuffer.MD_SIZE`, `ID_MAX`, ...): defined once, in the core.
    m.add("BLOCK_HEADER_BYTES", shmq::alloc::HEADER_BYTES)?;
    m.add("ID_MAX", shmq::alloc::ID_MAX)?;
    m.add("COUNT_BYTES", shmq::storage::COUNT_BYTES)?;
    m.add("SECRET_BYTES", shmq::storage::SECRET_BYTES)?;
    // The smallest loaned part a queue sends by reference (sealed); smaller ones are
    // copied: `MessageQueue.loan`'s docs and the tests that seal take it from here.
    m.add("LOAN_SEAL_MIN", shmq::arena::LOAN_SEAL_MIN)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
