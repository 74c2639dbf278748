"""The Metal stand-in: the macOS Metal host, built and run on Linux (tests only).

``build()`` compiles the unmodified host (``cpp/metal/host/executor.cc``,
``cpp/ffi/metal_ffi.cc``, ``cpp/metal/plan/plan.cc``) against the real
metal-cpp headers into the ``_metal_ffi`` extension, linked with this
directory's Objective-C runtime and Metal stand-in instead of Apple's
frameworks, and with the MSL emulator as the GPU. The kernel library is the
packaged kernel source exactly as ``jax_fatrain._backends.metal`` hands it to
``newLibraryWithSource`` (one translation unit, headers inlined), translated
by the emulator's pre-pass and compiled as C++.

``use()`` makes that extension the package's ``jax_fatrain._metal_ffi``, so
``implementation="metal"`` runs through it, and ``restore()`` undoes that.
``report()``, ``reset()``, ``fail()`` and ``limit_pipelines()`` reach the
stand-in's counters, findings, injected failures and pipeline limits.

Tools: g++ (the emulator and kernels), clang++ (metal-cpp needs ``-fblocks``;
Debian's package is installed with apt-get when missing and running as root)
and the metal-cpp headers of the pymetal-cpp 0.1.5 source distribution from
PyPI, checked by SHA-256. Objects and the extension are cached by the hash of
their inputs under ``$JAX_FATRAIN_CACHE`` (default ``~/.cache/jax_fatrain``).
Linux x86-64 only (objc_msgsend_x86_64.S); tools/arm64_check.sh builds the
host for aarch64 with objc_msgsend_aarch64.S and runs it under qemu from C++
(host_check.cc).

Command line: ``python tests/metal_standin/standin.py [--plant NAME]`` builds
and prints the extension's path.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from jax_fatrain.emulator.msl_standalone import _hash as _digest  # pylint: disable=protected-access
from jax_fatrain.emulator.msl_standalone import cache_root

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STUBS = ROOT / "tests" / "metal_typecheck" / "stubs"
EMULATOR = ROOT / "cpp" / "metal" / "emulator"

METAL_CPP_SDIST = "pymetal_cpp-0.1.5.tar.gz"
METAL_CPP_SHA256 = "1118062f635277a2781659fbc4e7e5bac7d565d6948a3461c3b04d6425c15a0e"

# Host bugs planted into a copy of the host source, to show that the tests
# catch them: name -> (file, text, replacement). Each text must occur once.
PLANTED = {
    # Q bound one buffer index too high.
    "q_index": ("cpp/metal/host/executor.cc",
                "enc->setBuffer(role_buffer[int(b.role)], 0, NS::UInteger(b.index));",
                "enc->setBuffer(role_buffer[int(b.role)], 0, "
                "NS::UInteger(b.role == mp::Role::kQ ? b.index + 1 : b.index));"),
    # do_causal set on the next function-constant index.
    "causal_constant": ("cpp/metal/host/executor.cc",
                        "values->setConstantValue(&v, MTL::DataTypeBool, NS::UInteger(index));",
                        "values->setConstantValue(&v, MTL::DataTypeBool, NS::UInteger("
                        "index == FATRAIN_FC_DO_CAUSAL ? index + 1 : index));"),
    # Staged outputs never copied back.
    "no_copy_back": ("cpp/metal/host/executor.cc",
                     "if (st.output) std::memcpy(st.host, st.buffer->contents(), st.bytes);",
                     "if (st.output && false) std::memcpy(st.host, st.buffer->contents(), st.bytes);"),
    # No memory barrier between the dispatches of the backward.
    "no_barrier": ("cpp/metal/host/executor.cc",
                   "if (i > 0) enc->memoryBarrier(MTL::BarrierScopeBuffers);", ""),
    # The backward planned without the GPU's core count (the IORegistry's).
    "ignore_core_count": ("cpp/ffi/metal_ffi.cc", "fatrain::metal::gpu_core_count());",
                          "0);"),
    # Pipelines cached by kernel name alone, whatever the function constants.
    "pipeline_key": ("cpp/metal/host/executor.cc",
                     'for (auto [index, value] : d.constants) key += "|" + std::to_string(index) '
                     '+ (value ? "=1" : "=0");',
                     ""),
}


class Unavailable(RuntimeError):
  """The stand-in cannot be built on this machine; the message says why."""


class BuildError(RuntimeError):
  """A step of the build failed; the message has the command and its output."""


def _run(cmd: list[str], what: str, **kw) -> str:
  proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
  if proc.returncode != 0:
    raise BuildError(f"{what} failed ({' '.join(map(str, cmd))}):\n{proc.stdout}{proc.stderr}")
  return proc.stdout


# ---------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------
def _check_platform() -> None:
  if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
    raise Unavailable(f"the Metal stand-in runs on Linux x86-64 (this is {sys.platform} "
                      f"{platform.machine()}); on a Mac the real Metal host is built instead")


def clang() -> str:
  """clang++ ($FATRAIN_CLANGXX, or on PATH, or Debian's, installed when root)."""
  found = os.environ.get("FATRAIN_CLANGXX") or shutil.which("clang++")
  if not found and shutil.which("apt-get") and os.geteuid() == 0:
    print("metal stand-in: installing clang (apt-get)", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "clang"]):
      if subprocess.run(cmd, capture_output=True, env=env).returncode != 0:
        raise Unavailable("clang++ is missing and apt-get could not install clang")
    found = shutil.which("clang++")
  if not found:
    raise Unavailable("clang++ not found (metal-cpp needs clang's -fblocks) and not installable "
                      "here (needs root and apt-get); set FATRAIN_CLANGXX")
  return found


def gxx() -> str:
  found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not found:
    raise Unavailable("no C++ compiler (g++) found; set CXX")
  return found


def metal_cpp() -> Path:
  """The metal-cpp headers: $METAL_CPP_DIR, or the pinned pymetal-cpp sdist's (cached)."""
  if env := os.environ.get("METAL_CPP_DIR"):
    d = Path(env)
  else:
    d = cache_root() / "metal-cpp" / METAL_CPP_SHA256[:16] / "metal-cpp"
    if not (d / "Metal" / "Metal.hpp").is_file():
      d.parent.mkdir(parents=True, exist_ok=True)
      with tempfile.TemporaryDirectory(dir=d.parent) as tmp:
        base = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--no-binary", "pymetal-cpp", "pymetal-cpp==0.1.5", "-d", tmp]
        # pip prepares the sdist's metadata with its build backend; without
        # build isolation it uses the one installed here (fast).
        if subprocess.run(base + ["--no-build-isolation"], capture_output=True).returncode != 0:
          if subprocess.run(base, capture_output=True).returncode != 0:
            raise Unavailable("pip could not download pymetal-cpp==0.1.5 (for metal-cpp)")
        sdist = Path(tmp) / METAL_CPP_SDIST
        got = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if got != METAL_CPP_SHA256:
          raise BuildError(f"{METAL_CPP_SDIST}: SHA-256 {got}, expected {METAL_CPP_SHA256}")
        prefix = "pymetal_cpp-0.1.5/thirdparty/metal-cpp/"
        with tarfile.open(sdist) as tar:
          members = [m for m in tar.getmembers()
                     if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
          tar.extractall(tmp, members=members, filter="data")
        os.replace(Path(tmp) / prefix, d)
  if not (d / "Metal" / "Metal.hpp").is_file():
    raise Unavailable(f"no Metal/Metal.hpp under {d}")
  return d


# ---------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------
def library_source() -> str:
  """What the package hands to newLibraryWithSource: the kernels as one unit."""
  from jax_fatrain._backends import metal  # pylint: disable=import-outside-toplevel
  return metal.kernel_source()


def _project_headers() -> str:
  files = []
  for d in (ROOT / "cpp", ROOT / "jax_fatrain" / "metal", EMULATOR / "include", HERE, STUBS):
    files += sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in ("", ".h", ".hpp", ".inc"))
  return _digest(*(str(p.relative_to(ROOT)) + "\0" + p.read_text(errors="replace") for p in files))


def _version(tool: str) -> str:
  return _run([tool, "--version"], f"{tool} --version").splitlines()[0]


def build(plant: str | None = None, *, verbose: bool = False) -> Path:
  """Builds the stand-in ``_metal_ffi`` (cached); ``plant`` names a PLANTED host bug."""
  _check_platform()
  import jax.ffi  # pylint: disable=import-outside-toplevel
  import nanobind  # pylint: disable=import-outside-toplevel

  cxx, clangxx, mcpp = gxx(), clang(), metal_cpp()
  nb_inc = Path(nanobind.include_dir())
  nb_src = Path(nanobind.source_dir())
  robin_map = nb_inc.parent / "ext" / "robin_map" / "include"
  py_inc = sysconfig.get_paths()["include"]
  xla_inc = jax.ffi.include_dir()
  suffix = sysconfig.get_config_var("EXT_SUFFIX")

  work = cache_root() / "metal_standin"
  objs_dir = work / "obj"
  objs_dir.mkdir(parents=True, exist_ok=True)
  headers = _project_headers()
  environment = _digest(_version(cxx), _version(clangxx), str(mcpp), nanobind.__version__,
                        jax.__version__, py_inc, headers)

  # The library: the packaged source, pre-passed to C++ (and embedded as text).
  source = library_source()
  lib_key = _digest(environment, source, (EMULATOR / "msl_prepass.py").read_text(),
                    (EMULATOR / "msl_rules.py").read_text())[:24]
  lib_dir = work / "library" / lib_key
  if not (lib_dir / "library.cc").is_file():
    lib_dir.mkdir(parents=True, exist_ok=True)
    (lib_dir / "library.metal").write_text(source)
    tmp_cc = lib_dir / "library.cc.tmp"
    # The source rules hold for these kernels (the package build enforces them).
    _run([sys.executable, str(EMULATOR / "msl_prepass.py"), str(lib_dir / "library.metal"),
          str(tmp_cc), "--cxx", cxx],
         "the MSL pre-pass of the kernel library")
    os.replace(tmp_cc, lib_dir / "library.cc")
  (lib_dir / "library_source.S").write_text(
      "    .section .rodata\n"
      "    .globl fatrain_standin_library_source\n    .hidden fatrain_standin_library_source\n"
      "    .globl fatrain_standin_library_source_end\n"
      "    .hidden fatrain_standin_library_source_end\n"
      f'fatrain_standin_library_source:\n    .incbin "{lib_dir / "library.metal"}"\n'
      "fatrain_standin_library_source_end:\n    .byte 0\n"
      '    .section .note.GNU-stack,"",@progbits\n')

  host_sources = {rel: (ROOT / rel).read_text() for rel in
                  ("cpp/metal/host/executor.cc", "cpp/ffi/metal_ffi.cc")}
  if plant is not None:
    if plant not in PLANTED:
      raise ValueError(f"unknown planted bug {plant!r}; known: {', '.join(PLANTED)}")
    rel, old, new = PLANTED[plant]
    if host_sources[rel].count(old) != 1:
      raise BuildError(f"planted bug {plant!r}: its text no longer occurs once in {rel}")
    host_sources[rel] = host_sources[rel].replace(old, new)

  # $JAX_FATRAIN_SANITIZE (e.g. "address,undefined", tools/sanitize.sh) builds
  # every object with those sanitizers and links the runtimes of CXX (g++'s
  # libasan/libubsan, which also serve clang 14's instrumentation); Python
  # must preload libasan.
  sanitize = []
  if os.environ.get("JAX_FATRAIN_SANITIZE"):
    sanitize = [f"-fsanitize={os.environ['JAX_FATRAIN_SANITIZE']}", "-fno-sanitize-recover=all",
                "-fno-omit-frame-pointer", "-g"]
  gflags = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-w"] + sanitize
  cflags = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-fblocks", "-w",
            "-include", str(STUBS / "apple_prelude.h"), "-isystem", str(STUBS), "-isystem", str(mcpp)
            ] + sanitize
  host_inc = ["-I", str(ROOT / "cpp"), "-I", str(ROOT / "cpp" / "ffi"),
              "-I", str(ROOT / "jax_fatrain" / "metal")]
  emu_inc = ["-I", str(EMULATOR / "include")]
  nb_flags = ["-isystem", str(nb_inc), "-isystem", str(robin_map), "-isystem", py_inc]
  # (name, compiler and flags, source path, source text or None)
  jobs = [
      ("library", [cxx] + gflags + emu_inc, lib_dir / "library.cc", None),
      ("library_source", [cxx, "-c"], lib_dir / "library_source.S", None),
      ("runtime", [cxx] + gflags + emu_inc, EMULATOR / "src" / "runtime.cc", None),
      ("plan", [cxx] + gflags + host_inc, ROOT / "cpp" / "metal" / "plan" / "plan.cc", None),
      ("nanobind", [cxx] + gflags + ["-DNB_BUILD", "-fno-strict-aliasing"] + nb_flags,
       nb_src / "nb_combined.cpp", None),
      ("executor", [clangxx] + cflags + host_inc, ROOT / "cpp/metal/host/executor.cc",
       host_sources["cpp/metal/host/executor.cc"]),
      ("metal_ffi", [clangxx] + cflags + host_inc + ["-isystem", xla_inc] + nb_flags,
       ROOT / "cpp/ffi/metal_ffi.cc", host_sources["cpp/ffi/metal_ffi.cc"]),
      ("metal_standin", [clangxx] + cflags + emu_inc + ["-I", str(HERE)],
       HERE / "metal_standin.cc", None),
      ("standin_selftest", [clangxx] + cflags + ["-I", str(HERE)], HERE / "standin_selftest.cc",
       None),
      ("objc_runtime", [clangxx] + cflags + ["-I", str(HERE)], HERE / "objc_runtime.cc", None),
      ("objc_msgsend", [cxx, "-c"], HERE / "objc_msgsend_x86_64.S", None),
  ]

  def compile_one(job) -> Path:
    name, cmd, path, text = job
    text = path.read_text() if text is None else text
    key = _digest(environment, " ".join(cmd), str(path), text)[:32]
    obj = objs_dir / f"{name}-{key}.o"
    if obj.is_file():
      return obj
    with tempfile.TemporaryDirectory(dir=objs_dir) as tmp:
      src = path
      if text != path.read_text():  # a planted variant: compile an edited copy
        src = Path(tmp) / path.name
        src.write_text(text)
      out = Path(tmp) / "out.o"
      if verbose:
        print("metal stand-in: compiling", name, file=sys.stderr)
      _run(cmd + ["-c", str(src), "-o", str(out)], f"compiling {name}")
      os.replace(out, obj)
    return obj

  with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
    objects = list(pool.map(compile_one, jobs))
  key = _digest(*(o.name for o in objects))[:24]
  out_dir = work / "ext" / key
  ext = out_dir / f"_metal_ffi{suffix}"
  if not ext.is_file():
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".tmp{os.getpid()}{suffix}"
    _run([cxx, "-shared", "-o", str(tmp)] + [str(o) for o in objects] + ["-lpthread", "-ldl"]
         + sanitize[:1],
         "linking the stand-in extension")
    os.replace(tmp, ext)
  return ext


# ---------------------------------------------------------------------------
# Use from a test process
# ---------------------------------------------------------------------------
_saved: dict | None = None
_lib: ctypes.CDLL | None = None


def use(ext: Path, device: str = "apple8"):
  """Loads ``ext`` as ``jax_fatrain._metal_ffi`` and makes ``metal`` use it.

  ``device`` is the stand-in's system model: "apple8" (a 10-core
  Apple8-family GPU with Metal 3 on macOS 14.5), "apple8_macos13" (the same
  GPU on macOS 13.6.7, which cannot compile Metal Shading Language 3.1),
  "apple6" (a GPU too old for the kernels), "none" (no device), "m1" (8
  cores), "m2_max" (38 cores), "m4_max" (40 cores) or "apple8_no_core_count"
  (an IORegistry entry without "gpu-core-count"). Returns the
  ``jax_fatrain._backends.metal`` module, re-imported against the stand-in.
  """
  global _saved, _lib
  import jax_fatrain  # pylint: disable=import-outside-toplevel
  from jax_fatrain import _registry  # pylint: disable=import-outside-toplevel
  from jax_fatrain._backends import metal  # pylint: disable=import-outside-toplevel
  if _saved is not None:
    raise RuntimeError("the Metal stand-in is already in use in this process")
  spec = importlib.util.spec_from_file_location("jax_fatrain._metal_ffi", ext)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  _lib = ctypes.CDLL(str(ext))
  _lib.fatrain_metal_standin_report.restype = ctypes.c_char_p
  _lib.fatrain_metal_standin_fail.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
  _lib.fatrain_metal_standin_set_device.argtypes = [ctypes.c_char_p]
  _lib.fatrain_metal_standin_limit_pipelines.argtypes = [ctypes.c_char_p, ctypes.c_ulong,
                                                         ctypes.c_ulong]
  if _lib.fatrain_metal_standin_set_device(device.encode()) != 0:
    raise ValueError(f"unknown device model {device!r}")
  _saved = {"module": sys.modules.get("jax_fatrain._metal_ffi"),
            "attribute": getattr(jax_fatrain, "_metal_ffi", None)}
  sys.modules["jax_fatrain._metal_ffi"] = module
  jax_fatrain._metal_ffi = module  # pylint: disable=protected-access
  metal = importlib.reload(metal)
  _registry._table.cache_clear()  # pylint: disable=protected-access
  return metal


def restore() -> None:
  """Undoes ``use``: ``metal`` is the package's own again (unavailable on Linux)."""
  global _saved
  import jax_fatrain  # pylint: disable=import-outside-toplevel
  from jax_fatrain import _registry  # pylint: disable=import-outside-toplevel
  from jax_fatrain._backends import metal  # pylint: disable=import-outside-toplevel
  if _saved is None:
    return
  if _saved["module"] is None:
    sys.modules.pop("jax_fatrain._metal_ffi", None)
  else:
    sys.modules["jax_fatrain._metal_ffi"] = _saved["module"]
  if _saved["attribute"] is None:
    if hasattr(jax_fatrain, "_metal_ffi"):
      del jax_fatrain._metal_ffi  # pylint: disable=protected-access
  else:
    jax_fatrain._metal_ffi = _saved["attribute"]  # pylint: disable=protected-access
  _saved = None
  importlib.reload(metal)
  _registry._table.cache_clear()  # pylint: disable=protected-access


def report() -> dict:
  """The stand-in's counters, pipelines, dispatches run (kernel, grid), compile
  options, live objects (IORegistry model objects under "registry_live") and
  findings."""
  return json.loads(_lib.fatrain_metal_standin_report().decode())


def reset() -> None:
  """Clears counters, the pipeline list and findings."""
  _lib.fatrain_metal_standin_reset()


def selftest() -> tuple[int, str]:
  """(failures, log) of the stand-in's own checks (standin_selftest.cc)."""
  _lib.fatrain_metal_standin_selftest.restype = ctypes.c_char_p
  text = _lib.fatrain_metal_standin_selftest().decode()
  first, _, log = text.partition("\n")
  return int(first.split()[1]), log


def fail(what: str, message: str, times: int = 1) -> None:
  """The next ``times`` operations ``what`` ("library", "pipeline", "execution") fail."""
  if _lib.fatrain_metal_standin_fail(what.encode(), message.encode(), times) != 0:
    raise ValueError(f"unknown failure kind {what!r}")


def limit_pipelines(kernel_prefix: str | None, max_threads: int = 0,
                    execution_width: int = 0) -> None:
  """Pipelines created from now on for kernels whose names start with
  ``kernel_prefix`` report at most ``max_threads`` as
  maxTotalThreadsPerThreadgroup (as Apple's compiler lowers it for a kernel
  with many registers) and ``execution_width`` as threadExecutionWidth (0:
  leave as is). ``None`` removes every limit set so far; pipelines the host
  has cached keep theirs."""
  prefix = None if kernel_prefix is None else kernel_prefix.encode()
  _lib.fatrain_metal_standin_limit_pipelines(prefix, max_threads, execution_width)


if __name__ == "__main__":
  import argparse
  parser = argparse.ArgumentParser(description="Builds the Metal stand-in extension.")
  parser.add_argument("--plant", choices=sorted(PLANTED), default=None)
  args = parser.parse_args()
  sys.path.insert(0, str(ROOT))
  print(build(args.plant, verbose=True))
