#!/usr/bin/env bash
# The one-GPU end-to-end points the cost model is judged against (never fitted to): the
# single-device reference training 4 layers of the 7B in bf16 at 4K-64K (activation checkpointing
# on, as the paper's runs), and one forward at 64K, each a real `tspbench run` record. Run after
# env/gpu-check.sh on the same machine (docs/projection.md, "One H200 against the model").
#
#   bash env/gpu-validate.sh OUT_DIR [SECONDS]   # stops starting runs after SECONDS (default 240)
#
# Like gpu-check.sh it installs nothing: the checkout on PYTHONPATH, the machine's own torch.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: bash env/gpu-validate.sh OUT_DIR [SECONDS]}
budget=${2:-240}
PY=${PYTHON:-python3}
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
cd "$here"
device=$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
if [ "$device" = cuda ]; then
  shape=(--model 7b --set layers=4 --dtype bf16)
  train=(4096 16384 32768 65536) infer=65536
else # a CPU stand-in, so the script itself is checked where no GPU is
  shape=(--model tiny --dtype fp32)
  train=(128 256) infer=256
fi
start=$SECONDS
failed=0
one() { # NAME ARGS...: one run, its own time limit, one line
  local name=$1
  shift
  if ((SECONDS - start > budget)); then
    echo "skipped  $name (past the ${budget} s budget)"
    return
  fi
  local t=$SECONDS
  if timeout 120 "$PY" -m tspbench run --strategy single "${shape[@]}" --device "$device" \
    --warmup 1 --steps 3 --quiet --out "$out/$name.json" "$@" >"$out/$name.log" 2>&1; then
    echo "ok       $name ($((SECONDS - t)) s)"
  else
    echo "FAILED   $name ($((SECONDS - t)) s): $(tail -1 "$out/$name.log")"
    failed=$((failed + 1))
  fi
}
for S in "${train[@]}"; do
  one "val-train-S$S" --mode train --recompute full --seq-len "$S"
done
one "val-infer-S$infer" --mode infer --seq-len "$infer"
echo "gpu-validate: $failed failed in $((SECONDS - start)) s; wrote $out"
exit "$failed"
