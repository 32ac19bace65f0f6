#!/usr/bin/env bash
# A real one-node Slurm cluster on localhost (Debian slurm-wlm 22.05 + munge), for tests and for trying
# the slurm/ recipes on a laptop or CI machine. Needs root.
#
#   bash scripts/local_slurm.sh start    # install if missing, start (idempotent), print `export SLURM_CONF=...`
#   bash scripts/local_slurm.sh status   # daemons and node state
#   bash scripts/local_slurm.sh stop     # stop the daemons by PID (logs stay in the directory)
#
#   eval "$(bash scripts/local_slurm.sh start)" && sbatch --wait ... && bash scripts/local_slurm.sh stop
#
# Nothing is exported into your shell: `start` prints the SLURM_CONF line on stdout (progress goes to
# stderr). munged runs as user munge (setpriv, no wrapper process), slurmctld and slurmd as root.
# Environment:
#   LOCAL_SLURM_DIR    state, spool, logs, munge socket and slurm.conf (default /tmp/diffmeg-slurm).
#                      munged refuses a socket directory whose parents are not world-executable, so keep
#                      it under /tmp (mode 755), not under a 700 home or `mktemp -d` directory.
#   LOCAL_SLURM_PORT   slurmctld port; slurmd uses PORT+1 (default 6817). Use another directory and port
#                      to run a second independent cluster beside the first.
#   LOCAL_SLURM_CPUS   CPUs the node advertises (default: nproc).
#   LOCAL_SLURM_FIRST_JOB_ID   first job id (default 1). pretrain_diff.py derives MASTER_PORT from the job
#                      id, so two clusters on one machine should number their jobs apart.
#   LOCAL_SLURM_NO_INSTALL=1   never call apt-get (fail if Slurm or munge is missing). DIFFMEG_SKIP_SLURM=1,
#                      the test suite's opt-out of the live Slurm tests, implies it.
set -euo pipefail

D=${LOCAL_SLURM_DIR:-/tmp/diffmeg-slurm}
PORT=${LOCAL_SLURM_PORT:-6817}
CPUS=${LOCAL_SLURM_CPUS:-$(nproc)}
FIRST_JOB_ID=${LOCAL_SLURM_FIRST_JOB_ID:-1}
CONF=$D/slurm.conf
DAEMONS=(slurmd slurmctld munged)  # stop order

log() { echo "local_slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }
fail_start() {  # a start that fails leaves nothing running
    log "error: $*"
    stop_daemons quiet
    exit 1
}

pid_of() {  # the PID recorded for a daemon, if that process is alive and still that daemon
    local f=$D/$1.pid pid
    [ -f "$f" ] || return 1
    pid=$(cat "$f" 2>/dev/null) || return 1
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
    if [ -r "/proc/$pid/stat" ]; then  # not a zombie, and not a recycled PID of another program
        [ "$(cut -d' ' -f3 "/proc/$pid/stat")" != Z ] || return 1
        tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$1 .*$D" || return 1
    fi
    echo "$pid"
}

# Whether a daemon this start just launched is still alive. Not pid_of: while the process is between
# setsid, setpriv and the daemon's own exec, /proc/PID/cmdline can read empty for a moment, and pid_of's
# identity check (for a PID file left by an earlier run) then took a starting munged for a dead one.
alive() {
    local pid
    pid=$(cat "$D/$1.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null || return 1
    [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)" != Z ]
}

node_state() { SLURM_CONF=$CONF timeout 10 sinfo -h -o %T 2>/dev/null | head -n 1; }

install_if_missing() {
    local missing=()
    for cmd in slurmctld slurmd sbatch munged; do
        command -v "$cmd" >/dev/null || missing+=("$cmd")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "${LOCAL_SLURM_NO_INSTALL:-0}" = 1 ] && die "missing ${missing[*]} and LOCAL_SLURM_NO_INSTALL=1"
    [ "${DIFFMEG_SKIP_SLURM:-0}" = 1 ] && die "missing ${missing[*]} and DIFFMEG_SKIP_SLURM=1 (no apt-get)"
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install slurm-wlm munge"
    log "installing slurm-wlm munge (missing: ${missing[*]})"
    local apt_log
    apt_log=$(mktemp /tmp/local_slurm_apt.XXXXXX)
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; } >"$apt_log" 2>&1; then
        tail -n 20 "$apt_log" >&2
        die "apt-get install slurm-wlm munge failed (log: $apt_log)"
    fi
    rm -f "$apt_log"
}

write_conf() {
    cat >"$CONF" <<EOF
# Written by scripts/local_slurm.sh: a one-node cluster on localhost.
ClusterName=diffmeg-local
FirstJobId=$FIRST_JOB_ID
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$D/munge/munge.socket.2
CryptoType=crypto/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust the CPU count above even where it exceeds the hardware (LOCAL_SLURM_CPUS > nproc).
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

start_daemon() {  # name, then the command; detached from this shell, output to the log directory
    local name=$1
    shift
    setsid "$@" </dev/null >>"$D/log/$name.out" 2>&1 &
    echo $! >"$D/$name.pid"
}

start() {
    [ "$(id -u)" = 0 ] || die "needs root (munged runs as user munge, slurmd as root)"
    install_if_missing
    if pid_of slurmctld >/dev/null && pid_of slurmd >/dev/null && pid_of munged >/dev/null; then
        log "already running in $D"
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    stop_daemons quiet  # a partial cluster from an earlier run: start over
    rm -rf "$D/state" "$D/spool"
    mkdir -p "$D/munge" "$D/state" "$D/spool" "$D/log"
    chmod 755 "$D"
    local dir=$D
    while [ "$dir" != / ]; do  # munged checks every directory above its socket
        [ "$(( 0$(stat -c %a "$dir") & 1 ))" = 1 ] || die "$dir is not world-executable; munged refuses it"
        dir=$(dirname "$dir")
    done
    chown munge:munge "$D/munge"
    chmod 755 "$D/munge"
    if [ ! -f "$D/munge/munge.key" ]; then
        if [ -f /etc/munge/munge.key ]; then
            install -o munge -g munge -m 600 /etc/munge/munge.key "$D/munge/munge.key"
        else
            (umask 077 && head -c 1024 /dev/urandom >"$D/munge/munge.key")
            chown munge:munge "$D/munge/munge.key"
        fi
    fi
    write_conf

    start_daemon munged setpriv --reuid=munge --regid=munge --init-groups munged -F --socket="$D/munge/munge.socket.2" \
        --key-file="$D/munge/munge.key" --log-file="$D/log/munged.log" \
        --pid-file="$D/munge/munged.pid" --seed-file="$D/munge/munged.seed"
    local i
    for i in $(seq 50); do
        [ -S "$D/munge/munge.socket.2" ] && munge -n -S "$D/munge/munge.socket.2" >/dev/null 2>&1 && break
        alive munged || fail_start "munged exited; see $D/log/munged.log and $D/log/munged.out"
        sleep 0.2
    done
    [ "$i" -lt 50 ] || fail_start "munged did not come up; see $D/log/munged.log"

    start_daemon slurmctld slurmctld -D -f "$CONF"
    start_daemon slurmd slurmd -D -N localhost -f "$CONF"
    local state=""
    for i in $(seq 60); do
        state=$(node_state || true)
        case $state in idle | mixed | allocated) break ;; esac
        for name in slurmctld slurmd; do
            alive "$name" || fail_start "$name exited; see $D/log/$name.log and $D/log/$name.out"
        done
        sleep 0.5
    done
    case $state in
        idle | mixed | allocated) ;;
        *) fail_start "node not up after 30 s (state '${state:-unknown}'); see $D/log/" ;;
    esac
    log "up: node localhost ($CPUS CPUs) is $state; logs in $D/log"
    echo "export SLURM_CONF=$CONF"
}

stop_daemons() {
    local name pid i
    for name in "${DAEMONS[@]}"; do
        pid=$(pid_of "$name") || { rm -f "$D/$name.pid"; continue; }
        [ "${1:-}" = quiet ] || log "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "$name (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$D/$name.pid"
    done
}

status() {
    local name pid up=0
    for name in munged slurmctld slurmd; do
        if pid=$(pid_of "$name"); then
            echo "$name: running (pid $pid)"
            up=$((up + 1))
        else
            echo "$name: stopped"
        fi
    done
    if [ "$up" = 3 ]; then
        echo "node: $(node_state || echo unknown)"
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    return 3
}

case ${1:-} in
    start) start ;;
    stop) stop_daemons ;;
    status) status ;;
    *)
        echo "usage: $0 start|stop|status   (LOCAL_SLURM_DIR=$D, LOCAL_SLURM_PORT=$PORT)" >&2
        exit 2
        ;;
esac
