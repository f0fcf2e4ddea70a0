#!/bin/bash
# SLURM prolog: stage into this node's shared cache the data the JOB asks for. One prolog, every job.
#
# A job names its data in its comment (Slurm gives a prolog SLURM_JOB_COMMENT; `scontrol show job`
# shows it too):
#   sbatch --comment 'shardtool:/lustre/me/web-v3' train.sbatch             # a dataset (or s3://..., gs://...)
#   sbatch --comment 'shardtool:mix.json' train.sbatch                      # a mixture file (job's dir)
#   sbatch --comment 'shardtool:{"url": "s3://b/ds", "mesh": "pp=2,dp=4,tp=2", "ranks_per_node": 8}' ...
# (JSON keys: url; mesh, dp_dim, dp_size, ranks_per_node as the job gives ShardedLoader; best_effort).
# A job that asks for nothing gets nothing staged. See `shardtool prolog --help`.
#
# Needs PrologFlags=Alloc (the prolog runs at allocation, on every node of the job). A prolog runs
# as root with NO PATH and a minimal environment (SLURM_JOB_ID, SLURMD_NODENAME, SLURM_NODELIST,
# SLURM_JOB_NUM_NODES, SLURM_JOB_COMMENT, SLURM_JOB_WORK_DIR). The cluster config
# $SHARDTOOL_WARM_CONF (default /etc/slurm/shardtool-warm.conf) holds only the admin's settings:
# SHARDTOOL_PYTHON, CACHE_ROOT, SCONTROL, SQUEUE, budgets and timeouts (see warm.conf.example).
#
# Exit status: SLURM drains a node on a non-zero prolog exit, so only a fault of THIS node is one:
#   3  cache disk missing, read-only or full, or the budget below this node's share of the job's data
#   0  everything else: staged; nothing asked; the job's own mistake (no dataset at its URL, a bad
#      layout or request: written to CACHE_ROOT/<node>/jobs/<job>.json, where the job's ShardedLoader
#      finds it and fails with it); a storage outage; the source gone while this node's cache holds a
#      complete copy (the job reads it, with a warning); a broken prolog set-up (logged in slurmd's log).
set -u
CONF="${SHARDTOOL_WARM_CONF:-/etc/slurm/shardtool-warm.conf}"
log() { echo "shardtool-prolog[job ${SLURM_JOB_ID:-?} on ${SLURMD_NODENAME:-?}]: $*" >&2; }

if [ ! -r "$CONF" ]; then log "no config $CONF; nothing staged"; exit 0; fi
# shellcheck disable=SC1090
. "$CONF"
for v in SHARDTOOL_PYTHON CACHE_ROOT; do
  if [ -z "${!v:-}" ]; then log "config $CONF does not set $v; nothing staged"; exit 0; fi
done
ARGS=(-m shardtool prolog --cache-root "$CACHE_ROOT" --scontrol "${SCONTROL:-/usr/bin/scontrol}"
      --squeue "${SQUEUE:-/usr/bin/squeue}")
[ -n "${JOBS:-}" ] && ARGS+=(--jobs "$JOBS")
[ -n "${MAX_BYTES:-}" ] && ARGS+=(--max-bytes "$MAX_BYTES")
[ -n "${MIN_FREE:-}" ] && ARGS+=(--min-free "$MIN_FREE")
[ -n "${TIMEOUT:-}" ] && ARGS+=(--timeout "$TIMEOUT")
# shellcheck disable=SC2206
[ -n "${EXTRA_ARGS:-}" ] && ARGS+=($EXTRA_ARGS)

"$SHARDTOOL_PYTHON" "${ARGS[@]}"
rc=$?
if [ "$rc" = 3 ]; then log "local fault (exit 3): the node drains"; exit 3; fi
# Anything else non-zero is no fault of the node (a missing python, a bug): never drain for it.
[ "$rc" = 0 ] || log "shardtool prolog exited $rc (not a node fault; nothing or not everything staged)"
exit 0
