#!/usr/bin/env bash
# The Rust tests: `cargo test` (unit, integration in several processes, examples), the doc
# tests, and the broadcast and async (tokio) examples run. Needs only cargo:
# `bash scripts/ci/rust-test.sh`.
set -euo pipefail
# shellcheck source=scripts/ci/common.sh
source "$(dirname "$0")/common.sh"
use_libzmq_once

step "Rust: cargo test (unit, integration in several processes, doc tests, examples)"
# Every crate but the binding (its test harness would link libpython; the Python suite,
# scripts/ci/pytest.sh, tests it).
cargo test --workspace --exclude shmq-python --all-targets
cargo test --workspace --exclude shmq-python --doc
cargo run --quiet --example broadcast
cargo run --quiet --example async_tokio
