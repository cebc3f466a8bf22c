#!/usr/bin/env bash
# The distributions as a user gets them: `bash scripts/ci/wheel.sh [build|newcomer]`
# (no argument: both).
#
#   build      the manylinux_2_17 abi3 wheel (maturin --zig) and the sdist into dist/,
#              audited (scripts/wheel.sh). Needs python3 and cargo: its build tools go into
#              a venv of their own, target/wheel-venv. It builds its own libzmq (zig, for
#              manylinux) in its own target dir, so it runs with your CARGO_HOME, not
#              target/cargo-home's override of the other builds. Then the bench's own wheel
#              (bench/, shmq-bench: pure Python) into dist/ beside it, and a check that
#              shmq's wheel and sdist carry nothing of the bench.
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

  step "Wheel: the bench's own (shmq-bench, pure Python) into dist/; shmq's carries none of it"
  rm -f dist/shmq_bench-*.whl
  target/wheel-venv/bin/python -m pip wheel --quiet --no-deps --wheel-dir dist ./bench
  target/wheel-venv/bin/python - dist/shmq-*.whl dist/shmq-*.tar.gz dist/shmq_bench-*.whl <<'EOF'
import sys, tarfile, zipfile

wheel, sdist, bench = sys.argv[1:]
# The bench is a distribution of its own: shmq's wheel and sdist hold none of its files
# (python/shmq/bench/ was its old place, bench/ and shmq_bench/ are its new one).
names = zipfile.ZipFile(wheel).namelist()
names += ["/".join(n.split("/")[1:]) for n in tarfile.open(sdist).getnames()]
found = [n for n in names if n.startswith(("shmq/bench/", "python/shmq/bench/", "bench/", "shmq_bench"))]
if found:
    sys.exit(f"shmq's distributions carry the bench's files: {found[:10]}")
# The bench's wheel: its package, and a requirement of exactly shmq's version.
bench_names = zipfile.ZipFile(bench).namelist()
if "shmq_bench/__init__.py" not in bench_names or any(n.startswith("shmq/") for n in bench_names):
    sys.exit(f"{bench}: not the bench's package alone: {bench_names}")
version = wheel.split("/")[-1].split("-")[1]
metadata = zipfile.ZipFile(bench).read(f"shmq_bench-{version}.dist-info/METADATA").decode()
if f"Requires-Dist: shmq=={version}" not in metadata.splitlines():
    sys.exit(f"{bench} does not require shmq=={version}")
print(f"{wheel}, {sdist}: nothing of the bench; {bench}: shmq_bench, for shmq=={version}")
EOF
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
