//! Bindings for `crate::admin`: listing, describing and removing segments.

use pyo3::prelude::*;

use crate::admin::{self, SegmentReport};

/// `(name, size, kind, creator pid or None, creator alive)`.
type ReportTuple = (String, u64, &'static str, Option<u32>, bool);

fn tuple(s: SegmentReport) -> ReportTuple {
    (
        s.name,
        s.size,
        s.kind.as_str(),
        s.creator.map(|c| c.pid),
        s.creator_alive,
    )
}

/// Every shmq segment in /dev/shm.
#[pyfunction]
pub fn list_segments() -> PyResult<Vec<ReportTuple>> {
    Ok(admin::list_segments()?.into_iter().map(tuple).collect())
}

/// Remove (or with `dry_run` only list) the segments whose creator has died.
#[pyfunction]
#[pyo3(signature = (dry_run=false))]
pub fn remove_orphans(dry_run: bool) -> PyResult<Vec<ReportTuple>> {
    Ok(admin::remove_orphans(dry_run)?
        .into_iter()
        .map(tuple)
        .collect())
}

/// A human-readable description of a segment's state.
#[pyfunction]
pub fn describe_segment(name: &str) -> PyResult<String> {
    Ok(admin::describe(name)?)
}
