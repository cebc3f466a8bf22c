//! Entry points for the fuzz targets in `fuzz/` (see the README's Develop section): the
//! crate-private parsers that hostile bytes reach, re-exported as they are. Not part of
//! shmq's API; everything else the targets drive (rings, readers, the arena, the store)
//! is public already.

/// The message framing decoder and encoder (`broadcast::framing`): what a reader runs on
/// a chunk (or the first frame of an overflow message) written by the writer, or by
/// anyone else who can write the segment.
pub use crate::broadcast::framing::{
    PartRef, decode as decode_framing, encode as encode_framing, header_len,
};
