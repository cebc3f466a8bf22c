//! Waiting for any of several local readers at once: one thread (an event loop's
//! waiter, a collector of several writers' queues) sleeps on all their rings' "data
//! ready" doorbells in one `futex_waitv` (the handshake is
//! `shmq_protocol::multiwait`'s, model-checked with loom) and learns which readers' next
//! call would not block. No thread per queue, no polling: the sleep ends when a writer
//! publishes (or shuts down), when the caller's wake word changes, at the timeout, or
//! every half second to look at the writers' liveness, as a reader's own wait does (a
//! writer killed by a signal rings no bell).
//!
//! A [`ReadyTarget`] is taken from a [`Reader`] (by the thread that owns it) and waited
//! on by another without the reader: it names the chunk the reader reads next, so the
//! owner takes a new one after each message.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::queue::{Canceller, Reader};
use super::ring::{Ring, RingReader};
use crate::error::{Error, OsError, Result};
use shmq_protocol::doorbell::DoorbellWords;
use shmq_protocol::multiwait::{self, MAX_WORDS, OsFutexMany};

pub use shmq_protocol::multiwait::WakeWord;

/// Make a [`wait_any`] that was given `word`'s value from before now return (at once if
/// it is not asleep yet): what a caller does after it changed what the waiter waits for.
pub fn wake(word: &WakeWord) {
    word.wake(&OsFutexMany);
}

/// How often a sleep looks at the writers' liveness (as a reader's own wait does).
const LIVENESS_INTERVAL: Duration = Duration::from_millis(500);

/// The most readers one [`wait_any`] takes: one doorbell each, and the wake word.
pub const MAX_TARGETS: usize = MAX_WORDS - 1;

/// What tells whether a local reader's next call would return at once, without the
/// reader (see the module docs).
#[derive(Clone, Debug)]
pub struct ReadyTarget {
    ring: Arc<Ring>,
    reader: usize,
    next: usize,
    cancel: Canceller,
}

impl ReadyTarget {
    /// The target of `reader`'s next message; `None` for a remote reader (its messages
    /// come over ZeroMQ, not through a ring's doorbell).
    pub fn of(reader: &Reader) -> Option<ReadyTarget> {
        Some(ReadyTarget {
            ring: reader.ring()?.clone(),
            reader: reader.reader_index()?,
            next: reader.current_idx(),
            cancel: reader.canceller(),
        })
    }

    /// Whether the reader's next call returns at once: a message in its next chunk, the
    /// writer's shutdown (the call raises it), or the reader cancelled.
    pub fn ready(&self) -> bool {
        self.cancel.is_cancelled()
            || self.ring.is_readable_by(self.next, self.reader)
            || self.ring.writer_closed()
    }

    /// Whether the reader's next call fails at once because its writer is proved dead
    /// (or the segment is no longer whole).
    pub fn writer_dead(&self) -> bool {
        self.check_writer().is_err()
    }

    /// The reader's error when its writer is proved dead
    /// ([`QueueError::DeadWriter`](crate::broadcast::QueueError::DeadWriter)), or its
    /// segment no longer whole; `Ok` otherwise.
    ///
    /// # Errors
    ///
    /// [`QueueError::DeadWriter`](crate::broadcast::QueueError::DeadWriter) when the
    /// writer's process is proved dead; [`Error::Os`] when the segment was truncated.
    pub fn check_writer(&self) -> Result<()> {
        RingReader::check_writer(&self.ring)
    }

    /// The ring's segment name.
    pub fn queue(&self) -> &str {
        self.ring.name()
    }

    fn bell(&self) -> &DoorbellWords {
        self.ring.data_ready()
    }
}

/// Wait until one of `targets` is ready ([`ReadyTarget::ready`], or its writer proved
/// dead), `wake` is no longer `wake_seen` (read with [`WakeWord::current`] before the
/// caller chose its targets), or `timeout` passes. Returns the indices of the targets
/// ready (empty: woken or timed out). At most [`MAX_TARGETS`] targets; an
/// [`OsError::Os`] of kind `Unsupported` where the kernel has no `futex_waitv`.
///
/// The caller owns a [`WakeWord`] (`WakeWord::default()`), reads it with
/// [`WakeWord::current`] *before* it takes its targets, and passes what it read: another
/// thread that changes what to wait for (or wants the waiter to stop) calls [`wake`] on
/// the same word, and the wait returns at once even if it had not begun to sleep. Take a
/// new [`ReadyTarget::of`] each reader after each message it takes (a target names the
/// chunk its reader reads next). For async code, [`AsyncWaiter`](super::AsyncWaiter)
/// does all this on threads of its own.
///
/// ```
/// use std::time::Duration;
/// use shmq_core::broadcast::wait_any::{wait_any, wake, ReadyTarget, WakeWord};
/// use shmq_core::{QueueOptions, Reader, Writer};
///
/// let t = Duration::from_secs(10);
/// let mut writers: Vec<Writer> = (0..3)
///     .map(|_| Writer::new(QueueOptions::local(1)))
///     .collect::<Result<_, _>>()?;
/// let mut readers: Vec<Reader> = writers
///     .iter()
///     .map(|w| Reader::open(w.handle(), 0))
///     .collect::<Result<_, _>>()?;
/// for r in &mut readers {
///     r.wait_until_ready(t)?;
/// }
/// let word = WakeWord::default();
/// std::thread::scope(|s| {
///     let second = &mut writers[1];
///     s.spawn(move || {
///         second.wait_until_ready(t)?;
///         second.enqueue(b"from the second writer", t)?;
///         Ok::<(), shmq_core::Error>(())
///     });
///     loop {
///         let seen = word.current(); // before the targets
///         let targets: Vec<ReadyTarget> =
///             readers.iter().map(|r| ReadyTarget::of(r).expect("local")).collect();
///         let refs: Vec<&ReadyTarget> = targets.iter().collect();
///         // Sleeps on the three queues' doorbells at once.
///         let ready = wait_any(&refs, &word, seen, Some(t))?;
///         if let Some(&i) = ready.first() {
///             // Ready: the reader's next call returns at once (a message, or its error).
///             let msg = readers[i].dequeue(Duration::ZERO)?;
///             assert_eq!((i, msg.as_slice()), (1, &b"from the second writer"[..]));
///             return Ok::<(), shmq_core::Error>(());
///         }
///     }
/// })?;
/// // Another thread ends a wait with the word: `wait_any` returns no target.
/// let seen = word.current();
/// wake(&word);
/// let target = ReadyTarget::of(&readers[0]).expect("local");
/// assert!(wait_any(&[&target], &word, seen, None)?.is_empty());
/// # Ok::<(), shmq_core::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidArgument`] for more than [`MAX_TARGETS`] targets; [`Error::Os`] when the
/// kernel has no `futex_waitv` (Linux before 5.16, or a seccomp filter).
pub fn wait_any(
    targets: &[&ReadyTarget],
    wake: &WakeWord,
    wake_seen: u32,
    timeout: Option<Duration>,
) -> Result<Vec<usize>> {
    if targets.len() > MAX_TARGETS {
        return Err(Error::InvalidArgument(format!(
            "one wait takes at most {MAX_TARGETS} queues, got {}",
            targets.len()
        )));
    }
    let ready = || -> Vec<usize> { (0..targets.len()).filter(|&i| targets[i].ready()).collect() };
    let deadline = timeout.map(|t| Instant::now() + t.min(Duration::from_secs(1 << 32)));
    // Readers of one ring share its bell: sleep on each bell once.
    let mut bells: Vec<&DoorbellWords> = Vec::with_capacity(targets.len());
    for t in targets {
        if !bells.iter().any(|b| std::ptr::eq(*b, t.bell())) {
            bells.push(t.bell());
        }
    }
    let mut next_liveness = Instant::now();
    loop {
        let now = Instant::now();
        if now >= next_liveness {
            let dead: Vec<usize> = (0..targets.len())
                .filter(|&i| targets[i].writer_dead())
                .collect();
            if !dead.is_empty() {
                return Ok(dead);
            }
            next_liveness = now + LIVENESS_INTERVAL;
        }
        let mut slice = next_liveness.saturating_duration_since(now);
        if let Some(d) = deadline {
            slice = slice.min(d.saturating_duration_since(now));
        }
        let mut found = Vec::new();
        multiwait::sleep_any(
            &OsFutexMany,
            &bells,
            wake,
            wake_seen,
            || {
                found = ready();
                !found.is_empty()
            },
            Some(slice),
        )
        .map_err(|e| {
            Error::Os(OsError::Os {
                context: "waiting for several queues at once".into(),
                source: std::io::Error::new(std::io::ErrorKind::Unsupported, e),
            })
        })?;
        if found.is_empty() {
            found = ready();
        }
        if !found.is_empty() || wake.current() != wake_seen {
            return Ok(found);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(Vec::new());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broadcast::{QueueOptions, Writer};

    fn queue() -> (Writer, Reader) {
        let w = Writer::new(QueueOptions {
            max_chunk_bytes: 64,
            max_chunks: 2,
            ..QueueOptions::local(1)
        })
        .unwrap();
        let r = Reader::open(w.handle(), 0).unwrap();
        (w, r)
    }

    #[test]
    fn one_wait_for_three_queues_names_the_one_written_and_the_one_shut_down() {
        let mut queues: Vec<(Writer, Reader)> = (0..3).map(|_| queue()).collect();
        std::thread::scope(|s| {
            for (w, r) in queues.iter_mut() {
                s.spawn(|| w.wait_until_ready(Some(Duration::from_secs(10))).unwrap());
                r.wait_until_ready(Some(Duration::from_secs(10))).unwrap();
            }
        });
        let wake = WakeWord::default();
        let targets: Vec<ReadyTarget> = queues
            .iter()
            .map(|(_, r)| ReadyTarget::of(r).unwrap())
            .collect();
        let refs: Vec<&ReadyTarget> = targets.iter().collect();
        // Nothing sent: the timeout.
        let seen = wake.current();
        assert!(
            wait_any(&refs, &wake, seen, Some(Duration::from_millis(50)))
                .unwrap()
                .is_empty()
        );
        // A message on the second queue, sent while the waiter sleeps.
        std::thread::scope(|s| {
            let w = &mut queues[1].0;
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                w.enqueue(b"m", Some(Duration::from_secs(10))).unwrap();
            });
            let seen = wake.current();
            let mut got = Vec::new();
            while got.is_empty() {
                got = wait_any(&refs, &wake, seen, Some(Duration::from_secs(20))).unwrap();
            }
            assert_eq!(got, vec![1]);
        });
        // The third writer shuts its queue down: ready (its reader's call returns).
        queues[2].0.close();
        let got = wait_any(&refs, &wake, wake.current(), Some(Duration::from_secs(20))).unwrap();
        assert_eq!(got, vec![1, 2]);
        // The wake word ends a wait on the first queue alone.
        let seen = wake.current();
        wake.wake(&OsFutexMany);
        assert!(wait_any(&refs[..1], &wake, seen, None).unwrap().is_empty());
    }
}
