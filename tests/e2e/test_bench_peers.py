"""The peer benchmarks, each on a tiny corpus with every peer (CI step `peers`, in their own venv).

MosaicML Streaming, LitData and Megatron-Energon cannot share the main environment
(mosaicml-streaming pins numpy<2.2 and transformers<5), so this builds their venv the way a
user would (`bash benchmarks/setup_peers.sh`, from the package index) and runs there:
`benchmarks.loader_throughput` (every side's read verified: count, unique keys, payload crc32),
`benchmarks.peer_packing`, `benchmarks.peer_resume`, `benchmarks.peer_pack` and `shardtool bench`'s
data-wait measurement, checking each prints every peer's column. Numbers on a tiny corpus are not
results; that they come out is.
Minutes of installs and runs, so it is marked ``peers``: left out of the default run, run by
`.ci/run` as its own step. ``SHARDTOOL_PEERS_VENV=DIR`` reuses a venv setup_peers.sh built.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.skips import require

REPO = Path(__file__).resolve().parents[2]
PEERS = ("streaming", "litdata", "energon")


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> str:
    """``cmd`` in the checkout; its whole process group killed past ``timeout``; its output."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the benchmark's measurement processes and their workers too
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout:g} s\n{out[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


@pytest.mark.peers
@pytest.mark.timeout(1500)
def test_every_peer_benchmark_runs_with_every_peer(tmp_path):
    venv = os.environ.get("SHARDTOOL_PEERS_VENV")
    if not venv:
        venv = str(tmp_path / "venv")
        out = _run(["bash", "benchmarks/setup_peers.sh", venv], 900, {**os.environ, "PYTHON": sys.executable})
        for name in ("mosaicml-streaming", "litdata", "megatron-energon"):
            assert f"peer: {name}" in out, out[-3000:]
    py = os.path.join(venv, "bin", "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")

    out = _run(
        [
            py,
            "-m",
            "benchmarks.loader_throughput",
            "--tiny",
            "--repeats",
            "1",
            "--max-seconds",
            "1",
            "--dir",
            str(tmp_path / "read"),
        ],
        600,
        env,
    )
    assert "verified: every side read each corpus whole" in out, out[-3000:]
    for peer in PEERS:
        assert f"peer {peer}: " in out and "not measured" not in out, out[-3000:]
        for ratio in (
            f"tokens samples/s ours/{peer} w0",
            f"tokens samples/s ours/{peer} w2",
            f"images MB/s ours/{peer} w2",
        ):
            assert ratio in out, out[-3000:]

    out = _run(
        [
            py,
            "-m",
            "benchmarks.peer_packing",
            "--tiny",
            "--repeats",
            "1",
            "--max-seconds",
            "1",
            "--seq-lens",
            "2048",
            "--workers",
            "0",
            "--dir",
            str(tmp_path / "rows"),
        ],
        300,
        env,
    )
    for ours in (
        "best-fit (full outputs)",
        "best-fit (lean, like for like",
        "concat (full outputs)",
        "concat (lean",
        "stream (lean, like for like: ids int32 + cu_seqlens, Arrow shards, eos stored)",
    ):
        assert f"ours {ours}" in out, out[-3000:]
    assert "/ LitData TokensLoader" in out and "BinPackCollator (reimpl." in out, out[-3000:]

    out = _run(
        [py, "-m", "benchmarks.peer_resume", "--tiny", "--repeats", "1", "--dir", str(tmp_path / "resume")], 600, env
    )
    lines = [ln for ln in out.splitlines() if not ln.startswith(" ")]
    for side in ("ours",) + PEERS:
        assert any(ln.startswith(side) and "epoch" in ln for ln in lines), out[-3000:]
    assert "mid-epoch resume: exact" in out and "4 ranks: batches [4, 4, 4, 4] (equal), 0 repeated, 0 skipped" in out

    out = _run(
        [
            py,
            "-m",
            "benchmarks.peer_pack",
            "--tiny",
            "--repeats",
            "1",
            "--sides",
            "mds:1,litdata:2,energon:2",  # the peers' 1-process sides: the same code, timed by the lead's runs
            "--dir",
            str(tmp_path / "pack"),
        ],
        600,
        env,
    )
    for side in ("mds:1", "litdata:2", "energon:2"):
        assert side in out, out[-3000:]
    assert out.count("/ best peer") == 2, out[-3000:]

    # An ImageFolder tree (real PNG icons) through every peer's own writer and loader, verified
    # (the timed rounds take minutes of process starts: not here).
    require(os.path.isdir("/usr/share/icons/Adwaita"), "no Adwaita icons (tests/run.sh installs adwaita-icon-theme)")
    out = _run(
        [
            py,
            "-m",
            "benchmarks.image_epoch",
            "--max-images",
            "100",
            "--verify-only",
            "--workers",
            "0",
            "--dir",
            str(tmp_path / "img"),
        ],
        600,
        env,
    )
    for side in ("ours",) + PEERS:
        assert f"'{side}/w0': 100" in out, out[-3000:]

    # The data-wait fraction at a simulated step (`shardtool bench`), every peer on its own copy.
    report = tmp_path / "bench.json"
    out = _run(
        [
            py,
            "-m",
            "shardtool",
            "bench",
            "--generate",
            "4000",
            "--ranks",
            "2",
            "--workers",
            "0",
            "--max-tokens",
            "65536",
            "--step-ms",
            "5",
            "--max-batches",
            "4",
            "--compare",
            ",".join(PEERS),  # webdataset's side: tests/cli/test_bench_cli.py
            "--json",
            str(report),
        ],
        600,
        env,
    )
    rows = {r["reader"]: r for r in json.loads(report.read_text())["rows"]}
    assert set(rows) == {"shardtool", *PEERS}, out[-3000:]
    for name, r in rows.items():
        assert not r["errors"] and r["batches_per_rank"] == [4, 4] and 0 <= r["wait_fraction"] <= 1, (name, r)
