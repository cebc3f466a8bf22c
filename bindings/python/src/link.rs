//! Bindings for `shmq::workers::link`: the worker link, Rust's at both ends. A remote
//! worker joins with `Link.connect` (`shmq.workers.connect_to_parent`); a
//! `WorkerProcesses` parent admits its remote workers with `WorkerGroup.admit_remote`
//! (the core's accept loop, handshake slots and serving); `LinkListener` is the
//! parent's end alone (one admitted link at a time, to drive it by hand). The frames'
//! kinds are the core's `link::Kind`, as `LinkKind`.

use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use shmq::workers::link::{
    Kind, LinkSender, ParentLink, ParentMessage, RemoteWorker, Ticket, WorkerListener,
    WorkerMessage,
};

use crate::errors::OrRaise;

/// The `LinkKind` enum (an `IntEnum` made at import from `link::Kind::ALL`).
fn kind_object<'py>(py: Python<'py>, kind: Kind) -> PyResult<Bound<'py, PyAny>> {
    py.import("shmq._core")?
        .getattr("LinkKind")?
        .call1((kind.byte(),))
}

/// Which end of the link this is, and its receiving half (one receiver at a time).
enum End {
    /// A worker's end (`link::ParentLink`).
    Worker(ParentLink),
    /// The parent's end of an admitted worker (`link::RemoteWorker`).
    Parent(RemoteWorker),
}

/// One admitted link, either end: its sends and receives release the GIL.
#[pyclass(module = "shmq._core", frozen)]
pub struct Link {
    end: Mutex<End>,
    sender: LinkSender,
    rank: u32,
}

impl Link {
    fn new(end: End) -> Link {
        let (sender, rank) = match &end {
            End::Worker(link) => (link.sender(), link.rank()),
            End::Parent(worker) => (worker.sender(), worker.rank()),
        };
        Link {
            end: Mutex::new(end),
            sender,
            rank,
        }
    }
}

#[pymethods]
impl Link {
    /// Join the parent of `ticket` (its text) as worker `rank`, all of the handshake
    /// within `timeout` seconds (`link::ParentLink::connect`).
    #[staticmethod]
    fn connect(py: Python<'_>, ticket: &str, rank: u32, timeout: f64) -> PyResult<Link> {
        let ticket: Ticket = ticket.parse().or_raise()?;
        let timeout = Duration::try_from_secs_f64(timeout).map_err(|_| {
            PyValueError::new_err("timeout must be a non-negative number of seconds")
        })?;
        let link = py
            .detach(|| ParentLink::connect(&ticket, rank, timeout))
            .or_raise()?;
        Ok(Link::new(End::Worker(link)))
    }

    /// The rank the worker joined as.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// Send one sealed frame of `kind` (any byte: a kind the peer does not know, it
    /// skips). `ValueError` for a payload over the link's limit (nothing is sent).
    fn send(&self, py: Python<'_>, kind: u8, payload: &[u8]) -> PyResult<()> {
        py.detach(|| self.sender.send(kind, payload)).or_raise()
    }

    /// (A worker) ready, with `payload`.
    fn send_ready(&self, py: Python<'_>, payload: &[u8]) -> PyResult<()> {
        self.send(py, Kind::Ready.byte(), payload)
    }

    /// (A worker) leaving with `exitcode` and its last stderr lines.
    fn send_leaving(&self, py: Python<'_>, exitcode: i32, stderr: Vec<String>) -> PyResult<()> {
        py.detach(|| self.sender.send_leaving(exitcode, &stderr))
            .or_raise()
    }

    /// (The parent) tell the worker to stop within `grace` seconds.
    fn send_stop(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        let grace = Duration::try_from_secs_f64(grace)
            .map_err(|_| PyValueError::new_err("grace must be a non-negative number of seconds"))?;
        py.detach(|| self.sender.send_stop(grace)).or_raise()
    }

    /// The next message from the peer (blocking, the GIL released; kinds this version
    /// does not know are skipped): a worker's end gets `(LinkKind.STOP, grace)` or
    /// `(LinkKind.SIBLING_FAILED, notice)`, the parent's `(LinkKind.READY, payload)` or
    /// `(LinkKind.LEAVING, (exitcode, stderr_lines))`. `EOFError` or `OSError` for the
    /// link's loss; `ValueError` for a frame that is not the peer's (over the limit,
    /// unsealed, out of turn, of a kind never the peer's): the link is over either way.
    fn recv<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        enum Got {
            Parent(ParentMessage),
            Worker(WorkerMessage),
        }
        let got = py
            .detach(|| {
                let mut end = self.end.lock().unwrap_or_else(|e| e.into_inner());
                match &mut *end {
                    End::Worker(link) => link.recv().map(Got::Parent),
                    End::Parent(worker) => worker.recv().map(Got::Worker),
                }
            })
            .or_raise()?;
        Ok(match got {
            Got::Parent(ParentMessage::Stop { grace }) => (
                kind_object(py, Kind::Stop)?,
                grace.as_secs_f64().into_pyobject(py)?.into_any(),
            ),
            Got::Parent(ParentMessage::SiblingFailed(notice)) => (
                kind_object(py, Kind::SiblingFailed)?,
                PyBytes::new(py, &notice).into_any(),
            ),
            Got::Worker(WorkerMessage::Ready(payload)) => (
                kind_object(py, Kind::Ready)?,
                PyBytes::new(py, &payload).into_any(),
            ),
            Got::Worker(WorkerMessage::Leaving { exitcode, stderr }) => (
                kind_object(py, Kind::Leaving)?,
                (exitcode, PyList::new(py, stderr)?)
                    .into_pyobject(py)?
                    .into_any(),
            ),
        })
    }

    /// End the connection both ways (a `recv` waiting on it returns).
    fn shutdown(&self) {
        self.sender.shutdown()
    }
}

/// The parent's end of the link: a listening socket and its ticket; `accept` admits one
/// worker at a time, in the calling thread (the GIL released). A `WorkerProcesses`
/// parent does not use it: its group admits with `WorkerGroup.admit_remote`.
#[pyclass(module = "shmq._core", frozen)]
pub struct LinkListener {
    listener: WorkerListener,
}

#[pymethods]
impl LinkListener {
    /// Listen on `host`:`port` (0: any free port) with a fresh random token.
    #[new]
    fn new(host: &str, port: u16) -> PyResult<Self> {
        Ok(LinkListener {
            listener: WorkerListener::bind((host, port)).or_raise()?,
        })
    }

    /// The ticket a worker joins with (its text).
    #[getter]
    fn ticket(&self) -> String {
        self.listener.ticket().to_string()
    }

    /// Accept the next connection and admit it, whatever rank it asks for, if it proves
    /// the token (`PermissionError` for one refused); its link.
    fn accept(&self, py: Python<'_>) -> PyResult<Link> {
        let worker = py.detach(|| self.listener.accept(|_| Ok(()))).or_raise()?;
        Ok(Link::new(End::Parent(worker)))
    }
}

/// `LinkKind`: an `IntEnum` of `link::Kind::ALL` (its names and bytes).
fn link_kind_enum<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
    let members: Vec<(&str, u8)> = Kind::ALL.iter().map(|k| (k.name(), k.byte())).collect();
    let kind = py
        .import("enum")?
        .getattr("IntEnum")?
        .call1(("LinkKind", members))?;
    kind.setattr("__module__", "shmq._core")?;
    kind.setattr(
        "__doc__",
        "The kinds of the worker link's frames (the core's `link::Kind`): each one's byte.",
    )?;
    Ok(kind)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("LinkKind", link_kind_enum(py)?)?;
    m.add("LINK_MAX_FRAME", shmq::workers::link::MAX_FRAME)?;
    m.add("LINK_MAX_HELLO_FRAME", shmq::workers::link::MAX_HELLO_FRAME)?;
    m.add(
        "LINK_HANDSHAKE_TIMEOUT",
        shmq::workers::link::HANDSHAKE_TIMEOUT.as_secs_f64(),
    )?;
    m.add("LINK_MAX_HANDSHAKES", shmq::workers::link::MAX_HANDSHAKES)?;
    m.add_class::<Link>()?;
    m.add_class::<LinkListener>()?;
    Ok(())
}
