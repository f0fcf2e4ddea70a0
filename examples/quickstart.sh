#!/usr/bin/env bash
# The main job, end to end, on a small built-in example (no cluster needed):
#   1. generate  a synthetic tokenized corpus (JSONL + Parquet)
#   2. pack      it into indexed WebDataset-compatible tar shards; inspect + verify
#   3. warm      two simulated nodes' local caches with exactly their own shards
#   4. load      train a tiny LM with DDP, 2 nodes x 2 ranks (torchrun, gloo), each node
#                reading only from its cache, with the source renamed away mid-way
#   5. report    what each rank trained on, and loader throughput vs webdataset
#   6. stats     the loader metrics every rank logged during training, merged over both
#                nodes (shardtool stats: wait, tokens/s, cache hits, slowest ranks; a plot)
#
#   bash examples/quickstart.sh            # WORK=_work/quickstart SAMPLES=20000 by default
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
PY=${PYTHON:-python3}
# A bare `torch` requirement pulls a multi-GB CUDA build; install the CPU build first when missing.
if [ -z "${SHARDTOOL_NO_INSTALL:-}" ]; then  # tests that run this script set it
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
  # [plot]: step 6 draws the loader metrics with matplotlib (`shardtool stats --plot`).
  "$PY" -m pip install -q -e ".[plot]"
fi
W=${WORK:-$root/_work/quickstart}
N=${SAMPLES:-20000}
ST=("$PY" -m shardtool)
rm -rf "$W"
mkdir -p "$W"
step() { printf '\n== %s\n' "$*"; }

step "1. generate $N token samples"
"$PY" -m shardtool.benchmarks.corpus tokens "$W/raw" --n "$N"

step "2. pack"
"${ST[@]}" pack "$W/raw/tokens.parquet" -o "$W/dataset" --length tokens --samples-per-shard 1500 --workers 2
"${ST[@]}" inspect "$W/dataset" --no-peek
"${ST[@]}" verify "$W/dataset"

step "3. warm two simulated nodes (each its own local disk)"
for node in 0 1; do
  mkdir -p "$W/node$node"
  "${ST[@]}" warm "$W/dataset" --cache-dir "$W/node$node/cache" --nodes 2 --node-rank "$node" --ranks-per-node 2
done
"${ST[@]}" plan "$W/dataset" --nodes 2 --ranks-per-node 2 --max-tokens 8192

step "4. load: DDP training, 2 nodes x 2 ranks, from the node caches only"
mv "$W/dataset" "$W/dataset.offline"   # the parallel filesystem is gone: caches must serve everything
port=$(( 29500 + RANDOM % 1000 ))
pids=()
for node in 0 1; do
  GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --nnodes 2 --node_rank "$node" \
    --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$port" examples/train_ddp.py \
    --data "$W/dataset" --cache-dir "$W/node$node/cache" --max-tokens 8192 --seq-len 64 --num-workers 1 \
    --log-dir "$W/train-logs" --ckpt-dir "$W/ckpt" --ckpt-every 20 --collective-timeout 120 \
    --metrics-every 10 --metrics-dir "$W/node$node/metrics" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
mv "$W/dataset.offline" "$W/dataset"

step "5. report"
"$PY" examples/report.py "$W/dataset" "$W/train-logs" --nodes 2 --ranks-per-node 2 --max-tokens 8192
# A 5 ms simulated step: a GPU step of a small model; `--step-ms` omitted measures a CPU one.
"${ST[@]}" bench "$W/dataset" --ranks 2 --workers 0,2 --max-tokens 8192 --max-batches "${BENCH_BATCHES:-100}" \
  --step-ms 5 --compare webdataset --json "$W/bench.json"
step "6. loader metrics of the training run, every rank of both nodes (node-local files)"
"${ST[@]}" stats "$W/node0/metrics" "$W/node1/metrics" --plot "$W/loader-stats.png"
echo
echo "done: dataset, caches, logs, bench.json and loader-stats.png are in $W"
