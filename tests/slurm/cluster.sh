#!/usr/bin/env bash
# A single-node Slurm cluster for tests/slurm (tox -e slurm), without systemd.
#
#   tests/slurm/cluster.sh [start]   install (if missing), configure and start munge, slurmctld, slurmd
#   tests/slurm/cluster.sh stop      stop what `start` started (by the pid files it wrote)
#   tests/slurm/cluster.sh status    exit 0 if the node answers and is idle/mixed/allocated
#
# Idempotent: `start` on a running cluster it started leaves it running (restarting the daemons
# only when the configuration it would write differs). Everything lives in $LIFEGUARD_SLURM_DIR
# (default /tmp/lifeguard-slurm): slurm.conf, state, spool, logs and pid files. Clients find the
# configuration through SLURM_CONF=$LIFEGUARD_SLURM_DIR/slurm.conf, so /etc/slurm is not touched.
#
# Needs root (the packages, munged as user munge, slurmd). Exit status 2 means "cannot run
# here" (no root, or the packages cannot be installed): the tests skip on it outside CI.
#
# Settings (environment):
#   LIFEGUARD_SLURM_PROCTRACK  linuxproc (default) or cgroup (cgroup v1; with task/cgroup)
#   LIFEGUARD_SLURM_KILLWAIT   seconds between SIGTERM and SIGKILL (default 5)
set -euo pipefail

DIR="${LIFEGUARD_SLURM_DIR:-/tmp/lifeguard-slurm}"
CONF="$DIR/slurm.conf"
PROCTRACK="${LIFEGUARD_SLURM_PROCTRACK:-linuxproc}"
KILLWAIT="${LIFEGUARD_SLURM_KILLWAIT:-5}"
PACKAGES=(slurmctld slurmd slurm-client munge)

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

do_stop() {
    if [ -n "$(command -v scancel)" ] && [ -f "$CONF" ] && alive "$DIR/slurmctld.pid"; then
        SLURM_CONF="$CONF" timeout 10 scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    fi
    stop_pidfile "$DIR/slurmd.pid" slurmd
    stop_pidfile "$DIR/slurmctld.pid" slurmctld
    # munged writes its own pid file; stop it only if this script started it.
    if [ -f "$DIR/munged.started" ]; then
        stop_pidfile "$DIR/munged.pid" munged
        rm -f "$DIR/munged.started"
    fi
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
# Written by tests/slurm/cluster.sh: a single-node test cluster.
ClusterName=lifeguard
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/$PROCTRACK
TaskPlugin=$task
ReturnToService=2
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldPort=6817
SlurmdPort=6818
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
MinJobAge=300
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

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0 # a munged is answering (ours or the machine's)
    fi
    [ -s /etc/munge/munge.key ] || {
        log "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null; then
            runuser -u munge -- mungekey --create >&2
        else
            dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
            chown munge:munge /etc/munge/munge.key
            chmod 0400 /etc/munge/munge.key
        fi
    }
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    runuser -u munge -- munged --force --pid-file=/run/munge/munged.pid
    cp /run/munge/munged.pid "$DIR/munged.pid"
    touch "$DIR/munged.started"
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    cannot "munged does not answer"
}

node_ready() {
    SLURM_CONF="$CONF" timeout 5 sinfo -h -N -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'
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
        # -i: ignore state left by an earlier run of this script (its jobs are gone).
        slurmctld -f "$CONF" -i
    fi
    if ! alive "$DIR/slurmd.pid"; then
        slurmd -f "$CONF"
    fi
    for _ in $(seq 150); do
        if node_ready; then
            log "ready: SLURM_CONF=$CONF (proctrack/$PROCTRACK, KillWait=$KILLWAIT)"
            echo "$CONF"
            return 0
        fi
        sleep 0.2
    done
    SLURM_CONF="$CONF" sinfo -N -l >&2 || true
    tail -n 20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
    log "the node did not come up within 30 s"
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
