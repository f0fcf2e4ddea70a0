#!/bin/bash
# SLURM prolog: warm this node's shards of the job's dataset into node-local storage.
#
# Needs PrologFlags=Alloc (the prolog runs at allocation, on every node of the job). A prolog runs
# as root with NO PATH and a minimal environment; this script relies only on:
#   SLURM_JOB_ID, SLURMD_NODENAME           always set for a prolog
#   SLURM_JOB_NODELIST (Slurm 22.05 names it SLURM_NODELIST in a prolog), SLURM_JOB_NUM_NODES
#                                           set with PrologFlags=Alloc (SLURM_NODEID is NOT set)
# and on the config file $SHARDTOOL_WARM_CONF (default /etc/slurm/shardtool-warm.conf), which gives
# absolute paths: SHARDTOOL_PYTHON, SCONTROL, DATASET_URL, CACHE_ROOT, and optionally the data
# layout of model-parallel jobs: MESH, DP_DIM, DP_SIZE, RANKS_PER_NODE (see warm.conf.example).
#
# Node rank = position of $SLURMD_NODENAME in `scontrol show hostnames $SLURM_JOB_NODELIST`, the
# same order SLURM gives SLURM_NODEID to the job's tasks.
#
# Exit status (SLURM drains the node on non-zero): 0 ok, or a remote outage (logged; the loader
# fetches on demand); 3 local fault (cache disk missing, read-only, full or too small); 2 config error
# (including a DATASET_URL with no dataset at it).
set -u
CONF="${SHARDTOOL_WARM_CONF:-/etc/slurm/shardtool-warm.conf}"
log() { echo "shardtool-prolog[job ${SLURM_JOB_ID:-?} on ${SLURMD_NODENAME:-?}]: $*" >&2; }

if [ ! -r "$CONF" ]; then log "no config $CONF; nothing to warm"; exit 0; fi
# shellcheck disable=SC1090
. "$CONF"
: "${SCONTROL:=/usr/bin/scontrol}"
for v in SHARDTOOL_PYTHON DATASET_URL CACHE_ROOT; do
  if [ -z "${!v:-}" ]; then log "config $CONF does not set $v"; exit 2; fi
done
SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
if [ -z "${SLURMD_NODENAME:-}" ] || [ -z "${SLURM_JOB_NODELIST:-}" ]; then
  log "SLURMD_NODENAME/SLURM_JOB_NODELIST not set (PrologFlags=Alloc needed)"; exit 2
fi

NODES=$("$SCONTROL" show hostnames "$SLURM_JOB_NODELIST") || { log "scontrol failed"; exit 2; }
RANK=-1; N=0
while IFS= read -r host; do
  [ -z "$host" ] && continue
  [ "$host" = "$SLURMD_NODENAME" ] && RANK=$N
  N=$((N + 1))
done <<< "$NODES"
if [ "$RANK" -lt 0 ]; then log "$SLURMD_NODENAME is not in $SLURM_JOB_NODELIST"; exit 2; fi
if [ -n "${SLURM_JOB_NUM_NODES:-}" ] && [ "$SLURM_JOB_NUM_NODES" != "$N" ]; then
  log "SLURM_JOB_NUM_NODES=$SLURM_JOB_NUM_NODES but the node list has $N hosts"; exit 2
fi

CACHE_DIR="$CACHE_ROOT/$SLURMD_NODENAME"   # emulated nodes share one filesystem: key on the node name
ARGS=(-m shardtool warm "$DATASET_URL" --cache-dir "$CACHE_DIR" --nodes "$N" --node-rank "$RANK" --quiet
      --report "$CACHE_DIR.warm-$SLURM_JOB_ID.json")
[ -n "${JOBS:-}" ] && ARGS+=(--jobs "$JOBS")
[ -n "${MAX_BYTES:-}" ] && ARGS+=(--max-bytes "$MAX_BYTES")
[ -n "${MIN_FREE:-}" ] && ARGS+=(--min-free "$MIN_FREE")
[ -n "${TIMEOUT:-}" ] && ARGS+=(--timeout "$TIMEOUT")
# The data layout, as ShardedLoader gets it (empty: pure data parallelism).
[ -n "${MESH:-}" ] && ARGS+=(--mesh "$MESH")
[ -n "${DP_DIM:-}" ] && ARGS+=(--dp-dim "$DP_DIM")
[ -n "${DP_SIZE:-}" ] && ARGS+=(--dp-size "$DP_SIZE")
[ -n "${RANKS_PER_NODE:-}" ] && ARGS+=(--ranks-per-node "$RANKS_PER_NODE")
# shellcheck disable=SC2206
[ -n "${EXTRA_ARGS:-}" ] && ARGS+=($EXTRA_ARGS)

log "warming $DATASET_URL into $CACHE_DIR as node $RANK of $N"
"$SHARDTOOL_PYTHON" "${ARGS[@]}"
rc=$?
log "warm exited $rc"
exit $rc
