#!/usr/bin/env bash
# Stop exactly the daemons env/slurm/start.sh started (by their pid files).
set -u
STATE=${TSPBENCH_SLURM_STATE:-/tmp/tspbench-slurm}
for d in slurmd slurmctld munged; do
  f="$STATE/run/$d.pid"
  if [ -s "$f" ]; then
    kill "$(cat "$f")" 2>/dev/null && echo "stopped $d ($(cat "$f"))"
    rm -f "$f"
  fi
done
