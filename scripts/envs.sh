#!/usr/bin/env bash
# The Python environments the test suite needs, made (or checked) in one go. scripts/test.sh
# runs this in the background while its Rust steps use the CPU (this is mostly downloads):
#
#   .venv                the [test] extra's packages and maturin; torch pinned to the
#                        engine's version (tests/engine/torch.txt), so that the engine
#                        venv shares its files instead of a second copy (gigabytes); the
#                        bench (bench/, the shmq-bench distribution), editable
#   vLLM 0.33            for the plugin test, without its heavy dependencies (once per .venv)
#   target/engine-venv   vLLM's CPU build and the tiny model: scripts/engine.sh --prepare
#
# shmq itself is built into .venv afterwards, by test.sh (`pip install -e .`). Set PYTHON
# to choose the interpreter that makes the venvs (default: python3, CPython >= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s  (at %d min %02d s)\n' "$*" $((SECONDS / 60)) $((SECONDS % 60)); }

step "iproute2 for the two-host tests (network namespaces), tini for the container-init test (skipped where they cannot be had)"
if { ! command -v ip || ! command -v tini; } >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq iproute2 tini >/dev/null || echo "(could not install iproute2 and tini)"
fi

step ".venv: shmq's requirements, the [test] extra, maturin, $(cat tests/engine/torch.txt), the bench (editable)"
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# shmq's requirements and its [test] extra as pyproject.toml lists them (shmq itself is
# built later, by test.sh, with --no-deps: everything it needs is here).
.venv/bin/python - >target/test-requirements.txt <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
PY
.venv/bin/python -m pip install --quiet --no-warn-conflicts "maturin>=1.9.4,<2" \
  -r target/test-requirements.txt -r tests/engine/torch.txt
# The bench, a distribution of its own (what shmq's [bench] extra names), editable: the
# tests and `python -m shmq bench` use bench/shmq_bench as it is. Its requirements are in
# the [test] extra already; shmq is built later.
.venv/bin/python -m pip install --quiet --no-deps --no-warn-conflicts -e ./bench

step "vLLM 0.33 for the plugin test (without its heavy dependencies; once per .venv)"
# Only what the vLLM code that the test runs imports (see the file). A stamp named by the
# file's hash skips the download when this exact set is installed already.
vllm_requirements=tests/python/vllm-requirements.txt
vllm_stamp=".venv/.vllm-requirements-$(sha256sum "$vllm_requirements" | cut -c1-16)"
if [ ! -e "$vllm_stamp" ]; then
  .venv/bin/python -m pip install --quiet --no-warn-conflicts --no-deps -r "$vllm_requirements"
  touch "$vllm_stamp"
fi

step "target/engine-venv and target/engine-model (scripts/engine.sh --prepare)"
bash scripts/engine.sh --prepare
step "done"
