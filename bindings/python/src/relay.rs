//! Binding for the relay (`shmq.Relay`): `Relay`. Handles cross as their text form
//! (`str(Handle)`, `Handle.from_str`).

use crate::errors::{exception, OrRaise};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::wait::{blocking, duration, lock, BindingLock, Interrupts, Timeout};
use crate::options::{count, QueueOptions};
use shmq::broadcast::{Handle, QueueOptions as CoreQueueOptions};
use shmq::error::Error;
use shmq::relay::{Relay as CoreRelay, RelayEnd, RelayStopper};

const RELAY: &str = "relay";

/// One copy of a remote stream per node: a remote reader of an upstream queue that
/// writes every message, whole, into a queue of its own for the readers on this machine.
#[pyclass(module = "shmq._core")]
pub(super) struct Relay {
    inner: BindingLock<CoreRelay>,
    /// Outside the lock: `stop()` must work while `run()` holds it (from another thread,
    /// or from a signal handler that `run`'s checks call).
    stopper: RelayStopper,
    handle: String,
}

#[pymethods]
impl Relay {
    /// Join the queue of `upstream` (a handle's text form) as its remote reader `rank`,
    /// and make this machine's queue for `n_local_reader` readers with `options` (where
    /// not given: the ring's sizes of the upstream queue where its handle has a ring, and
    /// the core's defaults).
    #[new]
    #[pyo3(signature = (upstream, rank, n_local_reader, options=None))]
    fn new(
        upstream: &str,
        rank: usize,
        n_local_reader: &Bound<'_, PyAny>,
        options: Option<QueueOptions>,
    ) -> PyResult<Relay> {
        let upstream: Handle = upstream
            .parse()
            .map_err(|e: Error| PyValueError::new_err(format!("not a shmq Handle: {e}")))?;
        let n_local_reader = count(
            n_local_reader,
            "n_local_reader",
            "readers",
            0,
            i64::MAX.into(),
        )? as usize;
        let mut opts = CoreQueueOptions::local(n_local_reader);
        if let Some(ring) = &upstream.buffer {
            opts.max_chunk_bytes = ring.max_chunk_bytes;
            opts.max_chunks = ring.max_chunks;
        }
        options.unwrap_or_default().apply(&mut opts)?;
        let relay = CoreRelay::new(&upstream, rank, opts).or_raise()?;
        Ok(Relay {
            stopper: relay.stopper(),
            handle: relay.handle().to_string(),
            inner: BindingLock::new(relay),
        })
    }

    /// The text form of the relay's own queue's handle, for its readers.
    fn handle_text(&self) -> String {
        self.handle.clone()
    }

    /// The rank the relay reads as, upstream.
    #[getter]
    fn rank(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(lock(py, &self.inner, RELAY)?.rank())
    }

    /// (messages, bytes) passed on so far.
    #[getter]
    fn forwarded(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        Ok(lock(py, &self.inner, RELAY)?.forwarded())
    }

    /// Wait for the local readers, then for the upstream writer's start (`timeout`
    /// seconds for both).
    #[pyo3(signature = (timeout=None))]
    fn wait_until_ready(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<()> {
        let mut guard = lock(py, &self.inner, RELAY)?;
        let relay = &mut *guard;
        let t = duration(timeout);
        let interrupts = Interrupts {
            timeout,
            cancel: None,
            quiet: false,
        };
        // The core's error comes back as a value (a signal handler's exception comes back
        // as the error).
        blocking(py, interrupts, |spec| {
            Ok::<_, shmq::Error>(relay.wait_until_ready(t, spec.hook))
        })?
        .map_err(exception)
    }

    /// Pass messages on until the upstream writer shuts down (`True`, the relay's queue
    /// shut down after the same messages) or `stop()` (`False`). The upstream writer's
    /// death raises `PeerDiedError`, a local reader's death `PeerDiedError` too (unless
    /// `on_dead_reader="drop"`). Signal handlers run while it waits for upstream; an
    /// exception they raise ends it, and `run()` may be called again (nothing is lost).
    fn run(&self, py: Python<'_>) -> PyResult<bool> {
        let mut guard = lock(py, &self.inner, RELAY)?;
        let relay = &mut *guard;
        let interrupts = Interrupts {
            timeout: None,
            cancel: None,
            quiet: true,
        };
        match blocking(py, interrupts, |spec| {
            Ok::<_, shmq::Error>(relay.run(spec.hook))
        })? {
            Ok(RelayEnd::UpstreamShutDown) => Ok(true),
            Ok(RelayEnd::Stopped) => Ok(false),
            Err(e) => Err(exception(e)),
        }
    }

    /// End `run()` from any thread (or a signal handler) and shut the relay's queue down.
    fn stop(&self) {
        self.stopper.stop();
    }

    /// Whether `stop()` was called.
    #[getter]
    fn stopped(&self) -> bool {
        self.stopper.is_stopped()
    }

    /// Shut the relay's queue down and leave the upstream stream.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.stopper.stop();
        lock(py, &self.inner, RELAY)?.close();
        Ok(())
    }
}
