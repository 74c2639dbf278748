"""Run-time builds of .metal files into standalone MSL-emulator libraries.

The ``metal_emulated`` extension compiles the package's own kernels when the
package is built. A kernel whose source only exists at run time (MLX's steel
attention, fetched for comparison by ``jax_fatrain.emulator.mlx_reference``) goes
through the same emulator here: ``cpp/metal/emulator/msl_prepass.py``
enforces the emulator's source rules (with clang++, when there is one, also
the address-space rule) and translates the .metal file, the C++ compiler builds a shared library from the
result, the emulator runtime (``src/runtime.cc``) and its C API
(``src/standalone_api.cc``), and ``ctypes`` loads it. Libraries are cached by
the SHA-256 of everything that goes into them, under ``$JAX_FATRAIN_CACHE``
(default ``~/.cache/jax_fatrain``).

Needs a source checkout (``cpp/metal/emulator`` is not installed with the
package) and a C++17 compiler (``$CXX``, default ``c++``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

__all__ = ["BuildError", "EmulatorError", "EmulatorLibrary", "build_library", "cache_root"]

_ROOT = Path(__file__).resolve().parents[2]
_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wno-narrowing",
          "-Wno-unknown-pragmas", "-Wno-attributes", "-w")
_ABI_VERSION = 2


class BuildError(RuntimeError):
  """The .metal file could not be translated or compiled."""


class EmulatorError(RuntimeError):
  """A dispatch failed (the emulator's message: kernel, threadgroup, thread, what)."""


def cache_root() -> Path:
  """Where downloads and builds are cached: $JAX_FATRAIN_CACHE or ~/.cache/jax_fatrain."""
  env = os.environ.get("JAX_FATRAIN_CACHE")
  return Path(env) if env else Path.home() / ".cache" / "jax_fatrain"


def emulator_dir() -> Path:
  d = _ROOT / "cpp" / "metal" / "emulator"
  if not (d / "msl_prepass.py").is_file():
    raise BuildError(
        f"building a .metal file for the MSL emulator at run time needs a source checkout of "
        f"jax_fatrain (the emulator sources cpp/metal/emulator/ are not installed with the "
        f"package; looked in {d})")
  return d


def _compiler() -> list[str]:
  return shlex.split(os.environ.get("CXX") or "c++")


def clang_for_rules() -> str | None:
  """clang++ for the pre-pass's address-space rule: $FATRAIN_CLANGXX, else
  clang++ on PATH; None (the rule is skipped) when there is none."""
  return os.environ.get("FATRAIN_CLANGXX") or shutil.which("clang++")


def _compiler_id(cxx: list[str]) -> str:
  try:
    out = subprocess.run(cxx + ["--version"], capture_output=True, text=True, check=True)
  except (OSError, subprocess.CalledProcessError) as e:
    raise BuildError(f"no working C++ compiler ({' '.join(cxx)}; set CXX): {e}") from e
  return out.stdout


def _hash(*parts: bytes | str) -> str:
  h = hashlib.sha256()
  for p in parts:
    b = p.encode() if isinstance(p, str) else p
    h.update(len(b).to_bytes(8, "little"))
    h.update(b)
  return h.hexdigest()


def _emulator_sources(emu: Path) -> list[Path]:
  files = sorted(p for p in (emu / "include").rglob("*") if p.is_file())
  return files + [emu / "src" / "runtime.cc", emu / "src" / "standalone_api.cc"]


def _run(cmd: list[str], what: str) -> None:
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    raise BuildError(f"{what} failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")


class _Buffer(ctypes.Structure):
  _fields_ = [("index", ctypes.c_int32), ("is_bytes", ctypes.c_int32),
              ("data", ctypes.c_void_p), ("size", ctypes.c_uint64)]


class _Constant(ctypes.Structure):
  _fields_ = [("index", ctypes.c_int32), ("value", ctypes.c_double)]


class _Dispatch(ctypes.Structure):
  _fields_ = [("kernel", ctypes.c_char_p),
              ("constants", ctypes.POINTER(_Constant)), ("num_constants", ctypes.c_int32),
              ("buffers", ctypes.POINTER(_Buffer)), ("num_buffers", ctypes.c_int32),
              ("threadgroup_memory_length", ctypes.c_uint64),
              ("grid", ctypes.c_uint32 * 3), ("threadgroup", ctypes.c_uint32 * 3),
              ("worker_threads", ctypes.c_int32),
              ("sample_fraction", ctypes.c_double), ("sample_max_threadgroups", ctypes.c_uint64)]


def _read_list(fn) -> list[str]:
  n = fn(None, 0)
  buf = ctypes.create_string_buffer(int(n) + 1)
  fn(buf, len(buf))
  return [s for s in buf.value.decode().split("\n") if s]


class EmulatorLibrary:
  """One built library: its kernels (by host name) and dispatch()."""

  def __init__(self, path: Path):
    self.path = Path(path)
    self._lib = ctypes.CDLL(str(self.path))
    lib = self._lib
    lib.msl_emu_abi_version.restype = ctypes.c_uint32
    if lib.msl_emu_abi_version() != _ABI_VERSION:
      raise BuildError(f"{self.path}: C API version {lib.msl_emu_abi_version()}, "
                       f"expected {_ABI_VERSION}")
    lib.msl_emu_dispatch.restype = ctypes.c_int
    lib.msl_emu_dispatch.argtypes = [ctypes.POINTER(_Dispatch), ctypes.POINTER(ctypes.c_uint64),
                                     ctypes.c_int32, ctypes.c_char_p, ctypes.c_uint64,
                                     ctypes.c_char_p, ctypes.c_uint64]
    for name in ("msl_emu_kernel_names", "msl_emu_counter_names"):
      getattr(lib, name).restype = ctypes.c_uint64
      getattr(lib, name).argtypes = [ctypes.c_char_p, ctypes.c_uint64]
    self.kernel_names = _read_list(lib.msl_emu_kernel_names)
    self.counter_names = _read_list(lib.msl_emu_counter_names)

  def dispatch(self, kernel: str, *, buffers: Mapping[int, np.ndarray | bytes],
               constants: Mapping[int, bool | int | float], grid: Sequence[int],
               threadgroup: Sequence[int], threadgroup_memory_length: int = 0,
               worker_threads: int = 0, count: bool = False,
               sample: float | int | None = None) -> dict | None:
    """Runs one dispatch.

    ``buffers`` maps a buffer index to a C-contiguous numpy array (device
    memory: the kernel reads and writes it in place) or to ``bytes`` (setBytes
    data, constant). ``grid`` counts threadgroups. Raises EmulatorError with
    the emulator's message when the kernel faults (out-of-bounds access,
    barrier not reached by all threads, threadgroup-memory race, ...).

    With ``count`` (or ``sample``) returns the dispatch's record in the format
    of :mod:`jax_fatrain.emulator.profile` (``kernel``, ``grid``, ``threadgroup``,
    ``threadgroup_memory_length``, the counters, ``race_reports``,
    ``sampled_fraction``); races are then counted, not raised. ``sample``: a
    fraction in (0, 1] of the threadgroups, or an int, at most that many (the
    outputs are then incomplete). Without either returns None.
    """
    if kernel not in self.kernel_names:
      raise EmulatorError(f"{self.path.name} has no kernel {kernel!r} "
                          f"(it has {', '.join(self.kernel_names)})")
    from jax_fatrain.emulator import profile as metal_profile  # pylint: disable=import-outside-toplevel
    fraction, max_threadgroups = metal_profile._sample_args(sample)  # pylint: disable=protected-access
    count = count or sample is not None
    keep = []
    bufs = (_Buffer * max(1, len(buffers)))()
    for i, (index, value) in enumerate(sorted(buffers.items())):
      if isinstance(value, (bytes, bytearray)):
        data = ctypes.create_string_buffer(bytes(value), len(value))
        keep.append(data)
        bufs[i] = _Buffer(index, 1, ctypes.cast(data, ctypes.c_void_p), len(value))
      else:
        arr = value
        if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
          raise TypeError(f"buffer {index}: a C-contiguous numpy array or bytes is required")
        keep.append(arr)
        bufs[i] = _Buffer(index, 0, arr.ctypes.data, arr.nbytes)
    consts = (_Constant * max(1, len(constants)))()
    for i, (index, value) in enumerate(sorted(constants.items())):
      consts[i] = _Constant(index, float(value))
    d = _Dispatch(kernel.encode(), consts, len(constants), bufs, len(buffers),
                  threadgroup_memory_length, (ctypes.c_uint32 * 3)(*grid),
                  (ctypes.c_uint32 * 3)(*threadgroup), worker_threads, fraction,
                  max_threadgroups)
    counters = (ctypes.c_uint64 * len(self.counter_names))() if count else None
    reports = ctypes.create_string_buffer(1 << 14)
    err = ctypes.create_string_buffer(1 << 12)
    rc = self._lib.msl_emu_dispatch(ctypes.byref(d), counters, len(self.counter_names), reports,
                                    len(reports), err, len(err))
    del keep
    if rc != 0:
      raise EmulatorError(err.value.decode(errors="replace"))
    if not count:
      return None
    record = {"kernel": kernel, "grid": tuple(grid), "threadgroup": tuple(threadgroup),
              "threadgroup_memory_length": threadgroup_memory_length}
    record.update((name, int(counters[i])) for i, name in enumerate(self.counter_names))
    record["race_reports"] = [r for r in reports.value.decode(errors="replace").split("\n") if r]
    total = record.get("threadgroups_total", 0)
    record["sampled_fraction"] = record["threadgroups_executed"] / total if total else 1.0
    return record


_loaded: dict[str, EmulatorLibrary] = {}    # by content hash
_requested: dict[tuple, EmulatorLibrary] = {}  # by arguments (and the file's mtime) in this process
_lock = threading.Lock()


def build_library(metal_file: str | os.PathLike, *, include_dirs: Sequence[str | os.PathLike] = (),
                  kernels: Sequence[str] | None = None,
                  skip_rules: Sequence[str] = ()) -> EmulatorLibrary:
  """Builds (or loads from the cache) the emulator library of ``metal_file``.

  ``include_dirs`` are search roots for the file's ``#include "..."``;
  ``kernels`` restricts the library to these host names (only their templates
  are instantiated, which keeps the compile short); ``skip_rules`` names
  source rules of the pre-pass (cpp/metal/emulator/README.md, "Rules") not to
  enforce, for kernels kept only to be measured.
  """
  emu = emulator_dir()
  cxx = _compiler()
  stat = os.stat(metal_file)
  request = (str(Path(metal_file).resolve()), stat.st_mtime_ns, stat.st_size,
             tuple(str(d) for d in include_dirs), None if kernels is None else tuple(kernels),
             tuple(skip_rules))
  with _lock:
    if request in _requested:
      return _requested[request]
  with tempfile.TemporaryDirectory(prefix="fatrain_msl_") as tmp:
    generated = Path(tmp) / "kernels.cc"
    cmd = [sys.executable, str(emu / "msl_prepass.py"), str(metal_file), str(generated),
           "--cxx", cxx[0]]
    for d in include_dirs:
      cmd += ["-I", str(d)]
    if kernels is not None:
      cmd += ["--kernels", ",".join(kernels)]
    for rule in skip_rules:
      cmd += ["--skip-rule", rule]
    clang = clang_for_rules()
    if clang:
      cmd += ["--clang", clang]
    _run(cmd, "the MSL pre-pass")
    code = generated.read_text()
  compiler_id = _compiler_id(cxx)
  sources = _emulator_sources(emu)
  runtime_key = _hash(compiler_id, " ".join(_FLAGS),
                      *(str(p.relative_to(emu)) + "\0" + p.read_text() for p in sources))
  key = _hash(runtime_key, code)
  with _lock:
    if key in _loaded:
      _requested[request] = _loaded[key]
      return _loaded[key]
    out_dir = cache_root() / "msl_standalone"
    lib_path = out_dir / f"{key[:32]}.so"
    if not lib_path.is_file():
      out_dir.mkdir(parents=True, exist_ok=True)
      _build(emu, cxx, code, out_dir / f"runtime-{runtime_key[:32]}", lib_path)
    lib = EmulatorLibrary(lib_path)
    _loaded[key] = lib
    _requested[request] = lib
    return lib


def _build(emu: Path, cxx: list[str], code: str, runtime_dir: Path, lib_path: Path) -> None:
  include = ["-I", str(emu / "include")]
  runtime_objs = [runtime_dir / "runtime.o", runtime_dir / "standalone_api.o"]
  with tempfile.TemporaryDirectory(prefix="fatrain_msl_", dir=lib_path.parent) as tmp:
    src = Path(tmp) / "kernels.cc"
    src.write_text(code)
    jobs = [(cxx + list(_FLAGS) + include + ["-c", str(src), "-o", str(Path(tmp) / "kernels.o")],
             "compiling the translated .metal file")]
    have_runtime = all(p.is_file() for p in runtime_objs)
    if not have_runtime:
      for obj in runtime_objs:
        jobs.append((cxx + list(_FLAGS) + include + [
            "-c", str(emu / "src" / (obj.stem + ".cc")), "-o", str(Path(tmp) / obj.name)],
                     f"compiling {obj.stem}.cc"))
    procs = [(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
              cmd, what) for cmd, what in jobs]
    for proc, cmd, what in procs:
      out, _ = proc.communicate()
      if proc.returncode != 0:
        raise BuildError(f"{what} failed ({' '.join(cmd)}):\n{out}")
    if not have_runtime:
      runtime_dir.mkdir(parents=True, exist_ok=True)
      for obj in runtime_objs:
        os.replace(Path(tmp) / obj.name, obj)
    tmp_lib = Path(tmp) / "lib.so"
    _run(cxx + ["-shared", "-o", str(tmp_lib), str(Path(tmp) / "kernels.o")] +
         [str(p) for p in runtime_objs] + ["-lpthread"], "linking the emulator library")
    os.replace(tmp_lib, lib_path)
