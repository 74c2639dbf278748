"""The CUDA kernels compile (CI has nvcc but no GPU).

The CUDA backend is built only with JAX_FATRAIN_CUDA=ON, and its tests run only
where a GPU is present; compiling the kernels here catches compile errors (and
ptxas resource overflows) on machines that cannot run them.
"""

import concurrent.futures
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARCHS = ("-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a")


def _compile(source: pathlib.Path, arch: str, out_dir: pathlib.Path):
  out = out_dir / f"{source.stem}-{arch.rsplit('=', 1)[-1]}.o"
  cmd = ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", arch,
         f"-I{ROOT / 'cpp'}", "-c", str(source), "-o", str(out)]
  return source.name, arch, subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler (nvcc) here")
def test_cuda_kernels_compile_for_sm80_and_sm90a(tmp_path):
  sources = sorted((ROOT / "cpp" / "cuda").glob("*.cu"))
  assert sources
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    results = list(pool.map(lambda job: _compile(*job, tmp_path),
                            [(s, a) for s in sources for a in ARCHS]))
  failures = [f"{name} [{arch}]:\n{r.stderr[-3000:]}" for name, arch, r in results
              if r.returncode != 0]
  assert not failures, "\n\n".join(failures)


def _resource_report_tool():
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "cuda_resource_report", ROOT / "tools" / "cuda_resource_report.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_resource_report_reads_ptxas_output():
  """tools/cuda_resource_report.py's parser, on ptxas -v lines as nvcc prints them
  (a C7512 note may come before the function's own lines)."""
  tool = _resource_report_tool()
  log = "\n".join([
      "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are "
      "serialized due to insufficient register resources for the function '_Z1bv'",
      "ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'",
      "ptxas info    : Function properties for _Z1av",
      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
      "ptxas info    : Used 168 registers, used 16 barriers",
      "ptxas info    : Compiling entry function '_Z1bv' for 'sm_90a'",
      "ptxas info    : Function properties for _Z1bv",
      "    96 bytes stack frame, 168 bytes spill stores, 136 bytes spill loads",
      "ptxas info    : Used 128 registers",
  ])
  kernels = tool.rows(log)
  assert kernels["_Z1av"] == dict(regs=168, stores=0, loads=0, barriers=16, c7512=False)
  assert kernels["_Z1bv"] == dict(regs=128, stores=168, loads=136, barriers=0, c7512=True)
  name = ("void fatrain::cuda::(anonymous namespace)::bwd_ws_kernel<__nv_bfloat16, 64, true, "
          "0, 128>(fatrain::cuda::(anonymous namespace)::BwdTensorMaps, fatrain::cuda::KParams)")
  assert tool.short(name) == "bwd_ws_kernel<bf16, 64, true, 0, 128>"
