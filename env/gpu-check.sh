#!/usr/bin/env bash
# One GPU, no network, the machine's own torch: every check the suite can make there, in one
# folder, in under 5 minutes (tspbench/pipeline/gpucheck.py says what each step does).
#
#   bash env/gpu-check.sh OUT_DIR        # e.g. bash env/gpu-check.sh "$OUT" on a lent machine
#
# Nothing is installed: the checkout is put on PYTHONPATH and run with the python that has
# torch ($PYTHON, else python3). Besides torch it needs numpy and pyyaml, which GPU images
# ship; where they are missing, carry their wheels in and `pip install --no-index` them.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: bash env/gpu-check.sh OUT_DIR}
PY=${PYTHON:-python3}
"$PY" -c 'import torch, numpy, yaml' || {
  echo "gpu-check: $PY lacks torch, numpy or pyyaml (carry their wheels in)" >&2
  exit 2
}
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
cd "$here"
exec "$PY" -m tspbench gpu-check --out "$out"
