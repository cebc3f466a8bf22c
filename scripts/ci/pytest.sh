#!/usr/bin/env bash
# The Python suite (tests/python) against shmq built from this checkout. Needs .venv made
# by bash scripts/envs.sh (vLLM 0.33 for the plugin test included); builds shmq into it.
# SHMQ_TEST_WORKERS sets the number of pytest workers (default: one per core).
set -euo pipefail
# shellcheck source=scripts/ci/common.sh
source "$(dirname "$0")/common.sh"
build_shmq

step "Python: pytest"
# The plugin test must run here: a missing vLLM is a failure, not a skip. One pytest
# worker per core (pytest-xdist): every test makes its own processes and segments, and
# the suite is CPU-bound. --dist worksteal: a worker that runs out of tests takes some of
# the other's, so the run does not end on one worker's queue of slow tests.
SHMQ_REQUIRE_VLLM=1 .venv/bin/python -m pytest -q -n "${SHMQ_TEST_WORKERS:-auto}" --dist worksteal --durations=15
