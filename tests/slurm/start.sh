#!/usr/bin/env bash
# Start a two-node Slurm cluster on this host: slurmctld + `slurmd -N n1` + `slurmd -N n2`
# (one partition, `local`), with munged if none is running. Needs root (no systemd: the
# daemons are started by hand). State, logs and pid files go under DIR; stop.sh DIR stops
# exactly the daemons started here.
#
#   tests/slurm/start.sh DIR
#
# Exit status: 0 both nodes idle; 3 not root; 4 the Slurm packages are missing and apt cannot
# install them; 5 /etc/slurm/slurm.conf belongs to someone else; 1 anything else.
set -euo pipefail

DIR=${1:?usage: start.sh DIR}
MARKER="# written by wattgate tests/slurm/start.sh"
CONF=/etc/slurm/slurm.conf
CTLD_PORT=${WATTGATE_SLURM_PORT:-16817}   # node n<i> listens on CTLD_PORT + i

if [ "$(id -u)" != 0 ]; then
    echo "start.sh: needs root (slurmd runs jobs as their user; the config lives in /etc/slurm)" >&2
    exit 3
fi

mkdir -p "$DIR/ctld" "$DIR/spool-n1" "$DIR/spool-n2"
DIR=$(cd "$DIR" && pwd)

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v srun >/dev/null \
        || ! command -v munged >/dev/null; then
    echo "start.sh: installing slurmctld slurmd slurm-client munge" >&2
    export DEBIAN_FRONTEND=noninteractive
    if ! { timeout -k 5 180 apt-get update -qq && timeout -k 5 300 apt-get install -y -qq \
            --no-install-recommends slurmctld slurmd slurm-client munge; } >"$DIR/apt.log" 2>&1; then
        tail -5 "$DIR/apt.log" >&2
        echo "start.sh: cannot install the Slurm packages (apt unreachable?)" >&2
        exit 4
    fi
fi

# The jobstep executor strips SLURM_CONF from the job's environment, so srun inside a job only
# finds the default path: the config must live there. Never overwrite a real cluster's config.
if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
    echo "start.sh: $CONF exists and was not written by this script; not touching it" >&2
    exit 5
fi
if [ -e "$CONF" ]; then
    other=$(sed -n 's/^# state: //p' "$CONF")
    if [ -n "$other" ] && [ "$other" != "$DIR" ] && [ -e "$other/slurmctld.pid" ] \
            && kill -0 "$(cat "$other/slurmctld.pid")" 2>/dev/null; then
        echo "start.sh: a test cluster from $other is still running; stop it first (stop.sh $other)" >&2
        exit 6  # another test run's cluster (slurmd is one per host): a caller may wait for it to stop
    fi
fi

CPUS=$(nproc)
MEM_MB=$(( $(awk '/^MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))   # each node claims half the host
HOST=$(hostname -s)

mkdir -p /etc/slurm
cat >"$CONF" <<EOF
$MARKER
# state: $DIR
ClusterName=wattgate-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
# no cgroups in a container: plain process tracking, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
ReturnToService=2
# no slurmdbd: finished jobs stay visible to 'squeue --states=all' this long, and each job's
# final record (nodes, submit/start/end times, state) is appended to jobcomp.log
MinJobAge=900
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
InactiveLimit=0
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=60
# both nodes are this host: distinct ports, an address that resolves
NodeName=n1 NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 1)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 2)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF

# munge: reuse a working daemon (then it is not ours to stop), else start one
if ! timeout 5 bash -c 'munge -n | unmunge' >/dev/null 2>&1; then
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
    mkdir -p /run/munge
    chmod 755 /run/munge
    munged -f --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed"
fi

slurmctld -i
for n in n1 n2; do
    slurmd -N "$n"
done

# bounded wait until both nodes report idle
for _ in $(seq 120); do
    states=$(timeout 5 sinfo -h -N -o '%N=%T' 2>/dev/null | sort -u | tr '\n' ' ' || true)
    if [ "$states" = "n1=idle n2=idle " ]; then
        echo "start.sh: cluster up (nodes n1 n2 idle; state in $DIR)"
        exit 0
    fi
    sleep 0.5
done
echo "start.sh: nodes not idle after 60 s: ${states:-no answer from slurmctld}" >&2
tail -5 "$DIR"/slurmctld.log "$DIR"/slurmd-n*.log >&2 || true
exit 1
