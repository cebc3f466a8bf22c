//! Bindings for the encoder-cache hand-off (`shmq::encoder_cache`): `EncoderCacheProducer`,
//! `EncoderCacheReservation`, `EncoderCacheConsumer`. The Python package
//! (`shmq.encoder_cache`) pickles values into parts and runs saves on a background thread.

use std::sync::Arc;

use crate::errors::OrRaise;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyMemoryView};

use super::parts::{self, slices};
use super::view::ShmView;
use super::wait::{blocking, lock, BindingLock, Interrupts, Timeout};
use super::COPY_WITH_GIL_MAX;
use shmq::encoder_cache::{
    Consumer, LoadState, Producer, ProducerOptions, Reservation, DEFAULT_CAPACITY,
    DEFAULT_MAX_CONSUMERS, DEFAULT_MAX_ENTRIES,
};

fn state_name(s: LoadState) -> &'static str {
    match s {
        LoadState::Loaded => "loaded",
        LoadState::Pending => "pending",
        LoadState::Unknown => "unknown",
    }
}

/// Contiguous buffers of `parts`, and their spans (see [`parts::buffers`]).
fn buffers(parts: &Bound<'_, PyList>) -> PyResult<parts::Exports> {
    parts::buffers(parts, |i| format!("part {i} is not a contiguous buffer"))
}

/// Copy `parts` into `r`'s parts (their lengths were given to `reserve`).
fn fill(r: &mut Reservation, parts: &[&[u8]]) -> PyResult<()> {
    if parts.len() != r.parts().len()
        || parts.iter().zip(r.parts()).any(|(p, (_, n))| p.len() != *n)
    {
        return Err(PyValueError::new_err(
            "the parts do not have the lengths that were reserved",
        ));
    }
    for (i, p) in parts.iter().enumerate() {
        shmq::copy::copy_large(r.part_mut(i), p);
    }
    Ok(())
}

/// The producer side of an encoder cache (one segment, this process its only writer).
#[pyclass(module = "shmq._core", frozen, weakref)]
pub struct EncoderCacheProducer {
    producer: Producer,
}

impl EncoderCacheProducer {
    fn interrupts(timeout: Option<Timeout>) -> Interrupts<'static, 'static> {
        Interrupts {
            timeout,
            cancel: None,
            quiet: true,
        }
    }
}

#[pymethods]
impl EncoderCacheProducer {
    #[new]
    #[pyo3(signature = (name=None, capacity=DEFAULT_CAPACITY, max_entries=DEFAULT_MAX_ENTRIES, max_consumers=DEFAULT_MAX_CONSUMERS, min_consumers=0))]
    fn new(
        name: Option<&str>,
        capacity: usize,
        max_entries: usize,
        max_consumers: usize,
        min_consumers: usize,
    ) -> PyResult<Self> {
        let producer = Producer::create(
            name,
            ProducerOptions {
                capacity,
                max_entries,
                max_consumers,
                min_consumers,
            },
        )
        .or_raise()?;
        Ok(EncoderCacheProducer { producer })
    }

    /// The name consumers open it by.
    #[getter]
    fn name(&self) -> &str {
        self.producer.name()
    }
    /// The segment's name in /dev/shm.
    #[getter]
    fn segment_name(&self) -> &str {
        self.producer.segment_name()
    }
    #[getter]
    fn capacity(&self) -> usize {
        self.producer.capacity()
    }
    #[getter]
    fn max_entries(&self) -> usize {
        self.producer.max_entries()
    }

    /// Reserve room for an entry of parts of `part_lens` bytes under `key`, evicting
    /// loaded entries and waiting up to `timeout` while nothing can go (then
    /// `MemoryError`). None if the key is held or being saved.
    #[pyo3(signature = (key, part_lens, timeout=None))]
    fn reserve(
        &self,
        py: Python<'_>,
        key: &str,
        part_lens: Vec<usize>,
        timeout: Option<Timeout>,
    ) -> PyResult<Option<EncoderCacheReservation>> {
        let p = &self.producer;
        // The core tries once before it starts waiting: a cache with room does not wait.
        let what = format!("encoder cache '{}' waiting for room", p.name());
        let r = blocking(py, Self::interrupts(timeout), |spec| {
            p.reserve_with(key, &part_lens, &mut p.wait(&what, spec))
        })?;
        Ok(r.map(|r| EncoderCacheReservation {
            inner: BindingLock::new(Some(r)),
        }))
    }

    /// Save `parts` (bytes-like) under `key` now: reserve, copy, publish. False if the
    /// key is held already.
    #[pyo3(signature = (key, parts, timeout=None))]
    fn save(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &Bound<'_, PyList>,
        timeout: Option<Timeout>,
    ) -> PyResult<bool> {
        let lens: Vec<usize> = buffers(parts)?.1.iter().map(|s| s.1).collect();
        let Some(r) = self.reserve(py, key, lens, timeout)? else {
            return Ok(false);
        };
        r.fill_and_publish(py, parts)
    }

    /// Whether `key` is held and published.
    fn has(&self, key: &str) -> bool {
        self.producer.has(key)
    }

    /// The keys held, oldest first.
    fn keys(&self) -> Vec<String> {
        self.producer.keys()
    }

    /// Evict `key` now (its bytes stay until no consumer maps them). Whether it was held.
    fn evict(&self, key: &str) -> bool {
        self.producer.evict(key)
    }

    /// "loaded", "pending" or "unknown".
    fn load_state(&self, key: &str) -> &'static str {
        state_name(self.producer.load_state(key))
    }

    /// Wait until every live consumer has loaded `key` (`TimeoutError` after `timeout`,
    /// `KeyError` for a key not held).
    #[pyo3(signature = (key, timeout=None))]
    fn wait_loaded(&self, py: Python<'_>, key: &str, timeout: Option<Timeout>) -> PyResult<()> {
        let p = &self.producer;
        let what = format!(
            "waiting for the consumers of encoder cache '{}' to load key {key:?}",
            p.name()
        );
        blocking(py, Self::interrupts(timeout), |spec| {
            p.wait_loaded_with(key, &mut p.wait(&what, spec))
        })
    }

    /// Wait up to `timeout` until some of `keys` are no longer pending; those, with
    /// their state ("loaded" or "unknown"). Empty on timeout.
    #[pyo3(signature = (keys, timeout=None))]
    fn wait_any_loaded(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        timeout: Option<Timeout>,
    ) -> PyResult<Vec<(String, &'static str)>> {
        let p = &self.producer;
        let what = "waiting for encoder cache consumers";
        let done = blocking(py, Self::interrupts(timeout), |spec| {
            p.wait_any_loaded_with(&keys, &mut p.wait(what, spec))
        })?;
        Ok(done.into_iter().map(|(k, s)| (k, state_name(s))).collect())
    }

    /// Reclaim dead consumers' slots and free evicted entries nobody maps any more.
    fn sweep(&self) {
        self.producer.sweep()
    }

    /// `(slot, pid, alive, keys loaded)` of each consumer joined now.
    fn consumers(&self) -> Vec<(usize, u32, bool, u64)> {
        self.producer
            .consumers()
            .into_iter()
            .map(|c| (c.slot, c.process.pid, c.alive, c.loads))
            .collect()
    }

    /// Occupancy: entries, pending, zombies, bytes_in_use, reserved, capacity, saves,
    /// evictions.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.producer.stats();
        let d = PyDict::new(py);
        d.set_item("entries", s.entries)?;
        d.set_item("pending", s.pending)?;
        d.set_item("zombies", s.zombies)?;
        d.set_item("bytes_in_use", s.bytes_in_use)?;
        d.set_item("reserved", s.reserved)?;
        d.set_item("capacity", s.capacity)?;
        d.set_item("saves", s.saves)?;
        d.set_item("evictions", s.evictions)?;
        Ok(d)
    }

    /// Stop serving and remove the segment's name (consumers' views stay valid).
    fn close(&self) -> PyResult<()> {
        self.producer.close().or_raise()
    }

    /// Remove the segment's name now (at interpreter exit).
    fn unlink(&self) -> PyResult<()> {
        self.producer.unlink().or_raise()
    }
}

/// What a poisoned lock of an `EncoderCacheReservation` calls it.
const RESERVATION: &str = "encoder cache reservation";
/// What a poisoned lock of an `EncoderCacheConsumer` calls it.
const CONSUMER: &str = "encoder cache consumer";

/// Room for one entry: fill it and publish it (from any thread), or drop it.
#[pyclass(module = "shmq._core", frozen)]
pub struct EncoderCacheReservation {
    inner: BindingLock<Option<Reservation>>,
}

#[pymethods]
impl EncoderCacheReservation {
    /// `(offset, len)` of each part in the entry.
    #[getter]
    fn parts(&self, py: Python<'_>) -> PyResult<Vec<(usize, usize)>> {
        Ok(lock(py, &self.inner, RESERVATION)?
            .as_ref()
            .map(|r| r.parts().to_vec())
            .unwrap_or_default())
    }

    /// Copy `parts` (bytes-like, of the reserved lengths) in and publish the entry; the
    /// copy runs with the GIL released. False if the key was evicted meanwhile.
    fn fill_and_publish(&self, py: Python<'_>, parts: &Bound<'_, PyList>) -> PyResult<bool> {
        let (bufs, spans) = buffers(parts)?;
        let Some(mut r) = lock(py, &self.inner, RESERVATION)?.take() else {
            return Err(PyRuntimeError::new_err(
                "this reservation was published or abandoned already",
            ));
        };
        let total: usize = spans.iter().map(|s| s.1).sum();
        let run = move || -> PyResult<bool> {
            // SAFETY: `bufs` holds every export until after this call returns.
            let parts = unsafe { slices(&spans) };
            fill(&mut r, &parts)?;
            r.publish().or_raise()
        };
        let published = if total <= COPY_WITH_GIL_MAX {
            run()
        } else {
            py.detach(run)
        };
        drop(bufs);
        published
    }

    /// Give the room back without publishing.
    fn abandon(&self, py: Python<'_>) -> PyResult<()> {
        drop(lock(py, &self.inner, RESERVATION)?.take());
        Ok(())
    }
}

/// A consumer of one or more producers (or, `index_only`, a reader of their key
/// indexes, for `has` from any process).
#[pyclass(module = "shmq._core", frozen)]
pub struct EncoderCacheConsumer {
    inner: BindingLock<Option<Consumer>>,
}

impl EncoderCacheConsumer {
    fn with<T>(&self, py: Python<'_>, f: impl FnOnce(&mut Consumer) -> PyResult<T>) -> PyResult<T> {
        match lock(py, &self.inner, CONSUMER)?.as_mut() {
            Some(c) => f(c),
            None => Err(PyRuntimeError::new_err(
                "this encoder cache consumer is closed",
            )),
        }
    }
}

#[pymethods]
impl EncoderCacheConsumer {
    #[new]
    #[pyo3(signature = (producers, index_only=false))]
    fn new(producers: Vec<String>, index_only: bool) -> PyResult<Self> {
        let c = if index_only {
            Consumer::index_only(&producers).or_raise()?
        } else {
            Consumer::new(&producers).or_raise()?
        };
        Ok(EncoderCacheConsumer {
            inner: BindingLock::new(Some(c)),
        })
    }

    /// Whether some producer holds `key` now.
    fn has(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        self.with(py, |c| Ok(c.has(key)))
    }

    /// `key`'s parts as writable memoryviews of a private mapping (zero-copy; a write
    /// stays in this process), acknowledged to its producer; None if no producer holds
    /// it. The entry stays held until every view of it is gone.
    fn load<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(view) = self.with(py, |c| c.load(key).or_raise())? else {
            return Ok(None);
        };
        let view = Arc::new(view);
        let out = PyList::empty(py);
        for i in 0..view.n_parts() {
            let (ptr, len) = view.part_ptr(i);
            let held = view.clone();
            // SAFETY: the part lies in the entry view's own private mapping, which it
            // unmaps only when dropped, i.e. after the last buffer export of every
            // ShmView that holds it is gone. The mapping is private to this process, so
            // writes through the memoryview reach neither the producer nor other views.
            let sv = unsafe { ShmView::new(view.clone(), ptr, len) }
                .with_shared(Box::new(move || held.part_shared(i)));
            let sv = Bound::new(py, sv)?;
            out.append(PyMemoryView::from(sv.as_any())?)?;
        }
        Ok(Some(out))
    }

    /// Acknowledge `key` without mapping it; whether some producer held it.
    fn acknowledge(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        self.with(py, |c| c.acknowledge(key).or_raise())
    }

    /// `(segment name, open now)` for each producer.
    fn producers(&self, py: Python<'_>) -> PyResult<Vec<(String, bool)>> {
        self.with(py, |c| Ok(c.producers()))
    }

    /// Leave every producer (views already handed out stay valid and hold their
    /// entries until they are gone).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        drop(lock(py, &self.inner, CONSUMER)?.take());
        Ok(())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<EncoderCacheProducer>()?;
    m.add_class::<EncoderCacheReservation>()?;
    m.add_class::<EncoderCacheConsumer>()?;
    m.add(
        "ENCODER_CACHE_MAX_KEY_LEN",
        shmq::encoder_cache::key_index::MAX_KEY_LEN,
    )?;
    Ok(())
}
