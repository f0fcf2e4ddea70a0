"""The loader's keywords are checked in one place (`shardtool.loader.options`) before any file is
opened: each wrong combination is refused naming the keyword, and the right ones make the
`Batching` the plan runs with."""

from __future__ import annotations

import pytest

from shardtool.loader import ShardedLoader
from shardtool.loader.options import WorkerOptions, batch_options, worker_options
from shardtool.plan import Batching
from shardtool.plan.packing import Packing

BASE = dict(
    batch_size=None,
    max_tokens=4096,
    shuffle=True,
    seed=3,
    window=None,
    bucketing=None,
    seq_len=None,
    packing="best-fit",
    eos_id=None,
    max_docs_per_row=None,
    packed_outputs="full",
    drop_last=None,
    cost_model=None,
    balance_window=None,
    micro_batches=None,
    shuffle_block=None,
    transform=None,
    collate_fn=None,
    pad_id=0,
)


def test_the_keywords_make_the_plans_batching():
    opts = batch_options(**BASE)
    assert opts.batching == Batching(max_tokens=4096, seed=3) and opts.packing is None
    packed = batch_options(**{**BASE, "max_tokens": None, "batch_size": 4, "seq_len": 1024, "eos_id": 2})
    assert packed.packing == Packing(1024, "best-fit", eos_id=2) and packed.batching.batch_size == 4
    balanced = batch_options(**{**BASE, "cost_model": "llama-7b", "micro_batches": 2})
    assert balanced.batching.balance is not None and balanced.batching.micro_batches == 2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seq_len": 512, "batch_size": 2, "max_tokens": None, "transform": len}, "transform and collate_fn"),
        ({"packed_outputs": "thin"}, "packed_outputs must be 'full' or 'lean'"),
        ({"packed_outputs": "lean"}, "is for packed rows: give seq_len"),
        ({"batch_size": 4}, "batch_size"),  # and max_tokens: exactly one
        ({"micro_batches": 2}, "give a cost model too"),
    ],
)
def test_a_wrong_combination_is_refused_naming_the_keyword(change, message):
    with pytest.raises(ValueError, match=message):
        batch_options(**{**BASE, **change})


def test_worker_keywords():
    assert worker_options(0, 0, False, 5) == WorkerOptions(0, 0, False, 5.0)  # no workers: no prefetch to check
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        worker_options(True, 2, False, 1)
    with pytest.raises(ValueError, match="prefetch_factor must be an int >= 1"):
        worker_options(2, 0, False, 1)


def test_the_loader_refuses_them_before_opening_anything(tmp_path):
    missing = str(tmp_path / "no-such-dataset")  # never opened: the keywords fail first
    with pytest.raises(ValueError, match="packed_outputs='lean' is for packed rows"):
        ShardedLoader(missing, max_tokens=4096, packed_outputs="lean", rank=0, world_size=1)
    with pytest.raises(ValueError, match="num_workers must be an int >= 0"):
        ShardedLoader(missing, max_tokens=4096, num_workers=-1, rank=0, world_size=1)
