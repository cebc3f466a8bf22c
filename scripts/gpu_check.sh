#!/usr/bin/env bash
# The device path on a GPU machine (issue 55): install the abi3 wheel that
# scripts/wheel.sh built (dist/, carried with the working tree) into a directory of its
# own, without an index or dependencies (torch and pytest are the machine's), and run
# the device tests with the CUDA implementation of the seam (SHMQ_DEVICE=cuda) against
# that installed package, not the source tree; then `python -m shmq bench --scenarios gpu`
# (the bench from bench/, shmq from the wheel), which prints one JSON line per row
# (docs/performance.md, "GPU rows"; under 3 minutes on a GPU).
#   bash scripts/gpu_check.sh            # PYTHON=... to pick the interpreter
# GPU_CHECK_DEVICE=twin runs the same tests and rows against the CPU twin (a dry run of
# this script on a machine without a GPU: every row then says it is the twin's, not a GPU
# figure).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}

wheels=(dist/shmq-*-abi3-*.whl)
if [ ! -e "${wheels[0]}" ]; then
  echo "gpu_check: no abi3 wheel in dist/: run bash scripts/wheel.sh first" >&2
  exit 2
fi
if [ "${GPU_CHECK_DEVICE:-cuda}" = cuda ]; then
  "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no GPU")'
fi

target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT
"$py" -m pip install --quiet --no-index --no-deps --target "$target" "${wheels[0]}"

# The tests import shmq from the installed wheel: the source tree's python/ is not on
# the path (the repository root has no shmq package; conftest.py adds tests/python).
PYTHONPATH="$target" "$py" -c '
import sys, shmq
where = shmq.__file__
print("gpu_check: shmq from", where)
sys.exit(0 if where.startswith(sys.argv[1]) else "gpu_check: shmq is not the installed wheel")
' "$target"
# Every device test: the seam, the store's, the queue's and the encoder cache's readers.
SHMQ_DEVICE=${GPU_CHECK_DEVICE:-cuda} PYTHONPATH="$target" "$py" -m pytest -q -p no:cacheprovider \
  tests/python/test_device_*.py

# The rows: the bench's package from the source tree beside the installed shmq (the wheel
# does not carry it). Its JSON lines on stdout, its progress and errors on stderr.
echo "gpu_check: python -m shmq bench --scenarios gpu"
SHMQ_DEVICE=${GPU_CHECK_DEVICE:-cuda} PYTHONPATH="$target:$PWD/bench" "$py" -m shmq bench --scenarios gpu
