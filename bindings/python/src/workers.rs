//! `WorkerGroup`: the core's worker supervision (`shmq::workers::Workers`) for the
//! Python package's `WorkerProcesses`, which starts the interpreters and hands each one
//! over. Conversions only: fds are duplicated (the caller keeps its own), deaths become
//! tuples of `WorkerDiedError`'s arguments, waits release the GIL and check signals
//! between slices.

use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::errors::OrRaise;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::wait::{blocking, duration, Interrupts, Timeout};

use shmq::workers::link::WorkerListener;
use shmq::workers::{StartedWorker, Waited, WorkerOptions, Workers};
use shmq::workers::{StderrCapture, WorkerDeath, WorkerExit};

/// `WorkerDiedError`'s arguments: (name, rank, pid, exitcode, stderr_tail, host,
/// before_ready, how, stderr_captured, stderr_from_start).
type DeathTuple = (
    String,
    usize,
    Option<u32>,
    Option<i32>,
    Vec<String>,
    String,
    bool,
    Option<String>,
    bool,
    bool,
);

fn death_tuple(d: WorkerDeath) -> DeathTuple {
    let (captured, from_start) = match d.stderr {
        StderrCapture::No => (false, true),
        StderrCapture::FromStart => (true, true),
        StderrCapture::FromBootstrap => (true, false),
    };
    (
        d.name,
        d.rank,
        d.pid,
        d.exit.map(WorkerExit::exitcode),
        d.stderr_tail,
        d.host,
        d.before_ready,
        d.how,
        captured,
        from_start,
    )
}

/// `WorkerDiedError`'s message (the core's wording), from its arguments.
#[pyfunction]
#[pyo3(signature = (name, rank, pid, exitcode, stderr_tail, host, before_ready, how, stderr_captured, stderr_from_start))]
#[allow(clippy::too_many_arguments)]
pub fn worker_died_message(
    name: String,
    rank: usize,
    pid: Option<u32>,
    exitcode: Option<i32>,
    stderr_tail: Vec<String>,
    host: String,
    before_ready: bool,
    how: Option<String>,
    stderr_captured: bool,
    stderr_from_start: bool,
) -> String {
    WorkerDeath {
        name,
        rank,
        pid,
        host,
        exit: exitcode.map(WorkerExit::from_exitcode),
        before_ready,
        how,
        stderr_tail,
        stderr: match (stderr_captured, stderr_from_start) {
            (false, _) => StderrCapture::No,
            (true, true) => StderrCapture::FromStart,
            (true, false) => StderrCapture::FromBootstrap,
        },
    }
    .to_string()
}

fn dup(fd: Option<i32>) -> PyResult<Option<OwnedFd>> {
    let Some(fd) = fd else { return Ok(None) };
    if fd < 0 {
        return Err(PyValueError::new_err(format!(
            "not a file descriptor: {fd}"
        )));
    }
    // SAFETY: fcntl(2) takes plain integers: a number that is not an open fd fails with
    // EBADF, and nothing but the new descriptor is made.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if new < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `new` was just made by the duplication and nothing else owns it.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(new) }))
}

/// Run `wait(slice)` with the GIL released, slice after slice until it returns `Some` or
/// `timeout` passes (`None`): the core's loop for such waits (`wait::in_slices`), with the
/// binding's hook between slices (signals: Ctrl-C ends the wait), as every blocking call
/// of the binding has ([`blocking`]).
fn sliced<T: Send>(
    py: Python<'_>,
    timeout: Option<Timeout>,
    wait: impl Fn(Duration) -> Option<T> + Sync,
) -> PyResult<Option<T>> {
    let interrupts = Interrupts {
        timeout,
        cancel: None,
        quiet: true,
    };
    blocking(py, interrupts, |spec| shmq::wait::in_slices(spec, &wait))
}

/// A wait for readiness or exits, slice after slice (see [`sliced`]), as Python sees its
/// end: ("done", None), ("failed", rank) or ("timeout", None).
fn waited_sliced(
    py: Python<'_>,
    timeout: Option<Timeout>,
    wait: impl Fn(Duration) -> shmq::workers::Result<Waited> + Sync,
) -> PyResult<(&'static str, Option<usize>)> {
    let out = sliced(py, timeout, |slice| match wait(slice) {
        Ok(Waited::TimedOut) => None,
        other => Some(other),
    })?;
    Ok(match out.transpose().or_raise()? {
        Some(Waited::Done) => ("done", None),
        Some(Waited::Failed(rank)) => ("failed", Some(rank)),
        Some(Waited::TimedOut) | None => ("timeout", None),
    })
}

/// A group of workers supervised by a thread of the core (see `shmq.workers`).
#[pyclass(module = "shmq._core", frozen)]
pub struct WorkerGroup {
    inner: Workers,
}

#[pymethods]
impl WorkerGroup {
    #[new]
    #[pyo3(signature = (n_local, n_remote, name_prefix, stderr_tail_lines, forward_stderr, new_process_group, grace))]
    fn new(
        n_local: usize,
        n_remote: usize,
        name_prefix: String,
        stderr_tail_lines: usize,
        forward_stderr: bool,
        new_process_group: bool,
        grace: Timeout,
    ) -> PyResult<Self> {
        let options = WorkerOptions {
            death_signal: None, // the Python bootstrap sets it up in the worker
            grace: duration(Some(grace)).unwrap_or(Duration::MAX),
            forward_stderr,
            stderr_tail_lines,
            name_prefix,
            new_process_group,
        };
        Ok(WorkerGroup {
            inner: Workers::new(n_local, n_remote, options).or_raise()?,
        })
    }

    /// Watch local worker `rank` (pid `pid`); `ready_fd` and `stderr_fd` are duplicated.
    #[pyo3(signature = (rank, pid, own_child, ready_fd, stderr_fd, stderr_from_start))]
    fn adopt(
        &self,
        rank: usize,
        pid: u32,
        own_child: bool,
        ready_fd: Option<i32>,
        stderr_fd: Option<i32>,
        stderr_from_start: bool,
    ) -> PyResult<()> {
        let capture = if stderr_from_start {
            StderrCapture::FromStart
        } else {
            StderrCapture::FromBootstrap
        };
        let worker = StartedWorker {
            pid,
            own_child,
            ready: dup(ready_fd)?,
            stderr: dup(stderr_fd)?.map(|fd| (fd, capture)),
            reap: false,
        };
        self.inner.adopt(rank, worker).or_raise()
    }

    /// Admit this group's remote workers from now on, listening on `host`:`port` (0: any
    /// free port), from the core's threads (`Workers::admit_remote`: the accept loop,
    /// its handshake slots, each worker's rank claimed and its link served); the ticket's
    /// text.
    fn admit_remote(&self, host: &str, port: u16) -> PyResult<String> {
        let listener = WorkerListener::bind((host, port)).or_raise()?;
        Ok(self.inner.admit_remote(listener).or_raise()?.to_string())
    }

    /// Ask every admitted remote worker to stop within `grace` seconds, over its link.
    fn stop_remote(&self, py: Python<'_>, grace: Timeout) {
        let grace = duration(Some(grace)).unwrap_or(Duration::MAX);
        py.detach(|| self.inner.stop_remote(grace))
    }

    /// Tell the admitted remote workers of the group's first failure, over their links
    /// (once; `Workers::tell_siblings`: the local workers' pipes are the caller's).
    fn tell_siblings(&self, py: Python<'_>) {
        py.detach(|| {
            self.inner.tell_siblings();
        })
    }

    #[pyo3(signature = (rank, exitcode, stderr_tail, how))]
    fn report_exit(
        &self,
        rank: usize,
        exitcode: Option<i32>,
        stderr_tail: Vec<String>,
        how: Option<String>,
    ) {
        self.inner.report_exit(
            rank,
            exitcode.map(WorkerExit::from_exitcode),
            stderr_tail,
            how,
        )
    }

    /// (name, rank, pid, host, ready, exited, exitcode) of every worker, by rank.
    #[allow(clippy::type_complexity)]
    fn status(&self) -> Vec<(String, usize, Option<u32>, String, bool, bool, Option<i32>)> {
        self.inner
            .status()
            .into_iter()
            .map(|s| {
                let code = s.exit.map(WorkerExit::exitcode);
                (s.name, s.rank, s.pid, s.host, s.ready, s.exited, code)
            })
            .collect()
    }

    fn exit_order(&self) -> Vec<usize> {
        self.inner.exit_order()
    }

    fn ready_payloads<'py>(&self, py: Python<'py>) -> Vec<Option<Bound<'py, PyBytes>>> {
        self.inner
            .ready_payloads()
            .into_iter()
            .map(|p| p.map(|b| PyBytes::new(py, &b)))
            .collect()
    }

    fn failures(&self) -> Vec<DeathTuple> {
        self.inner.failures().into_iter().map(death_tuple).collect()
    }

    /// The death of `rank`: recorded, or (it finished) made now.
    fn death_or_exit(&self, rank: usize) -> DeathTuple {
        death_tuple(self.inner.death_or_exit(rank))
    }

    fn describe(&self, rank: usize) -> Option<String> {
        self.inner.describe(rank)
    }

    /// (message, names) of the workers not ready after `waited` seconds.
    fn not_ready(&self, waited: Timeout) -> (String, Vec<String>) {
        let e = self
            .inner
            .not_ready(duration(Some(waited)).unwrap_or(Duration::MAX));
        let names = match &e {
            shmq::workers::Error::WorkersNotReady { not_ready, .. } => {
                not_ready.iter().map(|(n, _)| n.clone()).collect()
            }
            _ => Vec::new(),
        };
        (e.to_string(), names)
    }

    #[getter]
    fn closing(&self) -> bool {
        self.inner.closing()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.closed()
    }

    fn exit_unrecorded(&self) -> bool {
        self.inner.exit_unrecorded()
    }

    /// Until all are ready (see `waited`). RuntimeError once closing.
    #[pyo3(signature = (timeout=None))]
    fn wait_ready(
        &self,
        py: Python<'_>,
        timeout: Option<Timeout>,
    ) -> PyResult<(&'static str, Option<usize>)> {
        waited_sliced(py, timeout, |slice| self.inner.wait_ready_for(Some(slice)))
    }

    /// The first rank to exit, or None when `timeout` passes.
    #[pyo3(signature = (timeout=None))]
    fn wait_any(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<Option<usize>> {
        let out = sliced(py, timeout, |slice| {
            self.inner.wait_any(Some(slice)).ok().flatten()
        })?;
        Ok(out.map(|(rank, _)| rank))
    }

    /// Until every worker has exited, or the first failure (see `waited`).
    #[pyo3(signature = (timeout=None))]
    fn wait_all_exited(
        &self,
        py: Python<'_>,
        timeout: Option<Timeout>,
    ) -> PyResult<(&'static str, Option<usize>)> {
        waited_sliced(py, timeout, |slice| {
            Ok(self.inner.wait_all_exited(Some(slice)))
        })
    }

    /// Until more than `seen` failures are recorded or the group is closing (or
    /// `timeout` passes): how many there are.
    #[pyo3(signature = (seen, timeout=None))]
    fn wait_failures(
        &self,
        py: Python<'_>,
        seen: usize,
        timeout: Option<Timeout>,
    ) -> PyResult<usize> {
        let out = sliced(py, timeout, |slice| {
            let n = self.inner.wait_failures(seen, Some(slice));
            (n > seen || self.inner.closing()).then_some(n)
        })?;
        Ok(out.unwrap_or(seen))
    }

    fn close_begin(&self, py: Python<'_>) -> bool {
        py.detach(|| self.inner.close_begin())
    }

    /// Wait up to `timeout` seconds until every started worker has exited; whether all
    /// have.
    fn wait_exits(&self, py: Python<'_>, timeout: Timeout) -> PyResult<bool> {
        let out = sliced(py, Some(timeout), |slice| {
            self.inner.wait_exits(Instant::now() + slice).then_some(())
        })?;
        Ok(out.is_some())
    }

    fn close_finish(&self, py: Python<'_>) {
        py.detach(|| self.inner.close_finish())
    }
}
