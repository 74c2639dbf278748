"""The CUDA kernels compile (CI has nvcc but no GPU).

The CUDA backend is built only with JAX_FATRAIN_CUDA=ON, and its tests run only
where a GPU is present; compiling the kernels here catches compile errors,
ptxas resource overflows and wgmma that ptxas serialises, on machines that
cannot run them.
"""

import concurrent.futures
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARCHS = ("-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a")


def _compile(source: pathlib.Path, arch: str, out_dir: pathlib.Path):
  """nvcc's result for one source and target, with ptxas's resource report
  (-v) in its stderr."""
  out = out_dir / f"{source.stem}-{arch.rsplit('=', 1)[-1]}.o"
  cmd = ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", arch,
         f"-I{ROOT / 'cpp'}", "-c", str(source), "-o", str(out), "-Xptxas", "-v"]
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
  # No warp-specialised kernel may have its wgmma serialised by ptxas (notes
  # C7512, C7520): the kernel still computes the right thing, only far slower.
  report = _tool("cuda_resource_report")
  serialised = []
  for name, arch, r in results:
    if "sm_90a" not in arch:
      continue
    kernels = report.rows(r.stderr)
    for kernel, k in zip(report.demangle(list(kernels)), kernels.values()):
      if k["serialised"] != "no":
        serialised.append(f"{name}: {report.short(kernel)} {k['serialised']}")
  assert not serialised, "\n".join(serialised)


def _tool(name):
  """tools/NAME.py as a module (tools/ is not a package)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_resource_report_reads_ptxas_output():
  """tools/cuda_resource_report.py's parser, on ptxas -v lines as nvcc prints them
  (a C7512 or C7520 note may come before the function's own lines)."""
  tool = _tool("cuda_resource_report")
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
      "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are "
      "serialized due to program dependence on compiler-inserted WG.AR in divergent path in "
      "the function '_Z1cv'",
      "ptxas info    : Compiling entry function '_Z1cv' for 'sm_90a'",
      "ptxas info    : Used 168 registers, used 16 barriers",
  ])
  kernels = tool.rows(log)
  assert kernels["_Z1av"] == dict(regs=168, stores=0, loads=0, barriers=16, serialised="no")
  assert kernels["_Z1bv"] == dict(regs=128, stores=168, loads=136, barriers=0,
                                  serialised="yes: C7512")
  assert kernels["_Z1cv"] == dict(regs=168, stores=0, loads=0, barriers=16,
                                  serialised="yes: C7520")
  name = ("void fatrain::cuda::(anonymous namespace)::bwd_ws_kernel<__nv_bfloat16, 64, true, "
          "0, 128>(fatrain::cuda::(anonymous namespace)::BwdTensorMaps, fatrain::cuda::KParams)")
  assert tool.short(name) == "bwd_ws_kernel<bf16, 64, true, 0, 128>"


def test_ncu_summary_reads_the_source_page(tmp_path):
  """tools/ncu_summary.py on a source page laid out as `ncu --page source --csv
  --print-source sass` writes it: a kernel line, the header, one row per
  instruction (the numbers here are made up)."""
  tool = _tool("ncu_summary")
  page = "\n".join([
      '"Kernel Name","void k(int)",',
      '"Address","Source","# Samples","Instructions Executed","stall_wait","stall_long_sb",'
      '"stall_wait (Not Issued)"',
      '"0x7f0000000010","      BSSY B0, 0x7f00000000a0","30","1000","20","10","5"',
      '"0x7f0000000020","@!P0  BRA 0x7f0000000010","60","2000","0","60","0"',
      '"0x7f0000000030","HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16], RZ, !UPT","10","500","10","0","0"',
  ])
  path = tmp_path / "k.sass.csv"
  path.write_text(page)
  rows = tool.read_rows(str(path))
  assert [tool.opcode(r["Source"]) for r in rows] == ["BSSY", "BRA", "HGMMA"]
  report = tool.summarise(rows, top=2)
  assert report[0] == "100 samples"
  assert any(line.split()[:4] == ["stall", "long_sb", "70", "70.0%"] for line in report)
  assert any(line.split()[:5] == ["op", "BRA", "60", "60.0%", "executed"] for line in report)
  top = [line for line in report if line.startswith("  ") and line.split()[0].isdigit()]
  assert [line.split()[0] for line in top] == ["60", "30"]
  assert top[0].rstrip().endswith("long_sb 60")


def test_ncu_summary_picks_one_kernel_of_a_page(tmp_path):
  """A page of two kernels (ncu -c 2): each is read on its own, never mixed."""
  tool = _tool("ncu_summary")
  header = '"Address","Source","# Samples","Instructions Executed","stall_wait"'
  page = "\n".join([
      '"Kernel Name","fwd_kernel",', header,
      '"0x10","FFMA R1, R2, R3, R4","5","100","5"',
      '"Kernel Name","bprop_kernel",', header,
      '"0x20","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], R24","7","200","7"',
      '"0x30","@P0 BRA 0x20","9","300","9"',
  ])
  path = tmp_path / "two.sass.csv"
  path.write_text(page)
  assert [name for name, _ in tool.read_kernels(str(path))] == ["fwd_kernel", "bprop_kernel"]
  assert [tool.opcode(r["Source"]) for r in tool.read_rows(str(path))] == ["FFMA"]
  rows = tool.read_rows(str(path), "bprop")
  assert [tool.opcode(r["Source"]) for r in rows] == ["HGMMA", "BRA"]
  assert tool.summarise(rows)[0] == "16 samples"
  with pytest.raises(ValueError):
    tool.read_rows(str(path), "no_such_kernel")


def test_cuda_kernel_times_groups_kernels_by_problem():
  """tools/cuda_kernel_times.py on an ncu --csv page as it lays one out: per
  problem an untimed call, a separator (the cosine kernel), the timed calls,
  a separator; values in ns with thousands separators (the numbers here are
  made up)."""
  tool = _tool("cuda_kernel_times")
  header = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
  def row(name, ns):
    return f'"0","{name}","gpu__time_duration.sum","ns","{ns}"'
  fwd, bwd, cos = "void fatrain::<unnamed>::fwd_ws_kernel<bf16>(int)", "bwd_ws_kernel(int)", "loop_cosine_fusion"
  page = "\n".join([
      header,
      row(fwd, "9,999,999"), row(bwd, "9,999,999"), row(cos, "1,000"),  # untimed
      row(fwd, "1,100,000"), row(bwd, "2,000,000"), row(fwd, "1,300,000"), row(bwd, "2,100,000"),
      row(fwd, "1,200,000"), row(bwd, "2,050,000"), row(cos, "900"),
      row(fwd, "8,888,888"), row(cos, "1,000"),  # the second problem, untimed
      row(fwd, "950"), row(cos, "1,000"),
  ])
  lines = tool.summarise(page, ["64,4096,32,32,0", "64,1024,32,32,1"], "fwd_ws|bwd_ws", "cuda")
  assert [line.split()[1] for line in lines] == ["64,4096,32,32,0"] * 2 + ["64,1024,32,32,1"]
  assert "fatrain::<unnamed>::fwd_ws_kernel<bf16> " in lines[0] and "(int)" not in lines[0]
  assert lines[0].split()[-3:] == ["1200.0", "(1100.0-1300.0)", "x3"]
  assert lines[1].split()[-3:] == ["2050.0", "(2000.0-2100.0)", "x3"]
  assert lines[2].split()[-3:] == ["0.9", "(0.9-0.9)", "x1"]


def test_cuda_one_step_runs_a_reference_implementation(capsys):
  """tools/cuda_one_step.py's arguments, with --impl xla (which runs here)."""
  tool = _tool("cuda_one_step")
  norms = {}
  for name, extra in (("plain", []), ("mask", ["mask"]), ("window", ["--window", "16"])):
    tool.main(["64", "256", "2", "1", "1", *extra, "--impl", "xla"])
    out = capsys.readouterr().out
    assert out.startswith("ok ")
    norms[name] = [float(x) for x in out[3:].strip(" []\n").split(",")]
    assert len(norms[name]) == 3 and all(x > 0 for x in norms[name])
  # The mask and the window reach the attention call.
  assert norms["mask"] != norms["plain"] and norms["window"] != norms["plain"]
