#!/usr/bin/env bash
# Create ./.venv (if missing) and install tspbench for CPU: torch 2.13.0 CPU build, the pipeline
# tools, the package in editable mode with its MPI and pipeline extras, and with --dev the pinned
# test and lint tools. Links the Slurm profile so `snakemake --profile slurm` finds it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
reqs=(-r env/requirements-cpu.txt)
[ "${1:-}" = "--dev" ] && reqs+=(-r env/requirements-dev.txt)
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
