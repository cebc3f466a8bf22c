//! The reader side of a corrupted broadcast ring: a writer fills a small ring (inline
//! messages, messages of several parts with large parts in the tensor arena), then the
//! fuzzer writes over the ring's segment (header, slots, chunk states and data: before
//! the reader opens it, and again after) and over the arena's lease table, and a queue
//! reader (`shmq::Reader`, what `MessageQueue.create_from_handle` makes) takes every
//! message it can. Opening may fail and messages may be errors; nothing may panic,
//! crash or read outside the mappings. Without patches, the reader gets exactly what
//! was sent, in order.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use shmq::{QueueOptions, Reader, Writer};
use shmq_fuzz::{apply, touch, Patch};

/// Parts of at least this many bytes go to the arena.
const ARENA_THRESHOLD: usize = 512;

#[derive(Arbitrary, Debug)]
struct Input {
    n_reader: u8,
    max_chunk_bytes: u16,
    max_chunks: u8,
    reader: u8,
    messages: Vec<Message>,
    before_open: Vec<Patch>,
    after_open: Vec<Patch>,
    arena: Vec<Patch>,
}

#[derive(Arbitrary, Debug)]
enum Message {
    Bytes(Vec<u8>),
    /// A body and buffers: `(len, fill byte)` each (long ones go to the arena).
    Parts(Vec<(u16, u8)>),
}

fuzz_target!(|input: Input| {
    let n_reader = 1 + input.n_reader as usize % 3;
    let max_chunk_bytes = 1 + input.max_chunk_bytes as usize % 2048;
    let max_chunks = 1 + input.max_chunks as usize % 4;
    let mut opts = QueueOptions::local(n_reader);
    opts.max_chunk_bytes = max_chunk_bytes;
    opts.max_chunks = max_chunks;
    opts.arena_bytes = 256 << 10;
    opts.arena_threshold = ARENA_THRESHOLD;
    let mut writer = Writer::new(opts).expect("a small queue");
    // What went into chunks, in order (an overflow message goes over the socket, which
    // the reader joins too late to get: it stops there).
    let mut sent: Vec<Vec<Vec<u8>>> = Vec::new();
    for m in input.messages.iter().take(2 * max_chunks) {
        let ok = match m {
            Message::Bytes(b) => {
                let ok = was_sent(writer.try_enqueue(b));
                if ok && b.len() <= max_chunk_bytes {
                    sent.push(vec![b.clone()]);
                }
                ok
            }
            Message::Parts(spec) if !spec.is_empty() => {
                let parts: Vec<Vec<u8>> = spec
                    .iter()
                    .take(4)
                    .map(|&(len, fill)| vec![fill; len as usize % 4096])
                    .collect();
                let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
                let ok = was_sent(writer.try_enqueue(shmq::Message::Parts(&refs)));
                if ok && writer.overflow_count() == 0 {
                    sent.push(parts);
                }
                ok
            }
            Message::Parts(_) => true,
        };
        if !ok || writer.overflow_count() > 0 {
            break; // the ring is full, or the reader would stop at the overflow mark
        }
    }
    let handle = writer.handle().clone();
    let ring = handle.buffer.as_ref().expect("local readers").name.clone();
    let arena = handle.arena.clone().expect("an arena");
    // The arena is made at first use; these messages are small, so make it here, to
    // scribble over it too.
    writer
        .arena_mut()
        .expect("an arena")
        .make()
        .expect("making the arena");
    // Header, shared words, the name, slots and chunk states come before the data
    // (slots from byte 320: see the layout in crates/core/src/broadcast/ring/mod.rs).
    let control = (320 + 64 * (1 + n_reader) + 64 * max_chunks) as u64;
    let patched =
        !input.before_open.is_empty() || !input.after_open.is_empty() || !input.arena.is_empty();
    apply(&ring, control, &input.before_open);
    let rank = input.reader as usize % n_reader;
    let Ok(mut reader) = Reader::open(&handle, rank) else {
        assert!(patched, "a reader of an intact ring must open");
        return;
    };
    apply(&ring, control, &input.after_open);
    // The lease table of the first leases (each record is 64 bytes after 384 of header,
    // statistics and the queue's name).
    apply(&arena, 384 + 64 * 8, &input.arena);
    let mut got: Vec<Vec<Vec<u8>>> = Vec::new();
    for _ in 0..2 * max_chunks + 1 {
        let taken = reader.try_take_message(|m| match m {
            shmq::broadcast::Received::Bytes(b) => {
                touch(b);
                vec![b.to_vec()]
            }
            shmq::broadcast::Received::Parts(parts) => parts
                .iter()
                .map(|p| {
                    touch(p);
                    p.to_vec()
                })
                .collect(),
            shmq::broadcast::Received::Array { meta, data } => {
                // Checked against its data when received: every element lies inside it.
                assert!(meta.span().expect("checked") <= data.len(), "{meta:?}");
                touch(&data);
                vec![data.to_vec()]
            }
            _ => Vec::new(),
        });
        match taken {
            Ok(m) => got.push(m),
            Err(shmq::broadcast::TryDequeueError::Empty) => break,
            Err(e) => {
                assert!(patched, "reading an intact ring failed: {e}");
                got.push(Vec::new());
            }
        }
    }
    if !patched {
        assert_eq!(got, sent, "the reader did not get what was sent");
    }
    // A wait that times out at once: it reads the writer's slot and liveness, and the
    // doorbell words, all of which the patches may have hit.
    let _ = reader.wait_message(Some(std::time::Duration::ZERO));
    drop(reader);
    drop(writer);
});

/// Whether `try_enqueue` sent the message (`false`: no room now); any other error is a bug.
fn was_sent(r: Result<(), shmq::broadcast::TryEnqueueError>) -> bool {
    match r {
        Ok(()) => true,
        Err(shmq::broadcast::TryEnqueueError::Full) => false,
        Err(e) => panic!("enqueue: {e}"),
    }
}
