#!/usr/bin/env bash
# Type-checks the macOS Metal host (metal-cpp, C++17) on Linux.
#
# No Metal SDK exists for Linux, but metal-cpp is header-only C++: with the
# real headers from the pymetal-cpp 0.1.5 source distribution on PyPI
# (thirdparty/metal-cpp/, Apache-2.0), Debian's clang and the few stubs of
# Apple system headers in stubs/, `clang++ -fsyntax-only` checks every
# metal-cpp call we make, so a wrong one fails here instead of on a Mac.
# Nothing downloaded is kept (a temporary directory).
#
# Usage: run.sh [FILE.cc ...]   (default: cpp/metal/host/executor.cc cpp/ffi/metal_ffi.cc)
# Environment: PYTHON (default python), METAL_CPP_DIR (an unpacked metal-cpp
# to use instead of downloading).
# Exit status: 0 all files type-check; 1 a clang error; 77 the check could
# not run (no clang and none installable, or pymetal-cpp not downloadable).
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python}"
skip() { echo "metal typecheck: SKIPPED: $*" >&2; exit 77; }

# (a) Debian's clang.
cxx="$(command -v clang++ || true)"
if [[ -z "$cxx" ]]; then
  if command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
    echo "metal typecheck: installing clang (apt-get)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang) >&2 ||
      skip "apt-get could not install clang"
    cxx="$(command -v clang++ || true)"
  fi
  [[ -n "$cxx" ]] || skip "clang++ not found and not installable here (needs root and apt-get)"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# (b) metal-cpp from the pymetal-cpp sdist.
metal_cpp="${METAL_CPP_DIR:-}"
if [[ -z "$metal_cpp" ]]; then
  # pip prepares the sdist's metadata with its build backend (scikit-build-core):
  # --no-build-isolation uses the one installed here (this package's own build
  # requirement; fast), else pip sets up an isolated build environment, from
  # wheels (with --no-binary :all: it would compile CMake from source there).
  "$python" -m pip download --quiet --no-deps --no-binary pymetal-cpp --no-build-isolation \
      pymetal-cpp==0.1.5 -d "$work" >&2 ||
    "$python" -m pip download --quiet --no-deps --no-binary pymetal-cpp \
      pymetal-cpp==0.1.5 -d "$work" >&2 || skip "pip could not download pymetal-cpp==0.1.5"
  tar -xzf "$work"/pymetal_cpp-0.1.5.tar.gz -C "$work" 'pymetal_cpp-0.1.5/thirdparty/metal-cpp' ||
    skip "the pymetal-cpp sdist has no thirdparty/metal-cpp"
  metal_cpp="$work/pymetal_cpp-0.1.5/thirdparty/metal-cpp"
fi
[[ -f "$metal_cpp/Metal/Metal.hpp" ]] || skip "no Metal/Metal.hpp under $metal_cpp"

# (c) clang++ -fsyntax-only with the XLA FFI, nanobind and Python headers.
xla_inc="$("$python" -c 'import jax.ffi; print(jax.ffi.include_dir())')" || exit 1
nb_inc="$("$python" -m nanobind --include_dir)" || exit 1
py_inc="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" || exit 1

files=("$@")
[[ ${#files[@]} -gt 0 ]] || files=("$root/cpp/metal/host/executor.cc" "$root/cpp/ffi/metal_ffi.cc")

echo "metal typecheck: $("$cxx" --version | head -1); metal-cpp from $metal_cpp" >&2
status=0
for f in "${files[@]}"; do
  if "$cxx" -std=c++17 -fblocks -fsyntax-only -Wno-unknown-attributes \
      -include "$here/stubs/apple_prelude.h" \
      -isystem "$here/stubs" -isystem "$metal_cpp" \
      -isystem "$xla_inc" -isystem "$nb_inc" -isystem "$py_inc" \
      -I "$root/cpp" -I "$root/cpp/ffi" -I "$root/jax_fatrain/metal" "$f"; then
    echo "metal typecheck: OK $f" >&2
  else
    echo "metal typecheck: FAILED $f" >&2
    status=1
  fi
done
exit $status
