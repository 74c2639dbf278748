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
