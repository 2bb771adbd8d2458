#!/usr/bin/env bash
# Everything one lent GPU is asked, in one call: env/gpu-check.sh (versions, doctor, rank probe,
# three real runs; 5 min), env/gpu-validate.sh (single-device end-to-end points) and
# env/gpu_kernels.py (attention kernels, the rank probe at 64K and 128K), each with its own time
# limit inside BUDGET seconds (default 530), packed as OUT/gpu.tgz with the check's summary and
# log beside it (a lent machine sends back at most 8 files). results/reference/gpu-h200 is what
# its parts wrote on an H200.
#
#   bash env/gpu-all.sh OUT [BUDGET]
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: bash env/gpu-all.sh OUT [BUDGET]}
budget=${2:-530}
PY=${PYTHON:-python3}
work=$(mktemp -d)/gpu
mkdir -p "$work" "$out"
t0=$SECONDS
left() { echo $((budget - (SECONDS - t0))); }
pack() {
  cp "$work/check/summary.json" "$work/check/log.txt" "$out/" 2>/dev/null
  tar czf "$out/gpu.tgz" -C "$(dirname "$work")" gpu
}
trap pack EXIT
{
  nvidia-smi || rocm-smi
  "$PY" -c 'import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda or torch.version.hip)'
  "$PY" -m pip list 2>/dev/null
} >"$work/env.txt" 2>&1
t=$(($(left) - 200))            # the check first: the kernels and validation want 200 s after it
[ "$t" -ge 60 ] || t=$(($(left) - 20))
if [ "$t" -ge 30 ]; then
  timeout -k 10 "$t" bash "$here/env/gpu-check.sh" "$work/check"
  echo "gpu-check: rc $? at $((SECONDS - t0)) s"
fi
if [ "$(left)" -gt 150 ]; then
  PYTHONPATH="$here" timeout -k 10 $(($(left) - 100)) "$PY" "$here/env/gpu_kernels.py" \
    "$work/kernels-and-probes.json" >"$work/kernels.log" 2>&1
  echo "gpu_kernels: rc $? at $((SECONDS - t0)) s"
fi
b=$(($(left) - 160)) # gpu-validate starts no run after b s, and one run takes at most 120 s
if [ "$b" -gt 0 ]; then
  timeout -k 10 $(($(left) - 20)) bash "$here/env/gpu-validate.sh" "$work/validate" "$b"
  echo "gpu-validate: rc $? at $((SECONDS - t0)) s"
fi
