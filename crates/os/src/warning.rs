//! Where shmq's warnings go ("still waiting for ...", a setting ignored, a segment that
//! could not be removed): to a hook the program set ([`set_warning_hook`]); else to the
//! `log` crate when the program has a logger (Python's `logging` through the bindings);
//! else, with no logger at all, to stderr, so that a program without one still hears
//! that a call with no timeout is blocked and why.

use std::fmt;
use std::sync::RwLock;

/// A function that receives each warning's text.
pub type WarningHook = Box<dyn Fn(&str) + Send + Sync>;

static HOOK: RwLock<Option<WarningHook>> = RwLock::new(None);

/// Send shmq's warnings to `hook` from now on (`None`: back to the `log` crate, or stderr
/// without a logger). The hook runs in the thread that warns, which may hold a queue's
/// writer or reader: it must not call into shmq, and should be quick. To silence
/// shmq's warnings, give a hook that does nothing.
pub fn set_warning_hook(hook: Option<WarningHook>) {
    // A hook that panicked while held leaves the lock poisoned; the slot is still sound.
    *HOOK.write().unwrap_or_else(|e| e.into_inner()) = hook;
}

/// Each layer crate and the path its modules have in the `shmq` crate, which re-exports
/// them (`shmq_workers` is `shmq::workers`; the others' modules are at `shmq`'s root).
const LAYERS: [(&str, &str); 4] = [
    ("shmq_workers", "shmq::workers"),
    ("shmq_core", "shmq"),
    ("shmq_os", "shmq"),
    ("shmq_protocol", "shmq"),
];

/// The `log` target of a record from the module `module` (its `module_path!()`): the path
/// the module has in the `shmq` crate (`shmq_core::remote` → `shmq::remote`,
/// `shmq_workers::watch` → `shmq::workers::watch`), so that a program's log filter, and
/// Python's `logging.getLogger("shmq")`, see one name for shmq whichever layer logs.
pub fn log_target(module: &str) -> std::borrow::Cow<'_, str> {
    let (krate, rest) = module.split_once("::").unwrap_or((module, ""));
    match LAYERS.iter().find(|(layer, _)| *layer == krate) {
        Some((_, path)) if rest.is_empty() => (*path).into(),
        Some((_, path)) => format!("{path}::{rest}").into(),
        None => module.into(),
    }
}

/// Report a warning (see the module docs) from the module `module` (its `log` target is
/// [`log_target`]); used through the crate's `warn_user!` macro.
pub fn emit(module: &str, args: fmt::Arguments<'_>) {
    if let Some(hook) = HOOK.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
        hook(&args.to_string());
        return;
    }
    let target = log_target(module);
    let target = target.as_ref();
    let metadata = log::Metadata::builder()
        .level(log::Level::Warn)
        .target(target)
        .build();
    // No logger set: its max level is Off and the no-op logger enables nothing. A
    // program that set a logger (at any level) has chosen where warnings go.
    if log::max_level() == log::LevelFilter::Off && !log::logger().enabled(&metadata) {
        let text = args.to_string();
        let text = text.strip_prefix("shmq: ").unwrap_or(&text);
        eprintln!("shmq warning: {text}");
    } else {
        log::warn!(target: target, "{args}");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn a_hook_gets_every_warning() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink = got.clone();
        set_warning_hook(Some(Box::new(move |w| {
            sink.lock().unwrap().push(w.to_owned())
        })));
        warn_user!("shmq: waiting for {} readers", 2);
        set_warning_hook(None);
        warn_user!("shmq: not hooked");
        assert_eq!(*got.lock().unwrap(), ["shmq: waiting for 2 readers"]);
    }

    #[test]
    fn every_layer_logs_under_shmq() {
        assert_eq!(log_target("shmq_core::remote"), "shmq::remote");
        assert_eq!(
            log_target("shmq_os::segment::janitor"),
            "shmq::segment::janitor"
        );
        assert_eq!(log_target("shmq_workers"), "shmq::workers");
        assert_eq!(log_target("shmq_workers::watch"), "shmq::workers::watch");
        assert_eq!(log_target("shmq_protocol::ring"), "shmq::ring");
        assert_eq!(log_target("shmq::relay"), "shmq::relay");
        assert_eq!(log_target("shmq_extra::x"), "shmq_extra::x");
        assert_eq!(log_target("my_app::io"), "my_app::io");
    }
}
