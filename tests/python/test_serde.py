"""Serde of the object store: ``MsgpackSerde`` and ``PickleSerde``
round trips through a real store and a reader process, compared exactly (dtype, shape
and every element's bits), plus the ``ObjectSerde`` contract.

One long-lived reader process (``serde_service``) serves the whole module: each test
makes its own store, puts its values, and the reader opens the store from the pickled
handle, gets every value and sends back an exact description (``canon``) of it.
"""

from __future__ import annotations

import datetime
import decimal
import gc
import math
import pickle
import re
import warnings

import numpy as np
import pytest
import torch  # the tensor tests must run: torch is required, not optional

from shmq import MsgpackSerde, ObjectSerde, ObjectStorage, PickleSerde, RingBuffer

from _processes import Children
from _processes.store_children import (
    KEEPERS,
    PartsSerde,
    Point,
    POINT_ENCODED,
    Thing,
    canon,
    register_point,
    serde_service,
    store_frame,
    tensor_bytes,
)

pytestmark = pytest.mark.timeout(180)

SERDES = [MsgpackSerde, PickleSerde]

warnings.filterwarnings("ignore", message=".*ComplexHalf support is experimental.*")
warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*deprecated.*")


# ---------------------------------------------------------------------------------
# Fixtures and drivers


class Service:
    def __init__(self) -> None:
        self.kids = Children()
        self.out = self.kids.queue()
        self.cmds = self.kids.queue()
        self.proc = self.kids.start(serde_service, self.out, self.cmds)
        self.kids.expect(self.out, "ready", timeout=60)

    def read(self, store: ObjectStorage, handles: dict, point: bool = False) -> dict:
        items = [(k, a, i) for k, (a, i) in handles.items()]
        self.cmds.put(("read", pickle.dumps(store.handle()), items, point))
        assert self.proc.is_alive(), f"the reader process died (exit code {self.proc.exitcode})"
        return self.kids.expect(self.out, "read", timeout=120)[1]

    def close(self) -> None:
        if self.proc.is_alive():
            self.cmds.put(("stop",))
            try:
                self.kids.receive(self.out, timeout=10)
            except AssertionError:
                pass
        self.kids.close()


@pytest.fixture(scope="module")
def reader():
    s = Service()
    try:
        yield s
    finally:
        s.close()


def _short(c) -> str:
    r = repr(c)
    return r if len(r) < 300 else r[:300] + "..."


def round_trip(reader: Service, serde, values: dict, point: bool = False) -> None:
    """Put every value with ``serde``, read it in the writer's process and in the reader
    process, and check both are exactly the value that was put. All failures are
    reported together."""
    sizes = 0
    for v in values.values():
        sizes += _approx_size(v)
    ring = RingBuffer(max(1 << 16, 4 * sizes + (64 << 10)), create=True)
    store = ObjectStorage(max(1 << 15, 2 * sizes + (32 << 10)), 1, ring, serde_class=serde)
    handles, failures = {}, []
    expected = {}
    for k, v in values.items():
        expected[k] = canon(v)
        try:
            handles[k] = store.put(k, v)
        except Exception as e:
            failures.append(f"{k}: put raised {type(e).__name__}: {e}")
    for k, h in handles.items():
        try:
            got = canon(store.get(*h))
        except Exception as e:
            failures.append(f"{k}: get in the writer raised {type(e).__name__}: {e}")
            continue
        if got != expected[k]:
            failures.append(f"{k}: the writer's get differs:\n  put {_short(expected[k])}\n  got {_short(got)}")
    results = reader.read(store, handles, point)
    for k in handles:
        status, *rest = results[k]
        if status == "raised":
            failures.append(f"{k}: get in the reader process raised {rest[0]}: {rest[1]}")
        elif rest[0] != expected[k]:
            failures.append(f"{k}: the reader's get differs:\n  put {_short(expected[k])}\n  got {_short(rest[0])}")
    del store, ring  # (the leftover check collects, should a cycle hold them)
    failed = {f.split(":", 1)[0] for f in failures}
    assert not failures, f"{serde.__name__}: {len(failed)} of {len(values)} values failed:\n" + "\n".join(failures)


def _approx_size(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size() + 256
    if isinstance(v, np.ndarray):
        return v.nbytes + 256
    if isinstance(v, (list, tuple)):
        return sum(_approx_size(x) for x in v) + 64
    if isinstance(v, dict):
        return sum(_approx_size(x) for x in v.values()) + 64 * len(v) + 64
    return 256


# ---------------------------------------------------------------------------------
# torch tensors: every dtype, every layout


def _all_torch_dtypes() -> list[torch.dtype]:
    return sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)


ALL_DTYPES = _all_torch_dtypes()
QUANTIZED = {d for d in ALL_DTYPES if str(d).startswith(("torch.qint", "torch.quint"))}
PACKED_QUANTIZED = {d for d in QUANTIZED if "x" in str(d)}  # quint4x2, quint2x4
# The dtypes named in the brief: all of them must be in the enumeration above.
NAMED = [
    "float16", "float32", "float64", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "complex64", "complex128",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool",
]  # fmt: skip


def test_the_dtype_enumeration_covers_the_named_dtypes():
    names = {str(d).removeprefix("torch.") for d in ALL_DTYPES}
    for n in ("float16", "float32", "float64", "bfloat16", "complex64", "complex128", "bool"):
        assert n in names
    for n in NAMED:
        if hasattr(torch, n):
            assert n in names, n
    assert len(ALL_DTYPES) >= 20


def _random_tensor(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype in QUANTIZED:
        base = torch.randn(shape, generator=g) * 3
        return torch.quantize_per_tensor(base, 0.05, 3, dtype)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    es = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * es,), dtype=torch.uint8, generator=g)
    # any bit pattern: NaNs, infinities, subnormals, negative zeros included
    return raw.view(dtype).reshape(shape)


def tensor_variants(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    t = _random_tensor(dtype, (4, 6), 1)
    v = {
        "plain": t,
        "zero_d_view": t[1, 2],
        "zero_d": _random_tensor(dtype, (), 2),
        "zero_size": t[:0],
        "zero_size_3d": _random_tensor(dtype, (2, 0, 3), 3),
        "transposed": t.T,
        "sliced_step": t[:, ::2],
        "offset_rows": t[1:3],
        "one_element": t[2:3, 4:5],
        "large": _random_tensor(dtype, (64, 1024), 4),
        "large_transposed": _random_tensor(dtype, (256, 96), 5).T,
    }
    if dtype not in QUANTIZED:
        v["expanded_stride_0"] = t[0:1].expand(3, 6)
        v["3d_permuted"] = _random_tensor(dtype, (2, 3, 4), 6).permute(2, 0, 1)
    if dtype in (torch.complex64, torch.complex128):
        v["conj"] = t.conj()
    if dtype in PACKED_QUANTIZED:
        # Several values per byte: torch cannot address a view that starts inside a byte
        # (its own pickle does not round-trip those), so only views from offset 0.
        v = {k: x for k, x in v.items() if x.storage_offset() == 0}
    return v


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("serde", SERDES, ids=lambda s: s.__name__)
def test_torch_dtype_round_trip(reader, serde, dtype):
    variants = tensor_variants(dtype)
    for name, t in variants.items():  # the test data is what it claims to be
        assert t.dtype == dtype, name
    assert not variants["transposed"].is_contiguous()
    round_trip(reader, serde, variants)


def test_tensor_comparison_is_bit_exact():
    """The comparison used above tells apart what torch.equal would not."""
    nan1 = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert canon(nan1) == canon(nan1.clone())
    assert canon(nan1) != canon(nan2)
    assert canon(torch.tensor([0.0])) != canon(torch.tensor([-0.0]))
    assert canon(torch.zeros(2, 3)) != canon(torch.zeros(3, 2))
    assert canon(torch.zeros(2, dtype=torch.float16)) != canon(torch.zeros(2, dtype=torch.bfloat16))
    t = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    assert tensor_bytes(t.T) == t.T.contiguous().numpy().tobytes()


def test_tensor_results_are_plain_writable_cpu_tensors():
    ring = RingBuffer(1 << 16, create=True)
    store = ObjectStorage(1 << 14, 1, ring, reader_lock=object())
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).T
    h = store.put("t", t)
    for serde_result in (store.get(*h), store.get(*h)):
        assert type(serde_result) is torch.Tensor and serde_result.device.type == "cpu"
        assert serde_result.dtype == t.dtype and serde_result.shape == t.shape
        assert torch.equal(serde_result, t)
        serde_result += 1  # a private, writable copy: the stored object is unchanged


# ---------------------------------------------------------------------------------
# numpy arrays


NUMPY_DTYPES = [
    "?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8",
    "f2", "f4", "f8", "g", "c8", "c16", "G",
    ">i4", ">f8", ">c16", "<M8[ns]", "<m8[s]", "M8[D]",
    "S7", "U5", "V3", "struct", "O",
]  # fmt: skip


def _random_array(code: str, shape: tuple, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if code == "?":
        return (rng.integers(0, 2, n) == 1).reshape(shape)
    if code == "O":
        pool = [1, "two", None, (3, 4), [5.5], b"six", {"seven": 7}, 2**70]
        a = np.empty(n, dtype=object)
        for i in range(n):
            a[i] = pool[int(rng.integers(0, len(pool)))]
        return a.reshape(shape)
    if code == "U5":
        letters = np.array(list("abcdeé日本xyz"))
        return letters[rng.integers(0, len(letters), (n, 5))].view("U5").reshape(shape)
    dtype = np.dtype([("a", "<i4"), ("b", "<f8", (2,))]) if code == "struct" else np.dtype(code)
    raw = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def array_variants(code: str) -> dict[str, np.ndarray]:
    a = _random_array(code, (4, 6), 1)
    ro = a.copy()
    ro.setflags(write=False)
    v = {
        "plain": a,
        "zero_d": _random_array(code, (), 2),
        "zero_size": _random_array(code, (0,), 3),
        "zero_size_3d": _random_array(code, (2, 0, 3), 4),
        "strided": a[::2],
        "strided_cols": a[:, 1::3],
        "transposed": a.T,
        "fortran": np.asfortranarray(_random_array(code, (5, 7), 5)),
        "reversed": a[::-1, ::-1],
        "broadcast_stride_0": np.broadcast_to(a[0], (3, 6)),
        "read_only": ro,
        "large": _random_array(code, (128, 256), 6) if code != "O" else a,
    }
    if code not in ("O", "?") and np.dtype(a.dtype).itemsize > 1:
        buf = bytearray(a.nbytes + 1)
        unaligned = np.frombuffer(buf, dtype=a.dtype, offset=1, count=a.size).reshape(4, 6)
        unaligned[...] = a
        v["unaligned"] = unaligned
    return v


NUMPY_VARIANTS = list(array_variants("i4"))


def test_numpy_variants_are_what_they_claim():
    for code in NUMPY_DTYPES:
        v = array_variants(code)
        assert v["zero_d"].ndim == 0 and v["zero_size"].size == 0
        assert not v["transposed"].flags.c_contiguous
        assert v["fortran"].flags.f_contiguous and not v["fortran"].flags.c_contiguous
        assert 0 in v["broadcast_stride_0"].strides
        assert not v["read_only"].flags.writeable


@pytest.mark.parametrize("variant", NUMPY_VARIANTS)
@pytest.mark.parametrize("serde", SERDES, ids=lambda s: s.__name__)
def test_numpy_round_trip(reader, serde, variant):
    """One layout, every dtype (a failure lists the dtypes that fail)."""
    values = {}
    for code in NUMPY_DTYPES:
        v = array_variants(code)
        if variant in v:
            values[f"{code}"] = v[variant]
    round_trip(reader, serde, values)


# ---------------------------------------------------------------------------------
# Multimodal items, other objects, registered types


def multimodal_item() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "pixel_values": torch.randn(2, 3, 16, 16, generator=g).to(torch.bfloat16),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 8]]),
        "image_embeds": [torch.randn(5, 8, generator=g), np.arange(7, dtype=np.float16)],
        "pairs": (torch.zeros(0, 3, dtype=torch.float16), np.zeros((2, 0))),
        "transposed": torch.arange(12.0).reshape(3, 4).T,
        "requires_grad": torch.ones(3, requires_grad=True),
        "masks": torch.rand(4, 4, generator=g) > 0.5,
        "scales": torch.tensor(0.5, dtype=torch.float64),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
        "meta": {
            "str": "a prompt, 日本語",
            "bytes": b"\x00raw\xff",
            "int": -7,
            "big_uint64": 2**64 - 1,
            "min_int64": -(2**63),
            "float": 1.25,
            "nan": float("nan"),
            "-inf": float("-inf"),
            "-0.0": -0.0,
            "bool": False,
            "none": None,
        },
        "nested": [[(1, (2, [3, (torch.ones(1, dtype=torch.int8), np.float32(2.5))]))]],
        "empty_list": [],
        "empty_tuple": (),
        "empty_dict": {},
        "int_keys": {1: "one", 2: torch.arange(3)},
        "tuple_of_tuples": ((1,), (2, (3,)), ()),
    }


@pytest.mark.parametrize("serde", SERDES, ids=lambda s: s.__name__)
def test_multimodal_items_round_trip(reader, serde):
    item = multimodal_item()
    values = {
        "item": item,
        "top_level_tuple": (item["image_embeds"], item["meta"], (item["pairs"],)),
        "top_level_list": [item["pixel_values"], item["meta"]],
        "list_of_items": [multimodal_item(), multimodal_item()],
        "single_tensor": item["pixel_values"],
        "single_array": item["fortran"],
    }
    round_trip(reader, serde, values)


def test_tuples_stay_tuples_and_lists_stay_lists():
    """The exact comparison distinguishes them (so the round trips above check it)."""
    assert canon((1, 2)) != canon([1, 2])
    assert canon({"a": (1,)}) != canon({"a": [1]})
    assert canon(True) != canon(1) and canon(1) != canon(1.0)


@pytest.mark.parametrize("serde", SERDES, ids=lambda s: s.__name__)
def test_other_objects_are_pickled_and_round_trip(reader, serde):
    values = {
        "custom_class": Thing("thing", {"payload": [1, (2, 3)]}),
        "set": {1, "two", (3, 4)},
        "frozenset": frozenset({b"a", 5}),
        "big_int": 2**70 + 12345,
        "negative_big_int": -(2**70),
        "int_2**64": 2**64,
        "int_below_min_int64": -(2**63) - 1,
        "complex": complex(1.5, -2.0),
        "numpy_scalar_f32": np.float32(1.5),
        "numpy_scalar_i64": np.int64(-3),
        "numpy_scalar_c128": np.complex128(1 - 2j),
        "datetime": datetime.datetime(2024, 5, 6, 7, 8, 9, 123456),
        "decimal": decimal.Decimal("3.14159265358979323846264338327950288"),
        "range": range(3, 30, 3),
        "dict_with_thing_and_tensor": {"thing": Thing("t", 1), "t": torch.ones(2)},
        "big_int_next_to_a_tensor": {"big": 2**70, "t": torch.arange(4, dtype=torch.int16)},
        "set_in_a_list": [{1, 2}, torch.zeros(1)],
        "non_str_keys": {(1, 2): "tuple key", 3: "int key", b"k": "bytes key", None: "none key", 1.5: "float"},
    }
    if serde is PickleSerde:
        values["bytearray"] = bytearray(b"mutable")
    round_trip(reader, serde, values)


def test_msgpack_stores_bytearrays_as_bytes(reader):
    """Documented limitation: msgpack packs bytearray and memoryview leaves as its binary
    type without consulting `default`, so they come back as bytes (with the same content)."""
    serde = MsgpackSerde()
    data, _, metadata, _ = serde.serialize({"b": bytearray(b"mutable"), "m": memoryview(b"view")})
    parts = [metadata, *data] if isinstance(data, list) else [metadata, data]
    assert serde.deserialize(memoryview(b"".join(bytes(p) for p in parts))) == {"b": b"mutable", "m": b"view"}


def test_msgpack_register_a_custom_type(reader):
    register_point()
    register_point()  # registering the same type again is harmless
    POINT_ENCODED.clear()
    values = {
        "point": Point(1, -2),
        "nested": {"pts": [Point(3, 4), (Point(-5, 6),)], "t": torch.ones(2)},
    }
    round_trip(reader, MsgpackSerde, values, point=True)
    assert len(POINT_ENCODED) >= 3, "the registered encoder was not used"


def test_msgpack_stores_tensors_and_arrays_without_pickle(monkeypatch):
    def no_pickle(*a, **k):
        raise AssertionError("MsgpackSerde pickled a tensor, an array or a multimodal item")

    item = multimodal_item()
    del item["nested"]  # holds a numpy scalar, which is pickled by design
    t = torch.arange(4096, dtype=torch.float32)
    item["big"] = t
    monkeypatch.setattr(pickle, "dumps", no_pickle)
    monkeypatch.setattr(pickle, "Pickler", no_pickle)
    data, nbytes, metadata, md_nbytes = MsgpackSerde().serialize(item)
    monkeypatch.undo()
    parts = data if isinstance(data, list) else [data]
    raw = t.numpy().tobytes()
    assert any(bytes(memoryview(p)) == raw for p in parts), "the tensor's buffer is not a separate segment"
    value = MsgpackSerde().deserialize(memoryview(bytes(metadata) + b"".join(bytes(memoryview(p)) for p in parts)))
    assert canon(value) == canon(item)


# ---------------------------------------------------------------------------------
# The ObjectSerde contract


SERIALIZE_CASES = {
    "int": 5,
    "str": "x" * 100,
    "tensor": torch.arange(10, dtype=torch.float64),
    "array": np.arange(10, dtype=np.int32).reshape(2, 5).T,
    "item": {"a": [torch.ones(3), np.zeros(2)], "b": ("s", b"b", None)},
    "empty_tensor": torch.empty(0, 5),
}


@pytest.mark.parametrize("case", list(SERIALIZE_CASES))
@pytest.mark.parametrize("serde", SERDES + [PartsSerde], ids=lambda s: s.__name__)
def test_serialize_returns_consistent_sizes_and_the_store_layout(serde, case):
    value = ["part one", "", "part three: é"] if serde is PartsSerde else SERIALIZE_CASES[case]
    data, nbytes, metadata, md_nbytes = serde().serialize(value)
    parts = data if isinstance(data, list) else [data]
    for p in parts:
        memoryview(p)  # bytes-like
    assert nbytes == sum(memoryview(p).nbytes for p in parts)
    assert md_nbytes == len(metadata)
    stored = bytes(metadata) + b"".join(bytes(memoryview(p)) for p in parts)
    assert len(stored) == md_nbytes + nbytes
    assert canon(serde().deserialize(memoryview(stored))) == canon(value)
    # In the store: [0-7 pad][count word: count u32, id tag u32][n][n x (offset, len)]
    # [parts], offsets from the start of the chunk's data (see `store_frame`). A built-in serde's parts are its own (the
    # tree or pickle stream, then the raw buffers, each on a 64-byte boundary of the
    # ring); a custom serde's are its metadata and data, back to back, as in vLLM.
    ring = RingBuffer(1 << 16, create=True)
    # With a reader lock the writer's own get counts as a read (vLLM's), so the count
    # word can be seen to change.
    store = ObjectStorage(1 << 14, 1, ring, serde_class=serde, reader_lock=object())
    ring.allocate_buf(3)  # the object's chunk starts at an odd offset (11)
    builtin = serde is not PartsSerde
    stored_parts = (
        [bytes(memoryview(p)) for p in serde()._store_parts(value)]
        if builtin
        else [bytes(metadata)] + [bytes(memoryview(p)) for p in parts]
    )
    address, mid = store.put("k", value)
    assert address == 11
    data_offset = address + 8
    with ring.access_buf(address) as (view, (hid, size)):
        assert hid == mid and size == 8 + len(view)
        count, tag, pad, entries = store_frame(view, data_offset)
        assert count == 0, "the reader count starts at 0"
        assert len(entries) == len(stored_parts)
        at = pad + 12 + 8 * len(entries)
        for i, ((off, length), expected) in enumerate(zip(entries, stored_parts, strict=True)):
            assert bytes(view[off : off + length]) == expected
            if builtin and i >= 1:
                assert (data_offset + off) % 64 == 0, "raw buffers are 64-byte aligned in the ring"
                assert off - at < 64, "no more padding than alignment needs"
            else:
                assert off == at, "parts follow each other"
            at = off + length
        assert at == len(view), "the chunk is sized exactly"
    assert canon(store.get(address, mid)) == canon(value)
    with ring.access_buf(address) as (view, _):
        # The read was counted in the count word's low half; the tag did not move.
        assert store_frame(view, data_offset)[:2] == (1, tag) == (store.reader_count(address, mid), tag)


def test_object_serde_is_abstract():
    with pytest.raises(TypeError):
        ObjectSerde()


def test_a_custom_serde_with_several_parts_across_processes(reader):
    round_trip(reader, PartsSerde, {"a": ["x", "yy", ""], "b": [], "c": ["é" * 1000]})


def test_deserialized_values_do_not_alias_the_store():
    """Values read before their memory is reused keep their contents."""
    ring = RingBuffer(8192, create=True)
    for serde in SERDES:
        store = ObjectStorage(4096, 1, ring, serde_class=serde, reader_lock=object())
        t = torch.arange(256, dtype=torch.int32)
        a = np.arange(256, dtype=np.int64)
        got = store.get(*store.put("v", {"t": t, "a": a, "b": b"q" * 100}))
        for n in range(40):  # reuse the whole ring several times
            store.get(*store.put(f"f{n}", {"t": torch.full((256,), -1, dtype=torch.int32), "a": -a, "b": b"z" * 100}))
        assert torch.equal(got["t"], t) and np.array_equal(got["a"], a) and got["b"] == b"q" * 100
        store.clear()
        del store
        gc.collect()


@pytest.mark.parametrize("keeper", KEEPERS, ids=lambda k: k.__name__)
def test_a_deserializer_that_keeps_a_view_is_refused(reader, keeper):
    ring = RingBuffer(4096, create=True)
    store = ObjectStorage(1024, 1, ring, serde_class=keeper)
    h = store.put("k", b"hello, shared memory")
    with pytest.raises(RuntimeError) as e:
        kept = store.get(*h)
        print("get returned", repr(kept))
    assert re.search("view|copy", str(e.value), re.I), str(e.value)
    results = reader.read(store, {"k": h})
    status, *rest = results["k"]
    assert status == "raised" and rest[0] == "RuntimeError", f"the reader process got {status}: {rest}"
