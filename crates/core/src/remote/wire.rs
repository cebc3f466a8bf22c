//! The wire format of the remote stream: the magics and kinds of its frames, and the
//! header of every message from the writer (see the parent module's docs: Frames).

pub(super) const HEADER: usize = 64;
pub(super) const HELLO: usize = 4 + 8 + 16 + 32;
pub(super) const MAGIC_MESSAGE: &[u8; 4] = b"SQM1";
pub(super) const MAGIC_HELLO: &[u8; 4] = b"SQH1";
/// A reader's acknowledgement of the CLOSED message (see `RemoteWriter::close`).
pub(super) const MAGIC_BYE: &[u8; 4] = b"SQB1";
/// A reader's running totals of messages and bytes taken (see the `remote` module docs).
pub(super) const MAGIC_ACK: &[u8; 4] = b"SQA1";
pub(super) const ACK: usize = 4 + 8 + 8;
pub(super) const KIND_DATA: u8 = 0;
pub(super) const KIND_WELCOME: u8 = 1;
pub(super) const KIND_READY: u8 = 2;
pub(super) const KIND_REFUSED: u8 = 3;
pub(super) const KIND_CLOSED: u8 = 4;
/// The writer, out of credit for a reader, asks it to acknowledge what it has taken.
pub(super) const KIND_PING: u8 = 5;
/// The writer dropped this reader (see the `remote` module docs).
pub(super) const KIND_DROPPED: u8 = 6;

pub(super) fn header(kind: u8, seq: u64, session: &[u8; 16], mac: &[u8; 32]) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(MAGIC_MESSAGE);
    h[4] = kind;
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    h[16..32].copy_from_slice(session);
    h[32..64].copy_from_slice(mac);
    h
}
