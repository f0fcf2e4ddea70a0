#!/usr/bin/env bash
# Install everything the tests need (idempotent; a fresh machine has nothing) and run the suite.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -k loader`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
PY=${PYTHON:-python3}
peers=${SHARDTOOL_PEERS_VENV:-$root/.venv-peers}
# SHARDTOOL_NO_INSTALL: run the tests as the environment is (tests/test_run_sh.py runs this script so).
if [ -z "${SHARDTOOL_NO_INSTALL:-}" ]; then
  # A bare `torch` requirement pulls a multi-GB CUDA build; pin the CPU build first when torch is missing.
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
  # Keep what the machine's own tools pin exactly (awscli's botocore==): pip then picks versions of
  # ours that fit, instead of upgrading it and printing a resolver ERROR about awscli
  # (tests/helpers/keep_pins.py); unconstrained if no such versions exist.
  pins=$(mktemp)
  trap 'rm -f "$pins" "$pins.err"' EXIT
  "$PY" tests/helpers/keep_pins.py > "$pins"
  if ! "$PY" -m pip install -q -c "$pins" -e ".[test]" 2>"$pins.err"; then
    echo "pip found no versions that keep $(paste -sd' ' "$pins"); installing without them" >&2
    "$PY" -m pip install -q -e ".[test]"
  else
    cat "$pins.err" >&2
  fi
  # tests/integrations/test_torchtitan.py: torchtitan's CheckpointManager and dataloader. Not in the test extra: its own
  # requirements would downgrade datasets and fsspec and pull wandb and tensorboard; these are what
  # torchtitan.components.{checkpoint,dataloader} import (torchtitan needs Python >= 3.11).
  "$PY" -m pip install -q --no-deps torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 \
    spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 \
    || echo "could not install torchtitan: tests/integrations/test_torchtitan.py says so" >&2
  # Real PNGs in class folders for the ImageFolder tests (tests/helpers/realdata.py): Debian's Adwaita icons.
  [ -d /usr/share/icons/Adwaita/48x48 ] || { apt-get update -qq && apt-get install -y -qq adwaita-icon-theme; } \
    >/dev/null 2>&1 || echo "could not install adwaita-icon-theme: the ImageFolder tests say so" >&2
  # The peers (MosaicML Streaming, LitData, Megatron-Energon): their own writers and readers for the
  # conversion tests (tests/helpers/peers.py) and the peer benchmarks' smoke test (tests/e2e/test_bench_peers.py).
  # Streaming pins numpy<2.2, so they get a venv of their own (benchmarks/setup_peers.sh, built once and
  # reused) and never touch this environment's numpy.
  if ! PYTHONPATH=$root "$peers/bin/python" -c "from benchmarks import peers as p; assert not p.missing()" 2>/dev/null; then
    PYTHON="$PY" bash benchmarks/setup_peers.sh "$peers" \
      || echo "could not make the peers' venv: tests/pack/test_pack_{mds,litdata}.py and the peers step say so" >&2
  fi
fi
export SHARDTOOL_PEERS_VENV="$peers"
export SHARDTOOL_PEERS_PYTHON="$peers/bin/python"
# -q unless the caller chose a verbosity: a second -q (`run.sh -q`) would hide the closing "N passed".
quiet=(-q)
for arg in "$@"; do
  case "$arg" in -q | -qq | --quiet | -v | -vv | --verbose) quiet=() ;; esac
done
set +e
"$PY" -m pytest "${quiet[@]}" -p no:cacheprovider "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: a run that tested nothing must not pass.
if [ "$rc" -eq 5 ]; then echo "no tests ran" >&2; exit 1; fi
exit "$rc"
