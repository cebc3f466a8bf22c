#!/usr/bin/env bash
# The whole test suite, from a fresh clone: Rust tests (unit, multi-process integration,
# doc tests, examples) and the Python suite against a freshly built package.
#
# Python packages go into ./.venv (made on first use, reused after). Set PYTHON to
# choose the interpreter that makes it (default: python3, CPython >= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "Rust: lints (clippy, every warning an error: undocumented unsafe blocks included) and docs"
cargo clippy --all-targets -- -D warnings
cargo clippy --all-targets --features python -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet

step "Rust: cargo test (unit, integration in several processes, doc tests, examples)"
cargo test --all-targets
cargo test --doc
cargo run --quiet --example broadcast

step "Rust: loom model checks of the ring protocol and the sleep/wake handshake"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom

step "Python: test environment in .venv"
# The two-host test makes network namespaces with iproute2 (skipped where it cannot).
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null || echo "(could not install iproute2)"
fi
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "maturin>=1.9.4,<2" -e ".[test]"

step "Python: pytest"
.venv/bin/python -m pytest -q

step "Python: the README's examples"
.venv/bin/python examples/broadcast.py
.venv/bin/python examples/tensors.py
.venv/bin/python examples/encoder_cache.py
.venv/bin/python examples/process_group.py
.venv/bin/python examples/serving.py
# One worker crashes mid-run: the example must report it by name and exit cleanly.
.venv/bin/python examples/serving.py --crash
