//! Counting shmq's own mappings against the process's limit: [`take_mappings`].
//!
//! Every mapping and every split of one counts against the process's
//! `vm.max_map_count` (65530 by default); past it, every `mmap` of the process fails,
//! the host program's too (numpy's, malloc's). shmq's mappings that grow with what a
//! program holds (a sealed loan: its range split out and its shared pages parked, 3 per
//! loan) ask [`take_mappings`] first and fall back (a loan is sent by copy) when the
//! process would pass three quarters of the limit: a quarter stays for the host. The
//! process's count is read from `/proc/self/maps` at most once a second, or sooner
//! once shmq's own use since reaches a 32nd of the limit (so that a host that grew
//! meanwhile loses at most that much to shmq). `SHMQ_MAX_MAP_COUNT`
//! sets a lower limit than the kernel's (for tests, or to leave the host more).

use std::sync::{Mutex, OnceLock};

/// Environment variable: a mapping limit for shmq's own below `vm.max_map_count`.
pub const MAX_MAP_COUNT_ENV: &str = "SHMQ_MAX_MAP_COUNT";

/// The process's mapping limit as shmq sees it: `vm.max_map_count`, or
/// `SHMQ_MAX_MAP_COUNT` where that is lower (read once). A value that is not a whole
/// number from 0 to the kernel's limit is reported once (a warning naming it and the
/// limit used instead, the kernel's), never ignored silently.
pub fn map_count_limit() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        let kernel = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(65530);
        let raw = std::env::var_os(MAX_MAP_COUNT_ENV);
        let (limit, complaint) = limit_from_env(raw.as_deref(), kernel);
        if let Some(complaint) = complaint {
            warn_user!("shmq: {complaint}");
        }
        limit
    })
}

/// The limit from `SHMQ_MAX_MAP_COUNT`'s value `raw` (`None`: unset) and the kernel's
/// `vm.max_map_count`, and what to report about a value that cannot be used as it is.
fn limit_from_env(raw: Option<&std::ffi::OsStr>, kernel: usize) -> (usize, Option<String>) {
    let Some(raw) = raw else {
        return (kernel, None);
    };
    let text = raw.to_string_lossy();
    match text.trim().parse::<usize>() {
        Ok(lower) if lower <= kernel => (lower, None),
        Ok(higher) => (
            kernel,
            Some(format!(
                "{MAX_MAP_COUNT_ENV}={higher} is above the kernel's vm.max_map_count \
                 ({kernel}), which it can only lower: using {kernel}"
            )),
        ),
        Err(_) => (
            kernel,
            Some(format!(
                "{MAX_MAP_COUNT_ENV}={text:?} is not a whole number of mappings from 0 to \
                 {kernel} (the kernel's vm.max_map_count): it is ignored, using {kernel}"
            )),
        ),
    }
}

/// The process's mappings now: the lines of `/proc/self/maps` (`None` if unreadable).
fn count_mappings() -> Option<usize> {
    use std::io::Read;
    let mut f = std::fs::File::open("/proc/self/maps").ok()?;
    let mut buf = vec![0u8; 1 << 16];
    let mut lines = 0;
    loop {
        match f.read(&mut buf) {
            Ok(0) => return Some(lines),
            Ok(n) => lines += buf[..n].iter().filter(|&&b| b == b'\n').count(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

/// What [`take_mappings`] knows: the room below the ceiling at the last reading of the
/// process's count, when that was, whether a request was refused since, and shmq's own
/// use since (taken minus given back).
struct MapBudget {
    room: usize,
    used_since: isize,
    counted_at: Option<std::time::Instant>,
    refused: bool,
}

static MAP_BUDGET: Mutex<MapBudget> = Mutex::new(MapBudget {
    room: 0,
    used_since: 0,
    counted_at: None,
    refused: false,
});

/// Ask for `n` more mappings of shmq's own (see the module docs): `false` when they would
/// take the process past three quarters of its limit ([`map_count_limit`]); the caller
/// then does without (a loan is copied). Give them back with [`give_back_mappings`].
///
/// The process's count is read again once shmq's own use since the last reading reaches
/// half the room left then, or a 32nd of the limit (the host may have grown meanwhile:
/// shmq takes at most that much of what it left), or a second has passed. A process
/// refused reads it again only after a second (a long `/proc/self/maps` costs
/// milliseconds), unless what shmq gave back since makes room.
pub fn take_mappings(n: usize) -> bool {
    let limit = map_count_limit();
    let mut b = MAP_BUDGET.lock().unwrap_or_else(|e| e.into_inner());
    let fresh = b
        .counted_at
        .is_some_and(|t| t.elapsed() < std::time::Duration::from_secs(1));
    let step = (b.room / 2).min(limit / 32) as isize;
    if fresh && b.used_since + n as isize <= step {
        b.used_since += n as isize;
        return true;
    }
    if fresh && b.refused {
        return false;
    }
    let Some(now) = count_mappings() else {
        return false;
    };
    b.room = (limit / 4 * 3).saturating_sub(now);
    b.used_since = 0;
    b.counted_at = Some(std::time::Instant::now());
    b.refused = n > (b.room / 2).min(limit / 32);
    if b.refused {
        shmq_log!(
            info,
            "shmq: this process has {now} mappings of its limit {limit} (vm.max_map_count \
             or SHMQ_MAX_MAP_COUNT): loans are sent by copy until it has fewer"
        );
        return false;
    }
    b.used_since = n as isize;
    true
}

/// Mappings from [`take_mappings`] are gone again.
pub fn give_back_mappings(n: usize) {
    let mut b = MAP_BUDGET.lock().unwrap_or_else(|e| e.into_inner());
    b.used_since -= n as isize;
}

#[cfg(test)]
mod tests {
    use super::limit_from_env;
    use std::ffi::OsStr;

    /// Issue 44: a bad `SHMQ_MAX_MAP_COUNT` is reported, naming the variable, the value
    /// and the limit used instead.
    #[test]
    fn a_bad_limit_is_reported_with_the_one_used_instead() {
        assert_eq!(limit_from_env(None, 65530), (65530, None));
        assert_eq!(
            limit_from_env(Some(OsStr::new("3000")), 65530),
            (3000, None)
        );
        assert_eq!(limit_from_env(Some(OsStr::new(" 0 ")), 65530), (0, None));
        for bad in ["-1", "abc", "", "1e3", "1180591620717411303424"] {
            let (limit, complaint) = limit_from_env(Some(OsStr::new(bad)), 65530);
            assert_eq!(limit, 65530, "{bad}");
            let complaint = complaint.unwrap();
            assert!(
                complaint.starts_with(&format!("SHMQ_MAX_MAP_COUNT={bad:?} is not a whole number"))
                    && complaint.ends_with("using 65530"),
                "{complaint}"
            );
        }
        let (limit, complaint) = limit_from_env(Some(OsStr::new("100000")), 65530);
        assert_eq!(limit, 65530);
        assert!(complaint
            .unwrap()
            .contains("100000 is above the kernel's vm.max_map_count (65530)"));
    }
}
