//! Queues and stores by name, for processes of the same user on this machine, in either
//! language: a writer made with a name holds it ([`claim`]) and records its handle under
//! it; a reader that knows only the name finds the handle ([`lookup`]). Rust's
//! `QueueOptions { name, record_name: true, .. }` and `Reader::open_by_name`, Python's
//! `MessageQueue(..., name=...)`, `MessageQueue.open(name, rank)` and `ObjectStorage.open`
//! all go through here, so a name one language holds is found, and refused to a second
//! writer, by the other.
//!
//! Where the records are kept, who holds one (a lock, not a pid), and how a dead one is
//! removed without a race: [`shmq_os::names_dir`]. This module decides what a record
//! holds and what the answers mean:
//!
//! - **A record's file** is named by a hash of the name, `q.<sha256 hex>` for a queue
//!   and `s.<sha256 hex>` for a store, so that every name (1 to [`MAX_NAME_BYTES`] bytes
//!   of text, no control characters) fits in a file name; the name itself is kept in the
//!   record and checked on every lookup.
//! - **A record** is one JSON object, as the Python package has always written it:
//!   `{"kind": "queue", "name": <name>, "pid": <writer's pid>, ...details}`, a queue's
//!   details being `"handle"` (its handle's text, `Handle`'s `Display`), a store's
//!   `"max_object_size"`, `"n_readers"`, `"ring_buffer_handle"` and `"serde_class"` (Python
//!   only). The handle holds the remote stream's secret: the record is owner-only. The
//!   pid is for messages only.
//! - **Answers**: a name held by a live writer is refused to another
//!   ([`NameError::Taken`]); one whose writer's liveness cannot be told is refused too
//!   ([`NameError::Undecidable`]); a dead writer's record is reported gone once
//!   ([`NameError::Gone`], and removed), then the name is free to take over. A record that
//!   does not parse as a record of its kind and name is no record (a lookup says there is
//!   none, a new writer removes it once dead).

use std::fmt;

use sha2::{Digest, Sha256};
use shmq_os::liveness::Liveness;
use shmq_os::names_dir::{HeldRecord, NamesDir};

use crate::error::{Error, Result};

/// The environment variable that names a directory of the user's choice for the names
/// (see [`shmq_os::names_dir`]).
pub use shmq_os::names_dir::DIRECTORY_ENV;

/// The longest name, in bytes of UTF-8 (every shared-memory segment name is a store name).
pub const MAX_NAME_BYTES: usize = 200;

/// How many times a new writer tries to take a name whose record it found dead (another
/// remover or writer may be at it at the same moment), 1 ms apart after the first few.
const ATTEMPTS: usize = 200;

/// What a name names: a queue or a store (their names are apart: a queue and a store
/// may have the same name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A broadcast queue (its writer's handle).
    Queue,
    /// An object store (Python's `ObjectStorage`).
    Store,
}

impl Kind {
    /// `"queue"` or `"store"`: the record's `kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Queue => "queue",
            Kind::Store => "store",
        }
    }

    /// The kind named `text` (`"queue"` or `"store"`); `InvalidArgument` otherwise.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the choices when `text` is neither `"queue"` nor
    /// `"store"`.
    pub fn parse(text: &str) -> Result<Kind> {
        crate::error::parse_choice(
            "kind",
            text,
            &[("queue", Kind::Queue), ("store", Kind::Store)],
        )
    }

    fn prefix(self) -> &'static str {
        match self {
            Kind::Queue => "q.",
            Kind::Store => "s.",
        }
    }

    /// How a writer of this kind takes a name, in either language (for messages).
    fn how(self) -> &'static str {
        match self {
            Kind::Queue => {
                "Python's MessageQueue(..., name=...) or Rust's QueueOptions with name and \
                 record_name"
            }
            Kind::Store => "an ObjectStorage on RingBuffer(create=True, name=...)",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a name could not be taken or found. Python gets `FileNotFoundError` for
/// [`NotFound`](Self::NotFound) and [`Gone`](Self::Gone), `FileExistsError` for the others.
/// It is `#[non_exhaustive]`: a `match` on it needs a `_` arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// No live writer holds the name for this user (never taken, released, a damaged
    /// record, or no directory of names yet).
    #[error(
        "no {kind} named '{name}' on this machine for this user (uid {uid}): names are scoped \
         to the user; was it made with {how}, and is its writer still running?",
        how = kind.how()
    )]
    NotFound { kind: Kind, name: String, uid: u32 },

    /// The name's writer died or ended without releasing it (proved by its lock): its
    /// record was removed, and the name is free.
    #[error("the {kind} named '{name}' is gone: its writer (pid {pid}) is no longer running")]
    Gone { kind: Kind, name: String, pid: i64 },

    /// A live writer holds the name (`pid`: as its record says, if it could be read).
    #[error(
        "a {kind} named '{name}' already exists ({}): names are unique per user on this machine",
        match pid {
            Some(pid) => format!("made by pid {pid}, which holds it still"),
            None => "its writer holds it".to_owned(),
        }
    )]
    Taken {
        kind: Kind,
        name: String,
        pid: Option<i64>,
    },

    /// The name is recorded, but whether its writer is alive cannot be told (its record is
    /// not this user's file, or its lock cannot be tested): it is not taken over.
    #[error(
        "a {kind} named '{name}' is recorded in {path}, and whether its writer is alive \
         cannot be told: the name is not taken over"
    )]
    Undecidable {
        kind: Kind,
        name: String,
        path: String,
    },

    /// Other processes kept taking and removing the name's record while this one tried.
    #[error("a {kind} named '{name}' is being taken by other processes at this moment")]
    Contended { kind: Kind, name: String },
}

/// `InvalidArgument` unless `name` is a name of `kind`: 1 to [`MAX_NAME_BYTES`] bytes of
/// text with no control characters (below U+0020).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a name that is empty, longer than [`MAX_NAME_BYTES`]
/// bytes, or has a control character.
pub fn check_name(kind: Kind, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES || name.chars().any(|c| c < ' ') {
        return Err(Error::InvalidArgument(format!(
            "{name:?} is no {kind} name: 1 to {MAX_NAME_BYTES} bytes of text with no control \
             characters"
        )));
    }
    Ok(())
}

/// The file name of `name`'s record: `q.` or `s.` and the SHA-256 of the name in
/// lowercase hexadecimal (66 characters).
pub fn file_name(kind: Kind, name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    let mut out = String::with_capacity(66);
    out.push_str(kind.prefix());
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Whether `file` is the file name of a record (of either kind).
pub fn is_record_file(file: &str) -> bool {
    file.len() == 66
        && (file.starts_with("q.") || file.starts_with("s."))
        && file[2..]
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The path of this user's directory of names; `None` when there is none yet and `create`
/// is false (see [`shmq_os::names_dir`] for which directory, and its errors).
///
/// # Errors
///
/// [`Error::Name`] with `NamesDirRefused` when the directory found is not this user's or
/// others may enter it; [`Error::Os`] when it cannot be opened or made.
pub fn directory(create: bool) -> Result<Option<String>> {
    Ok(NamesDir::find(create)?.map(|d| d.path().to_owned()))
}

/// Where the record of `name` is (or would be); `None` when this user has no directory of
/// names yet and `create` is false.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a name that is not one of `kind` ([`check_name`]); else
/// as [`directory`].
pub fn record_path(kind: Kind, name: &str, create: bool) -> Result<Option<String>> {
    check_name(kind, name)?;
    Ok(NamesDir::find(create)?.map(|d| d.record_path(&file_name(kind, name))))
}

/// A record of a name, as its writer wrote it.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    kind: Kind,
    name: String,
    pid: i64,
    fields: serde_json::Map<String, serde_json::Value>,
}

impl Record {
    /// The record in `bytes` if it is a whole record of `kind` named `name`; `None`
    /// otherwise (a file is only as good as whoever wrote it).
    fn parse(bytes: &[u8], kind: Kind, name: &str) -> Option<Record> {
        let serde_json::Value::Object(fields) = serde_json::from_slice(bytes).ok()? else {
            return None;
        };
        if fields.get("kind")?.as_str()? != kind.as_str() || fields.get("name")?.as_str()? != name {
            return None;
        }
        let pid = fields.get("pid")?.as_i64()?;
        Some(Record {
            kind,
            name: name.to_owned(),
            pid,
            fields,
        })
    }

    /// What it names.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its writer's pid, as the writer saw it (in its own pid namespace): for messages.
    pub fn pid(&self) -> i64 {
        self.pid
    }

    /// The text of its field `key` (a queue's `"handle"`), if it has one that is text.
    pub fn text(&self, key: &str) -> Option<&str> {
        self.fields.get(key)?.as_str()
    }

    /// The whole record, as JSON text (an object).
    pub fn to_json(&self) -> String {
        serde_json::Value::Object(self.fields.clone()).to_string()
    }
}

/// The record's bytes: `{"kind": ..., "name": ..., "pid": ..., ...details}` in this
/// order, with the Python package's separators (`json.dumps`), so the files are alike
/// whichever language wrote them. `details` must be a JSON object; its `kind`, `name` and
/// `pid` are the record's own.
fn record_bytes(kind: Kind, name: &str, details: &str) -> Result<Vec<u8>> {
    let serde_json::Value::Object(details) = serde_json::from_str(details).map_err(|e| {
        Error::InvalidArgument(format!("a name's details must be a JSON object: {e}"))
    })?
    else {
        return Err(Error::InvalidArgument(
            "a name's details must be a JSON object".into(),
        ));
    };
    let text = |s: &str| serde_json::Value::from(s).to_string();
    let mut out = format!(
        "{{\"kind\": {}, \"name\": {}, \"pid\": {}",
        text(kind.as_str()),
        text(name),
        std::process::id()
    );
    for (key, value) in details
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "kind" | "name" | "pid"))
    {
        out.push_str(&format!(", {}: {}", text(key), value));
    }
    out.push('}');
    Ok(out.into_bytes())
}

/// A name held by this process (see [`claim`]): released, and its record removed, when
/// dropped or by [`release`](Self::release). A forked child's copy holds nothing.
#[derive(Debug)]
pub struct NameClaim {
    kind: Kind,
    name: String,
    held: HeldRecord,
}

impl NameClaim {
    /// What it names.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The name held.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where its record is.
    pub fn path(&self) -> &str {
        self.held.path()
    }

    /// Whether the name is still held by this process.
    pub fn is_held(&self) -> bool {
        self.held.is_held()
    }

    /// Remove the record and let the name go. Idempotent; nothing in a forked child.
    pub fn release(&mut self) {
        self.held.release();
    }
}

/// Hold `name` (of `kind`) for this process, recording `details` (a JSON object's text:
/// a queue's `{"handle": "<handle text>"}`) under it until the returned claim is released
/// or dropped, or the process ends. Removes the dead records of the directory first.
/// [`NameError::Taken`] when a live writer holds the name, [`NameError::Undecidable`] when
/// whether its writer lives cannot be told; a dead writer's record is taken over.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad `name` or `details` that are not a JSON object;
/// [`NameError::Taken`] when a live process holds `name` already;
/// [`NameError::Undecidable`] when its holder's liveness cannot be told, or other processes
/// kept taking the record; [`Error::Os`] when the directory of names is refused, or the
/// record cannot be made or published.
pub fn claim(kind: Kind, name: &str, details: &str) -> Result<NameClaim> {
    check_name(kind, name)?;
    let bytes = record_bytes(kind, name, details)?;
    let dir = NamesDir::find(true)?.expect("made if missing");
    let file = file_name(kind, name);
    dir.sweep(is_record_file);
    let record = dir.new_record(&bytes)?;
    for attempt in 0..ATTEMPTS {
        if record.publish(&file)? {
            return Ok(NameClaim {
                kind,
                name: name.to_owned(),
                held: record.hold(&file)?,
            });
        }
        let Some(found) = record.dir().examine(&file) else {
            continue; // removed meanwhile: try again
        };
        match found.liveness {
            Liveness::Alive => {
                let pid = found
                    .contents
                    .and_then(|b| Record::parse(&b, kind, name))
                    .map(|r| r.pid);
                return Err(NameError::Taken {
                    kind,
                    name: name.to_owned(),
                    pid,
                }
                .into());
            }
            Liveness::Unknown => {
                return Err(NameError::Undecidable {
                    kind,
                    name: name.to_owned(),
                    path: record.dir().record_path(&file),
                }
                .into());
            }
            // Dead (its writer ended or died, or it is damaged): removed, then taken if
            // no other writer links its own first.
            Liveness::Dead => {
                if let Some(id) = found.id {
                    record.dir().remove_dead(&file, id);
                }
                if attempt >= 10 {
                    // Another process is removing it: let it finish. Not a timing
                    // assumption: the loop only gives up after ATTEMPTS tries.
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }
    Err(NameError::Contended {
        kind,
        name: name.to_owned(),
    }
    .into())
}

/// The record of the live writer of the `kind` named `name`. [`NameError::NotFound`] when
/// there is none (never made, released, damaged); [`NameError::Gone`] once when its
/// writer died (proved by its lock; the record is removed, so the next lookup says
/// `NotFound`). A record whose writer's liveness cannot be told is returned as it is
/// (the handle in it says whether the writer is there). The directory's own errors
/// (another user's, open to others) are the operating-system layer's.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a bad `name`; [`NameError::NotFound`] when no live writer
/// holds it (never made, released, damaged); [`NameError::Gone`] once when its writer died;
/// [`Error::Os`] when the directory of names is refused or a record cannot be read.
pub fn lookup(kind: Kind, name: &str) -> Result<Record> {
    check_name(kind, name)?;
    let missing = || {
        Error::from(NameError::NotFound {
            kind,
            name: name.to_owned(),
            uid: shmq_os::names_dir::uid(),
        })
    };
    let Some(dir) = NamesDir::find(false)? else {
        return Err(missing());
    };
    let file = file_name(kind, name);
    let Some(found) = dir.examine(&file) else {
        return Err(missing());
    };
    let record = found
        .contents
        .as_deref()
        .and_then(|b| Record::parse(b, kind, name));
    if found.liveness == Liveness::Dead {
        if let Some(id) = found.id {
            dir.remove_dead(&file, id);
        }
        if let Some(record) = record {
            return Err(NameError::Gone {
                kind,
                name: name.to_owned(),
                pid: record.pid,
            }
            .into());
        }
    }
    record.ok_or_else(missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_files_are_named_by_the_names_hash() {
        let f = file_name(Kind::Queue, "steps");
        // sha256("steps"), as Python's hashlib gives it.
        assert_eq!(
            f,
            "q.b7595e2a863957fc6c225ed540d335dd1e859dd3032451c2e11bceb0329defa6"
        );
        assert!(is_record_file(&f));
        assert!(is_record_file(&file_name(Kind::Store, "x")));
        assert_eq!(file_name(Kind::Store, "steps")[2..], f[2..]);
        for not in [
            "q.abc",
            ".new.0123",
            &f.to_uppercase(),
            &format!("x{}", &f[1..]),
        ] {
            assert!(!is_record_file(not), "{not}");
        }
    }

    #[test]
    fn names_are_checked() {
        for bad in ["", "a\nb", "\u{1}", &"x".repeat(201)] {
            let e = check_name(Kind::Queue, bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        }
        check_name(Kind::Store, &"é".repeat(100)).unwrap();
        check_name(Kind::Queue, "results →").unwrap();
    }

    #[test]
    fn a_record_is_written_as_python_writes_it_and_parsed_back() {
        let bytes =
            record_bytes(Kind::Queue, "steps \"1\"", r#"{"handle": "h|1", "pid": 0}"#).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        let pid = std::process::id();
        assert_eq!(
            text,
            format!(r#"{{"kind": "queue", "name": "steps \"1\"", "pid": {pid}, "handle": "h|1"}}"#)
        );
        let record = Record::parse(&bytes, Kind::Queue, "steps \"1\"").unwrap();
        assert_eq!(record.pid(), i64::from(pid));
        assert_eq!(record.text("handle"), Some("h|1"));
        // What Python's json.dumps writes (non-ASCII escaped) parses the same.
        let python = br#"{"kind": "queue", "name": "r\u2192", "pid": 7, "handle": "x"}"#;
        assert_eq!(Record::parse(python, Kind::Queue, "r→").unwrap().pid(), 7);
        for bad in [
            &b"not json"[..],
            br#"{"pid": "x"}"#,
            b"[1, 2]",
            br#"{"kind": "store", "name": "r", "pid": 1}"#,
            br#"{"kind": "queue", "name": "other", "pid": 1}"#,
            br#"{"kind": "queue", "name": "r", "pid": true}"#,
        ] {
            assert!(Record::parse(bad, Kind::Queue, "r").is_none());
        }
        assert!(record_bytes(Kind::Queue, "r", "[1]").is_err());
        assert!(record_bytes(Kind::Queue, "r", "nope").is_err());
    }

    #[test]
    fn errors_say_what_python_said() {
        let e = NameError::Taken {
            kind: Kind::Queue,
            name: "a".into(),
            pid: Some(12),
        };
        assert_eq!(
            e.to_string(),
            "a queue named 'a' already exists (made by pid 12, which holds it still): names \
             are unique per user on this machine"
        );
        let e = NameError::Gone {
            kind: Kind::Queue,
            name: "a".into(),
            pid: 12,
        };
        assert!(
            e.to_string()
                .starts_with("the queue named 'a' is gone: its writer (pid 12)")
        );
        let e = NameError::NotFound {
            kind: Kind::Store,
            name: "a".into(),
            uid: 5,
        };
        assert!(
            e.to_string()
                .starts_with("no store named 'a' on this machine for this user (uid 5)")
        );
        assert!(matches!(Kind::parse("queue"), Ok(Kind::Queue)));
        assert!(Kind::parse("queues").is_err());
    }

    fn unique(what: &str) -> String {
        let n: [u8; 8] = shmq_os::random::random_bytes("a test's name").unwrap();
        format!("{what} {} {}", std::process::id(), u64::from_le_bytes(n))
    }

    /// In one process (several: `tests/names.rs`): a name claimed is found, refused to a
    /// second claim naming this pid, and free once released.
    #[test]
    fn a_name_is_claimed_found_refused_and_released() {
        let name = unique("claimed");
        let e = lookup(Kind::Queue, &name).unwrap_err();
        assert!(
            matches!(e, Error::Name(NameError::NotFound { .. })),
            "{e:?}"
        );
        let mut held = claim(Kind::Queue, &name, r#"{"handle": "h"}"#).unwrap();
        assert!(held.is_held());
        let found = lookup(Kind::Queue, &name).unwrap();
        assert_eq!(found.pid(), i64::from(std::process::id()));
        assert_eq!(found.text("handle"), Some("h"));
        // A store of the same name is another name.
        assert!(lookup(Kind::Store, &name).is_err());
        let e = claim(Kind::Queue, &name, "{}").unwrap_err();
        assert!(
            matches!(&e, Error::Name(NameError::Taken { pid: Some(p), .. }) if *p == i64::from(std::process::id())),
            "{e:?}"
        );
        held.release();
        assert!(!held.is_held());
        let e = lookup(Kind::Queue, &name).unwrap_err();
        assert!(
            matches!(e, Error::Name(NameError::NotFound { .. })),
            "{e:?}"
        );
        drop(claim(Kind::Queue, &name, "{}").unwrap());
    }

    /// A writer made with `record_name` holds its name until it is closed; one without a
    /// name is refused.
    #[test]
    fn a_writer_holds_its_name_until_closed() {
        let mut opts = crate::QueueOptions::local(1);
        opts.record_name = true;
        let e = crate::Writer::new(opts.clone()).unwrap_err();
        assert!(
            matches!(e, crate::error::CreateError::BadOptions(_)),
            "{e:?}"
        );
        let name = unique("w");
        opts.name = Some(name.clone());
        let mut writer = crate::Writer::new(opts.clone()).unwrap();
        let record = lookup(Kind::Queue, &name).unwrap();
        let handle: crate::Handle = record.text("handle").unwrap().parse().unwrap();
        assert_eq!(&handle, writer.handle());
        let e = crate::Writer::new(opts.clone()).unwrap_err();
        assert!(
            matches!(e, crate::error::CreateError::Name(NameError::Taken { .. })),
            "{e:?}"
        );
        writer.close();
        let e = crate::Reader::open_by_name(&name, 0).unwrap_err();
        assert!(
            matches!(e, crate::error::OpenError::Name(NameError::NotFound { .. })),
            "{e:?}"
        );
        drop(crate::Writer::new(opts).unwrap());
    }
}
