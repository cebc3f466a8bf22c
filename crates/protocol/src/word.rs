//! Shared words that carry no protocol of their own, typed by what they are for, so that
//! the code that lays out a segment never names a raw shared atomic nor picks an
//! ordering on one (clippy refuses `sync::{AtomicU8, AtomicU32, AtomicU64}` outside this
//! crate: see `clippy.toml`). Each is `#[repr(transparent)]` over one atomic, so a
//! segment's layout is the atomic's.
//!
//! - A statistic (`StatU32`, `StatU64`): a count that decides nothing (metrics, the
//!   numbers in warnings and reports). Relaxed everywhere: nothing is read through it.
//! - A field (`FieldU8`, `FieldU32`, `FieldU64`): a value that some protocol publishes
//!   (a seqlock's fields, a chunk's length written before its `written` flag, a slot's
//!   pid before its word, an entry's offset before READY, a header before its magic).
//!   Relaxed: the publishing protocol's Release (and its readers' Acquire) orders it;
//!   whoever uses one says which protocol that is.
//! - A published word (`PublishedU32`, `PublishedU64`): a word that itself publishes
//!   what was written before it (a segment's magic, the encoder cache's state): Release
//!   stores, Acquire loads.

use crate::sync::{AtomicU32, AtomicU64, AtomicU8, Ordering};

macro_rules! stat {
    ($name:ident, $atomic:ident, $int:ty) => {
        /// A statistic in shared memory (see the module docs): Relaxed everywhere.
        #[repr(transparent)]
        pub struct $name($atomic);

        impl $name {
            pub fn new(v: $int) -> Self {
                $name($atomic::new(v))
            }
            /// The value now.
            pub fn get(&self) -> $int {
                // Relaxed: a statistic; nothing is read through it.
                self.0.load(Ordering::Relaxed)
            }
            /// Set it (its one writer: a gauge, or a count kept in that process).
            pub fn set(&self, v: $int) {
                // Relaxed: a statistic.
                self.0.store(v, Ordering::Relaxed);
            }
            /// Add `n`, wrapping, where several processes (or a forked copy) may add at once.
            pub fn add(&self, n: $int) {
                // Relaxed: a statistic; an atomic add, so concurrent adds are all kept.
                self.0.fetch_add(n, Ordering::Relaxed);
            }
            /// Add `n`, wrapping, where this process is its only writer (no atomic
            /// read-modify-write: a load and a store, cheaper on a hot path).
            pub fn add_own(&self, n: $int) {
                // Relaxed: a statistic, written by one process only.
                self.0.store(
                    self.0.load(Ordering::Relaxed).wrapping_add(n),
                    Ordering::Relaxed,
                );
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name::new(0)
            }
        }
    };
}

macro_rules! field {
    ($name:ident, $atomic:ident, $int:ty) => {
        /// A field published by an enclosing protocol (see the module docs): Relaxed.
        #[repr(transparent)]
        pub struct $name($atomic);

        impl $name {
            pub fn new(v: $int) -> Self {
                $name($atomic::new(v))
            }
            /// The value, as the publishing protocol orders it.
            pub fn get(&self) -> $int {
                // Relaxed: ordered by the protocol that publishes the field (its Acquire
                // load or fence before this, or its re-check after).
                self.0.load(Ordering::Relaxed)
            }
            /// Write it, before the publishing protocol publishes it.
            pub fn set(&self, v: $int) {
                // Relaxed: published by the protocol's Release store or fence after this.
                self.0.store(v, Ordering::Relaxed);
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name::new(0)
            }
        }
    };
}

macro_rules! published {
    ($name:ident, $atomic:ident, $int:ty) => {
        /// A word that publishes what was written before it (see the module docs).
        #[repr(transparent)]
        pub struct $name($atomic);

        impl $name {
            pub fn new(v: $int) -> Self {
                $name($atomic::new(v))
            }
            /// Store `v`, publishing every write before it.
            pub fn publish(&self, v: $int) {
                // Release: pairs with the Acquire load in `get`.
                self.0.store(v, Ordering::Release);
            }
            /// The value; what was written before it was published is visible.
            pub fn get(&self) -> $int {
                // Acquire: pairs with the Release store in `publish`.
                self.0.load(Ordering::Acquire)
            }
            /// Store `v` before anyone can see the word (a segment being made, before its
            /// magic is published), or where nothing is published by it.
            pub fn set_early(&self, v: $int) {
                // Relaxed: no process reads the word yet (the segment's own publication,
                // its magic, comes after), or nothing is read through it.
                self.0.store(v, Ordering::Relaxed);
            }
            /// The value, where nothing is read through it (a report).
            pub fn peek(&self) -> $int {
                // Relaxed: a report; nothing is read through the value.
                self.0.load(Ordering::Relaxed)
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name::new(0)
            }
        }
    };
}

stat!(StatU32, AtomicU32, u32);
stat!(StatU64, AtomicU64, u64);
field!(FieldU8, AtomicU8, u8);
field!(FieldU32, AtomicU32, u32);
field!(FieldU64, AtomicU64, u64);
published!(PublishedU32, AtomicU32, u32);
published!(PublishedU64, AtomicU64, u64);

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn words_keep_their_values() {
        let s = StatU64::default();
        s.add(2);
        s.add_own(3);
        assert_eq!(s.get(), 5);
        s.set(1);
        assert_eq!(s.get(), 1);
        let f = FieldU8::new(7);
        f.set(9);
        assert_eq!(f.get(), 9);
        let p = PublishedU32::default();
        p.set_early(1);
        p.publish(2);
        assert_eq!((p.get(), p.peek()), (2, 2));
    }
}
