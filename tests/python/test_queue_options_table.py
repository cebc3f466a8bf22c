"""A queue's options are written once, in one table in the binding
(``bindings/python/src/options.rs``, ``queue_options!``), which the binding exports as
``_core.QueueOptions.OPTIONS``. What is written by hand beside it is checked against
that table here: the stub (``_core.pyi``: the constructor and the attributes) and
``MessageQueue`` (its signature, its defaults, and what it passes on to the core).
Adding an option to the table without them fails here, naming what is missing."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from shmq import _core
from shmq.message_queue import MessageQueue

PACKAGE = Path(_core.__file__).parent
OPTIONS = _core.QueueOptions.OPTIONS


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text(), filename=str(path))
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_table_is_the_constructors_signature_every_option_none_by_default() -> None:
    assert type(OPTIONS) is tuple and len(OPTIONS) == len(set(OPTIONS)) > 0
    params = inspect.signature(_core.QueueOptions).parameters
    assert tuple(params) == OPTIONS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None for p in params.values())
    # Each option is an attribute, the core's default when not given.
    options = _core.QueueOptions()
    for name in OPTIONS:
        getattr(options, name)


def test_the_stub_has_every_option_of_the_table_in_its_order() -> None:
    stub = _class(PACKAGE / "_core.pyi", "QueueOptions")
    new = _method(stub, "__new__")
    assert tuple(a.arg for a in new.args.kwonlyargs) == OPTIONS, "_core.pyi: QueueOptions.__new__"
    assert all(isinstance(d, ast.Constant) and d.value is None for d in new.args.kw_defaults)
    properties = tuple(
        n.name
        for n in stub.body
        if isinstance(n, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list)
    )
    assert properties == OPTIONS, "_core.pyi: QueueOptions's attributes"


def test_message_queue_takes_every_option_with_the_cores_defaults_and_passes_each_on() -> None:
    params = inspect.signature(MessageQueue.__init__).parameters
    missing = [name for name in OPTIONS if name not in params]
    assert not missing, f"MessageQueue.__init__ lacks the queue option(s) {missing}"
    core = _core.QueueOptions()
    for name in OPTIONS:
        default = params[name].default
        # None: the core's default; anything else must be the core's default too.
        assert default is None or default == getattr(core, name), (name, default, getattr(core, name))
    # The call that makes the options in MessageQueue.__init__ passes each one as it came.
    init = _method(_class(PACKAGE / "message_queue.py", "MessageQueue"), "__init__")
    (call,) = [
        n
        for n in ast.walk(init)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "QueueOptions"
    ]
    passed = tuple(k.arg for k in call.keywords)
    assert passed == OPTIONS, "MessageQueue.__init__'s _core.QueueOptions(...) call"
    assert all(isinstance(k.value, ast.Name) and k.value.id == k.arg for k in call.keywords)


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("max_chunk_bytes", 4096, 4096),
        ("on_dead_reader", "drop", "drop"),
        ("remote_hwm", 7, 7),
        ("name", "q", "q"),
        ("local_reader_ranks", (2, 3), [2, 3]),
    ],
)
def test_a_given_option_is_what_the_attribute_shows(name: str, value: object, shown: object) -> None:
    assert getattr(_core.QueueOptions(**{name: value}), name) == shown


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"max_chunks": 0}, ValueError, "max_chunks must be a positive number of chunks, got 0"),
        ({"arena_bytes": -1}, ValueError, "arena_bytes must be a non-negative number of bytes (0: no arena), got -1"),
        ({"remote_hwm": 2**31}, ValueError, "remote_hwm must be at most 2147483647 messages, got 2147483648"),
        ({"max_chunk_bytes": True}, TypeError, "max_chunk_bytes must be an int, got bool (True)"),
        ({"name": 5}, TypeError, "name must be a str, got int"),
        (
            {"local_reader_ranks": [1, -1]},
            ValueError,
            "local_reader_ranks must hold ranks (non-negative ints), got [1, -1]",
        ),
    ],
)
def test_a_bad_option_is_refused_by_name(kwargs: dict[str, object], error: type[Exception], words: str) -> None:
    with pytest.raises(error) as e:
        _core.QueueOptions(**kwargs)  # type: ignore[arg-type]
    assert str(e.value) == words
