//! The two ends of a link over TCP: the parent's listener and the workers it admitted,
//! and a worker's link to its parent.

use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use shmq_core::auth::{new_secret, secret_from_text, SECRET_BYTES};

use super::frame::{read_frame_from, session, write_frame, SealIn, SealOut, Side, SEAL_BYTES};
use super::handshake::{
    challenge_payload, new_nonce, read_answer, read_challenge, refusal_payload, welcome_payload,
    Hello,
};
use super::{
    HandshakeSlot, Kind, LinkError, Ticket, HANDSHAKE_TIMEOUT, MAX_FRAME, MAX_HELLO_FRAME,
};
use crate::{Result, WorkerExit, Workers};

/// Reads of a stream that end at `deadline`, however the peer drips its bytes.
pub(super) struct Deadlined<'a> {
    pub(super) stream: &'a TcpStream,
    pub(super) deadline: Instant,
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

fn send_by(stream: &TcpStream, deadline: Instant, kind: u8, payload: &[u8]) -> Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(LinkError::TimedOut.into());
    }
    stream
        .set_write_timeout(Some(left))
        .map_err(|e| LinkError::io("setting a write timeout", e))?;
    let mut stream = stream;
    Ok(write_frame(&mut stream, kind, payload)?)
}

/// The sending half of a link: every frame sealed, one at a time (it may be shared by
/// threads; clones send on the same link).
#[derive(Clone)]
pub struct LinkSender {
    /// The stream (`None` once [`close`](Self::close)d) and the outgoing seal.
    inner: Arc<Mutex<(Option<TcpStream>, SealOut)>>,
}

impl LinkSender {
    fn new(stream: TcpStream, seal: SealOut) -> LinkSender {
        LinkSender {
            inner: Arc::new(Mutex::new((Some(stream), seal))),
        }
    }

    /// Send one sealed frame of `kind`. A `payload` that would make a frame over
    /// [`MAX_FRAME`] (the most the peer reads) is [`LinkError::BadLength`] here, before
    /// it is sealed or sent: the link goes on, and the peer never sees it.
    ///
    /// # Errors
    ///
    /// [`LinkError::BadLength`] for a payload that would make a frame over [`MAX_FRAME`]
    /// (nothing sent, the link goes on); a [`LinkError`] that ends the link when the frame
    /// cannot be written (the peer gone: [`LinkError::is_loss`]).
    pub fn send(&self, kind: u8, payload: &[u8]) -> Result<()> {
        // The frame's length counts its kind, the number and seal, then the payload.
        let length = payload.len().saturating_add(1 + SEAL_BYTES);
        if length > MAX_FRAME {
            return Err(LinkError::BadLength {
                length: u64::try_from(length).unwrap_or(u64::MAX),
                max: MAX_FRAME,
            }
            .into());
        }
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (stream, seal) = &mut *guard;
        let Some(stream) = stream else {
            return Err(LinkError::Closed.into());
        };
        let body = seal.seal(kind, payload);
        Ok(write_frame(stream, kind, &body)?)
    }

    /// (The parent's side) tell the worker to stop within `grace`
    /// ([`RemoteWorker::send_stop`]).
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send): the link is lost when the frame cannot be written.
    pub fn send_stop(&self, grace: Duration) -> Result<()> {
        let payload = json!({"grace": grace.as_secs_f64()}).to_string();
        self.send(Kind::Stop.byte(), payload.as_bytes())
    }

    /// (A worker's side) tell the parent this worker is leaving with `exitcode` and its
    /// last stderr lines ([`ParentLink::send_leaving`]).
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send): [`LinkError::BadLength`] for stderr lines too long for one
    /// frame; the link is lost when the frame cannot be written.
    pub fn send_leaving(&self, exitcode: i32, stderr: &[String]) -> Result<()> {
        let payload = json!({"exitcode": exitcode, "stderr": stderr}).to_string();
        self.send(Kind::Leaving.byte(), payload.as_bytes())
    }

    /// End the connection both ways (a `recv` waiting on it returns).
    pub fn shutdown(&self) {
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(stream) = &guard.0 {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// End the connection both ways and close this half's descriptor, so that once the
    /// receiving half is dropped too the socket is closed: a peer still sending then gets
    /// a reset at once (a shut-down socket with unread bytes only stops reading, and a
    /// peer's blocked send would wait for its own timeout). Later sends are
    /// [`LinkError::Closed`].
    pub fn close(&self) {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(stream) = guard.0.take() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// The receiving half: reads a frame and checks its seal and turn.
struct Receiver {
    stream: TcpStream,
    seal: SealIn,
    /// The peer, as errors name it.
    peer: String,
}

impl Receiver {
    /// The next frame's kind and payload: one frame of at most [`MAX_FRAME`] held at a
    /// time, its payload never copied (its number and seal cut off in place).
    fn recv(&mut self) -> Result<(u8, Vec<u8>)> {
        let (kind, mut body) = read_frame_from(&mut self.stream, MAX_FRAME, &self.peer, false)?;
        self.seal.open(kind, &body)?;
        body.drain(..SEAL_BYTES);
        Ok((kind, body))
    }
}

/// The two halves of an admitted link on `stream`, with TCP keepalive on: on either
/// end, a peer machine that vanished without a word (no FIN, no RST) ends a blocking
/// `recv` as the link's loss once the kernel's keepalive probes go unanswered, instead
/// of never.
fn split(
    stream: TcpStream,
    key: &[u8; SECRET_BYTES],
    session: &[u8],
    side: Side,
    peer: String,
) -> Result<(Receiver, LinkSender)> {
    keepalive(&stream);
    let writer = stream
        .try_clone()
        .map_err(|e| LinkError::io("sharing the link's connection", e))?;
    Ok((
        Receiver {
            stream,
            seal: SealIn::new(key, session, side),
            peer,
        },
        LinkSender::new(writer, SealOut::new(key, session, side)),
    ))
}

fn nonce_bytes(nonce: &str) -> Result<[u8; SECRET_BYTES]> {
    secret_from_text(nonce)
        .ok_or_else(|| LinkError::Malformed("a nonce that is not one".into()).into())
}

// -- the parent ------------------------------------------------------------------------

/// The parent's end: a listening TCP socket and the ticket that joins it.
pub struct WorkerListener {
    listener: TcpListener,
    ticket: Ticket,
}

impl WorkerListener {
    /// Listen on `address` (port 0: any free one) with a fresh random token.
    ///
    /// # Errors
    ///
    /// [`Error::Core`](crate::Error::Core) with `Os` when the kernel gives no random token;
    /// [`LinkError::Io`] when `address` cannot be bound (in use, not this host's).
    pub fn bind(address: impl ToSocketAddrs) -> Result<WorkerListener> {
        WorkerListener::bind_with_token(address, new_secret("a worker ticket's token")?)
    }

    /// Listen on `address` with `token`.
    ///
    /// # Errors
    ///
    /// [`LinkError::Io`] when `address` cannot be resolved or bound (in use, not this
    /// host's), or its port cannot be read.
    pub fn bind_with_token(
        address: impl ToSocketAddrs,
        token: [u8; SECRET_BYTES],
    ) -> Result<WorkerListener> {
        let listener = TcpListener::bind(address)
            .map_err(|e| LinkError::io("listening for remote workers", e))?;
        let local = listener
            .local_addr()
            .map_err(|e| LinkError::io("reading the listening address", e))?;
        let ticket = Ticket {
            host: local.ip().to_string(),
            port: local.port(),
            token,
        };
        Ok(WorkerListener { listener, ticket })
    }

    /// The ticket a worker joins with (its host: the address listened on).
    pub fn ticket(&self) -> &Ticket {
        &self.ticket
    }

    /// The listening socket (to accept on a thread of one's own and
    /// [`handshake`](Self::handshake) each connection in another).
    pub fn listener(&self) -> &TcpListener {
        &self.listener
    }

    /// Accept the next connection and run its [`handshake`](Self::handshake), in this
    /// thread: a stranger that drips its bytes holds it up to [`HANDSHAKE_TIMEOUT`]. On a
    /// port strangers can reach, let a group admit its workers
    /// ([`Workers::admit_remote`]: each handshake on a thread of its own, in one of
    /// [`MAX_HANDSHAKES`](super::MAX_HANDSHAKES) slots, [`HandshakeSlots`](super::HandshakeSlots)),
    /// as the Python package's parent does.
    ///
    /// # Errors
    ///
    /// [`LinkError::Io`] when `accept` fails; else as [`handshake`](Self::handshake): a
    /// peer that is no shmq worker, proves no token, is refused by `admit`, or is too slow.
    pub fn accept(
        &self,
        admit: impl FnOnce(&Hello) -> std::result::Result<(), String>,
    ) -> Result<RemoteWorker> {
        let (stream, _) = self
            .listener
            .accept()
            .map_err(|e| LinkError::io("accepting a remote worker", e))?;
        self.handshake(stream, admit)
    }

    /// Accept the next worker into `workers` (a group made with remote ranks,
    /// [`Workers::new`]): its rank claimed ([`Workers::claim_remote`]: a rank the group
    /// does not expect, or one taken, is refused) and connected. Then
    /// [`RemoteWorker::serve`] it (on a thread of its own) so that the group sees it
    /// ready, and its leaving or its link's loss as its exit.
    ///
    /// # Errors
    ///
    /// As [`accept`](Self::accept), with [`LinkError::Refused`] for a rank the group does
    /// not expect or that another worker took (the worker is told why, and the rank stays
    /// free).
    pub fn accept_into(&self, workers: &Workers) -> Result<RemoteWorker> {
        let claimed = std::cell::Cell::new(None);
        let admitted = self.accept(|hello| {
            let rank = hello.rank as usize;
            workers.claim_remote(rank, hello.pid)?;
            claimed.set(Some(rank));
            Ok(())
        });
        match admitted {
            Ok(worker) => {
                if !workers.remote_connected(worker.rank() as usize, worker.host()) {
                    worker.shutdown();
                    return Err(
                        LinkError::Refused("the worker group is shutting down".into()).into(),
                    );
                }
                // A sibling's failure is told on its link (`Workers::tell_siblings`).
                workers.add_link(worker.rank() as usize, worker.sender());
                Ok(worker)
            }
            Err(e) => {
                if let Some(rank) = claimed.get() {
                    // Claimed, then its welcome failed: the rank is not left taken by nobody.
                    let how = format!("lost its connection during its handshake ({e})");
                    workers.report_exit(rank, None, Vec::new(), Some(how));
                }
                Err(e)
            }
        }
    }

    /// The parent's side of the handshake on `stream`, all of it within
    /// [`HANDSHAKE_TIMEOUT`]: the challenge, the worker's hello (at most
    /// [`MAX_HELLO_FRAME`] bytes), its proof checked, then `admit` (say, a rank's check
    /// and claim: `Err` is the reason the worker is told), then the welcome.
    /// [`LinkError::Refused`] for a worker refused (wrong token, malformed hello, `admit`'s
    /// reason), which was told so; other errors for a connection that failed.
    ///
    /// # Errors
    ///
    /// [`LinkError::TimedOut`] past [`HANDSHAKE_TIMEOUT`];
    /// [`LinkError::HandshakeFrameTooLong`] or [`LinkError::Malformed`] for a peer that is
    /// no shmq worker; [`LinkError::Refused`] for a wrong token or `admit`'s refusal (the
    /// worker is told why); [`LinkError::Io`] when the connection fails.
    pub fn handshake(
        &self,
        stream: TcpStream,
        admit: impl FnOnce(&Hello) -> std::result::Result<(), String>,
    ) -> Result<RemoteWorker> {
        let (hello, nonce) = self.handshake_on(&stream, None, admit)?;
        self.admitted(stream, hello, &nonce)
    }

    /// [`handshake`](Self::handshake) on `stream` up to the welcome, in `slot` (which
    /// the hello's arrival marks, [`HandshakeSlot::hello_arrived`]: a connection that
    /// gave way to a newer one ends here, [`LinkError::Closed`]): the worker's hello and
    /// this side's nonce, for [`admitted`](Self::admitted).
    pub(crate) fn handshake_on(
        &self,
        stream: &TcpStream,
        slot: Option<&HandshakeSlot>,
        admit: impl FnOnce(&Hello) -> std::result::Result<(), String>,
    ) -> Result<(Hello, String)> {
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let peer = stream
            .peer_addr()
            .map_err(|e| LinkError::io("reading a remote worker's address", e))?;
        let token = &self.ticket.token;
        let nonce = new_nonce()?;
        send_by(
            stream,
            deadline,
            Kind::Challenge.byte(),
            &challenge_payload(&nonce),
        )?;
        let mut reader = Deadlined { stream, deadline };
        let (k, payload) = read_frame_from(&mut reader, MAX_HELLO_FRAME, &peer.to_string(), true)?;
        if slot.is_some_and(|slot| !slot.hello_arrived()) {
            return Err(LinkError::Closed.into()); // it gave way to a newer connection
        }
        let hello = match Hello::check(k, &payload, token, &nonce)
            .and_then(|h| admit(&h).map(|()| h))
        {
            Ok(hello) => hello,
            Err(reason) => {
                let _ = send_by(
                    stream,
                    deadline,
                    Kind::Answer.byte(),
                    &refusal_payload(&reason),
                );
                return Err(
                    LinkError::Refused(format!("refused a worker from {peer}: {reason}")).into(),
                );
            }
        };
        // Proved the token: its welcome has a fresh timeout of its own.
        let welcome = welcome_payload(token, &hello.nonce, &nonce, hello.rank);
        send_by(
            stream,
            Instant::now() + HANDSHAKE_TIMEOUT,
            Kind::Answer.byte(),
            &welcome,
        )?;
        Ok((hello, nonce))
    }

    /// The link of the worker `hello` welcomed on `stream` (this side's nonce: `nonce`).
    pub(crate) fn admitted(
        &self,
        stream: TcpStream,
        hello: Hello,
        nonce: &str,
    ) -> Result<RemoteWorker> {
        let peer = stream
            .peer_addr()
            .map_err(|e| LinkError::io("reading a remote worker's address", e))?;
        stream
            .set_read_timeout(None)
            .and_then(|()| stream.set_write_timeout(None))
            .map_err(|e| LinkError::io("clearing the handshake's timeouts", e))?;
        let session = session(&nonce_bytes(nonce)?, &nonce_bytes(&hello.nonce)?);
        let token = &self.ticket.token;
        let (receiver, sender) = split(stream, token, &session, Side::Parent, peer.to_string())?;
        Ok(RemoteWorker {
            hello,
            peer,
            receiver,
            sender,
        })
    }
}

/// What an admitted worker sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerMessage {
    /// Its set-up is done; the payload is the worker's (Python: its pickled `info`).
    Ready(Vec<u8>),
    /// It is leaving: its exit code and its last stderr lines.
    Leaving { exitcode: i32, stderr: Vec<String> },
}

/// A worker the parent admitted: who it is, and its link.
pub struct RemoteWorker {
    hello: Hello,
    peer: SocketAddr,
    receiver: Receiver,
    sender: LinkSender,
}

impl RemoteWorker {
    /// Its rank.
    pub fn rank(&self) -> u32 {
        self.hello.rank
    }

    /// Its process id, on its machine.
    pub fn pid(&self) -> u32 {
        self.hello.pid
    }

    /// The host it named.
    pub fn host(&self) -> &str {
        &self.hello.host
    }

    /// The address it connected from.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// The next frame from the worker (blocking; frames of kinds this version does not
    /// know are skipped). Any error ends the link: [`LinkError::is_loss`] for the
    /// connection's loss (the worker died or its machine went away), another for a
    /// frame that is not the worker's, or a sealed one of a kind that is never the
    /// worker's to send here (a handshake's, or the parent's own:
    /// [`LinkError::UnexpectedKind`]).
    ///
    /// # Errors
    ///
    /// A [`LinkError`] that ends the link: the connection lost ([`LinkError::is_loss`]: the
    /// worker died or closed it), a frame that is not the worker's ([`LinkError::BadSeal`],
    /// [`LinkError::OutOfTurn`], [`LinkError::FrameTooLong`]), or one of a kind never the
    /// worker's to send ([`LinkError::UnexpectedKind`]), or a malformed one.
    pub fn recv(&mut self) -> Result<WorkerMessage> {
        loop {
            let (k, payload) = self.receiver.recv()?;
            let Some(kind) = Kind::from_byte(k) else {
                continue; // a newer worker's kind
            };
            match kind {
                Kind::Challenge | Kind::Hello | Kind::Answer | Kind::Stop | Kind::SiblingFailed => {
                    return Err(LinkError::UnexpectedKind {
                        kind: char::from(k),
                    }
                    .into());
                }
                Kind::Ready => return Ok(WorkerMessage::Ready(payload)),
                Kind::Leaving => {
                    // A JSON object; no exit code is 1, one that is not an i32 malformed.
                    let malformed = || LinkError::Malformed("a malformed leaving frame".into());
                    let msg: Value = serde_json::from_slice(&payload)
                        .ok()
                        .filter(Value::is_object)
                        .ok_or_else(malformed)?;
                    let exitcode = msg
                        .get("exitcode")
                        .map_or(Some(1), Value::as_i64)
                        .and_then(|c| i32::try_from(c).ok())
                        .ok_or_else(malformed)?;
                    let stderr = msg
                        .get("stderr")
                        .and_then(Value::as_array)
                        .map(|lines| {
                            lines
                                .iter()
                                .map(|l| l.as_str().map_or_else(|| l.to_string(), str::to_owned))
                                .collect()
                        })
                        .unwrap_or_default();
                    return Ok(WorkerMessage::Leaving { exitcode, stderr });
                }
            }
        }
    }

    /// Read this worker's frames until it leaves or its link ends, telling `workers`
    /// (which admitted it, [`WorkerListener::accept_into`]): ready with its payload, its
    /// leaving as its exit (code and stderr lines), a lost or failed link as its death
    /// ("lost its connection to the parent"). Blocks: run it on a thread of its own.
    pub fn serve(self, workers: &Workers) {
        self.serve_shared(&workers.shared);
    }

    /// [`serve`](Self::serve), for a thread that holds the group's shared state.
    pub(crate) fn serve_shared(mut self, workers: &crate::watch::Shared) {
        let rank = self.rank() as usize;
        loop {
            match self.recv() {
                Ok(WorkerMessage::Ready(payload)) => workers.remote_ready(rank, payload),
                Ok(WorkerMessage::Leaving { exitcode, stderr }) => {
                    let exit = WorkerExit::from_exitcode(exitcode);
                    workers.report_exit(rank, Some(exit), stderr, None);
                    return;
                }
                Err(e) => {
                    let how = match &e {
                        crate::Error::Link(LinkError::Closed) => {
                            "lost its connection to the parent".to_owned()
                        }
                        e => format!("lost its connection to the parent ({e})"),
                    };
                    // A frame that was not the worker's: end and close the stream (this
                    // half's descriptor here, the receiving half's as `self` goes), so
                    // that the worker's side sees it go, a send in progress included.
                    self.sender.close();
                    workers.report_exit(rank, None, Vec::new(), Some(how));
                    return;
                }
            }
        }
    }

    /// Tell the worker to stop: it gets SIGTERM (Python) or [`ParentMessage::Stop`],
    /// and `grace` before SIGKILL.
    ///
    /// # Errors
    ///
    /// As [`LinkSender::send`]: the link is lost when the frame cannot be written (the
    /// worker gone).
    pub fn send_stop(&self, grace: Duration) -> Result<()> {
        self.sender.send_stop(grace)
    }

    /// Tell the worker that another worker of its group failed (`notice`: the parent's
    /// description of it; Python's is the `WorkerDiedError`'s notice).
    ///
    /// # Errors
    ///
    /// As [`LinkSender::send`]: [`LinkError::BadLength`] for a `notice` too long for one
    /// frame; the link is lost when the frame cannot be written.
    pub fn send_sibling_failed(&self, notice: &[u8]) -> Result<()> {
        self.sender.send(Kind::SiblingFailed.byte(), notice)
    }

    /// A sender on this link, for another thread.
    pub fn sender(&self) -> LinkSender {
        self.sender.clone()
    }

    /// End the connection.
    pub fn shutdown(&self) {
        self.sender.shutdown()
    }

    /// Its connection (the link's tests read its socket options).
    #[cfg(test)]
    pub(super) fn stream(&self) -> &TcpStream {
        &self.receiver.stream
    }
}

// -- the worker ------------------------------------------------------------------------

/// What the parent sent a worker.
#[derive(Clone, Debug, PartialEq)]
pub enum ParentMessage {
    /// Stop, within `grace`.
    Stop { grace: Duration },
    /// Another worker of the group failed: the parent's notice.
    SiblingFailed(Vec<u8>),
}

/// A worker's link to its parent.
pub struct ParentLink {
    rank: u32,
    receiver: Receiver,
    sender: LinkSender,
}

fn hostname() -> String {
    shmq_os::process::host_name().unwrap_or_default()
}

/// Turn TCP keepalive on for `stream`, with the kernel's probe times (best effort: a
/// socket that refuses it is left as it is).
fn keepalive(stream: &TcpStream) {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt(2) on the stream's own open socket, reading one c_int that
    // lives through the call.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_KEEPALIVE,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

impl ParentLink {
    /// Join the parent of `ticket` as worker `rank`: connect, answer its challenge,
    /// check its proof of the token, all within `timeout`: one deadline for the whole
    /// handshake (connecting included), however slowly the parent's bytes come
    /// ([`LinkError::TimedOut`] once it passed). A handshake frame longer than
    /// [`MAX_HELLO_FRAME`] is refused at its length, before any of it is read
    /// ([`LinkError::HandshakeFrameTooLong`]).
    /// [`LinkError::Refused`] if the parent refused this worker (wrong token, a rank not
    /// expected or taken) or could not prove the token (it is not the ticket's parent),
    /// or speaks another protocol version; [`LinkError::Malformed`] for a peer that is
    /// no shmq parent.
    ///
    /// # Errors
    ///
    /// [`LinkError::Io`] when the ticket's host cannot be resolved or connected to;
    /// [`LinkError::TimedOut`] past `timeout`; [`LinkError::Malformed`] for a peer that is
    /// no shmq parent; [`LinkError::Refused`] when the parent refuses this worker (wrong
    /// token, rank not expected or taken) or cannot prove the token itself.
    pub fn connect(ticket: &Ticket, rank: u32, timeout: Duration) -> Result<ParentLink> {
        let deadline = Instant::now() + timeout;
        let peer = if ticket.host.contains(':') {
            format!("[{}]:{}", ticket.host, ticket.port)
        } else {
            format!("{}:{}", ticket.host, ticket.port)
        };
        let addresses = (ticket.host.as_str(), ticket.port)
            .to_socket_addrs()
            .map_err(|e| LinkError::io(format!("resolving {peer}"), e))?;
        let mut last = None;
        let mut stream = None;
        for address in addresses {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                last = Some(std::io::ErrorKind::TimedOut.into());
                break;
            }
            match TcpStream::connect_timeout(&address, left) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let stream = stream.ok_or_else(|| {
            LinkError::io(
                format!("connecting to the parent at {peer}"),
                last.unwrap_or_else(|| std::io::ErrorKind::NotFound.into()),
            )
        })?;
        let mut reader = Deadlined {
            stream: &stream,
            deadline,
        };
        let (k, payload) = read_frame_from(&mut reader, MAX_HELLO_FRAME, &peer, true)?;
        let parent_nonce = read_challenge(k, &payload, &peer)?;
        let hello = Hello::new(
            &ticket.token,
            &parent_nonce,
            rank,
            std::process::id(),
            &hostname(),
        )?;
        send_by(&stream, deadline, Kind::Hello.byte(), &hello.encode())?;
        let (k, payload) = read_frame_from(&mut reader, MAX_HELLO_FRAME, &peer, true)?;
        read_answer(
            k,
            &payload,
            &ticket.token,
            &hello.nonce,
            &parent_nonce,
            rank,
            &peer,
        )?;
        // Admitted: reads block from here on (a worker may hear nothing for as long as it
        // runs), and TCP keepalive (`split`) notices a parent machine that vanished.
        stream
            .set_read_timeout(None)
            .and_then(|()| stream.set_write_timeout(None))
            .map_err(|e| LinkError::io("clearing the handshake's timeouts", e))?;
        let session = session(&nonce_bytes(&parent_nonce)?, &nonce_bytes(&hello.nonce)?);
        let (receiver, sender) = split(stream, &ticket.token, &session, Side::Worker, peer)?;
        Ok(ParentLink {
            rank,
            receiver,
            sender,
        })
    }

    /// The rank this worker joined as.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Its connection (the link's tests read its socket options).
    #[cfg(test)]
    pub(super) fn stream(&self) -> &TcpStream {
        &self.receiver.stream
    }

    /// Tell the parent this worker is ready, with `payload` (for the parent to read).
    ///
    /// # Errors
    ///
    /// As [`LinkSender::send`]: [`LinkError::BadLength`] for a `payload` too long for one
    /// frame; the link is lost when the frame cannot be written (the parent gone).
    pub fn send_ready(&self, payload: &[u8]) -> Result<()> {
        self.sender.send(Kind::Ready.byte(), payload)
    }

    /// Tell the parent this worker is leaving with `exitcode` and its last stderr lines.
    ///
    /// # Errors
    ///
    /// As [`LinkSender::send`]: [`LinkError::BadLength`] for stderr lines too long for one
    /// frame; the link is lost when the frame cannot be written.
    pub fn send_leaving(&self, exitcode: i32, stderr: &[String]) -> Result<()> {
        self.sender.send_leaving(exitcode, stderr)
    }

    /// The next frame from the parent (blocking; frames of kinds this version does not
    /// know are skipped). An error ends the link: the parent is gone
    /// ([`LinkError::is_loss`]) or a frame was not the parent's, or a sealed one of a
    /// kind that is never the parent's to send here (a handshake's, or a worker's:
    /// [`LinkError::UnexpectedKind`]).
    ///
    /// # Errors
    ///
    /// A [`LinkError`] that ends the link: the parent gone ([`LinkError::is_loss`]), a
    /// frame that is not the parent's ([`LinkError::BadSeal`], [`LinkError::OutOfTurn`]),
    /// or a sealed one of a kind never the parent's to send
    /// ([`LinkError::UnexpectedKind`]), or a malformed one.
    pub fn recv(&mut self) -> Result<ParentMessage> {
        loop {
            let (k, payload) = self.receiver.recv()?;
            let Some(kind) = Kind::from_byte(k) else {
                continue; // a newer parent's kind
            };
            match kind {
                Kind::Challenge | Kind::Hello | Kind::Answer | Kind::Ready | Kind::Leaving => {
                    return Err(LinkError::UnexpectedKind {
                        kind: char::from(k),
                    }
                    .into());
                }
                Kind::Stop => {
                    let msg: Value = serde_json::from_slice(&payload).unwrap_or(Value::Null);
                    let grace = msg
                        .get("grace")
                        .and_then(Value::as_f64)
                        .and_then(|g| Duration::try_from_secs_f64(g).ok())
                        .unwrap_or(crate::DEFAULT_GRACE);
                    return Ok(ParentMessage::Stop { grace });
                }
                Kind::SiblingFailed => return Ok(ParentMessage::SiblingFailed(payload)),
            }
        }
    }

    /// A sender on this link, for another thread.
    pub fn sender(&self) -> LinkSender {
        self.sender.clone()
    }

    /// End the connection.
    pub fn shutdown(&self) {
        self.sender.shutdown()
    }
}
