"""The compiler's resource report for the CUDA kernels, as a markdown table.

    python tools/cuda_resource_report.py [--all-dtypes] [SOURCE ...]

Compiles each CUDA source (default: every cpp/cuda/*.cu; a file without
kernels adds no row) with this machine's nvcc, for sm_90a (the Hopper files) or sm_80
(the mma.sync and SIMT files), with `-Xptxas -v`, and prints one row per
kernel instance: registers per thread at launch, spill bytes, named
barriers, and whether ptxas serialised its wgmma instructions (note C7512,
"insufficient register resources", or C7520, registers that reach a wgmma
through a divergent path). Needs nvcc, not a GPU.

The warp-specialised kernels start with the launch's register count and
then move registers between warpgroups with setmaxnreg (the producer gives
its registers back, the consumers take them), so for them "registers" is the
block's starting budget, not what a consumer ends up with.
"""

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA = ROOT / "cpp" / "cuda"


def target(source: str) -> str:
  """sm_90a for the Hopper-only files (their kernels are empty elsewhere), else sm_80."""
  return "sm_90a" if source.startswith("hopper_") else "sm_80"


def ptxas_report(source: str, target: str) -> str:
  arch = target.replace("sm_", "compute_")
  with tempfile.TemporaryDirectory() as tmp:
    cmd = ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr",
           f"-gencode=arch={arch},code={target}", f"-I{ROOT / 'cpp'}", "-cubin",
           "-o", str(pathlib.Path(tmp) / "k.cubin"), str(CUDA / source), "-Xptxas", "-v"]
    done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode != 0:
    sys.exit(f"nvcc failed on {source}:\n{done.stderr[-2000:]}")
  return done.stderr


def demangle(names):
  out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
  return out.stdout.splitlines() if out.returncode == 0 else list(names)


def short(name: str) -> str:
  """The kernel's name and template arguments, without namespaces and parameters."""
  name = name.replace("(anonymous namespace)::", "").replace("fatrain::cuda::", "")
  name = re.sub(r"^void ", "", name)
  name = re.sub(r"\([^()]*\)$", "", name)  # the parameter list
  return name.replace("__nv_bfloat16", "bf16").replace("__half", "f16")


def rows(report: str):
  """{mangled name: registers, spill stores, spill loads, barriers, the
  serialising notes}."""
  kernels, serialised = {}, {}
  current = None
  for line in report.splitlines():
    m = re.search(r"Compiling entry function '(\S+)'", line)
    if m:
      current = m.group(1)
      kernels[current] = dict(regs=None, stores=0, loads=0, barriers=0, serialised="no")
      continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and current:
      kernels[current].update(stores=int(m.group(1)), loads=int(m.group(2)))
    m = re.search(r"Used (\d+) registers(?:, used (\d+) barriers)?", line)
    if m and current:
      kernels[current].update(regs=int(m.group(1)), barriers=int(m.group(2) or 0))
    m = re.search(r"\((C7512|C7520)\).*function '(\S+)'", line)
    if m:  # ptxas may print it before the function's own lines
      serialised.setdefault(m.group(2), set()).add(m.group(1))
  for name in serialised.keys() & kernels.keys():
    kernels[name]["serialised"] = "yes: " + ", ".join(sorted(serialised[name]))
  return kernels


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("sources", nargs="*", help="files in cpp/cuda (default: all .cu files)")
  ap.add_argument("--all-dtypes", action="store_true",
                  help="also the float16 instances (default: bfloat16 and dtype-free only)")
  args = ap.parse_args(argv)
  sources = args.sources or sorted(f.name for f in CUDA.glob("*.cu"))
  missing = [s for s in sources if not (CUDA / s).is_file()]
  if missing:
    sys.exit(f"not in {CUDA}: {', '.join(missing)}")
  print("| file | kernel instance | registers | spills (store/load bytes) | barriers "
        "| wgmma serialised (C7512, C7520) |")
  print("|---|---|---|---|---|---|")
  for source in sources:
    kernels = rows(ptxas_report(source, target(source)))
    names = demangle(list(kernels))
    for (mangled, k), name in sorted(zip(kernels.items(), names), key=lambda x: x[1]):
      name = short(name)
      if not args.all_dtypes and "f16" in name.replace("bf16", ""):
        continue
      print(f"| {source} | `{name}` | {k['regs']} | {k['stores']}/{k['loads']} "
            f"| {k['barriers']} | {k['serialised']} |")


if __name__ == "__main__":
  main()
