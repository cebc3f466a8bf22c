"""Build libzmq once for the test command, and make a CARGO_HOME whose cargo calls link it.

zmq-sys compiles libzmq (C++) from source in every profile and target directory that
builds it, most of a release build of shmq's time (docs/performance.md, "The test
command"), and scripts/test.sh builds four of them (the lints and tests, the fuzz targets,
shmq's build into .venv, the wheel). This script builds it once (``cargo build --release -p zmq-sys`` into
target/libzmq) and writes a links override for it: ``[target.<host>.zmq]``, cargo's own way
to skip a -sys crate's build script, with the libraries and search paths that zmq-sys's
build script itself reported (cargo's JSON messages, not a hand-written list).

Cargo reads a links override only from a config file: not from ``--config`` (cargo-clippy
and cargo-fuzz do not pass it on) nor from the environment. So the override goes into a
CARGO_HOME of the test command's own, target/cargo-home: your config file's text plus the
table, and every other entry of your CARGO_HOME linked (the registry, git checkouts, and
cargo's locks and cache tracking, so that cargo calls under either home share them).
When your config already overrides ``zmq`` for this host, it is left as it is.

Prints the new CARGO_HOME. Usage: python3 scripts/libzmq_once.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG_NAMES = ("config.toml", "config")
# Cargo's locks and cache tracking: linked even before they exist, so that both homes
# create and use the same files.
SHARED = ("registry", "git", ".package-cache", ".package-cache-mutate", ".global-cache")


def build() -> tuple[list[str], list[str]]:
    """Build zmq-sys; the libraries and search paths its build script reported."""
    cmd = ["cargo", "build", "--release", "-p", "zmq-sys", "--target-dir", "target/libzmq", "--message-format=json"]
    out = subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout
    for line in out.splitlines():
        msg = json.loads(line) if line.startswith("{") else {}
        if msg.get("reason") == "build-script-executed" and "zmq-sys@" in msg.get("package_id", ""):
            libs = list(dict.fromkeys(msg["linked_libs"]))
            paths = list(dict.fromkeys(msg["linked_paths"]))
            return libs, paths
    sys.exit("libzmq_once: cargo reported no build script run for zmq-sys")


def static_libs(libs: list[str], paths: list[str]) -> list[Path]:
    """The files of the static libraries, found in the search paths."""
    dirs = [Path(p.split("=", 1)[-1]) for p in paths]  # "native=DIR" or "DIR"
    found = []
    for lib in libs:
        if lib.startswith("static="):
            name = f"lib{lib.removeprefix('static=')}.a"
            hits = [d / name for d in dirs if (d / name).is_file()]
            if not hits:
                sys.exit(f"libzmq_once: {name} is in none of {paths}")
            found.append(hits[0])
    return found


def main() -> None:
    real = Path(os.environ.get("CARGO_HOME") or Path.home() / ".cargo")
    host = next(
        line.split(":", 1)[1].strip()
        for line in subprocess.run(["rustc", "-vV"], check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()
        if line.startswith("host:")
    )
    home = ROOT / "target" / "cargo-home"
    home.mkdir(parents=True, exist_ok=True)
    real.mkdir(parents=True, exist_ok=True)
    names = set(SHARED) | {p.name for p in real.iterdir()}
    for name in sorted(names - set(CONFIG_NAMES)):
        link = home / name
        if link.is_symlink() or link.exists():
            if link.is_symlink() and os.readlink(link) == str(real / name):
                continue
            if link.is_dir() and not link.is_symlink():
                sys.exit(f"libzmq_once: {link} is a directory, not a link: remove it")
            link.unlink()
        link.symlink_to(real / name)

    user = next((real / n for n in CONFIG_NAMES if (real / n).is_file()), None)
    text = user.read_text() if user else ""
    theirs = tomllib.loads(text).get("target", {}).get(host, {}).get("zmq") if text else None
    if theirs is not None:
        print(f"libzmq_once: {user} already overrides zmq for {host}: left as it is", file=sys.stderr)
        table = ""
    else:
        libs, paths = build()
        # The libraries' digests: cargo fingerprints the override's text, not the files,
        # so a rebuilt libzmq.a (other flags, another zeromq-src) relinks what links it.
        digest = hashlib.sha256(b"".join(hashlib.sha256(p.read_bytes()).digest() for p in static_libs(libs, paths)))
        table = (
            f"\n[target.{json.dumps(host)}.zmq]\n"
            f"rustc-link-lib = {json.dumps(libs)}\n"
            f"rustc-link-search = {json.dumps(paths)}\n"
            f"libs-sha256 = {json.dumps(digest.hexdigest())}\n"
        )
        print(f"libzmq_once: {', '.join(libs)} from {', '.join(paths)}", file=sys.stderr)
    (home / "config.toml").write_text(text + table)
    print(home)


if __name__ == "__main__":
    main()
