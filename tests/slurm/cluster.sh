#!/usr/bin/env bash
# A single-node Slurm cluster for tests/slurm (tox -e slurm), without systemd, apart from any
# Slurm or munge that already runs on the machine.
#
#   tests/slurm/cluster.sh [start]   install (if missing), configure and start munged, slurmctld, slurmd
#   tests/slurm/cluster.sh stop      stop what `start` started (by the pid files it wrote)
#   tests/slurm/cluster.sh status    exit 0 if this cluster's node answers and is idle/mixed/allocated
#
# Running `start` changes the machine: it may apt-get install Debian's Slurm and munge, and it
# starts three daemons. The tests run it only when asked (LIFEGUARD_SLURM=1, or CI=true); run by
# hand, it is asked.
#
# Idempotent: `start` on a running cluster it started leaves it running (restarting the daemons
# only when the configuration it would write differs). Everything lives in $LIFEGUARD_SLURM_DIR
# (default /tmp/lifeguard-slurm): slurm.conf, state, spool, logs, pid files and munge/ (its own
# munged's key, socket, pid file and log). Nothing under /etc is read or written, and the cluster
# cannot meet another one on the machine:
#   - its own ports, not Slurm's 6817/6818 (it refuses to start when another process has them);
#   - its own munged: its own key and socket (AuthInfo=socket=... in its slurm.conf);
#   - its own ClusterName, and job ids from FirstJobId=7000000;
#   - every client call here gets SLURM_CONF=$LIFEGUARD_SLURM_DIR/slurm.conf and none of the
#     SLURM_*/SBATCH_*/SRUN_*/SALLOC_* variables it inherited (from a job of a real cluster).
#
# Needs root (the packages, munged as user munge, slurmd). Exit status 2 means "cannot run
# here" (no root, or the packages cannot be installed).
#
# Settings (environment):
#   LIFEGUARD_SLURM_DIR        where everything lives (default /tmp/lifeguard-slurm)
#   LIFEGUARD_SLURMCTLD_PORT   slurmctld's port (default 16817)
#   LIFEGUARD_SLURMD_PORT      slurmd's port (default 16818)
#   LIFEGUARD_SLURM_PROCTRACK  linuxproc (default) or cgroup (cgroup v1; with task/cgroup)
#   LIFEGUARD_SLURM_KILLWAIT   seconds between SIGTERM and SIGKILL (default 5)
set -euo pipefail

DIR="${LIFEGUARD_SLURM_DIR:-/tmp/lifeguard-slurm}"
CONF="$DIR/slurm.conf"
CLUSTER=lifeguard-test
CTLD_PORT="${LIFEGUARD_SLURMCTLD_PORT:-16817}"
SLURMD_PORT="${LIFEGUARD_SLURMD_PORT:-16818}"
MUNGE_DIR="$DIR/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket"
PROCTRACK="${LIFEGUARD_SLURM_PROCTRACK:-linuxproc}"
KILLWAIT="${LIFEGUARD_SLURM_KILLWAIT:-5}"
PACKAGES=(slurmctld slurmd slurm-client munge)

# Every Slurm client below (sinfo, scontrol, scancel, slurmd -C) talks to this cluster only.
for name in $(compgen -e); do
    case "$name" in
    SLURM_* | SBATCH_* | SRUN_* | SALLOC_* | SQUEUE_* | SINFO_* | SCANCEL_* | SCONTROL_*) unset "$name" ;;
    esac
done
export SLURM_CONF="$CONF"

log() { echo "cluster.sh: $*" >&2; }
cannot() { log "$*"; exit 2; }

alive() { # pid file -> running?
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

stop_pidfile() { # pid file, name: TERM, wait up to 10 s, then KILL
    local file="$1" name="$2" pid
    alive "$file" || { rm -f "$file"; return 0; }
    pid="$(cat "$file")"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name ($pid) still alive after 10 s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

listening() { # port -> does any process on this machine listen on it (TCP, IPv4 or IPv6)?
    local hex
    hex="$(printf ':%04X' "$1")"
    awk -v port="$hex" 'FNR > 1 && $4 == "0A" && substr($2, length($2) - 4) == port { found = 1 }
        END { exit !found }' /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

do_stop() {
    if [ -n "$(command -v scancel)" ] && [ -f "$CONF" ] && alive "$DIR/slurmctld.pid"; then
        timeout 10 scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    fi
    stop_pidfile "$DIR/slurmd.pid" slurmd
    stop_pidfile "$DIR/slurmctld.pid" slurmctld
    stop_pidfile "$MUNGE_DIR/munged.pid" munged # ours: its own pid file, key and socket
    log "stopped"
}

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    [ "${#missing[@]}" -eq 0 ] && return 0
    command -v apt-get >/dev/null || cannot "missing ${missing[*]} and no apt-get to install them"
    log "installing ${PACKAGES[*]}"
    apt-get update -q >&2 || cannot "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >&2 \
        || cannot "apt-get install ${PACKAGES[*]} failed"
}

write_conf() {
    local host cpus mem cgroup_lines="" task="task/none"
    host="$(hostname -s)"
    # The machine's memory; CPUs are declared 16 (at least the real count) so that one test's
    # jobs (both shapes, with and without lifeguard) run side by side: they mostly wait.
    mem="$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')"
    cpus="$(nproc)"
    [ "$cpus" -lt 16 ] && cpus=16
    if [ "$PROCTRACK" = cgroup ]; then
        task="task/cgroup"
        cat >"$DIR/cgroup.conf.new" <<EOF
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
        mv "$DIR/cgroup.conf.new" "$DIR/cgroup.conf"
    fi
    cat >"$CONF.new" <<EOF
# Written by tests/slurm/cluster.sh: a single-node test cluster, apart from any other on this
# machine (its own ports, munged, state, spool and job ids).
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/$PROCTRACK
TaskPlugin=$task
ReturnToService=2
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
FirstJobId=7000000
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# A short grace between SIGTERM and SIGKILL; the tests wait through it.
KillWait=$KILLWAIT
# A finished job's record is kept for the whole session: test_time_limit judges its jobs last,
# minutes after their limit (with the default 300 s a slow run found them purged).
MinJobAge=3600
InactiveLimit=0
Waittime=0
# Jobs of a higher partition tier preempt lower ones; debug's jobs are requeued when they
# allow it (sbatch --requeue), cancelled otherwise.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=0
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE
PartitionName=high Nodes=$host Default=NO MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
    if [ -f "$CONF" ] && cmp -s "$CONF" "$CONF.new"; then
        rm -f "$CONF.new"
        return 1 # unchanged
    fi
    mv "$CONF.new" "$CONF"
    return 0
}

munge_answers() {
    munge --socket="$MUNGE_SOCKET" -n </dev/null 2>/dev/null |
        unmunge --socket="$MUNGE_SOCKET" >/dev/null 2>&1
}

start_munge() { # our own munged: own key, socket, pid file and log, all in $MUNGE_DIR
    if alive "$MUNGE_DIR/munged.pid" && munge_answers; then
        return 0
    fi
    stop_pidfile "$MUNGE_DIR/munged.pid" munged
    install -d -o munge -g munge -m 0755 "$MUNGE_DIR"
    if [ ! -s "$MUNGE_DIR/munge.key" ]; then
        if command -v mungekey >/dev/null; then
            runuser -u munge -- mungekey --create --keyfile="$MUNGE_DIR/munge.key" >&2
        else
            dd if=/dev/urandom bs=1 count=1024 of="$MUNGE_DIR/munge.key" status=none
        fi
    fi
    chown munge:munge "$MUNGE_DIR/munge.key"
    chmod 0400 "$MUNGE_DIR/munge.key"
    # --force: a socket left by a munged of ours that was killed is removed, not refused.
    runuser -u munge -- munged --force --socket="$MUNGE_SOCKET" \
        --key-file="$MUNGE_DIR/munge.key" --pid-file="$MUNGE_DIR/munged.pid" \
        --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed"
    for _ in $(seq 50); do
        munge_answers && return 0
        sleep 0.1
    done
    cannot "munged does not answer on $MUNGE_SOCKET (see $MUNGE_DIR/munged.log)"
}

# grep without -q: -q exits at the first match, and under pipefail the SIGPIPE that scontrol then
# gets for the rest of its 7 KB fails the pipeline (it did: the node was idle, and "ready" never
# came for 120 s in a rehearsal of .ci/run).
ours() { # is the controller on our port this cluster's own (and alive by our pid files)?
    alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" &&
        timeout 5 scontrol show config 2>/dev/null | grep -E "^ClusterName += $CLUSTER\$" >/dev/null
}

node_ready() {
    ours && timeout 5 sinfo -h -N -o '%T' 2>/dev/null | grep -E '^(idle|mixed|allocated)' >/dev/null
}

free_port() { # port, variable that sets it, daemon: fail unless the port is free
    if listening "$1"; then
        log "port $1 is taken by another process: set $2 to a free port for the test $3"
        exit 1
    fi
}

do_start() {
    [ "$(id -u)" -eq 0 ] || cannot "needs root (packages, munged, slurmd)"
    install_packages
    mkdir -p "$DIR/state" "$DIR/spool"
    chmod 0755 "$DIR"
    local changed=0
    write_conf && changed=1
    start_munge
    if [ "$changed" -eq 1 ]; then
        stop_pidfile "$DIR/slurmd.pid" slurmd
        stop_pidfile "$DIR/slurmctld.pid" slurmctld
    fi
    if ! alive "$DIR/slurmctld.pid"; then
        free_port "$CTLD_PORT" LIFEGUARD_SLURMCTLD_PORT slurmctld
        # -i: ignore state left by an earlier run of this script (its jobs are gone).
        slurmctld -f "$CONF" -i
    fi
    if ! alive "$DIR/slurmd.pid"; then
        free_port "$SLURMD_PORT" LIFEGUARD_SLURMD_PORT slurmd
        slurmd -f "$CONF"
    fi
    # Up to 120 s: on a loaded 2-core machine slurmd's first registration took 34 s.
    for _ in $(seq 600); do
        if node_ready; then
            log "ready: SLURM_CONF=$CONF (ports $CTLD_PORT/$SLURMD_PORT, proctrack/$PROCTRACK, KillWait=$KILLWAIT)"
            echo "$CONF"
            return 0
        fi
        sleep 0.2
    done
    sinfo -N -l >&2 || true
    tail -n 20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
    log "the node did not come up within 120 s"
    exit 1
}

case "${1:-start}" in
start) do_start ;;
stop) do_stop ;;
status) node_ready ;;
*)
    echo "usage: $0 [start|stop|status]" >&2
    exit 64
    ;;
esac
