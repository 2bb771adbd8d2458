#!/usr/bin/env bash
# Create ./.venv (if missing) and install tspbench: torch 2.13.0, the pipeline tools (report
# included), the package in editable mode with its MPI and pipeline extras, and with --dev the
# pinned test and lint tools. Links the Slurm profile so `snakemake --profile slurm` finds it.
#
#   bash env/install.sh [--dev] [--torch-index URL]
#
# torch comes from the wheel index in --torch-index or $TSPBENCH_TORCH_INDEX, by default
# PyTorch's CPU index (on the public PyPI the same pin is the multi-GB CUDA build). For a GPU
# node name its CUDA/ROCm index, e.g. https://download.pytorch.org/whl/cu128 or .../rocm6.4;
# "none" leaves the choice to pip's own configuration. Needs Python 3.11 or newer ($PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0
torch_index=${TSPBENCH_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) dev=1 ;;
    --torch-index) torch_index=${2:?--torch-index needs a URL}; shift ;;
    --torch-index=*) torch_index=${1#*=} ;;
    *) echo "install.sh: unknown option $1 (known: --dev, --torch-index URL)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "install.sh: $("$PY" --version 2>&1) is too old: tspbench needs Python 3.11 or newer (set PYTHON=...)" >&2
  exit 2
}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
torch_pin=$(grep -E '^torch==' env/requirements-cpu.txt)
if [ "$torch_index" = none ]; then
  pip install -q "$torch_pin"
else  # an extra index: torch's own dependencies still come from PyPI
  pip install -q --retries 1 --extra-index-url "$torch_index" "$torch_pin"
fi
reqs=(-r env/requirements-cpu.txt)
[ "$dev" = 1 ] && reqs+=(-r env/requirements-dev.txt)
pip install -q "${reqs[@]}"
pip install -q -e ".[mpi,pipeline]"
profile="${XDG_CONFIG_HOME:-$HOME/.config}/snakemake/slurm"
if [ ! -e "$profile" ]; then
  mkdir -p "$(dirname "$profile")"
  ln -s "$(pwd)/workflows/profiles/slurm" "$profile"
  echo "linked the Slurm profile: $profile -> workflows/profiles/slurm"
elif [ "$(readlink -f "$profile")" != "$(pwd)/workflows/profiles/slurm" ]; then
  echo "note: $profile exists and is not tspbench's; use --profile workflows/profiles/slurm"
fi
echo "tspbench installed in $(pwd)/.venv ($(python -c 'import torch; print("torch", torch.__version__)'))"
