# shellcheck shell=bash
# Sourced by scripts/test.sh and every scripts/ci/*.sh: the repository root as the working
# directory, the step lines, and the environment the checks share. Not run on its own.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1

# Step lines count from the start of the whole run: scripts/test.sh exports the start, a
# script run alone starts its own (bash keeps counting SECONDS from the value given).
: "${SHMQ_CI_START:=$(date +%s)}"
export SHMQ_CI_START
SECONDS=$(($(date +%s) - SHMQ_CI_START))
step() { printf '\n== %s  (at %d min %02d s)\n' "$*" $((SECONDS / 60)) $((SECONDS % 60)); }
df_line() { df -h --output=avail,size . | tail -n 1 | awk '{print "disk: " $1 " free of " $2}'; }

# pip keeps no download cache (torch's wheels are unpacked again into the venv anyway) and
# cargo no incremental state (a clean build gains nothing from it): disk on a fresh machine.
export PIP_NO_CACHE_DIR=1 CARGO_INCREMENTAL=0
mkdir -p target

# libzmq built once (scripts/libzmq_once.py, which says why) and the CARGO_HOME whose cargo
# calls link it, target/cargo-home. Once per run: a script started by test.sh finds it set.
# SHMQ_REAL_CARGO_HOME keeps yours, for the wheel (it builds its own libzmq with zig).
use_libzmq_once() {
  if [ "${CARGO_HOME:-}" = "$PWD/target/cargo-home" ]; then return; fi
  step "libzmq (ZeroMQ's C++ library, which zmq-sys compiles from source): built once, linked by every build below"
  export SHMQ_REAL_CARGO_HOME=${CARGO_HOME:-$HOME/.cargo}
  CARGO_HOME=$("${PYTHON:-python3}" scripts/libzmq_once.py)
  export CARGO_HOME
}

# shmq built into .venv (`pip install -e .`, with the libzmq above), once per run: test.sh
# builds it after scripts/envs.sh and exports SHMQ_CI_BUILT; a script run alone builds the
# checkout as it is (cargo finds it up to date when it is). .venv itself is scripts/envs.sh's.
build_shmq() {
  if [ "${SHMQ_CI_BUILT:-}" = 1 ]; then return; fi
  if [ ! -x .venv/bin/python ]; then
    echo "no .venv: make it first with bash scripts/envs.sh (what scripts/test.sh does)"
    exit 1
  fi
  use_libzmq_once
  step "Python: shmq built into .venv"
  .venv/bin/python -m pip install --quiet --no-deps -e .
  export SHMQ_CI_BUILT=1
}
