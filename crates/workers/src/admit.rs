//! Remote workers in one call: [`Workers::admit_remote`] accepts, admits and serves them
//! from threads of the group's own, and [`Workers::close`] stops them.

use std::collections::HashMap;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::link::{LinkError, Ticket, WorkerListener};
use crate::monitor::Notices;
use crate::watch::Shared;
use crate::{Error, Result, Workers};

/// Connections in their handshake at once; a connection past them is closed at once
/// (the Python parent's bound).
const MAX_HANDSHAKES: usize = 32;
/// Between accepts while they fail (out of descriptors, say).
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// Every connection's stream (a clone, shut down at close: that ends its handshake or
/// its serving) and thread, by connection number.
type Conns = Arc<Mutex<HashMap<u64, (TcpStream, Option<JoinHandle<()>>)>>>;

/// What [`Workers::admit_remote`] started, stopped by [`Workers::close`].
pub(crate) struct Admission {
    listener: Arc<WorkerListener>,
    stop: Arc<Mutex<bool>>,
    accept: Option<JoinHandle<()>>,
    conns: Conns,
}

impl Workers {
    /// Admit this group's remote workers (its ranks after the local ones,
    /// [`Workers::new`]) from `listener`, from now on, on threads of the group's own:
    /// each connection's handshake (at most 32 at once) claims the rank the worker asks
    /// for ([`claim_remote`](Self::claim_remote): a rank not expected, or taken, is
    /// refused and told why), then its link is served (ready, leaving, its loss as its
    /// death, as [`RemoteWorker::serve`](crate::link::RemoteWorker::serve)) and told of a
    /// sibling's failure ([`tell_siblings`](Self::tell_siblings)). [`close`](Self::close)
    /// (also on drop) asks every admitted worker to stop within the grace period, then
    /// stops listening and ends every connection and thread. Returns the ticket workers
    /// join with ([`ParentLink::connect`](crate::link::ParentLink::connect), Python's
    /// `connect_to_parent`). Err if admission was started already, or its thread cannot
    /// start.
    ///
    /// ```no_run
    /// # mod shmq { pub mod workers { pub use shmq_workers::*; } }
    /// use std::time::Duration;
    /// use shmq::workers::{link::WorkerListener, WorkerOptions, Workers};
    ///
    /// let workers = Workers::new(0, 2, WorkerOptions::default())?; // two remote ranks
    /// let ticket = workers.admit_remote(WorkerListener::bind("0.0.0.0:0")?)?;
    /// // ... hand `ticket.to_string()` to the workers (a trusted channel) ...
    /// workers.wait_until_ready(Duration::from_secs(60))?;
    /// // ... work; a monitor (`workers.monitor()`) tells them of a failure ...
    /// workers.close(); // each asked to stop, then the connections ended
    /// # Ok::<(), shmq::workers::Error>(())
    /// ```
    pub fn admit_remote(&self, listener: WorkerListener) -> Result<Ticket> {
        let mut admission = self.admission.lock().unwrap_or_else(|e| e.into_inner());
        if admission.is_some() {
            return Err(Error::Core(shmq_core::Error::WrongRole(
                "remote workers are admitted already (admit_remote was called)".into(),
            )));
        }
        if self.closing() {
            return Err(LinkError::Refused("the worker group is shutting down".into()).into());
        }
        let ticket = listener.ticket().clone();
        let listener = Arc::new(listener);
        let stop = Arc::new(Mutex::new(false));
        let conns = Arc::default();
        let accept = {
            let (listener, stop, conns) = (listener.clone(), stop.clone(), Arc::clone(&conns));
            let (shared, notices) = (self.shared.clone(), self.notices.clone());
            std::thread::Builder::new()
                .name("shmq-workers-accept".into())
                .spawn(move || accept_loop(&listener, &stop, &conns, &shared, &notices))
                .map_err(|e| Error::os("starting the thread that admits remote workers", e))?
        };
        *admission = Some(Admission {
            listener,
            stop,
            accept: Some(accept),
            conns,
        });
        Ok(ticket)
    }

    /// Ask every remote worker admitted by [`admit_remote`](Self::admit_remote) or
    /// [`accept_into`](crate::link::WorkerListener::accept_into) to stop within `grace`
    /// (part of [`close_with`](Self::close_with)).
    pub(crate) fn stop_remote(&self, grace: Duration) {
        let links: Vec<_> = {
            let notices = self.notices.lock().unwrap_or_else(|e| e.into_inner());
            notices.links.iter().map(|(_, l)| l.clone()).collect()
        };
        for link in links {
            let _ = link.send_stop(grace); // a link that is gone: its worker is too
        }
    }

    /// Stop admitting: the listener shut down (its accept ends), every connection ended
    /// (its handshake or serving ends), every thread joined (part of
    /// [`close_finish`](Self::close_finish)).
    pub(crate) fn end_admission(&self) {
        let Some(mut admission) = self
            .admission
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        *admission.stop.lock().unwrap_or_else(|e| e.into_inner()) = true;
        // SAFETY: shutdown(2) of our listening socket: a blocked accept returns (EINVAL).
        unsafe { libc::shutdown(admission.listener.listener().as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(accept) = admission.accept.take() {
            let _ = accept.join();
        }
        // No connection is added from here on (the accept thread is gone).
        let threads: Vec<JoinHandle<()>> = {
            let mut conns = admission.conns.lock().unwrap_or_else(|e| e.into_inner());
            conns
                .drain()
                .filter_map(|(_, (stream, thread))| {
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                    thread
                })
                .collect()
        };
        for thread in threads {
            let _ = thread.join();
        }
    }
}

fn accept_loop(
    listener: &Arc<WorkerListener>,
    stop: &Mutex<bool>,
    conns: &Conns,
    shared: &Arc<Shared>,
    notices: &Arc<Mutex<Notices>>,
) {
    let mut next: u64 = 0;
    loop {
        let accepted = listener.listener().accept();
        if *stop.lock().unwrap_or_else(|e| e.into_inner()) {
            return;
        }
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => match e.raw_os_error() {
                Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK) => return, // the listener is gone
                _ => {
                    std::thread::sleep(ACCEPT_PAUSE); // a failed connection, or out of fds
                    continue;
                }
            },
        };
        let Ok(clone) = stream.try_clone() else {
            continue; // out of descriptors: that connection is dropped
        };
        let mut table = conns.lock().unwrap_or_else(|e| e.into_inner());
        // Finished threads go (their connection is over).
        table.retain(|_, (_, t)| t.as_ref().is_some_and(|t| !t.is_finished()));
        if table.len() >= MAX_HANDSHAKES + serving(shared) {
            shmq_log!(
                warn,
                "too many worker handshakes in progress: closed a connection"
            );
            continue;
        }
        let id = next;
        next += 1;
        let (listener, shared, notices) = (listener.clone(), shared.clone(), notices.clone());
        let thread = std::thread::Builder::new()
            .name("shmq-workers-remote".into())
            .spawn(move || admit_and_serve(&listener, stream, &shared, &notices));
        match thread {
            Ok(thread) => {
                table.insert(id, (clone, Some(thread)));
            }
            Err(e) => shmq_log!(warn, "could not start a remote worker's thread: {e}"),
        }
    }
}

/// How many remote workers are connected (their threads serve them, not handshakes).
fn serving(shared: &Shared) -> usize {
    let state = shared.lock();
    state
        .members
        .iter()
        .filter(|m| m.remote && !m.host.is_empty() && !m.exited)
        .count()
}

fn admit_and_serve(
    listener: &WorkerListener,
    stream: TcpStream,
    shared: &Shared,
    notices: &Mutex<Notices>,
) {
    let claimed = std::cell::Cell::new(None);
    let admitted = listener.handshake(stream, |hello| {
        let rank = hello.rank as usize;
        shared.claim_remote(rank, hello.pid)?;
        claimed.set(Some(rank));
        Ok(())
    });
    let worker = match admitted {
        Ok(worker) => worker,
        Err(e) => {
            if let Some(rank) = claimed.get() {
                let how = format!("lost its connection during its handshake ({e})");
                shared.report_exit(rank, None, Vec::new(), Some(how));
            } else {
                shmq_log!(warn, "{e}");
            }
            return;
        }
    };
    let rank = worker.rank() as usize;
    if !shared.remote_connected(rank, worker.host()) {
        worker.shutdown();
        return;
    }
    notices
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .links
        .push((rank, worker.sender()));
    worker.serve_shared(shared);
}
