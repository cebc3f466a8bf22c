"""The README's programs run as written, and so do those of ``docs/*.md``.

The convention, for README.md and every docs/*.md file:

- A ```` ```python ```` block is a **complete program**: what a user pastes into a file
  and runs (imports, ``if __name__ == "__main__":`` where spawned children need it, no
  undefined names). Each one is run here.
- A block that is not a whole program is a **fragment**: the text before it says so,
  and the line just before its opening fence (blank lines aside) is the HTML comment
  ``<!-- fragment -->``, which GitHub does not show. Fragments are not run. Use them
  sparingly.
- Blocks in other languages (``sh``, ``rust``, plain) are not run.

Each program is written to a file in a temporary directory and run there with
``sys.executable`` (a file, not ``-c``: spawned children re-import it as their main
module, as they would a user's script), with a 60 s limit. It must exit with 0, leave
no process running, and leave nothing in /dev/shm: every ``shmq_*`` entry that is there
after it ran and was not before fails the test if the program's process or one of its
descendants created it. (The descendants are seen by polling the process tree while it
runs; an entry's creator is read from its name or, for segments named by the user such
as encoder caches, from the segment's header. Entries of other processes on the machine,
e.g. a concurrent test run, are not counted.)

Also checked: the README's fresh-machine set-up is the two commands CI and users run,
and every relative link in these files points at a file (and heading) that exists.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from _processes import WaitTimeout, kill, segment_creator_pid, shm_segments, still_running, wait_for
from shmq.admin import list_segments

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"
RUN_WITHIN = 60.0
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    fragment: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with whether each is marked a fragment."""
    blocks = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})\s*(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        ticks, language, start = fence.group(1), fence.group(2), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        assert end is not None, f"{path.relative_to(ROOT)}:{start + 1}: a code block that is never closed"
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        code = "\n".join(lines[start + 1 : end]) + "\n"
        blocks.append(Block(path, start + 1, language, code, before == FRAGMENT))
        i = end + 1
    return blocks


def _python_blocks() -> list[Block]:
    return [b for path in DOCUMENTS for b in code_blocks(path) if b.language == "python"]


PROGRAMS = [b for b in _python_blocks() if not b.fragment]


def _creators(names: set[str]) -> dict[str, int | None]:
    """Each entry's creator pid: from its name, else from its segment header (None when
    neither says; an entry that is gone by then is left out: another process removed it)."""
    creators: dict[str, int | None] = {}
    unknown = set()
    for name in names:
        pid = segment_creator_pid(name)
        if pid is not None:
            creators[name] = pid
        else:
            unknown.add(name)

    def all_known() -> bool:
        headers = {s.name: s.creator_pid for s in list_segments()}
        for name in list(unknown):
            if headers.get(name) is not None:
                creators[name] = headers[name]
                unknown.discard(name)
            elif not (SHM_DIR / name).exists():
                unknown.discard(name)
        return not unknown

    # A segment being made has no header yet: look again until each has one or is gone
    # (bounded); what is still unknown then is reported as such.
    with contextlib.suppress(WaitTimeout):
        wait_for(all_known, 2.0, "every new segment's header", 0.01)
    creators.update({name: None for name in unknown if (SHM_DIR / name).exists()})
    return creators


def _tree(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _remove(names: set[str]) -> None:
    for name in names:
        path = SHM_DIR / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def test_the_documents_have_programs_to_run():
    readme = [b for b in PROGRAMS if b.path.name == "README.md"]
    assert len(readme) >= 5, [b.where for b in PROGRAMS]


@pytest.mark.parametrize("block", PROGRAMS, ids=[b.where for b in PROGRAMS])
def test_program_runs_as_written(block: Block, tmp_path: Path):
    script = tmp_path / f"{block.path.stem.lower()}_{block.line}.py"
    script.write_text(block.code)
    before = shm_segments()
    out, err = (tmp_path / "stdout").open("w+"), (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=out, stderr=err)
    pids = {proc.pid}

    def ended() -> bool:
        pids.update(_tree(proc.pid))  # every process it starts, while it runs
        return proc.poll() is not None

    with contextlib.suppress(WaitTimeout):
        wait_for(ended, RUN_WITHIN, f"{block.where} to end", 0.01)
    timed_out = proc.poll() is None
    if timed_out:
        pids |= _tree(proc.pid)
        kill(pids)
        proc.wait()
    # The program is gone; what it started must be too (a moment for children that were
    # told to stop, e.g. multiprocessing's resource tracker).
    started = pids - {proc.pid}
    with contextlib.suppress(WaitTimeout):
        wait_for(lambda: not still_running(started), 5.0, "what it started to end", 0.05)
    left_running = still_running(started)
    kill(left_running)
    new = shm_segments() - before
    leaked = {name for name, creator in _creators(new).items() if creator is None or creator in pids}
    _remove(leaked)
    out.seek(0), err.seek(0)
    output = f"--- stdout:\n{out.read()[-4000:]}\n--- stderr:\n{err.read()[-4000:]}"
    assert not timed_out, f"{block.where}: still running after {RUN_WITHIN} s\n{output}"
    assert proc.returncode == 0, f"{block.where}: exit code {proc.returncode}\n{output}"
    assert not left_running, f"{block.where}: processes left running: {left_running}\n{output}"
    assert not leaked, f"{block.where}: left in /dev/shm: {sorted(leaked)}\n{output}"


def test_fragments_say_so():
    """A fragment is the exception: the text just before its marker says it is one."""
    for path in DOCUMENTS:
        lines = path.read_text().splitlines()
        for block in code_blocks(path):
            if block.fragment:
                marker = max(i for i in range(block.line - 1) if lines[i].strip() == FRAGMENT)
                text = " ".join(lines[max(0, marker - 3) : marker]).lower()
                assert "fragment" in text or "not a whole program" in text, (
                    f"{block.where}: a fragment whose text does not say so"
                )


def test_the_readme_sets_up_a_fresh_machine_with_two_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("### Set up: a fresh machine", 1)[1].split("\n#", 1)[0]
    commands = [code.strip() for code in code_blocks_of_text(section)]
    assert commands == ["pip install '.[bench]' ./bench && python -m shmq bench", "bash scripts/test.sh"], commands


def code_blocks_of_text(text: str) -> list[str]:
    """The contents of the fenced blocks in ``text``."""
    return [m.group(2) for m in re.finditer(r"^(`{3,})\w*\n(.*?)^\1\s*$", text, re.S | re.M)]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^(`{3,}).*?^\1\s*$", "", path.read_text(), flags=re.S | re.M)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_relative_links_point_at_what_exists(path: Path):
    text = re.sub(r"^(`{3,}).*?^\1\s*$", "", path.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), f"{path.relative_to(ROOT)}: link to a missing file: {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{path.relative_to(ROOT)}: link to a missing heading: {target}"
