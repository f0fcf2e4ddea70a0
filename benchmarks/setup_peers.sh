#!/usr/bin/env bash
# Build the venv the peer benchmarks run in, from nothing: MosaicML Streaming, LitData and
# Megatron-Energon (benchmarks/requirements-peers.txt) next to this checkout's own dependencies.
#
#   bash benchmarks/setup_peers.sh [VENV]        # default VENV: .venv-peers in the checkout
#   PYTHONPATH=$PWD VENV/bin/python -m benchmarks.loader_throughput ...
#
# - The venv sees the main environment's packages (PYTHON's: a venv's own, not its base
#   interpreter's, which `--system-site-packages` would give), through a .pth file that adds its
#   site-packages after the venv's own: both sides of every comparison run on the same torch build
#   and shardtool's own dependencies; torch is pinned (a constraint) to the version already
#   installed, so no peer's requirement replaces it.
# - mosaicml-streaming 0.13 pins numpy<2.2 and transformers<5: the venv gets its own numpy
#   (2.1.x) and transformers, shadowing the main environment's for both sides alike.
# - torchvision is removed again after the install: the peers require it, but the only wheels on
#   this index are CUDA builds that a CPU torch cannot load ("operator torchvision::nms does not
#   exist" on `import streaming`). Nothing the benchmarks use needs it: Streaming's MDS path does
#   not, and benchmarks/peers/streaming.py stands an empty module in for `streaming.vision` (its
#   CIFAR/ImageNet classes, the only importer of torchvision) when torchvision does not import.
#   Where a CPU torchvision matching torch is installable, keep it: `KEEP_TORCHVISION=1`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$root/.venv-peers}
PY=${PYTHON:-python3}
"$PY" -m venv "$venv"
sites=$("$PY" -c "import sys; print(repr([p for p in sys.path if p.rstrip('/').endswith(('site-packages', 'dist-packages'))]))")
purelib=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir, not a bare path: the main environment's own .pth files (editable installs) apply too.
# (map, not a comprehension: a .pth line runs in a scope a comprehension cannot see `site` from)
echo "import site; list(map(site.addsitedir, $sites))" > "$purelib/_shardtool_main_env.pth"
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
"$PY" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$cons"
# And what the machine's own tools pin exactly (awscli's botocore==), as tests/run.sh keeps them.
[ ! -f "$root/tests/helpers/keep_pins.py" ] || "$PY" "$root/tests/helpers/keep_pins.py" >> "$cons"
# The venv sees the main environment's packages, so pip's resolver reports each one whose
# requirement a peer's pin shadows here (datasets 5 wants huggingface-hub>=1, which
# transformers<5 rules out) as a red ERROR. Those packages are the main environment's and are not
# used in this venv: their conflicts are printed as notes, every other message as pip gave it.
err=$(mktemp)
trap 'rm -f "$cons" "$err"' EXIT
rc=0
"$venv/bin/python" -m pip install -q -c "$cons" -r "$root/benchmarks/requirements-peers.txt" 2>"$err" || rc=$?
awk '/^ERROR: pip.s dependency resolver does not currently take into account/ {skip=1; next}
     skip && / requires .*, but you have / {print "note (shadowed in the peers venv, not used there): " $0; next}
     {skip=0; print}' "$err" >&2
[ "$rc" -eq 0 ] || exit "$rc"
if [ -z "${KEEP_TORCHVISION:-}" ] && ! "$venv/bin/python" -c "import torchvision" 2>/dev/null; then
  "$venv/bin/python" -m pip uninstall -q -y torchvision
fi
PYTHONPATH=$root "$venv/bin/python" -c "
from benchmarks import peers
got, missing = peers.available(), peers.missing()
for m in got.values(): print('peer:', m.version())
if missing: raise SystemExit(f'peers not importable: {missing}')
"
