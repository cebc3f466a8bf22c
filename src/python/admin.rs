//! Bindings for `crate::admin`: listing, describing and removing segments.

use pyo3::prelude::*;

use crate::admin::{self, SegmentReport};
use crate::liveness::Liveness;

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
    Ok(admin::list_segments()?.into_iter().map(tuple).collect())
}

/// Remove (or with `dry_run` only list) the segments whose creator is proved dead; with
/// `force`, also those whose creator cannot be judged from here.
#[pyfunction]
#[pyo3(signature = (dry_run=false, force=false))]
pub fn remove_orphans(dry_run: bool, force: bool) -> PyResult<Vec<ReportTuple>> {
    Ok(admin::remove_orphans(dry_run, force)?
        .into_iter()
        .map(tuple)
        .collect())
}

/// A human-readable description of a segment's state.
#[pyfunction]
pub fn describe_segment(name: &str) -> PyResult<String> {
    Ok(admin::describe(name)?)
}
