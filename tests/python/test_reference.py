"""The reference where users are (issue 59 item 4): the store's error and slot type are
exported from ``shmq`` (so the reference, which lists ``shmq.__all__``, has their
entries); ``scripts/api_reference.py`` without pdoc says what to install instead of a
traceback (run in a real interpreter with pdoc hidden); and the docstrings the reference
renders hold no construct pdoc shows wrongly: a ``literal`` broken across lines (shown
with its line break and indentation) or Sphinx's ``~`` shortening (shown as a stray
``~`` before the link)."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import runpy
import sys
from pathlib import Path
from typing import Any, Iterator

import shmq
from shmq import ReaderSlotInfo, StoreReaderDiedError
from shmq import object_storage

ROOT = Path(__file__).resolve().parents[2]

# The pages of the reference (scripts/api_reference.py's MODULES, read from the script,
# those that import without vLLM) and the modules their entries come from.
_PAGES = runpy.run_path(str(ROOT / "scripts" / "api_reference.py"), run_name="api_reference")["MODULES"]
MODULES = [
    *(m for m in _PAGES if m not in ("shmq.vllm_ec_connector", "shmq.vllm_serde")),
    "shmq.message_queue",
    "shmq.gather",
    "shmq.object_storage",
    "shmq.workers.child",
    "shmq.workers.processes",
]


def test_the_store_error_and_slot_type_are_exported() -> None:
    assert StoreReaderDiedError is object_storage.StoreReaderDiedError
    assert ReaderSlotInfo is object_storage.ReaderSlotInfo
    assert {"StoreReaderDiedError", "ReaderSlotInfo"} <= set(shmq.__all__)
    assert issubclass(StoreReaderDiedError, shmq.PeerDiedError) and issubclass(StoreReaderDiedError, MemoryError)
    assert StoreReaderDiedError.__doc__ and ReaderSlotInfo.__doc__


def test_the_reference_script_without_pdoc_says_what_to_install(tmp_path: Path) -> None:
    hide_pdoc = (
        "import runpy, sys\n"
        "sys.modules['pdoc'] = None  # import pdoc raises ImportError, as where it is not installed\n"
        f"sys.argv = ['api_reference.py', {str(tmp_path)!r}]\n"
        f"runpy.run_path({str(ROOT / 'scripts' / 'api_reference.py')!r}, run_name='__main__')\n"
    )
    run = subprocess.run([sys.executable, "-c", hide_pdoc], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "pip install pdoc" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not any(tmp_path.iterdir()), "nothing built"


def _docstrings() -> Iterator[tuple[str, str]]:
    seen: set[int] = set()

    def walk(obj: Any, where: str) -> Iterator[tuple[str, str]]:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        doc = inspect.getdoc(obj)
        if doc:
            yield where, doc
        if inspect.ismodule(obj) or inspect.isclass(obj):
            for name, value in vars(obj).items():
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                own = getattr(value, "__module__", None) or ""
                if isinstance(value, property) or (
                    (inspect.isclass(value) or inspect.isfunction(value)) and own.startswith("shmq")
                ):
                    yield from walk(value, f"{where}.{name}")

    for module in MODULES:
        yield from walk(importlib.import_module(module), module)


def test_no_docstring_breaks_a_literal_across_lines_or_shortens_a_link_with_a_tilde() -> None:
    broken = [
        (where, literal)
        for where, doc in _docstrings()
        for literal in re.findall(r"``(.*?)``", doc, re.S)
        if "\n" in literal
    ]
    assert not broken, broken
    tildes = [(where, m) for where, doc in _docstrings() for m in re.findall(r":\w+:`~[^`]*`", doc)]
    assert not tildes, tildes
