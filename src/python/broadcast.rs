//! Bindings for the broadcast ring and queue: `Ring`, `Writer`, `Reader`.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::view::ShmView;
use super::wait::{blocking, lock, wait_policy, Interrupts, Timeout};
use crate::broadcast::queue::Canceller;
use crate::broadcast::{ChunkKind, DeadReaderPolicy};
use crate::broadcast::{
    Handle, QueueOptions, Reader as CoreReader, Ring as CoreRing, RingHandle, Writer as CoreWriter,
};
use crate::error::Error;
use crate::wait::{Wait, WaitPolicy};
use pyo3::exceptions::PyValueError;

/// Messages up to this size are copied with the GIL held when no wait is needed.
const COPY_WITH_GIL_MAX: usize = 64 * 1024;

type RingTuple = (usize, usize, usize, String);
type HandleTuple = (
    Vec<usize>,
    Option<RingTuple>,
    Option<String>,
    Option<String>,
    bool,
);

fn ring_tuple(h: &RingHandle) -> RingTuple {
    (h.n_reader, h.max_chunk_bytes, h.max_chunks, h.name.clone())
}

fn handle_tuple(h: &Handle) -> HandleTuple {
    (
        h.local_reader_ranks.clone(),
        h.buffer.as_ref().map(ring_tuple),
        h.local_subscribe_addr.clone(),
        h.remote_subscribe_addr.clone(),
        h.remote_addr_ipv6,
    )
}

/// A broadcast ring segment (either side).
#[pyclass(module = "shmq._core", frozen, weakref)]
pub struct Ring {
    ring: Arc<CoreRing>,
}

#[pymethods]
impl Ring {
    #[staticmethod]
    #[pyo3(signature = (n_reader, max_chunk_bytes, max_chunks, name=None))]
    fn create(
        n_reader: usize,
        max_chunk_bytes: usize,
        max_chunks: usize,
        name: Option<&str>,
    ) -> PyResult<Ring> {
        let ring = match name {
            Some(n) => CoreRing::create_named(n, n_reader, max_chunk_bytes, max_chunks)?,
            None => CoreRing::create(n_reader, max_chunk_bytes, max_chunks)?,
        };
        Ok(Ring {
            ring: Arc::new(ring),
        })
    }

    #[staticmethod]
    fn open(name: &str) -> PyResult<Ring> {
        Ok(Ring {
            ring: Arc::new(CoreRing::open(name)?),
        })
    }

    #[getter]
    fn name(&self) -> &str {
        self.ring.name()
    }
    #[getter]
    fn n_reader(&self) -> usize {
        self.ring.n_reader()
    }
    #[getter]
    fn max_chunk_bytes(&self) -> usize {
        self.ring.max_chunk_bytes()
    }
    #[getter]
    fn max_chunks(&self) -> usize {
        self.ring.max_chunks()
    }
    #[getter]
    fn is_creator(&self) -> bool {
        self.ring.is_creator()
    }
    #[getter]
    fn creator_pid(&self) -> u32 {
        self.ring.creator().pid
    }
    #[getter]
    fn overflow_count(&self) -> u64 {
        self.ring.overflow_count()
    }

    /// `(pid or None, alive, dropped, messages)` of the writer's slot (`reader=None`) or
    /// reader `reader`'s.
    #[pyo3(signature = (reader=None))]
    fn slot(&self, reader: Option<usize>) -> PyResult<(Option<u32>, bool, bool, u64)> {
        let s = self.ring.slot_info(reader)?;
        Ok((
            s.process.map(|p| p.pid),
            s.process.is_some_and(|p| p.is_alive()),
            s.dropped,
            s.messages,
        ))
    }

    /// Remove the segment's name now if this process created it (the memory stays
    /// mapped for whoever has it); for cleanup at interpreter exit.
    fn unlink(&self) -> PyResult<()> {
        Ok(self.ring.unlink()?)
    }

    fn handle(&self) -> RingTuple {
        ring_tuple(&self.ring.handle())
    }

    /// A view of chunk `i`'s data.
    fn data(&self, i: i64) -> PyResult<ShmView> {
        let (p, n) = self.ring.data_ptr(self.chunk_index(i)?)?;
        // SAFETY: data_ptr returns a range inside the mapping, which the Arc keeps alive.
        Ok(unsafe { ShmView::new(self.ring.clone(), p, n) })
    }

    /// A view of chunk `i`'s flags: `[written, read_0, ..]`.
    fn metadata(&self, i: i64) -> PyResult<ShmView> {
        let (p, n) = self.ring.metadata_ptr(self.chunk_index(i)?)?;
        // SAFETY: as in `data`.
        Ok(unsafe { ShmView::new(self.ring.clone(), p, n) })
    }

    /// A snapshot of chunk `i`'s flags, read atomically.
    fn metadata_snapshot<'py>(&self, py: Python<'py>, i: i64) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.ring.metadata(self.chunk_index(i)?)?))
    }
}

impl Ring {
    /// A Python index as a chunk index (negative ones are out of range too).
    fn chunk_index(&self, i: i64) -> PyResult<usize> {
        Ok(usize::try_from(i).map_err(|_| self.ring.chunk_out_of_range(i))?)
    }
}

/// The writing side of a queue.
#[pyclass(module = "shmq._core", frozen)]
pub struct Writer {
    inner: Mutex<CoreWriter>,
    canceller: Canceller,
    policy: WaitPolicy,
}

#[pymethods]
impl Writer {
    #[new]
    #[pyo3(signature = (n_reader, n_local_reader, local_reader_ranks=None, max_chunk_bytes=10*1024*1024, max_chunks=10, connect_ip=None, spin_us=None, yield_us=None, on_dead_reader="raise"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        n_reader: usize,
        n_local_reader: usize,
        local_reader_ranks: Option<Vec<usize>>,
        max_chunk_bytes: usize,
        max_chunks: usize,
        connect_ip: Option<String>,
        spin_us: Option<f64>,
        yield_us: Option<f64>,
        on_dead_reader: &str,
    ) -> PyResult<Writer> {
        let on_dead_reader = match on_dead_reader {
            "raise" => DeadReaderPolicy::Raise,
            "drop" => DeadReaderPolicy::Drop,
            other => {
                return Err(PyValueError::new_err(format!(
                    "on_dead_reader must be \"raise\" or \"drop\", got {other:?}"
                )))
            }
        };
        let opts = QueueOptions {
            n_reader,
            n_local_reader,
            local_reader_ranks,
            max_chunk_bytes,
            max_chunks,
            connect_ip,
            wait: Some(wait_policy(n_local_reader + 1, spin_us, yield_us)?),
            on_dead_reader,
        };
        let writer = CoreWriter::new(opts)?;
        Ok(Writer {
            canceller: writer.canceller(),
            policy: writer.wait_policy(),
            inner: Mutex::new(writer),
        })
    }

    /// Local readers dropped after they died (with `on_dead_reader="drop"`).
    #[getter]
    fn dropped_readers(&self, py: Python<'_>) -> Vec<usize> {
        lock(py, &self.inner).dropped_readers()
    }

    /// `(local_reader_ranks, buffer_handle, local_subscribe_addr, remote_subscribe_addr, remote_addr_ipv6)`
    fn handle(&self, py: Python<'_>) -> HandleTuple {
        handle_tuple(lock(py, &self.inner).handle())
    }

    /// The ring, or None without local readers.
    fn ring(&self, py: Python<'_>) -> Option<Ring> {
        lock(py, &self.inner)
            .ring()
            .map(|r| Ring { ring: r.clone() })
    }

    #[getter]
    fn current_idx(&self, py: Python<'_>) -> usize {
        lock(py, &self.inner).current_index()
    }
    #[getter]
    fn overflow_count(&self, py: Python<'_>) -> u64 {
        lock(py, &self.inner).overflow_count()
    }

    #[pyo3(signature = (timeout=None))]
    fn wait_until_ready(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<()> {
        let mut w = lock(py, &self.inner);
        let w = &mut *w;
        let what = "the writer waiting for every reader to subscribe";
        blocking(py, what, self.interrupts(timeout), |wait| {
            w.wait_until_ready_with(wait)
        })
    }

    /// Send `data` to every reader.
    #[pyo3(signature = (data, timeout=None))]
    fn enqueue(&self, py: Python<'_>, data: &[u8], timeout: Option<Timeout>) -> PyResult<()> {
        let mut w = lock(py, &self.inner);
        if data.len() <= COPY_WITH_GIL_MAX && w.can_write() {
            // No wait needed (the chunk is free and sockets never block): skip the core
            // `enqueue`, which would check the chunk again before setting up a wait.
            return Ok(w.enqueue_with(data, &mut Wait::ready_now())?);
        }
        let w = &mut *w;
        let what = "the writer waiting for readers to free a chunk";
        blocking(py, what, self.interrupts(timeout), |wait| {
            w.enqueue_with(data, wait)
        })
    }

    /// Wait for the next chunk and return a view of it, for zero-copy writing;
    /// publish it with `commit_write()`.
    #[pyo3(signature = (timeout=None))]
    fn acquire_write(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<ShmView> {
        let mut w = lock(py, &self.inner);
        let w = &mut *w;
        let what = "the writer waiting for readers to free a chunk";
        let (ptr, len) = blocking(py, what, self.interrupts(timeout), |wait| {
            w.acquire_write(wait)
                .map(|buf| (buf.as_mut_ptr() as usize, buf.len()))
        })?;
        let ring = w.ring().expect("acquire_write succeeded").clone();
        // SAFETY: the range is the acquired chunk, inside the mapping kept alive by `ring`.
        Ok(unsafe { ShmView::new(ring, ptr as *mut u8, len) })
    }

    fn commit_write(&self, py: Python<'_>) -> PyResult<()> {
        Ok(lock(py, &self.inner).commit_write()?)
    }

    /// Make this writer's blocked calls raise `RuntimeError("cancelled")`.
    fn shutdown(&self) {
        self.canceller.cancel();
    }
}

impl Writer {
    /// Never locks `inner`: the callers hold it already.
    fn interrupts(&self, timeout: Option<Timeout>) -> Interrupts<'_, '_> {
        Interrupts {
            timeout,
            cancel: None,
            shutdown: self.canceller.flag(),
            quiet: false,
            policy: self.policy,
        }
    }
}

/// The reading side of a queue.
#[pyclass(module = "shmq._core", frozen)]
pub struct Reader {
    inner: Mutex<CoreReader>,
    canceller: Canceller,
    policy: WaitPolicy,
    what: String,
}

#[pymethods]
impl Reader {
    #[new]
    #[pyo3(signature = (local_reader_ranks, buffer_handle, local_subscribe_addr, remote_subscribe_addr, remote_addr_ipv6, rank, spin_us=None, yield_us=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        local_reader_ranks: Vec<usize>,
        buffer_handle: Option<RingTuple>,
        local_subscribe_addr: Option<String>,
        remote_subscribe_addr: Option<String>,
        remote_addr_ipv6: bool,
        rank: usize,
        spin_us: Option<f64>,
        yield_us: Option<f64>,
    ) -> PyResult<Reader> {
        let handle = Handle {
            local_reader_ranks,
            buffer: buffer_handle.map(|(n_reader, max_chunk_bytes, max_chunks, name)| RingHandle {
                n_reader,
                max_chunk_bytes,
                max_chunks,
                name,
            }),
            local_subscribe_addr,
            remote_subscribe_addr,
            remote_addr_ipv6,
        };
        let policy = wait_policy(handle.local_reader_ranks.len() + 1, spin_us, yield_us)?;
        let reader = CoreReader::open_with(&handle, rank, policy)?;
        Ok(Reader {
            canceller: reader.canceller(),
            policy,
            what: reader.wait_description().to_owned(),
            inner: Mutex::new(reader),
        })
    }

    #[getter]
    fn is_local(&self, py: Python<'_>) -> bool {
        lock(py, &self.inner).is_local()
    }
    #[getter]
    fn reader_index(&self, py: Python<'_>) -> Option<usize> {
        lock(py, &self.inner).reader_index()
    }
    #[getter]
    fn current_idx(&self, py: Python<'_>) -> usize {
        lock(py, &self.inner).current_index()
    }
    fn ring(&self, py: Python<'_>) -> Option<Ring> {
        lock(py, &self.inner)
            .ring()
            .map(|r| Ring { ring: r.clone() })
    }

    #[pyo3(signature = (timeout=None, cancel=None))]
    fn wait_until_ready(
        &self,
        py: Python<'_>,
        timeout: Option<Timeout>,
        cancel: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let mut r = lock(py, &self.inner);
        let r = &mut *r;
        let what = format!("{} to be ready", self.what);
        blocking(py, &what, self.interrupts(timeout, cancel, false), |wait| {
            r.wait_until_ready_with(wait)
        })
    }

    /// The next message's bytes.
    #[pyo3(signature = (timeout=None, cancel=None, indefinite=false))]
    fn dequeue<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<Timeout>,
        cancel: Option<&Bound<'py, PyAny>>,
        indefinite: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut r = lock(py, &self.inner);
        if let Some(b) = r.try_take(|d| PyBytes::new(py, d))? {
            return Ok(b);
        }
        if self.canceller.is_cancelled() {
            return Err(Error::Cancelled.into());
        }
        let r = &mut *r;
        blocking(
            py,
            &self.what,
            self.interrupts(timeout, cancel, indefinite),
            |wait| r.wait_message(wait),
        )?;
        r.try_take(|d| PyBytes::new(py, d))?
            .ok_or_else(|| r.not_ready_any_more().into())
    }

    /// Wait for the next chunk and return a view of its data (zero-copy); release it
    /// with `finish_read()`.
    #[pyo3(signature = (timeout=None, cancel=None))]
    fn acquire_read(
        &self,
        py: Python<'_>,
        timeout: Option<Timeout>,
        cancel: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let mut r = lock(py, &self.inner);
        let r = &mut *r;
        let info = blocking(
            py,
            &self.what,
            self.interrupts(timeout, cancel, false),
            |wait| r.acquire_read(wait),
        )?;
        let data = r.chunk_data(&info);
        if info.kind == ChunkKind::Overflow {
            // The message came over the socket and is gone after finish_read: a copy.
            return Ok(PyBytes::new(py, data).into_any().unbind());
        }
        let ring = r.ring().expect("a local reader has a ring").clone();
        // SAFETY: the slice lies in the chunk, in the mapping kept alive by `ring`, so the
        // view never points outside mapped memory. Its bytes are the chunk's only until
        // `finish_read`: after that the writer may overwrite them (the context manager
        // in message_queue.py releases the view first).
        let view = unsafe { ShmView::new(ring, data.as_ptr() as *mut u8, data.len()) };
        Ok(Py::new(py, view)?.into_any())
    }

    fn finish_read(&self, py: Python<'_>) -> PyResult<()> {
        Ok(lock(py, &self.inner).finish_read()?)
    }

    /// Wake this reader's blocked calls (from any thread) with `RuntimeError("cancelled")`.
    fn shutdown(&self) {
        self.canceller.cancel();
    }

    #[getter]
    fn shutting_down(&self) -> bool {
        self.canceller.is_cancelled()
    }
}

impl Reader {
    fn interrupts<'a, 'py>(
        &'a self,
        timeout: Option<Timeout>,
        cancel: Option<&'a Bound<'py, PyAny>>,
        quiet: bool,
    ) -> Interrupts<'a, 'py> {
        Interrupts {
            timeout,
            cancel,
            shutdown: self.canceller.flag(),
            quiet,
            policy: self.policy,
        }
    }
}
