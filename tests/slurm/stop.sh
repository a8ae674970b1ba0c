#!/usr/bin/env bash
# Stop the cluster that start.sh DIR started: cancel its jobs, then stop exactly the daemons
# whose pid files start.sh left in DIR (a munged that was already running is left alone), and
# remove /etc/slurm/slurm.conf if start.sh wrote it.
#
#   tests/slurm/stop.sh DIR
set -uo pipefail

DIR=${1:?usage: stop.sh DIR}
MARKER="# written by wattgate tests/slurm/start.sh"
CONF=/etc/slurm/slurm.conf
DIR=$(cd "$DIR" 2>/dev/null && pwd) || { echo "stop.sh: no such directory" >&2; exit 1; }

# jobs of this test cluster only (it has no other users); bounded, the controller may be gone
if [ -e "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
    timeout -k 2 10 scancel --full --quiet --partition=local 2>/dev/null
    for _ in $(seq 20); do
        [ -z "$(timeout 5 squeue -h -t running,completing,pending -o %i 2>/dev/null)" ] && break
        sleep 0.5
    done
fi

stop_pid() {  # pid file, expected command name: never signal a recycled pid
    local file=$1 name=$2 pid
    [ -e "$file" ] || return 0
    pid=$(cat "$file")
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 50); do
            [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || break
            [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = Z ] && break
            sleep 0.2
        done
        if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] \
                && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]; then
            kill -KILL "$pid" 2>/dev/null
        fi
    fi
    rm -f "$file"
}

stop_pid "$DIR/slurmd-n1.pid" slurmd
stop_pid "$DIR/slurmd-n2.pid" slurmd
stop_pid "$DIR/slurmctld.pid" slurmctld
stop_pid "$DIR/munged.pid" munged

if [ -e "$CONF" ] && grep -qF "$MARKER" "$CONF" && grep -qxF "# state: $DIR" "$CONF"; then
    rm -f "$CONF"
fi
echo "stop.sh: stopped the cluster in $DIR"
