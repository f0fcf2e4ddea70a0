#!/usr/bin/env bash
# Local single-machine SLURM cluster for shardtool's tests.
#
#   tests/slurm/cluster.sh up [N]    # install slurm-wlm if missing, start munged + slurmctld + N slurmd (node1..nodeN)
#   tests/slurm/cluster.sh status    # daemons, sinfo, squeue
#   tests/slurm/cluster.sh down      # cancel jobs, stop every daemon we started (by verified pidfile), rm the dir
#
# All state lives in $SLURM_TEST_DIR (default: a fresh mktemp dir under /tmp; `up` prints it and records it in
# /tmp/shardtool-slurm-test.last so a later `down`/`status` without the variable finds it). /etc/slurm is never
# written. Clients need SLURM_CONF=$SLURM_TEST_DIR/slurm.conf (see $SLURM_TEST_DIR/cluster.env).
#
# Environment knobs (all optional):
#   SLURM_TEST_DIR             state dir (reused if given; leftovers in it are stopped/cleared first)
#   SLURM_TEST_NODES           node count if not given as argument (default 2)
#   SLURM_TEST_PROLOG          prolog script (absolute path, executable). Default: generated no-op that logs.
#                              It runs as root with NO PATH and only SLURM_JOB_ID, SLURMD_NODENAME, SLURM_CONF, ...;
#                              a non-zero exit DRAINS the node. Read $(dirname $SLURM_CONF)/cluster.env for config.
#   SLURM_TEST_CTLD_PORT       slurmctld port (default: first free block from 26817 upwards)
#   SLURM_TEST_SLURMD_PORT_BASE  node i listens on BASE+i (default: right after the ctld port)
#   SLURM_TEST_MIN_JOB_AGE     seconds finished jobs stay visible in scontrol (default 30)
#   SLURM_TEST_UP_TIMEOUT      seconds to wait for all nodes idle (default 60)
#
# Lessons baked in (Debian 12, slurm-wlm 22.05): no systemd -> start daemons by hand; munged must run as the
# munge user and is strict about directory permissions; 22.05 rejects CgroupPlugin=disabled (use autodetect);
# no usable cgroups in containers -> proctrack/linuxproc + task/none; each emulated node needs its own spool dir
# before slurmd starts; several slurmd on one host need `slurmd -N name` + a distinct Port per node.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LAST=/tmp/shardtool-slurm-test.last
SBIN=/usr/sbin
DAEMON_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

log() { echo "[slurm-test $(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

resolve_dir() {  # sets D; $1=create -> make a fresh one if unset
  if [ -n "${SLURM_TEST_DIR:-}" ]; then
    D=$SLURM_TEST_DIR
  elif [ "${1:-}" = create ]; then
    D=$(mktemp -d /tmp/shardtool-slurm.XXXXXX)
  elif [ -s "$LAST" ]; then
    D=$(cat "$LAST")
  else
    die "SLURM_TEST_DIR not set and no $LAST"
  fi
  case "$D" in /*) ;; *) D=$(pwd)/$D ;; esac
  D=${D%/}
  [ "$D" != "" ] && [ "$D" != / ] || die "refusing SLURM_TEST_DIR=/"
  export SLURM_CONF=$D/slurm.conf
}

# ---------------------------------------------------------------- install
install_pkgs() {
  local missing=0 b
  for b in $SBIN/slurmctld $SBIN/slurmd $SBIN/munged /usr/bin/srun /usr/bin/sbatch; do [ -x "$b" ] || missing=1; done
  [ $missing = 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "slurm-wlm missing and not root: cannot apt-get install"
  command -v apt-get >/dev/null || die "slurm-wlm missing and no apt-get"
  log "installing slurm-wlm (apt-get, quiet)"
  export DEBIAN_FRONTEND=noninteractive
  # an install can fail on a stale package index: update and retry once
  if ! apt-get install -y -qq -o Dpkg::Use-Pty=0 slurm-wlm >"$D/log/apt.log" 2>&1; then
    apt-get update -qq >>"$D/log/apt.log" 2>&1 || true
    apt-get install -y -qq -o Dpkg::Use-Pty=0 slurm-wlm >>"$D/log/apt.log" 2>&1 \
      || { tail -20 "$D/log/apt.log" >&2; die "apt-get install slurm-wlm failed"; }
  fi
}

# ---------------------------------------------------------------- processes
# A pidfile is trusted only if the pid is alive AND its cmdline names the expected binary AND mentions our dir
# (guards against a recycled pid from a stale pidfile of an earlier run).
pid_ours() {  # $1=pid $2=binary-name [$3=path that must appear in the cmdline, default $D]
  local p=$1 cmd needle=${3:-$D}
  [ -n "$p" ] && alive "$p" || return 1
  cmd=$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null) || return 1
  case "$cmd" in *"$2"*) ;; *) return 1 ;; esac
  case "$cmd" in *"$needle"*) return 0 ;; *) return 1 ;; esac
}

# alive = exists and not a zombie: in containers without a reaping init, a daemon that exited lingers as a
# zombie (ppid 1) and `kill -0` still succeeds on it.
alive() { local st; st=$(awk '/^State:/{print $2}' /proc/"$1"/status 2>/dev/null) && [ -n "$st" ] && [ "$st" != Z ]; }

stop_pidfile() {  # $1=pidfile $2=binary-name [$3=cmdline needle]
  local f=$1 p
  [ -f "$f" ] || return 0
  p=$(tr -dc 0-9 < "$f" 2>/dev/null || true)
  if pid_ours "$p" "$2" "${3:-$D}"; then
    kill -TERM "$p" 2>/dev/null || true
    for _ in $(seq 100); do alive "$p" || break; sleep 0.1; done
    if alive "$p"; then log "$2 pid $p ignored SIGTERM; SIGKILL"; kill -KILL "$p" 2>/dev/null || true; fi
  fi
  rm -f "$f"
}

# Leftover job processes after the daemons are gone. slurmstepd is double-forked (not a child of slurmd) and has
# an empty environment, but its cwd is our log dir; job tasks inherit the submitter's environment, and the
# harness marks it with SHARDTOOL_SLURM_TEST_DIR=$D. This shell and its ancestors are never touched.
sweep_leftovers() {
  local p q anc=" " cwd
  q=$$; while [ -n "$q" ] && [ "$q" != 0 ]; do anc+="$q "; q=$(awk '/^PPid:/{print $2}' /proc/$q/status 2>/dev/null || true); done
  for p in $(ls /proc | grep -E '^[0-9]+$'); do
    case "$anc" in *" $p "*) continue ;; esac
    cwd=$(readlink /proc/$p/cwd 2>/dev/null || true)
    if [ "$(cat /proc/$p/comm 2>/dev/null)" = slurmstepd ] && [ "${cwd#$D/}" != "$cwd" ]; then
      kill -KILL "$p" 2>/dev/null || true
    elif tr "\0" "\n" 2>/dev/null < /proc/$p/environ | grep -qxF "SHARDTOOL_SLURM_TEST_DIR=$D"; then
      case "$(cat /proc/$p/comm 2>/dev/null)" in munged|slurmd|slurmctld|slurmscriptd) ;; *) kill -KILL "$p" 2>/dev/null || true ;; esac
    fi
  done
}

# ---------------------------------------------------------------- ports
port_busy() { (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null; }

pick_ports() {  # sets CTLD_PORT NODE_PORT_BASE
  local n=$1 base p ok
  if [ -n "${SLURM_TEST_CTLD_PORT:-}" ]; then
    CTLD_PORT=$SLURM_TEST_CTLD_PORT
    NODE_PORT_BASE=${SLURM_TEST_SLURMD_PORT_BASE:-$CTLD_PORT}
    for p in $CTLD_PORT $(seq $((NODE_PORT_BASE + 1)) $((NODE_PORT_BASE + n))); do
      port_busy "$p" && die "port $p already in use (leftover cluster? run: SLURM_TEST_DIR=... $0 down)"
    done
    return 0
  fi
  for base in $(seq 26817 64 40000); do
    ok=1
    for p in $(seq "$base" $((base + n))); do port_busy "$p" && { ok=0; break; }; done
    if [ $ok = 1 ]; then CTLD_PORT=$base; NODE_PORT_BASE=${SLURM_TEST_SLURMD_PORT_BASE:-$base}; return 0; fi
  done
  die "no free port block found"
}

# ---------------------------------------------------------------- munge (private instance, own socket + key)
# Our own munged on its own socket: independent of any munged already running (or half-dead) on the host,
# and `down` can always stop it. slurm is pointed at it with AuthInfo=socket=...
# munged runs as the munge user and insists every directory up to its socket is traversable by it, so its dir
# cannot live inside $D ($D may sit under a 0700 parent such as pytest's tmp_path): it gets /tmp/shardtool-munge.<hash of $D>.
munge_dir() { echo "/tmp/shardtool-munge.$(printf '%s' "$D" | md5sum | cut -c1-12)"; }

start_munge() {
  # socket dir world-executable; key 0400 in a 0700 dir owned by munge.
  local m k
  m=$(munge_dir); k=$m/private
  mkdir -p "$k"
  if [ ! -s "$k/munge.key" ]; then
    if [ -s /etc/munge/munge.key ]; then cp /etc/munge/munge.key "$k/munge.key"
    else dd if=/dev/urandom of="$k/munge.key" bs=1 count=1024 status=none; fi
  fi
  chown -R munge:munge "$m"; chmod 0755 "$m"; chmod 0700 "$k"; chmod 0400 "$k/munge.key"
  rm -f "$m/munge.socket" "$m/munge.socket.lock"
  runuser -u munge -- env -i PATH=$DAEMON_PATH SHARDTOOL_SLURM_TEST_DIR="$D" $SBIN/munged \
    --socket="$m/munge.socket" --key-file="$k/munge.key" --pid-file="$m/munged.pid" \
    --log-file="$m/munged.log" --seed-file="$k/munged.seed" \
    || { tail -5 "$m/munged.log" >&2 2>/dev/null; die "munged failed to start"; }
  for _ in $(seq 50); do munge -S "$m/munge.socket" -n 2>/dev/null | unmunge -S "$m/munge.socket" >/dev/null 2>&1 && return 0; sleep 0.1; done
  tail -5 "$m/munged.log" >&2 2>/dev/null; die "munged not answering on $m/munge.socket"
}

# ---------------------------------------------------------------- config
write_default_prolog() {
  # No PATH in a prolog: only bash builtins here ($(date) would fail). Logs one line per (job, node).
  cat > "$D/prolog-default.sh" <<EOF
#!/bin/bash
printf '%s job=%s node=%s nnodes=%s\n' "\$(printf '%(%s)T' -1)" "\$SLURM_JOB_ID" "\$SLURMD_NODENAME" \
  "\${SLURM_JOB_NUM_NODES:-?}" >> "$D/log/prolog.log"
exit 0
EOF
  chmod 0755 "$D/prolog-default.sh"
}

write_conf() {  # $1=N
  local n=$1 host cpus mem i names=""
  host=$(hostname -s)
  cpus=$(nproc); [ "$cpus" -ge 1 ] || cpus=1
  mem=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 / 2 / n ))
  [ "$mem" -ge 100 ] || mem=100
  local prolog=${SLURM_TEST_PROLOG:-$D/prolog-default.sh}
  case "$prolog" in /*) ;; *) prolog=$(pwd)/$prolog ;; esac
  [ -f "$prolog" ] || die "prolog $prolog does not exist"
  [ -x "$prolog" ] || die "prolog $prolog is not executable (chmod +x; slurmd execs it directly)"
  cat > "$D/slurm.conf" <<EOF
# generated by tests/slurm/cluster.sh -- do not edit; rerun up
ClusterName=shardtooltest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((NODE_PORT_BASE + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$(munge_dir)/munge.socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
Prolog=$prolog
PrologFlags=Alloc
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd.%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=${SLURM_TEST_MIN_JOB_AGE:-30}
EOF
  for i in $(seq 1 "$n"); do
    echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((NODE_PORT_BASE + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN" >> "$D/slurm.conf"
    names+="node$i,"
    mkdir -p "$D/spool/node$i" "$D/nodes/node$i/local"
  done
  echo "PartitionName=debug Nodes=${names%,} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >> "$D/slurm.conf"
  # read from SLURM_CONF's directory; 22.05 slurmd always loads a cgroup plugin and does not know "disabled"
  echo "CgroupPlugin=${SLURM_CGROUP_PLUGIN:-autodetect}" > "$D/cgroup.conf"
  # One sourceable file for prologs, jobs and humans. A prolog gets SLURM_CONF from slurmd, so it can do
  #   . "${SLURM_CONF%/*}/cluster.env"
  cat > "$D/cluster.env" <<EOF
SLURM_TEST_DIR=$D
SLURM_CONF=$D/slurm.conf
SLURM_TEST_NODES=$n
SLURM_TEST_NODE_ROOT=$D/nodes
SLURM_TEST_CTLD_PORT=$CTLD_PORT
SLURM_TEST_SLURMD_PORT_BASE=$NODE_PORT_BASE
SLURM_TEST_PROLOG=$prolog
EOF
}

# ---------------------------------------------------------------- lifecycle
node_states() { timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }

wait_idle() {  # $1=N
  local n=$1 t=${SLURM_TEST_UP_TIMEOUT:-60} deadline states nidle
  deadline=$(( $(date +%s) + t ))
  while :; do
    states=$(node_states || true)
    nidle=$(echo "$states" | awk '$2=="idle"' | wc -l)
    [ "$nidle" -eq "$n" ] && return 0
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "nodes not all idle after ${t}s; sinfo says:"; echo "$states" >&2
      for f in "$D"/log/slurmctld.log "$D"/log/slurmd.*.log "$(munge_dir)"/munged.log; do
        [ -f "$f" ] && { echo "----- tail $f" >&2; tail -15 "$f" >&2; }
      done
      return 1
    fi
    sleep 0.2
  done
}

stop_all() {  # stop whatever of ours runs from $D; safe on a half-started or already-stopped dir
  local f
  if [ -f "$D/slurm.conf" ] && [ -f "$D/run/slurmctld.pid" ]; then
    timeout 5 scancel --quiet --full --signal=KILL --user=root 2>/dev/null || true
    timeout 5 scancel --quiet --user=root 2>/dev/null || true
  fi
  for f in "$D"/run/slurmd.*.pid; do [ -e "$f" ] && stop_pidfile "$f" slurmd; done
  stop_pidfile "$D/run/slurmctld.pid" slurmctld
  sweep_leftovers
  stop_pidfile "$(munge_dir)/munged.pid" munged "$(munge_dir)"
  rm -rf "$(munge_dir)"
}

cmd_up() {
  local n=${1:-${SLURM_TEST_NODES:-2}} t0 i
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "node count must be a positive integer, got '$n'"
  [ "$(id -u)" = 0 ] || die "must run as root (SlurmUser=root, munged via runuser)"
  t0=$(date +%s.%N)
  mkdir -p "$D"
  if [ -f "$D/slurm.conf" ] || [ -d "$D/run" ]; then log "reusing $D: stopping leftovers"; stop_all; fi
  rm -rf "$D/state" "$D/spool" "$D/run" "$D/nodes" "$D/log"
  mkdir -p "$D/state" "$D/spool" "$D/run" "$D/nodes" "$D/log"
  echo "$D" > "$LAST"
  # any failure from here on: stop what was already started, keep the dir (logs) for inspection
  trap 'rc=$?; if [ $rc != 0 ]; then log "up failed; stopping partial cluster, logs kept in $D/log"; stop_all; fi' EXIT
  install_pkgs
  pick_ports "$n"
  write_default_prolog
  write_conf "$n"
  start_munge
  # clean env for daemons: realistic (prolog sees only what slurmd builds) and a marker for sweep_leftovers
  env -i PATH=$DAEMON_PATH SLURM_CONF="$SLURM_CONF" SHARDTOOL_SLURM_TEST_DIR="$D" \
    $SBIN/slurmctld -f "$SLURM_CONF" -c -i || die "slurmctld failed to start (see $D/log/slurmctld.log)"
  for i in $(seq 1 "$n"); do
    env -i PATH=$DAEMON_PATH SLURM_CONF="$SLURM_CONF" SHARDTOOL_SLURM_TEST_DIR="$D" \
      $SBIN/slurmd -f "$SLURM_CONF" -N "node$i" || die "slurmd node$i failed to start (see $D/log/slurmd.node$i.log)"
  done
  wait_idle "$n" || die "cluster did not come up (state left in $D)"
  log "up: $n nodes in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s, ctld port $CTLD_PORT"
  echo "export SLURM_TEST_DIR=$D SLURM_CONF=$SLURM_CONF"
}

cmd_down() {
  [ -d "$D" ] || { log "nothing at $D"; return 0; }
  stop_all
  # only delete what is recognisably ours
  if head -1 "$D/slurm.conf" 2>/dev/null | grep -q 'generated by tests/slurm/cluster.sh' || [ -z "$(ls -A "$D")" ]; then
    rm -rf "$D"
  else
    log "left $D in place (no slurm.conf of ours in it)"
  fi
  [ "$(cat "$LAST" 2>/dev/null)" = "$D" ] && rm -f "$LAST"
  log "down: $D"
}

cmd_status() {
  local f p name b nd rc=0
  echo "SLURM_TEST_DIR=$D"
  for f in "$(munge_dir)"/munged.pid "$D"/run/slurmctld.pid "$D"/run/slurmd.*.pid; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .pid); p=$(cat "$f" 2>/dev/null || true)
    case "$name" in munged) b=munged; nd=$(munge_dir) ;; slurmctld) b=slurmctld; nd=$D ;; *) b=slurmd; nd=$D ;; esac
    if pid_ours "$p" "$b" "$nd"; then echo "  $name: running (pid $p)"; else echo "  $name: NOT running (stale pid $p)"; rc=1; fi
  done
  [ -f "$D/slurm.conf" ] || { echo "  no slurm.conf"; return 1; }
  timeout 10 sinfo -N || rc=1
  timeout 10 squeue || rc=1
  return $rc
}

cmd=${1:-}; shift || true
case "$cmd" in
  up)     resolve_dir create; cmd_up "$@" ;;
  down)   resolve_dir; cmd_down ;;
  status) resolve_dir; cmd_status ;;
  *) echo "usage: $0 up [N] | down | status   (state dir: \$SLURM_TEST_DIR)" >&2; exit 2 ;;
esac
