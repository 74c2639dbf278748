#!/usr/bin/env bash
# Builds the wheel as a user's `pip install` would (isolated build environment,
# XLA FFI headers of the jaxlib pinned in pyproject.toml's [build-system]),
# installs it into a fresh virtual environment outside the source tree and
# runs tools/wheel_smoke.py there, from a temporary directory.
#
# Usage: tools/check_wheel.sh [WHEEL_DIR]
#   WHEEL_DIR  where the wheel is written (default: a temporary directory,
#              removed at the end)
# Environment:
#   PYTHON     interpreter for the build and the test venv (default python3)
#   SOURCE     what to build: a source tree or an sdist (default: this checkout)
#   JAX_SPEC   jax requirement installed with the wheel, e.g. "jax==0.8.2" to
#              test against the oldest supported release (default: the newest)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
source_path="$(realpath "${SOURCE:-$root}")"

work="$(mktemp -d "${TMPDIR:-/tmp}/jax_fatrain_wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
wheel_dir="$(mkdir -p "${1:-$work/wheels}" && cd "${1:-$work/wheels}" && pwd)"

t0=$SECONDS
echo "== pip wheel $source_path (isolated build) -> $wheel_dir"
"$python" -m pip wheel --no-deps "$source_path" -w "$wheel_dir"
wheel="$(ls -t "$wheel_dir"/jax_fatrain-*.whl | head -n 1)"
t1=$SECONDS

echo "== fresh venv, install $(basename "$wheel")${JAX_SPEC:+ with $JAX_SPEC}"
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip
if [[ -n "${JAX_SPEC:-}" ]]; then
  # jax pins its matching jaxlib.
  "$work/venv/bin/python" -m pip install -q "$JAX_SPEC" "$wheel"
else
  "$work/venv/bin/python" -m pip install -q "$wheel"
fi
t2=$SECONDS

echo "== smoke test (from $work)"
cp "$root/tools/wheel_smoke.py" "$work/"
(cd "$work" && "$work/venv/bin/python" wheel_smoke.py)
t3=$SECONDS
echo "check_wheel: build $((t1 - t0)) s, install $((t2 - t1)) s, smoke test $((t3 - t2)) s," \
     "total $((t3 - t0)) s"
