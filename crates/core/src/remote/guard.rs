//! The guard of the writer's port: a thread that closes connections which never prove
//! the queue's secret (see [`spawn_guard`]).

use std::time::{Duration, Instant};

use crate::error::{Error, RemoteError, Result};

use super::{random16, socket};

/// How long a connection to the writer may stay without a HELLO that proves the
/// secret, counted from its acceptance to a look at the HELLOs by the writer after that.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections without such a HELLO at once, at most: beyond it the oldest are closed.
const MAX_UNAUTHENTICATED: usize = 64;
/// How often the guard looks at its connections when nothing happens.
const GUARD_TICK_MS: i64 = 200;
/// How long the guard of a dropped writer reads its monitor at most, waiting for ZeroMQ's
/// MONITOR_STOPPED (the socket's linger, `LINGER_MS`, and then some).
const GUARD_DRAIN: Duration = Duration::from_secs(5);

/// What the writer's thread tells the guard thread (see [`spawn_guard`]).
#[derive(Debug)]
pub(super) struct Guard {
    /// Descriptors of connections whose HELLO proved the secret.
    pub(super) authenticated: std::sync::Mutex<std::collections::HashSet<i32>>,
    /// When the writer last took every HELLO that had arrived, in ms since `epoch`.
    served_ms: shmq_protocol::sync::local::AtomicU64,
    epoch: Instant,
    /// The writer is gone: the guard closes nothing more, and ends once ZeroMQ stopped
    /// the monitor (at most `GUARD_DRAIN` later).
    pub(super) stop: shmq_protocol::sync::local::AtomicBool,
}

impl Guard {
    pub(super) fn served(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        // Release: the descriptors marked authenticated before this look (under the
        // mutex, itself ordered) are seen by a guard that reads this value (Acquire).
        self.served_ms
            .store(ms, std::sync::atomic::Ordering::Release);
    }
}

/// The peer address of socket `fd`, as bytes (None if it is not a connected socket).
pub(super) fn peer_of(fd: i32) -> Option<Vec<u8>> {
    // SAFETY: all-zero bytes are a valid `sockaddr_storage`.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `addr` is writable for `len` bytes, and getpeername writes at most that
    // and sets `len`; a stale `fd` only makes it fail (EBADF, ENOTSOCK, ENOTCONN).
    let rc = unsafe {
        libc::getpeername(
            fd,
            (&mut addr as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    let len = (len as usize).min(std::mem::size_of::<libc::sockaddr_storage>());
    // SAFETY: `addr` is a plain struct of `size_of` bytes, `len` is within it.
    let bytes = unsafe {
        std::slice::from_raw_parts((&addr as *const libc::sockaddr_storage).cast::<u8>(), len)
    };
    Some(bytes.to_vec())
}

/// Close the connection on `fd` if it is still the one accepted from `peer`: ZeroMQ
/// sees it end and frees the descriptor.
fn close_connection(fd: i32, peer: &Option<Vec<u8>>) {
    // The descriptor may have been closed by ZeroMQ and reused since: only a socket
    // with the same peer address and port (a live TCP connection's address pair is
    // unique) is the same connection.
    if peer.is_none() || peer_of(fd) != *peer {
        return;
    }
    // SAFETY: shutdown changes no memory; on the checked socket it ends the connection
    // (ZeroMQ, which owns the descriptor, reads its end and closes it).
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// The guard of the writer's port: a thread that watches the connections the ROUTER
/// accepts (ZeroMQ's socket monitor: the descriptor of each) and closes those that do
/// not prove the secret in time, so that connections which never say HELLO cannot use
/// up the writer's descriptors. ZeroMQ itself cannot: a ROUTER cannot close a peer,
/// and its handshake and heartbeat timeouts end only connections that fail ZeroMQ's
/// own handshake or stop answering, while a ZeroMQ peer that never says HELLO answers
/// both. So the guard closes (`shutdown(2)`) a connection
/// - without a good HELLO `HELLO_TIMEOUT` after its acceptance, once the writer has
///   looked at the HELLOs after that time (a reader whose HELLO waits in the socket of
///   a writer busy elsewhere is not closed for it), and
/// - the oldest such connections beyond `MAX_UNAUTHENTICATED`, at once (under a flood
///   this can close a real reader still in its handshake: it sees the writer go).
///
/// The writer marks a connection good by its descriptor, which ZeroMQ gives with each
/// message (the `__fd` property).
pub(super) fn spawn_guard(
    ctx: &zmq::Context,
    router: &zmq::Socket,
) -> Result<std::sync::Arc<Guard>> {
    let name = format!(
        "inproc://shmq-remote-guard-{}",
        crate::auth::to_hex(&random16()?)
    );
    let events = zmq::SocketEvent::ACCEPTED as i32
        | zmq::SocketEvent::DISCONNECTED as i32
        | zmq::SocketEvent::CLOSED as i32
        | zmq::SocketEvent::MONITOR_STOPPED as i32;
    router
        .monitor(&name, events)
        .map_err(Error::transport("monitoring the remote socket"))?;
    let mon = socket(ctx, zmq::PAIR, "remote monitor")?;
    mon.connect(&name).map_err(Error::transport(
        "connecting to the remote socket's monitor",
    ))?;
    let guard = std::sync::Arc::new(Guard {
        authenticated: Default::default(),
        served_ms: shmq_protocol::sync::local::AtomicU64::new(0),
        epoch: Instant::now(),
        stop: shmq_protocol::sync::local::AtomicBool::new(false),
    });
    let g = guard.clone();
    std::thread::Builder::new()
        .name("shmq-remote-guard".into())
        .spawn(move || run_guard(mon, &g))
        .map_err(|e| {
            Error::Remote(RemoteError::Refused(format!(
                "starting the remote port's guard thread: {e}"
            )))
        })?;
    Ok(guard)
}

fn run_guard(mon: zmq::Socket, guard: &Guard) {
    use std::sync::atomic::Ordering;
    // Connections not (yet) proved good: descriptor, acceptance, peer address.
    let mut pending: Vec<(i32, Instant, Option<Vec<u8>>)> = Vec::new();
    // Once the writer is gone, the guard closes nothing more but goes on reading the
    // monitor until ZeroMQ says it stopped (the socket's close emits its last events
    // from ZeroMQ's threads after the writer dropped it). A monitor nobody reads blocks
    // the thread that emits into it (libzmq sends monitor events blocking): with the
    // process's shared context (`transport::shared_context`) that is the I/O thread of
    // every other socket of the process, whose new listeners then accept nothing.
    let mut draining_until: Option<Instant> = None;
    loop {
        // Relaxed: the flag carries no data; it is seen at most a tick later.
        if draining_until.is_none() && guard.stop.load(Ordering::Relaxed) {
            draining_until = Some(Instant::now() + GUARD_DRAIN);
        }
        if draining_until.is_some_and(|t| Instant::now() >= t) {
            return;
        }
        if matches!(mon.poll(zmq::POLLIN, GUARD_TICK_MS), Ok(n) if n > 0) {
            while let Ok(frames) = mon.recv_multipart(zmq::DONTWAIT) {
                let Some(ev) = frames.first().filter(|f| f.len() == 6) else {
                    continue;
                };
                let kind = u16::from_ne_bytes([ev[0], ev[1]]);
                let fd = i32::from_ne_bytes([ev[2], ev[3], ev[4], ev[5]]);
                match zmq::SocketEvent::from_raw(kind) {
                    zmq::SocketEvent::ACCEPTED => pending.push((fd, Instant::now(), peer_of(fd))),
                    zmq::SocketEvent::DISCONNECTED | zmq::SocketEvent::CLOSED => {
                        pending.retain(|p| p.0 != fd);
                        guard
                            .authenticated
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&fd);
                    }
                    zmq::SocketEvent::MONITOR_STOPPED => return,
                    _ => {}
                }
            }
        }
        if draining_until.is_some() {
            continue;
        }
        // Acquire: pairs with `Guard::served` (the HELLOs taken by then are marked).
        let served = guard.epoch + Duration::from_millis(guard.served_ms.load(Ordering::Acquire));
        {
            let good = guard
                .authenticated
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            pending.retain(|p| !good.contains(&p.0));
        }
        pending.retain(|(fd, at, peer)| {
            let late = *at + HELLO_TIMEOUT <= served;
            if late {
                close_connection(*fd, peer);
            }
            !late
        });
        if pending.len() > MAX_UNAUTHENTICATED {
            let extra = pending.len() - MAX_UNAUTHENTICATED;
            for (fd, _, peer) in pending.drain(..extra) {
                close_connection(fd, &peer);
            }
        }
    }
}
