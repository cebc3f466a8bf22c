//! The object store's errors ([`StoreError`]), and the texts the Python binding also
//! writes for handles it refuses before they reach the store.

use shmq_protocol::alloc::Full;

/// An error of the object store (in `shmq::Error`, [`crate::Error::Store`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The object store's ring has no room (after freeing what could be freed), or can
    /// never have room for a block that large (see `full_message`).
    #[error("{}", full_message(.0))]
    Full(#[from] Full),

    /// An object handle `(address, id)` does not name a live object: evicted, reused,
    /// cleared, forged or out of range.
    #[error("{}", stale_object_message(address, id))]
    StaleObject { address: u64, id: u64 },

    /// A handle's signature is missing (`missing`: the key or the signature was not
    /// given, see [`HandleRefusal::is_missing`]) or does not match (vLLM 0.33's messages);
    /// `why`, when known, says what was wrong (the Python store adds the key's repr).
    #[error("{}", bad_signature_message(*missing, None, why.map(|w| w.to_string()).as_deref()))]
    BadSignature {
        missing: bool,
        why: Option<HandleRefusal>,
    },

    /// `put` of a key the store already has.
    #[error("Key '{0}' already exists in the storage.")]
    KeyExists(String),

    /// `put` of an object larger than the store's `max_object_size`.
    #[error("Serialized object size ({size} bytes) exceeds max object size ({max} bytes)")]
    TooLarge { size: u64, max: u64 },
}

/// The message of [`StoreError::StaleObject`], also for handles that are not even integers of
/// the right range (the Python bindings report those the same way).
pub fn stale_object_message(address: impl std::fmt::Display, id: impl std::fmt::Display) -> String {
    format!("Data for address:id '{address}:{id}' has been modified or is invalid.")
}

/// The message of [`StoreError::Full`]: the allocator's ("Not enough space in the data
/// buffer, try calling free_buf() to free up space (...; Rust: free_while)"), except for
/// a block that no freeing can ever make room for (larger than the whole ring, or than a
/// block header's 4-byte size can say): then that, so that nobody frees (or waits) in
/// vain. Both start alike (vLLM 0.33's wording, which callers match); each names the
/// Python spelling and the Rust one, since both languages show the same text.
fn full_message(full: &Full) -> String {
    if full.needed > full.capacity {
        format!(
            "Not enough space in the data buffer: a chunk of {} bytes (the data with its 8-byte \
             header and, for an object, its framing) can never fit in this ring of {} bytes, \
             however much is freed; store smaller objects or make the ring (data_buffer_size; \
             Rust: BlockFifo::create's capacity) larger",
            full.needed, full.capacity
        )
    } else if full.needed > u64::from(u32::MAX) {
        format!(
            "Not enough space in the data buffer: a chunk of {} bytes can never be stored (a \
             chunk's size field holds at most {} bytes); store smaller objects",
            full.needed,
            u32::MAX
        )
    } else {
        match &full.held_by {
            Some(held) => format!("{full}; {held}"),
            None => full.to_string(),
        }
    }
}

/// Why a store refuses a handle a request brings back: the words after vLLM's "Invalid SHM
/// handle signature for cache key ...:" ("Missing ..." for what a reader was not given:
/// [`is_missing`](Self::is_missing)). Readers check the signature (see
/// `storage::SignedHandle`); the writer also checks that the handle is the key's current
/// object, see `storage::StoreRole`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HandleRefusal {
    /// A reader was given neither the key nor the signature.
    #[error(
        "no key and no signature were given; a reader's get and touch need both (the key, \
         and the signature the writer's get_signature(key) returns)"
    )]
    NoKeyNoSignature,
    /// A reader was given a signature but not the key it was made for.
    #[error("no key was given; a reader's get and touch need the key the signature was made for")]
    NoKeyForSignature,
    /// A reader was given a key but no signature.
    #[error("no signature was given; pass the one the writer's get_signature(key) returns")]
    NoSignature,
    /// The writer was given no key to look the handle up under.
    #[error("no key was given")]
    NoKey,
    /// The writer has no object under the key.
    #[error("no object is stored under this key")]
    NoEntry,
    /// The writer's object under the key is another one.
    #[error(
        "the handle (address {}, id {}) is not this key's current object (address {}, id {})",
        handle.0, handle.1, current.0, current.1
    )]
    NotCurrent {
        handle: (u64, u32),
        current: (u64, u32),
    },
    /// The signature was not made for this key and handle by this store.
    #[error(
        "the signature does not match this key, address {address} and id {id} (was it made \
         for another key or object, or by another store?)"
    )]
    Mismatch { address: u64, id: u32 },
}

impl HandleRefusal {
    /// Whether the refusal is of something a reader was not given (vLLM's "Missing SHM
    /// handle signature"), rather than of what it was given ("Invalid ...").
    pub fn is_missing(self) -> bool {
        matches!(
            self,
            HandleRefusal::NoKeyNoSignature
                | HandleRefusal::NoKeyForSignature
                | HandleRefusal::NoSignature
        )
    }
}

impl From<HandleRefusal> for StoreError {
    fn from(why: HandleRefusal) -> StoreError {
        StoreError::BadSignature {
            missing: why.is_missing(),
            why: Some(why),
        }
    }
}

/// vLLM 0.33's message for a missing or invalid handle signature ("Missing SHM handle
/// signature for cache key", which its callers and tests match), then which key (as the
/// caller wrote it, e.g. a Python repr; `None` when no key was given) and what was wrong.
/// Without a key or a reason (`None`), vLLM's sentence alone.
pub fn bad_signature_message(missing: bool, key: Option<&str>, why: Option<&str>) -> String {
    let what = if missing { "Missing" } else { "Invalid" };
    match (key, why) {
        (Some(key), Some(why)) => format!("{what} SHM handle signature for cache key {key}: {why}"),
        (Some(key), None) => format!("{what} SHM handle signature for cache key {key}."),
        (None, Some(why)) => format!("{what} SHM handle signature for cache key: {why}"),
        (None, None) => format!("{what} SHM handle signature for cache key."),
    }
}
