//! Bindings for the broadcast ring and queue: `Ring`, `Writer`, `Reader`.
//!
//! `Reader.acquire_read`/`finish_read` wrap the core reader's `acquire_chunk` /
//! `finish_chunk` (the variant of `acquire_read` whose view does not borrow the reader):
//! the private mapping of the chunk and its life cycle (detached or retired when the
//! chunk is given back) are the core's; the binding only wraps the mapping in a
//! `ShmView` and tells the core, at `finish_read`, whether that view is still exported
//! (detach) or not (revoke it, retire).

use std::sync::Arc;

use crate::errors::{exception, taken_now, OrRaise};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyMemoryView, PyString, PyTuple};

use super::parts;
use super::view::ShmView;
use super::wait::{
    blocking_on, lock, try_lock, wait_policy, BindingGuard, BindingLock, Interrupts, Timeout,
};
use super::COPY_WITH_GIL_MAX;
use pyo3::exceptions::{PyAttributeError, PyOverflowError, PyTypeError, PyValueError};
use shmq::broadcast::queue::Canceller;
use shmq::broadcast::queue::ChunkEnd;

use crate::options::{count, QueueOptions};
use shmq::broadcast::{
    ArrayMeta, ArrayRef, Dtype, Handle, Message, Part, QueueOptions as CoreQueueOptions,
    Reader as CoreReader, Received, Ring as CoreRing, RingHandle, TryEnqueueError,
    Writer as CoreWriter,
};
use shmq::error::Error;
use shmq::wait::WaitSpec;

type RingTuple = (usize, usize, usize, String);

fn ring_tuple(h: &RingHandle) -> RingTuple {
    (h.n_reader, h.max_chunk_bytes, h.max_chunks, h.name.clone())
}

/// A queue handle as Python has it: any object with the fields of `shmq.Handle`
/// (`local_reader_ranks`, `buffer_handle`, `local_subscribe_addr`,
/// `remote_subscribe_addr`, `remote_addr_ipv6`, and optionally `arena_name`), read by
/// name.
struct PyHandle(Handle);

/// A field of a Python handle that is not what shmq needs, as the builtin error users
/// expect, naming the field: `TypeError` for a missing field or a value of the wrong
/// type, `ValueError` for one out of range (a negative rank: pyo3 says `OverflowError`).
fn bad_field(py: Python<'_>, name: &str, e: PyErr) -> PyErr {
    if e.is_instance_of::<PyOverflowError>(py) || e.is_instance_of::<PyValueError>(py) {
        PyValueError::new_err(format!("not a valid shmq Handle: {name}: {e}"))
    } else if e.is_instance_of::<PyAttributeError>(py) {
        PyTypeError::new_err(format!("not a shmq Handle: it has no field {name}"))
    } else {
        PyTypeError::new_err(format!("not a valid shmq Handle: {name}: {e}"))
    }
}

/// Field `name` of the handle `obj`, converted (errors as in [`bad_field`]).
fn handle_field<'py, T>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<T>
where
    T: for<'a> FromPyObject<'a, 'py>,
{
    let py = obj.py();
    let value = obj.getattr(name).map_err(|e| bad_field(py, name, e))?;
    value
        .extract::<T>()
        .map_err(|e| bad_field(py, name, e.into()))
}

impl<'a, 'py> FromPyObject<'a, 'py> for PyHandle {
    type Error = PyErr;
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<PyHandle> {
        let (py, obj) = (obj.py(), obj.to_owned());
        let buffer = obj
            .getattr("buffer_handle")
            .map_err(|e| bad_field(py, "buffer_handle", e))?;
        // A list where a tuple is expected (a handle that went through JSON, say) is fine.
        let buffer: Option<RingTuple> = if buffer.is_instance_of::<PyList>() {
            let items = buffer.try_iter()?.collect::<PyResult<Vec<_>>>()?;
            Some(
                PyTuple::new(py, items)?
                    .extract()
                    .map_err(|e| bad_field(py, "buffer_handle", e))?,
            )
        } else {
            buffer
                .extract()
                .map_err(|e| bad_field(py, "buffer_handle", e))?
        };
        let arena = match obj.getattr("arena_name") {
            Ok(v) => v.extract().map_err(|e| bad_field(py, "arena_name", e))?,
            Err(_) => None, // a handle pickled before the field existed
        };
        let remote_secret = match obj.getattr("remote_secret") {
            Ok(v) if !v.is_none() => {
                let text: String = v.extract().map_err(|e| bad_field(py, "remote_secret", e))?;
                let bytes = (0..text.len())
                    .step_by(2)
                    .map(|i| {
                        text.get(i..i + 2)
                            .and_then(|h| u8::from_str_radix(h, 16).ok())
                    })
                    .collect::<Option<Vec<u8>>>();
                Some(
                    bytes
                        .and_then(|b| <[u8; shmq::remote::SECRET_BYTES]>::try_from(b).ok())
                        .ok_or_else(|| {
                            PyValueError::new_err("remote_secret must be 64 hexadecimal digits")
                        })?,
                )
            }
            _ => None,
        };
        Ok(PyHandle(Handle {
            local_reader_ranks: handle_field(&obj, "local_reader_ranks")?,
            buffer: buffer.map(|(n_reader, max_chunk_bytes, max_chunks, name)| RingHandle {
                n_reader,
                max_chunk_bytes,
                max_chunks,
                name,
            }),
            local_subscribe_addr: handle_field(&obj, "local_subscribe_addr")?,
            remote_subscribe_addr: handle_field(&obj, "remote_subscribe_addr")?,
            remote_addr_ipv6: handle_field(&obj, "remote_addr_ipv6")?,
            arena,
            remote_secret,
        }))
    }
}

/// The fields of `shmq.Handle`, by name, for `Handle(**fields)`.
fn handle_fields<'py>(py: Python<'py>, h: &Handle) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("local_reader_ranks", h.local_reader_ranks.clone())?;
    d.set_item("buffer_handle", h.buffer.as_ref().map(ring_tuple))?;
    d.set_item("local_subscribe_addr", h.local_subscribe_addr.clone())?;
    d.set_item("remote_subscribe_addr", h.remote_subscribe_addr.clone())?;
    d.set_item("remote_addr_ipv6", h.remote_addr_ipv6)?;
    d.set_item("arena_name", h.arena.clone())?;
    let secret = h
        .remote_secret
        .map(|k| k.iter().map(|b| format!("{b:02x}")).collect::<String>());
    d.set_item("remote_secret", secret)?;
    Ok(d)
}

/// `str(handle)` for a `shmq.Handle`: the text form that Rust's `Handle` prints
/// (`shmq-handle-3|...`, see `broadcast::queue::handle`), secret included.
#[pyfunction]
pub(super) fn handle_to_text(handle: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(handle.extract::<PyHandle>()?.0.to_string())
}

/// `Handle.from_str(text)`: the fields of the `shmq.Handle` whose text form is `text`
/// (`ValueError` saying what is wrong when it is not one).
#[pyfunction]
pub(super) fn handle_from_text<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyDict>> {
    handle_fields(py, &text.parse::<Handle>().or_raise()?)
}

/// A message of raw bytes as a reader's `dequeue` returns it (core's [`Received::Bytes`]:
/// a writer's `enqueue`, Python's `enqueue_bytes`, or a chunk from `acquire_write`).
#[pyclass(module = "shmq._core", frozen, get_all)]
pub struct BytesMessage {
    /// The bytes, copied.
    data: Py<PyBytes>,
}

/// A message of parts as a reader's `dequeue` returns it (core's [`Received::Parts`]: for
/// Python, a pickled object): its body and the out-of-band buffers it refers to, each
/// what [`part_to_python`] makes (an empty tuple for a body alone, `enqueue_body`).
#[pyclass(module = "shmq._core", frozen, get_all)]
pub struct PartsMessage {
    body: Py<PyBytes>,
    buffers: Py<PyTuple>,
}

/// A typed array as a reader's `dequeue` returns it (core's [`Received::Array`]): its
/// fields, checked against its data, and its data as [`part_to_python`] makes it.
#[pyclass(module = "shmq._core", frozen, get_all)]
pub struct ArrayMessage {
    dtype: Py<PyString>,
    shape: Py<PyTuple>,
    strides: Py<PyTuple>,
    data: Py<PyAny>,
}

/// A received message as Python sees it: one object, its kind told by its class
/// (`BytesMessage`, `PartsMessage` or `ArrayMessage`), built from core's [`Received`].
fn to_python<'py>(py: Python<'py>, m: Received<'_>) -> PyResult<Bound<'py, PyAny>> {
    let message = match m {
        Received::Bytes(b) => Bound::new(
            py,
            BytesMessage {
                data: PyBytes::new(py, b).unbind(),
            },
        )?
        .into_any(),
        Received::Parts(parts) => {
            let mut parts = parts.into_iter();
            let body = parts.next().expect("a message has a body");
            let body = PyBytes::new(py, &body).unbind();
            let buffers = match parts.len() {
                0 => PyTuple::empty(py),
                _ => PyTuple::new(
                    py,
                    parts
                        .map(|p| part_to_python(py, p))
                        .collect::<PyResult<Vec<_>>>()?,
                )?,
            }
            .unbind();
            Bound::new(py, PartsMessage { body, buffers })?.into_any()
        }
        Received::Array { meta, data } => Bound::new(
            py,
            ArrayMessage {
                dtype: PyString::intern(py, meta.dtype.name()).unbind(),
                shape: PyTuple::new(py, &meta.shape)?.unbind(),
                strides: PyTuple::new(py, &meta.strides)?.unbind(),
                data: part_to_python(py, data)?.unbind(),
            },
        )?
        .into_any(),
        // A kind of message added to the core after this binding: refused by name.
        other => {
            return Err(PyValueError::new_err(format!(
                "this shmq._core cannot convert a message of this kind: {other:?}"
            )))
        }
    };
    Ok(message)
}

/// A received buffer as Python has it: a `bytearray` (copied from the chunk) or a
/// writable `memoryview` of memory private to this process (a frame, or an arena part
/// mapped copy-on-write).
fn part_to_python<'py>(py: Python<'py>, p: Part<'_>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match p {
        Part::Borrowed(b) => PyByteArray::new(py, b).into_any(),
        Part::Frame(m) => {
            let m = Arc::new(m);
            let (ptr, len) = (m.as_ptr() as *mut u8, m.len());
            // SAFETY: the frame's bytes live in the zmq message, which the view owns
            // (moved into the Arc before the pointer was taken, so small messages kept
            // inside the message struct do not move); a received frame is this
            // process's own memory, so handing out a writable view of it is sound.
            let view = Bound::new(py, unsafe { ShmView::new(m, ptr, len) })?;
            PyMemoryView::from(view.as_any())?.into_any()
        }
        Part::Arena(v) => {
            let (ptr, len) = (v.as_ptr(), v.len());
            let v = Arc::new(v);
            let held = v.clone();
            // SAFETY: the bytes are the view's own private mapping, which it unmaps only
            // when dropped, i.e. after the last buffer export of this ShmView is gone.
            let view =
                unsafe { ShmView::new(v, ptr, len) }.with_shared(Box::new(move || held.shared()));
            let view = Bound::new(py, view)?;
            PyMemoryView::from(view.as_any())?.into_any()
        }
    })
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
            Some(n) => {
                CoreRing::create_named(n, n_reader, max_chunk_bytes, max_chunks).or_raise()?
            }
            None => CoreRing::create(n_reader, max_chunk_bytes, max_chunks).or_raise()?,
        };
        Ok(Ring {
            ring: Arc::new(ring),
        })
    }

    #[staticmethod]
    fn open(name: &str) -> PyResult<Ring> {
        Ok(Ring {
            ring: Arc::new(CoreRing::open(name).or_raise()?),
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
    /// The queue's name its writer gave it (`MessageQueue(name=...)`), if any.
    #[getter]
    fn label(&self) -> Option<String> {
        self.ring.label()
    }
    #[getter]
    fn overflow_count(&self) -> u64 {
        self.ring.overflow_count()
    }

    /// `(pid or None, alive, dropped, messages)` of the writer's slot (`reader=None`) or
    /// reader `reader`'s.
    #[pyo3(signature = (reader=None))]
    fn slot(&self, reader: Option<usize>) -> PyResult<(Option<u32>, bool, bool, u64)> {
        let s = self.ring.slot_info(reader).or_raise()?;
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
        self.ring.unlink().or_raise()
    }

    /// The segment's bytes (its mapping's length).
    #[getter]
    fn size(&self) -> usize {
        self.ring.segment_len()
    }

    /// A view of the whole segment (reserved in /dev/shm first; `MemoryError` when there
    /// is no room). Its layout is shmq's: `data` and `metadata` reach chunks and flags.
    fn buf(&self) -> PyResult<ShmView> {
        let (p, n) = self.ring.segment_bytes().or_raise()?;
        // SAFETY: `segment_bytes` is exactly this process's mapping, which the Arc keeps
        // alive as long as the view. It is writable shared memory, header and atomics
        // included (as `metadata`'s views are): peers may change any byte under it, which
        // a byte view tolerates; shmq checks what it reads itself, never trusting this.
        Ok(unsafe { ShmView::new(self.ring.clone(), p, n) })
    }

    fn handle(&self) -> RingTuple {
        ring_tuple(&self.ring.handle())
    }

    /// A view of chunk `i`'s data (the whole chunk reserved in /dev/shm first: whoever
    /// has the view may touch any of it; `MemoryError` when there is no room).
    fn data(&self, i: i64) -> PyResult<ShmView> {
        let i = self.chunk_index(i)?;
        self.ring
            .reserve_data(i, self.ring.max_chunk_bytes())
            .or_raise()?;
        let (p, n) = self.ring.data_ptr(i).or_raise()?;
        // SAFETY: data_ptr returns a range inside the mapping, which the Arc keeps alive.
        Ok(unsafe { ShmView::new(self.ring.clone(), p, n) })
    }

    /// A view of chunk `i`'s flags: `[written, read_0, ..]`.
    fn metadata(&self, i: i64) -> PyResult<ShmView> {
        let (p, n) = self.ring.metadata_ptr(self.chunk_index(i)?).or_raise()?;
        // SAFETY: as in `data`.
        Ok(unsafe { ShmView::new(self.ring.clone(), p, n) })
    }

    /// A snapshot of chunk `i`'s flags, read atomically.
    fn metadata_snapshot<'py>(&self, py: Python<'py>, i: i64) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(
            py,
            &self.ring.metadata(self.chunk_index(i)?).or_raise()?,
        ))
    }
}

impl Ring {
    /// A Python index as a chunk index (negative ones are out of range too).
    fn chunk_index(&self, i: i64) -> PyResult<usize> {
        usize::try_from(i)
            .map_err(|_| self.ring.chunk_out_of_range(i))
            .or_raise()
    }
}

/// The writing side of a queue (weakly referenced by `shmq._cleanup`, which shuts it
/// down at exit).
#[pyclass(module = "shmq._core", frozen, weakref)]
pub struct Writer {
    inner: BindingLock<CoreWriter>,
    canceller: Canceller,
}

impl Writer {
    /// Send `message` (of `nbytes` in all): with `try_enqueue`, at once with the GIL held,
    /// when it is small (releasing the GIL would cost more than the copy), else (or if
    /// that would wait) with `enqueue`, which may wait (the GIL let go, Ctrl-C and the
    /// timeout honoured).
    fn send(
        &self,
        py: Python<'_>,
        message: Message<'_>,
        nbytes: usize,
        timeout: Option<Timeout>,
    ) -> PyResult<()> {
        if nbytes <= COPY_WITH_GIL_MAX {
            match self.writer(py)?.try_enqueue(message) {
                Ok(()) => return Ok(()),
                Err(TryEnqueueError::Failed(e)) => return Err(exception(e)),
                // No room now: wait for it below.
                Err(_) => {}
            }
        }
        blocking_on(py, &self.inner, WRITER, interrupts(timeout), |w, spec| {
            w.enqueue(message, spec)
        })
        .map(drop)
    }
}

#[pymethods]
impl Writer {
    /// A writer for `n_reader` readers, `n_local_reader` of them on this machine, made
    /// with `options` (the core's defaults where `None`).
    #[new]
    #[pyo3(signature = (n_reader, n_local_reader, options=None))]
    fn new(
        n_reader: &Bound<'_, PyAny>,
        n_local_reader: &Bound<'_, PyAny>,
        options: Option<QueueOptions>,
    ) -> PyResult<Writer> {
        let mut opts = CoreQueueOptions::default();
        opts.n_reader = count(n_reader, "n_reader", "readers", 0, i64::MAX.into())? as usize;
        opts.n_local_reader = count(
            n_local_reader,
            "n_local_reader",
            "readers",
            0,
            i64::MAX.into(),
        )? as usize;
        options.unwrap_or_default().apply(&mut opts)?;
        let writer = CoreWriter::new(opts).or_raise()?;
        Ok(Writer {
            canceller: writer.canceller(),
            inner: BindingLock::new(writer),
        })
    }

    /// Local readers dropped after they died (with `on_dead_reader="drop"`).
    #[getter]
    fn dropped_readers(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        Ok(self.writer(py)?.dropped_readers())
    }

    /// How many remote readers this writer no longer sends to (gone or dropped).
    #[getter]
    fn remote_dropped_count(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.writer(py)?.remote_dropped_count())
    }

    /// Look for remote readers whose connection closed while this writer sent nothing
    /// (each is warned about once and no longer sent to); the number no longer sent to,
    /// or `None` when another thread is in a call of this writer (that call does the
    /// same check when it sends). Never waits.
    fn check_remote_peers(&self) -> PyResult<Option<usize>> {
        Ok(crate::wait::try_lock(&self.inner, WRITER)?.map(|mut w| w.check_remote_peers()))
    }

    /// The remote readers accepted so far: `(rank, host as ZeroMQ saw it, dropped)`.
    #[getter]
    fn remote_peers(&self, py: Python<'_>) -> PyResult<Vec<(u64, Option<String>, bool)>> {
        Ok(self.writer(py)?.remote_peers())
    }

    /// The fields of the queue's `shmq.Handle`, by name.
    fn handle<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        handle_fields(py, self.writer(py)?.handle())
    }

    /// The ring, or None without local readers.
    fn ring(&self, py: Python<'_>) -> PyResult<Option<Ring>> {
        Ok(self.writer(py)?.ring().map(|r| Ring { ring: r.clone() }))
    }

    #[getter]
    fn current_idx(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.writer(py)?.current_idx())
    }
    #[getter]
    fn overflow_count(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.writer(py)?.overflow_count())
    }
    /// Message parts sent by copy because the tensor arena had no room.
    #[getter]
    fn arena_fallbacks(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.writer(py)?.arena_fallbacks())
    }
    /// `(segment name, capacity, bytes reserved, leases outstanding)` of the tensor
    /// arena (after returning the leases nobody holds any more, dead readers' holds
    /// included), or None without one. An arena not made yet (no large part so far) has
    /// its name, nothing reserved and nothing outstanding.
    fn arena_info(&self, py: Python<'_>) -> PyResult<Option<(String, usize, usize, usize)>> {
        let mut w = self.writer(py)?;
        w.reclaim_arena();
        let Some(a) = w.arena() else {
            return Ok(None);
        };
        Ok(Some((
            a.name().to_owned(),
            a.capacity(),
            a.reserved(),
            a.outstanding(),
        )))
    }

    /// Send a message of several parts: `parts[0]` is the body, the rest are the
    /// buffers it refers to (bytes-like, contiguous). Large ones go through the tensor
    /// arena; parts inside a live loan of this writer are sent without a copy.
    #[pyo3(signature = (parts, timeout=None))]
    fn enqueue_parts(
        &self,
        py: Python<'_>,
        parts: &Bound<'_, PyList>,
        timeout: Option<Timeout>,
    ) -> PyResult<()> {
        let (buffers, spans) = parts::buffers(parts, |i| {
            format!("message part {i} is not a contiguous buffer")
        })?;
        // SAFETY: each span is a live, contiguous buffer export held by `buffers` until the
        // end of this call; its exporter cannot free or resize it meanwhile. (Another
        // thread may still write into it: then that part's bytes are whatever it wrote,
        // as with any buffer being sent.)
        let slices = unsafe { parts::slices(&spans) };
        let total = slices.iter().map(|s| s.len()).sum();
        let r = self.send(py, Message::Parts(&slices), total, timeout);
        // Released with the writer let go: an exporter's release may run Python code.
        drop(buffers);
        r
    }

    /// Send a typed array: `dtype` by name (`"float32"`...), its C-contiguous `shape`
    /// and its bytes `data` (contiguous, exactly as many as the shape says). Its data
    /// travels as a large part of `enqueue_parts` does.
    #[pyo3(signature = (dtype, shape, data, timeout=None))]
    fn enqueue_array(
        &self,
        py: Python<'_>,
        dtype: &str,
        shape: Vec<usize>,
        data: &Bound<'_, PyAny>,
        timeout: Option<Timeout>,
    ) -> PyResult<()> {
        let meta = ArrayMeta::contiguous(Dtype::from_name(dtype).or_raise()?, &shape);
        // One buffer, the data: the core writes the header from `meta`.
        let parts = PyList::new(py, [data])?;
        let (buffers, spans) = parts::buffers(&parts, |_| {
            "an array's data must be one contiguous buffer".into()
        })?;
        // SAFETY: as in `enqueue_parts`: the span is a live export held by `buffers`.
        let slices = unsafe { parts::slices(&spans) };
        let r = ArrayRef::with_strides(meta, slices[0])
            .or_raise()
            .and_then(|array| self.send(py, Message::Array(&array), spans[0].1, timeout));
        // Released with the writer let go: an exporter's release may run Python code.
        drop(buffers);
        r
    }

    /// Reserve the first `nbytes` of the tensor arena now (see `ArenaWriter::reserve`);
    /// the bytes reserved in all, or None if the queue has no arena. Makes the arena if
    /// it is not made yet.
    fn reserve_arena(&self, py: Python<'_>, nbytes: usize) -> PyResult<Option<usize>> {
        let mut w = self.writer(py)?;
        let Some(a) = w.arena_mut() else {
            return Ok(None);
        };
        Ok(Some(py.detach(|| a.make()?.reserve(nbytes)).or_raise()?))
    }

    /// Lend `nbytes` of the tensor arena to fill in place, as a writable buffer; a part
    /// of a later message that lies inside it is sent without a copy. None if the queue
    /// has no arena or it has no room now. Dropped without being sent, it is returned.
    fn loan(&self, py: Python<'_>, nbytes: usize) -> PyResult<Option<ShmView>> {
        let Some(loan) = self.writer(py)?.loan(nbytes) else {
            return Ok(None);
        };
        let (ptr, len) = (loan.as_ptr(), loan.len());
        // SAFETY: the range is the loan's, inside the arena mapping the loan keeps alive;
        // the view owns the loan, so it is returned only when the last buffer is gone.
        Ok(Some(unsafe { ShmView::new(Arc::new(loan), ptr, len) }))
    }

    /// Wait until every reader has subscribed and tell them the queue is ready; once
    /// done, later calls return at once.
    #[pyo3(signature = (timeout=None))]
    fn wait_until_ready(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<()> {
        blocking_on(py, &self.inner, WRITER, interrupts(timeout), |w, spec| {
            w.wait_until_ready(spec)
        })
        .map(drop)
    }

    /// Wait until every remote reader still sent to has taken every message sent so
    /// far (each acknowledges when it next reads); at once without remote readers.
    #[pyo3(signature = (timeout=None))]
    fn wait_remote_taken(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<()> {
        blocking_on(py, &self.inner, WRITER, interrupts(timeout), |w, spec| {
            w.wait_remote_taken(spec)
        })
        .map(drop)
    }

    /// Send `data` to every reader.
    #[pyo3(signature = (data, timeout=None))]
    fn enqueue(&self, py: Python<'_>, data: &[u8], timeout: Option<Timeout>) -> PyResult<()> {
        self.send(py, Message::Bytes(data), data.len(), timeout)
    }

    /// Send `body` (a pickle stream with no out-of-band buffers) as a message of one
    /// part: a reader's `dequeue` returns it as a `PartsMessage` with no buffers (raw
    /// bytes from `enqueue` come as a `BytesMessage`). As cheap as `enqueue`: only the
    /// chunk's kind differs.
    #[pyo3(signature = (body, timeout=None))]
    fn enqueue_body(&self, py: Python<'_>, body: &[u8], timeout: Option<Timeout>) -> PyResult<()> {
        self.send(py, Message::Body(body), body.len(), timeout)
    }

    /// Wait for the next chunk and return a view of it, for zero-copy writing;
    /// publish it with `commit_write()`.
    #[pyo3(signature = (timeout=None))]
    fn acquire_write(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<ShmView> {
        let (w, (ptr, len)) =
            blocking_on(py, &self.inner, WRITER, interrupts(timeout), |w, spec| {
                w.acquire_write(spec)
                    .map(|buf| (buf.as_mut_ptr() as usize, buf.len()))
            })?;
        let ring = w.ring().expect("acquire_write succeeded").clone();
        // SAFETY: the range is the acquired chunk, inside the mapping kept alive by `ring`.
        Ok(unsafe { ShmView::new(ring, ptr as *mut u8, len) })
    }

    fn commit_write(&self, py: Python<'_>) -> PyResult<()> {
        self.writer(py)?.commit_write().or_raise()
    }

    /// Shut the queue down: this writer's calls, also those blocked in other threads,
    /// raise `QueueShutDownError` from now on, and every reader gets it after the messages
    /// sent before (see `CoreWriter::close`). Safe from any thread; never waits for room.
    fn shutdown(&self, py: Python<'_>) {
        // First the flag, so that a call blocked in another thread ends and lets go of
        // the writer's lock; then tell the readers, under that lock.
        self.canceller.cancel();
        match self.writer(py) {
            Ok(mut w) => {
                let w = &mut *w;
                py.detach(|| w.close());
            }
            // Held by this thread (a finalizer run under one of its calls) or poisoned:
            // the local readers are told all the same.
            Err(_) => self.canceller.close_ring(),
        }
    }

    /// Whether `shutdown()` was called (or the writer closed).
    #[getter]
    fn shutting_down(&self) -> bool {
        self.canceller.is_cancelled()
    }
}

impl Writer {
    /// The core writer, locked (`RuntimeError` once a panic has poisoned it).
    fn writer(&self, py: Python<'_>) -> PyResult<BindingGuard<'_, CoreWriter>> {
        lock(py, &self.inner, WRITER)
    }
}

/// What a poisoned lock of a `Writer` calls it.
const WRITER: &str = "queue writer";

/// The terms of a writer's blocking call: a timeout, no cancel event.
fn interrupts<'a>(timeout: Option<Timeout>) -> Interrupts<'a, 'a> {
    Interrupts {
        timeout,
        cancel: None,
        quiet: false,
    }
}

/// The reading side of a queue.
#[pyclass(module = "shmq._core", frozen)]
pub struct Reader {
    inner: BindingLock<CoreReader>,
    canceller: Canceller,
    /// Whether it reads through shared memory (fixed when it is made; read without the
    /// lock, so that an event loop never waits for a thread's call to learn it).
    local: bool,
    /// The view of the chunk `acquire_read` handed out, until `finish_read` (the core
    /// reader keeps its mapping).
    open_chunk: BindingLock<Option<Py<ShmView>>>,
}

#[pymethods]
impl Reader {
    #[new]
    /// Join the queue of `handle` (a `shmq.Handle`) as the reader of rank `rank`.
    #[pyo3(signature = (handle, rank, spin_us=None, yield_us=None))]
    fn new(
        handle: PyHandle,
        rank: &Bound<'_, PyAny>,
        spin_us: Option<f64>,
        yield_us: Option<f64>,
    ) -> PyResult<Reader> {
        let handle = handle.0;
        // A rank that is not in `local_reader_ranks` opens a remote reader, a negative one
        // included: vLLM's multi-node executor opens its peers' response queues as
        // `create_from_handle(handle, -1)`. Such a rank matches no local reader, so any
        // value that fits no `usize` stands for "no local rank" (pyo3 would say
        // OverflowError); a queue without remote readers refuses it below, naming it.
        let rank = match rank.extract::<usize>() {
            Ok(r) => r,
            Err(e) if e.is_instance_of::<PyOverflowError>(rank.py()) => {
                if handle.remote_subscribe_addr.is_none() {
                    return Err(PyValueError::new_err(format!(
                        "rank {rank} is not a local reader ({:?}) and the queue has no remote readers",
                        handle.local_reader_ranks
                    )));
                }
                usize::MAX
            }
            Err(e) => return Err(e),
        };
        let policy = wait_policy(handle.local_reader_ranks.len() + 1, spin_us, yield_us)?;
        let reader = CoreReader::open_with(&handle, rank, policy).or_raise()?;
        Ok(Reader {
            canceller: reader.canceller(),
            local: reader.is_local(),
            inner: BindingLock::new(reader),
            open_chunk: BindingLock::new(None),
        })
    }

    #[getter]
    fn is_local(&self) -> bool {
        self.local
    }
    #[getter]
    fn reader_index(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        Ok(self.reader(py)?.reader_index())
    }
    #[getter]
    fn current_idx(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.reader(py)?.current_idx())
    }
    fn ring(&self, py: Python<'_>) -> PyResult<Option<Ring>> {
        Ok(self.reader(py)?.ring().map(|r| Ring { ring: r.clone() }))
    }

    #[pyo3(signature = (timeout=None, cancel=None))]
    fn wait_until_ready(
        &self,
        py: Python<'_>,
        timeout: Option<Timeout>,
        cancel: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.wait_for(py, timeout, cancel, |r, spec| r.wait_until_ready(spec))
    }

    /// The next message, one object whose class tells its kind (see `to_python`): a
    /// message of parts (`enqueue_body`, `enqueue_parts`) as a `PartsMessage` (small
    /// buffers copied into bytearrays, large ones zero-copy views of private memory:
    /// writable, and writes stay in this process), raw bytes (`enqueue`, `acquire_write`)
    /// as a `BytesMessage`, a typed array (`enqueue_array`) as an `ArrayMessage`.
    #[pyo3(signature = (timeout=None, cancel=None, indefinite=false))]
    fn dequeue<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<Timeout>,
        cancel: Option<&Bound<'py, PyAny>>,
        indefinite: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        // A message here already, and the reader free: no wait at all. A reader that
        // another thread is using is waited for below, within the timeout.
        if let Some(mut r) = try_lock(&self.inner, READER)? {
            if let Some(m) = taken_now(r.try_take_message(|m| to_python(py, m)))? {
                return m;
            }
        }
        if self.canceller.is_cancelled() {
            return Err(exception(Error::Cancelled));
        }
        let (mut r, ()) = blocking_on(
            py,
            &self.inner,
            READER,
            reader_interrupts(timeout, cancel, indefinite),
            |r, spec| r.wait_message(spec),
        )?;
        taken_now(r.try_take_message(|m| to_python(py, m)))?
            .ok_or_else(|| exception(r.not_ready_any_more()))?
    }

    /// Wait until the next message can be taken at once (then `dequeue(0)` takes it),
    /// without taking it: a message that arrives is kept for the next `dequeue`, so a
    /// wait that ends early (its timeout, its `cancel`, `shutdown()`) loses nothing. For
    /// a remote reader, and a local one's message larger than a chunk, this receives the
    /// message from its socket. Errors and "still waiting" warnings as `dequeue`'s.
    #[pyo3(signature = (timeout=None, cancel=None))]
    fn wait_message(
        &self,
        py: Python<'_>,
        timeout: Option<Timeout>,
        cancel: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.wait_for(py, timeout, cancel, |r, spec| r.wait_message(spec))
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
        let (_r, chunk) = blocking_on(
            py,
            &self.inner,
            READER,
            reader_interrupts(timeout, cancel, false),
            // SAFETY: no Rust borrow of the view's bytes outlives this call: the ShmView
            // below keeps only its pointer and the mapping's Arc, and `finish_read`
            // detaches (buffers still exported) or revokes it before `finish_chunk`.
            |r, spec| unsafe { r.acquire_chunk_unborrowed(spec) },
        )?;
        let Some(map) = chunk.private_map() else {
            // The message came over the socket and is gone after finish_read: a copy.
            return Ok(PyBytes::new(py, &chunk).into_any().unbind());
        };
        let (ptr, len) = (map.as_ptr(), map.len());
        // SAFETY: the range is the whole private mapping, which the view owns (via the
        // Arc); it stays mapped as long as any buffer of the view exists.
        let view = Py::new(py, unsafe { ShmView::new(map.clone(), ptr, len) })?;
        *lock(py, &self.open_chunk, READER)? = Some(view.clone_ref(py));
        Ok(view.into_any())
    }

    /// Give back the chunk from `acquire_read`; the writer's next message in it never
    /// shows through what was made of the view. Buffers that still hold the view (a
    /// memoryview slice) are detached first (given a private copy of the bytes); else the
    /// view is revoked (no new buffers) and its memory retired (zero pages in place), for
    /// a raw pointer kept without a buffer (numpy's `frombuffer` keeps one).
    fn finish_read(&self, py: Python<'_>) -> PyResult<()> {
        let end = match lock(py, &self.open_chunk, READER)?.take() {
            Some(view) if view.get().is_exported() => ChunkEnd::Detach,
            Some(view) => {
                view.get().revoke();
                ChunkEnd::Retire
            }
            None => ChunkEnd::Retire,
        };
        self.reader(py)?.finish_chunk(end).or_raise()
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

/// What a poisoned lock of a `Reader` calls it.
const READER: &str = "queue reader";

impl Reader {
    /// The core reader, locked (`RuntimeError` once a panic has poisoned it).
    fn reader(&self, py: Python<'_>) -> PyResult<BindingGuard<'_, CoreReader>> {
        lock(py, &self.inner, READER)
    }

    /// A wait of the core reader that returns nothing, as every blocking call runs it
    /// (the GIL released, its timeout and cancel event, another thread's hold of the
    /// reader waited for within them: [`blocking_on`]).
    fn wait_for<E, F>(
        &self,
        py: Python<'_>,
        timeout: Option<Timeout>,
        cancel: Option<&Bound<'_, PyAny>>,
        wait: F,
    ) -> PyResult<()>
    where
        E: Into<Error>,
        F: for<'w> FnMut(&mut CoreReader, WaitSpec<'w>) -> shmq::error::Result<(), E> + Send,
    {
        blocking_on(
            py,
            &self.inner,
            READER,
            reader_interrupts(timeout, cancel, false),
            wait,
        )
        .map(drop)
    }

    /// What `wait_any` watches for this reader's next message (`None`: a remote reader),
    /// waiting at most `timeout` for a reader another thread is using (`TimeoutError`).
    pub(crate) fn ready_target(
        &self,
        py: Python<'_>,
        timeout: Option<Timeout>,
    ) -> PyResult<Option<shmq::broadcast::wait_any::ReadyTarget>> {
        if !self.local {
            return Ok(None);
        }
        if let Some(r) = try_lock(&self.inner, READER)? {
            return Ok(shmq::broadcast::wait_any::ReadyTarget::of(&r));
        }
        let (r, ()) = blocking_on(
            py,
            &self.inner,
            READER,
            reader_interrupts(timeout, None, true),
            |_, _| Ok::<(), Error>(()),
        )?;
        Ok(shmq::broadcast::wait_any::ReadyTarget::of(&r))
    }
}

/// The terms of a reader's blocking call.
fn reader_interrupts<'a, 'py>(
    timeout: Option<Timeout>,
    cancel: Option<&'a Bound<'py, PyAny>>,
    quiet: bool,
) -> Interrupts<'a, 'py> {
    Interrupts {
        timeout,
        cancel,
        quiet,
    }
}
