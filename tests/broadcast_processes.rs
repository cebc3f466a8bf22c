//! The broadcast queue across real processes: one writer (the test) and reader
//! processes that are this same test binary run again.
//!
//! A test starts its readers with [`spawn_reader`]: the child runs
//! `<this binary> --exact <test name> --nocapture` with [`ROLE_ENV`], [`RANK_ENV`] and
//! [`HANDLE_ENV`] set, so the same test function starts again in the child, sees those
//! variables at its top and plays the reader instead of the writer. A reader process
//! reports a failure through its exit code (and its stderr, which the parent shows).
//!
//! Every blocking call has a timeout, the writer's waits stop as soon as a reader
//! process dies, and reader processes still running when a test fails are killed.
//!
//! Messages are generated from their sequence number alone ([`message`]), so a reader
//! knows exactly which bytes the `seq`-th message must hold and checks it byte for byte.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use shmq::broadcast::{DequeueError, EnqueueError};
use shmq::wait::WaitSpec;
use shmq::{Error, Handle, Message, QueueOptions, Reader, Writer};

/// What a child process plays; only `reader` exists. Its presence marks the child.
const ROLE_ENV: &str = "SHMQ_TEST_ROLE";
const RANK_ENV: &str = "SHMQ_TEST_RANK";
const HANDLE_ENV: &str = "SHMQ_TEST_HANDLE";

/// Bound on every single blocking call (enqueue, dequeue, ready, child exit).
const TIMEOUT: Duration = Duration::from_secs(60);
/// The PRNG seed of every message stream.
const SEED: u64 = 0x5EED_5A11_C0DE_0F0F;
/// Bytes before the body: the sequence number (u64 LE) and the body's FNV-1a (u32 LE).
const HEADER: usize = 12;

// ---------------------------------------------------------------------------------
// Messages

/// xorshift64 (Marsaglia 2003): deterministic, tiny, good enough for sizes and bytes.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
        // Never zero (a zero state stays zero); the multiply spreads nearby seeds apart.
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5, |h, &b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

/// The size of message `seq` for a ring of `chunk`-byte chunks: mostly below 512 bytes,
/// some up to the chunk, about 2 % larger than a chunk (the overflow path), and the
/// edge cases at fixed places: empty, exactly a chunk, one byte over.
fn message_len(rng: &mut XorShift, seq: u64, chunk: usize) -> usize {
    match seq % 1000 {
        999 => return 0,
        500 => return chunk,
        501 => return chunk + 1,
        _ => {}
    }
    let r = rng.below(100);
    let len = if r < 90 {
        rng.below(512)
    } else if r < 98 {
        512 + rng.below(chunk as u64 - 512)
    } else {
        chunk as u64 + 1 + rng.below(chunk as u64 / 2)
    };
    (len as usize).max(HEADER)
}

/// Message number `seq` of the stream: `[seq][fnv1a(body)][body]`, or nothing at all for
/// the empty messages.
fn message(seq: u64, chunk: usize) -> Vec<u8> {
    let mut rng = XorShift::new(SEED ^ seq.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let len = message_len(&mut rng, seq, chunk);
    if len == 0 {
        return Vec::new();
    }
    let mut msg = vec![0u8; len];
    for word in msg[HEADER..].chunks_mut(8) {
        word.copy_from_slice(&rng.next().to_le_bytes()[..word.len()]);
    }
    let sum = fnv1a(&msg[HEADER..]);
    msg[..8].copy_from_slice(&seq.to_le_bytes());
    msg[8..HEADER].copy_from_slice(&sum.to_le_bytes());
    msg
}

/// Check that `got` is message `seq`; say precisely what is wrong if not.
fn check_message(got: &[u8], seq: u64, chunk: usize) -> Result<(), String> {
    let expected = message(seq, chunk);
    if got == expected.as_slice() {
        return Ok(());
    }
    let mut why = format!(
        "message {seq}: expected {} bytes, got {} bytes",
        expected.len(),
        got.len()
    );
    if got.len() >= HEADER {
        let got_seq = u64::from_le_bytes(got[..8].try_into().unwrap());
        let got_sum = u32::from_le_bytes(got[8..HEADER].try_into().unwrap());
        let sum_ok = got_sum == fnv1a(&got[HEADER..]);
        why += &format!(" carrying sequence number {got_seq}, checksum ok: {sum_ok}");
    }
    if let Some(at) = got.iter().zip(&expected).position(|(a, b)| a != b) {
        why += &format!("; first differing byte at offset {at}");
    }
    Err(why)
}

// ---------------------------------------------------------------------------------
// Reader processes (the child side)

/// The reader's part of a test, when this process is a child started by [`spawn_reader`].
struct ChildRole {
    rank: usize,
    handle: Handle,
}

impl ChildRole {
    /// `Some` in a child process. Call first thing in a test function.
    fn from_env() -> Option<ChildRole> {
        let role = std::env::var(ROLE_ENV).ok()?;
        assert_eq!(role, "reader", "unknown {ROLE_ENV}");
        let rank = std::env::var(RANK_ENV).unwrap().parse().unwrap();
        let handle = std::env::var(HANDLE_ENV).unwrap().parse().unwrap();
        Some(ChildRole { rank, handle })
    }

    /// Run the reader's part and end the process: exit code 0 on success, 1 with the
    /// reason on stderr otherwise.
    fn run(self, part: impl FnOnce(&ChildRole) -> Result<(), String>) -> ! {
        match part(&self) {
            Ok(()) => std::process::exit(0),
            Err(why) => {
                eprintln!("reader rank {} failed: {why}", self.rank);
                std::process::exit(1)
            }
        }
    }

    fn open_ready(&self) -> Result<Reader, String> {
        let mut reader = Reader::open(&self.handle, self.rank).map_err(|e| format!("open: {e}"))?;
        reader
            .wait_until_ready(Some(TIMEOUT))
            .map_err(|e| format!("wait_until_ready: {e}"))?;
        Ok(reader)
    }
}

/// Read `n` messages and check each one. Even ranks copy with `dequeue`, odd ranks
/// look at the bytes in place with `dequeue_view`. Then check nothing more is there.
fn read_and_check(role: &ChildRole, n: u64, chunk: usize, local: bool) -> Result<(), String> {
    let mut reader = role.open_ready()?;
    if reader.is_local() != local {
        return Err(format!(
            "is_local() is {}, expected {local}",
            reader.is_local()
        ));
    }
    for seq in 0..n {
        let checked = if role.rank % 2 == 0 {
            let msg = reader
                .dequeue(Some(TIMEOUT))
                .map_err(|e| format!("message {seq}: {e}"))?;
            check_message(&msg, seq, chunk)
        } else {
            reader
                .dequeue_view(TIMEOUT, |msg| check_message(msg, seq, chunk))
                .map_err(|e| format!("message {seq}: {e}"))?
        };
        checked?;
    }
    // The writer sent exactly `n`: the next chunk must not look readable.
    match reader.try_take(|m| m.len()) {
        Err(e) if e.is_empty() => {}
        Ok(len) => return Err(format!("a message of {len} bytes after the last one")),
        Err(e) => return Err(format!("try_take after the last message: {e}")),
    }
    drop(reader);
    Ok(())
}

// ---------------------------------------------------------------------------------
// Reader processes (the parent side)

/// A reader process of the test: its output is collected as it comes (so a chatty child
/// never blocks on a full pipe), it is killed if the test ends while it still runs.
struct ReaderProcess {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
    stdout_lines: Receiver<String>,
    output: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
}

/// Start this test binary again as reader `rank` of the queue `handle`, running only
/// `test_name`.
fn spawn_reader(test_name: &str, handle: &Handle, rank: usize) -> ReaderProcess {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test_name, "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "reader")
        .env(RANK_ENV, rank.to_string())
        .env(HANDLE_ENV, handle.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting a reader process");
    let output = Arc::new(Mutex::new(String::new()));
    let (tx, stdout_lines) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    let out = output.clone();
    let t1 = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            out.lock().unwrap().push_str(&format!("[stdout] {line}\n"));
            let _ = tx.send(line);
        }
    });
    let mut stderr = child.stderr.take().unwrap();
    let out = output.clone();
    let t2 = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        for line in s.lines() {
            out.lock().unwrap().push_str(&format!("[stderr] {line}\n"));
        }
    });
    ReaderProcess {
        rank,
        child,
        status: None,
        stdout_lines,
        output,
        readers: vec![t1, t2],
    }
}

impl ReaderProcess {
    /// The exit status if the process has ended.
    fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("try_wait");
        }
        self.status
    }

    fn stdin(&mut self) -> ChildStdin {
        self.child.stdin.take().expect("stdin already taken")
    }

    /// Wait for the child to print `line`.
    fn wait_for_line(&mut self, line: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout_lines.recv_timeout(left) {
                // The harness prints "test <name> ... " without a newline before the test runs.
                Ok(l) if l.ends_with(line) => return,
                Ok(_) => {}
                Err(_) => {
                    let (rank, out) = (self.rank, self.report());
                    panic!("reader rank {rank} did not print {line:?} within {timeout:?}:\n{out}")
                }
            }
        }
    }

    /// Wait (bounded) for the process to end and return its status.
    fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.exited() {
                return s;
            }
            if Instant::now() >= deadline {
                let (rank, out) = (self.rank, self.report());
                panic!("reader rank {rank} still running after {timeout:?}:\n{out}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Everything the child printed so far (all of it once it has exited).
    fn report(&mut self) -> String {
        if self.status.is_some() {
            for t in self.readers.drain(..) {
                let _ = t.join();
            }
        }
        self.output.lock().unwrap().clone()
    }
}

impl Drop for ReaderProcess {
    fn drop(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Wait until every reader process has ended and check that each exited with 0.
fn expect_all_succeed(children: &mut [ReaderProcess]) {
    for c in children.iter_mut() {
        let status = c.wait_exit(TIMEOUT);
        if !status.success() {
            let (rank, out) = (c.rank, c.report());
            panic!("reader rank {rank} exited with {status}:\n{out}");
        }
    }
}

/// A wait for the writer that ends as soon as one of `children` has exited: a reader
/// that died will never free its chunks, no point waiting out the timeout.
fn writer_step<T, E: std::fmt::Display>(
    children: &mut [ReaderProcess],
    what: &str,
    step: impl FnOnce(WaitSpec<'_>) -> Result<T, E>,
) -> T {
    let mut dead: Option<usize> = None;
    let result = {
        let dead = &mut dead;
        let kids = &mut *children;
        let mut hook = move || {
            if let Some(i) = kids.iter_mut().position(|c| c.exited().is_some()) {
                *dead = Some(i);
                return Err(Error::Cancelled);
            }
            Ok(())
        };
        step(WaitSpec {
            timeout: Some(TIMEOUT),
            hook: Some(&mut hook),
            ..Default::default()
        })
    };
    match (result, dead) {
        (Ok(v), _) => v,
        (Err(_), Some(i)) => {
            let c = &mut children[i];
            let (rank, status, out) = (c.rank, c.exited().unwrap(), c.report());
            panic!("{what}: reader rank {rank} exited early with {status}:\n{out}")
        }
        (Err(e), None) => panic!("{what}: {e}"),
    }
}

/// Send messages `0..n` of the stream to every reader.
fn write_stream(writer: &mut Writer, children: &mut [ReaderProcess], n: u64, chunk: usize) {
    writer_step(children, "waiting for readers to subscribe", |w| {
        writer.wait_until_ready(w)
    });
    for seq in 0..n {
        let msg = message(seq, chunk);
        writer_step(children, &format!("enqueue of message {seq}"), |w| {
            writer.enqueue(&msg, w)
        });
    }
}

fn segment_path(writer: &Writer) -> String {
    let name = &writer.handle().buffer.as_ref().expect("a ring").name;
    assert!(name.starts_with("shmq_"), "{name}");
    format!("/dev/shm/{name}")
}

// ---------------------------------------------------------------------------------
// Tests

/// a. Three local reader processes, 100 000 messages of random sizes through a small
/// ring (8 chunks of 4 KiB), some larger than a chunk (the overflow socket).
#[test]
fn three_local_readers_get_every_message_in_order() {
    const NAME: &str = "three_local_readers_get_every_message_in_order";
    const N: u64 = 100_000;
    const CHUNK: usize = 4096;
    if let Some(role) = ChildRole::from_env() {
        role.run(|r| read_and_check(r, N, CHUNK, true));
    }
    let started = Instant::now();
    let mut opts = QueueOptions::local(3);
    opts.max_chunk_bytes = CHUNK;
    opts.max_chunks = 8;
    let mut writer = Writer::new(opts).unwrap();
    let segment = segment_path(&writer);
    assert!(Path::new(&segment).exists());
    let mut children: Vec<_> = (0..3)
        .map(|rank| spawn_reader(NAME, writer.handle(), rank))
        .collect();
    write_stream(&mut writer, &mut children, N, CHUNK);
    expect_all_succeed(&mut children);
    let overflows = writer.overflow_count();
    let expected_overflows = (0..N).filter(|&s| message(s, CHUNK).len() > CHUNK).count();
    assert_eq!(overflows, expected_overflows as u64);
    assert!(overflows > 0);
    drop(writer);
    assert!(
        !Path::new(&segment).exists(),
        "{segment} left behind after the writer was dropped"
    );
    eprintln!(
        "{N} messages ({overflows} over the overflow socket) to 3 local readers in {:.2?}",
        started.elapsed()
    );
}

/// b. One local and one remote reader (TCP on 127.0.0.1), including oversized messages.
#[test]
fn local_and_remote_reader_get_every_message_in_order() {
    const NAME: &str = "local_and_remote_reader_get_every_message_in_order";
    const N: u64 = 5_000;
    const CHUNK: usize = 4096;
    if let Some(role) = ChildRole::from_env() {
        let local = role.rank == 0;
        role.run(|r| read_and_check(r, N, CHUNK, local));
    }
    let started = Instant::now();
    let mut opts = QueueOptions::default();
    opts.n_reader = 2;
    opts.n_local_reader = 1;
    opts.max_chunk_bytes = CHUNK;
    opts.max_chunks = 8;
    opts.connect_ip = Some("127.0.0.1".into());
    let mut writer = Writer::new(opts).unwrap();
    assert_eq!((writer.n_local_reader(), writer.n_remote_reader()), (1, 1));
    let remote = writer.handle().remote_subscribe_addr.clone().unwrap();
    assert!(remote.starts_with("tcp://127.0.0.1:"), "{remote}");
    let segment = segment_path(&writer);
    let mut children: Vec<_> = (0..2)
        .map(|rank| spawn_reader(NAME, writer.handle(), rank))
        .collect();
    write_stream(&mut writer, &mut children, N, CHUNK);
    expect_all_succeed(&mut children);
    assert!(writer.overflow_count() > 0);
    drop(writer);
    assert!(!Path::new(&segment).exists(), "{segment} left behind");
    eprintln!(
        "{N} messages to 1 local + 1 remote reader in {:.2?}",
        started.elapsed()
    );
}

/// c. Timeouts: a reader's dequeue with nothing written, then a writer's enqueue on a
/// ring that is full because its one reader never reads.
#[test]
fn full_ring_and_idle_writer_time_out() {
    const NAME: &str = "full_ring_and_idle_writer_time_out";
    const CHUNKS: usize = 4;
    const SHORT: Duration = Duration::from_millis(300);
    if let Some(role) = ChildRole::from_env() {
        role.run(|r| {
            let mut reader = r.open_ready()?;
            // The writer writes nothing until we say we are done waiting.
            let t = Instant::now();
            match reader.dequeue(Some(SHORT)) {
                Err(DequeueError::Timeout { waited, .. }) if waited >= SHORT => {}
                other => return Err(format!("dequeue with nothing written: {other:?}")),
            }
            if t.elapsed() > SHORT + Duration::from_secs(5) {
                return Err(format!("dequeue timeout took {:?}", t.elapsed()));
            }
            println!("dequeue timed out");
            // Never read: hold the ring full until the parent closes our stdin.
            let mut rest = Vec::new();
            std::io::stdin()
                .read_to_end(&mut rest)
                .map_err(|e| e.to_string())?;
            Ok(())
        });
    }
    let mut opts = QueueOptions::local(1);
    opts.max_chunk_bytes = 256;
    opts.max_chunks = CHUNKS;
    let mut writer = Writer::new(opts).unwrap();
    let segment = segment_path(&writer);
    let mut children = vec![spawn_reader(NAME, writer.handle(), 0)];
    writer_step(&mut children, "waiting for the reader to subscribe", |w| {
        writer.wait_until_ready(w)
    });
    children[0].wait_for_line("dequeue timed out", TIMEOUT);

    for i in 0..CHUNKS {
        writer_step(&mut children, "filling the ring", |w| {
            writer.enqueue(&[i as u8; 100], w)
        });
    }
    assert!(!writer.can_write());
    for msg in [vec![1u8; 100], vec![2u8; 1000]] {
        let t = Instant::now();
        match writer.enqueue(&msg, Some(SHORT)) {
            Err(EnqueueError::Timeout { waited, .. }) => assert!(waited >= SHORT, "{waited:?}"),
            other => panic!("enqueue of {} bytes on a full ring: {other:?}", msg.len()),
        }
        assert!(
            t.elapsed() < SHORT + Duration::from_secs(5),
            "{:?}",
            t.elapsed()
        );
    }
    // The oversized message timed out waiting for its chunk, before being published.
    assert_eq!(writer.overflow_count(), 0);
    assert_eq!(
        children[0].exited(),
        None,
        "the reader must still hold the ring"
    );

    let mut stdin = children[0].stdin();
    let _ = stdin.flush();
    drop(stdin);
    expect_all_succeed(&mut children);
    drop(writer);
    assert!(!Path::new(&segment).exists(), "{segment} left behind");
}

/// The bytes of part `k` of message `seq` in the parts test: deterministic, so a reader
/// checks them exactly.
fn part_bytes(seq: u64, k: usize, len: usize) -> Vec<u8> {
    let mut rng = XorShift::new(SEED ^ seq ^ ((k as u64) << 40));
    (0..len).map(|_| rng.next() as u8).collect()
}

/// Lengths of the parts of message `seq`: a small body, a large part (the arena for
/// local readers), a small one (inline).
fn part_lens(seq: u64) -> [usize; 3] {
    [
        16 + (seq as usize % 7),
        (2 << 20) + seq as usize * 4096,
        300,
    ]
}

/// Read `n` messages of parts and check them: the large part of a local reader is a
/// private view of the arena (no copy) that it can write without anyone else seeing it,
/// a remote reader's is a ZeroMQ frame.
fn read_parts(role: &ChildRole, n: u64) -> Result<(), String> {
    let mut reader = role.open_ready()?;
    let mut kept = Vec::new();
    for seq in 0..n {
        let mut parts = reader
            .dequeue_parts(Some(TIMEOUT))
            .map_err(|e| format!("message {seq}: {e}"))?;
        let lens = part_lens(seq);
        if parts.len() != 3 {
            return Err(format!("message {seq}: {} parts", parts.len()));
        }
        for (k, p) in parts.iter().enumerate() {
            if **p != part_bytes(seq, k, lens[k])[..] {
                return Err(format!("message {seq}: part {k} differs"));
            }
        }
        let zero_copy = matches!(
            (&parts[1], reader.is_local()),
            (shmq::OwnedPart::Arena(_), true) | (shmq::OwnedPart::Frame(_), false)
        );
        if !zero_copy {
            return Err(format!(
                "message {seq}: the large part was copied: {:?}",
                parts[1]
            ));
        }
        parts[1][0] ^= 0xFF; // private: must not reach the others
        if seq % 10 == 0 {
            kept.push((seq, parts.swap_remove(1))); // held while more messages come
        }
    }
    for (seq, p) in &kept {
        let want = part_bytes(*seq, 1, part_lens(*seq)[1]);
        if p[0] != want[0] ^ 0xFF || p[1..] != want[1..] {
            return Err(format!("kept part of message {seq} changed under its view"));
        }
    }
    Ok(())
}

/// e. Messages of several parts (`Message::Parts` / `dequeue_parts`): large parts reach
/// two local readers as private views of the tensor arena, with no copy at all when sent
/// from a loan, and a remote reader as frames; views held while more messages come stay
/// intact; every arena part comes back once the readers are done.
#[test]
fn parts_and_loans_reach_local_and_remote_readers() {
    const NAME: &str = "parts_and_loans_reach_local_and_remote_readers";
    const N: u64 = 40;
    if let Some(role) = ChildRole::from_env() {
        role.run(|r| read_parts(r, N));
    }
    let mut opts = QueueOptions::default();
    opts.n_reader = 3;
    opts.n_local_reader = 2;
    opts.max_chunk_bytes = 64 << 10;
    opts.max_chunks = 4;
    opts.connect_ip = Some("127.0.0.1".into());
    let mut writer = Writer::new(opts).unwrap();
    assert!(writer.handle().arena.is_some());
    let mut children: Vec<_> = (0..3)
        .map(|rank| spawn_reader(NAME, writer.handle(), rank))
        .collect();
    writer_step(&mut children, "waiting for readers to subscribe", |w| {
        writer.wait_until_ready(w)
    });
    for seq in 0..N {
        let lens = part_lens(seq);
        let parts: Vec<Vec<u8>> = (0..3).map(|k| part_bytes(seq, k, lens[k])).collect();
        if seq % 4 == 0 {
            // Filled in place and sent by reference: nothing new is allocated.
            let mut loan = writer.loan(lens[1]).expect("room for a loan");
            loan.copy_from_slice(&parts[1]);
            let before = writer.arena().unwrap().outstanding();
            writer_step(&mut children, &format!("enqueue of message {seq}"), |w| {
                writer.enqueue(Message::Parts(&[&parts[0], &loan, &parts[2]]), w)
            });
            assert_eq!(writer.arena().unwrap().outstanding(), before);
        } else {
            writer_step(&mut children, &format!("enqueue of message {seq}"), |w| {
                writer.enqueue(Message::Parts(&[&parts[0], &parts[1], &parts[2]]), w)
            });
        }
    }
    expect_all_succeed(&mut children);
    assert_eq!(writer.arena_fallbacks(), 0);
    let arena = writer.arena_mut().unwrap().get_mut().unwrap();
    arena.reclaim();
    assert_eq!(arena.outstanding(), 0, "arena parts not given back");
}
