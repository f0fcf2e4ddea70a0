"""Packing from a Ray Dataset and a Spark DataFrame (issue 38 item 4), on a real local Ray and a
real local Spark: each partition one task of the job-array protocol, then one merge. The result
is the dataset packing the same rows from Parquet gives: the same samples in the same order,
keys, tokens and every field. Real text: stdlib files as byte ids.

Marked ``engines``: its own CI step, after ``pip install -e ".[engines]"`` (Ray and PySpark are
large installs; Spark needs Java, which ``.ci/run`` installs from Debian's packages when missing).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardtool
from helpers.realtext import byte_ids, stdlib_files
from helpers.skips import require
from shardtool.format import open_dataset

pytestmark = [pytest.mark.engines, pytest.mark.timeout(600)]
OPTIONS = dict(format="arrow", length="tokens", shard_size="2MiB")


@pytest.fixture(scope="module")
def table() -> pa.Table:
    paths = [p for p in stdlib_files(90) if os.path.getsize(p) > 0]
    return pa.table(
        {
            "tokens": [byte_ids(p).tolist() for p in paths],
            "path": [os.path.relpath(p, os.path.dirname(os.__file__)) for p in paths],
        },
        schema=pa.schema([("tokens", pa.list_(pa.int32())), ("path", pa.string())]),
    )


@pytest.fixture(scope="module")
def from_parquet(table, tmp_path_factory) -> str:
    src = str(tmp_path_factory.mktemp("parquet") / "rows.parquet")
    pq.write_table(table, src)
    out = str(tmp_path_factory.mktemp("ref") / "ds")
    shardtool.pack(src, out, **OPTIONS)
    return out


def samples(root: str) -> list[tuple]:
    ds = open_dataset(root)
    return [(s["__key__"], np.asarray(s["tokens"]).tolist(), str(s["path"])) for s in ds]


def check_same(root: str, ref: str, table: pa.Table) -> None:
    got, want = samples(root), samples(ref)
    assert len(got) == table.num_rows and got == want  # keys, order, tokens, paths
    assert open_dataset(root).manifest.length == open_dataset(ref).manifest.length


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_a_ray_dataset_packs_one_task_per_block_as_parquet_would(ray_session, table, from_parquet, tmp_path):
    import ray.data

    from shardtool.pack.engines import pack_ray

    ds = ray.data.from_arrow(table).repartition(4, shuffle=False)
    summary = pack_ray(ds, str(tmp_path / "ds"), **OPTIONS)
    assert summary["samples"] == table.num_rows
    tasks = [t for t in os.listdir(tmp_path / "ds" / "tasks") if t.endswith(".json")]
    assert len(tasks) == 4 and all(t.endswith("-of-0004.json") for t in tasks), tasks
    check_same(str(tmp_path / "ds"), from_parquet, table)
    # The loader reads it as it reads the Parquet pack.
    from shardtool.loader import ShardedLoader

    a = [b["__key__"] for b in ShardedLoader(str(tmp_path / "ds"), batch_size=8, num_workers=0, seed=1)]
    assert a == [b["__key__"] for b in ShardedLoader(from_parquet, batch_size=8, num_workers=0, seed=1)]


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    require(shutil.which("java") is not None, "Spark needs Java (Debian's default-jre-headless; .ci/run installs it)")

    # local[2, 4]: two cores, a task may fail 4 times (as on a cluster) before the job fails.
    session = (
        SparkSession.builder.master("local[2, 4]")
        .appName("shardtool-pack-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    yield session
    session.stop()


def test_a_spark_dataframe_packs_one_task_per_partition_as_parquet_would(spark, table, from_parquet, tmp_path):
    from shardtool.pack.engines import pack_spark

    rows = [
        {"tokens": t, "path": p} for t, p in zip(table.column("tokens").to_pylist(), table.column("path").to_pylist())
    ]
    df = spark.createDataFrame(rows, "tokens array<int>, path string").coalesce(3)
    summary = pack_spark(df, str(tmp_path / "ds"), **OPTIONS)
    assert summary["samples"] == table.num_rows
    check_same(str(tmp_path / "ds"), from_parquet, table)


def test_a_spark_partition_that_fails_is_retried_alone(spark, table, from_parquet, tmp_path):
    """Partition 1's packing task fails on its first attempt (its rows are read twice: counted,
    then packed; the second read fails once); Spark runs that task again, and the dataset is
    whole: every row once, in order."""
    from shardtool.pack.engines import pack_spark

    seen, marker = str(tmp_path / "counted"), str(tmp_path / "failed-once")
    rows = [
        {"tokens": t, "path": p} for t, p in zip(table.column("tokens").to_pylist(), table.column("path").to_pylist())
    ]
    base = spark.createDataFrame(rows, "tokens array<int>, path string").coalesce(3)

    def fail_once(i, it):
        if i == 1 and not os.path.exists(seen):
            open(seen, "w").close()  # the count's read
        elif i == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            raise OSError("a lost executor (test)")
        return it

    df = spark.createDataFrame(base.rdd.mapPartitionsWithIndex(fail_once), base.schema)
    pack_spark(df, str(tmp_path / "ds"), **OPTIONS)
    assert os.path.exists(marker)
    check_same(str(tmp_path / "ds"), from_parquet, table)


def test_empty_partitions_get_no_task_and_engine_owned_options_are_refused(spark, table, tmp_path):
    from shardtool.pack.engines import pack_spark

    rows = [{"tokens": [1, 2, 3], "path": f"p{i}"} for i in range(5)]
    df = spark.createDataFrame(rows, "tokens array<int>, path string").repartition(8)  # some partitions empty
    summary = pack_spark(df, str(tmp_path / "ds"), **OPTIONS)
    assert summary["samples"] == 5
    assert sorted(s["path"] for s in open_dataset(str(tmp_path / "ds"))) == [f"p{i}" for i in range(5)]
    with pytest.raises(TypeError, match="num_tasks"):
        pack_spark(df, str(tmp_path / "other"), num_tasks=2, **OPTIONS)
    with pytest.raises(shardtool.ShardtoolError, match="every one is empty"):
        pack_spark(df.limit(0), str(tmp_path / "none"), **OPTIONS)
