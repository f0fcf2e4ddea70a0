#!/bin/bash
# Optional SLURM epilog: forget the job's staging record on this node as soon as the job ends, so
# the next prolog's budget may evict what only it asked for. Without it, the next prolog on the
# node removes the records of jobs `squeue` no longer lists (see examples/slurm/prolog.sh).
set -u
CONF="${SHARDTOOL_WARM_CONF:-/etc/slurm/shardtool-warm.conf}"
[ -r "$CONF" ] || exit 0
# shellcheck disable=SC1090
. "$CONF"
case "${SLURM_JOB_ID:-}" in ''|*[!0-9_]*) exit 0 ;; esac
[ -n "${CACHE_ROOT:-}" ] && [ -n "${SLURMD_NODENAME:-}" ] && \
  rm -f "$CACHE_ROOT/$SLURMD_NODENAME/jobs/$SLURM_JOB_ID.json" "$CACHE_ROOT/$SLURMD_NODENAME.warm-$SLURM_JOB_ID.json"
exit 0
