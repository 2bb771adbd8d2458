#!/usr/bin/env bash
# Create ./.venv (if missing) and install tspbench for CPU: torch 2.13.0 CPU build, the package
# in editable mode with its MPI extra, and with --dev the pinned test and lint tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
reqs=(-r env/requirements-cpu.txt)
[ "${1:-}" = "--dev" ] && reqs+=(-r env/requirements-dev.txt)
pip install -q "${reqs[@]}"
pip install -q -e ".[mpi]"
echo "tspbench installed in $(pwd)/.venv ($(python -c 'import torch; print("torch", torch.__version__)'))"
