//! Binding for a queue's options (`shmq._core.QueueOptions`): the options a writer or a
//! relay is made with, as Python spells them, each converted and checked once here; an
//! option not given keeps the core's default ([`shmq::QueueOptions::default`]), which the
//! getters show.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors::OrRaise;
use crate::wait::wait_policy;
use shmq::broadcast::ring::DeadReaderPolicy;
use shmq::remote::{LostReaderPolicy, RemoteOptions, SlowReaderPolicy};
use shmq::QueueOptions as CoreOptions;

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

/// `count` of an option, as `T`.
fn in_range<T: TryFrom<i128>>(
    value: &Bound<'_, PyAny>,
    name: &str,
    unit: &str,
    minimum: i128,
    maximum: i128,
) -> PyResult<T> {
    let n = count(value, name, unit, minimum, maximum)?;
    T::try_from(n).map_err(|_| {
        PyValueError::new_err(format!("{name} must be at most {maximum} {unit}, got {n}"))
    })
}

/// The largest count a `usize` option holds (`i64::MAX`, as Python's `sys.maxsize`).
const MAX_COUNT: i128 = i64::MAX as i128;

/// The queue's options as one table, each written once: its name (the keyword argument
/// and the attribute), the type PyO3 takes it as, what it is kept as, how it is checked
/// (`parse`), what the attribute shows (`get`: the core's default for one not given) and
/// where it goes in the core's options (`apply`). From it come the class, its
/// constructor (keyword-only, every option `None` by default), its attributes, the
/// options applied to a writer, and `QueueOptions.OPTIONS` (the names in order), which
/// `tests/python/test_queue_options_table.py` checks `_core.pyi` and `MessageQueue`
/// against.
macro_rules! queue_options {
    ($(
        $(#[doc = $doc:literal])*
        $name:ident: $param:ty => $stored:ty,
            parse($p:ident) => $parse:expr,
            get($g:ident) -> $shown:ty => $get:expr,
            apply($opts:ident, $a:ident) $apply:block
    )*) => {
        /// A queue's options. Each given one is checked when the object is made
        /// (`TypeError` or `ValueError` naming the option); one not given keeps the
        /// core's default.
        #[pyclass(module = "shmq._core", frozen, from_py_object)]
        #[derive(Clone, Default)]
        pub struct QueueOptions {
            $($name: Option<$stored>,)*
        }

        #[pymethods]
        impl QueueOptions {
            #[new]
            #[pyo3(signature = (*, $($name = None),*))]
            #[allow(clippy::too_many_arguments)]
            fn new($($name: Option<$param>),*) -> PyResult<QueueOptions> {
                let options = QueueOptions {
                    $($name: match $name {
                        None => None,
                        Some($p) => Some($parse),
                    },)*
                };
                // The waits' bounds are checked now too (for one local reader: the policy
                // is made again for the queue's processes when it is applied).
                wait_policy(2, options.spin_us, options.yield_us)?;
                Ok(options)
            }

            /// The options' names, in the constructor's order.
            #[classattr]
            #[allow(non_snake_case)]
            fn OPTIONS(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
                PyTuple::new(py, [$(stringify!($name)),*])
            }

            $(
                $(#[doc = $doc])*
                #[getter]
                fn $name(&self) -> $shown {
                    let $g = &self.$name;
                    $get
                }
            )*
        }

        impl QueueOptions {
            /// Set the options given on `opts`, which already says how many readers there
            /// are (the waits' policy is made for them); the others keep what `opts` has.
            pub(crate) fn apply(&self, opts: &mut CoreOptions) -> PyResult<()> {
                $(if let Some($a) = &self.$name {
                    let $opts = &mut *opts;
                    $apply
                })*
                opts.wait = Some(wait_policy(
                    opts.n_local_reader.saturating_add(1),
                    self.spin_us,
                    self.yield_us,
                )?);
                Ok(())
            }
        }
    };
}

queue_options! {
    /// The ranks of the local readers (default `0..n_local_reader`).
    local_reader_ranks: &Bound<'_, PyAny> => Vec<usize>,
        parse(v) => ranks(v)?,
        get(v) -> Option<Vec<usize>> => v.clone(),
        apply(opts, v) { opts.local_reader_ranks = Some(v.clone()); }
    /// The size of a chunk in bytes.
    max_chunk_bytes: &Bound<'_, PyAny> => usize,
        parse(v) => in_range(v, "max_chunk_bytes", "bytes", 1, MAX_COUNT)?,
        get(v) -> usize => v.unwrap_or(CoreOptions::default().max_chunk_bytes),
        apply(opts, v) { opts.max_chunk_bytes = *v; }
    /// The number of chunks in the ring.
    max_chunks: &Bound<'_, PyAny> => usize,
        parse(v) => in_range(v, "max_chunks", "chunks", 1, MAX_COUNT)?,
        get(v) -> usize => v.unwrap_or(CoreOptions::default().max_chunks),
        apply(opts, v) { opts.max_chunks = *v; }
    /// The IP remote readers connect to (default: this host's address).
    connect_ip: String => String,
        parse(v) => v,
        get(v) -> Option<String> => v.clone(),
        apply(opts, v) { opts.connect_ip = Some(v.clone()); }
    /// How long a blocked wait spins, in microseconds (default: for the processes).
    spin_us: f64 => f64,
        parse(v) => v,
        get(v) -> Option<f64> => *v,
        apply(_opts, _v) {} // with `yield_us`, in the waits' policy (see `apply`)
    /// How long a blocked wait yields, in microseconds (default: for the processes).
    yield_us: f64 => f64,
        parse(v) => v,
        get(v) -> Option<f64> => *v,
        apply(_opts, _v) {} // with `spin_us`, in the waits' policy (see `apply`)
    /// What the writer does when a local reader it waits for died: `"raise"` or `"drop"`.
    on_dead_reader: &str => DeadReaderPolicy,
        parse(v) => v.parse::<DeadReaderPolicy>().or_raise()?,
        get(v) -> &'static str => match v.unwrap_or(CoreOptions::default().on_dead_reader) {
            DeadReaderPolicy::Drop => "drop",
            _ => "raise",
        },
        apply(opts, v) { opts.on_dead_reader = *v; }
    /// Bytes of the tensor arena (0: none).
    arena_bytes: &Bound<'_, PyAny> => usize,
        parse(v) => in_range(v, "arena_bytes", "bytes (0: no arena)", 0, MAX_COUNT)?,
        get(v) -> usize => v.unwrap_or(CoreOptions::default().arena_bytes),
        apply(opts, v) { opts.arena_bytes = *v; }
    /// The smallest part that goes to the arena instead of being copied inline.
    arena_threshold: &Bound<'_, PyAny> => usize,
        parse(v) => in_range(v, "arena_threshold", "bytes", 0, MAX_COUNT)?,
        get(v) -> usize => v.unwrap_or(CoreOptions::default().arena_threshold),
        apply(opts, v) { opts.arena_threshold = *v; }
    /// Messages queued per remote reader.
    remote_hwm: &Bound<'_, PyAny> => i32,
        parse(v) => in_range(v, "remote_hwm", "messages", 1, i32::MAX.into())?,
        get(v) -> i32 => v.unwrap_or(RemoteOptions::default().hwm),
        apply(opts, v) { opts.remote.hwm = *v; }
    /// What to do with a remote reader that does not keep up: `"block"` or `"drop"`.
    slow_remote_reader: &str => SlowReaderPolicy,
        parse(v) => v.parse::<SlowReaderPolicy>().or_raise()?,
        get(v) -> &'static str => match v.unwrap_or(RemoteOptions::default().slow_reader) {
            SlowReaderPolicy::Drop => "drop",
            _ => "block",
        },
        apply(opts, v) { opts.remote.slow_reader = *v; }
    /// Bytes queued per remote reader.
    remote_max_queued_bytes: &Bound<'_, PyAny> => u64,
        parse(v) => in_range(v, "remote_max_queued_bytes", "bytes", 1, MAX_COUNT)?,
        get(v) -> u64 => v.unwrap_or(RemoteOptions::default().max_queued_bytes),
        apply(opts, v) { opts.remote.max_queued_bytes = *v; }
    /// A name for the queue.
    name: &Bound<'_, PyAny> => String,
        parse(v) => v.extract::<String>().map_err(|_| {
            PyTypeError::new_err(match v.get_type().name() {
                Ok(t) => format!("name must be a str, got {t}"),
                Err(e) => e.to_string(),
            })
        })?,
        get(v) -> Option<String> => v.clone(),
        apply(opts, v) { opts.name = Some(v.clone()); }
    /// What a lost remote reader does to the writer: `"warn"` or `"raise"`.
    on_lost_remote_reader: &str => LostReaderPolicy,
        parse(v) => v.parse::<LostReaderPolicy>().or_raise()?,
        get(v) -> &'static str => match v.unwrap_or(RemoteOptions::default().on_lost_reader) {
            LostReaderPolicy::Raise => "raise",
            _ => "warn",
        },
        apply(opts, v) { opts.remote.on_lost_reader = *v; }
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
