//! Surviving a peer that truncates a segment: `SIGBUS` becomes an error.
//!
//! # The threat
//! A process of the same user can `ftruncate` (or `os.truncate`) any segment's file in
//! `/dev/shm` while others have it mapped. The kernel then takes the lost pages out of
//! every mapping of the file, shared and private alike, and the next access of one of
//! them in any process is a `SIGBUS`, whose default action kills the process: one
//! careless (or broken) peer would take down the writer and every reader. Seals
//! (`F_SEAL_SHRINK`) would forbid the shrink, but only on a memfd, and shmq's segments
//! are named files that unrelated processes open by name (`Handle`s carry names); so
//! shmq keeps its files and makes the fault survivable instead.
//!
//! # The handler
//! Every mapping shmq makes of a segment — a [`Segment`](crate::segment::Segment)'s
//! shared mapping (ring, store, arena, encoder cache), a private window or view of one
//! ([`PrivateFile`](crate::private_map::PrivateFile)) — is entered in a fixed, lock-free
//! registry ([`Watch::protect`]) for as long as it is mapped, and taken out before it is
//! unmapped (a new mapping of a segment — a remap, say — must be registered the same
//! way, or a truncation of it kills as before). The first registration in a process
//! installs a `SIGBUS` handler (`SA_SIGINFO | SA_ONSTACK | SA_NODEFER`), once per process:
//! a handler the program (or Python's `faulthandler.enable()`, or a runtime) installs
//! later stays installed, and shmq never puts its own back over it (doing so would make
//! shmq chain to a handler that chains back to it, and a guard against that loop would
//! kill programs whose own handler runs in two threads at once or leaves through
//! `siglongjmp`). On a `SIGBUS` the kernel raised
//! for an address inside a registered mapping, the handler maps fresh anonymous zero
//! pages over the *whole* mapping (`mmap(MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS)`, at
//! the same address, readable and writable), sets the mapping's *hit* flag and returns:
//! the faulting access is retried and reads (or writes) zeros. Any other `SIGBUS` — an
//! address that is not shmq's, or a signal sent with `kill` — goes to the handler that
//! was installed before (Python's `faulthandler`, a runtime's), or, where that was the
//! default action, happens again under the default action: the process dies of it as
//! before. No loop can arise: shmq chains only to the handler that was there before its
//! own, which cannot know of shmq's; so the handler keeps no state across a chained call
//! (a handler that recovers with `siglongjmp`, or runs in several threads at once, works
//! as it does without shmq).
//!
//! The handler is async-signal-safe: it reads and sets atomics, calls `mmap`,
//! `sigaction` and `raise` (system calls; glibc's and musl's `mmap` take no lock) and
//! nothing else — no allocation, no lock, no logging. It trusts that a registered range
//! is mapped: a guard is released before its mapping goes, and nothing of shmq touches a
//! mapping while its owner unmaps it (the owner keeps it while any access can happen).
//!
//! # Turning the damage into an error
//! The zero pages only keep the process alive: the segment's content is lost to it. Each
//! layer asks its segment's flag (one atomic load) where a call begins and where a
//! message or value is done, and at each liveness step of a wait (about once a second)
//! also compares the file's size with the mapping (a `stat`, so a blocked call notices a
//! truncation that none of its accesses has hit); it then returns
//! [`Error::BadSegment`] naming the segment and the truncation ([`truncated`]): a Python
//! `ValueError`. Private views compare the file's size with their range before they map
//! it (`fstat`), so a reader is refused a part of a segment shrunk under it before it
//! touches a page. What a call was doing when the fault came may have read or written
//! zeros (a message the writer wrote into the zero pages reaches no reader; a buffer a
//! reader was handed before the truncation reads zeros): that call, or the next one,
//! reports the truncation; no call returns as if nothing happened once the flag is set,
//! and no process dies of it. A process that touches only pages a truncation left (one
//! to half the size, say) goes on working until it touches a lost one, a wait looks at
//! the size, or it reserves more pages. A reservation ([`Segment::reserve_range`](crate::segment::Segment::reserve_range),
//! `fallocate` with `FALLOC_FL_KEEP_SIZE`) never changes the file's size and compares
//! it with the mapping before and after: a writer never grows a truncated file back
//! (that would hand every process zeros where the lost pages were, with no fault to tell
//! it), and the shrink it finds is its error. A size check that found the file
//! short is remembered like a fault: the segment's checks fail from then on, also if the
//! file is grown again. Calls that answer from the process's own records without
//! touching the segment compare its size first (the store's `put` before it writes,
//! `is_cached`, `get_cached`: an `fstat` of the creator's descriptor), and a queue reader
//! asks the flags of the tensor arena's mappings at every call, not only for a message
//! with a part there (a view it handed out may read zeros now).
//!
//! # What this guarantees, and what it cannot (the same user's processes)
//! shmq defends against accidents and crashes of peers — a process that dies at any
//! point, a tool or script that truncates, removes or scribbles on a segment by mistake,
//! corrupt bytes — not against a malicious process of the same user, which can do
//! anything shmq's own processes can: `ptrace` them, `kill` them, write any byte of any
//! segment. Against such peers shmq guarantees that no participant crashes because of
//! what a peer did to a segment (a truncation is an error in the process that finds it;
//! corrupt bytes are checked where they are read) and that no wait lasts past its
//! timeout. Liveness ([`crate::liveness`]) proves death, never life against a hostile
//! peer: a role lock that is free proves its holder is gone, but any process that can
//! open the file can take or hold a lock on the byte — a peer that holds a read lock on a
//! dead reader's liveness byte makes the reader look alive (the writer then waits for it
//! until its timeout, and `drop` does not drop it), and a peer can take a free rank's
//! lock. So "alive" means "someone holds the role's lock", and a writer whose reader
//! looks alive but never reads still ends its wait at the timeout, with an error that
//! names the reader.
//!
//! # Limits
//! The registry has [`SLOTS`] entries; a mapping made when it is full is not protected
//! (a debug log says so) and a truncation of it kills as before. A file that another
//! process truncates and grows back to its length (two `truncate`s) before any shmq
//! process touches a lost page or looks at the size is not found: the lost pages then
//! read zeros, with no fault. A handler installed over
//! shmq's (`faulthandler.enable()` after shmq mapped a segment) gets every `SIGBUS` first,
//! for good: a truncation then does what that handler does with it (faulthandler reports
//! it and re-raises it as a sent signal, which kills: as it would without shmq); one that
//! calls the handler it replaced with the fault's own siginfo gets shmq's error instead.
//! The handler is Linux's
//! (`si_addr`, `MAP_FIXED` semantics).

use shmq_protocol::sync::local::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::Error;

/// The most mappings protected at once (each segment is one; a reader's window and each
/// of its views mapped on their own are one each).
pub const SLOTS: usize = 4096;

/// One registry entry. `state` says what the other words hold: [`FREE`], [`BUSY`] (being
/// filled or emptied: the handler skips it) or [`LIVE`].
struct Slot {
    state: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
    /// The mapping's hit flag (an `Arc<AtomicBool>` that the [`Guard`] keeps alive).
    hit: AtomicPtr<AtomicBool>,
}

const FREE: usize = 0;
const BUSY: usize = 1;
const LIVE: usize = 2;

#[allow(clippy::declare_interior_mutable_const)] // only to build the array below
const EMPTY: Slot = Slot {
    state: AtomicUsize::new(FREE),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    hit: AtomicPtr::new(std::ptr::null_mut()),
};

static REGISTRY: [Slot; SLOTS] = [EMPTY; SLOTS];

/// How many `SIGBUS`es the handler turned into zero pages in this process (for tests and
/// logs).
static HITS: AtomicUsize = AtomicUsize::new(0);

/// Whether some mapping of the thing watched was hit: shared by every mapping of one
/// segment in this process that is registered through it.
#[derive(Clone, Debug, Default)]
pub struct Watch {
    hit: Arc<AtomicBool>,
}

impl Watch {
    pub fn new() -> Watch {
        Watch::default()
    }

    /// Whether the handler found one of this watch's mappings truncated.
    #[inline]
    pub fn hit(&self) -> bool {
        // Acquire: pairs with the handler's Release store, made after it replaced the
        // mapping: whoever sees the flag sees the zero pages (and not the file's) there.
        self.hit.load(Ordering::Acquire)
    }

    /// Register `len` bytes at `start` (a mapping of a segment just made) until the
    /// returned guard is dropped, which must happen before the mapping is unmapped.
    pub fn protect(&self, start: *mut u8, len: usize) -> Guard {
        let slot = register(
            start as usize,
            len,
            Arc::as_ptr(&self.hit) as *mut AtomicBool,
        );
        Guard {
            slot,
            hit: self.hit.clone(),
        }
    }
}

/// A registered mapping; dropping it takes the mapping out of the registry.
#[derive(Debug)]
pub struct Guard {
    slot: Option<usize>,
    /// The flag the slot points to (kept alive while the slot is registered).
    hit: Arc<AtomicBool>,
}

impl Guard {
    /// Whether the handler found this mapping (or another of its watch's) truncated.
    #[inline]
    pub fn hit(&self) -> bool {
        // Acquire: as in `Watch::hit`.
        self.hit.load(Ordering::Acquire)
    }

    /// Take the mapping out of the registry now (before it is unmapped); dropping the
    /// guard does the same.
    pub fn release(&mut self) {
        if let Some(i) = self.slot.take() {
            let slot = &REGISTRY[i];
            // Relaxed: only this guard's owner moves the slot out of LIVE (the handler
            // never changes `state`); BUSY keeps the handler off the words while...
            slot.state.store(BUSY, Ordering::Relaxed);
            slot.hit.store(std::ptr::null_mut(), Ordering::Relaxed);
            // Release: ...they are cleared, and a later registration that takes the
            // slot (Acquire in its compare-exchange) starts after all of this.
            slot.state.store(FREE, Ordering::Release);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.release();
    }
}

/// The error a layer returns once its segment was found truncated: a
/// [`Error::BadSegment`] naming it, with its size now if it can still be read.
pub fn truncated(name: &str, mapped: usize) -> Error {
    let now = std::fs::metadata(crate::segment_file::path(name)).map(|m| m.len());
    truncation(name, mapped, now)
}

/// [`truncated`] for a file whose size was just read (`len`, below `mapped`) through a
/// descriptor: the same error, with that size.
pub fn truncated_to(name: &str, mapped: usize, len: u64) -> Error {
    truncation(name, mapped, Ok(len))
}

fn truncation(name: &str, mapped: usize, now: std::io::Result<u64>) -> Error {
    let reason = match now {
        // As long as it was: the fault was not a shrink that lasted.
        Ok(len) if len >= mapped as u64 => format!(
            "a page of it could not be had (SIGBUS) though it is {len} bytes long: another \
             process truncated it and grew it again, or /dev/shm ran out of memory; its \
             content is lost (this process reads zeros there instead of dying of SIGBUS)"
        ),
        _ => format!(
            "it was truncated by another process while in use ({}, {mapped} bytes were \
             mapped here): its content is lost (this process reads zeros there instead of \
             dying of SIGBUS)",
            now.map_or_else(|_| "gone now".into(), |len| format!("{len} bytes long now"))
        ),
    };
    Error::BadSegment {
        name: name.to_owned(),
        reason,
    }
}

/// How many faults the handler has turned into zero pages in this process.
#[cfg_attr(not(test), allow(dead_code))]
pub fn hits() -> usize {
    // Relaxed: a statistic.
    HITS.load(Ordering::Relaxed)
}

fn register(start: usize, len: usize, hit: *mut AtomicBool) -> Option<usize> {
    if len == 0 {
        return None;
    }
    #[cfg(target_os = "linux")]
    install();
    for (i, slot) in REGISTRY.iter().enumerate() {
        // Acquire: pairs with the Release store of FREE in `Guard::release`.
        if slot
            .state
            .compare_exchange(FREE, BUSY, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            // Relaxed: published by the Release store of LIVE below.
            slot.start.store(start, Ordering::Relaxed);
            slot.len.store(len, Ordering::Relaxed);
            slot.hit.store(hit, Ordering::Relaxed);
            // Release: pairs with the handler's Acquire load of `state`: a handler that
            // sees LIVE sees the words above.
            slot.state.store(LIVE, Ordering::Release);
            return Some(i);
        }
    }
    static FULL: std::sync::Once = std::sync::Once::new();
    FULL.call_once(|| {
        shmq_log!(
            debug,
            "shmq: more than {SLOTS} mappings at once; later ones are not protected from \
             SIGBUS if a peer truncates their segment"
        )
    });
    None
}

#[cfg(target_os = "linux")]
use linux::install;

#[cfg(target_os = "linux")]
mod linux {
    use super::*;
    use std::sync::Mutex;

    /// The handler that was installed before ours (`sa_sigaction`: a function, or
    /// `SIG_DFL`/`SIG_IGN`) and its `sa_flags`.
    static PREV_ACTION: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
    static PREV_FLAGS: AtomicUsize = AtomicUsize::new(0);

    /// Set once the handler was installed in this process (a forked child inherits the
    /// handler and this flag alike): never again, whatever was installed over it since.
    static INSTALLED: AtomicBool = AtomicBool::new(false);

    /// Serializes installations (never taken in the handler).
    static INSTALLING: Mutex<()> = Mutex::new(());

    fn ours() -> usize {
        handler as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize
    }

    /// Install the handler, the first time only; the handler current then becomes the
    /// one chained to.
    pub fn install() {
        // Relaxed: a shortcut only; the flag is read again under the lock below.
        if INSTALLED.load(Ordering::Relaxed) {
            return;
        }
        let _g = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
        // Relaxed: written and read under INSTALLING.
        if INSTALLED.swap(true, Ordering::Relaxed) {
            return;
        }
        // SAFETY: all-zero is a valid sigaction (no handler, no flags, empty mask).
        let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: queries the current action into a valid struct; changes nothing.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut current) } != 0 {
            return;
        }
        if current.sa_sigaction == ours() {
            return;
        }
        // Release: pairs with the handler's Acquire loads (a handler running once ours
        // is installed below sees the action it chains to).
        PREV_FLAGS.store(current.sa_flags as usize, Ordering::Release);
        PREV_ACTION.store(current.sa_sigaction, Ordering::Release);
        // SAFETY: as above.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = ours();
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
        // SAFETY: a valid action whose handler is async-signal-safe (see `handler`);
        // `sa_mask` is empty (zeroed), which is valid.
        unsafe {
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
        }
    }

    /// The registered mapping that contains `addr`: `(start, len, hit flag)`.
    fn find(addr: usize) -> Option<(usize, usize, *mut AtomicBool)> {
        for slot in REGISTRY.iter() {
            // Acquire: pairs with the Release store of LIVE in `register`.
            if slot.state.load(Ordering::Acquire) != LIVE {
                continue;
            }
            // Relaxed: ordered by the Acquire load above.
            let (start, len) = (
                slot.start.load(Ordering::Relaxed),
                slot.len.load(Ordering::Relaxed),
            );
            if addr >= start && addr - start < len {
                return Some((start, len, slot.hit.load(Ordering::Relaxed)));
            }
        }
        None
    }

    #[allow(
        clippy::disallowed_methods,
        reason = "maps anonymous zero pages over a segment's mapping, no file (clippy.toml)"
    )]
    extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
        // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
        let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
        // si_code > 0: raised by the kernel for a fault (si_addr is the address); a
        // signal sent by a process (kill, tgkill, sigqueue) has si_code <= 0.
        if code > 0 {
            if let Some((start, len, hit)) = find(addr) {
                // SAFETY: `start..start + len` is a mapping of a segment this process
                // made and still has (registered until just before it is unmapped; an
                // access of it, like this one, means its owner is alive and keeps it).
                // MAP_FIXED replaces it at once by private zero pages; whatever a peer
                // does to the file can no longer fault here. NORESERVE: the pages cost
                // memory only where this process writes them.
                let p = unsafe {
                    libc::mmap(
                        start as *mut libc::c_void,
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE
                            | libc::MAP_ANONYMOUS
                            | libc::MAP_FIXED
                            | libc::MAP_NORESERVE,
                        -1,
                        0,
                    )
                };
                if p != libc::MAP_FAILED {
                    if !hit.is_null() {
                        // SAFETY: the slot's flag lives in an Arc that its guard keeps
                        // until after the slot is freed.
                        // Release: pairs with the Acquire in `Watch::hit`.
                        unsafe { (*hit).store(true, Ordering::Release) };
                    }
                    // Relaxed: a statistic.
                    HITS.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
        chain(sig, info, ctx, code > 0);
    }

    /// Hand a signal that is not ours to the handler installed before ours. Nothing is
    /// kept across the call: that handler may run in several threads at once, or never
    /// return (`siglongjmp`).
    fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void, fault: bool) {
        // Acquire: pairs with the Release stores in `install`.
        let action = PREV_ACTION.load(Ordering::Acquire);
        let flags = PREV_FLAGS.load(Ordering::Acquire) as libc::c_int;
        if action == libc::SIG_IGN && !fault {
            return;
        }
        if action == libc::SIG_DFL || action == libc::SIG_IGN || action == ours() {
            // Back to the default action, then let it happen: a fault repeats when the
            // handler returns (and kills, with the faulting address in the core), a sent
            // signal is sent again (not blocked: SA_NODEFER).
            // SAFETY: all-zero is a valid sigaction; SIG_DFL is 0. sigaction and raise
            // are async-signal-safe.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
                if !fault {
                    libc::raise(sig);
                }
            }
            return;
        }
        if flags & libc::SA_SIGINFO != 0 {
            // SAFETY: the previous handler was installed with SA_SIGINFO, so this is its
            // three-argument function; called as the kernel would have called it.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(action) };
            f(sig, info, ctx);
        } else {
            // SAFETY: installed without SA_SIGINFO: a one-argument handler.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(action) };
            f(sig);
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
#[allow(
    clippy::disallowed_methods,
    reason = "the test makes, maps and truncates a file of its own, not a segment"
)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_truncated_mapping_reads_zeros_and_is_flagged() {
        let path = std::env::temp_dir().join(format!("shmq-sigbus-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let len = 4 * 4096;
        file.set_len(len as u64).unwrap();
        // SAFETY: a new shared mapping of the whole file, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        } as *mut u8;
        assert_ne!(p as *mut libc::c_void, libc::MAP_FAILED);
        let watch = Watch::new();
        let mut guard = watch.protect(p, len);
        // SAFETY: inside the mapping; volatile so that the accesses happen.
        unsafe { p.add(3 * 4096).write_volatile(7) };
        assert!(!watch.hit());
        let before = hits();
        file.set_len(0).unwrap();
        // SAFETY: inside the mapping: the page is gone from the file, so this faults; the
        // handler replaces the mapping with zero pages and the read is retried.
        let v = unsafe { p.add(3 * 4096).read_volatile() };
        assert_eq!(v, 0);
        assert!(watch.hit());
        assert!(hits() > before);
        // Writes go to the zero pages, and nothing faults any more.
        // SAFETY: as above.
        unsafe { p.write_volatile(1) };
        guard.release();
        // SAFETY: our mapping (now anonymous), no longer registered.
        unsafe { libc::munmap(p as *mut libc::c_void, len) };
        let _ = std::fs::remove_file(&path);
        let err = truncated("shmq_test_x", len).to_string();
        assert!(
            err.contains("shmq_test_x") && err.contains("truncated"),
            "{err}"
        );
    }

    #[test]
    fn other_addresses_are_not_ours() {
        assert!(linux_find(0x1000).is_none());
    }

    fn linux_find(addr: usize) -> Option<usize> {
        REGISTRY.iter().position(|s| {
            s.state.load(Ordering::Acquire) == LIVE
                && addr >= s.start.load(Ordering::Relaxed)
                && addr - s.start.load(Ordering::Relaxed) < s.len.load(Ordering::Relaxed)
        })
    }
}
