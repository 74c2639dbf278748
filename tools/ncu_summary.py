"""Summarises Nsight Compute's per-instruction source page (SASS, CSV, plain or
gzipped, as tools/cuda_profile.sh writes it): where a kernel's warps stall.

    python tools/ncu_summary.py PROFILE.sass.csv.gz [--top 25]

Prints the stall reasons over all samples, the samples and executions per
opcode, and the instructions with the most samples, each with its top three
stall reasons. Samples cover every warp, producer warps included, so a
producer's mbarrier wait loop shows as a BRA with long_sb stalls even where
that warp has nothing else to do.
"""

import argparse
import collections
import csv
import gzip


def read_rows(path):
  """The instruction rows, as dicts keyed by the page's column names."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", newline="") as f:
    lines = list(csv.reader(f))
  # The page starts with a line naming the kernel, then the header.
  start = next(i for i, row in enumerate(lines) if row and row[0] == "Address")
  header = lines[start]
  return [dict(zip(header, row)) for row in lines[start + 1:] if len(row) == len(header)]


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
  args = ap.parse_args()
  print("\n".join(summarise(read_rows(args.csv), args.top)))


if __name__ == "__main__":
  main()
