//! Who holds a slot: a process is named by its pid *and* its start time, so a pid the
//! kernel has reused for another process is not mistaken for the one that died.

/// A process, as recorded in a segment's slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessId {
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat`, field 22).
    pub start_time: u64,
}

/// `(state, start time)` from `/proc/<pid>/stat`, or `None` if there is no such process.
fn stat(pid: u32) -> Option<(char, u64)> {
    stat_fields(pid).map(|(state, _, start)| (state, start))
}

/// `(state, parent pid, start time)` from `/proc/<pid>/stat`.
fn stat_fields(pid: u32) -> Option<(char, u32, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces: skip past it.
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); field 4 (parent pid) is fields[1], field 22
    // (start time) is fields[19].
    let state = fields.first()?.chars().next()?;
    Some((
        state,
        fields.get(1)?.parse().ok()?,
        fields.get(19)?.parse().ok()?,
    ))
}

/// Every live descendant of `pid` (children, their children, ...), read from `/proc`.
/// A snapshot: processes may start or exit meanwhile, which is why each comes with its
/// start time (signal one only while [`ProcessId::is_alive`] still holds).
pub fn descendants(pid: u32) -> Vec<ProcessId> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut by_parent: std::collections::HashMap<u32, Vec<ProcessId>> = Default::default();
    for entry in dir.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some((state, parent, start_time)) = stat_fields(child) {
            if state != 'Z' && state != 'X' {
                by_parent.entry(parent).or_default().push(ProcessId {
                    pid: child,
                    start_time,
                });
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        for c in by_parent.remove(&p).unwrap_or_default() {
            frontier.push(c.pid);
            out.push(c);
        }
    }
    out
}

/// A clock for statistics that other processes read: `CLOCK_MONOTONIC_COARSE` in
/// nanoseconds (the same clock for every process of the machine, read in a few
/// nanoseconds, a few milliseconds coarse). 0 only if the clock cannot be read.
pub fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime only writes it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

impl ProcessId {
    /// This process.
    pub fn current() -> ProcessId {
        let pid = std::process::id();
        ProcessId {
            pid,
            start_time: stat(pid).map_or(0, |s| s.1),
        }
    }

    /// What its pid says about this process, where nothing better is at hand (role locks
    /// are: see [`crate::liveness`]). A pid that is not visible here (gone, or in another
    /// pid namespace) is `Unknown`; a zombie, or a visible pid whose start time differs,
    /// is `Dead`.
    pub fn liveness(&self) -> crate::liveness::Liveness {
        use crate::liveness::Liveness;
        match stat(self.pid) {
            None => Liveness::Unknown,
            Some((state, _)) if state == 'Z' || state == 'X' => Liveness::Dead,
            Some((_, start)) if self.start_time != 0 && start != self.start_time => Liveness::Dead,
            Some(_) => Liveness::Alive,
        }
    }

    /// Its scheduler state from `/proc/<pid>/stat` (`R` running, `S` sleeping, `T`
    /// stopped, ...) if it is visible here and is still the process of this start time.
    pub fn state(&self) -> Option<char> {
        match stat(self.pid) {
            Some((state, start)) if self.start_time == 0 || start == self.start_time => Some(state),
            _ => None,
        }
    }

    /// Whether this process still runs (a zombie, dead but not yet reaped, does not).
    /// A process in another pid namespace is not visible and counts as dead, so only
    /// call this for processes this one started (children); for peers use
    /// [`liveness`](Self::liveness) or the role locks of [`crate::liveness`].
    pub fn is_alive(&self) -> bool {
        match stat(self.pid) {
            Some((state, start)) => {
                state != 'Z' && state != 'X' && (self.start_time == 0 || start == self.start_time)
            }
            None => false,
        }
    }
}

/// This machine's host name (`gethostname(2)`), or `None` where the call fails.
pub fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname(2) writes at most `buf.len()` bytes into `buf`, which lives
    // through the call.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_process_is_alive_and_others_are_not() {
        let me = ProcessId::current();
        assert!(me.start_time > 0);
        assert!(me.is_alive());
        assert!(
            !ProcessId {
                start_time: me.start_time + 1,
                ..me
            }
            .is_alive(),
            "a reused pid"
        );
        assert!(!ProcessId {
            pid: u32::MAX - 1,
            start_time: 1
        }
        .is_alive());
    }

    #[test]
    fn descendants_include_grandchildren() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .unwrap();
        let t = std::time::Instant::now();
        let mut found = Vec::new();
        while found.is_empty() && t.elapsed().as_secs() < 10 {
            found = descendants(child.id());
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(found.len(), 1, "the shell's sleep");
        assert!(found[0].is_alive());
        assert!(descendants(std::process::id())
            .iter()
            .any(|p| p.pid == child.id()));
        // SAFETY: plain kill(2) of our own grandchild, still alive (checked above).
        unsafe { libc::kill(found[0].pid as libc::pid_t, libc::SIGKILL) };
        child.wait().unwrap();
    }

    #[test]
    fn a_killed_child_is_dead_even_before_it_is_reaped() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let id = ProcessId {
            pid: child.id(),
            start_time: stat(child.id()).unwrap().1,
        };
        assert!(id.is_alive());
        child.kill().unwrap();
        // Not reaped yet: a zombie.
        let t = std::time::Instant::now();
        while id.is_alive() && t.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!id.is_alive());
        child.wait().unwrap();
    }
}
