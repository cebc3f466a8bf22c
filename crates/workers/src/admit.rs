//! Remote workers in one call: [`Workers::admit_remote`] accepts, admits and serves them
//! from threads of the group's own, and [`Workers::close`] stops them.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::link::{
    HandshakeSlot, HandshakeSlots, LinkError, Ticket, WorkerListener, HANDSHAKE_TIMEOUT,
    MAX_HANDSHAKES,
};
use crate::monitor::Notices;
use crate::watch::Shared;
use crate::{Error, Result, Workers};

/// Between accepts while they fail (out of descriptors, say), doubling up to
/// [`ACCEPT_PAUSE_MAX`].
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);
const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);

/// The threads of the connections (handshakes, then the admitted workers' links).
type Threads = Arc<Mutex<Vec<JoinHandle<()>>>>;

/// What [`Workers::admit_remote`] started, stopped by [`Workers::close`].
pub(crate) struct Admission {
    listener: Arc<WorkerListener>,
    stop: Arc<Mutex<bool>>,
    accept: Option<JoinHandle<()>>,
    slots: HandshakeSlots,
    threads: Threads,
}

impl Workers {
    /// Admit this group's remote workers (its ranks after the local ones,
    /// [`Workers::new`]) from `listener`, from now on, on threads of the group's own:
    /// each connection's handshake, at most [`MAX_HANDSHAKES`] at once
    /// ([`HandshakeSlots`]: with every slot taken, the oldest connection still waiting
    /// for its hello of the host with the most gives way) and each within
    /// [`HANDSHAKE_TIMEOUT`], claims the rank the worker asks
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
    ///
    /// # Errors
    ///
    /// [`Error::Core`] with `WrongRole` when remote workers are admitted already (a second
    /// call); [`Error::Link`] with [`LinkError::Refused`] once the group is shutting down;
    /// [`Error::Core`] with `Os` when the admission thread cannot start.
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
        let slots = HandshakeSlots::new(MAX_HANDSHAKES);
        let threads = Threads::default();
        let accept = {
            let run = Accept {
                listener: listener.clone(),
                stop: stop.clone(),
                slots: slots.clone(),
                threads: threads.clone(),
                shared: self.shared.clone(),
                notices: self.notices.clone(),
            };
            std::thread::Builder::new()
                .name("shmq-workers-accept".into())
                .spawn(move || run.accept_loop())
                .map_err(|e| Error::os("starting the thread that admits remote workers", e))?
        };
        *admission = Some(Admission {
            listener,
            stop,
            accept: Some(accept),
            slots,
            threads,
        });
        Ok(ticket)
    }

    /// Ask every remote worker admitted by [`admit_remote`](Self::admit_remote) or
    /// [`accept_into`](crate::link::WorkerListener::accept_into) to stop within `grace`
    /// (part of [`close_with`](Self::close_with), for a caller that closes in steps:
    /// after [`close_begin`](Self::close_begin), before [`wait_exits`](Self::wait_exits)).
    pub fn stop_remote(&self, grace: Duration) {
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
        {
            // Under the links' lock, which a thread that admitted a worker holds to add its
            // link: every link is either ended here or never added (`Accept::serve`).
            let notices = self.notices.lock().unwrap_or_else(|e| e.into_inner());
            *admission.stop.lock().unwrap_or_else(|e| e.into_inner()) = true;
            for (_, link) in &notices.links {
                link.shutdown();
            }
        }
        // SAFETY: shutdown(2) of our listening socket: a blocked accept returns (EINVAL).
        unsafe { libc::shutdown(admission.listener.listener().as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(accept) = admission.accept.take() {
            let _ = accept.join();
        }
        // No connection is added from here on (the accept thread is gone): every
        // handshake in progress ended, then every thread joined.
        admission.slots.shut_down_all();
        let threads =
            std::mem::take(&mut *admission.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for thread in threads {
            let _ = thread.join();
        }
    }
}

/// What the accepting thread shares with the connections' threads.
#[derive(Clone)]
struct Accept {
    listener: Arc<WorkerListener>,
    stop: Arc<Mutex<bool>>,
    slots: HandshakeSlots,
    threads: Threads,
    shared: Arc<Shared>,
    notices: Arc<Mutex<Notices>>,
}

/// An accept's error as `strerror` says it (without Rust's " (os error N)").
fn os_text(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error ") {
        Some(cut) => text[..cut].to_owned(),
        None => text,
    }
}

impl Accept {
    fn stopped(&self) -> bool {
        *self.stop.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Accept connections until the admission ends. No error of `accept` ends this but
    /// the listener's own end: out of descriptors (`EMFILE`, `ENFILE`) or memory, the
    /// error is logged once and accepting goes on after a pause (the connection waits in
    /// the backlog meanwhile); a connection that failed before it was accepted
    /// (`ECONNABORTED` and the network errors `accept(2)` passes on) is skipped.
    fn accept_loop(self) {
        let mut failing: Option<String> = None; // the error of the streak, logged once
        let mut pause = ACCEPT_PAUSE;
        loop {
            let accepted = self.listener.listener().accept();
            if self.stopped() {
                return;
            }
            let (stream, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => match e.raw_os_error() {
                    Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EFAULT) => {
                        shmq_log!(error, "the port for remote workers stopped accepting: {e}");
                        return;
                    }
                    Some(
                        libc::ECONNABORTED
                        | libc::EPROTO
                        | libc::ENETDOWN
                        | libc::ENOPROTOOPT
                        | libc::EHOSTDOWN
                        | libc::ENONET
                        | libc::EHOSTUNREACH
                        | libc::EOPNOTSUPP
                        | libc::ENETUNREACH
                        | libc::EPERM,
                    ) => continue, // that connection's own failure: the next one
                    _ => {
                        if failing.is_none() {
                            let text = os_text(&e);
                            shmq_log!(
                                warn,
                                "the port for remote workers cannot accept now ({text}): \
                                 retrying every {} s at most",
                                ACCEPT_PAUSE_MAX.as_secs()
                            );
                            failing = Some(text);
                        }
                        std::thread::sleep(pause);
                        pause = (2 * pause).min(ACCEPT_PAUSE_MAX);
                        continue;
                    }
                },
            };
            if let Some(was) = failing.take() {
                shmq_log!(
                    warn,
                    "the port for remote workers accepts again (after: {was})"
                );
                pause = ACCEPT_PAUSE;
            }
            self.start_handshake(stream, peer);
        }
    }

    /// Take a slot for this connection's handshake (one that waits for its hello may
    /// give way: [`HandshakeSlots`]) and run it on a thread of its own (a handshake can
    /// stall: never in the accepting thread).
    fn start_handshake(&self, stream: TcpStream, peer: SocketAddr) {
        let Some((slot, evicted)) = self.slots.take(&stream, peer.ip()) else {
            shmq_log!(
                warn,
                "too many worker handshakes in progress: closed a connection from {peer}"
            );
            return;
        };
        if let Some(host) = evicted {
            shmq_log!(
                warn,
                "{MAX_HANDSHAKES} worker handshakes in progress: dropped the oldest waiting \
                 one of {host}, for a connection from {peer}"
            );
        }
        let mut threads = self.threads.lock().unwrap_or_else(|e| e.into_inner());
        threads.retain(|t| !t.is_finished()); // (finished: joined as they drop)
        let run = self.clone();
        let started = std::thread::Builder::new()
            .name("shmq-workers-remote".into())
            .spawn(move || run.admit_and_serve(stream, peer, slot));
        match started {
            Ok(thread) => threads.push(thread),
            // (The closure, with the stream and then its slot, is dropped.)
            Err(e) => shmq_log!(warn, "could not start the handshake with {peer}: {e}"),
        }
    }

    fn admit_and_serve(self, stream: TcpStream, peer: SocketAddr, slot: HandshakeSlot) {
        let shared = &self.shared;
        let claimed = std::cell::Cell::new(None);
        let handshake = self.listener.handshake_on(&stream, Some(&slot), |hello| {
            let rank = hello.rank as usize;
            shared.claim_remote(rank, hello.pid)?;
            claimed.set(Some(rank));
            Ok(())
        });
        // The slot goes before the stream may close (`HandshakeSlots::take`).
        let evicted = slot.evicted();
        drop(slot);
        let admitted =
            handshake.and_then(|(hello, nonce)| self.listener.admitted(stream, hello, &nonce));
        let worker = match admitted {
            Ok(worker) => worker,
            Err(e) => {
                if let Some(rank) = claimed.get() {
                    let how = format!("lost its connection during its handshake ({e})");
                    shared.report_exit(rank, None, Vec::new(), Some(how));
                }
                match e {
                    Error::Link(LinkError::Refused(why)) => shmq_log!(warn, "{why}"),
                    Error::Link(LinkError::TimedOut) => shmq_log!(
                        warn,
                        "worker handshake with {peer} failed: not done within {} s",
                        HANDSHAKE_TIMEOUT.as_secs()
                    ),
                    // A connection that gave way was logged when it did.
                    _ if evicted => {}
                    e => shmq_log!(warn, "worker handshake with {peer} failed: {e}"),
                }
                return;
            }
        };
        let rank = worker.rank() as usize;
        let host = if worker.host().is_empty() {
            peer.ip().to_string()
        } else {
            worker.host().to_owned()
        };
        {
            let mut notices = self.notices.lock().unwrap_or_else(|e| e.into_inner());
            if self.stopped() || !shared.remote_connected(rank, &host) {
                drop(notices);
                worker.shutdown();
                return;
            }
            notices.links.push((rank, worker.sender()));
        }
        worker.serve_shared(shared);
    }
}
