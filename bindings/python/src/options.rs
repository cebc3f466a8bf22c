//! Binding for a queue's options (`shmq._core.QueueOptions`): the options a writer or a
//! relay is made with, as Python spells them, each converted and checked once here; an
//! option not given keeps the core's default ([`shmq::QueueOptions::default`]), which the
//! getters show.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::errors::OrRaise;
use crate::wait::wait_policy;
use shmq::broadcast::ring::DeadReaderPolicy;
use shmq::remote::{LostReaderPolicy, RemoteOptions, SlowReaderPolicy};
use shmq::QueueOptions as CoreOptions;

/// A queue's options. Each given one is checked when the object is made (`TypeError` or
/// `ValueError` naming the option); one not given keeps the core's default.
#[pyclass(module = "shmq._core", frozen, from_py_object)]
#[derive(Clone, Default)]
pub struct QueueOptions {
    local_reader_ranks: Option<Vec<usize>>,
    max_chunk_bytes: Option<usize>,
    max_chunks: Option<usize>,
    connect_ip: Option<String>,
    spin_us: Option<f64>,
    yield_us: Option<f64>,
    on_dead_reader: Option<DeadReaderPolicy>,
    arena_bytes: Option<usize>,
    arena_threshold: Option<usize>,
    remote_hwm: Option<i32>,
    slow_remote_reader: Option<SlowReaderPolicy>,
    remote_max_queued_bytes: Option<u64>,
    name: Option<String>,
    on_lost_remote_reader: Option<LostReaderPolicy>,
}

/// A count or size argument as an int of at least `minimum` and at most `maximum`:
/// `TypeError` for anything but an int (a bool included), `ValueError` naming the
/// argument for one out of range (PyO3's own conversion would say `OverflowError: can't
/// convert negative int to unsigned`, naming nothing). Python's own count arguments
/// (`MessageQueue`'s `n_reader`, `ShmRingBuffer`'s) go through it too: one rule.
#[pyfunction]
#[pyo3(signature = (value, name, unit, minimum=1, maximum=9_223_372_036_854_775_807))]
pub(crate) fn count(
    value: &Bound<'_, PyAny>,
    name: &str,
    unit: &str,
    minimum: i128,
    maximum: i128,
) -> PyResult<i128> {
    let is_int =
        !value.is_instance_of::<pyo3::types::PyBool>() && value.get_type().hasattr("__index__")?;
    if !is_int {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {} ({})",
            value.get_type().name()?,
            value.repr()?
        )));
    }
    let index = value.call_method0("__index__")?;
    let n: i128 = match index.extract() {
        Ok(n) => n,
        // Beyond 128 bits: out of range either way.
        Err(_) if index.gt(0)? => i128::MAX,
        Err(_) => i128::MIN,
    };
    if n < minimum {
        let kind = if minimum == 1 {
            "positive"
        } else {
            "non-negative"
        };
        let shown = if n == i128::MIN {
            index.str()?.to_string()
        } else {
            n.to_string()
        };
        return Err(PyValueError::new_err(format!(
            "{name} must be a {kind} number of {unit}, got {shown}"
        )));
    }
    if n > maximum {
        let shown = if n == i128::MAX {
            index.str()?.to_string()
        } else {
            n.to_string()
        };
        return Err(PyValueError::new_err(format!(
            "{name} must be at most {maximum} {unit}, got {shown}"
        )));
    }
    Ok(n)
}

/// `count` of an optional argument, as `T` (`None` stays `None`).
fn optional_count<T: TryFrom<i128>>(
    value: Option<&Bound<'_, PyAny>>,
    name: &str,
    unit: &str,
    minimum: i128,
    maximum: i128,
) -> PyResult<Option<T>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    let n = count(value, name, unit, minimum, maximum)?;
    Ok(Some(T::try_from(n).map_err(|_| {
        PyValueError::new_err(format!("{name} must be at most {maximum} {unit}, got {n}"))
    })?))
}

/// The largest count a `usize` option holds (`i64::MAX`, as Python's `sys.maxsize`).
const MAX_COUNT: i128 = i64::MAX as i128;

#[pymethods]
impl QueueOptions {
    #[new]
    #[pyo3(signature = (*, local_reader_ranks=None, max_chunk_bytes=None, max_chunks=None, connect_ip=None, spin_us=None, yield_us=None, on_dead_reader=None, arena_bytes=None, arena_threshold=None, remote_hwm=None, slow_remote_reader=None, remote_max_queued_bytes=None, name=None, on_lost_remote_reader=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        local_reader_ranks: Option<&Bound<'_, PyAny>>,
        max_chunk_bytes: Option<&Bound<'_, PyAny>>,
        max_chunks: Option<&Bound<'_, PyAny>>,
        connect_ip: Option<String>,
        spin_us: Option<f64>,
        yield_us: Option<f64>,
        on_dead_reader: Option<&str>,
        arena_bytes: Option<&Bound<'_, PyAny>>,
        arena_threshold: Option<&Bound<'_, PyAny>>,
        remote_hwm: Option<&Bound<'_, PyAny>>,
        slow_remote_reader: Option<&str>,
        remote_max_queued_bytes: Option<&Bound<'_, PyAny>>,
        name: Option<&Bound<'_, PyAny>>,
        on_lost_remote_reader: Option<&str>,
    ) -> PyResult<QueueOptions> {
        let local_reader_ranks = match local_reader_ranks.filter(|r| !r.is_none()) {
            None => None,
            Some(r) => Some(ranks(r)?),
        };
        let name = match name.filter(|n| !n.is_none()) {
            None => None,
            Some(n) => Some(n.extract::<String>().map_err(|_| {
                PyTypeError::new_err(match n.get_type().name() {
                    Ok(t) => format!("name must be a str, got {t}"),
                    Err(e) => e.to_string(),
                })
            })?),
        };
        let on_lost_remote_reader = on_lost_remote_reader
            .map(|p| p.parse::<LostReaderPolicy>())
            .transpose()
            .or_raise()?;
        let options = QueueOptions {
            local_reader_ranks,
            max_chunk_bytes: optional_count(
                max_chunk_bytes,
                "max_chunk_bytes",
                "bytes",
                1,
                MAX_COUNT,
            )?,
            max_chunks: optional_count(max_chunks, "max_chunks", "chunks", 1, MAX_COUNT)?,
            connect_ip,
            spin_us,
            yield_us,
            on_dead_reader: on_dead_reader
                .map(|p| p.parse::<DeadReaderPolicy>())
                .transpose()
                .or_raise()?,
            arena_bytes: optional_count(
                arena_bytes,
                "arena_bytes",
                "bytes (0: no arena)",
                0,
                MAX_COUNT,
            )?,
            arena_threshold: optional_count(
                arena_threshold,
                "arena_threshold",
                "bytes",
                0,
                MAX_COUNT,
            )?,
            remote_hwm: optional_count(remote_hwm, "remote_hwm", "messages", 1, i32::MAX.into())?,
            slow_remote_reader: slow_remote_reader
                .map(|p| p.parse::<SlowReaderPolicy>())
                .transpose()
                .or_raise()?,
            remote_max_queued_bytes: optional_count(
                remote_max_queued_bytes,
                "remote_max_queued_bytes",
                "bytes",
                1,
                MAX_COUNT,
            )?,
            name,
            on_lost_remote_reader,
        };
        // The waits' bounds are checked now too (for one local reader: the policy is made
        // again for the queue's processes when it is applied).
        wait_policy(2, spin_us, yield_us)?;
        Ok(options)
    }

    #[getter]
    fn local_reader_ranks(&self) -> Option<Vec<usize>> {
        self.local_reader_ranks.clone()
    }
    #[getter]
    fn max_chunk_bytes(&self) -> usize {
        self.max_chunk_bytes
            .unwrap_or(CoreOptions::default().max_chunk_bytes)
    }
    #[getter]
    fn max_chunks(&self) -> usize {
        self.max_chunks.unwrap_or(CoreOptions::default().max_chunks)
    }
    #[getter]
    fn connect_ip(&self) -> Option<String> {
        self.connect_ip.clone()
    }
    #[getter]
    fn spin_us(&self) -> Option<f64> {
        self.spin_us
    }
    #[getter]
    fn yield_us(&self) -> Option<f64> {
        self.yield_us
    }
    #[getter]
    fn on_dead_reader(&self) -> &'static str {
        match self
            .on_dead_reader
            .unwrap_or(CoreOptions::default().on_dead_reader)
        {
            DeadReaderPolicy::Drop => "drop",
            _ => "raise",
        }
    }
    #[getter]
    fn arena_bytes(&self) -> usize {
        self.arena_bytes
            .unwrap_or(CoreOptions::default().arena_bytes)
    }
    #[getter]
    fn arena_threshold(&self) -> usize {
        self.arena_threshold
            .unwrap_or(CoreOptions::default().arena_threshold)
    }
    #[getter]
    fn remote_hwm(&self) -> i32 {
        self.remote_hwm.unwrap_or(RemoteOptions::default().hwm)
    }
    #[getter]
    fn slow_remote_reader(&self) -> &'static str {
        match self
            .slow_remote_reader
            .unwrap_or(RemoteOptions::default().slow_reader)
        {
            SlowReaderPolicy::Drop => "drop",
            _ => "block",
        }
    }
    #[getter]
    fn remote_max_queued_bytes(&self) -> u64 {
        self.remote_max_queued_bytes
            .unwrap_or(RemoteOptions::default().max_queued_bytes)
    }
    #[getter]
    fn name(&self) -> Option<String> {
        self.name.clone()
    }
    #[getter]
    fn on_lost_remote_reader(&self) -> &'static str {
        match self
            .on_lost_remote_reader
            .unwrap_or(RemoteOptions::default().on_lost_reader)
        {
            LostReaderPolicy::Raise => "raise",
            _ => "warn",
        }
    }
}

impl QueueOptions {
    /// Set the options given on `opts`, which already says how many readers there are
    /// (the waits' policy is made for them); the others keep what `opts` has.
    pub(crate) fn apply(&self, opts: &mut CoreOptions) -> PyResult<()> {
        if let Some(r) = &self.local_reader_ranks {
            opts.local_reader_ranks = Some(r.clone());
        }
        if let Some(b) = self.max_chunk_bytes {
            opts.max_chunk_bytes = b;
        }
        if let Some(c) = self.max_chunks {
            opts.max_chunks = c;
        }
        if let Some(ip) = &self.connect_ip {
            opts.connect_ip = Some(ip.clone());
        }
        opts.wait = Some(wait_policy(
            opts.n_local_reader.saturating_add(1),
            self.spin_us,
            self.yield_us,
        )?);
        if let Some(p) = self.on_dead_reader {
            opts.on_dead_reader = p;
        }
        if let Some(b) = self.arena_bytes {
            opts.arena_bytes = b;
        }
        if let Some(t) = self.arena_threshold {
            opts.arena_threshold = t;
        }
        if let Some(h) = self.remote_hwm {
            opts.remote.hwm = h;
        }
        if let Some(p) = self.slow_remote_reader {
            opts.remote.slow_reader = p;
        }
        if let Some(b) = self.remote_max_queued_bytes {
            opts.remote.max_queued_bytes = b;
        }
        if let Some(p) = self.on_lost_remote_reader {
            opts.remote.on_lost_reader = p;
        }
        if let Some(n) = &self.name {
            opts.name = Some(n.clone());
        }
        Ok(())
    }
}

/// `local_reader_ranks` as a list of ranks (non-negative ints), from any iterable.
fn ranks(value: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let items: Vec<Bound<'_, PyAny>> = value.try_iter()?.collect::<PyResult<_>>()?;
    let mut out = Vec::with_capacity(items.len());
    for r in &items {
        let rank = count(r, "local_reader_ranks", "ranks", 0, MAX_COUNT).ok();
        match rank {
            Some(n) => out.push(n as usize),
            None => {
                let shown = items
                    .iter()
                    .map(|i| i.repr().map(|s| s.to_string()))
                    .collect::<PyResult<Vec<_>>>()?;
                return Err(PyValueError::new_err(format!(
                    "local_reader_ranks must hold ranks (non-negative ints), got [{}]",
                    shown.join(", ")
                )));
            }
        }
    }
    Ok(out)
}
