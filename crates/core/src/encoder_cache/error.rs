//! The encoder cache's errors.

use std::time::Duration;

/// An error of the encoder cache (in `shmq::Error`, [`crate::Error::Cache`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// The encoder cache has no room for an entry and nothing could be evicted before the
    /// deadline; `reason` says what holds the room.
    #[error(
        "encoder cache '{name}' is full: no room for an entry of {needed} bytes (capacity \
         {capacity} bytes, {held} entries held) after waiting {waited:.3?}: {reason}"
    )]
    Full {
        name: String,
        needed: u64,
        capacity: u64,
        held: usize,
        waited: Duration,
        reason: String,
    },

    /// A key the encoder cache does not hold (and did not hold until every consumer had
    /// loaded it).
    #[error("{0:?} is not held by this encoder cache")]
    UnknownKey(String),

    /// An entry larger than the cache's whole data region.
    #[error("Serialized object size ({size} bytes) exceeds max object size ({max} bytes)")]
    TooLarge { size: u64, max: u64 },
}
