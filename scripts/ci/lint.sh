#!/usr/bin/env bash
# The lints: `bash scripts/ci/lint.sh [rust|python]` (no argument: both).
#
#   rust     formatting (the workspace and the fuzz targets), clippy with every warning an
#            error (undocumented unsafe blocks included), and the docs (`cargo doc`, warnings
#            are errors). Needs only cargo.
#   python   ruff over the package, the tests, the scripts, the examples and the bench;
#            the stubs of shmq._core against the built module (stubtest), mypy over the
#            package and, under --strict, the typing test of the public API; the API
#            reference (pdoc) with its links checked. Needs .venv (bash scripts/envs.sh); builds shmq into it.
#
# scripts/test.sh runs the Rust half first and the Python half once .venv is made.
set -euo pipefail
# shellcheck source=scripts/ci/common.sh
source "$(dirname "$0")/common.sh"

rust() {
  use_libzmq_once
  step "Rust: lints (clippy, every warning an error: undocumented unsafe blocks included) and docs"
  # Formatting: every crate of the workspace, and the fuzz targets (a workspace of their own).
  cargo fmt --all -- --check
  cargo fmt --manifest-path fuzz/Cargo.toml --all -- --check
  cargo clippy --workspace --all-targets -- -D warnings
  RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
}

python() {
  build_shmq
  step "Python: ruff over the package, the tests, the scripts, the examples and the bench"
  .venv/bin/python -m ruff check python tests scripts examples bench

  step "Python: the stubs of shmq._core against the built module, and the types"
  # stubtest compares python/shmq/_core.pyi with the extension (every name, signature,
  # default; the allowlist says why each exception exists); mypy checks the package, and
  # the typing test of the public API under --strict.
  .venv/bin/python -m mypy.stubtest shmq._core --allowlist scripts/stubtest-allowlist --ignore-unused-allowlist
  .venv/bin/python -m mypy python/shmq
  .venv/bin/python -m mypy --strict tests/python/test_typing.py

  step "Python: the API reference (pdoc, from the docstrings and the stubs) into target/api-reference, its links checked"
  .venv/bin/python scripts/api_reference.py
}

case "${1:-both}" in
  rust) rust ;;
  python) python ;;
  both) rust; python ;;
  *) echo "usage: bash scripts/ci/lint.sh [rust|python]" >&2; exit 2 ;;
esac
