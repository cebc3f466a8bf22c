//! What this process created — the one registry the exit hook (`remove_created`), the
//! objects' own `unlink` and drops, and the janitor all go by — and the janitor itself:
//! what removes this process's segments when it dies without its exit hook.

use shmq_protocol::sync::local::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};

// ---------------------------------------------------------------------------------
// What this process created, for the exit hook (`remove_created`).
//
// Objects remove what they created when they are dropped, but Python does not promise to
// drop objects at interpreter exit (a queue kept in a module-level list, a loan still
// alive, a daemon thread's locals). So every segment and socket directory is noted here
// while it exists, and the exit hook (`shmq._cleanup`) removes what is left. Entries
// carry the creator's pid: a forked child inherits the list but removes only its own.

/// `(creator pid, name)`: a segment's name, or the absolute path of a directory.
static CREATED: Mutex<Vec<(u32, String)>> = Mutex::new(Vec::new());

/// Names of [`CREATED`] that this process's janitor must leave (see
/// [`Segment::survive_crash`]), with their creator's pid.
static SURVIVORS: Mutex<Vec<(u32, String)>> = Mutex::new(Vec::new());

pub(super) fn survivors() -> std::sync::MutexGuard<'static, Vec<(u32, String)>> {
    SURVIVORS.lock().unwrap_or_else(|e| e.into_inner())
}

fn created() -> std::sync::MutexGuard<'static, Vec<(u32, String)>> {
    // A panic while holding it leaves a plain list, still consistent.
    CREATED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Note a segment name, or the absolute path of a directory in `/dev/shm`, that this
/// process has just created (and tell this process's janitor, if it has one).
pub fn note_created(name_or_path: &str) {
    created().push((std::process::id(), name_or_path.to_owned()));
    tell_janitor(b'+', name_or_path);
}

/// Whether this process noted `name_or_path` ([`note_created`]) and has not removed it
/// since: the one registry of what this process created, which `unlink`, drops and
/// the exit hook all go by.
pub(super) fn is_noted(name_or_path: &str) -> bool {
    let me = std::process::id();
    created()
        .iter()
        .any(|(pid, n)| *pid == me && n == name_or_path)
}

/// Forget a name noted by [`note_created`]: its creator removed it.
pub fn forget_created(name_or_path: &str) {
    let me = std::process::id();
    created().retain(|(pid, n)| !(*pid == me && n == name_or_path));
    survivors().retain(|(pid, n)| !(*pid == me && n == name_or_path));
    tell_janitor(b'-', name_or_path);
}

// ---------------------------------------------------------------------------------
// The janitor: what removes this process's segments when it dies without exit cleanup.
//
// A process killed by SIGKILL (vLLM's shutdown does that to its engine core and workers
// when they linger), by a signal's default action or by a crash runs no destructor and no
// exit hook. So a process can hand one end of a `SOCK_SEQPACKET` socket pair to a
// *janitor*: a small process of its own (the Python package starts one, see
// `shmq._janitor`) that holds the other end. Every name noted above is sent to it as
// `+name`, every removal as `-name`; when every copy of this end is closed — the process
// is gone, however it ended — the janitor reads end-of-file and removes the names still
// listed, each only if the file of that name is still the one this process made (same
// device and inode; a successor may have made a new one under a name given by the caller,
// as vLLM names its multimodal store). No signal handler is needed for it, and nothing
// runs in this process at its death.

/// This process's end of the socket to its janitor, with the pid that set it: a forked
/// child inherits the descriptor but not the janitor (it closes its copy at first use,
/// so that the parent's janitor is not kept waiting for it).
static JANITOR: Mutex<Option<(u32, std::os::fd::OwnedFd)>> = Mutex::new(None);

pub(super) fn janitor() -> std::sync::MutexGuard<'static, Option<(u32, std::os::fd::OwnedFd)>> {
    JANITOR.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hand this process's end of a janitor's socket (a `SOCK_SEQPACKET` pair; see the
/// section above) to the core: every name this process has created and not removed is
/// sent now, and every later one as it comes. Replaces an earlier janitor (whose end is
/// closed, so it removes what it was told and ends). Returns how many names were sent.
pub fn set_janitor(fd: std::os::fd::OwnedFd) -> usize {
    use std::os::fd::AsRawFd;
    let me = std::process::id();
    let mut slot = janitor();
    if let Some((pid, old)) = slot.take() {
        if pid == me {
            // Closed here now: no longer the fork handler's to close in children.
            crate::fork::forget_fd(old.as_raw_fd());
        }
        drop_inherited_or_own(pid, old);
    }
    // Closed in every forked child at the fork itself (a `pthread_atfork` handler: also
    // for a child forked from C, where Python's fork hooks do not run), so that a child
    // that lives on never keeps this process's janitor from seeing it die.
    // Relaxed: read only by this process's own later calls, under the slot's lock.
    JANITOR_CLOSED_IN_CHILDREN.store(
        crate::fork::close_in_children(fd.as_raw_fd()),
        Ordering::Relaxed,
    );
    backlog().clear();
    *slot = Some((me, fd));
    let kept = survivors().clone();
    let names: Vec<String> = created()
        .iter()
        .filter(|(pid, n)| *pid == me && !kept.iter().any(|(p, k)| p == pid && k == n))
        .map(|(_, n)| n.clone())
        .collect();
    for n in &names {
        if !send_to_janitor(&slot, b'+', n) {
            janitor_gone(&mut slot);
            return 0;
        }
    }
    // Segments that survive a crash while others hold them (`Segment::survive_crash`),
    // made before this janitor: its wait for their holders starts now.
    for (_, n) in kept.iter().filter(|(pid, _)| *pid == me) {
        let file =
            crate::segment_file::SegmentFile::try_open(n, crate::segment_file::Access::ReadWrite);
        if let Ok(file) = file {
            hand_to_janitor_locked(&mut slot, n, &file, true);
        }
    }
    names.len()
}

/// Make the socket pair for a janitor: this process's end goes to [`set_janitor`], the
/// other end (close-on-exec, so pass it on explicitly) is returned for the janitor.
///
/// # Errors
///
/// [`Error::Os`] when `socketpair` fails (out of descriptors).
pub fn new_janitor_socket() -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors socketpair(2) writes; nothing else
    // is touched.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(Error::os(
            "making the socket pair for shmq's janitor".to_owned(),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: both descriptors were just made by socketpair(2) and nothing else owns them.
    let (ours, theirs) = unsafe {
        (
            std::os::fd::OwnedFd::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        )
    };
    // Room for many thousands of names queued at once (a burst of creations while the
    // janitor is not scheduled), so that a non-blocking send rarely finds it full.
    let room: libc::c_int = 4 << 20;
    // SAFETY: a valid socket and an int option of the right size; failure is harmless
    // (the default buffer stays).
    unsafe {
        libc::setsockopt(
            ours.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&room as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    set_janitor(ours);
    Ok(theirs)
}

/// Whether this process (not a parent it was forked from) has a janitor.
pub fn has_janitor() -> bool {
    let mut slot = janitor();
    forget_inherited_janitor(&mut slot);
    slot.is_some()
}

/// Close a janitor's socket inherited through `fork` (its janitor is the parent's).
pub fn forget_inherited_janitor_now() {
    forget_inherited_janitor(&mut janitor());
}

fn forget_inherited_janitor(slot: &mut Option<(u32, std::os::fd::OwnedFd)>) {
    if matches!(slot, Some((pid, _)) if *pid != std::process::id()) {
        if let Some((pid, fd)) = slot.take() {
            drop_inherited_or_own(pid, fd);
        }
        backlog().clear(); // the parent's messages, not this process's
    }
}

/// Whether the janitor's descriptor of this process is registered with the fork handler
/// (which closes it in every child at the fork).
static JANITOR_CLOSED_IN_CHILDREN: AtomicBool = AtomicBool::new(false);

/// Close a janitor descriptor, unless it was inherited and the fork handler already closed
/// it in this child (its number may have been reused since: closing it again could close
/// another descriptor of this process).
fn drop_inherited_or_own(pid: u32, fd: std::os::fd::OwnedFd) {
    // Relaxed: see `set_janitor`.
    if pid != std::process::id() && JANITOR_CLOSED_IN_CHILDREN.load(Ordering::Relaxed) {
        std::mem::forget(fd);
    } else {
        drop(fd);
    }
}

/// Messages the janitor's socket had no room for (a janitor not scheduled during a burst
/// of creations): sent before any later message, so that none is lost or reordered.
static BACKLOG: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn backlog() -> std::sync::MutexGuard<'static, Vec<Vec<u8>>> {
    BACKLOG.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn tell_janitor(op: u8, name: &str) {
    let mut slot = janitor();
    forget_inherited_janitor(&mut slot);
    if !send_to_janitor(&slot, op, name) {
        janitor_gone(&mut slot);
    }
}

/// This process's janitor is gone (killed: its end of the socket is closed). Its end is
/// closed here too, so that [`has_janitor`] says so and the Python package starts a new
/// one with the next segment, which is sent every name still noted.
fn janitor_gone(slot: &mut Option<(u32, std::os::fd::OwnedFd)>) {
    use std::os::fd::AsRawFd;
    if let Some((pid, fd)) = slot.take() {
        if pid == std::process::id() {
            crate::fork::forget_fd(fd.as_raw_fd());
        }
        drop_inherited_or_own(pid, fd);
    }
    backlog().clear();
}

/// The identity of a noted name as the janitor checks it before removing it: the device
/// and inode of the file (or directory) itself, never of what a symlink points to. `None`
/// when it is not there (any more).
fn identity(name_or_path: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let path = if name_or_path.starts_with('/') {
        name_or_path.to_owned()
    } else {
        crate::segment_file::path(name_or_path)
    };
    let meta = std::fs::symlink_metadata(path).ok()?;
    (meta.is_file() || meta.is_dir()).then(|| (meta.dev(), meta.ino()))
}

/// Send `+DEV:INO:name` (a creation, with the identity the janitor checks before it
/// removes the name: never a successor's file of the same name, nor a symlink put in its
/// place) or `-name` (a removal).
/// Returns false once the janitor is found gone (its end closed).
fn send_to_janitor(slot: &Option<(u32, std::os::fd::OwnedFd)>, op: u8, name: &str) -> bool {
    let Some((_, fd)) = slot else { return true };
    let mut message = Vec::with_capacity(name.len() + 48);
    message.push(op);
    if op == b'+' {
        // Gone already (removed by someone else meanwhile): nothing for the janitor.
        let Some((dev, ino)) = identity(name) else {
            return true;
        };
        message.extend_from_slice(format!("{dev}:{ino}:").as_bytes());
    }
    message.extend_from_slice(name.as_bytes());
    // The caller holds the slot's lock: the backlog and the socket are used in turn.
    let mut pending = backlog();
    if op == b'-' {
        // A creation still pending and its removal cancel out: the backlog never holds
        // more than the names that exist.
        let creates_name = |m: &Vec<u8>| {
            m.first() == Some(&b'+')
                && m[1..].splitn(3, |&b| b == b':').nth(2) == Some(name.as_bytes())
        };
        if let Some(i) = pending.iter().position(creates_name) {
            pending.remove(i);
            return true;
        }
    }
    let may_wait = pending.is_empty();
    pending.push(message);
    flush_to_janitor(fd, &mut pending, may_wait)
}

/// Send the pending messages, oldest first, until the socket has no room. A socket with
/// no room is given up to 100 ms (a janitor not scheduled at the moment) when nothing was
/// pending before (`may_wait`: once per burst, not per message); what is still pending
/// then waits for the next message. Returns false for a janitor that is gone (EPIPE:
/// its end is closed).
fn flush_to_janitor(fd: &std::os::fd::OwnedFd, pending: &mut Vec<Vec<u8>>, may_wait: bool) -> bool {
    use std::os::fd::AsRawFd;
    let mut sent_count = 0;
    let mut waited = !may_wait;
    while sent_count < pending.len() {
        let message = &pending[sent_count];
        // SAFETY: `fd` is an open socket owned by the slot, which the caller holds locked;
        // `message` is a live buffer of the given length. MSG_NOSIGNAL: a janitor that died
        // is EPIPE here, never a SIGPIPE to the host program. MSG_DONTWAIT: a janitor that
        // does not read (stopped, say) never blocks a segment's creation for long (the
        // wait below is bounded). A message of a SOCK_SEQPACKET socket arrives whole or
        // not at all.
        let sent = unsafe {
            libc::send(
                fd.as_raw_fd(),
                message.as_ptr().cast(),
                message.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if sent >= 0 {
            sent_count += 1;
            continue;
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) if !waited => {
                waited = true;
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one valid pollfd for the duration of the call.
                unsafe { libc::poll(&mut p, 1, 100) };
            }
            Some(libc::EAGAIN) => break, // kept for the next message
            _ => {
                // Gone: nothing more can reach it (the caller closes its end).
                pending.clear();
                return false;
            }
        }
    }
    pending.drain(..sent_count);
    true
}

/// Hand the removal of segment `name`, which this process created, to its janitor: the
/// janitor removes it once no process holds any lock on `wait_on`'s file (a queue's
/// ring, whose readers hold their role locks there until they leave or die), whenever
/// that is — also long after this process is gone — and only while the name is still
/// the file this process made. From then on this process removes it no more (its exit
/// hook, drops and `unlink` leave it): a queue's tensor arena outlives a writer that
/// ends normally while a reader still has messages in it to read (issue 54).
///
/// The janitor gets a descriptor of `wait_on`'s file with the message (`SCM_RIGHTS`), so
/// the wait holds even after that name is removed. Returns false, and changes nothing,
/// where there is no janitor or the message cannot be sent now: the caller removes the
/// segment itself, as before.
///
/// With `keep_noted`, this process still removes it too, as before (its exit hook, drops
/// and `unlink`): the janitor's removal is only for when this process is gone without
/// removing it and the last holder of a lock on `wait_on` has gone too (a named encoder
/// cache that outlives a crashed producer while consumers read it: see
/// `Segment::survive_crash`).
pub(super) fn hand_to_janitor(
    name: &str,
    wait_on: &crate::segment_file::SegmentFile,
    keep_noted: bool,
) -> bool {
    let mut slot = janitor();
    forget_inherited_janitor(&mut slot);
    hand_to_janitor_locked(&mut slot, name, wait_on, keep_noted)
}

/// [`hand_to_janitor`] with the janitor's slot locked by the caller.
fn hand_to_janitor_locked(
    slot: &mut Option<(u32, std::os::fd::OwnedFd)>,
    name: &str,
    wait_on: &crate::segment_file::SegmentFile,
    keep_noted: bool,
) -> bool {
    use std::os::fd::AsRawFd;
    let me = std::process::id();
    if !created().iter().any(|(pid, n)| *pid == me && n == name) {
        return false;
    }
    let Some((dev, ino)) = identity(name) else {
        return false;
    };
    let Some((_, fd)) = slot.as_ref() else {
        return false;
    };
    let mut pending = backlog();
    // What is pending goes first (this very name's `+` may be among it).
    if !flush_to_janitor(fd, &mut pending, true) {
        drop(pending);
        janitor_gone(slot);
        return false;
    }
    if !pending.is_empty() {
        return false; // no room now: the caller removes it, as before
    }
    let message = format!("~{dev}:{ino}:{name}");
    match send_with_descriptor(fd.as_raw_fd(), message.as_bytes(), wait_on.as_raw_fd()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
            drop(pending);
            janitor_gone(slot);
            return false;
        }
        Err(_) => return false,
    }
    drop(pending);
    if !keep_noted {
        created().retain(|(pid, n)| !(*pid == me && n == name));
        survivors().retain(|(pid, n)| !(*pid == me && n == name));
    }
    true
}

/// Send `message` with a copy of descriptor `passed` (`SCM_RIGHTS`) on the janitor's
/// socket `socket`; a socket with no room is given 100 ms.
fn send_with_descriptor(
    socket: libc::c_int,
    message: &[u8],
    passed: libc::c_int,
) -> std::io::Result<()> {
    const FD_SPACE: usize = 64; // CMSG_SPACE(sizeof(int)) is 24 on Linux; room to spare
    #[repr(C, align(8))]
    struct Control([u8; FD_SPACE]);
    let mut control = Control([0; FD_SPACE]);
    let mut iov = libc::iovec {
        iov_base: message.as_ptr() as *mut libc::c_void,
        iov_len: message.len(),
    };
    // SAFETY: all-zero is a valid msghdr (null pointers, zero lengths), filled in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    debug_assert!(space <= FD_SPACE);
    msg.msg_controllen = space as _;
    // SAFETY: `msg` names `control`, an 8-aligned buffer of `space` bytes, so the first
    // header fits in it (CMSG_FIRSTHDR checks the length and is non-null here); its data
    // has room for one int (CMSG_LEN of an int). Nothing else is written.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), passed);
    }
    let mut waited = false;
    loop {
        // SAFETY: `msg` and everything it points to (the message, `iov`, `control`) live
        // for the call; MSG_NOSIGNAL: a janitor that died is EPIPE, never a SIGPIPE to
        // the host program; MSG_DONTWAIT: never blocked on a janitor that does not read
        // (the wait below is bounded). The kernel copies the descriptor into the
        // janitor's table; this process's copy is its own still.
        let sent = unsafe { libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if sent >= 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) if !waited => {
                waited = true;
                let mut p = libc::pollfd {
                    fd: socket,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one valid pollfd for the duration of the call.
                unsafe { libc::poll(&mut p, 1, 100) };
            }
            _ => return Err(err),
        }
    }
}

/// Remove every segment and directory this process created that is still there (at
/// interpreter exit); their mappings stay valid for whoever has them. Returns how many
/// were noted. A live object whose name goes here removes nothing when it is dropped
/// later (the name is no longer noted: a named encoder cache or store may have been
/// created anew by another process meanwhile).
pub fn remove_created() -> usize {
    let me = std::process::id();
    let mine: Vec<String> = {
        let mut list = created();
        let (mine, others) = list.drain(..).partition(|(pid, _)| *pid == me);
        *list = others;
        survivors().retain(|(pid, _)| *pid != me);
        mine.into_iter().map(|(_, n)| n).collect()
    };
    for n in &mine {
        if n.starts_with('/') {
            let _ = std::fs::remove_dir_all(n);
        } else {
            // An absent name is ENOENT: nothing to do.
            let _ = crate::segment_file::unlink(n);
        }
        // Removed: the janitor must not remove it again once this process is gone (a
        // process of the same name's successor may have taken it by then).
        tell_janitor(b'-', n);
    }
    mine.len()
}
