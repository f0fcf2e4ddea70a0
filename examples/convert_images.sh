#!/usr/bin/env bash
# Pack a directory of image-like files (<key>.bin + <key>.json) into WebDataset tar shards.
#   examples/convert_images.sh [WORKDIR]
set -euo pipefail
WORK=${1:-_work/example-images}
python -m shardtool.benchmarks.corpus images "$WORK/src" --n "${N:-2000}"
shardtool pack "$WORK/src" -o "$WORK/ds" --shard-size 64MiB --workers 2 --overwrite
shardtool verify "$WORK/ds"
shardtool inspect "$WORK/ds"
# The shards are plain WebDataset shards:
python -c "import webdataset as wds, glob; print(sum(1 for _ in wds.WebDataset(sorted(glob.glob('$WORK/ds/shards/*.tar')), shardshuffle=False)), 'samples via webdataset')"
