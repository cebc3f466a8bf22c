"""Hard-link an installed distribution, and every distribution it requires on this
platform, from this interpreter's environment into another environment's site-packages.

    .venv/bin/python scripts/link_dists.py torch target/engine-venv/lib/python3.11/site-packages

scripts/engine.sh uses it so that the engine venv and the test venv share one copy of
torch and its CUDA libraries (PyPI's torch is a CUDA build that needs them to import, on
CPU too: gigabytes) instead of unpacking a second one; a full CI run ran out of disk with
two. Hard links cost no space and stay valid when either venv is removed. Only files
inside site-packages are linked (a distribution's scripts in bin/ name their own venv's
interpreter); pip in the target venv then sees the distributions as installed.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(name: str) -> dict[str, md.Distribution]:
    """``name`` and what it requires here, recursively (markers evaluated, with the extras asked for)."""
    found: dict[str, md.Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str]]] = [(name, frozenset())]
    while todo:
        req_name, extras = todo.pop()
        key = canonicalize_name(req_name)
        if (key, extras) in seen:
            continue
        seen.add((key, extras))
        dist = found.setdefault(key, md.distribution(req_name))
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""}))
            if wanted:
                todo.append((req.name, frozenset(req.extras)))
    return found


def link(dist: md.Distribution, site: Path, target: Path) -> int:
    count = 0
    for rel in dist.files or []:
        src = Path(dist.locate_file(rel)).resolve()
        try:
            inner = src.relative_to(site)
        except ValueError:  # bin/ scripts and the like: outside site-packages
            continue
        if not src.is_file():
            continue
        dst = target / inner
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists() or dst.is_symlink():
            dst.unlink()
        os.link(src, dst)
        count += 1
    return count


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    name, target = sys.argv[1], Path(sys.argv[2]).resolve()
    site = Path(md.distribution(name).locate_file("")).resolve()
    total = 0
    dists = closure(name)
    for dist in dists.values():
        total += link(dist, site, target)
    names = ", ".join(sorted(f"{d.metadata['Name']} {d.version}" for d in dists.values()))
    print(f"linked {total} files of {len(dists)} distributions into {target}: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
