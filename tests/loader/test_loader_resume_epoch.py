"""The resume trap: a checkpoint taken on the last batch of an epoch, resumed with the script's
own epoch counter, must not replay that epoch silently."""

from __future__ import annotations

import pytest

from shardtool.loader import LoaderStateError, ShardedLoader
from test_loader_data import read_all, write_dataset


def _train_one_epoch_checkpointing_every_step(root):
    """A DataLoader-style script: ckpt = {"epoch": epoch, "loader": ...} after every step."""
    ld = ShardedLoader(root, batch_size=4, num_workers=0)
    ckpt = None
    epoch = 0
    ld.set_epoch(epoch)
    for _ in ld:
        ckpt = {"epoch": epoch, "loader": ld.state_dict()}
    return ckpt


def test_set_epoch_behind_a_loaded_state_is_refused_naming_the_fix(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 13])
    ckpt = _train_one_epoch_checkpointing_every_step(root)
    ld = ShardedLoader(root, batch_size=4, num_workers=0)
    ld.load_state_dict(ckpt["loader"])
    assert ld.epoch == 1  # the last batch of epoch 0 was served: the state is the start of epoch 1
    with pytest.raises(LoaderStateError, match=r"set_epoch\(0\).*epoch 1.*start_epoch = loader.epoch"):
        ld.set_epoch(ckpt["epoch"])  # the usual start_epoch = ckpt["epoch"]: would replay epoch 0
    # The loader is untouched by the refusal, and the documented resume goes on with epoch 1.
    ld.set_epoch(ld.epoch)
    fresh = ShardedLoader(root, batch_size=4, num_workers=0)
    fresh.set_epoch(1)
    assert read_all(ld) == read_all(fresh)


def test_a_mid_epoch_state_also_refuses_an_earlier_epoch(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 13])
    ld = ShardedLoader(root, batch_size=4, num_workers=0)
    ld.set_epoch(2)
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    resumed = ShardedLoader(root, batch_size=4, num_workers=0)
    resumed.load_state_dict(state)
    with pytest.raises(LoaderStateError, match=r"set_epoch\(1\)"):
        resumed.set_epoch(1)
    resumed.set_epoch(2)  # the loaded epoch: keeps the position
    assert len(resumed) == len(ld) and resumed.batches_left == len(ld) - 1


def test_going_back_is_allowed_once_the_resumed_loader_has_been_iterated_or_without_a_state(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 13])
    ckpt = _train_one_epoch_checkpointing_every_step(root)
    ld = ShardedLoader(root, batch_size=4, num_workers=0)
    ld.load_state_dict(ckpt["loader"])
    epoch1 = read_all(ld)
    ld.set_epoch(0)  # a deliberate choice after the resume took effect: epoch 0 again
    epoch0 = read_all(ShardedLoader(root, batch_size=4, num_workers=0))
    assert read_all(ld) == epoch0 and epoch1 != epoch0
    plain = ShardedLoader(root, batch_size=4, num_workers=0)
    plain.set_epoch(3)
    plain.set_epoch(0)  # no loaded state: any epoch, as before
