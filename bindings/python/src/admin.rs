//! Bindings for `shmq::admin`: listing, describing and removing segments.

use crate::errors::OrRaise;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use shmq::admin::{self, Metrics, SegmentReport};
use shmq::broadcast::ring::SideStats;
use shmq::liveness::Liveness;

/// `(name, size, kind, creator pid or None, creator: "alive" | "dead" | "unknown")`.
type ReportTuple = (String, u64, &'static str, Option<u32>, &'static str);

fn tuple(s: SegmentReport) -> ReportTuple {
    let state = match s.creator_liveness {
        Liveness::Alive => "alive",
        Liveness::Dead => "dead",
        Liveness::Unknown => "unknown",
    };
    (
        s.name,
        s.size,
        s.kind.as_str(),
        s.creator.map(|c| c.pid),
        state,
    )
}

/// Every shmq segment in /dev/shm.
#[pyfunction]
pub fn list_segments() -> PyResult<Vec<ReportTuple>> {
    Ok(admin::list_segments()
        .or_raise()?
        .into_iter()
        .map(tuple)
        .collect())
}

/// Remove (or with `dry_run` only list) the segments whose creator is proved dead; with
/// `force`, also those whose creator cannot be judged from here.
#[pyfunction]
#[pyo3(signature = (dry_run=false, force=false))]
pub fn remove_orphans(dry_run: bool, force: bool) -> PyResult<Vec<ReportTuple>> {
    Ok(admin::remove_orphans(dry_run, force)
        .or_raise()?
        .into_iter()
        .map(tuple)
        .collect())
}

/// A human-readable description of a segment's state.
#[pyfunction]
pub fn describe_segment(name: &str) -> PyResult<String> {
    admin::describe(name).or_raise()
}

fn liveness_str(l: Liveness) -> &'static str {
    match l {
        Liveness::Alive => "alive",
        Liveness::Dead => "dead",
        Liveness::Unknown => "unknown",
    }
}

fn side_dict<'py>(
    py: Python<'py>,
    s: &SideStats,
    writer: &SideStats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("reader", s.reader)?;
    d.set_item("pid", s.process.map(|p| p.pid))?;
    d.set_item("state", liveness_str(s.liveness))?;
    d.set_item("stopped", matches!(s.process_state, Some('T' | 't')))?;
    d.set_item("dropped", s.dropped)?;
    d.set_item("messages", s.messages)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("behind", s.behind(writer))?;
    d.set_item("waits", s.waits)?;
    d.set_item("wait_seconds", s.wait_seconds)?;
    d.set_item("waiting_seconds", s.waiting_seconds)?;
    d.set_item("idle_seconds", s.idle_seconds)?;
    Ok(d)
}

/// The live metrics of a segment as a dict (see `shmq.metrics`): `kind` and, by kind,
/// its counters; a ring's `writer` and `readers` are dicts of their own.
#[pyfunction]
pub fn segment_metrics<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
    let m = py.detach(|| admin::metrics(name)).or_raise()?;
    let d = PyDict::new(py);
    d.set_item("name", name)?;
    match m {
        Metrics::Ring {
            label,
            n_reader,
            max_chunks,
            max_chunk_bytes,
            stats,
        } => {
            d.set_item("kind", "queue")?;
            d.set_item("label", label)?;
            d.set_item("n_reader", n_reader)?;
            d.set_item("max_chunks", max_chunks)?;
            d.set_item("max_chunk_bytes", max_chunk_bytes)?;
            d.set_item("overflow_sends", stats.overflow_sends)?;
            d.set_item("arena_parts", stats.arena_parts)?;
            d.set_item("loaned_parts", stats.loaned_parts)?;
            d.set_item("fallback_parts", stats.fallback_parts)?;
            d.set_item("remote_sends", stats.remote_sends)?;
            d.set_item("writer", side_dict(py, &stats.writer, &stats.writer)?)?;
            let readers = stats
                .readers
                .iter()
                .map(|r| side_dict(py, r, &stats.writer))
                .collect::<PyResult<Vec<_>>>()?;
            d.set_item("readers", readers)?;
        }
        Metrics::Store {
            capacity,
            occupancy,
            stats,
        } => {
            d.set_item("kind", "store")?;
            d.set_item("capacity", capacity)?;
            d.set_item("objects", occupancy.live_blocks)?;
            d.set_item("bytes_in_use", occupancy.live_bytes)?;
            d.set_item("puts", stats.puts)?;
            d.set_item("gets", stats.gets)?;
            d.set_item("evictions", stats.evictions)?;
            d.set_item("views_held", stats.views_held)?;
        }
        Metrics::Arena(a) => {
            d.set_item("kind", "arena")?;
            d.set_item("queue", &a.queue)?;
            d.set_item("n_reader", a.n_reader)?;
            d.set_item("capacity", a.capacity)?;
            d.set_item("reserved", a.reserved)?;
            d.set_item("bytes_in_use", a.bytes_in_use)?;
            d.set_item("fallbacks", a.fallbacks)?;
        }
        Metrics::EncoderCache(c) => {
            d.set_item("kind", "encoder_cache")?;
            d.set_item("state", c.state)?;
            d.set_item("capacity", c.capacity)?;
            d.set_item("reserved", c.reserved)?;
            d.set_item("entries", c.entries)?;
            d.set_item("bytes_in_use", c.bytes_in_use)?;
            d.set_item("saves", c.saves)?;
            d.set_item("evictions", c.evictions)?;
            d.set_item("waits", c.waits)?;
            d.set_item("wait_seconds", c.wait_ns as f64 / 1e9)?;
            let loads: u64 = c.consumers.iter().map(|k| k.loads).sum();
            d.set_item("loads", loads)?;
            let consumers = c
                .consumers
                .iter()
                .map(|k| {
                    let e = PyDict::new(py);
                    e.set_item("slot", k.slot)?;
                    e.set_item("pid", k.process.pid)?;
                    e.set_item("state", if k.alive { "alive" } else { "dead" })?;
                    e.set_item("loads", k.loads)?;
                    Ok(e)
                })
                .collect::<PyResult<Vec<_>>>()?;
            d.set_item("consumers", consumers)?;
        }
    }
    Ok(d)
}
