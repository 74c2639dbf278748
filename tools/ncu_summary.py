"""Summarises Nsight Compute's per-instruction source page (SASS, CSV, plain or
gzipped, as tools/cuda_profile.sh writes it): where a kernel's warps stall.

    python tools/ncu_summary.py PROFILE.sass.csv.gz [--top 25] [--kernel SUBSTRING]

Prints the stall reasons over all samples, the samples and executions per
opcode, and the instructions with the most samples, each with its top three
stall reasons. Samples cover every warp, producer warps included, so a
producer's mbarrier wait loop shows as a BRA with long_sb stalls even where
that warp has nothing else to do. A page of several kernels (ncu -c N) is
summarised one kernel at a time: the first, or the first whose name contains
--kernel.
"""

import argparse
import collections
import csv
import gzip


def read_kernels(path):
  """[(kernel name, instruction rows)] of the page, each row a dict keyed by
  the page's column names. Each kernel's part starts with a line naming it,
  then its header."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", newline="") as f:
    lines = list(csv.reader(f))
  kernels, header = [], None
  for row in lines:
    if row and row[0] == "Kernel Name":
      kernels.append((row[1] if len(row) > 1 else "?", []))
      header = None
    elif row and row[0] == "Address":
      header = row
      if not kernels:
        kernels.append(("?", []))
    elif header is not None and len(row) == len(header):
      kernels[-1][1].append(dict(zip(header, row)))
  return kernels


def read_rows(path, kernel=None):
  """The instruction rows of the page's first kernel, or of the first whose
  name contains `kernel`."""
  for name, rows in read_kernels(path):
    if kernel is None or kernel in name:
      return rows
  raise ValueError(f"no kernel named like {kernel!r} in {path}")


def _int(value):
  return int(value) if value and value.lstrip("-").isdigit() else 0


def opcode(source):
  """'@!P0 BRA 0x7f..' -> 'BRA'; 'HGMMA.64x128x16.F32.BF16 R88, ..' -> 'HGMMA'."""
  words = [w for w in source.split() if not w.startswith("@")]
  return words[0].split(".")[0] if words else "?"


def summarise(rows, top=25):
  """The report, as a list of lines."""
  stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k] if rows else []
  total = sum(_int(r["# Samples"]) for r in rows) or 1
  by_stall = collections.Counter()
  by_op, executed = collections.Counter(), collections.Counter()
  for r in rows:
    for s in stalls:
      by_stall[s[len("stall_"):]] += _int(r[s])
    op = opcode(r["Source"])
    by_op[op] += _int(r["# Samples"])
    executed[op] += _int(r["Instructions Executed"])
  out = [f"{total} samples"]
  out += [f"  stall {s:20s} {n:9d} {100 * n / total:5.1f}%" for s, n in by_stall.most_common(10)]
  out += [f"  op    {op:20s} {n:9d} {100 * n / total:5.1f}%  executed {executed[op]:12d}"
          for op, n in by_op.most_common(15)]
  for r in sorted(rows, key=lambda r: -_int(r["# Samples"]))[:top]:
    why = sorted(((_int(r[s]), s[len("stall_"):]) for s in stalls), reverse=True)[:3]
    why = ", ".join(f"{s} {n}" for n, s in why if n)
    out.append(f"  {_int(r['# Samples']):8d}  {r['Address'][-5:]}  {r['Source'].strip()[:56]:56s}  {why}")
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("csv")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--kernel", help="the first kernel whose name contains this (default: the first)")
  args = ap.parse_args()
  print("\n".join(summarise(read_rows(args.csv, args.kernel), args.top)))


if __name__ == "__main__":
  main()
