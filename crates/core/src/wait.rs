//! Waiting for the other side of a ring: the one place that decides how a blocked
//! writer or reader spends its time.
//!
//! A wait polls a condition in three phases:
//! 1. **spin** for a short window (default 50 µs when every process of the ring has a
//!    core, else none; [`SPIN_US_ENV`]): a message usually arrives within microseconds
//!    while a serving engine is busy;
//! 2. **yield** the CPU between polls for a while longer (default 50 µs, [`YIELD_US_ENV`];
//!    up to 1 ms for a waiter whose peer usually answers that fast, [`WaitHistory`]);
//! 3. **sleep** on the ring's doorbell (`shmq_protocol::doorbell`) (a futex in the
//!    shared segment) until the other side rings it: an idle waiter costs no CPU.
//!
//! On a full machine it skips the first two: when the machine's runnable tasks outnumber
//! its cores (other work beside the ring: a build, a second engine), a waiter that spins
//! or yields takes a core its peer, or the work the peer waits on, is queued for; so a
//! blocked wait asks at each clock read of those two phases (the first after 64 polls)
//! and once the machine is full goes straight to the doorbell ([`MachineLoad`], read
//! about every 5 ms; [`LOAD_CHECK_ENV`] turns it off). A waiter without a doorbell still
//! yields.
//!
//! While it waits it also checks, each at its own pace: the deadline and the cancel flag
//! (every poll), the caller's hook (every few ms; the Python bindings check signals and
//! cancel events there), whether the peer it waits for is still alive (about once a
//! second) and the "still waiting" warning ([`WARNING_INTERVAL_ENV`]).

use shmq_protocol::sync::local::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use shmq_protocol::doorbell::DoorbellWords;

/// Environment variable: seconds between "still waiting" warnings (default 60).
pub const WARNING_INTERVAL_ENV: &str = "SHMQ_RINGBUFFER_WARNING_INTERVAL";
/// vLLM's name for [`WARNING_INTERVAL_ENV`], used when shmq's is unset.
pub const VLLM_WARNING_INTERVAL_ENV: &str = "VLLM_RINGBUFFER_WARNING_INTERVAL";
/// Environment variable: microseconds a waiter spins before it starts yielding.
pub const SPIN_US_ENV: &str = "SHMQ_SPIN_US";
/// Environment variable: microseconds a waiter yields before it goes to sleep.
pub const YIELD_US_ENV: &str = "SHMQ_YIELD_US";
/// Environment variable: microseconds the yield phase may grow to for a waiter whose
/// recent waits were short (see [`WaitHistory`]).
pub const YIELD_MAX_US_ENV: &str = "SHMQ_YIELD_MAX_US";
/// The default of [`YIELD_MAX_US_ENV`] when every process of the ring has a core.
pub const DEFAULT_YIELD_MAX: Duration = Duration::from_millis(1);
/// Environment variable: `0` turns the check of the machine's load off ([`MachineLoad`]):
/// a blocked waiter then spins and yields as its policy says however busy the machine is
/// (shmq's behaviour before the check). Read once per process; any other value, or none,
/// leaves the check on.
pub const LOAD_CHECK_ENV: &str = "SHMQ_LOAD_CHECK";

/// How often the caller's hook runs while yielding, and at most how long one sleep lasts
/// when there is a hook (so a Python cancel event is seen within this time).
const HOOK_INTERVAL: Duration = Duration::from_millis(2);
const SLEEP_SLICE_WITH_HOOK: Duration = Duration::from_millis(10);
/// How often a waiter checks that its peer is alive.
const LIVENESS_INTERVAL: Duration = Duration::from_millis(500);
/// The longest sleep slice with a hook, once a waiter has slept a while.
const SLEEP_SLICE_WITH_HOOK_MAX: Duration = Duration::from_millis(250);

/// How long one sleep with a hook lasts after `asleep` of sleeping in this wait: 10 ms at
/// first (a cancel event set or a signal handled on another thread is seen that soon
/// while messages are flowing), then a tenth of the time already asleep, up to 250 ms. A
/// waiter idle for seconds then wakes 4–6 times a second (the liveness step included),
/// not 100: its CPU in the steady idle was a 100-per-second wake-up and a Python call
/// each time. A signal delivered to the sleeping thread itself (CPython's main thread,
/// where a process-directed signal such as Ctrl-C goes) ends the sleep at once (EINTR)
/// whatever the slice; a cancel event is seen within a tenth of the idle time, at most
/// 250 ms.
fn hook_slice(asleep: Duration) -> Duration {
    (asleep / 10).clamp(SLEEP_SLICE_WITH_HOOK, SLEEP_SLICE_WITH_HOOK_MAX)
}

/// The longest timeout kept as a deadline: 10⁹ s, about 31.7 years. A longer one, and an
/// infinite one, mean no timeout at all (see [`timeout_from_secs`]): a deadline that far
/// away is never reached, and one further still cannot be represented (an `Instant`
/// plus `Duration::MAX` panics).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);

/// The longest a waiter may spin, or yield, before it sleeps (`spin_us` / `yield_us` and
/// their environment variables): 10 s, [`MAX_PHASE_US`] microseconds.
pub const MAX_PHASE: Duration = Duration::from_secs(10);
/// [`MAX_PHASE`] in microseconds.
pub const MAX_PHASE_US: f64 = 10_000_000.0;

/// A timeout given in seconds (`name` is the argument's name, for the error): `None`, no
/// timeout, for `+inf` and for anything longer than [`MAX_TIMEOUT`];
/// `Error::InvalidArgument` for a negative number or NaN. Every timeout a caller gives
/// as a number goes through here, so that none can panic a `Duration` conversion or an
/// `Instant` addition.
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming `name` for a NaN or negative `secs`.
pub fn timeout_from_secs(name: &str, secs: f64) -> Result<Option<Duration>> {
    if secs.is_nan() || secs < 0.0 {
        return Err(Error::InvalidArgument(format!(
            "{name} must be a non-negative number of seconds, or None (or inf) for no \
             timeout, got {secs:?}"
        )));
    }
    if secs > MAX_TIMEOUT.as_secs_f64() {
        return Ok(None);
    }
    Ok(Some(Duration::from_secs_f64(secs)))
}

/// The instant `timeout` after `from`; `None` (no deadline) for one longer than
/// [`MAX_TIMEOUT`], which a caller's own `Duration` may be (up to `Duration::MAX`).
pub fn deadline_after(from: Instant, timeout: Duration) -> Option<Instant> {
    if timeout > MAX_TIMEOUT {
        return None;
    }
    from.checked_add(timeout)
}

/// The instant `d` after `from`, at most [`MAX_TIMEOUT`] later: for waits that need an
/// instant to stop at, however long they were given (a grace period of `Duration::MAX`).
pub fn saturating_deadline(from: Instant, d: Duration) -> Instant {
    let d = d.min(MAX_TIMEOUT);
    from.checked_add(d).unwrap_or(from)
}

/// The duration an environment variable gives in `unit`s per second (1: seconds, 10⁶:
/// microseconds), if it is a number from 0 to `max`; anything else is ignored (as an
/// unset variable), never a panic.
fn env_duration(name: &str, per_second: f64, max: Duration) -> Option<Duration> {
    let v: f64 = std::env::var(name).ok()?.trim().parse().ok()?;
    let secs = v / per_second;
    (secs >= 0.0 && secs <= max.as_secs_f64()).then(|| Duration::from_secs_f64(secs))
}

fn micros_env(name: &str) -> Option<Duration> {
    env_duration(name, 1e6, MAX_PHASE)
}

/// Seconds between warnings while a wait goes on, from [`WARNING_INTERVAL_ENV`] (or
/// [`VLLM_WARNING_INTERVAL_ENV`] when that is unset).
pub fn warning_interval() -> Duration {
    static V: OnceLock<Duration> = OnceLock::new();
    *V.get_or_init(|| {
        env_duration(WARNING_INTERVAL_ENV, 1.0, MAX_TIMEOUT)
            .or_else(|| env_duration(VLLM_WARNING_INTERVAL_ENV, 1.0, MAX_TIMEOUT))
            .unwrap_or(Duration::from_secs(60))
    })
}

/// How long a waiter spins, then yields, before it sleeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitPolicy {
    pub spin: Duration,
    pub yield_for: Duration,
    /// How long the yield phase may grow to for a waiter whose recent waits were short
    /// ([`WaitHistory`]); no growth when it is at most `yield_for`.
    pub yield_max: Duration,
}

impl WaitPolicy {
    /// The default for a ring that `processes` processes use (its writer and local
    /// readers): spin 50 µs if each can have a core, else not at all (spinners would take
    /// the cores the others need: measured in `docs/performance.md`, "Figures quoted
    /// elsewhere"),
    /// then yield for 50 µs, or up to 1 ms for a waiter whose recent waits were short
    /// when each process has a core ([`WaitHistory`]). [`SPIN_US_ENV`] /
    /// [`YIELD_US_ENV`] / [`YIELD_MAX_US_ENV`] override each.
    pub fn for_processes(processes: usize) -> WaitPolicy {
        // Computed once: `available_parallelism` reads cgroup files (its cost:
        // `docs/performance.md`, "Figures quoted elsewhere"), and every blocking call
        // starts from a policy.
        type Env = (Option<Duration>, Option<Duration>, Option<Duration>, usize);
        static ENV: OnceLock<Env> = OnceLock::new();
        let (spin, yield_for, yield_max, cores) = *ENV.get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (
                micros_env(SPIN_US_ENV),
                micros_env(YIELD_US_ENV),
                micros_env(YIELD_MAX_US_ENV),
                cores,
            )
        });
        let oversubscribed = processes > cores;
        let default_spin = if oversubscribed {
            Duration::ZERO
        } else {
            Duration::from_micros(50)
        };
        // An explicit yield time is kept as it is unless a maximum is given too.
        let default_max = if oversubscribed || yield_for.is_some() {
            None
        } else {
            Some(DEFAULT_YIELD_MAX)
        };
        let yield_for = yield_for.unwrap_or(Duration::from_micros(50));
        WaitPolicy {
            spin: spin.unwrap_or(default_spin),
            yield_for,
            yield_max: yield_max.or(default_max).unwrap_or(yield_for),
        }
    }

    /// The policy for `processes` processes ([`for_processes`](Self::for_processes)) with
    /// the spin and yield times given in microseconds, where given: a yield time given
    /// here is kept as given, never grown by the waiter's history. `InvalidArgument` for
    /// a time that is negative, NaN or longer than [`MAX_PHASE`] (infinite included).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the option for a spin or yield time that is
    /// negative, NaN, or over the longest phase.
    pub fn from_micros(
        processes: usize,
        spin_us: Option<f64>,
        yield_us: Option<f64>,
    ) -> Result<WaitPolicy> {
        let d = WaitPolicy::for_processes(processes);
        let us = |v: Option<f64>, default: Duration, name: &str| match v {
            None => Ok(default),
            Some(x) if (0.0..=MAX_PHASE_US).contains(&x) => Ok(Duration::from_secs_f64(x / 1e6)),
            Some(x) => Err(Error::InvalidArgument(format!(
                "{name} must be a non-negative number of microseconds, at most {MAX_PHASE_US} \
                 ({} s), got {x:?}",
                MAX_PHASE.as_secs()
            ))),
        };
        let yield_for = us(yield_us, d.yield_for, "yield_us")?;
        Ok(WaitPolicy {
            spin: us(spin_us, d.spin, "spin_us")?,
            yield_for,
            yield_max: if yield_us.is_some() {
                yield_for
            } else {
                d.yield_max
            },
        })
    }

    /// This policy with fixed phases: `spin`, then `yield_for`, never grown by history.
    pub fn fixed(spin: Duration, yield_for: Duration) -> WaitPolicy {
        WaitPolicy {
            spin,
            yield_for,
            yield_max: yield_for,
        }
    }
}

/// How old the last reading of the machine's load may be before a wait reads it again.
const LOAD_REFRESH_MS: u32 = 5;

/// Whether the machine is full: its runnable tasks (the running ones and those queued
/// for a core, machine-wide: the first number of `/proc/loadavg`'s "running/total")
/// outnumber its online cores in the last two readings. Then a waiter that spins or
/// yields only takes a core from a task that needs it (its peer, or whatever the peer
/// waits on: measured in `docs/performance.md`, "Waiting on a full machine"), and a wait
/// that blocks goes straight to the doorbell instead.
///
/// The count is the whole machine's (`/proc/loadavg` is not a container's own), so it is
/// compared with the machine's online cores, not with the fewer this process may be
/// allowed: in a container on a big, busy host the check then says "full" only when the
/// host is, never because of tasks on cores this process cannot use (it cannot see a
/// container whose own cores are full while the host has idle ones: those waits spin and
/// yield as before, and a ring with more processes than its cores never spins anyway,
/// [`WaitPolicy::for_processes`]). Two readings, about 5 ms apart, must both say full:
/// a single task woken for a moment on a quiet machine does not make its waits sleep.
///
/// What it costs a wait: nothing when the condition holds within its first 64 polls (it
/// asks first at its first clock read); else, at each clock read of its spin (every 64
/// polls) and yield phases, one atomic load and a little arithmetic on the clock it read
/// anyway, plus reading `/proc/loadavg` (open, read, close) by one wait of the process
/// about every 5 ms. Figures: `docs/performance.md`, "Waiting on a full machine".
#[derive(Debug)]
pub struct MachineLoad {
    /// The last two readings and when the last was taken, in one word so that a wait
    /// sees them together: bits 0..16 the newest reading (saturated), 16..32 the one
    /// before, 32..64 the time of the newest in milliseconds since [`load_base`] (plus
    /// one, wrapping; 0: never read).
    state: AtomicU64,
    /// The ring's processes awake when each of the two readings was taken (bits 0..16
    /// the newest's, 16..32 the one before; 0 for a wait of no ring's): see
    /// [`full_beyond`](Self::full_beyond).
    own: AtomicU64,
    /// Reads the number of runnable tasks (`None`: unknown, counted as 0).
    read: fn() -> Option<u32>,
    /// The number of cores the count is compared with.
    cores: fn() -> usize,
}

/// The process's [`MachineLoad`], reading `/proc/loadavg`; `None` when [`LOAD_CHECK_ENV`]
/// turns the check off.
pub fn machine_load() -> Option<&'static MachineLoad> {
    static MACHINE: MachineLoad = MachineLoad::new(runnable_tasks, online_cores);
    static ON: OnceLock<bool> = OnceLock::new();
    ON.get_or_init(|| std::env::var(LOAD_CHECK_ENV).map_or(true, |v| v.trim() != "0"))
        .then_some(&MACHINE)
}

/// The instant a [`MachineLoad`]'s times count from: the first wait that checked one.
fn load_base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// The machine's online cores (read once).
fn online_cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| {
        // SAFETY: sysconf takes a constant name and touches no memory of ours.
        let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        usize::try_from(n)
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    })
}

/// The machine's runnable tasks now: `/proc/loadavg`'s "running" (the waiter reading it
/// included). `None` where it cannot be read or parsed.
fn runnable_tasks() -> Option<u32> {
    use std::io::Read;
    let mut buf = [0u8; 128];
    let n = std::fs::File::open("/proc/loadavg")
        .ok()?
        .read(&mut buf)
        .ok()?;
    parse_runnable(&buf[..n])
}

/// The "running" of a `/proc/loadavg` text: "0.50 0.40 0.30 3/151 8919" is 3.
fn parse_runnable(text: &[u8]) -> Option<u32> {
    let field = text.split(|&b| b == b' ').nth(3)?;
    let running = field.split(|&b| b == b'/').next()?;
    std::str::from_utf8(running).ok()?.parse().ok()
}

impl MachineLoad {
    /// A gauge that counts runnable tasks with `read` and compares them with `cores()`.
    pub const fn new(read: fn() -> Option<u32>, cores: fn() -> usize) -> MachineLoad {
        MachineLoad {
            state: AtomicU64::new(0),
            own: AtomicU64::new(0),
            read,
            cores,
        }
    }

    /// Whether the machine is full at `now`: from the cached readings, read again first
    /// when the newest is 5 ms old (counted in whole milliseconds) or more.
    pub fn full(&self, now: Instant) -> bool {
        let state = self.refresh(now, || 0);
        self.says_full(state)
    }

    /// The state word at `now`, with a new reading where the newest is 5 ms old or more
    /// (taken with `own()`, the waiter's ring's processes awake then: see
    /// [`full_beyond`](Self::full_beyond)).
    fn refresh(&self, now: Instant, own: impl FnOnce() -> u32) -> u64 {
        // Wrapping on purpose (every 49.7 days): only ages under 5 ms matter, and a
        // wrapped one is wrong at most once, by one early or late reading.
        let ms = (now.saturating_duration_since(load_base()).as_millis() as u32)
            .wrapping_add(1)
            .max(1);
        // Relaxed, here and below: the word holds all there is (both readings and their
        // time), and publishes no other memory. A stale load makes one wait decide on a
        // reading a few milliseconds older, or read the file once more; a lost store
        // (two threads refreshing at once) loses one reading of the same moment.
        let state = self.state.load(Ordering::Relaxed);
        let stamp = (state >> 32) as u32;
        let newest = state & 0xffff;
        if stamp != 0 && ms.wrapping_sub(stamp) < LOAD_REFRESH_MS {
            return state;
        }
        // Claim the refresh, so that one thread reads the file, not all the waiting ones:
        // the others go on with the readings they have.
        let claimed = (u64::from(ms) << 32) | (state & 0xffff_ffff);
        if self
            .state
            .compare_exchange(state, claimed, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return state;
        }
        let own = u64::from(own().min(0xffff));
        let reading = (self.read)().map_or(0, |n| u64::from(n.min(0xffff)));
        // The own counts first: a wait that sees the new reading sees, at worst, the
        // own count of the same moment or of the reading before (Relaxed, like the
        // state: a heuristic, each word whole).
        let previous_own = self.own.load(Ordering::Relaxed) & 0xffff;
        self.own
            .store((previous_own << 16) | own, Ordering::Relaxed);
        let fresh = (u64::from(ms) << 32) | (newest << 16) | reading;
        self.state.store(fresh, Ordering::Relaxed);
        fresh
    }

    /// Whether both readings in `state` outnumber the cores.
    fn says_full(&self, state: u64) -> bool {
        let both = (state & 0xffff).min((state >> 16) & 0xffff);
        usize::try_from(both).is_ok_and(|n| n > (self.cores)())
    }

    /// Whether the machine is full ([`full`](Self::full)) with work *besides* `own` of
    /// its runnable tasks (a ring's processes that are awake, the waiter included): both
    /// readings also outnumber `own`. A machine full of the ring's own processes (four
    /// processes of one queue on two cores) is not: there a waiter that yields hands its
    /// core to a peer that will answer it, where a sleep costs both sides a futex call
    /// and a wake-up per message (measured in `docs/performance.md`, "Waiting on a full
    /// machine").
    ///
    /// Each reading is compared with the ring's processes awake *when it was taken*
    /// (`own()`, asked only then): they come and go thousands of times a second, so a
    /// count of now against a reading of up to 10 ms ago would take a sleeping peer for
    /// other work, or other work for a peer. (Several rings waited on in one process
    /// share the readings: each is compared with the count of the ring whose waiter took
    /// it.)
    pub fn full_beyond(&self, now: Instant, own: impl FnOnce() -> u32) -> bool {
        let state = self.refresh(now, own);
        if !self.says_full(state) {
            return false;
        }
        // Relaxed: see `refresh`.
        let own = self.own.load(Ordering::Relaxed);
        let beyond = |reading: u64, own: u64| reading > own;
        beyond(state & 0xffff, own & 0xffff) && beyond((state >> 16) & 0xffff, (own >> 16) & 0xffff)
    }
}

/// A ring's processes as a waiter counts them when it asks whether the machine is full
/// ([`MachineLoad::full_beyond`]): how many there are (its writer and readers) and the
/// ring's two doorbells, whose sleepers are the ones not running.
#[derive(Clone, Copy, Debug)]
pub struct RingPeers<'r> {
    pub processes: u32,
    pub doorbells: [&'r DoorbellWords; 2],
}

impl RingPeers<'_> {
    /// The ring's processes not asleep on either doorbell now (the waiter included).
    pub fn awake(&self) -> u32 {
        let asleep: u32 = self.doorbells.iter().map(|d| d.sleepers_now()).sum();
        self.processes.saturating_sub(asleep)
    }
}

/// How many recent waits a [`WaitHistory`] keeps.
const HISTORY: usize = 8;

/// The last few waits of one waiter (a queue's reader or writer, in one process), so
/// that it keeps polling through the gaps its peer usually leaves instead of sleeping on
/// every message. A reader whose writer sends step-sized messages (a ping-pong whose
/// pickling takes a little longer than the default 100 µs of spinning and yielding)
/// would otherwise go to sleep before each one comes, and pay a futex wake-up per
/// message.
///
/// The yield phase grows to twice the *typical* recent wait (the 6th shortest of the last
/// 8) when that is at most [`WaitPolicy::yield_max`]; a waiter whose peer is usually slow
/// or idle keeps the short default and sleeps at no CPU cost. Only the time until the
/// condition held is recorded, never a wait that failed.
#[derive(Debug, Default)]
pub struct WaitHistory {
    /// Microseconds, saturated.
    samples: [AtomicU32; HISTORY],
    next: AtomicU32,
}

impl WaitHistory {
    /// Record a wait that ended because its condition held after `waited`.
    pub fn record(&self, waited: Duration) {
        let us = u32::try_from(waited.as_micros()).unwrap_or(u32::MAX);
        // Relaxed: a statistic of this process that orders no other memory. Threads that
        // share a handle may overwrite each other's sample (the index is loaded and
        // stored, not incremented atomically): one sample lost changes only how long a
        // later wait polls before it sleeps.
        let i = self.next.load(Ordering::Relaxed);
        self.next.store(i.wrapping_add(1), Ordering::Relaxed);
        self.samples[i as usize % HISTORY].store(us, Ordering::Relaxed);
    }

    /// How long a wait under `policy` yields before it sleeps.
    pub fn yield_for(&self, policy: &WaitPolicy) -> Duration {
        if policy.yield_max <= policy.yield_for {
            return policy.yield_for;
        }
        // Relaxed: see `record`.
        let mut s = [0u32; HISTORY];
        for (v, sample) in s.iter_mut().zip(&self.samples) {
            *v = sample.load(Ordering::Relaxed);
        }
        s.sort_unstable();
        let grown = Duration::from_micros(u64::from(s[HISTORY * 3 / 4 - 1]) * 2);
        if grown <= policy.yield_max {
            grown.max(policy.yield_for)
        } else {
            policy.yield_for
        }
    }
}

impl Default for WaitPolicy {
    /// [`WaitPolicy::for_processes`] for two processes (one writer, one reader).
    fn default() -> Self {
        WaitPolicy::for_processes(2)
    }
}

/// A function the waiter calls every few milliseconds while it waits; an error ends the
/// wait with that error (the Python bindings raise `KeyboardInterrupt` or "cancelled").
pub type Hook<'a> = &'a mut (dyn FnMut() -> Result<()> + Send);

/// What a caller may say about a blocking call of a [`Writer`](crate::Writer) or
/// [`Reader`](crate::Reader): its timeout, a hook to run every few milliseconds (the
/// Python bindings check signals and cancel events there), and whether to stay quiet
/// (no "still waiting" warnings, for a wait expected to be long). The queue adds the
/// rest itself: what the wait is for (in warnings and timeout errors), how it spins,
/// yields and sleeps, and its `shutdown`. A `Duration`, `None` and `Some(duration)`
/// convert into one.
///
/// A caller that must let go of the writer or reader now and then during a long wait
/// (the Python bindings do, to run Python code with no lock held) gives a hook that
/// ends the wait with an error, and a [`WaitClock`] in `resume`: then it calls the same
/// method again with the same clock, and the wait goes on where it stopped.
#[derive(Default)]
pub struct WaitSpec<'a> {
    pub timeout: Option<Duration>,
    pub hook: Option<Hook<'a>>,
    pub quiet: bool,
    pub resume: Option<&'a mut WaitClock>,
}

/// How long one slice of [`in_slices`] lasts when there is a hook to run between slices.
const SLICE_WITH_HOOK: Duration = Duration::from_millis(50);
/// ... and when there is none: only the deadline ends the wait, but the slice is bounded
/// so that a blocking call that adds it to `Instant::now()` never overflows.
const SLICE_WITHOUT_HOOK: Duration = Duration::from_secs(3600);

/// The wait loop for what has a blocking call of its own that takes a timeout (a
/// condition variable, `poll`: the worker supervisor's waits), beside [`Wait::until`]'s
/// for shared memory: `step(slice)` blocks up to `slice` and returns `Some` once what it
/// waits for is there. Between slices the spec's hook runs (every 50 ms: the Python
/// bindings check signals there); its error ends the wait. `Ok(None)`: the spec's
/// timeout passed first. (`quiet` and `resume` mean nothing here: such waits give no
/// "still waiting" warnings and hold no lock across slices.)
///
/// # Errors
///
/// The error of `spec`'s hook, which ends the wait (a timeout is `Ok(None)`, not an error).
pub fn in_slices<T>(
    spec: WaitSpec<'_>,
    mut step: impl FnMut(Duration) -> Option<T>,
) -> Result<Option<T>> {
    let start = Instant::now();
    let deadline = spec.timeout.and_then(|t| deadline_after(start, t));
    let mut hook = spec.hook;
    let longest = if hook.is_some() {
        SLICE_WITH_HOOK
    } else {
        SLICE_WITHOUT_HOOK
    };
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(longest),
            None => longest,
        };
        if let Some(out) = step(slice) {
            return Ok(Some(out));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        if let Some(hook) = hook.as_mut() {
            hook()?;
        }
    }
}

/// Where a wait stood when it ended, so that a blocking call started again with the
/// same clock ([`WaitSpec::resume`]) goes on from there instead of starting over: the
/// same start and deadline (timeouts and "still waiting" warnings count the whole
/// wait), the same liveness clock, and no second spin phase. Only a call that can be
/// started over may be resumed so: one ended by its hook, which (see
/// [`Wait::commit`]) is never called once the call has done something it cannot undo.
#[derive(Clone, Copy, Debug, Default)]
pub struct WaitClock {
    /// `None`: no wait has begun with this clock yet.
    started: Option<Instant>,
    deadline: Option<Instant>,
    next_warning: Option<Instant>,
    next_liveness: Option<Instant>,
    /// The end of the yield phase, once the spin phase is over.
    yield_end: Option<Instant>,
    /// When the wait first blocked on a ring (see [`Wait::blocked_since`]).
    blocked_since: Option<Instant>,
    /// When the wait began to sleep (see [`hook_slice`]).
    asleep_since: Option<Instant>,
}

impl WaitClock {
    /// The deadline of the wait it carries on (`None`: none, or no wait begun yet).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// How long since the wait it carries on began (zero if none has).
    pub fn elapsed(&self) -> Duration {
        self.started.map_or(Duration::ZERO, |t| t.elapsed())
    }
}

/// A timeout: `writer.enqueue(msg, Duration::from_secs(5))`.
impl From<Duration> for WaitSpec<'_> {
    fn from(timeout: Duration) -> Self {
        Some(timeout).into()
    }
}

impl From<Option<Duration>> for WaitSpec<'_> {
    fn from(timeout: Option<Duration>) -> Self {
        WaitSpec {
            timeout,
            ..Default::default()
        }
    }
}

impl<'a> WaitSpec<'a> {
    /// The wait these terms describe, for `what`, waiting as `policy` says and ending
    /// with [`Error::Cancelled`] once `cancel` is set.
    pub fn into_wait<'b>(
        self,
        what: &'b str,
        policy: WaitPolicy,
        cancel: &'b AtomicBool,
    ) -> Wait<'b>
    where
        'a: 'b,
    {
        let mut wait = Wait::new(what, self.timeout)
            .policy(policy)
            .cancel_on(cancel);
        if let Some(hook) = self.hook {
            let hook: Hook<'b> = hook;
            wait = wait.with_hook(hook);
        }
        if self.quiet {
            wait = wait.quiet();
        }
        if let Some(clock) = self.resume {
            wait = wait.resuming(clock);
        }
        wait
    }
}

/// The terms of one blocking call: what it waits for, until when, and what may cut it short.
pub struct Wait<'a> {
    what: &'a str,
    started: Instant,
    deadline: Option<Instant>,
    cancel: Option<&'a AtomicBool>,
    hook: Option<Hook<'a>>,
    policy: WaitPolicy,
    history: Option<Arc<WaitHistory>>,
    /// `None`: never warn (a wait the caller expects to be long).
    next_warning: Option<Instant>,
    next_liveness: Instant,
    /// The end of the yield phase, once `until` has spun (kept for a resumed wait).
    yield_end: Option<Instant>,
    /// Set by [`commit`](Self::commit): the hook is not called any more.
    committed: bool,
    /// It goes on from an earlier call's wait ([`resuming`](Self::resuming)).
    resumed: bool,
    /// When it first blocked on a ring ([`blocked_since`](Self::blocked_since)).
    blocked_since: Option<Instant>,
    /// When it began to sleep: a resumed wait goes on with the slices it had reached.
    asleep_since: Option<Instant>,
    /// Where the clocks go when the wait ends ([`resuming`](Self::resuming)).
    clock: Option<&'a mut WaitClock>,
    /// Says whether the machine is full (then a blocked wait skips spinning and
    /// yielding); `None`: never ([`LOAD_CHECK_ENV`]).
    load: Option<&'a MachineLoad>,
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        if let Some(clock) = self.clock.take() {
            *clock = WaitClock {
                started: Some(self.started),
                deadline: self.deadline,
                next_warning: self.next_warning,
                next_liveness: Some(self.next_liveness),
                yield_end: self.yield_end,
                blocked_since: self.blocked_since,
                asleep_since: self.asleep_since,
            };
        }
    }
}

impl<'a> Wait<'a> {
    /// A wait described by `what` (used in warnings and timeout errors), ending after
    /// `timeout` if one is given.
    pub fn new(what: &'a str, timeout: Option<Duration>) -> Self {
        let started = Instant::now();
        Wait {
            what,
            started,
            deadline: timeout.and_then(|t| deadline_after(started, t)),
            cancel: None,
            hook: None,
            policy: WaitPolicy::default(),
            history: None,
            next_warning: Some(saturating_deadline(started, warning_interval())),
            next_liveness: started + LIVENESS_INTERVAL,
            yield_end: None,
            committed: false,
            resumed: false,
            blocked_since: None,
            asleep_since: None,
            clock: None,
            load: machine_load(),
        }
    }

    /// For a call that has checked it need not wait: no clock read, no deadline. (Its
    /// `until` still works, as a wait without a timeout, should the check be wrong.)
    pub fn ready_now() -> Wait<'static> {
        static NOW: OnceLock<Instant> = OnceLock::new();
        let started = *NOW.get_or_init(Instant::now);
        Wait {
            what: "a wait that was expected to be ready",
            started,
            deadline: None,
            cancel: None,
            hook: None,
            policy: WaitPolicy::default(),
            history: None,
            next_warning: None,
            next_liveness: started,
            yield_end: None,
            committed: false,
            resumed: false,
            blocked_since: None,
            asleep_since: None,
            clock: None,
            load: machine_load(),
        }
    }

    /// End the wait with [`Error::Cancelled`] once `flag` is set.
    pub fn cancel_on(mut self, flag: &'a AtomicBool) -> Self {
        self.cancel = Some(flag);
        self
    }

    /// Call `hook` every few milliseconds while waiting.
    pub fn with_hook(mut self, hook: Hook<'a>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Go on from where the wait that last used `clock` stopped (none yet: start it), and
    /// leave this wait's clocks in it when it ends (see [`WaitClock`]). Call it after
    /// [`quiet`](Self::quiet): a quiet wait stays quiet.
    pub fn resuming(mut self, clock: &'a mut WaitClock) -> Self {
        if let Some(started) = clock.started {
            self.started = started;
            self.deadline = clock.deadline;
            if self.next_warning.is_some() {
                self.next_warning = clock.next_warning;
            }
            self.next_liveness = clock.next_liveness.unwrap_or(self.next_liveness);
            self.yield_end = clock.yield_end;
            self.blocked_since = clock.blocked_since;
            self.asleep_since = clock.asleep_since;
            self.resumed = true;
        }
        self.clock = Some(clock);
        self
    }

    /// The call has done what it cannot undo (sent part of a message): from here on it
    /// must not be ended by its hook and started over (see [`WaitClock`]), so the hook
    /// is not called any more. The deadline and the cancel flag still end the wait.
    pub fn commit(&mut self) {
        self.committed = true;
    }

    /// Ask `load`, while spinning and yielding, whether the machine is full (default: the
    /// process's, [`machine_load`]; `None`: spin and yield as the policy says whatever
    /// the load).
    pub fn load(mut self, load: Option<&'a MachineLoad>) -> Self {
        self.load = load;
        self
    }

    /// Spin and yield as `policy` says (default: [`WaitPolicy::default`]).
    pub fn policy(mut self, policy: WaitPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Learn from and add to `history`: how long this waiter's recent waits lasted sets
    /// how long this one yields before it sleeps.
    pub fn learning(mut self, history: &Arc<WaitHistory>) -> Self {
        self.history = Some(history.clone());
        self
    }

    /// The condition held: record how long since `since`, and forget the phase (a later
    /// `until` of the same wait waits for something else).
    fn done(&mut self, since: Instant) {
        self.yield_end = None;
        if let Some(h) = &self.history {
            h.record(since.elapsed());
        }
    }

    /// Do not log "still waiting" warnings (for waits expected to last, e.g. an idle
    /// worker waiting for the next request).
    pub fn quiet(mut self) -> Self {
        self.next_warning = None;
        self
    }

    /// Whether it goes on from an earlier call's wait (see [`WaitClock`]).
    pub fn is_resumed(&self) -> bool {
        self.resumed
    }

    /// For a ring's wait statistics: when this wait first blocked on the ring, over all
    /// the calls it goes on from (see [`WaitClock`]), and whether that is now (then the
    /// statistics count a wait; a resumed one is counted once).
    pub fn blocked_since(&mut self) -> (Instant, bool) {
        match self.blocked_since {
            Some(t) => (t, false),
            None => {
                let t = Instant::now();
                self.blocked_since = Some(t);
                (t, true)
            }
        }
    }

    /// Time since the wait began (the whole wait's, for a resumed one).
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// What this wait is for, as given to [`Wait::new`].
    pub fn description(&self) -> &str {
        self.what
    }

    fn cancelled(&self) -> bool {
        // Relaxed: the flag carries no data; seeing it a little late only delays the
        // cancellation by one poll (and `shutdown` rings the doorbell to end a sleep).
        self.cancel
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Check cancellation, the deadline and the warning clock; `now` is the current time.
    /// A warning and a timeout add what `explain` says (who the wait is for, and what
    /// they are doing).
    fn check(&mut self, now: Instant, explain: &mut dyn FnMut() -> String) -> Result<()> {
        if self.cancelled() {
            return Err(Error::Cancelled);
        }
        if self.deadline.is_some_and(|d| now >= d) {
            // The timeout says what the warnings say: who the wait was for, and what
            // they were doing (called once, at the end).
            let why = explain();
            let what = if why.is_empty() {
                self.what.to_owned()
            } else {
                format!("{}: {why}", self.what)
            };
            return Err(Error::Timeout {
                what,
                waited: now - self.started,
            });
        }
        if self.next_warning.is_some_and(|t| now >= t) {
            let why = explain();
            let why = if why.is_empty() {
                why
            } else {
                format!(": {why}")
            };
            warn_user!(
                "shmq: {} for {:.0?}{why} (set {WARNING_INTERVAL_ENV} to change how often this is logged)",
                self.what,
                now - self.started
            );
            self.next_warning = Some(saturating_deadline(now, warning_interval()));
        }
        Ok(())
    }

    /// The periodic checks of the slow phases: about twice a second the peer's liveness,
    /// then the hook. In that order: a hook that ends every wait it is called in (see
    /// [`WaitClock`]) must not keep the liveness check from running.
    fn slow_checks(
        &mut self,
        now: Instant,
        peer_alive: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        if now >= self.next_liveness {
            peer_alive()?;
            self.next_liveness = now + LIVENESS_INTERVAL;
        }
        if let Some(hook) = self.hook.as_mut().filter(|_| !self.committed) {
            hook()?;
        }
        Ok(())
    }

    /// Poll `ready` until it returns `Some`, then return its value. Spins, yields, and
    /// (with a `doorbell`) sleeps until the other side rings it. Ends early with `Timeout`,
    /// `Cancelled`, the hook's error or `peer_alive`'s error; the condition is polled at
    /// least once, so a ready result wins over an expired deadline.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the wait's deadline passes; [`Error::Cancelled`] once its
    /// cancel flag is set; `peer_alive`'s error (a dead peer); the hook's error.
    pub fn until<T>(
        &mut self,
        doorbell: Option<&DoorbellWords>,
        peer_alive: &mut dyn FnMut() -> Result<()>,
        ready: impl FnMut() -> Option<T>,
    ) -> Result<T> {
        self.until_explained(doorbell, peer_alive, &mut String::new, ready)
    }

    /// [`until`](Self::until), whose "still waiting" warnings add what `explain` says:
    /// who the wait is for and what they are doing (called once per warning only).
    ///
    /// # Errors
    ///
    /// As [`until`](Self::until).
    pub fn until_explained<T>(
        &mut self,
        doorbell: Option<&DoorbellWords>,
        peer_alive: &mut dyn FnMut() -> Result<()>,
        explain: &mut dyn FnMut() -> String,
        ready: impl FnMut() -> Option<T>,
    ) -> Result<T> {
        self.until_among(doorbell, None, peer_alive, explain, ready)
    }

    /// [`until_explained`](Self::until_explained) for a waiter of a ring whose processes
    /// are `peers`: the machine counts as full only with work besides the ring's own
    /// awake processes ([`MachineLoad::full_beyond`]), so that a ring with more
    /// processes than cores keeps spinning and yielding as its policy says (handing its
    /// core to its peers) unless other work waits for the cores too.
    ///
    /// # Errors
    ///
    /// As [`until_explained`](Self::until_explained).
    pub fn until_among<T>(
        &mut self,
        doorbell: Option<&DoorbellWords>,
        peers: Option<RingPeers<'_>>,
        peer_alive: &mut dyn FnMut() -> Result<()>,
        explain: &mut dyn FnMut() -> String,
        mut ready: impl FnMut() -> Option<T>,
    ) -> Result<T> {
        // A resumed wait (see `WaitClock`) goes on in the phase where it stopped, and
        // its history counts from the start of the whole wait.
        let resumed_yield_end = self.yield_end;
        if let Some(v) = ready() {
            match resumed_yield_end {
                Some(_) => self.done(self.started),
                None => {
                    if let Some(h) = &self.history {
                        h.record(Duration::ZERO);
                    }
                }
            }
            return Ok(v);
        }
        let start = match resumed_yield_end {
            Some(_) => self.started,
            None => Instant::now(),
        };
        // On a full machine (see `MachineLoad`) no more spinning or yielding, when there
        // is a doorbell to sleep on and a phase to skip: asked at each clock read of the
        // two phases (the first after 64 polls, so that a wait its peer ends within them
        // pays nothing), so that a machine that fills up during a long spin ends it too.
        let ask_load = doorbell.is_some()
            && !(self.policy.spin.is_zero()
                && self.policy.yield_for.is_zero()
                && self.policy.yield_max.is_zero());
        let full = |load: &MachineLoad, now: Instant| match &peers {
            Some(p) => load.full_beyond(now, || p.awake()),
            None => load.full(now),
        };
        let mut straight_to_sleep = false;
        let yield_end = match resumed_yield_end {
            Some(end) => end,
            None => {
                // The phases are capped: a policy's fields are public, and an
                // `Instant` plus a huge `Duration` panics.
                let spin_end = start + self.policy.spin.min(MAX_PHASE);
                // Spin: poll back to back, looking at the clock only every 64 polls.
                loop {
                    for _ in 0..64 {
                        std::hint::spin_loop();
                        if let Some(v) = ready() {
                            self.done(start);
                            return Ok(v);
                        }
                    }
                    let now = Instant::now();
                    self.check(now, explain)?;
                    if ask_load && self.load.is_some_and(|l| full(l, now)) {
                        straight_to_sleep = true;
                        break;
                    }
                    if now >= spin_end {
                        break;
                    }
                }
                if straight_to_sleep {
                    start
                } else {
                    let yield_for = self
                        .history
                        .as_ref()
                        .map_or(self.policy.yield_for, |h| h.yield_for(&self.policy));
                    spin_end + yield_for.min(MAX_PHASE)
                }
            }
        };
        self.yield_end = Some(yield_end);
        // Yield: give the core to others between polls (not on a full machine).
        if !straight_to_sleep {
            let mut next_slow = Instant::now() + HOOK_INTERVAL;
            loop {
                std::thread::yield_now();
                if let Some(v) = ready() {
                    self.done(start);
                    return Ok(v);
                }
                let now = Instant::now();
                self.check(now, explain)?;
                if now >= next_slow {
                    self.slow_checks(now, peer_alive)?;
                    next_slow = now + HOOK_INTERVAL;
                }
                if doorbell.is_some() && now >= yield_end {
                    break;
                }
                if ask_load && self.load.is_some_and(|l| full(l, now)) {
                    break;
                }
            }
        }
        // Sleep on the doorbell, in slices short enough for the periodic checks.
        let doorbell = doorbell
            .expect("the yield loop only ends, or is skipped, with a doorbell")
            .doorbell();
        let asleep_since = *self.asleep_since.get_or_insert_with(Instant::now);
        loop {
            let now = Instant::now();
            let slice = if self.hook.is_some() {
                hook_slice(now.saturating_duration_since(asleep_since))
            } else {
                LIVENESS_INTERVAL
            };
            let mut timeout = slice.min(self.next_liveness.saturating_duration_since(now));
            if let Some(d) = self.deadline {
                timeout = timeout.min(d.saturating_duration_since(now));
            }
            if let Some(w) = self.next_warning {
                timeout = timeout.min(w.saturating_duration_since(now));
            }
            let mut found = None;
            doorbell.sleep(
                || {
                    found = ready();
                    found.is_some()
                },
                Some(timeout.max(Duration::from_micros(100))),
            );
            if let Some(v) = found.or_else(&mut ready) {
                self.done(start);
                return Ok(v);
            }
            let now = Instant::now();
            self.check(now, explain)?;
            self.slow_checks(now, peer_alive)?;
        }
    }

    /// Time left before the deadline (`None`: no deadline), for blocking calls outside
    /// this module such as a socket receive.
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Run the checks of one wait step from outside `until` (a socket poll loop).
    ///
    /// # Errors
    ///
    /// As [`until`](Self::until) at one step: [`Error::Timeout`], [`Error::Cancelled`],
    /// `peer_alive`'s or the hook's error.
    pub fn step(&mut self, peer_alive: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.step_explained(peer_alive, &mut String::new)
    }

    /// [`step`](Self::step), whose warnings add what `explain` says (see
    /// [`until_explained`](Self::until_explained)).
    ///
    /// # Errors
    ///
    /// As [`step`](Self::step).
    pub fn step_explained(
        &mut self,
        peer_alive: &mut dyn FnMut() -> Result<()>,
        explain: &mut dyn FnMut() -> String,
    ) -> Result<()> {
        let now = Instant::now();
        self.check(now, explain)?;
        self.slow_checks(now, peer_alive)
    }
}

/// A `peer_alive` check for waits without a peer to check.
///
/// # Errors
///
/// Never: always `Ok` (the `Result` is what a `peer_alive` check returns).
pub fn no_peer() -> Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use shmq_protocol::sync::local::AtomicBool;

    #[test]
    fn in_slices_runs_the_hook_between_slices_and_ends_at_the_deadline_or_its_error() {
        // Ready at the third slice: the hook ran between the slices, each at most 50 ms.
        let mut slices = Vec::new();
        let mut hooks = 0;
        let mut hook = || -> Result<()> {
            hooks += 1;
            Ok(())
        };
        let got = in_slices(
            WaitSpec {
                timeout: Some(Duration::from_secs(10)),
                hook: Some(&mut hook),
                ..WaitSpec::default()
            },
            |slice| {
                slices.push(slice);
                (slices.len() == 3).then_some("ready")
            },
        );
        assert_eq!(got.unwrap(), Some("ready"));
        assert_eq!(hooks, 2);
        assert!(slices.iter().all(|s| *s <= SLICE_WITH_HOOK), "{slices:?}");
        // The hook's error ends the wait.
        let mut refuse = || -> Result<()> { Err(Error::Cancelled) };
        let got: Result<Option<()>> = in_slices(
            WaitSpec {
                hook: Some(&mut refuse),
                ..WaitSpec::default()
            },
            |_| None,
        );
        assert!(matches!(got, Err(Error::Cancelled)), "{got:?}");
        // No hook: one slice as long as the timeout, then `None` once it has passed.
        let mut calls = Vec::new();
        // (Longer than a hook's 50 ms slice: a loop that sliced without a hook would call
        // `step` three times.)
        let got: Result<Option<()>> = in_slices(Duration::from_millis(120).into(), |slice| {
            calls.push(slice);
            std::thread::sleep(slice);
            None
        });
        assert_eq!(got.unwrap(), None);
        // One slice, the rest of the timeout (a loaded machine may start it late: its
        // length is only bounded above).
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert!(calls[0] <= Duration::from_millis(120), "{calls:?}");
    }

    #[test]
    fn policies_from_micros_keep_what_is_given_and_refuse_what_cannot_be_a_time() {
        let p = WaitPolicy::from_micros(2, Some(10.0), Some(20.0)).unwrap();
        assert_eq!(
            p,
            WaitPolicy::fixed(Duration::from_micros(10), Duration::from_micros(20))
        );
        assert_eq!(
            WaitPolicy::from_micros(3, None, None).unwrap(),
            WaitPolicy::for_processes(3)
        );
        let range = "a non-negative number of microseconds, at most 10000000 (10 s)";
        for (spin, yld, name, got) in [
            (Some(-1.0), None, "spin_us", "-1.0"),
            (None, Some(f64::NAN), "yield_us", "NaN"),
            (Some(1e300), None, "spin_us", "1e300"),
            (None, Some(f64::INFINITY), "yield_us", "inf"),
            (None, Some(1.8e19), "yield_us", "1.8e19"),
        ] {
            let e = WaitPolicy::from_micros(2, spin, yld).unwrap_err();
            let message = format!("{name} must be {range}, got {got}");
            assert!(
                matches!(&e, Error::InvalidArgument(m) if *m == message),
                "{e}"
            );
        }
        let p = WaitPolicy::from_micros(2, Some(MAX_PHASE_US), Some(0.0)).unwrap();
        assert_eq!(p, WaitPolicy::fixed(MAX_PHASE, Duration::ZERO));
    }

    #[test]
    fn timeouts_beyond_the_longest_mean_none_and_bad_ones_are_refused() {
        let t = |s: f64| timeout_from_secs("timeout", s);
        assert_eq!(t(0.0).unwrap(), Some(Duration::ZERO));
        assert_eq!(t(1.5).unwrap(), Some(Duration::from_millis(1500)));
        assert_eq!(t(1e9).unwrap(), Some(MAX_TIMEOUT));
        let beyond = [1e9 + 1.0, 1.8e19, 2f64.powi(64), 1e300, f64::MAX];
        for s in beyond.into_iter().chain([f64::INFINITY]) {
            assert_eq!(t(s).unwrap(), None, "{s}");
        }
        for s in [-1.0, -0.5, f64::NEG_INFINITY, f64::NAN] {
            let e = t(s).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m)
                    if m.starts_with("timeout must be a non-negative number of seconds")),
                "{e}"
            );
        }
        let now = Instant::now();
        let second = Duration::from_secs(1);
        assert_eq!(deadline_after(now, second), Some(now + second));
        assert_eq!(deadline_after(now, Duration::MAX), None);
        let longest = MAX_TIMEOUT + Duration::from_nanos(1);
        assert_eq!(deadline_after(now, longest), None);
        assert_eq!(saturating_deadline(now, Duration::MAX), now + MAX_TIMEOUT);
    }

    #[test]
    fn a_wait_of_the_longest_duration_has_no_deadline_and_no_panic() {
        // A caller's own Duration::MAX (a Rust caller need not go through
        // timeout_from_secs): no deadline, where `Instant + Duration::MAX` panicked.
        let mut n = 0;
        let mut wait = Wait::new("test", Some(Duration::MAX));
        assert_eq!(wait.remaining(), None);
        let v = wait
            .until(None, &mut no_peer, || {
                n += 1;
                (n > 10).then_some(n)
            })
            .unwrap();
        assert_eq!(v, 11);
        let huge = WaitPolicy::fixed(Duration::MAX, Duration::MAX);
        let mut m = 0;
        Wait::new("test", Some(Duration::from_secs(5)))
            .policy(huge)
            .until(None, &mut no_peer, || {
                m += 1;
                (m > 100).then_some(())
            })
            .unwrap();
    }

    #[test]
    fn ready_value_is_returned() {
        let mut n = 0;
        let v = Wait::new("test", Some(Duration::from_secs(5)))
            .until(None, &mut no_peer, || {
                n += 1;
                (n > 1000).then_some(n)
            })
            .unwrap();
        assert_eq!(v, 1001);
    }

    #[test]
    fn history_grows_the_yield_phase_only_for_short_waits() {
        let policy = WaitPolicy {
            spin: Duration::from_micros(50),
            yield_for: Duration::from_micros(50),
            yield_max: Duration::from_millis(1),
        };
        let h = WaitHistory::default();
        // No history yet: the default.
        assert_eq!(h.yield_for(&policy), policy.yield_for);
        // A peer that answers every 130 µs: poll twice that before sleeping.
        for _ in 0..HISTORY {
            h.record(Duration::from_micros(130));
        }
        assert_eq!(h.yield_for(&policy), Duration::from_micros(260));
        // Two long waits of the last eight (an idle spell) do not undo it ...
        h.record(Duration::from_secs(3));
        h.record(Duration::from_secs(3));
        assert_eq!(h.yield_for(&policy), Duration::from_micros(260));
        // ... three do: the typical wait is long now, so the waiter sleeps early again.
        h.record(Duration::from_secs(3));
        assert_eq!(h.yield_for(&policy), policy.yield_for);
        // A peer whose gaps exceed half the maximum: no growth either.
        for _ in 0..HISTORY {
            h.record(Duration::from_micros(600));
        }
        assert_eq!(h.yield_for(&policy), policy.yield_for);
        // Waits shorter than the default never shrink it.
        for _ in 0..HISTORY {
            h.record(Duration::from_micros(5));
        }
        assert_eq!(h.yield_for(&policy), policy.yield_for);
        // A fixed policy never grows.
        for _ in 0..HISTORY {
            h.record(Duration::from_micros(130));
        }
        let fixed = WaitPolicy::fixed(policy.spin, policy.yield_for);
        assert_eq!(h.yield_for(&fixed), policy.yield_for);
    }

    #[test]
    fn a_wait_records_how_long_it_took() {
        let h = Arc::new(WaitHistory::default());
        let policy = WaitPolicy::fixed(Duration::ZERO, Duration::from_millis(100));
        let until = Instant::now() + Duration::from_millis(2);
        Wait::new("t", Some(Duration::from_secs(5)))
            .policy(policy)
            .learning(&h)
            .until(None, &mut no_peer, || {
                (Instant::now() >= until).then_some(())
            })
            .unwrap();
        let grown = WaitPolicy {
            yield_max: Duration::from_secs(1),
            ..policy
        };
        // All eight samples are needed for the typical wait: one 2 ms wait and seven
        // zeros give the default; eight such waits give twice 2 ms or more.
        assert_eq!(h.yield_for(&grown), policy.yield_for);
        for _ in 1..HISTORY {
            let until = Instant::now() + Duration::from_millis(2);
            Wait::new("t", None)
                .policy(policy)
                .learning(&h)
                .until(None, &mut no_peer, || {
                    (Instant::now() >= until).then_some(())
                })
                .unwrap();
        }
        assert!(h.yield_for(&grown) >= Duration::from_millis(4));
    }

    #[test]
    fn timeout_names_the_wait() {
        let err = Wait::new(
            "reader 0 waiting for the writer",
            Some(Duration::from_millis(20)),
        )
        .until(None, &mut no_peer, || None::<()>)
        .unwrap_err();
        match err {
            Error::Timeout { what, waited } => {
                assert_eq!(what, "reader 0 waiting for the writer");
                assert!(waited >= Duration::from_millis(20));
            }
            e => panic!("unexpected {e}"),
        }
    }

    #[test]
    fn zero_timeout_still_polls_once() {
        assert_eq!(
            Wait::new("t", Some(Duration::ZERO))
                .until(None, &mut no_peer, || Some(7))
                .unwrap(),
            7
        );
    }

    #[test]
    fn cancel_from_another_thread() {
        let flag = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                flag.store(true, std::sync::atomic::Ordering::Relaxed);
            });
            let err = Wait::new("t", Some(Duration::from_secs(10)))
                .cancel_on(&flag)
                .until(None, &mut no_peer, || None::<()>);
            assert!(matches!(err, Err(Error::Cancelled)));
        });
    }

    #[test]
    fn sleeper_is_woken_by_the_bell_from_another_thread() {
        let bell = DoorbellWords::default();
        let flag = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                // Let the waiter reach the sleep phase (spin 0, yield 1 ms).
                while bell.sleepers_now() == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
                bell.doorbell().ring();
            });
            let policy = WaitPolicy::fixed(Duration::ZERO, Duration::from_millis(1));
            let started = Instant::now();
            let got = Wait::new("t", Some(Duration::from_secs(20)))
                .policy(policy)
                .until(Some(&bell), &mut no_peer, || {
                    flag.load(std::sync::atomic::Ordering::SeqCst).then_some(1)
                })
                .unwrap();
            assert_eq!(got, 1);
            // Woken by the ring, not by the 500 ms liveness slice or the deadline (a bound
            // on a wake-up, not a benchmark: the ring comes ~1 ms after the sleep).
            assert!(
                started.elapsed() < Duration::from_millis(400),
                "{:?}",
                started.elapsed()
            );
        });
    }

    #[test]
    fn loadavg_gives_its_running_tasks() {
        assert_eq!(parse_runnable(b"2.10 1.83 1.67 3/151 8919\n"), Some(3));
        assert_eq!(parse_runnable(b"0.00 0.00 0.00 117/2048 1\n"), Some(117));
        assert_eq!(parse_runnable(b"2.10 1.83"), None);
        assert_eq!(parse_runnable(b"a b c x/1 2"), None);
        // This machine's, read for real.
        assert!(runnable_tasks().is_some_and(|n| n >= 1));
    }

    /// The runnable tasks the gauges of the tests below read: set by each test (they run
    /// one at a time, serialized on `GAUGE_LOCK`). SeqCst on these and on the tests'
    /// flags: plain test state, no ordering argument needed beyond the strongest.
    static RUNNABLE: AtomicU32 = AtomicU32::new(0);
    static READS: AtomicU32 = AtomicU32::new(0);
    static GAUGE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn injected() -> Option<u32> {
        READS.fetch_add(1, Ordering::SeqCst);
        Some(RUNNABLE.load(Ordering::SeqCst))
    }

    fn two_cores() -> usize {
        2
    }

    /// A gauge that has read `runnable` twice, 5 ms apart (full when it is over 2), each
    /// reading taken by a waiter whose ring had `own` processes awake then (0: a wait of
    /// no ring's).
    fn gauge_reading_among(runnable: u32, own: u32) -> MachineLoad {
        RUNNABLE.store(runnable, Ordering::SeqCst);
        let load = MachineLoad::new(injected, two_cores);
        load_base(); // the times count from before `now`
        let now = Instant::now();
        load.full_beyond(now, || own);
        load.full_beyond(now + Duration::from_millis(LOAD_REFRESH_MS.into()), || own);
        load
    }

    #[test]
    fn the_machine_is_full_when_two_readings_outnumber_its_cores() {
        let _one = GAUGE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        RUNNABLE.store(5, Ordering::SeqCst);
        READS.store(0, Ordering::SeqCst);
        let load = MachineLoad::new(injected, two_cores);
        load_base(); // the times count from before `t`
        let t = Instant::now();
        // One reading is not enough (a task woken for a moment).
        assert!(!load.full(t));
        assert_eq!(READS.load(Ordering::SeqCst), 1);
        // Within 5 ms: the cached reading, no second read.
        assert!(!load.full(t + Duration::from_millis(4)));
        assert_eq!(READS.load(Ordering::SeqCst), 1);
        // 5 ms later, a second reading over the cores: full, and cached as full.
        assert!(load.full(t + Duration::from_millis(5)));
        assert!(load.full(t + Duration::from_millis(9)));
        assert_eq!(READS.load(Ordering::SeqCst), 2);
        // As many runnable tasks as cores: not full once read again.
        RUNNABLE.store(2, Ordering::SeqCst);
        assert!(!load.full(t + Duration::from_millis(10)));
        RUNNABLE.store(3, Ordering::SeqCst);
        assert!(!load.full(t + Duration::from_millis(15)));
        assert!(load.full(t + Duration::from_millis(20)));
        assert_eq!(READS.load(Ordering::SeqCst), 5);
    }

    #[test]
    fn a_machine_full_of_the_rings_own_processes_is_not_full_beyond_them() {
        let _one = GAUGE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // The cached readings (no new one within 5 ms of the last): the own counts of
        // when they were taken decide, not the count of now (never asked).
        let now = Instant::now() + Duration::from_millis(LOAD_REFRESH_MS.into());
        let never = || -> u32 { panic!("asked for the count of now") };
        // 4 runnable on 2 cores: full, but not beyond the ring's 4 awake processes.
        let load = gauge_reading_among(4, 4);
        assert!(load.full(now));
        assert!(!load.full_beyond(now, never));
        // One more runnable task than the ring's awake ones: other work waits for a core.
        assert!(gauge_reading_among(4, 3).full_beyond(now, never));
        // Both readings must say so: a new reading with all 4 awake is not beyond.
        let load = gauge_reading_among(4, 3);
        let later = now + Duration::from_millis(LOAD_REFRESH_MS.into());
        assert!(!load.full_beyond(later, || 4));
        // Not full at all: not full beyond anything.
        assert!(!gauge_reading_among(2, 0).full_beyond(now, never));
    }

    #[test]
    fn a_rings_awake_processes_are_those_not_asleep_on_its_doorbells() {
        let (a, b) = (DoorbellWords::default(), DoorbellWords::default());
        let peers = RingPeers {
            processes: 4,
            doorbells: [&a, &b],
        };
        assert_eq!(peers.awake(), 4);
        // Two threads asleep on one doorbell, one on the other: one process awake. More
        // asleep than there are processes (nonsense a peer could write): none, no underflow.
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            for bell in [&a, &a, &b] {
                let done = &done;
                s.spawn(move || {
                    while !done.load(Ordering::SeqCst) {
                        bell.doorbell()
                            .sleep(|| done.load(Ordering::SeqCst), Some(Duration::from_secs(5)));
                    }
                });
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while a.sleepers_now() + b.sleepers_now() < 3 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(peers.awake(), 1);
            let few = RingPeers {
                processes: 2,
                doorbells: [&a, &b],
            };
            assert_eq!(few.awake(), 0);
            done.store(true, Ordering::SeqCst);
            a.doorbell().wake();
            b.doorbell().wake();
        });
    }

    /// A wait whose policy spins for 10 s, for a condition a peer thread sets: with
    /// `runnable` tasks on a machine of 2 cores, how many times it polled, and whether the
    /// peer found it asleep on the doorbell (the peer sets the condition once the waiter
    /// sleeps, or after 50 ms).
    fn poll_count_with_a_peer(runnable: u32) -> (u64, bool) {
        poll_count_among(runnable, None)
    }

    /// [`poll_count_with_a_peer`], the waiter a ring's of `ring_processes` processes (all
    /// awake but for those asleep on its doorbell) where given.
    fn poll_count_among(runnable: u32, ring_processes: Option<u32>) -> (u64, bool) {
        let _one = GAUGE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let load = gauge_reading_among(runnable, ring_processes.unwrap_or(0));
        let bell = DoorbellWords::default();
        let other = DoorbellWords::default();
        let peers = ring_processes.map(|processes| RingPeers {
            processes,
            doorbells: [&bell, &other],
        });
        let flag = AtomicBool::new(false);
        let found_asleep = AtomicBool::new(false);
        let mut polls = 0u64;
        std::thread::scope(|s| {
            s.spawn(|| {
                let started = Instant::now();
                while started.elapsed() < Duration::from_millis(50) {
                    if bell.sleepers_now() > 0 {
                        found_asleep.store(true, Ordering::SeqCst);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                flag.store(true, Ordering::SeqCst);
                bell.doorbell().ring();
            });
            let got = Wait::new("t", Some(Duration::from_secs(30)))
                .policy(WaitPolicy::fixed(Duration::from_secs(10), Duration::ZERO))
                .load(Some(&load))
                .until_among(Some(&bell), peers, &mut no_peer, &mut String::new, || {
                    polls += 1;
                    flag.load(Ordering::SeqCst).then_some(())
                });
            assert!(got.is_ok());
        });
        (polls, found_asleep.load(Ordering::SeqCst))
    }

    #[test]
    fn on_a_full_machine_a_blocked_wait_sleeps_at_once() {
        // 6 runnable tasks on 2 cores: no spin past the first 64 polls (the first clock
        // read, where it asks), whatever the policy says; then a handful (the doorbell's
        // check before it sleeps, after the ring).
        let (polls, asleep) = poll_count_with_a_peer(6);
        assert!(asleep, "the waiter did not sleep");
        assert!(polls < 80, "{polls} polls: it spun");
    }

    #[test]
    fn on_a_machine_full_of_its_own_rings_processes_a_blocked_wait_keeps_its_policy() {
        // 4 runnable tasks on 2 cores, all of them the ring's (awake): its policy's spin,
        // as on a machine with cores to spare (there it yields, handing the core to a
        // peer, where a ring's processes outnumber the cores: `WaitPolicy::for_processes`).
        let (polls, asleep) = poll_count_among(4, Some(4));
        assert!(!asleep, "the waiter slept");
        assert!(polls > 1_000, "{polls} polls: it did not spin");
        // 6 runnable, 4 of them the ring's: other work besides; it sleeps at once.
        let (polls, asleep) = poll_count_among(6, Some(4));
        assert!(asleep, "the waiter did not sleep");
        assert!(polls < 80, "{polls} polls: it spun");
    }

    #[test]
    fn on_a_machine_with_cores_to_spare_a_blocked_wait_spins() {
        // 2 runnable tasks on 2 cores: the policy's spin, polling until the peer sets
        // the condition (a count, not a time: 50 ms of spinning is far more than 1 000
        // polls, a sleep is a handful).
        let (polls, asleep) = poll_count_with_a_peer(2);
        assert!(!asleep, "the waiter slept");
        assert!(polls > 1_000, "{polls} polls: it did not spin");
    }

    #[test]
    fn an_idle_waiter_sleeps_longer_slices_up_to_a_bound() {
        assert_eq!(hook_slice(Duration::ZERO), SLEEP_SLICE_WITH_HOOK);
        assert_eq!(hook_slice(Duration::from_millis(50)), SLEEP_SLICE_WITH_HOOK);
        assert_eq!(
            hook_slice(Duration::from_secs(1)),
            Duration::from_millis(100)
        );
        assert_eq!(
            hook_slice(Duration::from_secs(60)),
            SLEEP_SLICE_WITH_HOOK_MAX
        );
    }

    #[test]
    fn a_dead_peer_ends_the_wait() {
        let bell = DoorbellWords::default();
        let mut checks = 0;
        let err = Wait::new("t", Some(Duration::from_secs(20)))
            .until(
                Some(&bell),
                &mut || {
                    checks += 1;
                    Err(Error::WrongRole("peer died".into()))
                },
                || None::<()>,
            )
            .unwrap_err();
        assert!(err.to_string().contains("peer died"));
        assert_eq!(checks, 1);
    }

    #[test]
    fn hook_error_ends_the_wait() {
        let mut calls = 0;
        let mut hook = || {
            calls += 1;
            if calls == 3 {
                Err(Error::Cancelled)
            } else {
                Ok(())
            }
        };
        let err = Wait::new("t", Some(Duration::from_secs(10)))
            .with_hook(&mut hook)
            .until(None, &mut no_peer, || None::<()>);
        assert!(matches!(err, Err(Error::Cancelled)));
        assert_eq!(calls, 3);
    }
    /// Wait with a hook that ends every call it is called in, calling again with the
    /// same clock, as the Python bindings do after running signal handlers with no lock
    /// held, until the wait ends otherwise: that error, and how many calls the hook ended.
    fn wait_resumed(
        clock: &mut WaitClock,
        timeout: Duration,
        doorbell: Option<&DoorbellWords>,
        peer_alive: &mut dyn FnMut() -> Result<()>,
    ) -> (Error, usize) {
        let flag = AtomicBool::new(false);
        let mut pauses = 0;
        loop {
            let mut pause = || Err(Error::Cancelled);
            let spec = WaitSpec {
                timeout: Some(timeout),
                hook: Some(&mut pause),
                quiet: false,
                resume: Some(&mut *clock),
            };
            let r = spec.into_wait("t", WaitPolicy::default(), &flag).until(
                doorbell,
                &mut *peer_alive,
                || None::<()>,
            );
            match r {
                Err(Error::Cancelled) => pauses += 1,
                other => return (other.unwrap_err(), pauses),
            }
        }
    }

    #[test]
    fn a_wait_ended_by_its_hook_goes_on_with_its_clock() {
        let mut clock = WaitClock::default();
        let started = Instant::now();
        let (err, pauses) =
            wait_resumed(&mut clock, Duration::from_millis(120), None, &mut no_peer);
        // The deadline is the first call's: the rounds did not each get 120 ms.
        let Error::Timeout { waited, .. } = err else {
            panic!("{err:?}")
        };
        assert!(pauses >= 2, "{pauses}");
        assert!(waited >= Duration::from_millis(120), "{waited:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        // And the clock says where it stood: a resumed wait does not spin again.
        assert!(clock.started.is_some() && clock.yield_end.is_some());
    }

    #[test]
    fn a_committed_wait_calls_no_hook() {
        let mut calls = 0;
        let mut hook = || {
            calls += 1;
            Err(Error::Cancelled)
        };
        let mut wait = Wait::new("t", Some(Duration::from_millis(30))).with_hook(&mut hook);
        wait.commit();
        let err = wait.until(None, &mut no_peer, || None::<()>).unwrap_err();
        drop(wait);
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        assert_eq!(calls, 0);
    }

    #[test]
    fn a_wait_its_hook_ends_every_time_still_checks_its_peer() {
        let bell = DoorbellWords::default();
        let started = Instant::now();
        let (err, _) = wait_resumed(
            &mut WaitClock::default(),
            Duration::from_secs(20),
            Some(&bell),
            &mut || Err(Error::WrongRole("peer died".into())),
        );
        assert!(err.to_string().contains("peer died"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
