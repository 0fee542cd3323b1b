#!/usr/bin/env bash
# The proof that `tox -e slurm` keeps to its own cluster on a machine that already runs Slurm.
#
#   tests/slurm/neighbour.sh [COMMAND...]    default COMMAND: tox -e slurm
#
# It starts a neighbour: a second single-node Slurm as a real cluster node has it, on Slurm's
# default ports (6817/6818), configured in /etc/slurm/slurm.conf (the file every client reads
# when SLURM_CONF is unset), authenticated by the system's munged (/etc/munge/munge.key), with
# a job of its own queued and one running. Then it runs COMMAND with LIFEGUARD_SLURM=1, and
# checks that the neighbour still runs, with the same job list and the same configuration, and
# that no job of the test cluster's reached it. Finally it stops the neighbour and removes what
# it wrote (/etc/slurm/slurm.conf only if it wrote it). Exit status: COMMAND's, or 1 when the
# neighbour was touched.
#
# Run by hand, as root, on a machine with no Slurm of its own (it refuses to replace an
# /etc/slurm/slurm.conf or to start on taken ports): it changes the machine while it runs.
set -euo pipefail
cd "$(dirname "$0")/../.."

DIR="$(mktemp -d /tmp/slurm-neighbour.XXXXXX)"
CONF=/etc/slurm/slurm.conf
log() { echo "neighbour.sh: $*" >&2; }

[ "$(id -u)" -eq 0 ] || { log "needs root"; exit 2; }
command -v slurmctld >/dev/null || { log "no slurmctld: run tests/slurm/cluster.sh once to install Slurm"; exit 2; }
[ -e "$CONF" ] && { log "$CONF exists: this machine has a Slurm of its own; not touching it"; exit 2; }
for port in 6817 6818; do
    if ss -Hltn "sport = :$port" 2>/dev/null | grep . >/dev/null; then log "port $port is taken"; exit 2; fi
done

host="$(hostname -s)"
mem="$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')"
mkdir -p "$DIR/state" "$DIR/spool" /etc/slurm
cat >"$CONF" <<EOF
# Written by tests/slurm/neighbour.sh: a stand-in for a real cluster's node, removed at its end.
ClusterName=neighbour
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=3600
NodeName=$host CPUs=2 RealMemory=$mem State=UNKNOWN
PartitionName=main Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

stop_all() {
    set +e
    scancel --full --quiet --user=root 2>/dev/null
    # Until its jobs are gone: a job step outlives a slurmd stopped under it.
    for _ in $(seq 100); do
        [ -z "$(squeue -h 2>/dev/null)" ] && break
        sleep 0.2
    done
    for name in slurmd slurmctld; do
        [ -s "$DIR/$name.pid" ] && kill "$(cat "$DIR/$name.pid")" 2>/dev/null
    done
    [ -n "${MUNGED_STARTED:-}" ] && kill "$(cat /run/munge/munged.pid 2>/dev/null)" 2>/dev/null
    sleep 1
    rm -f "$CONF"
    rm -rf "$DIR"
}
trap stop_all EXIT

# The system's munged, on its default socket and key, as a node runs it.
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- munged --force
    MUNGED_STARTED=1
fi
slurmctld -i
slurmd
for _ in $(seq 600); do
    sinfo -h -N -o '%T' 2>/dev/null | grep -E '^(idle|mixed)' >/dev/null && break
    sleep 0.2
done
sinfo -h -N -o '%T' | grep -E '^(idle|mixed)' >/dev/null || { log "the neighbour's node did not come up"; exit 1; }
# One job running and one waiting behind it (two CPUs each on a two-CPU node).
sbatch --quiet -o /dev/null -J neighbour-running -c 2 --wrap 'sleep 100000' >/dev/null
sbatch --quiet -o /dev/null -J neighbour-pending -c 2 --wrap 'sleep 100000' >/dev/null
for _ in $(seq 300); do
    [ "$(squeue -h -n neighbour-running -o '%T')" = RUNNING ] && break
    sleep 0.2
done
[ "$(squeue -h -n neighbour-running -o '%T')" = RUNNING ] || { log "the neighbour's job did not start"; exit 1; }

snapshot() {
    {
        squeue -h -o '%i %j %T %P %u'
        scontrol show config | grep -vE '^(Configuration data as of|BOOT_TIME|SLURM_VERSION)'
        scontrol show partition
    } 2>&1
}
snapshot >"$DIR/before"
log "neighbour up on 6817/6818 ($CONF): $(squeue -h -o '%j=%T' | tr '\n' ' ')"

[ $# -eq 0 ] && set -- tox -e slurm
set +e
LIFEGUARD_SLURM=1 "$@"
status=$?
set -e

snapshot >"$DIR/after"
touched=0
if ! cmp -s "$DIR/before" "$DIR/after"; then
    log "the neighbour changed:"
    diff "$DIR/before" "$DIR/after" >&2 || true
    touched=1
fi
strangers="$(squeue -h -t all -o '%i %j' | grep -v ' neighbour-' || true)"
if [ -n "$strangers" ]; then
    log "jobs that are not the neighbour's reached it: $strangers"
    touched=1
fi
if [ "$touched" -eq 0 ]; then
    log "the neighbour is untouched: same jobs, same configuration, no job of the tests"
fi
[ "$status" -ne 0 ] && exit "$status"
exit "$touched"
