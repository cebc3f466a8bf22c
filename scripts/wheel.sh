#!/usr/bin/env bash
# Build shmq's distributions into dist/ and check them:
#   - a manylinux_2_17 (manylinux2014) abi3 wheel: one file for CPython >= 3.11 on any
#     x86_64 Linux with glibc >= 2.17, installed without Rust or a C++ compiler;
#   - the sdist (what `pip install shmq` builds from where no wheel fits).
# The wheel must pass `auditwheel show`: tag manylinux_2_17_x86_64 and no shared library
# outside that policy (the script fails otherwise). scripts/newcomer.sh then installs it
# where cargo is not on PATH. Run by scripts/test.sh; on its own: bash scripts/wheel.sh
#
# How: maturin --zig. zig's clang cross-compiles against glibc 2.17's symbols whatever
# the build machine's glibc, and it compiles libzmq 4.3.4's C++ (zmq-sys builds it from
# source with the cc crate) as well, linking LLVM's libc++ statically: the extension needs
# only libc, libpthread, libdl and librt (all in the policy). No manylinux container,
# no auditwheel repair. (Fallback, not needed here: a native `maturin build` then
# `auditwheel repair --plat manylinux_2_28_x86_64`, which would need a build machine with
# glibc <= 2.28 and would graft libstdc++ into the wheel.)
set -euo pipefail
cd "$(dirname "$0")/.."

# Build tools, pinned (the versions this was checked with), in their own venv: made once,
# made anew when the pins change.
pins=("maturin==1.16.0" "ziglang==0.17.1" "auditwheel==6.8.2")
venv=target/wheel-venv
stamp="$venv/.pins-$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "${pins[@]}"
  touch "$stamp"
fi
# First on PATH: maturin runs zig as `python3 -m ziglang`, the pinned one of this venv.
export PATH="$PWD/$venv/bin:$PATH"

mkdir -p dist
rm -f dist/shmq-*.whl dist/shmq-*.tar.gz

# The wheel, in its own target dir (the zig-built objects differ from the dev build's,
# and the two would otherwise rebuild each other). Stripped: the release profile keeps
# line tables for profiling, which would make the .so several times larger; without them
# it also compiles faster.
start=$SECONDS
CARGO_PROFILE_RELEASE_DEBUG=0 maturin build --release --strip --zig --compatibility manylinux2014 \
  --interpreter "$venv/bin/python" --target-dir target/wheel --out dist
echo "wheel built in $((SECONDS - start)) s"
maturin sdist --out dist

wheels=(dist/shmq-*.whl) sdists=(dist/shmq-*.tar.gz)
wheel=${wheels[0]} sdist=${sdists[0]}
ls -l "$wheel" "$sdist"

# The audit: printed for the log, then judged from its JSON form.
auditwheel show "$wheel"
auditwheel show --json "$wheel" | python -c '
import json, sys
report = json.load(sys.stdin)
wanted = "manylinux_2_17_x86_64"
problems = []
if report.get("pure", True):
    problems.append("no extension module in the wheel")
tag, libs = report.get("overall_tag"), report.get("external_libs")
if tag != wanted:
    problems.append(f"platform tag {tag!r}, not {wanted!r}")
if libs:
    problems.append(f"needs shared libraries outside the policy: {sorted(libs)}")
name = report.get("wheel", "")
if wanted not in name or "-cp311-abi3-" not in name:
    problems.append(f"file name {name!r} lacks cp311-abi3 or {wanted}")
if problems:
    sys.exit("auditwheel: " + "; ".join(problems))
print(f"auditwheel: {name} is {wanted}, abi3, no external libraries beyond the policy")
'

# The sdist must build shmq: the crate, its lock file, the Python package.
listing=$(tar -tzf "$sdist")
for want in Cargo.toml Cargo.lock pyproject.toml src/lib.rs crates/core/Cargo.toml crates/core/src/lib.rs crates/workers/Cargo.toml crates/protocol/Cargo.toml crates/protocol/src/lib.rs crates/os/Cargo.toml crates/os/src/lib.rs bindings/python/Cargo.toml bindings/python/src/lib.rs python/shmq/__init__.py python/shmq/_core.pyi python/shmq/py.typed; do
  if ! grep -q "^shmq-[^/]*/$want" <<<"$listing"; then
    echo "sdist $sdist lacks $want"
    exit 1
  fi
done
if grep -qE '\.(so|whl)$' <<<"$listing"; then
  echo "sdist $sdist holds built files: $(grep -E '\.(so|whl)$' <<<"$listing")"
  exit 1
fi
echo "sdist: $(wc -l <<<"$listing") entries, with Cargo.toml, Cargo.lock, src/ and python/shmq/"
