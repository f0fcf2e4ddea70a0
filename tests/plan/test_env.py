"""The one environment reader: a rank's placement (loader), a node's (warmer), a job-array task's (pack)."""

import pytest

from shardtool.plan import Layout, LayoutError, Placement, array_task, node_placement, rank_placement
from shardtool.plan.env import slurm_tasks_per_node


@pytest.mark.parametrize("raw, expected", [("8", 8), ("2(x3)", 2), ("2(x3),2", 2), (" 4 ", 4), ("2,2", 2)])
def test_slurm_tasks_per_node_forms(raw, expected):
    assert slurm_tasks_per_node({"SLURM_NTASKS_PER_NODE": raw}) == expected
    assert slurm_tasks_per_node({"SLURM_TASKS_PER_NODE": raw}) == expected


@pytest.mark.parametrize("raw", ["2(x3),1", "4,2"])
def test_uneven_allocations_are_refused_with_a_clear_message(raw):
    with pytest.raises(LayoutError, match="uneven tasks per node"):
        slurm_tasks_per_node({"SLURM_TASKS_PER_NODE": raw})
    with pytest.raises(LayoutError, match="uneven"):
        rank_placement(env={"SLURM_PROCID": "0", "SLURM_NTASKS": "7", "SLURM_TASKS_PER_NODE": raw})
    with pytest.raises(LayoutError, match="uneven"):
        node_placement(env={"SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": raw})


@pytest.mark.parametrize("raw", ["x", "2(3)", "(x2)"])
def test_malformed_task_counts_are_refused(raw):
    with pytest.raises(LayoutError, match="must look like"):
        slurm_tasks_per_node({"SLURM_NTASKS_PER_NODE": raw})


def test_ntasks_per_node_wins_over_tasks_per_node():
    env = {"SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}
    p = rank_placement(env=env)
    assert (p.rank, p.layout, p.node, p.source) == (5, Layout(2, 4), 1, "SLURM")


def test_rank_placement_source_says_where_values_came_from():
    assert rank_placement(env={}).source == "default"
    assert rank_placement(rank=0, world_size=2, ranks_per_node=2, env={}).source == "arguments"
    assert rank_placement(rank=1, env={"RANK": "0", "WORLD_SIZE": "2"}).source == "arguments and torchrun"


def test_node_placement_from_slurm_and_precedence():
    env = {"SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2", "SLURM_NTASKS_PER_NODE": "8(x4)"}
    p = node_placement(env=env)
    assert (p.node, p.layout) == (2, Layout(4, 8))
    assert "SLURM_JOB_NUM_NODES" in p.source and "SLURM_NODEID" in p.source
    p = node_placement(num_nodes=2, node=1, env=env)
    assert (p.node, p.layout) == (1, Layout(2, 8))
    p = node_placement(env={"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4"})
    assert (p.node, p.layout) == (1, Layout(2, 4))
    alone = node_placement(env={})
    assert (alone.node, alone.layout) == (0, Layout(1, 1)) and alone.source.startswith("default: one node")
    assert "from default: one node" in alone.describe()


@pytest.mark.parametrize(
    "kw, env",
    [
        ({"num_nodes": 4}, {}),  # several nodes, no rank (a prolog has no SLURM_NODEID)
        ({"num_nodes": 2, "node": 2}, {}),
        ({"node": 1}, {}),
        ({}, {"SLURM_JOB_NUM_NODES": "x"}),
        ({}, {"SLURM_JOB_NUM_NODES": "2(x2)", "SLURM_NODEID": "0"}),
    ],
)
def test_node_placement_errors(kw, env):
    with pytest.raises(LayoutError):
        node_placement(env=env, **kw)


def test_placement_is_consistent():
    with pytest.raises(ValueError, match="lives on node"):
        Placement(Layout(2, 2), node=0, rank=3)
    with pytest.raises(ValueError, match="node must be"):
        Placement(Layout(2, 2), node=2)


_STEPPED = {
    "SLURM_ARRAY_TASK_COUNT": "3",
    "SLURM_ARRAY_TASK_MIN": "0",
    "SLURM_ARRAY_TASK_MAX": "10",
    "SLURM_ARRAY_TASK_STEP": "5",
}
# sbatch --array=1,3,7: SLURM gives MIN 1, MAX 7 and 3 tasks, and no place for each
_LISTED = {"SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "7"}


@pytest.mark.parametrize(
    "args, env, expected",
    [
        ((None, None), {}, (1, 0)),
        ((4, 2), {"SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_ID": "5"}, (4, 2)),
        ((None, None), {"SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_ID": "5"}, (8, 5)),
        (
            (None, None),
            {"SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_MIN": "1"},
            (8, 5),
        ),
        ((None, None), {"SLURM_ARRAY_TASK_COUNT": "1", "SLURM_ARRAY_TASK_ID": "3"}, (1, 0)),
        # sbatch --array=0-10:5: tasks 0, 5 and 10 are places 0, 1 and 2
        ((None, None), {**_STEPPED, "SLURM_ARRAY_TASK_ID": "10"}, (3, 2)),
        ((None, None), {**_STEPPED, "SLURM_ARRAY_TASK_ID": "5"}, (3, 1)),
        ((2, 1), {**_LISTED, "SLURM_ARRAY_TASK_ID": "3"}, (2, 1)),  # explicit: the list is not read
    ],
)
def test_array_task(args, env, expected):
    assert array_task(*args, env=env) == expected


@pytest.mark.parametrize(
    "args, env, message",
    [
        ((0, None), {}, "num-tasks"),
        ((2, 2), {}, "task-index 2 is outside"),
        ((None, None), {"SLURM_ARRAY_TASK_COUNT": "two"}, "must be an integer"),
        ((None, None), {**_LISTED, "SLURM_ARRAY_TASK_ID": "3"}, r"not the range 1-7 \(a listed array.*--task-index"),
        ((None, None), {**_STEPPED, "SLURM_ARRAY_TASK_ID": "4"}, "4 is not in the array 0-10:5"),
    ],
)
def test_array_task_errors(args, env, message):
    with pytest.raises(LayoutError, match=message):
        array_task(*args, env=env)
