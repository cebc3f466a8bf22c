//! Async receives and `Gather` across real processes: the writers are this same test
//! binary run again (as `tests/broadcast_processes.rs` runs its readers), the test
//! itself is the one reader of every queue.
//!
//! A test starts its writers with [`spawn_writer`]: the child runs `<this binary>
//! --exact <test name> --nocapture` with [`ROLE_ENV`] set, so the same test function
//! starts again in the child, sees the variable at its top and plays a writer: it makes
//! its queue, prints its handle (after [`HANDLE_MARK`]) for the parent to open, sends
//! its messages and ends as [`END_ENV`] says — closing its queue, or `_exit` without
//! any destructor (a death, as a crash or a kill leaves it).
//!
//! Every message is made from its writer's number and its sequence number alone
//! ([`message`]), so the reader checks each byte for byte and in order. Every blocking
//! call has a bound ([`TIMEOUT`], turning a hang into a failure, never a timing assert),
//! and writer processes still running when a test fails are killed.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shmq::broadcast::{DequeueError, Gather, GatherRecvError, QueueError};
use shmq::{Error, Handle, QueueOptions, Reader, Writer};

/// What a child plays (only `writer`); its presence marks the child.
const ROLE_ENV: &str = "SHMQ_TEST_ROLE";
/// The child writer's number (in its messages).
const WRITER_ENV: &str = "SHMQ_TEST_WRITER";
/// How many messages it sends.
const COUNT_ENV: &str = "SHMQ_TEST_COUNT";
/// How it ends: `close` (its queue shut down normally), `exit` (`_exit` at once after
/// its last message), `exit-on-stdin` (`_exit` once the parent writes a line).
const END_ENV: &str = "SHMQ_TEST_END";
/// Whether every message fits in a chunk (`1`), or some go over the queue's socket.
const SMALL_ENV: &str = "SHMQ_TEST_SMALL";
/// Pause 3 ms after every 10th message (`1`), so that a reader's awaits time out.
const PAUSE_ENV: &str = "SHMQ_TEST_PAUSE";
/// Before the handle in the child's output.
const HANDLE_MARK: &str = "SHMQ_HANDLE=";
/// The exit code of a writer that dies on purpose.
const DIED: i32 = 3;

/// Bound on every blocking call and on each test's whole run.
const TIMEOUT: Duration = Duration::from_secs(60);
/// The queues' chunks: messages above this go over the queue's socket.
const CHUNK: usize = 256;

// ---------------------------------------------------------------------------------
// Messages

/// xorshift64 (Marsaglia 2003): deterministic sizes and bytes.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
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
}

/// Message `seq` of writer `writer`: `[writer][seq]` (u64 LE each), then bytes from
/// both; 16 to 200 bytes, or (unless `small`) every 13th one larger than a chunk.
fn message(writer: u64, seq: u64, small: bool) -> Vec<u8> {
    let mut rng = XorShift::new((writer << 32) ^ seq ^ 0x5EED);
    let len = if !small && seq % 13 == 5 {
        CHUNK + 1 + (rng.next() % 300) as usize
    } else {
        16 + (rng.next() % 185) as usize
    };
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(&writer.to_le_bytes());
    msg.extend_from_slice(&seq.to_le_bytes());
    while msg.len() < len {
        msg.push(rng.next() as u8);
    }
    msg
}

/// Each writer's next sequence number, checking that every message is the next one of
/// its writer, byte for byte.
#[derive(Default)]
struct Expect {
    next: BTreeMap<u64, u64>,
    /// The writers that send only messages that fit in a chunk.
    small: Vec<u64>,
}

impl Expect {
    fn with_small(small: &[u64]) -> Expect {
        Expect {
            small: small.to_vec(),
            ..Expect::default()
        }
    }

    fn check(&mut self, writer: u64, got: &[u8]) {
        let seq = self.next.entry(writer).or_insert(0);
        let want = message(writer, *seq, self.small.contains(&writer));
        assert!(
            got == want.as_slice(),
            "writer {writer}: message {seq} wrong: {} bytes, expected {} (header {:?})",
            got.len(),
            want.len(),
            got.get(..16)
        );
        *seq += 1;
    }

    fn count(&self, writer: u64) -> u64 {
        self.next.get(&writer).copied().unwrap_or(0)
    }
}

// ---------------------------------------------------------------------------------
// Writer processes (the child side)

/// Play the writer if this process is a child; returns only in the parent.
fn child_writer() {
    if std::env::var(ROLE_ENV).is_err() {
        return;
    }
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let writer: u64 = var(WRITER_ENV).parse().unwrap();
    let count: u64 = var(COUNT_ENV).parse().unwrap();
    let (small, pause) = (var(SMALL_ENV) == "1", var(PAUSE_ENV) == "1");
    let result = (|| -> Result<(), Error> {
        let mut opts = QueueOptions::local(1);
        opts.max_chunk_bytes = CHUNK;
        opts.max_chunks = 4;
        let mut w = Writer::new(opts)?;
        println!("{HANDLE_MARK}{}", w.handle());
        std::io::stdout().flush().unwrap();
        w.wait_until_ready(TIMEOUT)?;
        for seq in 0..count {
            w.enqueue(&message(writer, seq, small), TIMEOUT)?;
            if pause && seq % 10 == 9 {
                std::thread::sleep(Duration::from_millis(3));
            }
        }
        match var(END_ENV).as_str() {
            "close" => {
                w.close();
                drop(w);
                Ok(())
            }
            end => {
                if end == "exit-on-stdin" {
                    let mut line = String::new();
                    std::io::stdin().read_line(&mut line).unwrap();
                }
                // SAFETY: `_exit` ends the process without running anything of it (no
                // destructor, no atexit work): a death as a crash leaves the queue, on
                // purpose. Nothing of this process is used after it.
                unsafe { libc::_exit(DIED) }
            }
        }
    })();
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("writer {writer} failed: {e}");
            std::process::exit(1)
        }
    }
}

// ---------------------------------------------------------------------------------
// Writer processes (the parent side)

/// A writer process: its output collected as it comes, killed if the test ends first.
struct WriterProcess {
    writer: u64,
    child: Child,
    lines: Receiver<String>,
    output: Arc<Mutex<String>>,
}

/// How a writer process is started.
struct Spec {
    count: u64,
    end: &'static str,
    small: bool,
    pause: bool,
}

/// Start this test binary again as writer number `writer` of test `test_name`.
fn spawn_writer(test_name: &str, writer: u64, spec: &Spec) -> WriterProcess {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test_name, "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "writer")
        .env(WRITER_ENV, writer.to_string())
        .env(COUNT_ENV, spec.count.to_string())
        .env(END_ENV, spec.end)
        .env(SMALL_ENV, if spec.small { "1" } else { "0" })
        .env(PAUSE_ENV, if spec.pause { "1" } else { "0" })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting a writer process");
    let output = Arc::new(Mutex::new(String::new()));
    let (tx, lines) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    let out = output.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            out.lock().unwrap().push_str(&format!("[stdout] {line}\n"));
            let _ = tx.send(line);
        }
    });
    let mut stderr = child.stderr.take().unwrap();
    let out = output.clone();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        out.lock().unwrap().push_str(&format!("[stderr] {s}\n"));
    });
    WriterProcess {
        writer,
        child,
        lines,
        output,
    }
}

impl WriterProcess {
    /// The handle the child printed (the harness prints `test <name> ... ` before it on
    /// the same line).
    fn handle(&self) -> Handle {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some((_, h)) = line.split_once(HANDLE_MARK) {
                        return h.parse().expect("a handle");
                    }
                }
                Err(_) => panic!(
                    "writer {} printed no handle within {TIMEOUT:?}:\n{}",
                    self.writer,
                    self.output.lock().unwrap()
                ),
            }
        }
    }

    fn stdin(&mut self) -> ChildStdin {
        self.child.stdin.take().expect("stdin taken once")
    }

    /// Wait (bounded) for the process to end.
    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "writer {} still running after {TIMEOUT:?}:\n{}",
                self.writer,
                self.output.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn expect_exit(&mut self, code: i32) {
        let status = self.wait_exit();
        assert_eq!(
            status.code(),
            Some(code),
            "writer {}:\n{}",
            self.writer,
            self.output.lock().unwrap()
        );
    }
}

impl Drop for WriterProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Start one writer process per spec and open the one local reader of each queue,
/// named `w<number>`.
fn start(test_name: &str, specs: &[Spec]) -> (Vec<WriterProcess>, Vec<(String, Reader)>) {
    let children: Vec<WriterProcess> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| spawn_writer(test_name, i as u64, s))
        .collect();
    let readers = children
        .iter()
        .map(|c| {
            let mut r = Reader::open(&c.handle(), 0).expect("opening a writer's queue");
            r.wait_until_ready(TIMEOUT).expect("ready");
            (format!("w{}", c.writer), r)
        })
        .collect();
    (children, readers)
}

/// Remove what a writer that died left in /dev/shm (its ring and socket directory: it
/// ran no destructor); the reader's mapping stays valid.
fn remove_dead_writers_segment(reader: &Reader) {
    // Only a segment's creator unlinks it (`Ring::unlink`); its creator is proved dead.
    let name = reader.ring().expect("a local reader").name();
    assert!(name.starts_with("shmq_"), "{name}");
    std::fs::remove_file(format!("/dev/shm/{name}")).expect("the dead writer's ring");
    shmq::admin::remove_socket_dirs_of(name);
}

/// A current-thread tokio runtime with timers.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

/// The three writers of the Gather tests: 0 and 2 send 200 messages (some over the
/// socket) and close; 1 sends 60 small ones and dies (`_exit`).
fn three_writers() -> [Spec; 3] {
    let ok = |pause| Spec {
        count: 200,
        end: "close",
        small: false,
        pause,
    };
    [
        ok(false),
        Spec {
            count: 60,
            end: "exit",
            // A message on its way over the socket when the writer dies would be lost
            // with it: the one that dies sends only what fits in a chunk.
            small: true,
            pause: false,
        },
        ok(true),
    ]
}

/// What the Gather tests check once their stream is over: every message of each
/// writer, the death of writer 1 reported once, the others ended normally.
fn check_three(gather: &Gather, expect: &Expect, deaths: &[usize], children: &mut [WriterProcess]) {
    assert_eq!(expect.count(0), 200);
    assert_eq!(expect.count(1), 60);
    assert_eq!(expect.count(2), 200);
    assert_eq!(deaths, [1]);
    assert_eq!(gather.died(), [1]);
    let mut ended = gather.ended().to_vec();
    ended.sort();
    assert_eq!(ended, [0, 2]);
    children[0].expect_exit(0);
    children[1].expect_exit(DIED);
    children[2].expect_exit(0);
    remove_dead_writers_segment(gather.reader(1));
}

/// The writer's index in a Gather's death report, which must name its cause.
fn death(e: &GatherRecvError) -> Option<usize> {
    match e {
        GatherRecvError::WriterDied {
            writer,
            name,
            cause,
        } => {
            assert_eq!(name, &format!("w{writer}"));
            assert!(
                matches!(**cause, Error::Queue(QueueError::DeadWriter { .. })),
                "{cause}"
            );
            Some(*writer)
        }
        _ => None,
    }
}

// ---------------------------------------------------------------------------------
// Tests

/// A blocking Gather of three writer processes, one of which dies (`_exit`): every
/// message of each writer in its order, the death reported once (after the dead
/// writer's last message), the others read to their end.
#[test]
fn a_gather_of_three_writer_processes_reports_the_one_that_died() {
    child_writer();
    const NAME: &str = "a_gather_of_three_writer_processes_reports_the_one_that_died";
    let (mut children, readers) = start(NAME, &three_writers());
    let mut gather = Gather::new(readers).unwrap();
    let mut expect = Expect::with_small(&[1]);
    let mut deaths = Vec::new();
    loop {
        match gather.recv_timeout(TIMEOUT) {
            Ok((writer, bytes)) => expect.check(writer as u64, &bytes),
            Err(GatherRecvError::Ended { ended, died }) => {
                assert_eq!(died, ["w1"]);
                assert_eq!(ended.len(), 2);
                break;
            }
            Err(e) => match death(&e) {
                Some(w) => {
                    // Reported after every message the writer sent.
                    assert_eq!(expect.count(w as u64), 60);
                    deaths.push(w);
                }
                None => panic!("recv: {e}"),
            },
        }
    }
    check_three(&gather, &expect, &deaths, &mut children);
}

/// The same on tokio, every receive under a short timeout (1 µs to 2 ms) that cancels
/// many of them, beside a task whose awaits on an idle queue are all cancelled: no
/// message lost or doubled, the death reported once.
#[test]
fn a_gather_on_tokio_with_cancelled_awaits_reports_the_one_that_died() {
    child_writer();
    const NAME: &str = "a_gather_on_tokio_with_cancelled_awaits_reports_the_one_that_died";
    let (mut children, readers) = start(NAME, &three_writers());
    let mut gather = Gather::new(readers).unwrap();
    // An idle queue of this process, awaited beside the Gather.
    let idle_writer = Writer::new(QueueOptions::local(1)).unwrap();
    let mut idle = Reader::open(idle_writer.handle(), 0).unwrap();
    let mut expect = Expect::with_small(&[1]);
    let mut deaths = Vec::new();
    let mut cancelled = 0u64;
    runtime().block_on(async {
        let beside = async {
            let mut n = 0u64;
            loop {
                let t = Duration::from_micros(1 + n % 500);
                let got = tokio::time::timeout(t, idle.dequeue_async()).await;
                assert!(got.is_err(), "the idle queue has no messages");
                n += 1;
                tokio::task::yield_now().await;
            }
        };
        let gathering = async {
            let mut rng = XorShift::new(7);
            loop {
                let t = Duration::from_micros(1 + rng.next() % 2000);
                match tokio::time::timeout(t, gather.recv_async()).await {
                    Err(_) => cancelled += 1,
                    Ok(Ok((writer, bytes))) => expect.check(writer as u64, &bytes),
                    Ok(Err(GatherRecvError::Ended { .. })) => break,
                    Ok(Err(e)) => match death(&e) {
                        Some(w) => {
                            assert_eq!(expect.count(w as u64), 60);
                            deaths.push(w);
                        }
                        None => panic!("recv_async: {e}"),
                    },
                }
            }
        };
        tokio::time::timeout(TIMEOUT, async {
            tokio::select! {
                () = gathering => {}
                () = beside => unreachable!("it loops for good"),
            }
        })
        .await
        .expect("the stream within the bound");
    });
    println!("{cancelled} receives cancelled");
    check_three(&gather, &expect, &deaths, &mut children);
}

/// A writer process's death wakes a `dequeue_async` that is pending (registered with the
/// waiter's thread, asleep): it fails with the writer's death, after the message sent
/// before it.
#[test]
fn a_writers_death_wakes_a_pending_dequeue_async() {
    child_writer();
    const NAME: &str = "a_writers_death_wakes_a_pending_dequeue_async";
    let spec = Spec {
        count: 1,
        end: "exit-on-stdin",
        small: true,
        pause: false,
    };
    let (mut children, mut readers) = start(NAME, &[spec]);
    let (_, mut reader) = readers.pop().unwrap();
    runtime().block_on(async {
        let first = tokio::time::timeout(TIMEOUT, reader.dequeue_async()).await;
        assert_eq!(first.unwrap().unwrap(), message(0, 0, true));
        let pending = reader.dequeue_async();
        tokio::pin!(pending);
        // Pending for a while: nothing more comes until the writer is told to die.
        let early = tokio::time::timeout(Duration::from_millis(50), &mut pending).await;
        assert!(early.is_err(), "nothing was sent: {early:?}");
        writeln!(children[0].stdin(), "die").unwrap();
        let got = tokio::time::timeout(TIMEOUT, &mut pending)
            .await
            .expect("woken by the death within the bound");
        assert!(
            matches!(got, Err(DequeueError::WriterDied { .. })),
            "{got:?}"
        );
    });
    children[0].expect_exit(DIED);
    remove_dead_writers_segment(&reader);
}

/// Twelve writer processes, 300 messages each (some over the socket, pauses now and
/// then), each queue read by its own task under timeouts of 1 µs to 2 ms racing every
/// receive: hundreds of awaits cancelled, and every message received exactly once, in
/// order.
#[test]
fn many_queues_raced_by_short_timeouts_lose_no_message() {
    child_writer();
    const NAME: &str = "many_queues_raced_by_short_timeouts_lose_no_message";
    const QUEUES: usize = 12;
    const COUNT: u64 = 300;
    let specs: Vec<Spec> = (0..QUEUES)
        .map(|_| Spec {
            count: COUNT,
            end: "close",
            small: false,
            pause: true,
        })
        .collect();
    let (mut children, readers) = start(NAME, &specs);
    let rt = runtime();
    let cancelled: u64 = rt.block_on(async {
        let tasks = readers
            .into_iter()
            .enumerate()
            .map(|(i, (_, mut reader))| async move {
                let mut expect = Expect::default();
                let mut rng = XorShift::new(i as u64 + 1);
                let mut cancelled = 0u64;
                loop {
                    let t = Duration::from_micros(1 + rng.next() % 2000);
                    match tokio::time::timeout(t, reader.dequeue_async()).await {
                        Err(_) => cancelled += 1,
                        Ok(Ok(bytes)) => expect.check(i as u64, &bytes),
                        Ok(Err(DequeueError::WriterShutDown { .. })) => break,
                        Ok(Err(e)) => panic!("queue {i}: {e}"),
                    }
                }
                assert_eq!(expect.count(i as u64), COUNT, "queue {i}");
                cancelled
            });
        let all = async {
            let mut handles = Vec::new();
            for t in tasks {
                handles.push(tokio::task::spawn_local(t));
            }
            let mut sum = 0;
            for h in handles {
                sum += h.await.expect("a reader task");
            }
            sum
        };
        let local = tokio::task::LocalSet::new();
        tokio::time::timeout(TIMEOUT, local.run_until(all))
            .await
            .expect("every queue read within the bound")
    });
    println!("{cancelled} receives cancelled");
    // What the test is for happened: awaits were cancelled (the writers pause 3 ms
    // after every 10th message, longer than any timeout, 360 times in all).
    assert!(cancelled > 0);
    for c in &mut children {
        c.expect_exit(0);
    }
}
