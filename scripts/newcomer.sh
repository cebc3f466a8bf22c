#!/usr/bin/env bash
# shmq as a newcomer meets it, each time in a venv made anew under target/:
#
#   bash scripts/newcomer.sh source   the README's first command from this source tree,
#                                     `pip install '.[bench]' ./bench && python -m shmq bench --quick`,
#                                     in a venv without torch (torch must stay optional)
#   bash scripts/newcomer.sh wheel    dist/shmq-*.whl (made by scripts/wheel.sh) with its
#                                     [bench] extra, the bench's own wheel beside it
#                                     (dist/shmq_bench-*.whl, made by scripts/ci/wheel.sh
#                                     build, or here), installed where cargo and rustc are not on
#                                     PATH, then a queue and a store across processes
#                                     (scripts/wheel_smoke.py) and `python -m shmq bench --quick`
#
# No argument runs both. scripts/test.sh runs them; pip's cache is reused, so after the
# first run they download nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# A fresh venv at $1, "activated" (first on PATH) the way a newcomer would.
fresh_venv() {
  rm -rf "$1"
  "${PYTHON:-python3}" -m venv "$1"
  export VIRTUAL_ENV="$root/$1" PATH="$root/$1/bin:$PATH"
}

# The bench must print its table: the header row, then the rule under it.
check_bench() {
  local log=$1
  if ! grep -qE '^scenario +shmq( |$)' "$log" || ! grep -qE '^-+( +-+)+$' "$log"; then
    echo "python -m shmq bench --quick printed no table (output in $log)"
    exit 1
  fi
}

# shmq and its bench (shmq_bench, a distribution of its own) must come from the venv's
# site-packages, not from the source tree.
check_installed() {
  python - "$VIRTUAL_ENV" <<'EOF'
import sys, shmq, shmq_bench
for module in (shmq, shmq_bench):
    if not module.__file__.startswith(sys.argv[1]):
        sys.exit(f"{module.__name__} imported from {module.__file__}, not from the venv {sys.argv[1]}")
    print(f"{module.__name__} {module.__file__}")
EOF
}

source_step() (
  start=$SECONDS
  fresh_venv target/newcomer-venv
  # The README's first command, from the repository's root, as written (./bench: the
  # bench's distribution, which pip takes for the [bench] extra's requirement).
  pip install --quiet '.[bench]' ./bench
  echo "installed from source in $((SECONDS - start)) s"
  check_installed
  if python -c 'import torch' 2>/dev/null; then
    echo "torch is importable in the newcomer's venv: '.[bench]' ./bench must not pull it in"
    exit 1
  fi
  echo "torch: not installed (as intended)"
  log=$root/target/newcomer-bench.log
  python -m shmq bench --quick 2>&1 | tee "$log"
  check_bench "$log"
  echo "newcomer (source) step: $((SECONDS - start)) s"
)

wheel_step() (
  start=$SECONDS
  wheels=(dist/shmq-*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    echo "no wheel in dist/: run scripts/wheel.sh first"
    exit 1
  fi
  wheel=$root/${wheels[0]}
  # The bench's own wheel (pure Python): scripts/ci/wheel.sh build makes it; made here
  # where scripts/wheel.sh alone made dist/.
  if ! compgen -G "dist/shmq_bench-*.whl" >/dev/null; then
    "${PYTHON:-python3}" -m pip wheel --quiet --no-deps --wheel-dir dist ./bench
  fi
  bench_wheels=(dist/shmq_bench-*.whl)
  bench_wheel=$root/${bench_wheels[0]}
  # PATH without any directory that holds cargo or rustc (~/.cargo/bin, rustup's).
  path=
  IFS=: read -ra dirs <<<"$PATH"
  for dir in "${dirs[@]}"; do
    if [ -n "$dir" ] && [ ! -e "$dir/cargo" ] && [ ! -e "$dir/rustc" ]; then
      path=${path:+$path:}$dir
    fi
  done
  export PATH=$path
  unset CARGO_HOME RUSTUP_HOME RUSTUP_TOOLCHAIN
  if command -v cargo >/dev/null 2>&1 || command -v rustc >/dev/null 2>&1; then
    echo "cargo or rustc still on PATH: $(command -v cargo rustc)"
    exit 1
  fi
  fresh_venv target/newcomer-wheel-venv
  # Binary wheels only: nothing may be compiled here (there is no Rust to do it). The
  # bench's wheel satisfies the [bench] extra's requirement (it is not on an index).
  pip install --quiet --only-binary=:all: "${wheel}[bench]" "$bench_wheel"
  echo "installed $(basename "$wheel") and $(basename "$bench_wheel") without Rust in $((SECONDS - start)) s"
  # Outside the source tree, so that nothing of it is imported.
  cd "$VIRTUAL_ENV"
  check_installed
  python "$root/scripts/wheel_smoke.py"
  log=$root/target/newcomer-wheel-bench.log
  python -m shmq bench --quick 2>&1 | tee "$log"
  check_bench "$log"
  echo "newcomer (wheel) step: $((SECONDS - start)) s"
)

case "${1:-both}" in
  source) source_step ;;
  wheel) wheel_step ;;
  both) source_step; wheel_step ;;
  *) echo "usage: bash scripts/newcomer.sh [source|wheel]" >&2; exit 2 ;;
esac
