"""`shardtool plan`: the plan of a layout from metadata only, as text and JSON."""

from __future__ import annotations

import functools
import json
import os

import pytest

from helpers.runcli import shardtool_cli
from shardtool.loader import ShardedLoader
from test_loader_data import write_dataset

shardtool = functools.partial(shardtool_cli, timeout=120)


@pytest.mark.timeout(150)
def test_plan_json_agrees_with_the_loaders(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [30, 30, 30, 30])
    out = shardtool(
        "plan",
        root,
        "--nodes",
        "2",
        "--ranks-per-node",
        "2",
        "--batch-size",
        "4",
        "--seed",
        "3",
        "--epoch",
        "1",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    loaders = [
        ShardedLoader(root, rank=r, world_size=4, ranks_per_node=2, batch_size=4, seed=3, num_workers=0)
        for r in range(4)
    ]
    for ld in loaders:
        ld.set_epoch(1)
    assert rep["batches_per_rank"] == len(loaders[3])
    # Each rank knows its data group's remainder: one per node here.
    assert rep["remainder_samples"] == loaders[0].remainder.size + loaders[2].remainder.size
    served = sum(int(ld.plan.lengths.sum()) for ld in loaders)
    padded = sum(ld.plan.lengths.sum() / ld.padding_efficiency for ld in loaders)
    assert abs(rep["padding_efficiency"] - served / padded) < 1e-9
    assert len(rep["per_node"]["shards"]) == 2 and rep["samples"] == 120
    assert rep["plan_seconds"] >= 0 and rep["peak_rss_mb"] > 0


@pytest.mark.timeout(150)
def test_plan_text_and_big_simulated_layouts(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [50] * 8)
    out = shardtool("plan", root, "--simulate-nodes", "4", "--ranks-per-node", "2", "--max-tokens", "200")
    assert out.returncode == 0, out.stderr
    for word in ("batches/rank", "padding eff.", "remainder", "shards/node", "bytes/node", "planning"):
        assert word in out.stdout
    big = shardtool(
        "plan",
        "--synthetic",
        "300000",
        "--simulate-nodes",
        "1024",
        "--ranks-per-node",
        "8",
        "--batch-size",
        "8",
        "--json",
    )
    assert big.returncode == 0, big.stderr
    rep = json.loads(big.stdout)
    assert rep["layout"]["world_size"] == 8192 and rep["scope"] == "every group"
    for key in (
        "plan_seconds",
        "peak_rss_mb",
        "batches_per_rank",
        "remainder_tokens_fraction",
        "bytes_per_node_max_over_mean",
    ):
        assert key in rep
    one = shardtool(
        "plan",
        "--synthetic",
        "300000",
        "--simulate-nodes",
        "1024",
        "--ranks-per-node",
        "8",
        "--batch-size",
        "8",
        "--rank",
        "5000",
        "--json",
    )
    assert one.returncode == 0, one.stderr
    mine = json.loads(one.stdout)
    assert mine["scope"] == "rank" and mine["dp_rank"] == 5000 and mine["group"] == 625
    assert mine["batches_per_rank"] == rep["batches_per_rank"] and 0 < mine["peak_rss_mb"] < rep["peak_rss_mb"] * 3
    # A trace of one step is the rank's plan plus its samples located: 8 samples, batch_size 8.
    assert mine["trace_step_seconds"] >= mine["plan_seconds"] and mine["trace_step_samples"] == 8


@pytest.mark.timeout(150)
def test_plan_errors_are_clean(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [5])
    out = shardtool("plan", root, "--nodes", "8", "--ranks-per-node", "8", "--batch-size", "4")
    assert out.returncode == 1 and "too small" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.timeout(300)
def test_packed_plan_reports_the_remainder_in_pieces_and_tokens_and_counts_split_documents(tmp_path):
    """Issue 32's corpus at seq_len 1,024: one rank with drop_last no serves every token; the
    split count is of documents in more than one piece (it was doubled); a drop_last remainder is
    reported in the pieces and tokens it loses, as the loader's plan reports it."""
    import numpy as np

    from helpers.realtext import issue32_lengths
    from shardtool.pack.synthetic import write_synthetic
    from shardtool.plan import ArraySource, Batching, DataLayout, Layout, Planner
    from shardtool.plan.packing import Packing

    lengths = issue32_lengths()
    root = str(tmp_path / "d")
    write_synthetic(root, lengths.size, lengths=lengths, samples_per_shard=100)
    source = ArraySource(lengths, np.diff(np.append(np.arange(0, lengths.size, 100), lengths.size)))
    for ranks, drop in ((1, "no"), (3, "yes")):
        args = ["plan", root, "--ranks-per-node", str(ranks), "--batch-size", "4", "--seq-len", "1024"]
        out = shardtool(*args, "--drop-last", drop, "--json")
        assert out.returncode == 0, out.stderr
        rep = json.loads(out.stdout)
        dl = DataLayout.pure_dp(Layout(1, ranks))
        planner = Planner(source, Batching(batch_size=4, packing=Packing(1024), drop_last=drop == "yes"))
        plan = planner.group(dl, 0, 0)
        pos = np.concatenate([plan.rows.span_pos, plan.left_out.span_pos])
        assert rep["documents_split"] == int(np.count_nonzero(np.bincount(pos) > 1))
        assert rep["documents_split"] < lengths.size
        assert rep["remainder_tokens"] == plan.remainder_tokens == int(lengths.sum()) - plan.rows.tokens
        assert rep["remainder_pieces"] == plan.remainder_pieces == len(plan.left_out.span_pos)
        if drop == "no":
            assert rep["remainder_tokens"] == 0
        text = shardtool(*args, "--drop-last", drop)
        assert text.returncode == 0, text.stderr
        assert f"remainder     {rep['remainder_pieces']:,} pieces of documents" in text.stdout
        assert f"{rep['remainder_tokens']:,} tokens" in text.stdout
        assert f"documents     {rep['documents_split']:,} split into pieces" in text.stdout


@pytest.mark.timeout(300)
def test_plan_no_shuffle_with_a_token_budget_is_the_greedy_cut(tmp_path):
    """`shardtool plan --no-shuffle --max-tokens` on the quickstart's corpus planned 1,668
    batches where a greedy cut in order gives 600 (issue 32, item 5)."""
    import subprocess
    import sys

    import numpy as np

    from helpers.runcli import repo_env
    from shardtool.format import Dataset
    from shardtool.plan import Batching
    from shardtool.plan.batching import in_order_starts

    corpus = [sys.executable, "-m", "shardtool.benchmarks.corpus", "tokens", str(tmp_path / "raw"), "--n", "4000"]
    raw = subprocess.run(corpus, env=repo_env(), capture_output=True, text=True, timeout=120)
    assert raw.returncode == 0, raw.stderr
    packed = shardtool(
        "pack", str(tmp_path / "raw" / "tokens.parquet"), "-o", str(tmp_path / "d"), "--length", "tokens",
        "--samples-per-shard", "1500",
    )  # fmt: skip
    assert packed.returncode == 0, packed.stderr
    ds = Dataset(str(tmp_path / "d"))
    lengths = np.asarray(ds.lengths_range(0, len(ds)))
    for budget, ranks in ((65536, 1), (8192, 2)):
        greedy = in_order_starts(lengths, Batching(max_tokens=budget, shuffle=False)).size
        out = shardtool(
            "plan", str(tmp_path / "d"), "--no-shuffle", "--max-tokens", str(budget), "--ranks-per-node", str(ranks),
            "--drop-last", "no", "--json",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        rep = json.loads(out.stdout)
        # The greedy cut, split up to a multiple of the ranks; nothing left out.
        assert greedy <= rep["batches_per_rank"] * ranks <= greedy + ranks - 1, (rep["batches_per_rank"], greedy)
        assert rep["remainder_samples"] == 0


@pytest.mark.timeout(300)
def test_plan_with_a_cost_model_reports_the_time_steps_lose_to_the_slowest_rank(tmp_path):
    """Issue 33: on real long documents (issue 32's corpus of stdlib files and /usr/share/doc
    text) at seq_len 8,192 x 1 row on 8 ranks, the plan prints each step's max/mean cost across
    the DP ranks and the time lost waiting, without balancing and with it, as the loader would
    plan with that cost model."""
    from helpers.realtext import issue32_lengths
    from shardtool.pack.synthetic import write_synthetic

    lengths = issue32_lengths()
    root = str(tmp_path / "d")
    write_synthetic(root, lengths.size, lengths=lengths, samples_per_shard=100)
    args = ["plan", root, "--ranks-per-node", "8", "--batch-size", "1", "--seq-len", "8192", "--cost-model"]
    out = shardtool(*args, "params=7e9,layers=32,hidden=4096", "--json")
    assert out.returncode == 0, out.stderr
    bal = json.loads(out.stdout)["compute_balance"]
    assert bal["cost_model"] == {"a": 6 * 7e9, "b": 6 * 32 * 4096}
    plain, even = bal["unbalanced"], bal["balanced"]
    assert plain["dp_ranks"] == even["dp_ranks"] == 8 and plain["steps"] == even["steps"] > 0
    assert even["time_lost"] < plain["time_lost"] / 2 and even["max_over_mean_median"] < plain["max_over_mean_median"]
    text = shardtool(*args, "llama-7b")
    assert text.returncode == 0, text.stderr
    assert (
        f"unbalanced:  per-step max/mean cost over 8 DP ranks: median {plain['max_over_mean_median']:.3f}"
        in text.stdout
    )
    assert f"{even['time_lost']:.2%} of step time lost waiting for the slowest" in text.stdout
    # And what no order of the same batches could win back, which the balanced order is near.
    assert 0 <= even["time_lost_floor"] <= even["time_lost"] + 1e-12
    assert f"the least any order of these batches can lose: {even['time_lost_floor']:.2%}" in text.stdout
    bad = shardtool(*args, "gpt-17")
    assert bad.returncode == 1 and "--cost-model" in bad.stderr and "llama-7b" in bad.stderr
    alone = shardtool(*args[:-1], "--balance-window", "8")
    assert alone.returncode == 1 and "give --cost-model too" in alone.stderr


@pytest.mark.parametrize("floor, hinted", [(0.0001, False), (0.0467, True)])
def test_a_high_floor_in_the_plan_says_how_to_prepare_the_corpus(floor, hinted):
    """Across nodes, what no order wins back is what each node's range holds; where that is a
    point or more of step time, the report says what lowers it (docs/sequence-packing.md)."""
    from shardtool.cli._plan_report import print_balance

    side = {"dp_ranks": 64, "max_over_mean_median": 1.0, "max_over_mean_p90": 1.0, "max_over_mean_max": 1.0}
    report = {"unbalanced": {**side, "time_lost": 0.07}, "balanced": {**side, "time_lost": floor}}
    report["balanced"]["time_lost_floor"] = floor
    lines: list[str] = []
    print_balance(report, lines.append)
    text = "".join(lines)
    assert f"can lose: {floor:.2%}" in text
    assert ("store the corpus in a random order before packing" in text) is hinted
    assert "--nodes-per-group" not in text  # no layout given: nothing said of the groups
    for groups, said in ((8, hinted), (1, False)):
        lines.clear()
        print_balance(report, lines.append, {"nodes": 8, "data_groups": groups})
        assert ("--nodes-per-group K" in "".join(lines)) is said
    # Groups of 2 nodes already: the floor is between groups, and the hint asks for a larger K.
    lines.clear()
    print_balance(report, lines.append, {"nodes": 8, "data_groups": 4, "nodes_per_group": 2})
    text = "".join(lines)
    assert "in which documents each group's range holds" in text and "each node's range" not in text
    assert ("(4 data groups now, of 2 nodes: a larger K)" in text) is hinted
    # One data group (one node, or nodes reading one range): the corpus's storage sets no floor
    # there. A short balance window does, and the hint says so instead of blaming the corpus.
    for window, says in ((5, "a --balance-window of 5 steps deals each block on its own"), (None, "few costly rows")):
        lines.clear()
        print_balance({**report, "balance_window": window}, lines.append, {"nodes": 1, "data_groups": 1})
        text = "".join(lines)
        assert (says in text) is hinted and "random order before packing" not in text


@pytest.mark.timeout(300)
def test_plan_with_nodes_reading_one_range_together_balances_across_them(tmp_path):
    """`--nodes-per-group 4` on 4 nodes x 2 ranks (issue 33): one data group, every node caching
    all of its range, and the balanced steps lose less than with a group a node, whose floor the
    ranges' documents set."""
    from helpers.realtext import issue32_lengths
    from shardtool.pack.synthetic import write_synthetic

    lengths = issue32_lengths()
    root = str(tmp_path / "d")
    write_synthetic(root, lengths.size, lengths=lengths, samples_per_shard=100)
    args = ["plan", root, "--nodes", "4", "--ranks-per-node", "2", "--batch-size", "1", "--seq-len", "8192"]
    apart, together = (
        json.loads(shardtool(*args, "--cost-model", "llama-7b", "--json", *more).stdout)
        for more in ([], ["--nodes-per-group", "4"])
    )
    assert apart["layout"]["data_groups"] == 4 and apart["layout"]["nodes_per_group"] == 1
    assert together["layout"]["data_groups"] == 1 and together["layout"]["nodes_per_group"] == 4
    shards = len(json.load(open(os.path.join(root, "index.json")))["shards"])
    assert together["shards_per_node"] == {"min": shards, "max": shards} and apart["shards_per_node"]["max"] < shards
    lost = [r["compute_balance"]["balanced"]["time_lost"] for r in (apart, together)]
    assert lost[1] < lost[0], lost
    bad = shardtool(*args, "--nodes-per-group", "0")
    assert bad.returncode == 1 and "nodes_per_group must be an int >= 1" in bad.stderr
