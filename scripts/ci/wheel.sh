#!/usr/bin/env bash
# The distributions as a user gets them: `bash scripts/ci/wheel.sh [build|newcomer]`
# (no argument: both).
#
#   build      the manylinux_2_17 abi3 wheel (maturin --zig) and the sdist into dist/,
#              audited (scripts/wheel.sh). Needs python3 and cargo: its build tools go into
#              a venv of their own, target/wheel-venv. It builds its own libzmq (zig, for
#              manylinux) in its own target dir, so it runs with your CARGO_HOME, not
#              target/cargo-home's override of the other builds.
#   newcomer   the wheel installed in a fresh venv where cargo and rustc are not on PATH
#              (scripts/newcomer.sh wheel). Needs dist/ from the build.
#
# scripts/test.sh runs the build in the background beside scripts/ci/examples.sh, which
# mostly waits on pip and on processes, not on the CPU (not beside the engine's tests:
# they time it), and the newcomer after it.
set -euo pipefail
# shellcheck source=scripts/ci/common.sh
source "$(dirname "$0")/common.sh"

build() {
  step "Wheel: manylinux_2_17 abi3 wheel (maturin --zig) and sdist into dist/, audited"
  CARGO_HOME=${SHMQ_REAL_CARGO_HOME:-${CARGO_HOME:-$HOME/.cargo}} bash scripts/wheel.sh
}

newcomer() {
  step "Newcomer: the wheel in a fresh venv with no cargo or rustc on PATH"
  bash scripts/newcomer.sh wheel
}

case "${1:-both}" in
  build) build ;;
  newcomer) newcomer ;;
  both) build; newcomer ;;
  *) echo "usage: bash scripts/ci/wheel.sh [build|newcomer]" >&2; exit 2 ;;
esac
