//! The parent's handshake slots: how many connections may be in their handshake at once,
//! and which one gives way to a newer connection when every slot is taken.

use std::net::{IpAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};

/// Connections in their handshake at once ([`HandshakeSlots::take`]).
pub const MAX_HANDSHAKES: usize = 32;

/// One connection in its handshake.
struct Pending {
    /// Its number (the order of the accepts: the oldest has the lowest).
    id: u64,
    /// The host it came from.
    host: IpAddr,
    /// Its socket, shut down to drop it (see [`HandshakeSlots::take`] for why the number
    /// still names it).
    fd: RawFd,
    /// Whether it still waits for its hello (only such a one gives way).
    waiting: bool,
}

#[derive(Default)]
struct Table {
    pending: Vec<Pending>,
    next: u64,
}

/// The slots of the handshakes in progress, at most `capacity` ([`MAX_HANDSHAKES`] for a
/// parent's port). With every slot taken, a new connection takes the slot of the oldest
/// connection still waiting for its hello of the host with the most such connections,
/// which is shut down (its handshake's next read ends); so a stranger that floods the
/// port from one host pushes out its own connections, and a genuine worker from another
/// host gets a slot at once: to push a worker's handshake out, a host must open more
/// connections than there are slots in the round trip of the worker's hello. A
/// connection's slot is freed when its handshake ends, at its deadline at the latest
/// ([`HANDSHAKE_TIMEOUT`](super::HANDSHAKE_TIMEOUT)). Shared by the accepting thread and
/// the handshakes' threads.
#[derive(Clone)]
pub struct HandshakeSlots {
    table: Arc<Mutex<Table>>,
    capacity: usize,
}

/// What [`HandshakeSlots::take`] did besides taking a slot: the host of the connection
/// that gave way, if one did.
pub type Evicted = Option<IpAddr>;

/// A connection's slot: freed when dropped.
pub struct HandshakeSlot {
    slots: HandshakeSlots,
    id: u64,
}

impl HandshakeSlots {
    /// `capacity` slots (at least 1).
    pub fn new(capacity: usize) -> HandshakeSlots {
        HandshakeSlots {
            table: Arc::default(),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for `stream`'s handshake (a connection from `host`), and the host of the
    /// connection that gave way for it, if every slot was taken; `None` if every slot is
    /// taken by a connection past its hello (being admitted): `stream` is then the
    /// caller's to close.
    ///
    /// The slot must be dropped before `stream` is closed: while the slot is held, the
    /// number of its socket names it (a connection that gives way is shut down by its
    /// number, under the table's lock, which dropping the slot takes).
    pub fn take(&self, stream: &TcpStream, host: IpAddr) -> Option<(HandshakeSlot, Evicted)> {
        let mut table = self.lock();
        let mut evicted = None;
        if table.pending.len() >= self.capacity {
            let victim = victim(&table.pending)?;
            let gone = table.pending.remove(victim);
            // SAFETY: shutdown(2) of a socket by its number: its handshake's thread holds
            // the socket open for as long as its slot is in the table (the slot is
            // dropped, which takes this lock, before the stream is closed: `take`'s
            // contract), so the number still names that connection, never one a peer
            // could have made reuse it. A peer gains nothing from it: its connection ends.
            unsafe { libc::shutdown(gone.fd, libc::SHUT_RDWR) };
            evicted = Some(gone.host);
        }
        let id = table.next;
        table.next += 1;
        table.pending.push(Pending {
            id,
            host,
            fd: stream.as_raw_fd(),
            waiting: true,
        });
        Some((
            HandshakeSlot {
                slots: self.clone(),
                id,
            },
            evicted,
        ))
    }

    /// End every handshake in progress (a parent that stops admitting): each connection
    /// shut down, its handshake's next read or write ends; the slots are freed as the
    /// handshakes end.
    pub fn shut_down_all(&self) {
        for p in &self.lock().pending {
            // SAFETY: as in `take`: the slot is in the table, so the number still names
            // its connection.
            unsafe { libc::shutdown(p.fd, libc::SHUT_RDWR) };
        }
    }

    /// How many slots are taken.
    pub fn taken(&self) -> usize {
        self.lock().pending.len()
    }
}

/// Of the connections waiting for their hello, the oldest of the host with the most; its
/// index in `pending` (oldest first).
fn victim(pending: &[Pending]) -> Option<usize> {
    let waiting = || pending.iter().filter(|p| p.waiting);
    let count = |host: IpAddr| waiting().filter(|p| p.host == host).count();
    let most = waiting().map(|p| count(p.host)).max()?;
    pending
        .iter()
        .position(|p| p.waiting && count(p.host) == most)
}

impl HandshakeSlot {
    /// Note that its connection's hello arrived: it no longer gives way to a newer
    /// connection. `false` if it gave way already (its connection was shut down: the
    /// handshake is over).
    pub fn hello_arrived(&self) -> bool {
        let mut table = self.slots.lock();
        match table.pending.iter_mut().find(|p| p.id == self.id) {
            Some(p) => {
                p.waiting = false;
                true
            }
            None => false,
        }
    }

    /// Whether its connection gave way to a newer one.
    pub fn evicted(&self) -> bool {
        !self.slots.lock().pending.iter().any(|p| p.id == self.id)
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let id = self.id;
        self.slots.lock().pending.retain(|p| p.id != id);
    }
}
