//! Bindings for the object store: `BlockFifo` (the spec's `RingBuffer`) and `ObjectStore`.

use std::sync::Arc;

use crate::errors::{exception, OrRaise, PeerDiedError};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyInt, PyList, PyMemoryView, PyRange, PyString};

use super::parts;
use super::view::ShmView;
use super::wait::{lock, BindingGuard, BindingLock};
use super::COPY_WITH_GIL_MAX;
use shmq::alloc::{Freed, ID_MAX};
use shmq::broadcast::DeadReaderPolicy;
use shmq::error::{Error, HandleRefusal, StoreError};
use shmq::storage::{bad_signature_message, stale_object_message};
use shmq::storage::{
    check_signed, key_and_signature, object_reader_count, read_signed, read_signed_viewed,
    store_full_message, BlockFifo as CoreRing, BlockHeader, CountRead, FreeOldestFirst, KeptPart,
    ObjectStore as CoreStore, ReaderSlot, ReaderStatus, SignedHandle, StoreRole, StoreSegment,
    SIGNATURE_BYTES,
};

/// Call `f` on zero-copy memoryviews of `spans` (inside `segment`): one view, or a
/// list of views if `as_list`; release them afterwards. A callback that kept the memory
/// (returned a view, a slice of it, an array over it, the list...) is an error: the
/// block may be reused as soon as this returns.
fn with_views<'py, R>(
    py: Python<'py>,
    segment: &Arc<StoreSegment>,
    spans: impl ExactSizeIterator<Item = &'py [u8]>,
    as_list: bool,
    f: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<R>,
) -> PyResult<R> {
    let mut views = Vec::with_capacity(spans.len());
    for data in spans {
        // SAFETY: `data` lies inside the segment's ring; the Arc keeps it mapped. Another
        // process may write these bytes while Python reads them (the view is plain
        // memory, never freed under it); `read_object` checks the handle again after the
        // call and reports a reused object as modified.
        let view = unsafe { ShmView::new(segment.clone(), data.as_ptr() as *mut u8, data.len()) };
        let view = Bound::new(py, view)?;
        let mv = PyMemoryView::from(view.as_any())?.into_any();
        views.push((view, mv));
    }
    let arg = if as_list {
        PyList::new(py, views.iter().map(|(_, mv)| mv))?.into_any()
    } else {
        views[0].1.clone()
    };
    let out = f(&arg);
    drop(arg);
    let mut kept = false;
    for (view, mv) in views {
        // Kept: the memoryview itself (returned, or stored somewhere: a second
        // reference), or something made from it that still holds the buffer.
        // SAFETY: `mv` is a live object we hold a reference to.
        kept |= unsafe { pyo3::ffi::Py_REFCNT(mv.as_ptr()) } > 1;
        // Fails if something made from the view still holds it; `is_exported` sees that.
        let _ = mv.call_method0(pyo3::intern!(py, "release"));
        drop(mv);
        kept |= view.get().is_exported();
    }
    if out.is_ok() && kept {
        return Err(PyRuntimeError::new_err(KEPT_VIEW));
    }
    out
}

const KEPT_VIEW: &str = "the deserializer kept a view of the shared memory, which the store may \
                         reuse once get() returns; it must copy what it keeps";

/// A handle signature from Python: vLLM 0.33's rules (a list of 32 ints, each exactly
/// an `int` in 0..=255), and a `str` key. `None` for either is a missing signature, which
/// the core refuses first (`key_and_signature`, the rule its `SignedHandle::verify`
/// applies). Refusals are [`bad_signature`]s saying what was wrong.
fn signature_arg<'a, 'py>(
    key: Option<&'a Bound<'py, PyAny>>,
    signature: Option<&Bound<'py, PyAny>>,
) -> PyResult<(&'a str, [u8; SIGNATURE_BYTES])> {
    let (key_obj, signature) =
        key_and_signature(key, signature).map_err(|why| refused(key, why))?;
    let invalid = |why: String| bad_signature(false, key, &why);
    let list = signature.cast::<PyList>().map_err(|_| {
        invalid(format!(
            "the signature must be a list of {SIGNATURE_BYTES} ints (what get_signature \
             returns), got {}",
            type_name(signature)
        ))
    })?;
    let key = key_obj
        .cast::<PyString>()
        .map_err(|_| invalid(format!("the key must be a str, got {}", type_name(key_obj))))?;
    if list.len() != SIGNATURE_BYTES {
        return Err(invalid(format!(
            "the signature must be a list of {SIGNATURE_BYTES} ints, got a list of {}",
            list.len()
        )));
    }
    // On an error only (the checks below are the hot path's): which item is not a byte.
    let bad_item = |i: usize| {
        let item = list
            .get_item(i)
            .map_or_else(|_| "?".into(), |v| short_repr(&v));
        invalid(format!(
            "the signature must be a list of {SIGNATURE_BYTES} ints in 0..255, item {i} is {item}"
        ))
    };
    let mut bytes = [0u8; SIGNATURE_BYTES];
    for (i, b) in bytes.iter_mut().enumerate() {
        // A reader checks a signature on every get: read the items through the C API
        // (a few ns each) rather than pyo3's conversions.
        // SAFETY: `list` is a list of SIGNATURE_BYTES items (checked above) that we hold
        // a reference to, with the GIL; PyList_GetItem returns a borrowed reference that
        // stays valid while the list is not changed, and nothing runs Python code before
        // we are done with it (PyLong_CheckExact and PyLong_AsLong on an exact int do not).
        let value = unsafe {
            let item = pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t);
            if item.is_null() || pyo3::ffi::PyLong_CheckExact(item) == 0 {
                pyo3::ffi::PyErr_Clear();
                return Err(bad_item(i));
            }
            pyo3::ffi::PyLong_AsLong(item)
        };
        // -1 may also be an overflow error: out of range either way.
        *b = u8::try_from(value).map_err(|_| {
            // SAFETY: with the GIL; clears the OverflowError PyLong_AsLong may have set.
            unsafe { pyo3::ffi::PyErr_Clear() };
            bad_item(i)
        })?;
    }
    let key = key
        .to_str()
        .map_err(|_| invalid("the key is not valid UTF-8".into()))?;
    Ok((key, bytes))
}

/// A refused handle signature: `ValueError` with vLLM 0.33's message first ("Invalid SHM
/// handle signature for cache key", which its callers match), then the key (its repr)
/// and `why`.
fn bad_signature(missing: bool, key: Option<&Bound<'_, PyAny>>, why: &str) -> PyErr {
    let key = key.map(short_repr);
    PyValueError::new_err(bad_signature_message(missing, key.as_deref(), Some(why)))
}

/// The store's refusal of a handle `key` (the caller's object) brought.
fn refused(key: Option<&Bound<'_, PyAny>>, why: HandleRefusal) -> PyErr {
    bad_signature(why.is_missing(), key, &why.to_string())
}

/// `r`'s error as Python sees it: a refused signature names `key` (the caller's object),
/// the others as everywhere.
fn or_refused<T>(r: shmq::error::Result<T>, key: Option<&Bound<'_, PyAny>>) -> PyResult<T> {
    match r {
        Err(Error::Store(StoreError::BadSignature { why: Some(why), .. })) => {
            Err(refused(key, why))
        }
        other => other.or_raise(),
    }
}

/// `v`'s repr, cut to a readable length (keys can be long).
fn short_repr(v: &Bound<'_, PyAny>) -> String {
    const MAX_CHARS: usize = 80;
    let r = v
        .repr()
        .map_or_else(|_| "<no repr>".into(), |r| r.to_string());
    if r.chars().count() <= MAX_CHARS {
        r
    } else {
        format!("{}...", r.chars().take(MAX_CHARS).collect::<String>())
    }
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// The address and id of a handle to sign or check: out-of-range integers cannot have
/// been signed (vLLM signs them as u64 and u32).
fn signed_handle(
    key: Option<&Bound<'_, PyAny>>,
    address: &Bound<'_, PyAny>,
    id: &Bound<'_, PyAny>,
) -> PyResult<(u64, u32)> {
    match (int_in_range::<u64>(address), int_in_range::<u32>(id)) {
        (Ok(Some(a)), Ok(Some(i))) => Ok((a, i)),
        _ => Err(unsignable_handle(key, address, id)),
    }
}

/// The refusal of a handle whose address or id is not an int in range (u64, u32).
fn unsignable_handle(
    key: Option<&Bound<'_, PyAny>>,
    address: &Bound<'_, PyAny>,
    id: &Bound<'_, PyAny>,
) -> PyErr {
    bad_signature(
        false,
        key,
        &format!(
            "the handle (address {}, id {}) cannot have been signed: the address must be an \
             int in 0..2**64 and the id an int in 0..2**32",
            short_repr(address),
            short_repr(id)
        ),
    )
}

/// The freed ids as a `range`, or a list when they wrap at 2**31.
fn freed_ids(py: Python<'_>, freed: Freed) -> PyResult<Py<PyAny>> {
    let (first, count) = (freed.first_id as isize, freed.count as isize);
    if first + count <= ID_MAX as isize {
        Ok(PyRange::new(py, first, first + count)?.into_any().unbind())
    } else {
        Ok(PyList::new(py, freed.ids())?.into_any().unbind())
    }
}

/// `Some(v)` for an int that fits `T`, `None` for one that does not; other types fail.
fn int_in_range<'py, T>(v: &Bound<'py, PyAny>) -> PyResult<Option<T>>
where
    T: for<'a> FromPyObject<'a, 'py>,
{
    if !v.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "expected an int, got {}",
            v.get_type().name()?
        )));
    }
    Ok(v.extract::<T>().ok())
}

/// The store's ring segment, writer or reader side.
#[pyclass(module = "shmq._core", frozen, weakref)]
pub struct BlockFifo {
    segment: Arc<StoreSegment>,
    /// Fixed at open: read without the lock.
    is_writer: bool,
    inner: BindingLock<CoreRing>,
}

impl BlockFifo {
    fn wrap(ring: CoreRing) -> BlockFifo {
        BlockFifo {
            segment: ring.segment().clone(),
            is_writer: ring.is_writer(),
            inner: BindingLock::new(ring),
        }
    }

    /// The core ring, locked (`RuntimeError` once a panic has poisoned it).
    fn ring(&self, py: Python<'_>) -> PyResult<BindingGuard<'_, CoreRing>> {
        lock(py, &self.inner, "ring buffer")
    }
}

#[pymethods]
impl BlockFifo {
    /// Create a ring of `capacity` bytes; this process is its writer.
    #[staticmethod]
    #[pyo3(signature = (capacity, name=None))]
    fn create(capacity: u64, name: Option<&str>) -> PyResult<BlockFifo> {
        Ok(Self::wrap(CoreRing::create(capacity, name).or_raise()?))
    }

    /// Open an existing ring as a reader; `capacity`, if given, must match.
    #[staticmethod]
    #[pyo3(signature = (name, capacity=None))]
    fn open(name: &str, capacity: Option<u64>) -> PyResult<BlockFifo> {
        Ok(Self::wrap(CoreRing::open(name, capacity).or_raise()?))
    }

    #[getter]
    fn name(&self) -> &str {
        self.segment.name()
    }
    #[getter]
    fn capacity(&self) -> u64 {
        self.segment.capacity()
    }
    /// The bytes of `buf()` (the ring's capacity).
    #[getter]
    fn size(&self) -> u64 {
        self.segment.capacity()
    }
    #[getter]
    fn is_writer(&self) -> bool {
        self.is_writer
    }
    #[getter]
    fn creator_pid(&self) -> u32 {
        self.segment.creator_pid()
    }

    /// `(data_buffer_start, data_buffer_end, monotonic_id_start, monotonic_id_end)` on
    /// the writer; `None` on a reader.
    fn state(&self, py: Python<'_>) -> PyResult<Option<(u64, u64, u32, u32)>> {
        let r = self.ring(py)?;
        Ok(r.allocator()
            .map(|a| (a.start(), a.end(), a.id_start(), a.id_end())))
    }

    /// Live blocks on the writer as a dict id → address.
    fn live<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        if let Some(a) = self.ring(py)?.allocator() {
            for c in a.live() {
                d.set_item(c.id, c.address)?;
            }
        }
        Ok(d)
    }

    /// Address of the live block `id` (writer side).
    fn block_address(&self, py: Python<'_>, id: i64) -> PyResult<Option<u64>> {
        let Ok(id) = u32::try_from(id) else {
            return Ok(None);
        };
        Ok(self
            .ring(py)?
            .allocator()
            .and_then(|a| a.get(id))
            .map(|c| c.address))
    }

    /// Number of live blocks (writer side; 0 on a reader).
    fn live_len(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.ring(py)?.allocator().map_or(0, |a| a.live().len()))
    }

    /// Allocate a block with `size` bytes of data: `(address, id)`.
    fn allocate(&self, py: Python<'_>, size: i64) -> PyResult<(u64, u32)> {
        // Negative sizes are as invalid as 0 (which the core rejects with the message).
        let c = self
            .ring(py)?
            .allocate(u64::try_from(size).unwrap_or(0))
            .or_raise()?;
        Ok((c.address, c.id))
    }

    /// `(id, size)` of the block at `address` (bounds-checked).
    fn header(&self, address: &Bound<'_, PyAny>) -> PyResult<(u32, u32)> {
        let h = self.header_at(address)?;
        Ok((h.id, h.size))
    }

    /// A view of the data of the block at `address` (bounds-checked).
    fn data(&self, address: &Bound<'_, PyAny>) -> PyResult<ShmView> {
        let h = self.header_at(address)?;
        let (p, n) = self.segment.data_ptr(&h);
        // SAFETY: header_at checked the block lies in the ring; the Arc keeps it mapped.
        Ok(unsafe { ShmView::new(self.segment.clone(), p, n) })
    }

    /// A view of the whole ring (`shared_memory.buf`), reserved in /dev/shm first
    /// (`MemoryError` when there is no room).
    fn buf(&self) -> PyResult<ShmView> {
        let (p, n) = self.segment.ring_bytes().or_raise()?;
        // SAFETY: `ring_bytes` is the ring inside this process's mapping, which the Arc
        // keeps alive as long as the view. Peers (the writer, readers' counts) may change
        // any byte under it, which a byte view tolerates; shmq checks what it reads from
        // the ring itself (headers, bounds, signatures), never trusting this view.
        Ok(unsafe { ShmView::new(self.segment.clone(), p, n) })
    }

    /// Free blocks oldest first while `is_free(id, memoryview)` is true and fewer than
    /// `nbytes` bytes have been freed; returns the freed ids. `is_free` runs with the
    /// ring unlocked (it may use the ring and its store): only blocks live at the start
    /// are asked about, and only a block `is_free` approved is freed (see
    /// `FreeOldestFirst`). An exception from `is_free` propagates; what it approved
    /// before stays freed.
    #[pyo3(signature = (is_free, nbytes=None))]
    fn free(
        &self,
        py: Python<'_>,
        is_free: &Bound<'_, PyAny>,
        nbytes: Option<u64>,
    ) -> PyResult<Py<PyAny>> {
        let mut run =
            FreeOldestFirst::new(&*self.ring(py)?, nbytes.unwrap_or(u64::MAX)).or_raise()?;
        loop {
            // Each statement takes the lock and lets it go.
            let next = run.next(&*self.ring(py)?).or_raise()?;
            let Some(block) = next else { break };
            let data = self.segment.block_data(&block);
            let approved = with_views(py, &self.segment, std::iter::once(data), false, |mv| {
                is_free.call1((block.id, mv))?.is_truthy()
            })?;
            if !approved || !run.free(&mut *self.ring(py)?, &block).or_raise()? {
                break;
            }
        }
        match run.consecutive() {
            Some(freed) => freed_ids(py, freed),
            None => Ok(PyList::new(py, run.freed_ids())?.into_any().unbind()),
        }
    }

    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        self.ring(py)?.clear().or_raise()
    }

    /// The handle-signing secret (32 bytes).
    fn secret<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.segment.secret())
    }

    /// Remove the segment's name now if this process created it (the memory stays
    /// mapped for whoever has it); for cleanup at interpreter exit.
    fn unlink(&self) -> PyResult<()> {
        self.segment.unlink().or_raise()
    }
}

impl BlockFifo {
    /// The block header at a Python `address`: any int (negative or huge ones name no
    /// block: the same `ValueError` as an address out of the ring, as the docs promise,
    /// not pyo3's `OverflowError`); `TypeError` for anything else.
    fn header_at(&self, address: &Bound<'_, PyAny>) -> PyResult<BlockHeader> {
        match int_in_range::<u64>(address)? {
            Some(a) => Ok(self.segment.header_at(a).or_raise()?),
            None => Err(PyValueError::new_err(format!(
                "no chunk can be at address {address}"
            ))),
        }
    }
}

/// A reader slot as `ObjectStore.readers()` gives it: `(slot, pid, status, reads)`.
type ReaderRow = (usize, Option<u32>, &'static str, u64);

/// Key → object store on a `BlockFifo`; payloads are already-serialized bytes.
#[pyclass(module = "shmq._core", frozen)]
pub struct ObjectStore {
    ring: Py<BlockFifo>,
    segment: Arc<StoreSegment>,
    inner: BindingLock<CoreStore>,
    /// Fixed at creation: read without the lock.
    role: StoreRole,
    /// A reader's slot (`None`: the writer, or a reader that found none and reads
    /// anonymously); left by `close()`.
    slot: Option<ReaderSlot>,
}

#[pymethods]
impl ObjectStore {
    /// The writer's store, or a reader's (which takes a reader slot: see
    /// `shmq::storage::ReaderSlot`). `on_dead_reader` ("raise" or "drop") is what the
    /// writer's put does about a reader that died holding the room.
    #[new]
    #[pyo3(signature = (ring, max_object_size, n_readers, count_writer_reads=false, on_dead_reader="raise"))]
    fn new(
        ring: Py<BlockFifo>,
        max_object_size: u64,
        n_readers: u32,
        count_writer_reads: bool,
        on_dead_reader: &str,
    ) -> PyResult<Self> {
        let policy = on_dead_reader.parse::<DeadReaderPolicy>().or_raise()?;
        let r = ring.get();
        let segment = r.segment.clone();
        let role = StoreRole {
            is_writer: r.is_writer,
            count_writer_reads,
        };
        let mut store = CoreStore::new(max_object_size, n_readers).or_raise()?;
        store.set_on_dead_reader(policy);
        // A reader that cannot take a slot (none free, or its lock cannot be had here)
        // reads anonymously, as readers did before slots: opening never fails for it.
        let slot = if role.is_writer {
            None
        } else {
            ReaderSlot::take(&segment, n_readers).ok().flatten()
        };
        Ok(ObjectStore {
            ring,
            segment,
            inner: BindingLock::new(store),
            role,
            slot,
        })
    }

    /// Store an object made of `parts` (bytes-like, C-contiguous) under `key`; parts
    /// from `align_from` on start at 64-byte boundaries of the ring.
    fn put(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &Bound<'_, PyList>,
        align_from: usize,
    ) -> PyResult<(u64, u32)> {
        let (buffers, spans) = parts::buffers(parts, |i| {
            format!("part {i} of the object is not C-contiguous")
        })?;
        let total: usize = spans.iter().map(|s| s.1).sum();
        let (r, dead) = {
            let (mut ring, mut store) = self.ring_and_store(py)?;
            let (store, ring) = (&mut *store, &mut *ring);
            let mut put = move || {
                // SAFETY: each span is a live, C-contiguous buffer export held by
                // `buffers` until the end of this call; the exporters cannot free it
                // meanwhile.
                let slices = unsafe { parts::slices(&spans) };
                let r = store.put(ring, key, &slices, align_from);
                (r, store.dead_reader().is_some())
            };
            if total > COPY_WITH_GIL_MAX {
                py.detach(put)
            } else {
                put()
            }
        };
        // Released with the locks let go: an exporter's release may run Python code.
        drop(buffers);
        match r {
            // The store's words (no ring advice to call free_buf()); a reader that died
            // holding the room is a PeerDiedError (the Python store makes it a MemoryError
            // too, as vLLM's callers expect of a full store).
            Err(Error::Store(StoreError::Full(full))) if dead => {
                Err(PeerDiedError::new_err(store_full_message(&full)))
            }
            Err(Error::Store(StoreError::Full(full))) => {
                Err(PyMemoryError::new_err(store_full_message(&full)))
            }
            other => other.or_raise(),
        }
    }

    /// Writer: `nbytes` of a new block to fill in place; `put` of an object whose buffer
    /// is exactly this memory writes the rest around it (no copy). `None` if the ring
    /// has no room for it.
    fn loan(&self, py: Python<'_>, nbytes: u64) -> PyResult<Option<ShmView>> {
        let (mut ring, mut store) = self.ring_and_store(py)?;
        match store.loan(&mut ring, nbytes) {
            Ok(loan) => {
                let loan = Arc::new(loan);
                let (ptr, len) = (loan.as_ptr(), loan.len());
                // SAFETY: the loan is `len` bytes at `ptr` of the ring, which its block
                // pin and the segment it holds keep mapped and unreused while it lives.
                Ok(Some(unsafe { ShmView::new(loan, ptr, len) }))
            }
            Err(Error::Store(StoreError::Full(_))) => Ok(None),
            Err(e) => Err(exception(e)),
        }
    }

    /// Read the object at `(address, id)`. A reader first checks the handle's signature
    /// (`key`, `signature`). `deserialize` gets a memoryview of the object's bytes (its
    /// parts, contiguous), or with `split` a list of one memoryview per part. The read
    /// is counted on a reader, or on the writer if `count_writer_reads`.
    ///
    /// With `view_from` (and `split`), the parts after the first are the caller's to
    /// keep: those of `view_from` bytes or more are private copy-on-write views of the
    /// shared memory (the object stays while any lives), smaller ones copies.
    #[pyo3(signature = (address, id, signature, key, deserialize, split, view_from=None))]
    #[allow(clippy::too_many_arguments)] // the Python call's arguments, one by one
    fn get(
        &self,
        py: Python<'_>,
        address: &Bound<'_, PyAny>,
        id: &Bound<'_, PyAny>,
        signature: Option<&Bound<'_, PyAny>>,
        key: Option<&Bound<'_, PyAny>>,
        deserialize: &Bound<'_, PyAny>,
        split: bool,
        view_from: Option<usize>,
    ) -> PyResult<Py<PyAny>> {
        let handle = (int_in_range::<u64>(address)?, int_in_range::<u32>(id)?);
        // A reader's key and signature, as the core takes them (it checks them before
        // touching the address, where the role checks signatures); integers out of range
        // cannot have been signed. The writer's are not looked at.
        let given = if self.role.checks_signatures() {
            let (key_str, signature) = signature_arg(key, signature)?;
            if handle.0.is_none() || handle.1.is_none() {
                return Err(unsignable_handle(key, address, id));
            }
            Some((key_str, signature))
        } else {
            None
        };
        // Integers out of range (negative, huge) name no object: the same ValueError.
        let (Some(a), Some(i)) = handle else {
            return Err(PyValueError::new_err(stale_object_message(address, id)));
        };
        let signed = SignedHandle {
            key: given.as_ref().map(|g| g.0),
            address: a,
            id: i,
            signature: given.as_ref().map(|g| &g.1[..]),
        };
        let (role, count) = (self.role, self.count());
        if let (Some(view_from), true) = (view_from, split) {
            let read = read_signed_viewed(&self.segment, role, signed, count, |object, views| {
                if object.is_empty() {
                    return with_views(py, &self.segment, std::iter::empty(), true, |arg| {
                        Ok(deserialize.call1((arg,))?.unbind())
                    });
                }
                let list = PyList::empty(py);
                list.append(py.None())?;
                for part in views.kept_parts(object, view_from) {
                    match part.or_raise()? {
                        KeptPart::View(v) => {
                            let v = Arc::new(v);
                            let (ptr, len) = (v.as_ptr(), v.len());
                            // SAFETY: the private mapping is `len` bytes at `ptr`, alive as
                            // long as `v`, which the view owns.
                            let view = Bound::new(py, unsafe { ShmView::new(v, ptr, len) })?;
                            list.append(PyMemoryView::from(view.as_any())?)?;
                        }
                        KeptPart::Copy(bytes) => list.append(PyByteArray::new(py, bytes))?,
                    }
                }
                with_views(
                    py,
                    &self.segment,
                    std::iter::once(object.part(0)),
                    false,
                    |head| {
                        list.set_item(0, head)?;
                        let out = deserialize.call1((&list,));
                        // The first part is read in place: let the list not keep it.
                        list.set_item(0, py.None())?;
                        Ok(out?.unbind())
                    },
                )
            });
            return or_refused(read, key)?;
        }
        let read = read_signed(&self.segment, role, signed, count, |object| {
            let spans: Vec<&[u8]> = if split {
                (0..object.len()).map(|k| object.part(k)).collect()
            } else {
                vec![object.span()]
            };
            with_views(py, &self.segment, spans.into_iter(), split, |arg| {
                Ok(deserialize.call1((arg,))?.unbind())
            })
        });
        or_refused(read, key)?
    }

    /// `touch(key, address, id, signature)`: on a writer without a reader lock, keep
    /// `key`'s object from eviction until `get_cached(key)` or `release_touches()`;
    /// otherwise check the handle (signature, then that it still names its object).
    #[pyo3(signature = (key, address, id, signature))]
    fn touch(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        address: &Bound<'_, PyAny>,
        id: &Bound<'_, PyAny>,
        signature: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        if self.role.touch_protects() {
            if let Ok(key) = key.cast::<PyString>() {
                self.store(py)?.touch(key.to_str()?);
            }
            return Ok(());
        }
        if self.role.checks_current_entry() {
            // The writer that counts its reads: the handle must be the key's current one.
            self.verify_current_entry(py, Some(key), address, id)?;
        }
        let (key_str, signature) = signature_arg(Some(key), signature)?;
        let (a, i) = signed_handle(Some(key), address, id)?;
        let signed = SignedHandle::new(key_str, a, i, &signature);
        or_refused(check_signed(&self.segment, signed), Some(key))
    }

    /// vLLM's `verify_signature`: on the writer the handle must also be the key's
    /// current entry; `ValueError` ("SHM handle signature") if it is not valid.
    #[pyo3(signature = (key, address, id, signature))]
    fn verify_signature(
        &self,
        py: Python<'_>,
        key: Option<&Bound<'_, PyAny>>,
        address: &Bound<'_, PyAny>,
        id: &Bound<'_, PyAny>,
        signature: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        if self.role.checks_current_entry() {
            self.verify_current_entry(py, key, address, id)?;
        }
        let (key_str, signature) = signature_arg(key, signature)?;
        let (a, i) = signed_handle(key, address, id)?;
        or_refused(
            SignedHandle::new(key_str, a, i, &signature).verify(&self.segment),
            key,
        )
    }

    /// The signature of `key`'s current handle, as 32 ints; `KeyError` if unknown.
    fn get_signature(&self, py: Python<'_>, key: &str) -> PyResult<Vec<u32>> {
        self.store(py)?
            .signature(&self.segment, key)
            .map(|s| s.map(u32::from).to_vec())
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(key.to_owned()))
    }

    /// Sign an arbitrary handle (for tests of what readers do with odd handles).
    fn _sign(&self, key: &str, address: u64, id: u32) -> Vec<u32> {
        self.segment.sign(key, address, id).map(u32::from).to_vec()
    }

    fn release_touches(&self, py: Python<'_>) -> PyResult<()> {
        self.store(py)?.release_touches();
        Ok(())
    }

    /// Ids the writer has touched and not yet handed out again or released.
    fn touched(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let store = self.store(py)?;
        Ok(store
            .entries()
            .map(|(_, e)| e.id)
            .filter(|&i| store.is_touched(i))
            .collect())
    }

    /// How many reads the object at `(address, id)` has had.
    fn reader_count(&self, address: &Bound<'_, PyAny>, id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let (Some(a), Some(i)) = (int_in_range::<u64>(address)?, int_in_range::<u32>(id)?) else {
            return Err(PyValueError::new_err(stale_object_message(address, id)));
        };
        object_reader_count(&self.segment, a, i).or_raise()
    }

    /// Whether `key` has an object; `ValueError` if the store was truncated (its
    /// objects are lost).
    fn is_cached(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        self.store(py)?.is_cached(&self.segment, key).or_raise()
    }

    /// Hand the object out once more: `(address, id)`; `KeyError` if unknown,
    /// `ValueError` if the store was truncated.
    fn get_cached(&self, py: Python<'_>, key: &str) -> PyResult<(u64, u32)> {
        self.store(py)?
            .get_cached(&self.segment, key)
            .or_raise()?
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(key.to_owned()))
    }

    fn free_unused(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let (mut ring, mut store) = self.ring_and_store(py)?;
        let freed = store.free_unused(&mut ring).or_raise()?;
        freed_ids(py, freed)
    }

    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        let (mut ring, mut store) = self.ring_and_store(py)?;
        store.clear(&mut ring).or_raise()
    }

    /// `(address, id, handouts)` of `key`'s object, if stored (writer side).
    fn entry(&self, py: Python<'_>, key: &str) -> PyResult<Option<(u64, u32, u32)>> {
        Ok(self
            .store(py)?
            .entry(key)
            .map(|e| (e.address, e.id, e.handouts)))
    }

    /// The key of the object with id `id`, if stored (writer side).
    fn key_of(&self, py: Python<'_>, id: i64) -> PyResult<Option<String>> {
        let Ok(id) = u32::try_from(id) else {
            return Ok(None);
        };
        Ok(self.store(py)?.key_of(id).map(str::to_owned))
    }

    /// Number of stored objects (writer side).
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.store(py)?.len())
    }

    /// vLLM's `increment_writer_flag`: one more hand-out of the object `id`.
    fn increment_writer_flag(&self, py: Python<'_>, id: i64) -> PyResult<()> {
        let found = match u32::try_from(id) {
            Ok(id) => self.store(py)?.hand_out(&self.segment, id),
            Err(_) => false,
        };
        if found {
            Ok(())
        } else {
            Err(pyo3::exceptions::PyKeyError::new_err(id))
        }
    }

    /// vLLM's `default_is_free_check(id, buf)`: `buf` is the block's data (a view from
    /// the ring); true if the object is not touched and every reader has read it as
    /// often as it was handed out.
    fn is_free(&self, py: Python<'_>, id: i64, buf: &Bound<'_, PyAny>) -> PyResult<bool> {
        let buffer = PyUntypedBuffer::get(buf)?;
        let Ok(id) = u32::try_from(id) else {
            return Ok(true);
        };
        let (p, n) = (buffer.buf_ptr() as usize, buffer.len_bytes());
        self.store(py)?
            .is_free_at(&self.segment, id, p, n)
            .or_raise()
    }

    /// `{key: (address, id, handouts)}` of the live objects (writer side).
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, e) in self.store(py)?.entries() {
            d.set_item(k, (e.address, e.id, e.handouts))?;
        }
        Ok(d)
    }

    #[getter]
    fn max_object_size(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.store(py)?.max_object_size())
    }
    #[getter]
    fn n_readers(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(self.store(py)?.n_readers())
    }
    #[getter]
    fn is_writer(&self) -> bool {
        self.role.is_writer
    }

    /// `"raise"` or `"drop"`: what the writer's put does about a reader that died
    /// holding the room.
    #[getter]
    fn on_dead_reader(&self, py: Python<'_>) -> PyResult<&'static str> {
        Ok(match self.store(py)?.on_dead_reader() {
            DeadReaderPolicy::Raise => "raise",
            DeadReaderPolicy::Drop => "drop",
        })
    }

    /// A reader's slot, `None` if it reads anonymously (and on the writer).
    #[getter]
    fn reader_slot(&self) -> Option<usize> {
        self.slot.as_ref().map(ReaderSlot::index)
    }

    /// Writer: reader slots dropped after their readers died.
    fn dropped_readers(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        Ok(self.store(py)?.dropped_readers())
    }

    /// The reader slots as this process sees them: `(slot, pid or None, status, reads)`,
    /// status one of "empty", "attaching", "alive", "unknown" (alive as far as can be
    /// told), "left", "dead", "dropped". Only the writer can tell "dead" (and "dropped").
    fn readers(&self, py: Python<'_>) -> PyResult<Vec<ReaderRow>> {
        let store = self.store(py)?;
        Ok(store
            .readers(&self.segment)
            .into_iter()
            .map(|r| {
                let status = match r.status {
                    ReaderStatus::Empty => "empty",
                    ReaderStatus::Attaching => "attaching",
                    ReaderStatus::Alive { known: true } => "alive",
                    ReaderStatus::Alive { known: false } => "unknown",
                    ReaderStatus::Left => "left",
                    ReaderStatus::Dead => "dead",
                    ReaderStatus::Dropped => "dropped",
                };
                (r.slot, r.process.map(|p| p.pid), status, r.reads)
            })
            .collect())
    }

    /// A reader gives its slot back (the writer does not take it for a dead one).
    /// Idempotent; a no-op on the writer.
    fn close(&self) {
        if let Some(slot) = &self.slot {
            slot.leave();
        }
    }
}

impl ObjectStore {
    /// How this process's gets count: a reader in its slot (anonymously without one), the
    /// writer only when it counts its own reads.
    fn count(&self) -> CountRead {
        match &self.slot {
            Some(slot) => slot.count(),
            None => self.role.counts_reads().into(),
        }
    }

    /// The core store, locked (`RuntimeError` once a panic has poisoned it).
    fn store(&self, py: Python<'_>) -> PyResult<BindingGuard<'_, CoreStore>> {
        lock(py, &self.inner, "object store")
    }

    /// The ring's lock and the store's, in that order: the order everywhere a call
    /// takes both.
    fn ring_and_store<'a>(
        &'a self,
        py: Python<'_>,
    ) -> PyResult<(BindingGuard<'a, CoreRing>, BindingGuard<'a, CoreStore>)> {
        let ring = self.ring.get().ring(py)?;
        let store = self.store(py)?;
        Ok((ring, store))
    }

    /// The writer's first check of a handle a request brings back (vLLM's
    /// `verify_signature` on the writer): it must be `key`'s current object.
    fn verify_current_entry(
        &self,
        py: Python<'_>,
        key: Option<&Bound<'_, PyAny>>,
        address: &Bound<'_, PyAny>,
        id: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        // A key that is not a str (or not valid UTF-8) has no entry. The store is locked
        // for the lookup only: the refusals below run Python (reprs).
        let current = match key {
            None => Err(HandleRefusal::NoKey),
            Some(k) => match k.cast::<PyString>().ok().and_then(|k| k.to_str().ok()) {
                Some(k) => self.store(py)?.current(Some(k)).copied(),
                None => Err(HandleRefusal::NoEntry),
            },
        }
        .map_err(|why| refused(key, why))?;
        let handle = signed_handle(key, address, id)?;
        current
            .check_handle(handle)
            .map_err(|why| refused(key, why))
    }
}
