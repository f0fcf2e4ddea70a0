#!/usr/bin/env bash
# Pack a tokenized JSONL corpus into tar shards with token-count lengths, check it, look at it.
#   examples/convert_jsonl.sh [WORKDIR]
set -euo pipefail
WORK=${1:-_work/example-jsonl}
python -m shardtool.benchmarks.corpus tokens "$WORK/src" --n "${N:-20000}"
shardtool pack "$WORK/src/tokens.jsonl" -o "$WORK/ds" --length tokens --shard-size 64MiB --workers 2 --overwrite
shardtool verify "$WORK/ds"
shardtool inspect "$WORK/ds"
# Job-array style (what a SLURM array does, one task per line), then one manifest:
for i in 0 1 2; do
  shardtool pack "$WORK/src/tokens.parquet" -o "$WORK/ds-array" --length tokens --num-tasks 3 --task-index $i -q
done
shardtool merge "$WORK/ds-array"
