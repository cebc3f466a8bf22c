#!/usr/bin/env bash
# The whole test suite, from a fresh clone: Rust tests (unit, multi-process integration,
# doc tests, examples), the Python suite against a freshly built package, then shmq as a
# newcomer meets it: the README's first command in a fresh venv, and the manylinux wheel
# (built and audited here) installed where there is no Rust.
#
# Each check is a script of scripts/ci/ that runs alone too (its header says what it needs
# first); this one runs them all and overlaps what can run side by side:
#
#   scripts/envs.sh          the Python environments (.venv, vLLM 0.33's requirements, the
#                            engine's venv and model: mostly downloads), in the background
#                            from the start while the Rust steps use the CPU
#   ci/lint.sh rust          formatting, clippy, docs
#   ci/rust-test.sh          cargo test, doc tests, the broadcast example
#   ci/loom.sh               built here, run in the background from once the fuzz targets
#                            are built (which wants both cores) until just before pytest
#   ci/fuzz.sh               the fuzz targets under AddressSanitizer (one core, beside loom)
#   ci/lint.sh python        ruff, stubtest, mypy, the API reference (once .venv is made
#                            and shmq built into it)
#   ci/pytest.sh             the Python suite
#   ci/engine.sh             vLLM's engine with and without the plugin (alone: it times)
#   ci/wheel.sh build        in the background from the engine tests on (at the idle
#                            scheduling class until the engine is done), beside
#                            ci/examples.sh (the README's examples and the newcomer from
#                            source)
#   ci/wheel.sh newcomer     the wheel where there is no Rust
#
# Python packages go into ./.venv (made on first use, reused after). Set PYTHON to
# choose the interpreter that makes it (default: python3, CPython >= 3.11).
set -euo pipefail
# shellcheck source=scripts/ci/common.sh
source "$(dirname "$0")/ci/common.sh"

envs_log=$PWD/target/envs.log
setsid -w bash scripts/envs.sh >"$envs_log" 2>&1 &
envs_pid=$!
loom_pid='' wheel_pid=''
# Background jobs run under setsid: each leads a process group of its own (a background
# job of a script is no group leader, so setsid makes the group without forking: the pid
# is the group's id; -w: were it to fork, it would wait and pass the status on), and a
# failure kills each whole group, what it started included.
# shellcheck disable=SC2154 # p is the trap's own loop variable
trap 'for p in $envs_pid $loom_pid $wheel_pid; do kill -- "-$p" "$p" 2>/dev/null || true; done' EXIT
step "Python environments: made in the background by scripts/envs.sh (log: target/envs.log); $(df_line)"

# libzmq once, for every cargo call below and in the scripts (they inherit CARGO_HOME).
use_libzmq_once

bash scripts/ci/lint.sh rust
bash scripts/ci/rust-test.sh

step "Rust: loom model checks of the protocols (crates/protocol): built now, run beside what follows"
bash scripts/ci/loom.sh --build
loom_log=$PWD/target/loom/loom.log && mkdir -p target/loom

bash scripts/ci/fuzz.sh --build
setsid -w bash scripts/ci/loom.sh >"$loom_log" 2>&1 &
loom_pid=$!
bash scripts/ci/fuzz.sh --run

step "Python: the environments from scripts/envs.sh; $(df_line)"
rc=0 && wait "$envs_pid" || rc=$?
envs_pid='' # waited for: its pid is not ours to signal any more
if [ "$rc" != 0 ]; then
  tail -n 80 "$envs_log"
  echo "making the Python environments failed (output above, all of it in $envs_log)"
  exit 1
fi
grep '^== ' "$envs_log"
build_shmq # exports SHMQ_CI_BUILT: the scripts below use this build

bash scripts/ci/lint.sh python

step "Rust: the loom model checks' result (they ran in the background since the fuzz targets were built)"
rc=0 && wait "$loom_pid" || rc=$?
loom_pid=''
if [ "$rc" = 0 ]; then
  grep -E '^(test |test result)' "$loom_log"
else
  cat "$loom_log"
  echo "loom model checks failed (output above, also in $loom_log)"
  exit 1
fi

bash scripts/ci/pytest.sh

# The wheel's build runs through vLLM's engine tests on what the engine leaves of the
# cores (a quarter, in its waits): at the idle scheduling class (SCHED_IDLE), it runs only
# when nothing else wants a core, so the engine's timings are its own. Once the engine
# is done, it gets its share of the cores again (all its processes, threads included).
step "Wheel: built and audited in the background, on the cores' idle time through the engine tests (log: target/wheel.log)"
wheel_log=$PWD/target/wheel.log
idle=() && chrt --idle 0 true 2>/dev/null && idle=(chrt --idle 0)
setsid -w "${idle[@]}" bash scripts/ci/wheel.sh build >"$wheel_log" 2>&1 &
wheel_pid=$!

bash scripts/ci/engine.sh
if [ ${#idle[@]} -gt 0 ]; then
  for p in $(pgrep -g "$wheel_pid" || true); do chrt --all-tasks --other -p 0 "$p" 2>/dev/null || true; done
fi

bash scripts/ci/examples.sh

step "Wheel: its build and audit, from the background (log: target/wheel.log)"
rc=0 && wait "$wheel_pid" || rc=$?
wheel_pid=''
if [ "$rc" != 0 ]; then
  tail -n 80 "$wheel_log"
  echo "building or auditing the wheel failed (output above, all of it in $wheel_log)"
  exit 1
fi
cat "$wheel_log"

bash scripts/ci/wheel.sh newcomer
step "Done; $(df_line)"
