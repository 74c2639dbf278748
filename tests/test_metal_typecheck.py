"""The macOS Metal host type-checks against the real metal-cpp headers, on Linux.

tests/metal_typecheck/run.sh runs Debian's clang (-std=c++17 -fblocks
-fsyntax-only) over cpp/metal/host/executor.cc and cpp/ffi/metal_ffi.cc with the
metal-cpp headers of the pymetal-cpp 0.1.5 sdist (downloaded to a temporary
directory) and stubs of the Apple system headers. A wrong metal-cpp call (a
method that does not exist, wrong arguments) is a clang error and fails here.
A planted wrong call checks that the check can fail.

Skipped only when the script cannot run at all (exit 77: no clang and none
installable, or pymetal-cpp not downloadable), and then it says why.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from metal_standin import standin

# The stubs stand in for Apple's headers on Linux; on macOS the real build
# compiles the Metal host instead (and the stubs would shadow the SDK).
pytestmark = pytest.mark.skipif(sys.platform == "darwin",
                                reason="macOS compiles the Metal host for real")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "metal_typecheck" / "run.sh"
CHECKED = [ROOT / "cpp" / "metal" / "host" / "executor.cc", ROOT / "cpp" / "ffi" / "metal_ffi.cc"]

PLANTED = """\
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>
// Objective-C's selector name, not metal-cpp's: must not type-check.
MTL::Buffer* planted(MTL::Device* device, void* p, NS::UInteger n) {
  return device->newBufferWithBytesNoCopy(p, n, MTL::ResourceStorageModeShared, nullptr);
}
"""


@pytest.fixture(scope="module")
def typecheck(tmp_path_factory):
  planted = tmp_path_factory.mktemp("planted") / "planted_wrong_call.cc"
  planted.write_text(PLANTED)
  env = dict(os.environ, PYTHON=sys.executable)
  try:  # the SHA-256-checked copy the Metal stand-in caches, instead of a second download
    env.setdefault("METAL_CPP_DIR", str(standin.metal_cpp()))
  except (standin.Unavailable, standin.BuildError):
    pass
  proc = subprocess.run(["bash", str(SCRIPT), *map(str, CHECKED), str(planted)],
                        capture_output=True, text=True, env=env, timeout=900)
  log = proc.stdout + proc.stderr
  if proc.returncode == 77:
    pytest.skip("metal-cpp type-check could not run here: " +
                log.strip().splitlines()[-1])
  return planted, proc.returncode, log


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: p.name)
def test_metal_host_typechecks(typecheck, path):
  _, _, log = typecheck
  assert f"metal typecheck: OK {path}" in log, log


def test_wrong_metal_cpp_call_fails(typecheck):
  planted, returncode, log = typecheck
  assert returncode == 1, log
  assert f"metal typecheck: FAILED {planted}" in log, log
  assert "no member named 'newBufferWithBytesNoCopy'" in log, log
