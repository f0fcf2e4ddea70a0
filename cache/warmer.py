"""``warm``: copy exactly this node's shards (and their metadata) into a node-local cache.

Failure policy for a prolog: a fault of this node (cache unusable, too small) is ``local_fault``
(exit 3, so SLURM drains the node); a failure of the source is ``remote_failed``, which exits 0
unless ``strict`` (then 1), because an outage seen by every node must not drain the cluster; the
loader fetches what is missing on demand. A URL with no dataset at all (the storage answers that
its manifest does not exist, or the protocol is unknown) is a mistake in the job's set-up, not
an outage: ``usage_error``, exit 2.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from ..format.dataset import Dataset, SummariesMissing
from ..format.manifest import MANIFEST_NAME, lengths_from_bytes
from ..format.storage import not_a_dataset
from ..plan import DataLayout, Layout, Placement
from .assign import assigned_shards
from .budget import Budget
from .cachedir import VersionDir, record_source
from .durability import must_fsync
from .errors import CacheError, LocalFault, RemoteError, SourceMissing, UsageError
from .fallback import complete_cached_version
from .meta import (
    COPIED,
    HIT,
    FetchOptions,
    ensure_index,
    ensure_lengths,
    ensure_shard,
    ensure_summaries,
    store_manifest,
)
from .perms import DEFAULT_PERMS, Perms
from .plain import cached_size, mark_keep_compressed, wants_plain
from .report import WarmReport, data_layout_dict
from .retry import RetryPolicy
from .store import Origin, local_fault
from .warmfit import cap_to_stage, fit_budget


def check_cache_dir(cache_dir: str, perms: Perms = DEFAULT_PERMS) -> None:
    """The directory must exist or be creatable under an existing parent, and be writable."""
    parent = os.path.dirname(os.path.abspath(cache_dir))
    if not os.path.isdir(cache_dir):
        if not os.path.isdir(parent):
            raise LocalFault(
                f"cache directory {cache_dir} is missing and so is its parent {parent} (is the local disk mounted?)"
            )
        try:
            perms.makedirs(cache_dir)
        except OSError as e:
            raise local_fault(e, f"cache directory {cache_dir}") from None
    probe = os.path.join(cache_dir, f".probe-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
    except OSError as e:
        raise LocalFault(f"cache directory {cache_dir} is not writable: {e.strerror or e}") from None


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.lock = threading.Lock()
        if enabled and total:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                file=sys.stderr,
                desc="warm",
                dynamic_ncols=True,
            )

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def warm(
    url: str,
    cache_dir: str,
    *,
    placement: Placement | None = None,
    data_layout: DataLayout | None = None,
    all_shards: bool = False,
    jobs: int = 8,
    max_bytes: int | None = None,
    min_free: int | None = None,
    best_effort: bool = False,
    strict: bool = False,
    timeout: float | None = None,
    verify: bool = False,
    durable: bool = False,
    retry: RetryPolicy = RetryPolicy(),
    storage_options: dict | None = None,
    progress: bool | None = None,
    env: Mapping[str, str] | None = None,
    log=None,
    perms: Perms = DEFAULT_PERMS,
    keep: Iterable[str] = (),
    live: Iterable[str] | None = None,
    stage_bytes: int | None = None,
    keep_compressed: bool = False,
) -> WarmReport:
    """Warm ``cache_dir`` with the shards node ``placement.node`` of its layout reads (every shard
    with ``all_shards``). Never raises for remote or local failures: the returned report carries
    ``status`` and ``exit_code``. ``placement=None`` without ``all_shards`` means one node;
    ``data_layout`` says who reads what when model-parallel peers span nodes (pure data
    parallelism over the placement's nodes when None), as the loader's mesh does.
    ``durable``: fsync each shard before publishing it; by default shards are published once
    verified and re-verified if the machine reboots before the kernel wrote them back
    (:mod:`shardtool.cache.durability`). ``perms``: modes and group of what the warm writes (default
    0644 files, 0755 directories, whatever the umask: the job's user must read what root warmed).
    ``keep``: dataset versions whose assigned shards a budget must not evict (the other sources of
    a mixture warmed into the same cache: `shardtool.cache.mixwarm`). ``live``: versions the running
    jobs on this node asked for (`shardtool.cache.jobs`); a budget evicts every other version first.
    ``stage_bytes``: a job's own cap on how much of this node's shards it holds in the cache (the
    first shards of its range, then none: the loader fetches the rest; status ``partial``).
    A source with no manifest, or one that cannot be reached, is not an error when this node's
    cache holds a complete version for ``url``: status ``cached``, with a warning.
    A compressed Arrow dataset is
    decompressed into the cache (plain, memory-mappable shards; `shardtool.cache.plain`), the budget
    counting plain bytes, unless ``keep_compressed``; the loader's fetch-on-miss follows that choice."""
    began = time.monotonic()
    deadline = None if timeout is None else began + timeout
    if progress is None:
        progress = sys.stderr.isatty()
    if all_shards:
        placement = None  # every shard: no node's placement applies
    elif placement is None:
        placement = Placement(Layout(1, 1), 0, source="default: one node")
    report = WarmReport(
        url=url,
        cache_dir=os.path.abspath(cache_dir),
        strict=strict,
        layout=None if placement is None else placement.to_dict(),
        durable=must_fsync(durable),
    )
    if placement is not None:
        data = data_layout if data_layout is not None else DataLayout.pure_dp(placement.layout)
        report.data_layout = data_layout_dict(data, placement.node)
    log = log or (lambda msg: print(f"shardtool warm: {msg}", file=sys.stderr))
    try:
        _warm(
            report,
            url,
            cache_dir,
            placement=placement,
            data_layout=data_layout,
            jobs=jobs,
            max_bytes=max_bytes,
            min_free=min_free,
            best_effort=best_effort,
            deadline=deadline,
            verify=verify,
            durable=durable,
            retry=retry,
            storage_options=storage_options,
            progress=progress,
            log=log,
            perms=perms,
            keep=frozenset(keep),
            live=None if live is None else frozenset(live),
            stage_bytes=stage_bytes,
            keep_compressed=keep_compressed,
        )
    except LocalFault as e:
        report.status, report.error = "local_fault", str(e)
    except UsageError as e:
        report.status, report.error = "usage_error", str(e)
    except (RemoteError, CacheError) as e:
        report.status, report.error = "remote_failed", str(e)
    report.seconds = time.monotonic() - began
    if report.status == "ok" and report.shards_failed:
        report.status = "remote_failed"
        report.error = f"{report.shards_failed} shard(s) failed; first: {report.failures[0]['error']}"
    if report.status == "ok" and report.not_fitted:
        report.status = "partial"
    return report


def _warm(
    report: WarmReport,
    url,
    cache_dir,
    *,
    placement,
    data_layout,
    jobs,
    max_bytes,
    min_free,
    best_effort,
    deadline,
    verify,
    durable,
    retry,
    storage_options,
    progress,
    log,
    perms,
    keep=frozenset(),
    live=None,
    stage_bytes=None,
    keep_compressed=False,
) -> None:
    check_cache_dir(cache_dir, perms)
    try:
        src = Origin(url, storage_options)
    except ValueError as e:  # fsspec: "Protocol not known: fiel"
        raise UsageError(f"no dataset at {url}: {e}") from None
    except ImportError as e:
        raise RemoteError(f"cannot open source {url}: {e}") from None
    kw: FetchOptions = {"policy": retry, "deadline": deadline}
    try:
        manifest_bytes = src.read_bytes(MANIFEST_NAME, **kw)
    except SourceMissing:
        if _from_cache(report, url, cache_dir, placement, data_layout, perms, "has no manifest any more"):
            return
        raise UsageError(
            f"no dataset at {url}: it {not_a_dataset(src.fs, src.root)} (its manifest "
            f"{src.path(MANIFEST_NAME)} does not exist; an unreachable source is not an error without --strict)"
        ) from None
    except RemoteError as e:
        if _from_cache(report, url, cache_dir, placement, data_layout, perms, f"cannot be reached ({e})"):
            return
        raise
    ds = Dataset(url, fs=src.fs, root=src.root, manifest_bytes=manifest_bytes)
    vd = VersionDir(cache_dir, ds.version, perms)
    report.version, report.version_dir = ds.version, vd.root
    m = ds.manifest
    store_manifest(vd, manifest_bytes)
    summaries_bytes = ensure_summaries(vd, src, m, **kw)
    # The lengths file too: the version directory stays a complete dataset root, and a dataset
    # packed before per-shard summaries needs it to compute them.
    ds.use_lengths(lengths_from_bytes(ensure_lengths(vd, m, src, **kw), expected=m.num_samples, source=url))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SummariesMissing)  # said once, below, not once per rank
        summaries = ds.load_summaries(summaries_bytes)
    if summaries_bytes is None:
        report.warnings.append(
            f"dataset {url} has no per-shard summaries (packed by shardtool < 0.2): every "
            f"rank computes them from all lengths; run `shardtool upgrade {url}` once"
        )
    shards = assigned_shards(summaries, placement, data_layout)
    report.assigned = len(shards)
    report.assigned_bytes = sum(m.shards[i].bytes for i in shards)
    plain = wants_plain(m, keep_compressed)
    size_in_cache = {i: cached_size(m, m.shards[i], keep_compressed) for i in shards}
    if m.compression is not None:
        report.compression = m.compression
        report.decompressed = plain
        report.assigned_cache_bytes = sum(size_in_cache.values())
        mark_keep_compressed(vd, keep_compressed)
    recorded = {**report.layout, "data_layout": report.data_layout} if report.layout else {"all": True}
    vd.write_assigned(shards, recorded)

    failed: dict[int, str] = {}

    def fail(i: int, e: BaseException) -> None:
        failed[i] = str(e)
        report.failures.append({"shard": i, "path": m.shards[i].path, "error": str(e), "kind": type(e).__name__})

    todo = []
    for i in shards:
        if not verify and vd.trusted(i, m.shards[i]):
            report.shards_skipped += 1
            report.bytes_skipped += m.shards[i].bytes
        else:
            todo.append(i)
    if stage_bytes is not None:
        todo = cap_to_stage(report, m, shards, todo, stage_bytes, log, size_in_cache)
    todo = fit_budget(
        report, vd, m, shards, todo, cache_dir, Budget(max_bytes, min_free), best_effort, log, keep, live, size_in_cache
    )

    bar = _Progress(sum(m.shards[i].bytes for i in todo), progress)
    lock = threading.Lock()

    def retried(*_):
        with lock:
            report.retries += 1

    def one(i: int) -> None:
        info = m.shards[i]
        index = index_futs[i]
        if index.exception() is not None:  # waits for it; its failure is recorded by the main thread
            return
        try:
            outcome = ensure_shard(
                vd, i, info, src, on_bytes=bar, on_retry=retried, verify=verify, durable=durable, plain=plain, **kw
            )
        except LocalFault:
            raise
        except CacheError as e:  # a remote error, or a lock wait that ran past the deadline
            with lock:
                fail(i, e)
            return
        with lock:
            if outcome == COPIED:
                report.shards_copied += 1
                report.bytes_copied += info.bytes
                report.cache_bytes_written += _size(vd.path(info.path), info.bytes)
            else:
                report.shards_skipped += 1
                report.bytes_skipped += info.bytes
                if outcome == HIT:
                    bar(info.bytes)

    try:
        with ThreadPoolExecutor(max(jobs, 1)) as pool:
            # One pool, indexes queued first: they are small and the loader needs them even for
            # shards fetched later, and the shard copies start while the last of them land.
            index_futs = {i: pool.submit(ensure_index, vd, m.shards[i], src, **kw) for i in shards}
            # Largest first: the long transfers start early and the tail is short.
            order = sorted(todo, key=lambda i: -m.shards[i].bytes)
            futs = [pool.submit(one, i) for i in order]
            try:
                for i, index_fut in index_futs.items():
                    try:
                        index_fut.result()
                    except RemoteError as e:
                        with lock:
                            fail(i, e)
                unrecorded: LocalFault | None = None
                try:
                    # metadata is in place: an offline loader can start
                    record_source(cache_dir, url, ds.version, perms=perms)
                except LocalFault as e:  # e.g. the copies filled the disk: a failing shard names it better
                    unrecorded = e
                done, pending = wait(futs, return_when=FIRST_EXCEPTION)
                for f in done:
                    f.result()  # re-raise a LocalFault: this node cannot hold its shards
                if unrecorded is not None:
                    raise unrecorded
            except BaseException:
                for f in futs:
                    f.cancel()
                raise
    finally:
        bar.close()
    report.shards_failed = len(failed)
    report.bytes_failed = sum(m.shards[i].bytes for i in failed)
    for i in list(failed)[:5]:
        log(f"failed shard #{i} {m.shards[i].path}: {failed[i]}")


def _from_cache(report, url, cache_dir, placement, data_layout, perms, why: str) -> bool:
    """The source is gone or unreachable: succeed, with a warning, if this node's cache holds a
    complete version for ``url`` (`shardtool.cache.fallback`)."""
    found = complete_cached_version(url, cache_dir, placement, data_layout, perms=perms)
    if found is None:
        return False
    vd, shards, size = found
    report.status, report.version, report.version_dir = "cached", vd.version, vd.root
    report.assigned = report.shards_skipped = len(shards)
    report.assigned_bytes = report.bytes_skipped = size
    report.warnings.append(
        f"source {url} {why}; this node's cache holds all {len(shards)} of its shards of the "
        f"version it last served ({vd.version}): the job reads that version"
    )
    return True


def _size(path: str, default: int) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # evicted already by another process's budget
        return default


__all__ = ["warm", "check_cache_dir"]
