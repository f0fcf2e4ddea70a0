"""One measurement of the loader benchmark, in its own process (``loader_throughput --one``).

A side's read of one corpus: ours (ShardedLoader), webdataset in its recommended set-up, or a peer
(`benchmarks.peers`); timed (steady-state rates, first batch, peak RSS) or, with ``--verify``, one
whole epoch checked. Apart from `loader_throughput` (the CLI) and `loader_rounds` (which starts
these processes and pairs their results) so that what one run measures reads on its own.
"""

from __future__ import annotations

import json
import os
import resource
import time

import numpy as np

from shardtool.cli._plan import peak_rss_mb

MAX_TOKENS = 65536
WDS_BATCH = 128  # about the samples per 65,536-token batch of our loader on this corpus
IMAGE_BATCH = 32


# ---------------------------------------------------------------------- one measurement (own process)
def wds_pad(samples):
    import torch

    keys = [s[0] for s in samples]
    arrs = [s[1] for s in samples]
    counts = np.array([len(a) for a in arrs], dtype=np.int64)
    out = np.zeros((len(arrs), int(counts.max())), dtype=np.int64)
    for r, a in enumerate(arrs):
        out[r, : len(a)] = a
    return {"__key__": keys, "tokens": torch.from_numpy(out), "lengths": torch.from_numpy(counts)}


def wds_bytes(samples):
    return {"__key__": [s[0] for s in samples], "jpg": [s[1] for s in samples]}


def run_wds(root: str, kind: str, workers: int, max_s: float) -> dict:
    import webdataset as wds

    urls = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))
    began = time.perf_counter()
    ds = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, seed=0).shuffle(1000)
    if kind == "tokens":
        ds = ds.decode().to_tuple("__key__", "tokens.npy").batched(WDS_BATCH, collation_fn=wds_pad, partial=True)
    else:
        ds = ds.to_tuple("__key__", "jpg").batched(IMAGE_BATCH, collation_fn=wds_bytes, partial=True)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=workers)
    return consume(loader, kind, began, max_s=max_s)


def run_ours(
    root: str,
    kind: str,
    workers: int,
    resume: bool,
    max_s: float,
    metrics: bool = True,
    cache_dir: str | None = None,
    passes: int = 1,
    shuffle_block: str | None = None,
) -> dict:
    from shardtool.loader import ShardedLoader

    began = time.perf_counter()
    size = {"max_tokens": MAX_TOKENS} if kind == "tokens" else {"batch_size": IMAGE_BATCH}
    if shuffle_block:
        size["shuffle_block"] = block_samples(root, shuffle_block)
    ld = ShardedLoader(
        root,
        num_workers=workers,
        pin_memory=False,
        metrics=metrics,
        cache_dir=cache_dir,
        metrics_dir=os.path.join(os.path.dirname(root), "metrics"),
        **size,
    )
    if resume:
        served = int(len(ld) * 0.9)
        ld.load_state_dict(ld.planner.start(0, ld.fingerprint, ld.data_layout).with_served(served).to_dict())
    ends: list[tuple[float, int]] = []
    out = consume(_passes(ld, passes, ends), kind, began, first_only=resume, max_s=max_s)
    out["padding_efficiency"] = ld.padding_efficiency if kind == "tokens" else None
    if not resume:
        out.update(pass_rates(began, ends))
    return out


def block_samples(root: str, spec: str) -> int:
    """``--shuffle-block``: a count of samples, or ``shard`` (the dataset's samples per shard)."""
    if spec != "shard":
        return int(spec)
    import shardtool

    m = shardtool.open_dataset(root).manifest
    return max(1, m.num_samples // max(len(m.shards), 1))


def _passes(ld, n: int, ends: list[tuple[float, int]]):
    """``n`` passes of ``ld`` (epochs 0 .. n - 1), one batch stream; each pass's end (time, samples)
    appended to ``ends``."""
    for epoch in range(n):
        ld.set_epoch(epoch)
        samples = 0
        for batch in ld:
            samples += len(batch["__key__"])
            yield batch
        ends.append((time.perf_counter(), samples))


def pass_rates(began: float, ends: list[tuple[float, int]]) -> dict:
    """samples/s of the first pass, from the loader's construction (its start-up, and for a
    compressed share read in place the decompression, included), and of the later ones."""
    if not ends:
        return {}
    out = {"first_pass_samples_per_s": ends[0][1] / (ends[0][0] - began)}
    if len(ends) > 1:
        later = sum(n for _, n in ends[1:])
        out["later_passes_samples_per_s"] = later / (ends[-1][0] - ends[0][0])
    return out


def consume(loader, kind: str, began: float, first_only: bool = False, max_s: float = float("inf")) -> dict:
    samples = tokens = nbytes = real = padded = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - began
            if first_only:
                break
            began_steady = time.perf_counter()
        samples += len(batch["__key__"])
        if kind == "tokens":
            n = int(batch["lengths"].sum())
            tokens += n
            nbytes += 4 * n
            real += n
            padded += batch["tokens"].numel()
        else:
            nbytes += sum(len(b) for b in batch["jpg"])
        if time.perf_counter() - began_steady > max_s:
            break
    el = time.perf_counter() - began_steady if not first_only else 0
    # Steady-state rates exclude the first batch (start-up is reported separately).
    return {
        "first_batch_s": first,
        "seconds": el,
        "samples_per_s": samples / el if el else None,
        "tokens_per_s": tokens / el if el else None,
        "mb_per_s": nbytes / el / 1e6 if el else None,
        "padding_efficiency": real / padded if padded else None,
        "peak_rss_mb": peak_rss_mb(),  # VmHWM: ru_maxrss would carry the benchmark parent's peak
        "workers_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def run_peer(name: str, root: str, kind: str, workers: int, max_s: float, verify: bool = False) -> dict:
    """A peer's shuffled read of its own copy of the corpus (``<root>-<name>``), as ``run_wds``."""
    from shardtool.benchmarks import peers

    mod = peers.available()[name]
    began = time.perf_counter()
    loader = mod.loader(f"{root}-{name}", kind, workers, WDS_BATCH if kind == "tokens" else IMAGE_BATCH)
    if verify:
        return verify_read(loader, kind)
    return consume(loader, kind, began, max_s=max_s)


def verify_read(loader, kind: str) -> dict:
    """One whole epoch: samples, unique keys and the sum of per-sample checksums (benchmarks.peers)."""
    from shardtool.benchmarks.peers import batch_fingerprint

    keys: list[str] = []
    total = 0
    for batch in loader:
        k, c = batch_fingerprint(batch, kind)
        keys += k
        total += c
    return {"samples": len(keys), "unique": len(set(keys)), "checksum": total}


def one(args) -> None:
    if args.one not in ("wds", "ours", "ours-nometrics"):
        out = run_peer(args.one, args.root, args.kind, args.workers, args.max_seconds, args.verify)
    elif args.verify and args.one == "wds":
        import webdataset as wds

        urls = sorted(os.path.join(args.root, f) for f in os.listdir(args.root) if f.endswith(".tar"))
        ds = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, seed=0).shuffle(1000)
        ds = (
            ds.decode().to_tuple("__key__", "tokens.npy").batched(WDS_BATCH, collation_fn=wds_pad, partial=True)
            if args.kind == "tokens"
            else ds.to_tuple("__key__", "jpg").batched(IMAGE_BATCH, collation_fn=wds_bytes, partial=True)
        )
        out = verify_read(wds.WebLoader(ds, batch_size=None, num_workers=args.workers), args.kind)
    elif args.verify:
        from shardtool.loader import ShardedLoader

        size = {"max_tokens": MAX_TOKENS} if args.kind == "tokens" else {"batch_size": IMAGE_BATCH}
        out = verify_read(
            ShardedLoader(args.root, num_workers=args.workers, pin_memory=False, metrics=False, **size), args.kind
        )
    elif args.one == "wds":
        out = run_wds(args.root, args.kind, args.workers, args.max_seconds)
    else:
        out = run_ours(
            args.root,
            args.kind,
            args.workers,
            args.resume,
            args.max_seconds,
            args.one == "ours",
            args.cache_dir,
            args.passes,
            args.shuffle_block,
        )
    print(json.dumps(out))
