"""`shardtool warm` takes the loader's data layout (--dp-size, --mesh/--dp-dim) and warms what the
node's ranks read: the same shards as the planner's `shards_for_node` for that layout, said in
the summary line and the JSON report; the SLURM prolog passes the layout through from the job's request."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.cachedata import child_env, make_dataset
from helpers.prolog import prolog_conf, run_prolog
from shardtool.format import open_dataset
from shardtool.plan import DataLayout, Layout, Mesh, data_layout, parse_mesh, shards_for_node


def warm(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardtool", "warm", *map(str, args)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("src") / "ds"), shards=16, samples=5, sample_bytes=2000)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "layout_args, nodes, rpn, expect",
    [
        # DP x TP with TP peers adjacent: 4 nodes x 2 ranks, dp 4 -> one DP rank per node
        (["--dp-size", "4"], 4, 2, lambda lay: data_layout(Mesh.row_major(("dp", "mp"), (4, 2)), ("dp",), lay)[0]),
        # PP stages across nodes: every DP rank has a stage on nodes 0-1 and on nodes 2-3
        (["--mesh", "pp=2,dp=4"], 4, 2, lambda lay: data_layout(parse_mesh("pp=2,dp=4"), ("dp",), lay)[0]),
        # HSDP: replicate x shard are both data-parallel
        (
            ["--mesh", "rep=2,shard=2,tp=2", "--dp-dim", "rep,shard"],
            4,
            2,
            lambda lay: data_layout(parse_mesh("rep=2,shard=2,tp=2"), ("rep", "shard"), lay)[0],
        ),
        # pure data parallelism, as before
        ([], 4, 2, DataLayout.pure_dp),
        # two nodes read one range together: each caches the pair's range
        (["--nodes-per-group", "2"], 4, 2, lambda lay: DataLayout.pure_dp(lay, 2)),
    ],
)
def test_each_node_warms_the_shards_its_ranks_read(src, tmp_path, layout_args, nodes, rpn, expect):
    ds = open_dataset(src)
    layout = Layout(nodes, rpn)
    data = expect(layout)
    for node in range(nodes):
        res = warm(
            src,
            "--cache-dir",
            tmp_path / f"n{node}",
            "--nodes",
            nodes,
            "--node-rank",
            node,
            "--ranks-per-node",
            rpn,
            "--json",
            "-q",
            *layout_args,
        )
        assert res.returncode == 0, res.stderr
        report = json.loads(res.stdout)
        want = shards_for_node(ds.summaries, data, node)
        assert report["assigned"] == len(want) and report["shards_copied"] == len(want)
        cached = sorted(
            i for i, s in enumerate(ds.manifest.shards) if os.path.exists(os.path.join(report["version_dir"], s.path))
        )
        assert cached == want
        d = report["data_layout"]
        assert d["dp_size"] == data.dp_size and d["data_groups"] == data.num_groups
        assert d["node_groups"] == data.groups_on_node(node)
        assert d["describe"] in res.stderr  # the summary line says it too
        if "--mesh" in layout_args:
            mesh = layout_args[layout_args.index("--mesh") + 1]
            assert d["mesh"] == mesh and f"mesh {mesh}" in res.stderr
        if "--nodes-per-group" in layout_args:
            assert d["nodes_per_group"] == 2 and data.group_nodes == ((0, 1), (2, 3))
    if layout_args[:1] == ["--mesh"] and "pp=2" in layout_args[1]:
        # a DP rank's stages on two nodes: those nodes hold the same range
        assert data.group_nodes == ((0, 2), (1, 3))


@pytest.mark.timeout(120)
def test_mesh_gives_ranks_per_node_and_bad_layouts_exit_2(src, tmp_path):
    res = warm(
        src, "--cache-dir", tmp_path / "a", "--nodes", 2, "--node-rank", 1, "--mesh", "pp=2,dp=2,tp=2", "--json", "-q"
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["layout"]["ranks_per_node"] == 4 and "ranks per node from --mesh" in report["layout"]["from"]
    bad = [
        (["--nodes", 2, "--node-rank", 0, "--dp-size", 4], "dp_size must divide the world size 2"),
        (["--nodes", 2, "--node-rank", 0, "--mesh", "pp=3,dp=1"], "do not divide over 2 node(s)"),
        (["--nodes", 2, "--node-rank", 0, "--ranks-per-node", 2, "--mesh", "pp=2,dp=4"], "has 8 ranks, the job 4"),
        (["--nodes", 2, "--node-rank", 0, "--mesh", "pp=2,dp=2", "--dp-dim", "data"], "not in the mesh"),
        (["--nodes", 2, "--node-rank", 0, "--mesh", "pp2"], "name=size"),
        (["--all", "--mesh", "dp=2"], "--all warms every shard"),
        (["--all", "--nodes-per-group", 2], "--all warms every shard"),
        (["--nodes", 2, "--node-rank", 0, "--nodes-per-group", 0], "nodes_per_group must be an int >= 1"),
    ]
    for args, message in bad:
        res = warm(src, "--cache-dir", tmp_path / "b", *args)
        assert res.returncode == 2 and message in res.stderr, (args, res.stderr)


@pytest.mark.timeout(120)
def test_prolog_passes_the_mesh_the_job_asks_for(src, tmp_path):
    hosts = ["gpu-a", "gpu-b"]
    conf = prolog_conf(tmp_path, hosts, tmp_path / "cache", active=["7"])
    comment = 'shardtool:{{"url": "{}", "mesh": "pp=2,dp=2", "dp_dim": "dp", "ranks_per_node": 2}}'.format(src)
    os.makedirs(tmp_path / "cache")
    ds = open_dataset(src)
    for node in hosts:
        res = run_prolog(conf, node, job_id="7", nodelist="gpu-[a-b]", num_nodes=2, comment=comment)
        assert res.returncode == 0, res.stderr
        report = json.load(open(tmp_path / "cache" / f"{node}.warm-7.json"))
        assert report["data_layout"]["mesh"] == "pp=2,dp=2" and report["layout"]["ranks_per_node"] == 2
        # both DP ranks have a pipeline stage on each node: each node warms every shard
        assert report["assigned"] == ds.num_shards


@pytest.mark.timeout(120)
def test_prolog_passes_the_nodes_per_group_the_job_asks_for(src, tmp_path):
    hosts = ["gpu-a", "gpu-b", "gpu-c"]
    conf = prolog_conf(tmp_path, hosts, tmp_path / "cache", active=["8"])
    comment = 'shardtool:{{"url": "{}", "nodes_per_group": 2, "ranks_per_node": 2}}'.format(src)
    os.makedirs(tmp_path / "cache")
    ds = open_dataset(src)
    data = DataLayout.pure_dp(Layout(3, 2), 2)  # nodes a, b read one range together; c its own
    for n, node in enumerate(hosts):
        res = run_prolog(conf, node, job_id="8", nodelist="gpu-[a-c]", num_nodes=3, comment=comment)
        assert res.returncode == 0, res.stderr
        report = json.load(open(tmp_path / "cache" / f"{node}.warm-8.json"))
        assert report["data_layout"]["nodes_per_group"] == 2
        assert report["assigned"] == len(shards_for_node(ds.summaries, data, n))
    assert shards_for_node(ds.summaries, data, 0) == shards_for_node(ds.summaries, data, 1)


@pytest.mark.timeout(180)
def test_a_loader_of_another_layout_than_the_warm_says_so(src, tmp_path, caplog):
    """A cache warmed for one group a node, read by a loader whose nodes read one range together:
    the loader read shards the warm never copied, fetched on a miss or, with the source gone,
    failed naming a shard alone (a user trial). It now warns, naming both layouts, at once."""
    import logging

    from shardtool.loader import ShardedLoader

    def loader_warning(*warm_args) -> str:
        cache = tmp_path / f"c{len(warm_args)}"
        res = warm(src, "--cache-dir", cache, "--nodes", 2, "--node-rank", 1, "--ranks-per-node", 2, "-q", *warm_args)
        assert res.returncode == 0, res.stderr
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardtool"):
            ld = ShardedLoader(
                src, rank=2, world_size=4, ranks_per_node=2, nodes_per_group=2, batch_size=2, cache_dir=str(cache)
            )
            ld.close()
        return "\n".join(r.getMessage() for r in caplog.records if "was warmed for" in r.getMessage())

    said = loader_warning()
    assert "4 data-parallel rank(s) in 2 data group(s) of 2" in said  # the warm's
    assert "1 data group(s) of 4, groups spanning 2 nodes" in said and "--nodes-per-group" in said
    assert loader_warning("--nodes-per-group", 2) == ""  # warmed as the loader reads: nothing said
