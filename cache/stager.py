"""In-job staging, the I/O: one process per node fetches the node's shards into the cache in the
order its ranks will first read them, a bounded distance ahead of the slowest reader.

No prolog, no admin: the loader's ranks publish on a *board* in the node cache (``ShardedLoader(...,
stage=...)``), and a stager follows it, either started by local rank 0 (``stage=True``) or as a
``shardtool warm --follow`` step beside torchrun (``stage="external"``). The board of one job and
dataset version is a directory ``<cache_dir>/stage/<run>-<version>/`` with, per local rank ``r``:

- ``order-<r>.json``: its touch order for the pass it starts (shardtool.plan.stageorder), written
  atomically once per pass;
- ``progress-<r>``: 16 bytes, the epoch and the number of batches handed to the training loop,
  overwritten in place every step (one ``pwrite``: cheap enough for every step);
- ``closed-<r>``: the loader was closed.

Which shards to fetch is decided by the pure `shardtool.plan.stageorder.next_fetches`. Fetches go
through `ensure_shard`, under the per-shard locks a reader's fetch-on-miss takes too: a reader
that misses a shard the stager is fetching waits for it (and the stager skips a shard a reader is
fetching), so no shard is fetched twice.

When it stops: ranges are sticky (docs/architecture.md §2.3), so every epoch reads the same shards of the node.
The stager stops once every expected rank has published an order and every shard of their
orders is in the cache: later epochs are served from it. It also stops when every rank closed
its loader, or when its parent process (the loader that started it) is gone.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from ..format.atomic import atomic_write_bytes
from ..plan.stageorder import TouchOrder, merge_orders, next_fetches, window_end
from .errors import CacheError, LocalFault
from .meta import COPIED, ensure_shard
from .plain import cached_size, keeps_compressed, wants_plain
from .stagebudget import StageBudget

_PROGRESS = struct.Struct("<qq")  # epoch, batches served
STAGE_DIR = "stage"


def stage_run(env: Mapping[str, str]) -> str:
    """The id every rank of a job and its `warm --follow` step share: SHARDTOOL_STAGE_RUN, else the
    SLURM job (not the step: the stager and torchrun are two steps of one job), else torchrun's
    run id, else "local" (one job per node cache at a time)."""
    for key in ("SHARDTOOL_STAGE_RUN", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        v = env.get(key, "").strip()
        if v and v != "none":
            return "".join(c if c.isalnum() or c in "-._" else "_" for c in v)
    return "local"


def board_dir(cache_dir: str, run: str, version: str) -> str:
    return os.path.join(os.path.abspath(cache_dir), STAGE_DIR, f"{run}-{version[:16]}")


class Board:
    """The ranks' side of the board: publish orders and progress (one object per rank)."""

    def __init__(self, path: str, local_rank: int):
        self.path, self.local_rank = path, local_rank
        os.makedirs(path, exist_ok=True)
        for stale in (f"closed-{local_rank}", f"order-{local_rank}.json"):  # a previous job of this run id
            try:
                os.unlink(os.path.join(path, stale))
            except FileNotFoundError:
                pass
        self._fd: int | None = os.open(os.path.join(path, f"progress-{local_rank}"), os.O_RDWR | os.O_CREAT, 0o644)
        self._last: tuple[int, int] | None = None

    def publish_order(self, epoch: int, order: TouchOrder, start: int) -> None:
        self.progress(epoch, start)  # before the order: a stager never sees it at a stale position
        atomic_write_bytes(
            os.path.join(self.path, f"order-{self.local_rank}.json"), json.dumps(order.to_dict(epoch)).encode()
        )

    def progress(self, epoch: int, served: int) -> None:
        if self._fd is not None and self._last != (epoch, served):
            os.pwrite(self._fd, _PROGRESS.pack(epoch, served), 0)
            self._last = (epoch, served)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            with open(os.path.join(self.path, f"closed-{self.local_rank}"), "wb"):
                pass


@dataclass
class Seen:
    """What the stager read off the board at one moment."""

    orders: dict[int, tuple[int, TouchOrder]]  # local rank -> (epoch, order)
    progress: dict[int, tuple[int, int]]  # local rank -> (epoch, served)
    closed: set[int]

    def current(self, memo: dict | None = None) -> tuple[TouchOrder, int] | None:
        """The node's merged order for the earliest epoch any rank is in, and its slowest reader's
        step there (a rank already in a later epoch is past all of it). ``memo`` keeps the merge
        while the ranks' orders are the same objects (`read_board` keeps unchanged ones)."""
        if not self.orders:
            return None
        epoch = min(e for e, _ in self.orders.values())
        mine = sorted((r, o) for r, (e, o) in self.orders.items() if e == epoch)
        key = (epoch, tuple((r, id(o)) for r, o in mine))
        memo = {} if memo is None else memo
        if memo.get("key") != key:
            memo["key"], memo["order"] = key, merge_orders(o for _, o in mine)
        order = memo["order"]
        steps = []
        for r, (e, _) in self.orders.items():
            pe, served = self.progress.get(r, (e, 0))
            if pe == epoch:
                steps.append(served)
        return order, min(steps, default=0)


def read_board(path: str, cache: dict | None = None, since_ns: int = 0) -> Seen:
    """The board's files; ``cache`` keeps parsed orders by (rank, mtime) between calls. A rank's
    ``closed`` mark older than ``since_ns`` is a previous job's (of the same run id): ignored."""
    cache = {} if cache is None else cache
    orders, progress, closed = {}, {}, set()
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        names = []
    for name in names:
        kind, _, r = name.partition("-")
        r = r.removesuffix(".json")
        if not r.isdigit():
            continue
        full, rank = os.path.join(path, name), int(r)
        try:
            if kind == "order":
                mtime = os.stat(full).st_mtime_ns
                hit = cache.get(rank)
                if hit is None or hit[0] != mtime:
                    with open(full, "rb") as f:
                        d = json.loads(f.read())
                    hit = cache[rank] = (mtime, (int(d["epoch"]), TouchOrder.from_dict(d)))
                orders[rank] = hit[1]
            elif kind == "progress":
                with open(full, "rb") as f:
                    data = f.read(_PROGRESS.size)
                if len(data) == _PROGRESS.size:
                    progress[rank] = _PROGRESS.unpack(data)
            elif kind == "closed" and os.stat(full).st_mtime_ns >= since_ns:
                closed.add(rank)
        except (OSError, ValueError, KeyError):
            continue  # being replaced, or not ours: read again at the next poll
    return Seen(orders, progress, closed)


class Throttle:
    """At most ``rate`` bytes per second over all threads: each chunk reserves its share of the pipe."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self._free_at = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + n / self.rate
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)


@dataclass
class StageReport:
    status: str = "running"  # done | closed | orphaned | stopped | local_fault
    error: str | None = None
    shards_copied: int = 0
    bytes_copied: int = 0
    shards_present: int = 0  # found in the cache (a warm or a reader got there first)
    failures: list = field(default_factory=list)
    not_fitted: list = field(default_factory=list)  # over the cache's budget: left to the readers
    # per fetch started: (seconds since start, shard, its index in the order, window end, slowest step)
    fetches: list = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"staged {self.shards_copied} shard(s), {self.bytes_copied / 1e9:.3f} GB, {self.shards_present} "
            f"already in the cache, {len(self.failures)} failed, "
            + (f"{len(self.not_fitted)} left over the cache budget, " if self.not_fitted else "")
            + f"in {self.seconds:.1f}s ({self.status})"
        )


def follow(
    cache,
    *,
    run: str,
    ranks: int,
    ahead_shards: int = 16,
    ahead_bytes: int | None = None,
    jobs: int = 4,
    bandwidth: float | None = None,
    poll: float = 0.02,
    parent: int | None = None,
    stop: threading.Event | None = None,
    log: Callable[[str], None] | None = None,
) -> StageReport:
    """Stage the shards ``ranks`` local ranks read from ``cache`` (a `DatasetCache`), following
    their board; returns when done (see the module docstring) or when ``stop`` is set.
    ``jobs``: concurrent fetches; ``bandwidth``: bytes per second over all of them. The cache's
    budget (``cache.budget``: ``max_bytes``/``min_free`` as `open_cache` took them) bounds what is staged:
    a shard over it is left to the readers, said once (`shardtool.cache.stagebudget`)."""
    if ahead_shards < 1 or jobs < 1 or ranks < 1:
        raise ValueError(f"ahead_shards, jobs and ranks must be >= 1, found {ahead_shards}, {jobs}, {ranks}")
    log = log or (lambda msg: print(f"shardtool stage: {msg}", file=sys.stderr))
    began, began_ns = time.monotonic(), time.time_ns() - 1_000_000_000  # 1 s: file times are coarse
    report = StageReport()
    path = board_dir(cache.cache_dir, run, cache.version)
    os.makedirs(path, exist_ok=True)
    vd, shards = cache.vdir, cache.manifest.shards
    sizes = [s.bytes for s in shards]
    throttle = Throttle(bandwidth)
    src = cache.source()
    policy = cache.retry
    present: set[int] = set()
    failed: set[int] = set()
    over: set[int] = set()  # over the budget: left to the readers' fetch-on-miss
    busy: dict[int, Future] = {}
    parsed: dict = {}
    next_scan = 0.0
    merged: dict = {}
    last, listed, resolved = None, [], 0  # the current order, as a list, and how many of its first are done

    # As the loader's fetch-on-miss does: a compressed Arrow shard enters the cache plain unless this
    # version was warmed with --keep-compressed.
    plain = wants_plain(cache.manifest, keeps_compressed(vd))
    budget = StageBudget(
        cache.cache_dir,
        [cached_size(cache.manifest, s, keeps_compressed(vd)) for s in shards],
        cache.budget,
    )

    def fetch(i: int) -> str:
        return ensure_shard(vd, i, shards[i], src, policy=policy, on_bytes=throttle, plain=plain)

    with ThreadPoolExecutor(jobs, thread_name_prefix="shardtool-stage") as pool:
        while True:
            for i, fut in list(busy.items()):
                if not fut.done():
                    continue
                del busy[i]
                try:
                    outcome = fut.result()
                except LocalFault as e:
                    report.status, report.error = "local_fault", str(e)
                except CacheError as e:  # left to the readers' fetch-on-miss, which reports it
                    failed.add(i)
                    report.failures.append({"shard": i, "path": shards[i].path, "error": str(e)})
                    log(f"shard #{i} {shards[i].path}: {e}")
                    continue
                else:
                    present.add(i)
                    if outcome == COPIED:
                        report.shards_copied += 1
                        report.bytes_copied += sizes[i]
                        budget.copied(i)
                    else:
                        report.shards_present += 1
            if report.status == "local_fault":
                break
            if stop is not None and stop.is_set():
                report.status = "stopped"
                break
            if parent is not None and os.getppid() != parent:
                report.status = "orphaned"
                break
            seen = read_board(path, parsed, began_ns)
            if len(seen.closed) >= ranks:
                report.status = "closed"
                break
            current = seen.current(merged)
            if current is not None:
                order, slowest = current
                if order is not last:  # a new pass: nothing of it is known to be resolved
                    last, listed, resolved = order, order.shards.tolist(), 0
                while resolved < len(order) and (
                    listed[resolved] in present or listed[resolved] in failed or listed[resolved] in over
                ):
                    resolved += 1
                # What a warm or a reader put there: the window's shards at every poll, all of them
                # once a second (a stat each: 10,000s of shards must not be stat-ed 50 times a second).
                end = window_end(order, sizes, slowest_step=slowest, ahead_shards=ahead_shards, ahead_bytes=ahead_bytes)
                scan_all = time.monotonic() >= next_scan
                if scan_all:
                    next_scan = time.monotonic() + 1.0
                for i in listed[resolved:] if scan_all else listed[resolved:end]:
                    if i not in present and i not in busy and vd.trusted(i, shards[i]):
                        present.add(i)
                        report.shards_present += 1
                while resolved < len(order) and (
                    listed[resolved] in present or listed[resolved] in failed or listed[resolved] in over
                ):
                    resolved += 1
                if len(seen.orders) >= ranks and not busy and resolved == len(order):
                    report.status = "done"
                    break
                picks = next_fetches(
                    order,
                    sizes,
                    slowest_step=slowest,
                    present=present | failed | over,
                    busy=set(busy),
                    ahead_shards=ahead_shards,
                    ahead_bytes=ahead_bytes,
                    slots=jobs - len(busy),
                )
                picks, left = budget.fit(picks, list(busy))
                for i in left:
                    if not over:
                        log(budget.describe(i, shards[i].path))
                    over.add(i)
                    report.not_fitted.append(i)
                if picks:
                    where = {s: k for k, s in enumerate(order.shards[:end].tolist())}
                    for i in picks:
                        report.fetches.append((time.monotonic() - began, i, where[i], end, slowest))
                        busy[i] = pool.submit(fetch, i)
                if picks or left:
                    continue
            time.sleep(poll)
        for fut in busy.values():
            fut.cancel()
    report.seconds = time.monotonic() - began
    try:  # what this node staged, beside the board (`shardtool stats` users look in the cache too)
        atomic_write_bytes(os.path.join(path, f"stager-{os.getpid()}.json"), json.dumps(asdict(report)).encode())
    except OSError as e:
        log(f"cannot write the report to {path}: {e}")
    return report


__all__ = ["Board", "Seen", "StageReport", "Throttle", "board_dir", "follow", "read_board", "stage_run"]
