#!/usr/bin/env bash
# The README's Python examples against shmq built into .venv, then its first command as a
# newcomer runs it: `pip install '.[bench]' ./bench` from this source tree in a fresh venv
# without torch (scripts/newcomer.sh source). Needs .venv (bash scripts/envs.sh); builds
# shmq into it: `bash scripts/ci/examples.sh`.
set -euo pipefail
# shellcheck source=scripts/ci/common.sh
source "$(dirname "$0")/common.sh"
build_shmq

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
