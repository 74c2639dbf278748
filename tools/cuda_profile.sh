#!/usr/bin/env bash
# Nsight Compute profile of one kernel of one forward+backward step, with the
# per-instruction stall samples exported, for the GPU machine (ncu needs the
# hardware counters; always --clock-control none, which leaves the clocks as
# they are):
#   bash tools/cuda_profile.sh OUTDIR NAME KERNEL_REGEX D T N K [causal [mask|bias]] [--impl cudnn]
#   e.g. bash tools/cuda_profile.sh $OUT bwd256 bwd_ws 256 8192 16 2 0
#        bash tools/cuda_profile.sh $OUT cudnn_bwd256 bprop 256 8192 16 2 0 --impl cudnn
# Writes OUTDIR/NAME.txt (ncu's details page) and OUTDIR/NAME.sass.csv.gz
# (its source page, SASS, one row per instruction), and prints the summary of
# tools/ncu_summary.py. Environment variables (kernel switches) pass through.
set -uo pipefail
out=$1 name=$2 kernel=$3
shift 3
cd "$(dirname "$0")/.."
# tools/cuda_one_step.py imports jax_fatrain from this tree (built in place by
# tools/cuda_device_build.sh, not installed).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
rep=/tmp/$name
ncu --clock-control none -k "regex:$kernel" -c 1 -f -o "$rep" \
  --section SpeedOfLight --section WarpStateStats --section InstructionStats \
  --section SourceCounters --section MemoryWorkloadAnalysis \
  --section ComputeWorkloadAnalysis \
  python3 tools/cuda_one_step.py "$@" > "$rep.run" 2>&1 || { tail -20 "$rep.run"; exit 1; }
ncu -i "$rep.ncu-rep" --page details > "$out/$name.txt" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2> /dev/null | gzip > "$out/$name.sass.csv.gz"
grep -E "^  [a-z].*\(|Duration|Issue Slots Busy" "$out/$name.txt" | head -3
python3 tools/ncu_summary.py "$out/$name.sass.csv.gz"
