//! Model checks (loom) of the cross-process protocols:
//! - the ring's chunk flags: no reader sees a half-written or stale chunk, the writer
//!   never overwrites a chunk a reader has not finished (loom's cell checks), messages
//!   are read in order;
//! - the doorbell's sleep/wake handshake: no lost wake-up (a lost one is a deadlock here,
//!   since the model futex sleeps without a timeout);
//! - the slot seqlock: no torn holder, and a drop never lands on a holder that attached
//!   after the writer judged the old one.
//! - the object store's published state (`shmq_protocol::seqlock`): no torn snapshot, and a
//!   reader's check after reading never vouches for bytes the writer reused.
//! - the encoder cache's key index: a reader racing with the writer never sees a torn
//!   slot (a key with another key's entry), and a key present throughout a lookup is
//!   found even while other keys are removed, inserted into its chain, or the table is
//!   rebuilt.
//! - the encoder cache's consumer slots (`shmq_protocol::consumer_slot`): one slot never
//!   goes to two consumers, a joined slot is never read torn, a producer whose clock tick
//!   came after a join never reads the slot as free; a dead consumer's slot is reclaimed
//!   at most once, never from its successor, and its successor finds the pins zeroed;
//!   the next occupant of a slot left normally sees the leaver's unpins.
//! - the arena's leases (`shmq_protocol::lease`): the writer never reuses a range while a
//!   live reader or a loan (dropped in another thread) still holds it, also after it
//!   dropped a dead reader's holds (loom's cell checks).
//! - the object store's read counts (`shmq_protocol::read_count`): no read count is lost,
//!   a counted read happens before the writer reuses the payload, a reader's late count
//!   never lands in reused memory (the counting window), and no block is reused under a
//!   zero-copy view (the pin hint).
//! - the encoder cache's entries (`shmq_protocol::entry`): no entry's bytes are reused
//!   while a consumer pins it, and no ack is lost or seen before the load it
//!   acknowledges.
//! - the object store's LEFT reader slots (`shmq_protocol::ring::slot_leave`): a reader
//!   that closed is never judged dead, and its slot is taken again.
//!
//! Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --release -p shmq-protocol --test loom`
//! (scripts/test.sh does). Without `--cfg loom` this file compiles to nothing.
#![cfg(loom)]

use std::time::Duration;

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;

use shmq_protocol::doorbell::{DoorbellWords, Futex};
use shmq_protocol::key_index::{IndexEpoch, IndexSlot, IndexWriter, Key, KeyIndex, Lookup};
use shmq_protocol::ring::{self as protocol, ChunkFlag, ChunkFlags};

/// One chunk shared by a writer and `N` readers; the payload is a loom cell, so loom
/// reports any write that is not ordered after every read of the previous message (and
/// the other way round).
struct Chunk<const N: usize> {
    written: ChunkFlag,
    read: [ChunkFlag; N],
    payload: UnsafeCell<(u32, u32)>,
}

impl<const N: usize> Chunk<N> {
    fn new() -> Self {
        Chunk {
            written: ChunkFlag::new(0),
            read: std::array::from_fn(|_| ChunkFlag::new(0)),
            payload: UnsafeCell::new((0, 0)),
        }
    }
}

impl<const N: usize> ChunkFlags for Chunk<N> {
    fn n_reader(&self) -> usize {
        N
    }
    fn written(&self) -> &ChunkFlag {
        &self.written
    }
    fn read(&self, reader: usize) -> &ChunkFlag {
        &self.read[reader]
    }
}

fn never_dropped(_: usize) -> bool {
    false
}

/// Poll `ready` a few times, yielding in between. The flag model checks safety (what is
/// read is whole and current, the writer never overwrites unread data), not progress
/// (`doorbell_loses_no_wake_up` covers waking up): a thread that gives up just ends that
/// execution. Unbounded spin loops would make loom's paths endless.
fn eventually(mut ready: impl FnMut() -> bool) -> bool {
    for _ in 0..3 {
        if ready() {
            return true;
        }
        thread::yield_now();
    }
    ready()
}

/// loom's defaults, widened for spin loops: longer paths, and at most `preemptions`
/// preemptions per execution (bugs of this kind need few; three threads with spin loops
/// and a bound of 3 take far too long to explore).
fn model(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.max_branches = 100_000;
    builder.preemption_bound = Some(preemptions);
    builder.check(f);
}

fn flag_protocol<const N: usize>(messages: u32, preemptions: usize) {
    model(preemptions, move || {
        let chunk = Arc::new(Chunk::<N>::new());
        let readers: Vec<_> = (0..N)
            .map(|r| {
                let chunk = chunk.clone();
                thread::spawn(move || {
                    for k in 1..=messages {
                        if !eventually(|| protocol::is_readable(&*chunk, r)) {
                            return;
                        }
                        // SAFETY: loom's cell; loom fails the model if this read is concurrent
                        // with a write, which is what the test checks.
                        let got = chunk.payload.with(|p| unsafe { *p });
                        assert_eq!(got, (k, k), "reader {r} saw a half-written or stale chunk");
                        protocol::finish_read(&*chunk, r);
                    }
                })
            })
            .collect();
        for k in 1..=messages {
            if !eventually(|| protocol::is_free(&*chunk, never_dropped)) {
                break;
            }
            protocol::begin_write(&*chunk);
            // Two separate writes: a reader seeing only one of them would be caught.
            // SAFETY: loom's cell; loom fails the model on a concurrent access.
            chunk.payload.with_mut(|p| unsafe { (*p).0 = k });
            // SAFETY: as above.
            chunk.payload.with_mut(|p| unsafe { (*p).1 = k });
            protocol::publish(&*chunk, never_dropped);
        }
        for r in readers {
            r.join().unwrap();
        }
    });
}

#[test]
fn one_reader_three_messages_wrap_around() {
    flag_protocol::<1>(3, 3);
}

#[test]
fn two_readers_two_messages() {
    flag_protocol::<2>(2, 3);
}

/// A futex as the kernel provides it: the value check and going to sleep are atomic with
/// respect to wakes (a lock stands in for the kernel's hash-bucket lock). No timeouts: a
/// lost wake-up leaves the sleeper blocked and loom reports the deadlock.
struct ModelFutex {
    wakes: Mutex<u64>,
    cv: Condvar,
}

impl Futex for &ModelFutex {
    fn wait(&self, word: &AtomicU32, expected: u32, _timeout: Option<Duration>) {
        let mut wakes = self.wakes.lock().unwrap();
        if word.load(Ordering::SeqCst) != expected {
            return;
        }
        let seen = *wakes;
        while *wakes == seen {
            wakes = self.cv.wait(wakes).unwrap();
        }
    }
    fn wake_all(&self, _word: &AtomicU32) {
        *self.wakes.lock().unwrap() += 1;
        self.cv.notify_all();
    }
}

#[test]
fn doorbell_loses_no_wake_up() {
    model(3, || {
        let words = Arc::new(DoorbellWords::default());
        let data = Arc::new(AtomicU8::new(0));
        let futex = Arc::new(ModelFutex {
            wakes: Mutex::new(0),
            cv: Condvar::new(),
        });

        let publisher = {
            let (words, data, futex) = (words.clone(), data.clone(), futex.clone());
            thread::spawn(move || {
                // What the writer does on commit: publish, then ring.
                data.store(1, Ordering::Release);
                words.with(&*futex).ring();
            })
        };
        // What a waiting reader does once its spin and yield windows are over.
        let bell = words.with(&*futex);
        while !bell.sleep(|| data.load(Ordering::Acquire) == 1, None) {}
        publisher.join().unwrap();
    });
}

/// The slot seqlock: one process attaches to a slot twice in a row (two holders, each a
/// (pid, start time) pair); an inspector reads the slot; the writer tries to drop the
/// holder it judged dead from an earlier read. The inspector never sees a pid paired
/// with the other holder's start time, and a drop based on a word read before a
/// re-attach never lands (the new holder is not dropped).
#[test]
fn slot_seqlock_never_tears_and_drops_only_the_judged_holder() {
    use loom::sync::atomic::AtomicU32;
    use shmq_protocol::ring::{
        slot_begin_attach, slot_drop, slot_end_attach, slot_read, slot_state, SlotWord,
        SLOT_ATTACHED, SLOT_DROPPED,
    };

    struct Slot {
        word: SlotWord,
        pid: AtomicU32,
        start: AtomicU32,
    }
    fn attach(s: &Slot, pid: u32, start: u32) -> bool {
        let Some(generation) = slot_begin_attach(&s.word) else {
            return false; // dropped meanwhile: the attach is refused
        };
        s.pid.store(pid, Ordering::Relaxed);
        s.start.store(start, Ordering::Relaxed);
        slot_end_attach(&s.word, generation);
        true
    }
    fn read(s: &Slot) -> Option<(u64, (u32, u32))> {
        slot_read(&s.word, || {
            (
                s.pid.load(Ordering::Relaxed),
                s.start.load(Ordering::Relaxed),
            )
        })
    }

    model(3, || {
        let slot = Arc::new(Slot {
            word: SlotWord::new(),
            pid: AtomicU32::new(0),
            start: AtomicU32::new(0),
        });
        attach(&slot, 1, 10);
        // The writer's judgement of holder 1, taken now.
        let (judged, fields) = read(&slot).expect("no attach under way");
        assert_eq!(fields, (1, 10));
        let reattach = {
            let slot = slot.clone();
            thread::spawn(move || attach(&slot, 2, 20))
        };
        let inspector = {
            let slot = slot.clone();
            thread::spawn(move || {
                if let Some((word, (pid, start))) = read(&slot) {
                    if slot_state(word) == SLOT_ATTACHED || slot_state(word) == SLOT_DROPPED {
                        assert!(
                            (pid, start) == (1, 10) || (pid, start) == (2, 20),
                            "torn slot: pid {pid} with start time {start}"
                        );
                    }
                }
            })
        };
        let dropped = slot_drop(&slot.word, judged);
        let reattached = reattach.join().unwrap();
        inspector.join().unwrap();
        // Exactly one of them wins: a drop after the re-attach would drop holder 2.
        assert!(
            dropped != reattached,
            "dropped {dropped}, re-attached {reattached}"
        );
        let (word, fields) = read(&slot).unwrap();
        if dropped {
            assert_eq!((slot_state(word), fields), (SLOT_DROPPED, (1, 10)));
        } else {
            assert_eq!((slot_state(word), fields), (SLOT_ATTACHED, (2, 20)));
        }
    });
}

/// `count` one-word keys whose home slot in a table of `n` slots is `home`.
fn keys_at(home: usize, n: usize, count: usize) -> Vec<Key> {
    (0u32..)
        .map(|i| Key::new(format!("k{i}").as_bytes()).unwrap())
        .filter(|k| k.hash() as usize & (n - 1) == home)
        .take(count)
        .collect()
}

/// A table of `n` slots and its epoch, shared by the model's threads.
struct Table {
    epoch: IndexEpoch,
    slots: Vec<IndexSlot>,
}

impl Table {
    fn new(n: usize) -> Arc<Table> {
        Arc::new(Table {
            epoch: IndexEpoch::new(),
            slots: (0..n).map(|_| IndexSlot::new()).collect(),
        })
    }
    fn index(&self) -> KeyIndex<'_> {
        KeyIndex::new(&self.epoch, &self.slots)
    }
}

#[test]
fn key_index_reader_never_sees_a_torn_slot() {
    // Keys A and B share a home slot: the writer puts A there, removes it, and puts B in
    // the same slot. A reader looking up either must get that key's own entry, or
    // nothing; never A's key with B's entry (a torn read of the slot).
    let ks = keys_at(0, 2, 2);
    model(2, move || {
        let table = Table::new(2);
        let (a, b) = (ks[0].clone(), ks[1].clone());
        let writer = {
            let (table, a, b) = (table.clone(), a.clone(), b.clone());
            thread::spawn(move || {
                let index = table.index();
                let mut w = IndexWriter::new();
                w.insert(&index, &a, 1, 10).unwrap();
                assert!(w.remove(&index, &a));
                w.insert(&index, &b, 2, 20).unwrap();
            })
        };
        let index = table.index();
        for (key, want) in [(&a, (1, 10)), (&b, (2, 20))] {
            match index.lookup(key) {
                Lookup::Found { entry, generation } => {
                    assert_eq!((entry, generation), want, "a torn slot: {key:?}")
                }
                Lookup::Absent | Lookup::Busy => {}
            }
        }
        writer.join().unwrap();
        assert_eq!(
            table.index().lookup(&b),
            Lookup::Found {
                entry: 2,
                generation: 20
            }
        );
        assert_eq!(table.index().lookup(&a), Lookup::Absent);
    });
}

#[test]
fn key_index_chain_survives_removal_reuse_and_rebuild() {
    // A and B share home slot 1: A sits there, B in slot 2. While a reader looks B up,
    // the writer removes A (leaving a tombstone in B's chain), puts C (same home) into
    // it, then rebuilds the table. B is present throughout: the reader must find it
    // (or give up as Busy), never answer Absent.
    let ks = keys_at(1, 4, 3);
    model(2, move || {
        let table = Table::new(4);
        let (a, b, c) = (ks[0].clone(), ks[1].clone(), ks[2].clone());
        let mut w = IndexWriter::new();
        w.insert(&table.index(), &a, 1, 1).unwrap();
        w.insert(&table.index(), &b, 2, 2).unwrap();
        let writer = {
            let (table, b) = (table.clone(), b.clone());
            thread::spawn(move || {
                let index = table.index();
                assert!(w.remove(&index, &a));
                w.insert(&index, &c, 3, 3).unwrap();
                w.rebuild(&index, [(&b, 2, 2), (&c, 3, 3)]).unwrap();
            })
        };
        let found = table.index().lookup(&b);
        assert!(
            matches!(
                found,
                Lookup::Found {
                    entry: 2,
                    generation: 2
                } | Lookup::Busy
            ),
            "B was lost: {found:?}"
        );
        writer.join().unwrap();
    });
}

/// The object store's published state (`storage::Published` under `shmq_protocol::seqlock`): a
/// reader never sees the fields of two updates mixed, and a reader that reads an object's
/// bytes and then finds the object still published (the store's `still_valid`) read the
/// object's own bytes, never what the writer put there after it gave the object up.
///
/// Model: object 0 is live (`id_start, id_end = 0, 1`) and its byte is 100. The writer
/// frees it (publishes `1, 1`), reuses its memory (byte 200, Relaxed, as the store's
/// payload writes are plain) and publishes the new object (`1, 2`); each update also
/// stores its number, so that a snapshot mixing two updates is seen. A reader takes a
/// snapshot, reads the byte if object 0 is live, then checks again as `still_valid` does.
/// Without the opening Release fence or the closing Release store of `seqlock::write`,
/// or the Acquire load or the Acquire fence of `seqlock::read`, loom finds a failing
/// execution (the closing Release fence is not needed here, see `shmq_protocol::seqlock`).
#[test]
fn store_seqlock_never_tears_and_never_vouches_for_reused_bytes() {
    use shmq_protocol::seqlock;

    struct Published {
        seq: seqlock::SeqWord,
        id_start: AtomicU32,
        id_end: AtomicU32,
        /// Which update stored the fields (0: the initial state).
        update: AtomicU32,
        /// The object's first payload byte (the ring's memory, outside the seqlock).
        byte: AtomicU32,
    }
    /// `(id_start, id_end)` after each update.
    const STATES: [(u32, u32); 3] = [(0, 1), (1, 1), (1, 2)];
    fn publish(p: &Published, update: u32) {
        let (start, end) = STATES[update as usize];
        seqlock::write(&p.seq, || {
            p.id_start.store(start, Ordering::Relaxed);
            p.update.store(update, Ordering::Relaxed);
            p.id_end.store(end, Ordering::Relaxed);
        });
    }
    /// A consistent `(id_start, id_end)`, retried a few times (see `eventually`).
    fn snapshot(p: &Published) -> Option<(u32, u32)> {
        let read = || {
            seqlock::read(&p.seq, || {
                (
                    p.id_start.load(Ordering::Relaxed),
                    p.update.load(Ordering::Relaxed),
                    p.id_end.load(Ordering::Relaxed),
                )
            })
        };
        let mut got = None;
        eventually(|| {
            got = read();
            got.is_some()
        });
        let (start, update, end) = got?;
        assert_eq!(
            (start, end),
            STATES[update as usize],
            "torn snapshot: fields of two updates"
        );
        Some((start, end))
    }
    fn live((start, end): (u32, u32), id: u32) -> bool {
        start <= id && id < end
    }

    model(3, || {
        let p = Arc::new(Published {
            seq: seqlock::SeqWord::new(),
            id_start: AtomicU32::new(0),
            id_end: AtomicU32::new(1),
            update: AtomicU32::new(0),
            byte: AtomicU32::new(100),
        });
        let reader = {
            let p = p.clone();
            thread::spawn(move || {
                let Some(first) = snapshot(&p) else { return };
                if !live(first, 0) {
                    return;
                }
                let byte = p.byte.load(Ordering::Relaxed);
                // `still_valid`: an Acquire fence, then the published state again.
                seqlock::before_recheck();
                if let Some(again) = snapshot(&p) {
                    if live(again, 0) {
                        assert_eq!(byte, 100, "a reused object's bytes passed as object 0's");
                    }
                }
            })
        };
        publish(&p, 1);
        p.byte.store(200, Ordering::Relaxed);
        publish(&p, 2);
        reader.join().unwrap();
    });
}

/// `futex_waitv` as the kernel provides it: the check of every word and going to sleep
/// are atomic with respect to wakes on any of them (one lock stands in for the kernel's
/// hash-bucket locks). No timeouts: a lost wake-up is a deadlock loom reports.
struct ModelFutexMany {
    wakes: Mutex<u64>,
    cv: Condvar,
}

impl shmq_protocol::multiwait::FutexMany for &ModelFutexMany {
    fn wait_any(
        &self,
        words: &[(&AtomicU32, u32)],
        _timeout: Option<Duration>,
    ) -> Result<(), shmq_protocol::multiwait::Unsupported> {
        let mut wakes = self.wakes.lock().unwrap();
        if words.iter().any(|(w, e)| w.load(Ordering::SeqCst) != *e) {
            return Ok(());
        }
        let seen = *wakes;
        while *wakes == seen {
            wakes = self.cv.wait(wakes).unwrap();
        }
        Ok(())
    }
    fn wake_all(&self, _word: &AtomicU32) {
        *self.wakes.lock().unwrap() += 1;
        self.cv.notify_all();
    }
}

/// One sleeper on two doorbells (`shmq_protocol::multiwait`): a publisher rings the
/// second while the sleeper counts itself on both and checks; no wake-up is lost.
#[test]
fn multiwait_loses_no_wake_up() {
    use shmq_protocol::multiwait::{sleep_any, WakeWord};
    model(3, || {
        let bells = Arc::new([DoorbellWords::default(), DoorbellWords::default()]);
        let data = Arc::new(AtomicU8::new(0));
        let futex = Arc::new(ModelFutexMany {
            wakes: Mutex::new(0),
            cv: Condvar::new(),
        });
        let publisher = {
            let (bells, data, futex) = (bells.clone(), data.clone(), futex.clone());
            thread::spawn(move || {
                // What the writer of the second queue does on commit: publish, then ring.
                data.store(1, Ordering::Release);
                bells[1].with(ModelBell(&futex)).ring();
            })
        };
        let wake = WakeWord::default();
        let refs = [&bells[0], &bells[1]];
        loop {
            let seen = wake.current();
            let ready = sleep_any(
                &&*futex,
                &refs,
                &wake,
                seen,
                || data.load(Ordering::Acquire) == 1,
                None,
            )
            .unwrap();
            if ready {
                break;
            }
        }
        publisher.join().unwrap();
    });
}

/// A doorbell's futex over the multi-wait model (a publisher's wake reaches a sleeper
/// that sleeps on several words).
struct ModelBell<'a>(&'a ModelFutexMany);

impl Futex for ModelBell<'_> {
    fn wait(&self, word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
        use shmq_protocol::multiwait::FutexMany;
        let _ = (&self.0).wait_any(&[(word, expected)], timeout);
    }
    fn wake_all(&self, word: &AtomicU32) {
        use shmq_protocol::multiwait::FutexMany;
        (&self.0).wake_all(word)
    }
}

/// The encoder cache's consumer slots (`shmq_protocol::consumer_slot`), joining: two
/// consumers race for one free slot while the producer publishes an entry (its clock
/// tick) and then reads the slot, as `fully_loaded` does. Exactly one consumer gets the
/// slot; a reader of the slot never sees a pid paired with the other consumer's start
/// time or another join's clock value (what the joiner publishes is visible, whole, to
/// whoever sees it JOINED); and a producer whose tick came after the join's never reads
/// the slot as FREE (it would not wait for a consumer that joined before its entry).
#[test]
fn consumer_slot_join_is_exclusive_whole_and_ordered_by_the_clock() {
    use shmq_protocol::consumer_slot::{self as slot, ConsumerSlot, JoinClock, FREE, JOINED};

    /// Join as consumer `pid` (start time `10 * pid`) if the slot is free: the joined
    /// word and `joined_at`.
    fn try_join(s: &ConsumerSlot, clock: &JoinClock, pid: u32) -> Option<(u64, u64)> {
        let free = slot::free_word(s)?;
        let claimed = slot::claim(s, free)?;
        let word = slot::join(s, claimed, pid, 10 * u64::from(pid), clock);
        Some((word, s.joined_at_now()))
    }

    model(2, || {
        let s = Arc::new(ConsumerSlot::new());
        let clock = Arc::new(JoinClock::new(0));
        let joiners: Vec<_> = [1, 2]
            .into_iter()
            .map(|pid| {
                let (s, clock) = (s.clone(), clock.clone());
                thread::spawn(move || try_join(&s, &clock, pid).map(|j| (pid, j)))
            })
            .collect();
        // The producer: publish an entry (its clock tick), then read the slot.
        let published_at = slot::tick(&clock);
        let seen = slot::snapshot(&s, 3);
        let joined: Vec<(u32, (u64, u64))> = joiners
            .into_iter()
            .filter_map(|j| j.join().unwrap())
            .collect();
        assert_eq!(joined.len(), 1, "two consumers in one slot: {joined:?}");
        let (pid, (word, joined_at)) = joined[0];
        let Some(seen) = seen else { return };
        match seen.state() {
            JOINED => assert_eq!(
                (seen.word, seen.pid, seen.start_time, seen.joined_at),
                (word, pid, 10 * u64::from(pid), joined_at),
                "a torn or stale consumer slot"
            ),
            FREE => assert!(
                published_at < joined_at,
                "the producer's tick {published_at} came after the join's {joined_at}, \
                 yet it read the slot as free"
            ),
            _ => {}
        }
    });
}

/// The encoder cache's consumer slots, reclaiming: consumer 1 joined and died holding a
/// pin; two reclaimers (the producer, and a joiner that found no free slot) judge the
/// slot from their own snapshots and reclaim it, while consumer 2 waits to take it.
/// The slot is reclaimed at most once (one pin zeroing), never from consumer 2 (a
/// snapshot that shows consumer 2 is not judged dead, and a reclaim based on consumer
/// 1's word fails once the word moved on); no snapshot pairs one consumer's pid with the
/// other's start time; and consumer 2 finds the pin zeroed when it gets the slot (the
/// reclaimer's zeroing is published by the FREE it stores).
#[test]
fn consumer_slot_of_a_dead_consumer_is_reclaimed_once_and_handed_over_clean() {
    use shmq_protocol::consumer_slot::{self as slot, ConsumerSlot, JoinClock, JOINED};

    model(2, || {
        let s = Arc::new(ConsumerSlot::new());
        let clock = Arc::new(JoinClock::new(0));
        // Consumer 1's pin count on an entry, and how many times a reclaim zeroed it.
        let pin = Arc::new(AtomicU32::new(0));
        let zeroings = Arc::new(AtomicU32::new(0));
        let claimed = slot::claim(&s, slot::free_word(&s).unwrap()).unwrap();
        slot::join(&s, claimed, 1, 10, &clock);
        pin.store(1, Ordering::Relaxed);

        let reclaimers: Vec<_> = (0..2)
            .map(|_| {
                let (s, pin, zeroings) = (s.clone(), pin.clone(), zeroings.clone());
                thread::spawn(move || {
                    let Some(snap) = slot::snapshot(&s, 2) else {
                        return false;
                    };
                    if snap.state() == JOINED {
                        let holder = (snap.pid, snap.start_time);
                        assert!(
                            holder == (1, 10) || holder == (2, 20),
                            "torn slot: pid {} with start time {}",
                            snap.pid,
                            snap.start_time
                        );
                    }
                    // Judged dead: consumer 1 only (its liveness lock is free).
                    if snap.state() != JOINED || snap.pid != 1 {
                        return false;
                    }
                    slot::reclaim(&s, snap.word, || {
                        pin.store(0, Ordering::Relaxed);
                        zeroings.fetch_add(1, Ordering::Relaxed);
                    })
                })
            })
            .collect();
        // Consumer 2: take the slot if it is free. One attempt, in a thread of its own: a
        // retry after a yield would hide a stale pin from loom (it does not return, after
        // a yield, values the thread saw before it).
        let consumer = {
            let (s, pin, clock) = (s.clone(), pin.clone(), clock.clone());
            thread::spawn(move || {
                let claimed = slot::claim(&s, slot::free_word(&s)?)?;
                // The pin count it inherits: Relaxed, as the consumer's own pin updates are.
                assert_eq!(
                    pin.load(Ordering::Relaxed),
                    0,
                    "a dead consumer's pin survived"
                );
                Some(slot::join(&s, claimed, 2, 20, &clock))
            })
        };
        let mine = consumer.join().unwrap();
        let wins = reclaimers
            .into_iter()
            .map(|r| r.join().unwrap())
            .filter(|&won| won)
            .count();
        assert!(wins <= 1, "reclaimed {wins} times");
        assert_eq!(zeroings.load(Ordering::Relaxed) as usize, wins);
        if let Some(word) = mine {
            assert_eq!(wins, 1, "consumer 2 took a slot nobody freed");
            assert!(slot::holds(&s, word), "consumer 2's slot was reclaimed");
            assert!(slot::leave(&s, word));
        }
    });
}

/// The tensor arena's leases (`shmq_protocol::lease`), a copied part: the writer fills a
/// lease, adds a hold for each of two readers, drops its own hold and publishes the
/// message (the ring's Release, modelled by one flag). Reader 0 reads the bytes and
/// drops its hold; reader 1 has died (proved dead: the writer drops its holds). The
/// writer reuses the range once the lease is unused. The bytes are a loom cell: a reuse
/// while reader 0 still reads is a race loom reports; reader 0 also sees the whole part
/// of its own generation.
#[test]
fn arena_lease_is_not_reused_under_a_live_readers_hold() {
    use loom::sync::atomic::AtomicU32;
    use shmq_protocol::lease::{Hold, Lease, LeaseRecord};

    struct Arena {
        record: LeaseRecord,
        holds: [Hold; 2],
        message: AtomicU32,
        bytes: UnsafeCell<(u32, u32)>,
    }
    impl Arena {
        fn lease(&self) -> Lease<'_> {
            Lease {
                record: &self.record,
                holds: &self.holds,
            }
        }
    }

    model(3, || {
        let a = Arc::new(Arena {
            record: LeaseRecord::new(),
            holds: std::array::from_fn(|_| Hold::new()),
            message: AtomicU32::new(0),
            bytes: UnsafeCell::new((0, 0)),
        });
        let reader = {
            let a = a.clone();
            thread::spawn(move || {
                let mut generation = 0;
                // Acquire: the ring's Acquire on the chunk that carries the reference.
                if !eventually(|| {
                    generation = a.message.load(Ordering::Acquire);
                    generation != 0
                }) {
                    return;
                }
                let lease = a.lease();
                assert_eq!(lease.read(), (generation, 0, 4096), "a stale lease record");
                // SAFETY: loom's cell; loom fails the model on a concurrent write.
                let got = a.bytes.with(|p| unsafe { *p });
                assert_eq!(got, (1, 1), "a half-written or reused part");
                lease.release(0);
            })
        };
        let lease = a.lease();
        let generation = lease.take(0, 4096);
        // SAFETY: loom's cell, as above.
        a.bytes.with_mut(|p| unsafe { *p = (1, 0) });
        // SAFETY: as above.
        a.bytes.with_mut(|p| unsafe { (*p).1 = 1 });
        lease.add_holds(0..2);
        lease.drop_writer_hold();
        a.message.store(generation, Ordering::Release);
        // Reader 1 is proved dead: `reclaim_dead` drops its holds.
        assert!(lease.is_held_by(1));
        lease.drop_holds_of(1);
        if eventually(|| lease.is_unused()) {
            lease.retire();
            lease.take(4096, 4096);
            // SAFETY: as above: a race with reader 0's read is what the model checks.
            a.bytes.with_mut(|p| unsafe { *p = (2, 2) });
        }
        reader.join().unwrap();
    });
}

/// The tensor arena's leases, a loan: its owner (another thread of the writer's
/// process) fills the lease in place, sends it (one hold for the reader; the loan keeps
/// the writer's hold) and later drops the loan (the writer's hold goes, Release). The
/// writer, in its own thread, reuses the range only once both holds are gone: it never
/// writes over the loan's writes nor under the reader's read (loom's cell checks), and,
/// loading the writer's hold first, it sees the reader's hold that the loan's thread
/// added before dropping it.
#[test]
fn arena_loan_is_not_reused_before_it_is_dropped_and_read() {
    use loom::sync::atomic::AtomicU32;
    use shmq_protocol::lease::{Hold, Lease, LeaseRecord};

    struct Arena {
        record: LeaseRecord,
        holds: [Hold; 1],
        message: AtomicU32,
        bytes: UnsafeCell<u32>,
    }
    impl Arena {
        fn lease(&self) -> Lease<'_> {
            Lease {
                record: &self.record,
                holds: &self.holds,
            }
        }
    }

    model(3, || {
        let a = Arc::new(Arena {
            record: LeaseRecord::new(),
            holds: [Hold::new()],
            message: AtomicU32::new(0),
            bytes: UnsafeCell::new(0),
        });
        // The writer lends the lease; the loan goes to another thread.
        let generation = a.lease().take(0, 4096);
        let loan = {
            let a = a.clone();
            thread::spawn(move || {
                // SAFETY: loom's cell; loom fails the model on a concurrent access.
                a.bytes.with_mut(|p| unsafe { *p = 1 });
                a.lease().add_holds(0..1);
                a.message.store(generation, Ordering::Release);
                a.lease().drop_writer_hold();
            })
        };
        let reader = {
            let a = a.clone();
            thread::spawn(move || {
                if !eventually(|| a.message.load(Ordering::Acquire) != 0) {
                    return;
                }
                // SAFETY: as above.
                assert_eq!(a.bytes.with(|p| unsafe { *p }), 1);
                a.lease().release(0);
            })
        };
        let lease = a.lease();
        if eventually(|| lease.is_unused()) {
            lease.retire();
            lease.take(0, 4096);
            // SAFETY: as above: a race with the loan's write or the reader's read is
            // what the model checks.
            a.bytes.with_mut(|p| unsafe { *p = 2 });
        }
        loan.join().unwrap();
        reader.join().unwrap();
    });
}

/// The encoder cache's consumer slots, leaving: consumer 1 drops its last pin (Relaxed
/// here, so that what is checked is the leave's ordering, not the unpin's own Release)
/// and leaves; consumer 2 takes the slot it left. Consumer 2 finds the pin count zero (the leave's Release, paired with
/// the claim's Acquire, carries the unpin), and consumer 1, once left, no longer holds
/// the slot.
#[test]
fn consumer_slot_left_is_handed_over_with_the_leavers_unpins() {
    use shmq_protocol::consumer_slot::{self as slot, ConsumerSlot, JoinClock};

    model(2, || {
        let s = Arc::new(ConsumerSlot::new());
        let clock = Arc::new(JoinClock::new(0));
        let pin = Arc::new(AtomicU32::new(1));
        let claimed = slot::claim(&s, slot::free_word(&s).unwrap()).unwrap();
        let word = slot::join(&s, claimed, 1, 10, &clock);
        let leaver = {
            let (s, pin) = (s.clone(), pin.clone());
            thread::spawn(move || {
                pin.fetch_sub(1, Ordering::Relaxed);
                assert!(slot::leave(&s, word));
                assert!(!slot::holds(&s, word));
            })
        };
        // One attempt, no yield (see the reclaim model).
        if let Some(claimed) = slot::free_word(&s).and_then(|free| slot::claim(&s, free)) {
            assert_eq!(
                pin.load(Ordering::Relaxed),
                0,
                "the leaver's unpin was lost"
            );
            slot::join(&s, claimed, 2, 20, &clock);
        }
        leaver.join().unwrap();
    });
}

/// The multi-wait's wake word (`shmq_protocol::multiwait::WakeWord`): a sleeper that read
/// the word, then found nothing to wait for yet, is woken by another thread that adds
/// something and bumps the word, wherever the bump falls in its sleep.
#[test]
fn multiwait_wake_word_loses_no_wake_up() {
    use shmq_protocol::doorbell::DoorbellWords;
    use shmq_protocol::multiwait::{sleep_any, WakeWord};
    model(3, || {
        let wake = Arc::new(WakeWord::default());
        let added = Arc::new(AtomicU8::new(0));
        let futex = Arc::new(ModelFutexMany {
            wakes: Mutex::new(0),
            cv: Condvar::new(),
        });
        let registrar = {
            let (wake, added, futex) = (wake.clone(), added.clone(), futex.clone());
            thread::spawn(move || {
                // What a coroutine that starts waiting does: add its queue, then wake.
                added.store(1, Ordering::Relaxed);
                wake.wake(&&*futex);
            })
        };
        let bell = DoorbellWords::default();
        loop {
            // The waiter: the word first, then what to wait for (see `WakeWord::current`).
            let seen = wake.current();
            if added.load(Ordering::Relaxed) == 1 {
                break;
            }
            sleep_any(&&*futex, &[&bell], &wake, seen, || false, None).unwrap();
        }
        registrar.join().unwrap();
    });
}

/// The object store's read counts (`shmq_protocol::read_count::ReadCount`): two readers
/// count their reads of one object at once and neither count is lost; the writer, once it
/// sees both, overwrites the payload, never under a reader's read (loom's cell checks:
/// the counts' Release pairs with the writer's Acquire).
#[test]
fn store_read_count_is_never_lost_and_orders_the_reads_before_reuse() {
    use shmq_protocol::read_count::ReadCount;

    model(2, || {
        let count = Arc::new(ReadCount::new(7));
        let payload = Arc::new(UnsafeCell::new(1u32));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (count, payload) = (count.clone(), payload.clone());
                thread::spawn(move || {
                    // SAFETY: loom's cell; loom fails the model on a concurrent write.
                    let got = payload.with(|p| unsafe { *p });
                    assert_eq!(got, 1, "the payload was reused under a read");
                    assert!(count.count_one(7));
                })
            })
            .collect();
        if eventually(|| count.reads() == 2) {
            // SAFETY: as above: a race with a reader's read is what the model checks.
            payload.with_mut(|p| unsafe { *p = 2 });
        }
        for r in readers {
            r.join().unwrap();
        }
        assert_eq!(count.reads(), 2, "a read count was lost");
    });
}

/// The object store's counting window (`shmq_protocol::read_count::CountingWindow`): a
/// reader checks that its object is live and counts its read inside the window; the
/// writer frees the object, waits for the window, then reuses the block, writing a word
/// that looks exactly like the old object's fresh count (its tag, count 0: the worst
/// payload). The reader's late increment never lands in it: either its check sees the
/// object freed, or the writer waits for it.
#[test]
fn store_counting_window_keeps_a_late_count_out_of_reused_memory() {
    use shmq_protocol::read_count::{CountingWindow, ReadCount};

    model(3, || {
        let window = Arc::new(CountingWindow::new());
        let count = Arc::new(ReadCount::new(7));
        let live = Arc::new(AtomicU32::new(1));
        let reader = {
            let (window, count, live) = (window.clone(), count.clone(), live.clone());
            thread::spawn(move || {
                window.count(|| {
                    // Relaxed: the store's validity check (a seqlock read in shmq); the
                    // window's fences order it.
                    if live.load(Ordering::Relaxed) == 1 {
                        count.count_one(7);
                    }
                })
            })
        };
        // The writer frees the object (publishes it gone: Relaxed here, the window's
        // SeqCst fence is what the model checks).
        live.store(0, Ordering::Relaxed);
        let mut attempts = 0;
        let mut quiet = false;
        window.wait(|announced| {
            attempts += 1;
            quiet = announced == 0;
            if !quiet {
                thread::yield_now();
            }
            quiet || attempts > 3
        });
        if quiet {
            count.reset(7); // the block reused: the worst payload
        }
        reader.join().unwrap();
        if quiet {
            assert_eq!(count.reads(), 0, "a late count landed in reused memory");
        }
    });
}

/// The object store's pin hint (`shmq_protocol::read_count::PinHint`): a reader that
/// holds, pins and confirms its object reads it; the writer, after marking the block no
/// longer the object's, reuses it only when no view may be held. The writer never writes
/// under the view (loom's cell checks), whoever goes first.
#[test]
fn store_pin_hint_keeps_a_viewed_block_from_reuse() {
    use shmq_protocol::read_count::PinHint;

    model(3, || {
        let hint = Arc::new(PinHint::new());
        let live = Arc::new(AtomicU32::new(1));
        let payload = Arc::new(UnsafeCell::new(1u32));
        let reader = {
            let (hint, live, payload) = (hint.clone(), live.clone(), payload.clone());
            thread::spawn(move || {
                hint.hold();
                // (shmq takes the pin's file lock here: what the writer probes for when
                // the hint is not 0; the model's writer keeps the block instead.)
                // Relaxed: the check the confirm's fence orders.
                if hint.confirm(|| live.load(Ordering::Relaxed) == 1) {
                    // SAFETY: loom's cell; loom fails the model on a concurrent write.
                    let got = payload.with(|p| unsafe { *p });
                    assert_eq!(got, 1, "the block was reused under a view");
                    hint.release();
                } else {
                    hint.release_unused();
                }
            })
        };
        live.store(0, Ordering::Relaxed); // the writer's mark (its header stamp)
        if eventually(|| !hint.may_be_held()) {
            // SAFETY: as above: a race with the reader's view is what the model checks.
            payload.with_mut(|p| unsafe { *p = 2 });
        }
        reader.join().unwrap();
    });
}

/// The encoder cache's entry pins (`shmq_protocol::entry`): the producer publishes an
/// entry, then evicts it (RETIRED, then the pins) and reuses its bytes once unpinned; a
/// consumer pins it and reads the bytes only if the pin holds. The producer never writes
/// under the consumer's read, and the consumer never reads bytes not yet published or
/// already reused (loom's cell checks and the asserts).
#[test]
fn encoder_cache_entry_is_not_reused_while_pinned() {
    use shmq_protocol::entry::{EntryPin, EntryState};

    model(3, || {
        let state = Arc::new(EntryState::new());
        let pin = Arc::new(EntryPin::new());
        let bytes = Arc::new(UnsafeCell::new(0u32));
        let consumer = {
            let (state, pin, bytes) = (state.clone(), pin.clone(), bytes.clone());
            thread::spawn(move || {
                if pin.pin(&state, 0) {
                    // SAFETY: loom's cell; loom fails the model on a concurrent write.
                    let got = bytes.with(|p| unsafe { *p });
                    assert_eq!(got, 1, "read an entry not yet published, or reused");
                }
                pin.unpin();
            })
        };
        // SAFETY: as above.
        bytes.with_mut(|p| unsafe { *p = 1 });
        state.publish(0);
        state.retire(0);
        if eventually(|| pin.is_unpinned()) {
            state.free(1);
            // SAFETY: as above: a race with the consumer's read is what the model checks.
            bytes.with_mut(|p| unsafe { *p = 2 });
        }
        consumer.join().unwrap();
    });
}

/// The encoder cache's acknowledgements (`shmq_protocol::entry::EntryAcks`): two
/// consumers ack one entry at once; neither ack is lost, and a producer that sees a
/// consumer's ack sees what that consumer did before it (its load, a loom cell here).
#[test]
fn encoder_cache_acks_are_never_lost_and_order_the_load() {
    use shmq_protocol::entry::EntryAcks;

    model(3, || {
        let acks = Arc::new(EntryAcks::new());
        let loads: Arc<[UnsafeCell<u32>; 2]> =
            Arc::new(std::array::from_fn(|_| UnsafeCell::new(0)));
        let consumers: Vec<_> = (0..2)
            .map(|slot| {
                let (acks, loads) = (acks.clone(), loads.clone());
                thread::spawn(move || {
                    // SAFETY: loom's cell; loom fails the model on a concurrent read.
                    loads[slot].with_mut(|p| unsafe { *p = 1 });
                    acks.ack(slot);
                })
            })
            .collect();
        let mut seen = 0;
        eventually(|| {
            seen = acks.loaded();
            seen == 0b11
        });
        for slot in 0..2 {
            if seen & (1 << slot) != 0 {
                // SAFETY: as above: a race with the consumer's write is what the model
                // checks.
                let load = loads[slot].with(|p| unsafe { *p });
                assert_eq!(load, 1, "an ack seen before the load it acknowledges");
            }
        }
        for c in consumers {
            c.join().unwrap();
        }
        assert_eq!(acks.loaded(), 0b11, "an ack was lost");
    });
}

/// The object store's LEFT reader slots (`shmq_protocol::ring::slot_leave`): a reader
/// that closes the store says LEFT, then lets its role lock go; the writer judges the
/// slot (its word, the lock, the word again). A reader that left is never judged dead
/// (nor dropped), and once left, the slot is taken again by the next reader, with a new
/// generation.
#[test]
fn store_reader_that_left_is_never_judged_dead() {
    use shmq_protocol::ring::{
        slot_attached_word, slot_begin_attach_reusing_dropped, slot_drop, slot_end_attach,
        slot_hint, slot_leave, slot_read, slot_recheck, slot_state, SlotWord, SLOT_ATTACHED,
        SLOT_LEFT,
    };

    model(3, || {
        let word = Arc::new(SlotWord::new());
        // The role lock, as the kernel keeps it: 1 while held; its release is ordered
        // after what the holder did before (Release), and a probe that finds it free sees
        // that (Acquire).
        let lock = Arc::new(AtomicU32::new(1));
        let generation = slot_begin_attach_reusing_dropped(&word);
        slot_end_attach(&word, generation);
        let attached = slot_attached_word(generation);
        let reader = {
            let (word, lock) = (word.clone(), lock.clone());
            thread::spawn(move || {
                assert!(slot_leave(&word, attached));
                lock.store(0, Ordering::Release);
            })
        };
        // The writer's `judge_slot`.
        if let Some((seen, ())) = slot_read(&word, || ()) {
            if slot_state(seen) == SLOT_ATTACHED {
                let lock_free = lock.load(Ordering::Acquire) == 0;
                let again = slot_recheck(&word);
                let dead = again == seen && lock_free;
                assert!(!dead, "a reader that left was judged dead");
                if dead {
                    slot_drop(&word, seen);
                }
            }
        }
        reader.join().unwrap();
        assert_eq!(slot_state(slot_hint(&word)), SLOT_LEFT);
        let next = slot_begin_attach_reusing_dropped(&word);
        assert_eq!(next, generation + 1, "a left slot is taken again");
    });
}
