"""Packing a Ray Dataset or a Spark DataFrame on the cluster that already holds it.

Each partition (a Ray block, a Spark partition) is one task of the job-array protocol
(`shardtool.pack` with ``num_tasks``): it writes its own shards and fragment under ``out``, so
a task that fails is retried alone by the engine (Ray's ``max_retries``, Spark's task retries)
and replaces only its own files; then the driver merges the fragments into the manifest
(`shardtool.pack.merge`). The partitions' rows are counted first, so that partition ``i``'s
samples are keyed after those of the partitions before it: the merged dataset numbers every
row once, in partition order, as packing the same rows from one Parquet file does.

``out`` must be a path every task can write and the driver can read (a shared filesystem: Lustre,
NFS, ``/dbfs/...`` on Databricks); shardtool must be installed where the tasks run. The engine's
dataset is read twice (the count, then the rows): a Spark DataFrame whose rows or partitions could
change between two reads (a non-deterministic shuffle) should be persisted first; a partition
whose row count differs between the two reads is an error naming it.
"""

from __future__ import annotations

import os
from typing import Any

from ..format.errors import ShardtoolError
from .merge import merge
from .options import strip_file_scheme
from .partition import Partition

__all__ = ["pack_ray", "pack_spark"]

# The options a partition's task packs with that the engine decides, not the caller.
_ENGINE_OWNS = ("num_tasks", "task_index", "partition", "workers", "env")


def _check_options(options: dict[str, Any]) -> None:
    taken = sorted(k for k in options if k in _ENGINE_OWNS)
    if taken:
        raise TypeError(f"pack_ray/pack_spark decide {', '.join(taken)} themselves (one task per partition)")


def _plan(counts: list[int]) -> dict[int, Partition]:
    """Partition number -> its task: empty partitions get none (they would have nothing to pack)."""
    total = sum(counts)
    if total == 0:
        raise ShardtoolError("no samples found in the partitions: every one is empty")
    tasks = [i for i, n in enumerate(counts) if n > 0]
    out, first = {}, 0
    for t, i in enumerate(tasks):
        out[i] = Partition(index=t, count=len(tasks), first=first, total=total)
        first += counts[i]
    return out


def _pack_partition(table: Any, out: str, part: Partition, counted: int, options: dict[str, Any]) -> int:
    """Pack one partition's rows (a pyarrow Table) as its task; returns the samples written."""
    from .api import pack

    if table.num_rows != counted:
        raise ShardtoolError(
            f"partition task {part.index} of {part.count} has {table.num_rows} rows, {counted} when counted: "
            "the dataset changed between its two reads (persist a Spark DataFrame before packing it)"
        )
    result = pack(table, out, partition=part, workers=1, quiet=True, **options)
    return result.samples


def pack_ray(dataset: Any, out: str, *, max_retries: int = 3, **options: Any) -> dict:
    """Pack a ``ray.data.Dataset`` into ``out``: one Ray task per block (``dataset.repartition(n)``
    first for ``n`` tasks), retried alone up to ``max_retries`` times, then one merge on the
    driver. ``options`` are `shardtool.pack`'s (format, length, shard_size, tokenizer, ...).
    Returns the merge's summary. Requires a running Ray (``ray.init()``) or starts a local one."""
    import ray

    _check_options(options)
    out = os.path.abspath(strip_file_scheme(out))  # the tasks may run in another directory
    refs = dataset.to_arrow_refs()

    @ray.remote
    def rows(table) -> int:
        return table.num_rows

    counts = ray.get([rows.remote(r) for r in refs])
    plan = _plan(counts)
    task = ray.remote(max_retries=max_retries)(_pack_partition)  # a lost worker or node: retried; bad data: not
    futures = [task.remote(refs[i], out, part, counts[i], options) for i, part in sorted(plan.items())]
    ray.get(futures)
    return merge(out, num_tasks=len(plan))


def pack_spark(dataframe: Any, out: str, **options: Any) -> dict:
    """Pack a ``pyspark.sql.DataFrame`` into ``out``: one Spark task per partition (retried by
    Spark as any task is), then one merge on the driver. Rows become Arrow with the DataFrame's
    schema (``to_arrow_schema``), so every partition packs the same fields. ``options`` are
    `shardtool.pack`'s. Returns the merge's summary."""
    from pyspark.sql.pandas.types import to_arrow_schema

    _check_options(options)
    out = os.path.abspath(strip_file_scheme(out))  # the tasks may run in another directory
    schema = to_arrow_schema(dataframe.schema)
    counts_by = dict(dataframe.rdd.mapPartitionsWithIndex(lambda i, it: [(i, sum(1 for _ in it))]).collect())
    counts = [counts_by.get(i, 0) for i in range(dataframe.rdd.getNumPartitions())]
    plan = _plan(counts)

    def task(i: int, it):
        import pyarrow as pa

        part = plan.get(i)
        rows = [row.asDict(recursive=True) for row in it]
        if part is None:
            if rows:
                raise ShardtoolError(f"partition {i} was empty when counted and has {len(rows)} rows now")
            return []
        return [_pack_partition(pa.Table.from_pylist(rows, schema=schema), out, part, counts[i], options)]

    dataframe.rdd.mapPartitionsWithIndex(task).collect()
    return merge(out, num_tasks=len(plan))
