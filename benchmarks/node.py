"""Per-node loader benchmark: G loader ranks as real processes, a simulated training step.

Each rank process iterates its loader the way a training loop does: wait for the next batch,
then "compute" for ``step_ms``. The share of wall time spent waiting is the data-wait fraction:
the number that says whether GPUs would wait on I/O. Peers (webdataset, …) read the same data in
the same run through their recommended set-up, so the ratios are measured, not quoted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from shardtool.benchmarks.node_report import (  # noqa: F401 - re-exported: cmd_bench reads them here
    MEASURED,
    RankResult,
    format_table,
    median_row,
    merge_loader_metrics,
    plot,
    summarize,
    write_json,
)
from shardtool.cli._plan import peak_rss_mb

READERS: dict[str, Callable] = {}


def reader(name: str):
    def deco(fn):
        READERS[name] = fn
        return fn

    return deco


@dataclass
class BenchConfig:
    url: str
    ranks: int = 2
    num_workers: int = 2
    batch_size: int | None = None
    max_tokens: int | None = 16384
    step_ms: float = 0.0
    max_batches: int | None = None
    seed: int = 0
    webdataset_urls: list[str] = field(default_factory=list)
    length_field: str | None = None
    length_ext: str | None = None  # the length field's tar member extension, e.g. "tokens.npy"
    peer_roots: dict[str, str] = field(default_factory=dict)  # peer -> its own copy (benchmarks.peers)
    dist_port: int | None = None  # MASTER_PORT for a peer whose ranks join torch.distributed (Streaming)


def _batch_stats(batch: dict) -> tuple[int, int, int, int]:
    keys = batch["__key__"]
    samples = len(keys)
    tokens = padded = nbytes = 0
    if "lengths" in batch:
        lengths = batch["lengths"]
        tokens = int(lengths.sum())
        padded = int(len(lengths) * int(lengths.max())) if len(lengths) else 0
    for k, v in batch.items():
        if hasattr(v, "element_size") and hasattr(v, "nelement"):
            nbytes += int(v.element_size() * v.nelement())
        elif isinstance(v, (bytes, bytearray)):
            nbytes += len(v)
        elif isinstance(v, list) and v and isinstance(v[0], (bytes, bytearray)):
            nbytes += sum(len(x) for x in v)
    return samples, tokens, padded, nbytes


def consume(it, result: RankResult, cfg: BenchConfig, t_start: float) -> None:
    """The simulated training loop; fills ``result`` in place. A reader whose iterator has
    ``metrics()`` (shardtool) reports its own counters: the call after the first batch opens
    the steady-state window, the last one closes it, and those numbers replace ours."""
    step_s = cfg.step_ms / 1000.0
    metrics = getattr(it, "metrics", None)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        if result.batches == 0:
            result.first_batch_s = t1 - t_start
            if metrics is not None:
                metrics()
        else:
            result.wait_s += t1 - t0
        s, tok, pad, nb = _batch_stats(batch)
        result.batches += 1
        result.samples += s
        result.tokens += tok
        result.padded_tokens += pad
        result.bytes += nb
        if step_s:
            # Sleep, not spin: a GPU step leaves the host CPU free for the loader's workers.
            time.sleep(step_s)
        if cfg.max_batches and result.batches >= cfg.max_batches:
            break
    result.wall_s = time.perf_counter() - t_start
    if metrics is not None and result.batches:
        result.use_loader_metrics(metrics())


class _LoaderIter:
    """A ShardedLoader pass that also answers ``metrics()``."""

    def __init__(self, loader):
        self.loader, self.it = loader, iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)

    def metrics(self) -> dict:
        return self.loader.metrics()


@reader("shardtool")
def _shardtool_iter(cfg: BenchConfig, rank: int):
    from shardtool.loader import ShardedLoader

    # No metric lines: the bench reads metrics() itself and writes them into its own JSON.
    ld = ShardedLoader(
        cfg.url,
        batch_size=cfg.batch_size,
        max_tokens=cfg.max_tokens,
        seed=cfg.seed,
        rank=rank,
        world_size=cfg.ranks,
        ranks_per_node=cfg.ranks,
        num_workers=cfg.num_workers,
        metrics_every=0,
    )
    return _LoaderIter(ld)


@reader("webdataset")
def _webdataset_iter(cfg: BenchConfig, rank: int):
    """webdataset's recommended set-up: node/worker splitting, shuffle buffer, decode, batch, WebLoader."""
    import torch
    import webdataset as wds

    field_name = cfg.length_field
    ext = cfg.length_ext or field_name
    # webdataset has no token budget: a fixed batch size holding the same tokens on average.
    bs = cfg.batch_size or max(1, (cfg.max_tokens or 16384) // 512)

    def split_by_rank(src):
        for i, s in enumerate(src):
            if i % cfg.ranks == rank:
                yield s

    def collate(samples):
        keys = [s["__key__"] for s in samples]
        arrays = [s[field_name] for s in samples]
        lengths = torch.tensor([len(a) for a in arrays], dtype=torch.long)
        out = torch.zeros((len(arrays), int(lengths.max()) if len(arrays) else 0), dtype=torch.long)
        for j, a in enumerate(arrays):
            out[j, : len(a)] = torch.from_numpy(np.asarray(a, dtype=np.int64))
        return {"__key__": keys, field_name: out, "lengths": lengths}

    ds = (
        wds.WebDataset(
            cfg.webdataset_urls,
            shardshuffle=len(cfg.webdataset_urls),
            nodesplitter=split_by_rank,
            seed=cfg.seed,
            empty_check=False,
        )
        .shuffle(1000)
        .decode()
        .map(lambda s: {"__key__": s["__key__"], field_name: s[ext]})
        .batched(bs, collation_fn=collate, partial=True)
    )
    loader = wds.WebLoader(ds, batch_size=None, num_workers=cfg.num_workers)
    return iter(loader)


def _peer_reader(name: str):
    """A peer of ``benchmarks.peers`` (Streaming, LitData, Energon) on its own copy of the shards,
    written by its own writer, read as its docs recommend, shuffled: the same batches as the
    webdataset side (a fixed batch size holding the same tokens on average, padded tokens and
    lengths); ranks as its docs set them (``peers.<name>.loader``)."""

    def make(cfg: BenchConfig, rank: int):
        from shardtool.benchmarks import peers

        if cfg.dist_port is not None:  # Streaming's ranks meet through torch.distributed's env
            import os

            os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cfg.dist_port)})
        bs = cfg.batch_size or max(1, (cfg.max_tokens or 16384) // 512)
        mod = peers.available()[name]
        return iter(
            mod.loader(cfg.peer_roots[name], "tokens", cfg.num_workers, bs, cfg.seed, rank=rank, world_size=cfg.ranks)
        )

    return make


PEERS = ("streaming", "litdata", "energon")
for _name in PEERS:
    reader(_name)(_peer_reader(_name))


def rank_result(rank: int, name: str, cfg: BenchConfig) -> dict:
    """One rank of reader ``name``, in its own (spawned) process: its `RankResult` as a dict."""
    # Every side's imports before the clock starts: a rank's start-up is not what we measure.
    import torch  # noqa: F401
    import webdataset  # noqa: F401

    import shardtool.loader.sharded  # noqa: F401

    if name in PEERS:
        from shardtool.benchmarks import peers

        peers.available()[name]  # the peer's package imported, like the others

    result = RankResult(name, rank, cfg.num_workers)
    try:
        t_start = time.perf_counter()
        it = READERS[name](cfg, rank)
        consume(it, result, cfg, t_start)
    except Exception as e:  # reported to the parent, which prints it
        result.error = f"{type(e).__name__}: {e}"
    # This rank's own peak (VmHWM): ru_maxrss would be at least the bench process's peak when it
    # spawned the rank (Linux carries it across exec), the same figure for every reader.
    result.peak_rss_mb = peak_rss_mb()
    return asdict(result)


def run_node(name: str, cfg: BenchConfig, timeout: float = 600.0) -> list[RankResult]:
    """Run ``cfg.ranks`` rank processes of reader ``name`` at once, as torchrun would on one node.

    A rank that fails or hangs past ``timeout`` seconds (then killed, with its workers) gets a
    result with ``error`` naming the reader and the rank."""
    from .ranks import run_ranks

    done, failed = run_ranks(rank_result, cfg.ranks, (name, cfg), timeout=timeout)
    out = []
    for r in range(cfg.ranks):
        if r in done:
            out.append(RankResult(**done[r]))
        else:
            out.append(RankResult(name, r, cfg.num_workers, error=f"{name} rank {r}/{cfg.ranks}: {failed[r]}"))
    return out


def measure_step_ms(batch_tokens: int = 4096, seq_len: int = 128, repeats: int = 3) -> float:
    """Median forward+backward time of a tiny 2-layer transformer LM step on this machine."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    vocab, dim = 1024, 64
    model = nn.Sequential(
        nn.Embedding(vocab, dim),
        nn.TransformerEncoder(
            nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
        ),
        nn.Linear(dim, vocab),
    )
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, vocab, (max(1, batch_tokens // seq_len), seq_len))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        loss = model(x).float().logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]) * 1000)


# Seconds of simulated steps one run (one reader at one num_workers) takes by default: the
# measured CPU step is hundreds of ms on a small machine, so a whole epoch per run took minutes.
DEFAULT_RUN_S = 20.0
# Spawning the rank processes (torch and webdataset imports) and planning, per run, on a 2-core machine.
RUN_START_S = 8.0


def default_max_batches(step_ms: float, run_s: float = DEFAULT_RUN_S) -> int | None:
    """Batches per rank that fill about ``run_s`` seconds of ``step_ms`` steps (at least 20, so the
    steady-state window has enough batches); None with no step: the loader alone is fast enough."""
    if step_ms <= 0:
        return None
    return max(20, int(round(run_s * 1000.0 / step_ms)))


def batches_per_rank_estimate(ds, ranks: int, batch_size: int | None, max_tokens: int | None) -> int:
    """About how many batches one epoch gives a rank, from the manifest alone (no plan)."""
    summary = (ds.manifest.length or {}).get("summary") or {}
    if batch_size is None and max_tokens and summary.get("total"):
        batches = summary["total"] / max_tokens
    else:
        batches = len(ds) / (batch_size or 1)
    return max(1, int(batches // max(1, ranks)))


def estimate_run_s(batches: int, step_ms: float) -> float:
    """Wall time of one run: start-up, then ``batches`` steps (the loader keeps up, or the step hides it)."""
    return RUN_START_S + batches * step_ms / 1000.0


def generate_token_dataset(
    out: str, n: int = 20000, *, seed: int = 0, samples_per_shard: int = 2000, shard_format: str = "tar"
) -> str:
    """A packed synthetic token corpus (the lognormal corpus of `shardtool.plan.synthetic`)."""
    from shardtool.pack.synthetic import write_synthetic

    return write_synthetic(out, n, samples_per_shard=samples_per_shard, seed=seed, fmt=shard_format).root
