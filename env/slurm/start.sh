#!/usr/bin/env bash
# Install (if missing) and start a one-node Slurm on 127.0.0.1 for the tests or a workstation.
# Needs root and Debian's packages (apt-get). Declares 4 CPUs whatever the machine has, so
# 4-rank cells fit on 2 cores. Every daemon it starts leaves a pid file under $STATE/run;
# env/slurm/stop.sh stops exactly those.
set -euo pipefail
STATE=${TSPBENCH_SLURM_STATE:-/tmp/tspbench-slurm}
CPUS=${TSPBENCH_SLURM_CPUS:-4}
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
mkdir -p "$STATE"/{run,log,ctld,spool} /etc/slurm
host=$(hostname -s)

# munge: a key, a socket directory readable by all (0755), the daemon as user munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge && chmod 0755 /run/munge
if ! pgrep -x munged >/dev/null; then
  runuser -u munge -- munged --pid-file=/run/munge/munged.pid
  cp /run/munge/munged.pid "$STATE/run/munged.pid"
fi

# slurm.conf must sit at the default path: the executor plugin's job steps drop SLURM_CONF
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=tspbench
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
KillWait=10
MinJobAge=300
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF

[ -s "$STATE/run/slurmctld.pid" ] && kill -0 "$(cat "$STATE/run/slurmctld.pid")" 2>/dev/null \
  || slurmctld
[ -s "$STATE/run/slurmd.pid" ] && kill -0 "$(cat "$STATE/run/slurmd.pid")" 2>/dev/null \
  || slurmd
for _ in $(seq 60); do
  if sinfo -h -o "%T" 2>/dev/null | grep -qE "^(idle|mixed|allocated)"; then
    sinfo
    exit 0
  fi
  sleep 1
done
echo "Slurm did not come up; logs in $STATE/log" >&2
tail -n 20 "$STATE"/log/*.log >&2 || true
exit 1
