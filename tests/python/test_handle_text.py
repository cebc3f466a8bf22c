"""A queue handle's text form across the language boundary, in real processes.

``str(handle)`` / ``Handle.from_str(text)`` speak the Rust crate's ``Handle`` text form
(``shmq-handle-3|...``, its ``Display`` / ``FromStr``): a Rust writer's handle line opens
Python readers that read its raw bytes with ``acquire_read()``, a Python writer's
``str(handle)`` opens a Rust reader, and both languages print and refuse the same texts
alike. The Rust side is ``examples/handle_roundtrip.rs``, built here with cargo (a no-op
after ``cargo test`` in ``scripts/test.sh``, which builds the examples).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from _processes.rust_examples import build_example

from shmq import Handle, MessageQueue
from _processes import segments_of

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 4096
STEP = 30  # seconds: every wait here has a bound

# The first build of the example may compile the crate's dependencies (minutes).
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def rust_example() -> str:
    """The path of the built ``handle_roundtrip`` example."""
    return build_example("handle_roundtrip")


def output(p: subprocess.Popen[str]) -> str:
    """All that ``p`` prints, once it has exited (its stdin closed already)."""
    assert p.stdout is not None
    out = p.stdout.read()  # bounded by the test's timeout, as the wait below
    p.wait(timeout=STEP)
    return out


def rust_messages(max_chunk_bytes: int) -> list[bytes]:
    """What ``handle_roundtrip writer`` sends (its ``messages``)."""
    return [
        b"hello from rust",
        bytes(range(256)),
        b"",
        bytes(i % 251 for i in range(max_chunk_bytes * 2 + 3)),
    ]


# A second Python reader, in a process of its own: reads the handle line from stdin and
# prints each message it takes with acquire_read() as hex.
PYTHON_READER = """
import sys
from shmq import Handle, MessageQueue
handle = Handle.from_str(sys.stdin.readline())
reader = MessageQueue.create_from_handle(handle, int(sys.argv[1]))
reader.wait_until_ready(timeout=30)
for _ in range(int(sys.argv[2])):
    with reader.acquire_read(timeout=30) as view:
        print(bytes(view).hex(), flush=True)
"""


def test_a_rust_writers_handle_line_opens_python_readers(rust_example: str) -> None:
    writer = subprocess.Popen(
        [rust_example, "writer", "2", str(CHUNK)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    other = None
    try:
        assert writer.stdout is not None and writer.stdin is not None
        line = writer.stdout.readline()
        assert line.startswith("shmq-handle-3|"), line
        handle = Handle.from_str(line)
        # Python prints it as Rust did, and it names the Rust writer's ring.
        assert str(handle) == line.rstrip("\n")
        assert handle.local_reader_ranks == [0, 1]
        assert handle.buffer_handle is not None and handle.buffer_handle[:3] == (2, CHUNK, 4)
        assert f"_{writer.pid}_" in handle.buffer_handle[3]

        sent = rust_messages(CHUNK)
        other = subprocess.Popen(
            [sys.executable, "-c", PYTHON_READER, "1", str(len(sent))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert other.stdin is not None
        other.stdin.write(line)
        other.stdin.close()

        reader = MessageQueue.create_from_handle(Handle.from_str(line), 0)
        reader.wait_until_ready(timeout=STEP)
        received = []
        for _ in sent:
            with reader.acquire_read(timeout=STEP) as view:
                received.append(bytes(view))
        assert received == sent
        out = output(other)
        assert other.returncode == 0
        assert [bytes.fromhex(h) for h in out.split("\n")[: len(sent)]] == sent
        del reader
    finally:
        for p in (other, writer):
            if p is not None and p.poll() is None and p.stdin is not None and not p.stdin.closed:
                p.stdin.close()  # the writer stays until its stdin closes
        for p in (other, writer):
            if p is not None:
                try:
                    p.wait(timeout=STEP)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    assert writer.returncode == 0
    assert segments_of({writer.pid}) == set(), "the Rust writer left its segments"


def test_a_python_writers_handle_opens_a_rust_reader(rust_example: str) -> None:
    writer = MessageQueue(1, 1, max_chunk_bytes=CHUNK, max_chunks=4)
    text = str(writer.export_handle())
    objects = [b"pickled bytes", {"step": 7, "tokens": [1, 2, 3]}, b"x" * (CHUNK * 3)]
    raw = b"raw bytes, no pickle"
    reader = subprocess.Popen(
        [rust_example, "reader", "0", str(len(objects) + 1)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdin is not None
        reader.stdin.write(text + "\n")
        reader.stdin.close()
        writer.wait_until_ready(timeout=STEP)
        for obj in objects:  # raw bytes (Rust's dequeue refuses a pickled object)
            writer.enqueue_bytes(pickle.dumps(obj, protocol=5), timeout=STEP)
        with writer.acquire_write(timeout=STEP) as chunk:
            chunk[: len(raw)] = raw
        out = output(reader)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0
    lines = out.splitlines()
    # Rust parsed the text and prints it back the same.
    assert lines[0] == text
    messages = []
    for line in lines[1:]:
        length, data = line.split(" ") if " " in line else (line, "")
        messages.append(bytes.fromhex(data))
        assert len(messages[-1]) == int(length)
    assert len(messages) == len(objects) + 1
    # What enqueue_bytes sent arrives as sent.
    assert [pickle.loads(m) for m in messages[:-1]] == objects
    # acquire_write's chunk arrives whole (max_chunk_bytes), starting with what was written.
    assert len(messages[-1]) == CHUNK and messages[-1].startswith(raw)


def rust_parse(rust_example: str, lines: list[str]) -> list[str]:
    """What ``handle_roundtrip parse`` prints for each line."""
    done = subprocess.run(
        [rust_example, "parse"],
        input="".join(f"{line}\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=STEP,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_both_languages_print_and_refuse_the_same_texts(rust_example: str) -> None:
    writer = MessageQueue(2, 1, max_chunk_bytes=CHUNK, max_chunks=2)  # one remote reader
    exported = writer.export_handle()
    assert exported.remote_secret is not None and exported.remote_subscribe_addr is not None
    handles = [
        exported,
        Handle(),
        Handle(
            local_reader_ranks=[3, 0, 7],
            buffer_handle=(3, 1 << 20, 10, "shmq_ring_1_abc"),
            remote_subscribe_addr="tcp://[::1]:5555",
            remote_addr_ipv6=True,
            remote_secret="A5" * 32,  # uppercase digits parse; printed lowercase
        ),
    ]
    texts = [str(h) for h in handles]
    assert rust_parse(rust_example, texts) == texts
    for h, t in zip(handles, texts, strict=True):
        back = Handle.from_str(t)
        assert (back.local_reader_ranks, back.buffer_handle, back.remote_subscribe_addr) == (
            h.local_reader_ranks,
            h.buffer_handle,
            h.remote_subscribe_addr,
        )
        assert back.remote_secret == (h.remote_secret.lower() if h.remote_secret else None)
    assert Handle.from_str(texts[0]) == exported
    # The secret is 32 bytes as 64 lowercase hex digits, the text's last field.
    assert texts[0].rsplit("|", 1)[1] == exported.remote_secret
    assert texts[2].endswith("|" + "a5" * 32)

    bad = [
        "",
        "nonsense",
        "shmq-handle-2|0|||0||",
        texts[0].rsplit("|", 1)[0],  # a field short
        texts[0][:-1],  # 63 hex digits
        texts[2].replace("|1|", "|true|"),
        texts[2].replace("3,0,7", "3,-1,7"),
    ]
    for text, rust in zip(bad, rust_parse(rust_example, bad), strict=True):
        with pytest.raises(ValueError, match=r"^not a shmq queue handle \(") as e:
            Handle.from_str(text)
        # The same words in both languages, and never the secret.
        assert rust == f"error: {e.value}"
        assert exported.remote_secret[:16] not in str(e.value)


def test_bad_text_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r'it must start with "shmq-handle-3\|"'):
        Handle.from_str("Handle(local_reader_ranks=[0])")
    with pytest.raises(ValueError, match="another shmq version"):
        Handle.from_str("shmq-handle-2|0|1,64,2,x|||0||")
    with pytest.raises(ValueError, match="the IPv6 flag must be 0 or 1"):
        Handle.from_str("shmq-handle-3|0|1,64,2,x|||2||")
    with pytest.raises(ValueError, match="the secret must be 64 hexadecimal digits"):
        Handle.from_str("shmq-handle-3|0|1,64,2,x|||0||" + "g" * 64)
    with pytest.raises(TypeError, match="takes a str"):
        Handle.from_str(b"shmq-handle-3|0||||0||")  # type: ignore[arg-type]
    # Whitespace around the line (a trailing newline) is no part of it.
    assert Handle.from_str("  shmq-handle-3|0||||0||\n") == Handle(local_reader_ranks=[0])


def test_the_text_carries_the_secret_but_reprs_do_not() -> None:
    writer = MessageQueue(2, 1, max_chunk_bytes=CHUNK, max_chunks=2)
    handle = writer.export_handle()
    assert handle.remote_secret is not None
    assert handle.remote_secret in str(handle)
    assert handle.remote_secret not in repr(handle)
    assert handle.remote_secret not in repr(writer)
    # Pickling is unchanged by the text form.
    assert pickle.loads(pickle.dumps(handle)) == handle


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-p", "no:xdist", *sys.argv[1:]]))
