#!/usr/bin/env bash
# The fuzz targets (fuzz/, cargo-fuzz) under AddressSanitizer, each for SHMQ_FUZZ_SECONDS
# (default 10) from the seed SHMQ_FUZZ_SEED (default 1; 0 draws one). Needs only cargo:
# cargo-fuzz is the one on PATH or is built once into target/tools.
#
#   bash scripts/ci/fuzz.sh           build the targets and run each
#   bash scripts/ci/fuzz.sh --build   only build them (scripts/test.sh starts the loom
#                                     models after it: the build wants both cores)
#   bash scripts/ci/fuzz.sh --run     only run them (cargo fuzz rebuilds what changed)
#
# A fixed seed by default: the same clone fuzzes the same inputs, so a red run is one that
# can be replayed, not a draw. Exploring is for the long runs by hand (the README's Develop
# section). Every input that once failed is kept in fuzz/seeds and replayed first. The
# targets build into target/fuzz and keep their corpus in target/fuzz/corpus, so a second
# run starts where the last one stopped.
#
# AddressSanitizer: `-Zsanitizer=address` is a nightly flag and no nightly toolchain can be
# had from this machine's registries, but the stable toolchain ships the sanitizer
# runtimes (rustlib/x86_64-unknown-linux-gnu/lib/librustc-stable_rt.asan.a), and
# RUSTC_BOOTSTRAP=1 lets the stable compiler take the flag. Out-of-bounds reads and
# writes, use after free and leaks in a fuzz input then fail the target, not only panics.
set -euo pipefail
# shellcheck source=scripts/ci/common.sh
source "$(dirname "$0")/common.sh"
use_libzmq_once
: "${SHMQ_FUZZ_SECONDS:=10}" "${SHMQ_FUZZ_SEED:=1}"

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  if [ ! -x target/tools/bin/cargo-fuzz ]; then
    cargo install --quiet --locked --root target/tools cargo-fuzz --version 0.13.2
  fi
  export PATH="$PWD/target/tools/bin:$PATH"
fi
fuzz() { RUSTC_BOOTSTRAP=1 cargo fuzz "$1" --sanitizer address --target-dir "$PWD/target/fuzz" "${@:2}"; }

build() {
  step "Rust: fuzz targets under AddressSanitizer (cargo-fuzz): built"
  fuzz build
}

run() {
  step "Rust: fuzz targets under AddressSanitizer (cargo-fuzz, $SHMQ_FUZZ_SECONDS s each, seed $SHMQ_FUZZ_SEED; longer by hand, see the README)"
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
}

case "${1:-}" in
  --build) build ;;
  --run) run ;;
  '') build; run ;;
  *) echo "usage: bash scripts/ci/fuzz.sh [--build|--run]" >&2; exit 2 ;;
esac
