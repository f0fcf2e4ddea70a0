"""The peers' own writers and readers (MosaicML Streaming, LitData), run in their own venv.

Streaming pins numpy<2.2, so they cannot share the test environment; tests/run.sh makes the venv
(``.venv-peers``, or ``$SHARDTOOL_PEERS_VENV``) and exports ``SHARDTOOL_PEERS_PYTHON``. A test that
needs it and finds none skips through tests/helpers/skips.require, which fails under CI's strict mode.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess

import numpy as np

from helpers.skips import require

HELPERS = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HELPERS, "peers_tool.py")
CANDIDATES = (
    os.environ.get("SHARDTOOL_PEERS_PYTHON", ""),
    os.path.join(os.path.dirname(os.path.dirname(HELPERS)), ".venv-peers/bin/python"),
    "/work/venv-peers/bin/python",
)


def peers_python() -> str:
    found = next((p for p in CANDIDATES if p and os.access(p, os.X_OK)), None)
    require(found is not None, "the peers' venv (mosaicml-streaming, litdata) is absent: bash tests/run.sh makes it")
    return found


def run_peer(*args: str, timeout: float = 300) -> None:
    res = subprocess.run(
        [peers_python(), TOOL, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert res.returncode == 0, res.stderr[-3000:]


def untag(v):
    if isinstance(v, dict) and set(v) == {"b64"}:
        return base64.b64decode(v["b64"])
    if isinstance(v, dict) and set(v) == {"nd", "v"}:
        return np.array(v["v"], dtype=np.dtype(v["nd"]))
    if isinstance(v, dict) and set(v) == {"np", "v"}:
        return np.dtype(v["np"]).type(v["v"])
    return v


def peer_rows(kind: str, root: str, out: str) -> list[dict]:
    """Every row of ``root`` as the peer's own reader returns it, in order."""
    run_peer(f"{kind}-read", root, out)
    with open(out) as f:
        return [{k: untag(v) for k, v in json.loads(line).items()} for line in f]
