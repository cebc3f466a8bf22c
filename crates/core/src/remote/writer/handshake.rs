//! The writer's side of joining: the readers' HELLOs, the WELCOME that answers them,
//! and READY, the start of the stream, once every remote reader has joined.

use super::{Peer, Probe, RemoteWriter};
use crate::auth::{mac, mac_eq, message_mac};
use crate::error::{Error, Result};
use crate::remote::guard::peer_of;
use crate::remote::wire::*;
use crate::transport::poll_slice;
use crate::wait::Wait;

impl RemoteWriter {
    /// Take the HELLOs that have arrived: accept the good ones, refuse duplicates and
    /// extra ranks, ignore anything else.
    pub(super) fn serve_hellos(&mut self) -> Result<()> {
        loop {
            // Frame by frame (not `recv_multipart`) to keep the last frame's metadata:
            // the peer's address, which names the reader in warnings.
            let mut frames: Vec<Vec<u8>> = Vec::with_capacity(2);
            let mut host = None;
            let mut fd = None;
            loop {
                let flags = if frames.is_empty() { zmq::DONTWAIT } else { 0 };
                let mut m = match self.socket.recv_msg(flags) {
                    Ok(m) => m,
                    Err(zmq::Error::EAGAIN) if frames.is_empty() => {
                        self.guard.served();
                        return Ok(());
                    }
                    // A signal interrupted the receive: the caller's wait runs its checks
                    // (the signal handlers), then serves again. Not every HELLO that has
                    // arrived was taken, so the guard is not told so.
                    Err(zmq::Error::EINTR) if frames.is_empty() => return Ok(()),
                    Err(e) => {
                        return Err(Error::Transport {
                            context: "receiving from a remote reader".into(),
                            source: e,
                        });
                    }
                };
                let more = m.get_more();
                if !more {
                    host = m.gets("Peer-Address").map(str::to_owned);
                    fd = m.gets("__fd").and_then(|f| f.parse::<i32>().ok());
                }
                frames.push(m.to_vec());
                if !more {
                    break;
                }
            }
            // [identity, hello] or [identity, ack]; anything else is not a shmq reader.
            let [id, hello] = &frames[..] else { continue };
            if hello.len() == ACK && &hello[..4] == MAGIC_ACK {
                self.take_ack(id, &hello[4..]);
                continue;
            }
            if hello.len() != HELLO || &hello[..4] != MAGIC_HELLO {
                continue;
            }
            let rank = u64::from_le_bytes(hello[4..12].try_into().expect("8 bytes"));
            let nonce: [u8; 16] = hello[12..28].try_into().expect("16 bytes");
            let want = mac(&self.key, b"hello", &[&rank.to_le_bytes(), &nonce]);
            if !mac_eq(&want, &hello[28..60]) {
                warn_user!(
                    "shmq: refused a connection to {}{} that does not hold the queue's secret",
                    self.endpoint,
                    self.of_queue()
                );
                continue;
            }
            if let Some(fd) = fd {
                // Proved the secret: the guard leaves its connection alone.
                self.guard
                    .authenticated
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(fd);
            }
            // The connection as the kernel knows it, to see it close (`connection_closed`).
            let conn = fd.and_then(|fd| Some((fd, peer_of(fd)?)));
            self.hello(id, rank, nonce, host, conn)?;
        }
    }

    /// A HELLO that proved the secret, from connection `id`: accept the reader, move a
    /// known one to this connection, or refuse it (with the reason, under a MAC).
    fn hello(
        &mut self,
        id: &[u8],
        rank: u64,
        nonce: [u8; 16],
        host: Option<String>,
        conn: Option<(i32, Vec<u8>)>,
    ) -> Result<()> {
        let known = self.peers.iter().position(|p| p.rank == rank);
        if let Some(k) = known {
            let p = &self.peers[k];
            if p.nonce == nonce && p.id[..] == id[..] {
                // Said again on the same connection: the answer is on its way.
                return Ok(());
            }
            if p.nonce == nonce && !p.dropped && p.sent_msgs == 0 {
                // The same reader on a new connection (its first one closed: a flood
                // the port's guard cut, a network blip): it lost nothing, so it goes on
                // there. The old connection is gone (a DEALER has one at a time).
                let p = &mut self.peers[k];
                p.id = id.to_vec();
                p.host = host;
                p.conn = conn;
                p.pinged = None;
                p.unanswered_pings = 0;
                let started = p.started;
                self.welcome(id, rank, &nonce);
                if started {
                    self.peers[k].started = false;
                    self.start(k)?;
                }
                return Ok(());
            }
            if p.nonce != nonce && !self.ready && self.probe(k) == Probe::Gone {
                // Another reader for a rank whose reader went away before the start:
                // the rank is free again.
                warn_user!(
                    "shmq: remote reader rank {rank} (host {}){} went away before the queue \
                     was ready; a new reader takes its rank",
                    self.peers[k].host.as_deref().unwrap_or("unknown"),
                    self.of_queue()
                );
                self.peers.remove(k);
            }
        }
        let reason = if let Some(p) = self.peers.iter().find(|p| p.rank == rank) {
            Some(if p.nonce == nonce {
                format!(
                    "rank {rank} lost its connection after messages were sent to it (or was \
                     dropped): it cannot join again"
                )
            } else {
                format!("rank {rank} has joined already")
            })
        } else if self.local_ranks.contains(&(rank as usize)) {
            Some(format!("rank {rank} is a local reader"))
        } else if self.peers.len() >= self.expected {
            Some(format!(
                "the queue has {} remote readers already",
                self.expected
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            let m = mac(
                &self.key,
                b"refused",
                &[
                    &rank.to_le_bytes(),
                    &nonce,
                    &self.session,
                    reason.as_bytes(),
                ],
            );
            let h = header(KIND_REFUSED, 0, &self.session, &m);
            // Best effort: a peer gone meanwhile is simply not there.
            let _ = self
                .socket
                .send_multipart([id, &h[..], reason.as_bytes()], zmq::DONTWAIT);
            return Ok(());
        }
        self.welcome(id, rank, &nonce);
        self.peers.push(Peer {
            id: id.to_vec(),
            rank,
            nonce,
            started: false,
            dropped: false,
            host,
            conn,
            sent_msgs: 0,
            sent_bytes: 0,
            taken_msgs: 0,
            taken_bytes: 0,
            last_seq: self.seq,
            pinged: None,
            unanswered_pings: 0,
        });
        if self.ready {
            // Joined after the start: it gets READY at once and messages from now on
            // (it has not missed any it was counted for).
            self.start(self.peers.len() - 1)?;
        }
        Ok(())
    }

    /// Answer a HELLO with WELCOME: the session, the bounds, so the reader knows when to
    /// acknowledge, and the queue's name; under a MAC bound to the reader's nonce. Best effort: a
    /// reader whose connection went meanwhile says HELLO again on its next one.
    fn welcome(&self, id: &[u8], rank: u64, nonce: &[u8; 16]) {
        let mut text = (self.options.hwm.max(1) as u64).to_le_bytes().to_vec();
        text.extend_from_slice(&self.options.max_queued_bytes.to_le_bytes());
        // Then the queue's name, if it has one (a reader of an older version reads only
        // the bounds).
        text.extend_from_slice(self.label.as_deref().unwrap_or("").as_bytes());
        let m = mac(
            &self.key,
            b"welcome",
            &[&rank.to_le_bytes(), nonce, &self.session, &text],
        );
        let h = header(KIND_WELCOME, 0, &self.session, &m);
        let _ = self
            .socket
            .send_multipart([id, &h[..], &text[..]], zmq::DONTWAIT);
    }

    /// Tell reader `k` to start (READY, at the current sequence number). A reader whose
    /// connection is gone is forgotten instead: before the start its rank is free again,
    /// after it (see `hello`) it is dropped.
    fn start(&mut self, k: usize) -> Result<()> {
        let m = message_mac(&self.key, b"ready", &self.session, self.seq, []);
        let h = header(KIND_READY, self.seq, &self.session, &m);
        match self
            .socket
            .send_multipart([&self.peers[k].id[..], &h[..]], zmq::DONTWAIT)
        {
            Ok(()) => {
                let p = &mut self.peers[k];
                p.started = true;
                p.last_seq = self.seq;
                Ok(())
            }
            // Gone (ZeroMQ closed its connection: `EHOSTUNREACH`), or going (its queue
            // is closing: `EAGAIN`, the only cause with no bound on the queue).
            Err(zmq::Error::EHOSTUNREACH | zmq::Error::EAGAIN) => {
                let p = &self.peers[k];
                warn_user!(
                    "shmq: remote reader rank {} (host {}){} went away before it was told to \
                     start; {}",
                    p.rank,
                    p.host.as_deref().unwrap_or("unknown"),
                    self.of_queue(),
                    if self.ready {
                        "no messages go to it"
                    } else {
                        "waiting for a reader of its rank again"
                    }
                );
                if self.ready {
                    self.peers[k].dropped = true;
                } else {
                    self.peers.remove(k);
                }
                Ok(())
            }
            Err(e) => Err(Error::Transport {
                context: format!("telling remote reader rank {} to start", self.peers[k].rank),
                source: e,
            }),
        }
    }

    /// Wait until every remote reader has joined, then tell them all to start. A reader
    /// that went away meanwhile is forgotten, and the wait goes on for its rank.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] or the hook's error when `wait` ends before every reader joined;
    /// [`Error::Transport`] when the socket fails.
    pub fn wait_for_readers(&mut self, wait: &mut Wait) -> Result<()> {
        if self.ready {
            return Ok(());
        }
        loop {
            self.serve_hellos()?;
            if self.peers.len() >= self.expected {
                // From the last: `start` may forget the reader it is given.
                for k in (0..self.peers.len()).rev() {
                    if !self.peers[k].started {
                        self.start(k)?;
                    }
                }
                if self.peers.len() >= self.expected {
                    break;
                }
                continue;
            }
            poll_slice(&self.socket, wait, || "waiting for remote readers".into())?;
            wait.step(&mut crate::wait::no_peer)?;
        }
        self.ready = true;
        Ok(())
    }
}
