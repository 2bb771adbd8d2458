#!/usr/bin/env bash
# Stop exactly the daemons env/slurm/start.sh started (by their pid files).
set -u
STATE=${TSPBENCH_SLURM_STATE:-/tmp/tspbench-slurm}
for d in slurmd slurmctld munged; do
  f="$STATE/run/$d.pid"
  if [ -s "$f" ]; then
    pid=$(cat "$f")  # read first: a daemon removes its own pid file as it stops
    kill "$pid" 2>/dev/null && echo "stopped $d ($pid)"
    rm -f "$f"
  fi
done
