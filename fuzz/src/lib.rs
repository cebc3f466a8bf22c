//! What the fuzz targets share: patches, the fuzzer's bytes written over a segment the
//! way any process that can open it could write them (through its file in `/dev/shm`,
//! which every mapping of the segment sees at once).

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;

use arbitrary::Arbitrary;

/// Bytes to write at an offset of a segment (taken modulo the segment's length, so that
/// every patch lands somewhere; `near` keeps most of them in the header and the control
/// words at the start, where a few bytes change the most).
#[derive(Arbitrary, Debug, Clone)]
pub struct Patch {
    pub at: u32,
    pub near: bool,
    pub bytes: Patched,
}

/// What a patch writes: a few arbitrary bytes, or a little-endian word (counts, lengths,
/// ids and offsets are words, and the interesting values are near their edges).
#[derive(Arbitrary, Debug, Clone)]
pub enum Patched {
    Bytes(Vec<u8>),
    Word(u64),
    Half(u32),
    Edge(Edge),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Edge {
    Zero,
    One,
    MaxU32,
    MaxU64,
    Pow2(u8),
}

impl Patched {
    pub fn bytes(&self) -> Vec<u8> {
        match self {
            Patched::Bytes(b) => b.iter().copied().take(64).collect(),
            Patched::Word(w) => w.to_le_bytes().to_vec(),
            Patched::Half(h) => h.to_le_bytes().to_vec(),
            Patched::Edge(Edge::Zero) => 0u64.to_le_bytes().to_vec(),
            Patched::Edge(Edge::One) => 1u64.to_le_bytes().to_vec(),
            Patched::Edge(Edge::MaxU32) => u32::MAX.to_le_bytes().to_vec(),
            Patched::Edge(Edge::MaxU64) => u64::MAX.to_le_bytes().to_vec(),
            Patched::Edge(Edge::Pow2(k)) => (1u64 << (k % 64)).to_le_bytes().to_vec(),
        }
    }
}

/// The file of segment `name`.
pub fn segment_path(name: &str) -> String {
    format!("/dev/shm/{name}")
}

/// Write `patches` over the segment `name` (within its current length), `near` ones
/// within its first `near_len` bytes. Returns the offsets and lengths written.
pub fn apply(name: &str, near_len: u64, patches: &[Patch]) -> Vec<(u64, usize)> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(segment_path(name))
        .expect("the segment's file");
    let len = file.metadata().expect("its size").len();
    let mut done = Vec::new();
    for p in patches {
        let bytes = p.bytes.bytes();
        let span = if p.near { near_len.min(len) } else { len };
        if span == 0 || bytes.is_empty() {
            continue;
        }
        let at = p.at as u64 % span;
        let n = bytes.len().min((len - at) as usize);
        file.write_all_at(&bytes[..n], at)
            .expect("writing the segment");
        done.push((at, n));
    }
    done
}

/// Read `n` bytes at `at` of segment `name`.
pub fn read_at(name: &str, at: u64, n: usize) -> Vec<u8> {
    let file = std::fs::File::open(segment_path(name)).expect("the segment's file");
    let mut buf = vec![0u8; n];
    file.read_exact_at(&mut buf, at)
        .expect("reading the segment");
    buf
}

/// Write `bytes` at `at` of segment `name`.
pub fn write_at(name: &str, at: u64, bytes: &[u8]) {
    let file = OpenOptions::new()
        .write(true)
        .open(segment_path(name))
        .expect("the segment's file");
    file.write_all_at(bytes, at).expect("writing the segment");
}

/// Touch every byte of `b` (a read out of bounds faults here), returning a checksum so
/// the reads are not optimized away.
pub fn touch(b: &[u8]) -> u64 {
    b.iter()
        .fold(0u64, |h, &x| h.wrapping_mul(31).wrapping_add(x as u64))
}
