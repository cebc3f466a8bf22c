//! Running a core blocking call from Python: the GIL is released for the wait, and
//! every few milliseconds the call checks for signals (Ctrl-C: their Python handlers
//! run) and the caller's cancel event, with no lock of the binding held
//! ([`blocking_on`] lets go of the object's lock for them). Also the locks around the
//! binding objects' core state (`BindingLock`): taken without blocking while the GIL is
//! held, and a clear error, never a hang or a silent use, when re-entered or poisoned by
//! a panic. A blocking call that finds its object in use by another thread waits for it
//! no longer than its own timeout (and its cancel event): one thread's wait never holds
//! up another thread's timeout.
use shmq_protocol::sync::local::{fence, AtomicBool, AtomicUsize, Ordering};
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};

use crate::errors::{exception, OrRaise};
use pyo3::exceptions::{PyOverflowError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyInt;

use shmq::error::{Error, Result};
use shmq::wait::{deadline_after, Hook, WaitClock, WaitPolicy, WaitSpec};

/// A `timeout` argument: seconds as a float, checked when the argument is converted (so
/// before any fast path) by the core's `wait::timeout_from_secs`: negative or NaN is a
/// `ValueError`; `inf`, and anything longer than `wait::MAX_TIMEOUT` (10⁹ s; an int too
/// large for a float included), mean no timeout. Methods take `Option<Timeout>`, `None`
/// meaning no timeout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timeout(Option<Duration>);

impl<'a, 'py> FromPyObject<'a, 'py> for Timeout {
    type Error = PyErr;
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Timeout> {
        let t: f64 = match obj.extract() {
            Ok(t) => t,
            // An int beyond a float's range: as long as an infinite timeout, or as
            // negative as an infinitely negative one.
            Err(e)
                if e.is_instance_of::<PyOverflowError>(obj.py())
                    && obj.is_instance_of::<PyInt>() =>
            {
                if obj.gt(0)? {
                    f64::INFINITY
                } else {
                    f64::NEG_INFINITY
                }
            }
            Err(e) => return Err(e),
        };
        Ok(Timeout(
            shmq::wait::timeout_from_secs("timeout", t).or_raise()?,
        ))
    }
}

pub(crate) fn duration(timeout: Option<Timeout>) -> Option<Duration> {
    timeout.and_then(|t| t.0)
}

/// `timeout` as the core takes it: seconds, or None for no timeout (None, inf, or more
/// than 10⁹ s); `ValueError` for a negative number or NaN. For the Python package's own
/// waits (a semaphore, futures), whose timeouts must mean what the core's do (and which
/// raise `OverflowError`, or hang on NaN, where the core's do not).
#[pyfunction]
pub(crate) fn timeout_seconds(timeout: Option<Timeout>) -> Option<f64> {
    duration(timeout).map(|d| d.as_secs_f64())
}

/// What may end a blocking call early, besides its timeout.
pub(crate) struct Interrupts<'a, 'py> {
    pub timeout: Option<Timeout>,
    pub cancel: Option<&'a Bound<'py, PyAny>>,
    pub quiet: bool,
}

/// A wait policy from the optional `spin_us` / `yield_us` arguments, for a ring used by
/// `processes` processes (`WaitPolicy::from_micros`).
pub(crate) fn wait_policy(
    processes: usize,
    spin_us: Option<f64>,
    yield_us: Option<f64>,
) -> PyResult<WaitPolicy> {
    WaitPolicy::from_micros(processes, spin_us, yield_us).or_raise()
}

/// A cancel event checked without the GIL: what `shmq._aio` hands a wait it runs in an
/// executor thread, and sets when the coroutine that awaits it is cancelled, so that
/// the thread's wait ends within a few milliseconds (never taking a message after its
/// coroutine gave up). Any blocking call's `cancel` argument takes it, as it takes a
/// `threading.Event`; unlike one, it is looked at every few milliseconds without the
/// GIL and without letting go of the object's lock.
#[pyclass(module = "shmq._core", frozen)]
pub struct CancelFlag {
    flag: Arc<AtomicBool>,
}

#[pymethods]
impl CancelFlag {
    #[new]
    fn new() -> CancelFlag {
        CancelFlag {
            flag: Arc::default(),
        }
    }

    /// End the waits given this flag (within a few milliseconds), now and from now on.
    fn set(&self) {
        // Relaxed: the flag carries no data; a wait sees it at its next check.
        self.flag.store(true, Ordering::Relaxed);
    }

    fn is_set(&self) -> bool {
        // Relaxed: as in `set`.
        self.flag.load(Ordering::Relaxed)
    }
}

/// What a blocking call checks every few milliseconds: signals (their Python handlers
/// run; an exception they raise ends the call) and the cancel event.
struct Checks {
    timeout: Option<Duration>,
    cancel: Option<Py<PyAny>>,
    /// The cancel event when it is a [`CancelFlag`]: checked without the GIL.
    flag: Option<Arc<AtomicBool>>,
    quiet: bool,
    /// Whether to run the Python checks at all: they take the GIL every few ms, only
    /// worth it for a cancel event that is not a `CancelFlag`, or in the main thread,
    /// where Ctrl-C must interrupt the wait. Other waits sleep undisturbed (shutdown()
    /// and the timeout still end them at once).
    needed: bool,
}

impl Checks {
    fn new(py: Python<'_>, interrupts: Interrupts<'_, '_>) -> Checks {
        let event = interrupts.cancel.filter(|c| !c.is_none());
        let flag = event
            .and_then(|c| c.cast::<CancelFlag>().ok())
            .map(|f| f.get().flag.clone());
        let cancel: Option<Py<PyAny>> =
            event.filter(|_| flag.is_none()).map(|c| c.clone().unbind());
        Checks {
            timeout: duration(interrupts.timeout),
            needed: cancel.is_some() || is_main_thread(py),
            cancel,
            flag,
            quiet: interrupts.quiet,
        }
    }

    /// Whether the call needs a hook at all.
    fn hooked(&self) -> bool {
        self.needed || self.flag.is_some()
    }

    /// Whether the `CancelFlag` is set (no GIL needed).
    fn flagged(&self) -> bool {
        // Relaxed: see `CancelFlag::set`.
        self.flag
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Run the checks (with the GIL): `Ok(true)` if the cancel event is set, the error a
    /// signal handler (or `is_set`) raised.
    fn run(&self, py: Python<'_>) -> PyResult<bool> {
        if self.flagged() {
            return Ok(true);
        }
        py.check_signals()?;
        match &self.cancel {
            Some(c) => c.bind(py).call_method0("is_set")?.is_truthy(),
            None => Ok(false),
        }
    }
}

/// Run the core's blocking call `f` with the GIL released, handing it the caller's terms
/// as a [`WaitSpec`]: the timeout, quiet or not, and a hook that checks signals (Ctrl-C)
/// and the `cancel` event every few milliseconds. What the wait is for, how it spins and
/// sleeps, and `shutdown()` are the core's business. For a call that holds no lock of
/// the binding (the hook runs Python code); one that does uses [`blocking_on`].
pub(crate) fn blocking<T, E, F>(py: Python<'_>, interrupts: Interrupts<'_, '_>, f: F) -> PyResult<T>
where
    T: Send,
    E: Into<Error>,
    F: for<'w> FnOnce(WaitSpec<'w>) -> Result<T, E> + Send,
{
    let checks = Checks::new(py, interrupts);
    let mut raised: Option<PyErr> = None;
    let result = py.detach(|| {
        let mut hook = || -> Result<()> {
            if checks.flagged() {
                return Err(Error::Cancelled);
            }
            if !checks.needed {
                return Ok(());
            }
            Python::attach(|py| match checks.run(py) {
                Ok(false) => Ok(()),
                Ok(true) => Err(Error::Cancelled),
                Err(e) => {
                    raised = Some(e);
                    Err(Error::Cancelled)
                }
            })
        };
        f(WaitSpec {
            timeout: checks.timeout,
            hook: checks.hooked().then_some(&mut hook as Hook<'_>),
            quiet: checks.quiet,
            resume: None,
        })
        .map_err(Into::into)
    });
    match raised {
        Some(e) => Err(e),
        None => result.map_err(exception),
    }
}

/// Run the blocking call `f` on the core object behind `lock` (a queue's writer or
/// reader) with the GIL released, as [`blocking`] does, but never running Python code
/// with the lock held: every few milliseconds the call's hook ends it, the lock is let
/// go, the checks run (signal handlers and the cancel event's `is_set`, which may call
/// this same object: its getters, `shutdown()`), and `f` is called again under the lock
/// with the same [`WaitClock`], so the wait goes on where it stopped (same deadline,
/// warnings and statistics; the core never ends a call at its hook once it has sent
/// anything: see `Wait::commit`). A [`CancelFlag`] needs no pause: the hook ends the
/// call (`Error::Cancelled`) once it is set. Another thread may hold the object when the
/// call begins, or take it between two calls: waiting for it counts against the call's
/// timeout and ends at its deadline or cancel event ([`lock_within`]), so a thread
/// blocked in a call of its own never holds this one up past its timeout. Returns
/// `f`'s value with the lock still held, for what must follow under the same hold.
/// (The core's errors name their queue themselves.)
pub(crate) fn blocking_on<'l, S, T, E, F>(
    py: Python<'_>,
    lock_: &'l BindingLock<S>,
    what: &str,
    interrupts: Interrupts<'_, '_>,
    mut f: F,
) -> PyResult<(BindingGuard<'l, S>, T)>
where
    S: Send,
    T: Send,
    E: Into<Error>,
    F: for<'w> FnMut(&mut S, WaitSpec<'w>) -> Result<T, E> + Send,
{
    let checks = Checks::new(py, interrupts);
    let started = Instant::now();
    let deadline = checks.timeout.and_then(|t| deadline_after(started, t));
    let mut clock = WaitClock::default();
    let mut guard = match lock_within(py, lock_, what, &checks, started, deadline)? {
        Ok(g) => g,
        Err(e) => return Err(exception(e)),
    };
    loop {
        let state = &mut *guard;
        let mut paused = false;
        // What is left of the call's timeout (a wait for the lock counts); a resumed call
        // keeps its clock's deadline instead.
        let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let result = py.detach(|| {
            // Ends the call so that the checks run with the lock let go; a set
            // CancelFlag ends it for good.
            let mut pause = || -> Result<()> {
                if checks.flagged() {
                    return Err(Error::Cancelled);
                }
                if !checks.needed {
                    return Ok(());
                }
                paused = true;
                Err(Error::Cancelled)
            };
            f(
                state,
                WaitSpec {
                    timeout,
                    hook: checks.hooked().then_some(&mut pause as Hook<'_>),
                    quiet: checks.quiet,
                    resume: Some(&mut clock),
                },
            )
            .map_err(Into::<Error>::into)
        });
        match result {
            Ok(v) => return Ok((guard, v)),
            Err(e) if !paused => return Err(exception(e)),
            Err(_) => drop(guard),
        }
        if checks.run(py)? {
            return Err(exception(Error::Cancelled));
        }
        guard = match lock_within(py, lock_, what, &checks, started, clock.deadline())? {
            Ok(g) => g,
            Err(e) => return Err(exception(e)),
        };
    }
}

/// Take `lock_` for a blocking call with `checks` that began at `started`: at once if it
/// is free; else wait (GIL released, asleep until the thread that holds it lets go) no
/// longer than `deadline`, then `Error::Timeout` naming the wait, and running the
/// checks every few milliseconds where the call has them (`Error::Cancelled` once its
/// cancel event is set). What a call waits for, when another thread is in a call of its
/// own on the same object (a `dequeue` without a timeout, say), is that call's end: no
/// more than its own timeout.
fn lock_within<'l, S: Send>(
    py: Python<'_>,
    lock_: &'l BindingLock<S>,
    what: &str,
    checks: &Checks,
    started: Instant,
    deadline: Option<Instant>,
) -> PyResult<Result<BindingGuard<'l, S>>> {
    /// How often the checks run while the lock is held by another thread.
    const CHECKS_EVERY: Duration = Duration::from_millis(10);
    /// One sleep without checks or deadline (woken anyway when the lock is let go).
    const LONGEST: Duration = Duration::from_secs(3600);
    loop {
        if let Some(guard) = try_lock(lock_, what)? {
            return Ok(Ok(guard));
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Ok(Err(Error::Timeout {
                what: format!("waiting for this {what}, which another thread is using"),
                waited: now.saturating_duration_since(started),
            }));
        }
        let mut slice = if checks.hooked() {
            CHECKS_EVERY
        } else {
            LONGEST
        };
        if let Some(d) = deadline {
            slice = slice.min(d.saturating_duration_since(now));
        }
        py.detach(|| lock_.wait_free(slice));
        if checks.flagged() || (checks.needed && checks.run(py)?) {
            return Ok(Err(Error::Cancelled));
        }
    }
}

/// Whether the calling thread is Python's main thread (the one that gets signals).
fn is_main_thread(py: Python<'_>) -> bool {
    let check = || -> PyResult<bool> {
        let threading = py.import("threading")?;
        let main = threading.call_method0("main_thread")?;
        Ok(main.is(&threading.call_method0("current_thread")?))
    };
    // If it cannot be told, keep the hook: a few wake-ups are cheaper than a lost Ctrl-C.
    check().unwrap_or(true)
}

/// The mutex around a binding object's core state. Besides the mutex it knows which
/// thread holds it, so that a call into the object from Python code that one of the
/// object's own calls runs under the lock is an error instead of a deadlock on itself.
///
/// The bindings call no user code under these locks (a `free_buf` callback runs with
/// the ring unlocked; a blocking queue call lets go of its lock to check for signals and
/// its cancel event: [`blocking_on`]). What remains: any Python object made under a lock
/// may start the garbage collector, which may run a finalizer; one that calls the same
/// object gets the error.
pub(crate) struct BindingLock<T> {
    mutex: Mutex<T>,
    /// The holder's thread token (`thread_token`), 0 when free. Relaxed: only compared
    /// with the caller's own token, which only the caller's own thread ever stores here,
    /// and a thread always reads its own last store (or a later one).
    holder: AtomicUsize,
    /// Threads asleep in [`wait_free`](Self::wait_free) (or about to be): a guard that
    /// lets go wakes them only then.
    waiting: AtomicUsize,
    /// Held by a waiter from its look at the mutex until it sleeps on `released`, and by
    /// a guard that lets go before it wakes them: so no wake-up falls between the two.
    gate: Mutex<()>,
    released: Condvar,
}

impl<T> BindingLock<T> {
    pub(crate) fn new(value: T) -> BindingLock<T> {
        BindingLock {
            mutex: Mutex::new(value),
            holder: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            gate: Mutex::new(()),
            released: Condvar::new(),
        }
    }

    /// Sleep (call it with the GIL released) until the lock is let go, or `slice`
    /// passes, or spuriously; return at once if it looks free. Takes nothing: the
    /// caller tries the lock again.
    fn wait_free(&self, slice: Duration) {
        // Relaxed RMW, then the SeqCst fence: pairs with the fence in
        // `BindingGuard::drop` (a Dekker pair on `waiting` and the mutex's own word).
        // Either that guard's load of `waiting` sees this waiter, and it wakes it after
        // taking `gate` (so after this waiter sleeps), or this waiter's look at the mutex
        // below (after its fence) sees the unlock that came before the guard's fence.
        self.waiting.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let gate = self.gate.lock().unwrap_or_else(PoisonError::into_inner);
        match self.mutex.try_lock() {
            Err(TryLockError::WouldBlock) => drop(self.released.wait_timeout(gate, slice)),
            // Free (or poisoned: the caller's `try_lock` says so): let go at once, under
            // `gate`, so that no waiter looks at the mutex while this look holds it.
            free => drop(free),
        }
        // Relaxed: a late decrement only costs a guard one needless wake-up.
        self.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A held `BindingLock`: the core state, until dropped.
pub(crate) struct BindingGuard<'a, T> {
    /// Dropped by hand (in `drop`, before the waiters are woken).
    guard: ManuallyDrop<MutexGuard<'a, T>>,
    lock: &'a BindingLock<T>,
}

impl<T> Deref for BindingGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for BindingGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for BindingGuard<'_, T> {
    fn drop(&mut self) {
        // Before the mutex is unlocked.
        self.lock.holder.store(0, Ordering::Relaxed);
        // SAFETY: `guard` is dropped exactly once, here, and never used after (this is
        // the guard's own drop). Process-local memory: no other process is involved.
        unsafe { ManuallyDrop::drop(&mut self.guard) };
        // SeqCst: pairs with the fence in `BindingLock::wait_free` (see there).
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence above.
        if self.lock.waiting.load(Ordering::Relaxed) > 0 {
            // A waiter that saw the mutex held is asleep once `gate` is free again.
            drop(
                self.lock
                    .gate
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner),
            );
            self.lock.released.notify_all();
        }
    }
}

/// A number that names the calling thread for as long as it lives (never 0): the address
/// of one of its thread-locals.
fn thread_token() -> usize {
    thread_local!(static TOKEN: u8 = const { 0 });
    TOKEN.with(|t| t as *const u8 as usize)
}

/// Lock `m` without ever blocking while holding the GIL: another thread may hold the
/// lock while it waits for the GIL.
///
/// Errors, each a `RuntimeError` naming `what` (`"queue writer"`, `"ring buffer"`, ...):
/// - the lock is held by this thread already: the object was called from Python code
///   that one of its own calls runs with the lock held (a finalizer the garbage
///   collector ran: see [`BindingLock`]); waiting would never end;
/// - a panic poisoned the lock (a bug, or a `PanicException` raised by such code, which
///   pyo3 resumes as a panic): the state it guards may be half-updated, so the object
///   is unusable from then on, never silently used.
pub(crate) fn lock<'a, T: Send>(
    py: Python<'_>,
    m: &'a BindingLock<T>,
    what: &str,
) -> PyResult<BindingGuard<'a, T>> {
    loop {
        if let Some(guard) = try_lock(m, what)? {
            return Ok(guard);
        }
        // Asleep until the holder lets go (a poisoned lock is seen as such by the next
        // `try_lock`).
        py.detach(|| m.wait_free(Duration::from_secs(3600)));
    }
}

/// [`lock`] if that needs no wait; `None` while another thread holds the lock.
pub(crate) fn try_lock<'a, T: Send>(
    m: &'a BindingLock<T>,
    what: &str,
) -> PyResult<Option<BindingGuard<'a, T>>> {
    let me = thread_token();
    match m.mutex.try_lock() {
        Ok(guard) => {
            m.holder.store(me, Ordering::Relaxed);
            Ok(Some(BindingGuard {
                guard: ManuallyDrop::new(guard),
                lock: m,
            }))
        }
        Err(TryLockError::Poisoned(_)) => Err(poisoned(what)),
        Err(TryLockError::WouldBlock) if m.holder.load(Ordering::Relaxed) == me => {
            Err(PyRuntimeError::new_err(format!(
                "this {what} was called from code that one of its own calls is running \
                     (a finalizer run by the garbage collector); that call holds it until \
                     it returns"
            )))
        }
        Err(TryLockError::WouldBlock) => Ok(None),
    }
}

/// The error for an object whose lock a panic poisoned.
fn poisoned(what: &str) -> PyErr {
    PyRuntimeError::new_err(format!(
        "this {what} is unusable: an earlier call panicked while holding its lock \
         (its state may be half-updated); make a new one"
    ))
}
