//! Entries: their life cycle in shared memory and the byte layout of one entry's data (the
//! producer allocates the data region with `shmq_os::range_alloc::RangeAllocator`).
//!
//! # Life cycle, pins and acknowledgements
//! The protocol on an entry record's words (its state, `generation << 2 | state`:
//! `FREE(g) -> WRITING(g) -> READY(g) -> RETIRED(g) -> FREE(g+1)`; the consumers' pins,
//! which keep a range from reuse while a view of it lives; their acknowledgements) is
//! [`shmq_protocol::entry`], with its ordering arguments and loom models. Only the
//! producer changes the state. The index stores `(entry, g)` beside each key, so a
//! consumer that found a key checks the word is exactly `READY(g)`: anything else (a
//! later generation, the entry reused for another key) means the key is gone. An
//! evicted entry whose pins are not all zero stays a *zombie* (gone from the index, its
//! bytes intact) until they are. A pin lasts as long as the consumer's view (its private
//! mapping).
//!
//! # Data of one entry
//! ```text
//! +0   PARTS_MAGIC: u32, n_parts: u32
//! +8   n_parts × (offset: u64, len: u64), offsets from the entry's start
//! ...  the parts, each at a 64-byte aligned offset
//! ```
//! A consumer reads the table from its own private mapping and checks every part lies
//! inside it, so a corrupted entry is an error, never a read out of bounds.

use crate::error::{Error, OsError, Result};

pub(crate) use shmq_protocol::entry::{READY, WRITING, state_of};

const PARTS_MAGIC: u32 = u32::from_le_bytes(*b"ECP1");
/// Most parts one entry may have.
pub const MAX_PARTS: usize = 1 << 16;
const PART_ALIGN: usize = 64;

fn align(n: usize) -> Option<usize> {
    n.checked_add(PART_ALIGN - 1)
        .map(|v| v / PART_ALIGN * PART_ALIGN)
}

/// Where each part of an entry goes: `(offset, len)` from the entry's start, and the
/// entry's total length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartsLayout {
    pub parts: Vec<(usize, usize)>,
    pub total: usize,
}

impl PartsLayout {
    /// The layout of parts of `lens` bytes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for more than [`MAX_PARTS`] parts, or a total size that
    /// overflows.
    pub fn new(lens: &[usize]) -> Result<PartsLayout> {
        if lens.len() > MAX_PARTS {
            return Err(Error::InvalidArgument(format!(
                "an encoder cache entry holds at most {MAX_PARTS} parts, got {}",
                lens.len()
            )));
        }
        let too_large =
            || Error::InvalidArgument("an encoder cache entry this large cannot be stored".into());
        let mut at = align(8 + 16 * lens.len()).ok_or_else(too_large)?;
        let mut parts = Vec::with_capacity(lens.len());
        for &len in lens {
            parts.push((at, len));
            at = at.checked_add(len).and_then(align).ok_or_else(too_large)?;
        }
        Ok(PartsLayout { parts, total: at })
    }

    /// Write the part table at the start of `dst` (the entry's bytes).
    pub fn write_table(&self, dst: &mut [u8]) {
        dst[0..4].copy_from_slice(&PARTS_MAGIC.to_le_bytes());
        dst[4..8].copy_from_slice(&(self.parts.len() as u32).to_le_bytes());
        for (i, &(off, len)) in self.parts.iter().enumerate() {
            let at = 8 + 16 * i;
            dst[at..at + 8].copy_from_slice(&(off as u64).to_le_bytes());
            dst[at + 8..at + 16].copy_from_slice(&(len as u64).to_le_bytes());
        }
    }

    /// Read and check the part table of an entry's bytes (a consumer's private copy).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] with [`OsError::BadSegment`] when the part table is corrupt: shorter
    /// than it says, a part count over [`MAX_PARTS`], or a part outside the entry.
    pub fn read(bytes: &[u8]) -> Result<Vec<(usize, usize)>> {
        let bad = |why: &str| {
            Error::Os(OsError::BadSegment {
                name: "(encoder cache entry)".into(),
                reason: format!("an entry's part table is corrupt: {why}"),
            })
        };
        let u32_at = |at: usize| -> Option<u32> {
            Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
        };
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
        };
        if u32_at(0) != Some(PARTS_MAGIC) {
            return Err(bad("no table"));
        }
        let n = u32_at(4).ok_or_else(|| bad("short"))? as usize;
        if n > MAX_PARTS || 8 + 16 * n > bytes.len() {
            return Err(bad("too many parts"));
        }
        (0..n)
            .map(|i| {
                let off = u64_at(8 + 16 * i).ok_or_else(|| bad("short"))?;
                let len = u64_at(16 + 16 * i).ok_or_else(|| bad("short"))?;
                match off.checked_add(len) {
                    Some(end) if end <= bytes.len() as u64 => Ok((off as usize, len as usize)),
                    _ => Err(bad("a part lies outside the entry")),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_layout_round_trips_and_rejects_corruption() {
        let l = PartsLayout::new(&[5, 0, 100]).unwrap();
        assert_eq!(l.parts, vec![(64, 5), (128, 0), (128, 100)]);
        assert_eq!(l.total, 256);
        let mut bytes = vec![0u8; l.total];
        l.write_table(&mut bytes);
        assert_eq!(PartsLayout::read(&bytes).unwrap(), l.parts);
        assert!(
            PartsLayout::read(&bytes[..100]).is_err(),
            "part beyond the end"
        );
        let mut bad = bytes.clone();
        bad[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(PartsLayout::read(&bad).is_err());
        let mut bad = bytes.clone();
        bad[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(PartsLayout::read(&bad).is_err());
        assert!(PartsLayout::read(&[0u8; 3]).is_err());
        assert!(PartsLayout::new(&[usize::MAX]).is_err());
        assert_eq!(PartsLayout::new(&[]).unwrap().total, 64);
    }
}
