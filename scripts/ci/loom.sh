#!/usr/bin/env bash
# The loom model checks of the protocols (crates/protocol/tests/loom.rs), in their own
# target dir, target/loom. Needs only cargo.
#
#   bash scripts/ci/loom.sh           build and run them
#   bash scripts/ci/loom.sh --build   only build them
#
# The longest model (two readers, two messages) keeps one core busy for minutes, so
# scripts/test.sh builds them early and runs them in the background beside the fuzz runs
# and the Python lints, reading the result just before pytest.
set -euo pipefail
# shellcheck source=scripts/ci/common.sh
source "$(dirname "$0")/common.sh"
use_libzmq_once

# No debuginfo for the model checks: it only slows their build.
loom=(env CARGO_PROFILE_RELEASE_DEBUG=0 RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom
  cargo test --release -p shmq-protocol --test loom)
case "${1:-}" in
  --build) "${loom[@]}" --no-run ;;
  '') "${loom[@]}" ;;
  *) echo "usage: bash scripts/ci/loom.sh [--build]" >&2; exit 2 ;;
esac
