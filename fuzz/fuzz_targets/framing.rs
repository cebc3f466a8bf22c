//! The message framing decoder (`framing::decode`), as a reader runs it on a chunk or on
//! the first frame of an overflow message: any bytes and frame count give an error or
//! parts that lie inside the block (inline) or among the frames that came (frame), never
//! a panic; and the parts it found encode back to descriptors that decode to them again.
//! The same bytes as a typed array's header (`ArrayMeta::decode`) against `frames * 4096`
//! bytes of data: an error, or fields whose elements lie inside that data.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use shmq::fuzzing::{decode_framing, encode_framing, header_len, PartRef};
use shmq::ArrayMeta;

#[derive(Arbitrary, Debug)]
struct Input {
    frames: u8,
    block: Vec<u8>,
}

fuzz_target!(|input: Input| {
    let Input { frames, block } = input;
    let frames = frames as usize;
    if let Ok(meta) = ArrayMeta::decode(&block, frames * 4096) {
        assert!(meta.span().unwrap() <= frames * 4096, "{meta:?}");
        assert_eq!(
            ArrayMeta::decode(&meta.encode(), frames * 4096).unwrap(),
            meta
        );
    }
    let Ok(parts) = decode_framing(&block, frames) else {
        return;
    };
    assert!(!parts.is_empty());
    let header = header_len(parts.len());
    assert!(header <= block.len());
    for p in &parts {
        match *p {
            PartRef::Inline { offset, len } => {
                assert!(offset >= header && offset + len <= block.len(), "{p:?}");
                // The bytes a reader would borrow.
                let _ = &block[offset..offset + len];
            }
            PartRef::Frame { index } => assert!(index > 0 && index < frames, "{p:?}"),
            PartRef::Arena(_) => {} // checked against the lease table by the arena
        }
    }
    let mut again = block.clone();
    encode_framing(&parts, &mut again);
    assert_eq!(decode_framing(&again, frames).unwrap(), parts);
});
