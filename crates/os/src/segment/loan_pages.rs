//! A writer's loaned pages: sealed (private copy-on-write) once sent, unsealed (shared
//! again) when the loan is dropped, and the unseals to retry when the process was out of
//! mappings.

use shmq_protocol::sync::local::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::{page_size, round_up, Segment};

/// The pages of a writer's loan (a queue's or a store's), which the writer fills in place
/// and then sends by reference. Once sent, [`seal`](Self::seal) turns this process's
/// mapping of them into a private copy-on-write view: the writer still reads what it
/// sent, and its later writes reach nobody — not the readers, not later messages.
/// [`unseal`](Self::unseal) maps them shared again; the owner calls it when the loan is
/// dropped, before the memory can be lent or written again.
#[derive(Debug)]
pub struct LoanPages {
    start: *mut u8,
    len: usize,
    /// Set by the first `seal`. Release/Acquire: a loan is sealed by the thread that sends
    /// it and unsealed by whichever thread drops it; the flag carries "the mapping is
    /// private now" (and `parked` with it) between them (the remaps themselves are
    /// ordered by the kernel's mapping lock).
    sealed: AtomicBool,
    /// Where `seal` parked the shared mapping of the pages, page tables and all (0: not
    /// parked; `unseal` maps them shared afresh). Relaxed: written before the Release
    /// store of `sealed`, read after its Acquire load.
    pub(super) parked: AtomicUsize,
}

// SAFETY: only address ranges and atomics; the pages are touched only through
// `Segment::remap` and `mremap` of this loan's own pages, whose safety arguments hold
// from any thread.
unsafe impl Send for LoanPages {}
// SAFETY: as for Send.
unsafe impl Sync for LoanPages {}

impl LoanPages {
    /// The whole pages of `start..start + len` (`start` page-aligned; `len` is rounded up
    /// to a page, so the loan's allocation must cover that much).
    pub fn new(start: *mut u8, len: usize) -> LoanPages {
        let page = page_size();
        LoanPages {
            start,
            len: round_up(len.max(1), page).unwrap_or(len),
            sealed: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
        }
    }

    /// The loan is being sent: from now on this process's writes to it are its own. Only
    /// the first call remaps. `false` if the pages could not be sealed (out of mappings,
    /// `vm.max_map_count`, say): they are still shared, so the caller must not send them
    /// by reference (a write after the send would reach the readers) but copy them.
    ///
    /// Replacing a filled (so populated) shared mapping costs the kernel a teardown of
    /// every page's entry, which would make a send cost in proportion to its size. So
    /// the shared mapping is first *moved* aside with its page tables
    /// (`mremap(MREMAP_DONTUNMAP)`, Linux 5.13+, far cheaper; the range stays mapped
    /// throughout, empty), and `unseal` moves it back, pages still mapped. Both measured
    /// in `docs/performance.md`, "The cost of sealing sent loans".
    /// Where the kernel cannot, the pages are remapped in place.
    ///
    /// A seal costs the process up to [`SEAL_MAPPINGS`] mappings while the loan lives;
    /// they are asked of `map_budget::take_mappings` first, which refuses them well
    /// before `vm.max_map_count` (the loan is then sent by copy), so that loans never
    /// take the mappings the host program needs.
    pub fn seal(&self, segment: &Segment) -> bool {
        if self.sealed.load(Ordering::Acquire) {
            return true;
        }
        retry_deferred_unseals();
        if !crate::map_budget::take_mappings(SEAL_MAPPINGS) {
            return false;
        }
        let park = self.park();
        match segment.remap(self.start, self.len, false) {
            Ok(()) => {
                self.parked.store(park, Ordering::Relaxed);
                self.sealed.store(true, Ordering::Release);
                true
            }
            Err(e) => {
                if park != 0 {
                    // SAFETY: `park` is the mapping moved aside just above, `len` bytes,
                    // nobody else's; it replaces the (still shared) range at `start`.
                    unsafe { libc::munmap(park as *mut libc::c_void, self.len) };
                }
                crate::map_budget::give_back_mappings(SEAL_MAPPINGS);
                shmq_log!(
                    info,
                    "shmq: a loan could not be sealed, so it is sent by copy: {e}"
                );
                false
            }
        }
    }

    /// Move the loan's shared mapping aside with its page tables, leaving the range
    /// mapped to the same file without page entries (see `seal`); where it went, or 0 if
    /// the kernel could not.
    ///
    /// The move goes to a place reserved for it first (an inaccessible anonymous mapping
    /// of the same size, which `MREMAP_FIXED` replaces): left to pick the place itself,
    /// the kernel refuses (`EINVAL`) a move of some ranges of a file mapping, here (Linux
    /// 6.18) the first one tried at the start of the arena, so that sends fell back to
    /// the costly in-place remap (measured: `docs/performance.md`, "The move aside,
    /// made reliable").
    fn park(&self) -> usize {
        // SAFETY: a new anonymous mapping at a place the kernel picks: it replaces
        // nothing.
        let spot = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if spot == libc::MAP_FAILED {
            return 0;
        }
        // SAFETY: `start..start + len` is whole pages of `segment`'s shared mapping (the
        // owner's allocation), which this process keeps mapped while the loan lives.
        // MREMAP_DONTUNMAP moves its page tables to `spot` (our own reservation of the
        // same size, which it replaces: nothing else lives there) and leaves the old range
        // mapped (to the same file, without page entries), so every address of the loan
        // stays valid. A peer cannot change what is mapped here.
        let park = unsafe {
            libc::mremap(
                self.start as *mut libc::c_void,
                self.len,
                self.len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP,
                spot,
            )
        };
        if park == libc::MAP_FAILED {
            // SAFETY: `spot` is the reservation made above, unused.
            unsafe { libc::munmap(spot, self.len) };
            return 0;
        }
        park as usize
    }

    /// Whether it was sealed (sent) and not unsealed since.
    pub fn is_sealed(&self) -> bool {
        self.sealed.load(Ordering::Acquire)
    }

    /// Map the pages shared again (if sealed). `false` if that failed: the caller must
    /// then never reuse the memory (writes there would reach only this process).
    pub fn unseal(&self, segment: &Segment) -> bool {
        if !self.sealed.load(Ordering::Acquire) {
            return true;
        }
        let park = self.parked.swap(0, Ordering::Relaxed);
        if park != 0 {
            // SAFETY: `park` is this loan's shared mapping, moved aside by `seal` and used
            // by nothing since; MREMAP_FIXED moves it back over the private view at
            // `start` (whole pages of the segment's mapping, which it replaces: the loan's
            // buffer is gone, nothing reads it).
            let back = unsafe {
                libc::mremap(
                    park as *mut libc::c_void,
                    self.len,
                    self.len,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    self.start as *mut libc::c_void,
                )
            };
            if back != libc::MAP_FAILED {
                self.sealed.store(false, Ordering::Release);
                crate::map_budget::give_back_mappings(SEAL_MAPPINGS);
                return true;
            }
            // SAFETY: as above; the parked mapping is dropped, and the pages are mapped
            // shared afresh below.
            unsafe { libc::munmap(park as *mut libc::c_void, self.len) };
        }
        match segment.remap(self.start, self.len, true) {
            Ok(()) => {
                self.sealed.store(false, Ordering::Release);
                crate::map_budget::give_back_mappings(SEAL_MAPPINGS);
                true
            }
            Err(e) => {
                warn_user!(
                    "shmq: a returned loan's memory is kept out of use until this process \
                     can map it again: {e}"
                );
                false
            }
        }
    }
}

/// Mappings a sealed loan may cost: its range split out of the segment's mapping (two
/// splits) and its shared pages parked aside (one).
pub const SEAL_MAPPINGS: usize = 3;

/// The unseals that failed (the process was out of mappings: `unseal` needs one or two
/// for a moment), each with what gives the memory back once it succeeds; tried again by
/// [`retry_deferred_unseals`]. Each entry returns `true` once done (it is then dropped,
/// and with it the pin or hold it kept). Tagged with the fork generation it was made in:
/// a forked child's inherited entries are the parent's, never retried there.
type DeferredUnseal = (u64, Box<dyn FnMut() -> bool + Send>);
static DEFERRED_UNSEALS: Mutex<Vec<DeferredUnseal>> = Mutex::new(Vec::new());
/// Whether `DEFERRED_UNSEALS` may hold entries. Relaxed: a hint that spares the common
/// case a lock; the entries themselves are read under the mutex.
static ANY_DEFERRED_UNSEAL: AtomicBool = AtomicBool::new(false);

/// A loan's memory could not be shared again when it was dropped (`LoanPages::unseal`
/// failed): `retry` tries again (and gives the memory back once it succeeds), at the
/// next seal, loan or allocation of any loan of this process, so that the memory is
/// kept out of use only while the process is out of mappings, never for good.
pub fn defer_unseal(retry: Box<dyn FnMut() -> bool + Send>) {
    let mut list = DEFERRED_UNSEALS.lock().unwrap_or_else(|e| e.into_inner());
    list.push((crate::fork::generation(), retry));
    ANY_DEFERRED_UNSEAL.store(true, Ordering::Relaxed);
}

/// Try the unseals [`defer_unseal`] keeps again; cheap (one atomic load) when there are
/// none.
pub fn retry_deferred_unseals() {
    if !ANY_DEFERRED_UNSEAL.load(Ordering::Relaxed) {
        return;
    }
    let generation = crate::fork::generation();
    let mut list = DEFERRED_UNSEALS.lock().unwrap_or_else(|e| e.into_inner());
    list.retain_mut(|(made_in, retry)| *made_in != generation || !retry());
    if list.iter().all(|(made_in, _)| *made_in != generation) {
        ANY_DEFERRED_UNSEAL.store(false, Ordering::Relaxed);
    }
}
