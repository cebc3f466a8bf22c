//! ZeroMQ transport: the writer's publish sockets and the readers' subscriptions.
//!
//! - Local readers get an `ipc://` publish socket for messages too large for a chunk, in
//!   an owner-only directory next to the ring's segment in `/dev/shm` (so only its
//!   owner reaches it, also from another network namespace).
//! - Remote readers are served by [`crate::remote`] (authenticated, over TCP).
//! - The ready handshake: publishers are XPUB sockets with `XPUB_VERBOSE`, so the writer
//!   receives one subscription per reader; once all are in it publishes [`READY`], and
//!   every message after that reaches every reader. A reader subscribes when it connects
//!   and never waits for `READY`: the first message its socket receives is `READY`, which
//!   its first receive takes first ([`Subscriber`]). So a reader's readiness never waits
//!   on its writer's, and no order of `wait_until_ready` calls across queues deadlocks.
//!
//! Sockets (and the queues' contexts) are never torn down in a forked child: see
//! [`shmq_os::fork`].
//!
//! High-water marks are off on both ends: a slow remote reader makes the writer's
//! memory grow rather than lose messages (local readers are bounded by the ring).

use crate::error::{Error, Result};
use crate::wait::Wait;
use shmq_os::fork::LeakInChild;
use std::time::Duration;

/// The handshake message the writer publishes once every reader has subscribed.
pub const READY: &[u8] = b"READY";

/// The process's ZeroMQ context, for every socket whose messages need no flushing by the
/// context's termination: readers' sockets, and the writer's remote socket (its
/// `close` waits for each reader's BYE). One context is one I/O thread per process
/// instead of one per queue: in a process that both sends and receives (a ping-pong
/// of two queues over TCP) each message then wakes one thread fewer (measured:
/// `docs/performance.md`, "Small messages: what the queue adds to pickling").
/// The writer's local publisher keeps a context of its own: its queued overflow
/// messages are flushed when that context ends (`LINGER_MS`).
///
/// It is never terminated (it lives as long as the process). A forked child gets its
/// own, leaking the inherited one unused ([`shmq_os::fork`]); a caller that finds the
/// slot locked (another thread making one, or a lock a fork left taken) gets a context
/// of its own, which ends with its last socket as before.
pub(crate) fn shared_context() -> zmq::Context {
    use std::sync::Mutex;
    static SHARED: Mutex<Option<(u64, zmq::Context)>> = Mutex::new(None);
    let Ok(mut slot) = SHARED.try_lock() else {
        return zmq::Context::new();
    };
    let generation = shmq_os::fork::generation();
    match slot.take() {
        Some((made_in, ctx)) if made_in == generation => {
            *slot = Some((made_in, ctx.clone()));
            return ctx;
        }
        // Terminating the parent's context in a child hangs: leak it.
        Some((_, inherited)) => std::mem::forget(inherited),
        None => {}
    }
    let ctx = zmq::Context::new();
    *slot = Some((generation, ctx.clone()));
    ctx
}

/// Longest a socket poll sleeps before the waiter's checks run again.
pub(crate) const POLL_SLICE: Duration = Duration::from_millis(5);

/// Wait until `socket` has a message to receive, at most one poll slice (less if `wait`
/// has less time left); whether it has one. `context` says what was awaited, for the
/// error (made only if there is one: this runs every slice of every wait).
///
/// A poll a signal interrupted (EINTR: a handled signal, SIGCHLD or one of the
/// program's own, or Ctrl-C) is no error but a slice that found nothing: `false`, so the
/// caller's `wait.step` runs next, and with it the wait's hook (the Python bindings run
/// the signal handlers there: a `KeyboardInterrupt` a handler raises ends the wait, a
/// handler that only counts lets it go on), and the next slice gets what is left of the
/// timeout.
pub(crate) fn poll_slice(
    socket: &zmq::Socket,
    wait: &Wait,
    context: impl FnOnce() -> String,
) -> Result<bool> {
    let slice = wait.remaining().map_or(POLL_SLICE, |r| r.min(POLL_SLICE));
    match socket.poll(zmq::POLLIN, slice.as_millis() as i64) {
        Ok(ready) => Ok(ready != 0),
        Err(zmq::Error::EINTR) => Ok(false),
        Err(e) => Err(Error::transport(context())(e)),
    }
}

/// How long closing a publisher may still flush queued messages.
const LINGER_MS: i32 = 1000;

/// Refuse an endpoint ZeroMQ cannot be given: one with a NUL character (the zmq crate
/// panics on it; a handle can carry anything). Call it before every connect and bind.
pub(crate) fn check_endpoint(endpoint: &str) -> Result<()> {
    if endpoint.contains('\0') {
        return Err(Error::InvalidArgument(format!(
            "not a ZeroMQ endpoint (it contains a NUL character): {endpoint:?}"
        )));
    }
    Ok(())
}

/// The error of a connect or bind to `endpoint` (`context` says which): an endpoint that
/// ZeroMQ rejects as such (malformed, an unknown transport) is a bad argument (a
/// `ValueError` in Python: a handle can carry any text), anything else a transport error.
pub(crate) fn endpoint_error(
    context: String,
    endpoint: &str,
) -> impl FnOnce(zmq::Error) -> Error + '_ {
    move |e| match e {
        zmq::Error::EINVAL | zmq::Error::EPROTONOSUPPORT | zmq::Error::ENOCOMPATPROTO => {
            Error::InvalidArgument(format!(
                "{context}: {endpoint:?} is not a ZeroMQ endpoint that can be used here ({e})"
            ))
        }
        source => Error::Transport { context, source },
    }
}

fn ctx_socket(ctx: &zmq::Context, kind: zmq::SocketType, what: &str) -> Result<zmq::Socket> {
    ctx.socket(kind)
        .map_err(Error::transport(format!("creating the {what} socket")))
}

/// The writer's end: an XPUB socket bound to one endpoint.
pub struct Publisher {
    socket: LeakInChild<zmq::Socket>,
    endpoint: String,
    subscribers: usize,
    /// READY has been published: the handshake is done and is not repeated.
    ready: bool,
    /// The directory of an `ipc://` socket, removed with the publisher. Declared after
    /// the socket, so the socket closes first.
    _dir: Option<SocketDir>,
}

/// The suffix of the directory that holds a segment's local socket: the directory is
/// `/dev/shm/<segment>.sock`, or `<segment>.<16 hex digits>.sock` where that name was
/// taken (the writer then draws another name).
pub const SOCKET_DIR_SUFFIX: &str = ".sock";

/// How many names [`SocketDir::create`] tries past `<segment>.sock`.
const SOCKET_DIR_TRIES: usize = 16;

/// The segment whose socket directory is `/dev/shm/<dir>` ([`SOCKET_DIR_SUFFIX`]):
/// `<segment>.sock` or `<segment>.<16 hex digits>.sock`; `None` for any other name.
pub fn socket_dir_segment(dir: &str) -> Option<&str> {
    let stem = dir.strip_suffix(SOCKET_DIR_SUFFIX)?;
    Some(match stem.rsplit_once('.') {
        Some((segment, r)) if r.len() == 16 && r.bytes().all(|b| b.is_ascii_hexdigit()) => segment,
        _ => stem,
    })
}

/// The owner-only (0700) directory of a local socket, next to its segment in `/dev/shm`.
/// Owner-only, so another user cannot reach the socket (a 0600 segment is not enough:
/// the socket is a second door); in `/dev/shm`, so that processes that share the
/// segment reach it also from another network namespace (an abstract socket would not
/// be). The process that made it removes it (a forked child does not).
///
/// Its name is `<segment>.sock`, unless something has that name: anyone may make a
/// file or directory in `/dev/shm`, and another user who sees the segment appear can
/// make `<segment>.sock` before the writer does (issue 44). The directory is then
/// `<segment>.<r>.sock`, `r` 64 bits from the kernel's random source, which nobody can
/// tell in advance; `mkdir` makes it or fails, never taking what is there. Readers
/// learn the socket's address from the queue's handle, so the name does not matter to
/// them.
#[derive(Debug)]
struct SocketDir {
    path: String,
    made_in: u64,
}

impl SocketDir {
    fn create(segment: &str) -> Result<SocketDir> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = shmq_os::segment::SHM_DIR;
        let mut path = format!("{dir}/{segment}{SOCKET_DIR_SUFFIX}");
        let mut tries = 0;
        loop {
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => break,
                Err(e)
                    if e.kind() == std::io::ErrorKind::AlreadyExists
                        && tries < SOCKET_DIR_TRIES =>
                {
                    tries += 1;
                    let r = u64::from_le_bytes(shmq_os::random::random_bytes::<8>(
                        "a socket directory's name",
                    )?);
                    path = format!("{dir}/{segment}.{r:016x}{SOCKET_DIR_SUFFIX}");
                }
                Err(e) => {
                    return Err(Error::os(
                        format!("creating the socket directory {path}"),
                        e,
                    ));
                }
            }
        }
        shmq_os::segment::note_created(&path);
        Ok(SocketDir {
            path,
            made_in: shmq_os::fork::generation(),
        })
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        if !shmq_os::fork::is_inherited(self.made_in) {
            let _ = std::fs::remove_dir_all(&self.path);
            shmq_os::segment::forget_created(&self.path);
        }
    }
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl Publisher {
    fn bind(ctx: &zmq::Context, addr: &str, ipv6: bool) -> Result<Publisher> {
        let socket = ctx_socket(ctx, zmq::XPUB, "publish")?;
        let opt = |what: &str| Error::transport(format!("setting {what} on the publish socket"));
        socket.set_xpub_verbose(true).map_err(opt("XPUB_VERBOSE"))?;
        socket.set_sndhwm(0).map_err(opt("SNDHWM"))?;
        socket.set_rcvhwm(0).map_err(opt("RCVHWM"))?;
        socket.set_linger(LINGER_MS).map_err(opt("LINGER"))?;
        socket.set_ipv6(ipv6).map_err(opt("IPV6"))?;
        check_endpoint(addr)?;
        socket
            .bind(addr)
            .map_err(endpoint_error("binding the publish socket".into(), addr))?;
        let endpoint = socket
            .get_last_endpoint()
            .map_err(Error::transport("reading the bound endpoint"))?
            .map_err(|_| Error::InvalidArgument("the bound endpoint is not UTF-8".into()))?;
        Ok(Publisher {
            socket: LeakInChild::new(socket),
            _dir: None,
            endpoint,
            subscribers: 0,
            ready: false,
        })
    }

    /// Bind an `ipc://` socket for the readers of segment `segment`, in an owner-only
    /// directory next to it (see [`SocketDir`]).
    pub fn bind_ipc(ctx: &zmq::Context, segment: &str) -> Result<Publisher> {
        let dir = SocketDir::create(segment)?;
        let mut p = Self::bind(ctx, &format!("ipc://{}/o", dir.path), false)?;
        p._dir = Some(dir);
        Ok(p)
    }

    /// The address readers connect to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Wait for `n` subscriptions (one per reader), then publish [`READY`]. Once done,
    /// calling it again does nothing (a READY more would reach readers as a message).
    /// `peers_alive` is checked now and then (a reader that died never subscribes);
    /// `explain`, given how many have subscribed, says who is missing (in the wait's
    /// warnings and its timeout).
    pub fn wait_for_subscribers(
        &mut self,
        n: usize,
        wait: &mut Wait,
        peers_alive: &mut dyn FnMut() -> Result<()>,
        explain: &mut dyn FnMut(usize) -> String,
    ) -> Result<()> {
        if self.ready {
            return Ok(());
        }
        while self.subscribers < n {
            let subscribers = self.subscribers;
            if !poll_slice(&self.socket, wait, || "waiting for subscribers".into())? {
                wait.step_explained(peers_alive, &mut || explain(subscribers))?;
                continue;
            }
            // Without waiting: the poll saw it there. A receive a signal interrupted
            // (EINTR) runs the wait's checks (the signal handlers), then polls again.
            let msg = match self.socket.recv_bytes(zmq::DONTWAIT) {
                Ok(msg) => msg,
                Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => {
                    wait.step_explained(peers_alive, &mut || explain(subscribers))?;
                    continue;
                }
                Err(e) => return Err(Error::transport("receiving a subscription")(e)),
            };
            // A subscription message is 0x01 followed by the topic; 0x00 is an unsubscribe.
            match msg.first() {
                Some(1) => self.subscribers += 1,
                Some(0) => self.subscribers = self.subscribers.saturating_sub(1),
                _ => {}
            }
        }
        self.send(READY)?;
        self.ready = true;
        Ok(())
    }

    /// Publish one message to every subscriber (never blocks: high-water mark is off).
    pub fn send(&self, msg: &[u8]) -> Result<()> {
        self.socket
            .send(msg, 0)
            .map_err(Error::transport(format!("publishing {} bytes", msg.len())))
    }

    /// Publish one message of several frames (delivered whole or not at all).
    pub fn send_frames(&self, frames: &[&[u8]]) -> Result<()> {
        self.socket
            .send_multipart(frames.iter().copied(), 0)
            .map_err(Error::transport(format!(
                "publishing a message of {} frames",
                frames.len()
            )))
    }
}

/// A reader's end: a SUB socket subscribed to everything.
///
/// The writer publishes [`READY`] before any message (once every reader's subscription
/// is in), so `READY` is the first message this socket receives: whichever receive comes
/// first ([`take_ready_if_here`](Self::take_ready_if_here) or a message's) takes it, and receives of messages never see it.
pub struct Subscriber {
    socket: LeakInChild<zmq::Socket>,
    endpoint: String,
    /// `READY` has been received (it comes once, first).
    ready: std::cell::Cell<bool>,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl Subscriber {
    pub fn connect(ctx: &zmq::Context, endpoint: &str, ipv6: bool) -> Result<Subscriber> {
        let socket = ctx_socket(ctx, zmq::SUB, "subscribe")?;
        let opt = |what: &str| Error::transport(format!("setting {what} on the subscribe socket"));
        socket.set_rcvhwm(0).map_err(opt("RCVHWM"))?;
        socket.set_linger(0).map_err(opt("LINGER"))?;
        socket.set_ipv6(ipv6).map_err(opt("IPV6"))?;
        socket.set_subscribe(b"").map_err(opt("SUBSCRIBE"))?;
        check_endpoint(endpoint)?;
        socket
            .connect(endpoint)
            .map_err(endpoint_error("connecting".into(), endpoint))?;
        Ok(Subscriber {
            socket: LeakInChild::new(socket),
            endpoint: endpoint.to_owned(),
            ready: std::cell::Cell::new(false),
        })
    }

    /// Take the writer's [`READY`] if it has arrived (never waits); whether it has come.
    pub fn take_ready_if_here(&self) -> Result<bool> {
        if !self.ready.get() {
            if let Some(m) = self.try_recv_raw()? {
                self.check_ready(&m)?;
            }
        }
        Ok(self.ready.get())
    }

    /// `m`, the first message this socket received, is the writer's [`READY`]: noted.
    fn check_ready(&self, m: &zmq::Message) -> Result<()> {
        if &m[..] != READY {
            return Err(Error::InvalidArgument(format!(
                "expected the writer's READY from {}, got {} other bytes (the writer sent before \
                 its wait_until_ready returned)",
                self.endpoint,
                m.len()
            )));
        }
        self.ready.set(true);
        Ok(())
    }

    /// The next message if one has arrived (the writer's [`READY`] before it taken and
    /// not returned). A receive a signal interrupted (EINTR) is one that found nothing:
    /// the caller's wait runs its checks (signals), then tries again.
    pub fn try_recv(&self) -> Result<Option<zmq::Message>> {
        if !self.take_ready_if_here()? {
            return Ok(None);
        }
        self.try_recv_raw()
    }

    /// The next message as it came, `READY` included.
    fn try_recv_raw(&self) -> Result<Option<zmq::Message>> {
        match self.socket.recv_msg(zmq::DONTWAIT) {
            Ok(m) => Ok(Some(m)),
            Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => Ok(None),
            Err(e) => Err(Error::Transport {
                context: format!("receiving from {}", self.endpoint),
                source: e,
            }),
        }
    }

    /// The next message, all its frames, if one has arrived.
    pub fn try_recv_frames(&self) -> Result<Option<Vec<zmq::Message>>> {
        let Some(first) = self.try_recv()? else {
            return Ok(None);
        };
        self.with_more_frames(first).map(Some)
    }

    /// Wait for the next message, all its frames; `peer_alive` is checked now and then.
    pub fn recv_frames(
        &self,
        wait: &mut Wait,
        peer_alive: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<zmq::Message>> {
        let first = self.recv(wait, peer_alive)?;
        self.with_more_frames(first)
    }

    /// `first` and the frames of its message after it.
    fn with_more_frames(&self, first: zmq::Message) -> Result<Vec<zmq::Message>> {
        let mut frames = vec![first];
        // The frames of a message arrive together: the rest are already here.
        while frames.last().is_some_and(|m| m.get_more()) {
            let m = self.socket.recv_msg(0).map_err(Error::transport(format!(
                "receiving a frame from {}",
                self.endpoint
            )))?;
            frames.push(m);
        }
        Ok(frames)
    }

    /// Wait for the next message; `peer_alive` is checked now and then.
    pub fn recv(
        &self,
        wait: &mut Wait,
        peer_alive: &mut dyn FnMut() -> Result<()>,
    ) -> Result<zmq::Message> {
        loop {
            if let Some(m) = self.try_recv()? {
                return Ok(m);
            }
            let context = || format!("waiting for a message from {}", self.endpoint);
            if !poll_slice(&self.socket, wait, context)? {
                wait.step(peer_alive)?;
            }
        }
    }
}

/// The address remote readers should use to reach this host: `SHMQ_HOST_IP` if set
/// (else vLLM's `VLLM_HOST_IP`), else the first address the host name resolves to, else
/// `127.0.0.1`.
pub fn default_connect_ip() -> String {
    if let Ok(ip) = std::env::var("SHMQ_HOST_IP").or_else(|_| std::env::var("VLLM_HOST_IP")) {
        if !ip.trim().is_empty() {
            return ip.trim().to_owned();
        }
    }
    use std::net::ToSocketAddrs;
    if let Some(host) = shmq_os::process::host_name() {
        if let Ok(addrs) = (host.as_str(), 0).to_socket_addrs() {
            if let Some(a) = addrs.map(|a| a.ip()).find(|ip| !ip.is_unspecified()) {
                return a.to_string();
            }
        }
    }
    "127.0.0.1".to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn a_socket_dirs_segment_is_read_from_either_form_of_its_name() {
        assert_eq!(
            socket_dir_segment("shmq_ring_1_ab.sock"),
            Some("shmq_ring_1_ab")
        );
        assert_eq!(
            socket_dir_segment("shmq_ring_1_ab.0123456789abcdef.sock"),
            Some("shmq_ring_1_ab")
        );
        // Not 16 hex digits: part of the segment's name.
        assert_eq!(socket_dir_segment("a.b.sock"), Some("a.b"));
        assert_eq!(socket_dir_segment("shmq_ring_1_ab"), None);
    }

    /// Issue 44: another user made `<segment>.sock` first (a directory anyone may write
    /// in, or a file): the writer's socket goes in a directory of a fresh name beside it,
    /// owner-only, and the other user's entry is left alone.
    #[test]
    fn a_taken_socket_dir_name_is_passed_over() {
        for squat_dir in [true, false] {
            let segment = shmq_os::segment::unique_name("test");
            let taken = format!("{}/{segment}{SOCKET_DIR_SUFFIX}", shmq_os::segment::SHM_DIR);
            if squat_dir {
                std::fs::create_dir(&taken).unwrap();
                std::fs::set_permissions(&taken, std::fs::Permissions::from_mode(0o777)).unwrap();
            } else {
                std::fs::write(&taken, b"").unwrap();
            }
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } == 0 {
                std::os::unix::fs::lchown(&taken, Some(65534), Some(65534)).unwrap();
            }
            let ctx = zmq::Context::new();
            let publisher = Publisher::bind_ipc(&ctx, &segment).unwrap();
            let endpoint = publisher.endpoint().to_owned();
            let path = endpoint.strip_prefix("ipc://").unwrap();
            let dir = std::path::Path::new(path).parent().unwrap();
            assert_ne!(dir, std::path::Path::new(&taken), "{endpoint}");
            let dir_name = dir.file_name().unwrap().to_str().unwrap();
            assert_eq!(socket_dir_segment(dir_name), Some(segment.as_str()));
            let meta = std::fs::metadata(dir).unwrap();
            // SAFETY: geteuid has no preconditions.
            assert_eq!(meta.uid(), unsafe { libc::geteuid() });
            assert_eq!(meta.permissions().mode() & 0o777, 0o700);
            drop(publisher);
            drop(ctx);
            assert!(!dir.exists(), "the writer's own directory goes with it");
            assert!(std::path::Path::new(&taken).exists(), "the other's stays");
            if squat_dir {
                std::fs::remove_dir(&taken).unwrap();
            } else {
                std::fs::remove_file(&taken).unwrap();
            }
        }
    }
}
