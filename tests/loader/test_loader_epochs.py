"""Epochs as a trainer drives them: a consumer that stops after len(loader) batches, without ever
seeing StopIteration (Lightning does), must get the next epoch from its next iter()."""

from __future__ import annotations

import itertools

import pytest

from shardtool.loader import ShardedLoader
from test_loader_data import read_all, write_dataset


def _take_len(loader) -> list[list[str]]:
    """One epoch the way Lightning reads it: exactly len(loader) batches, then stop asking."""
    return [list(b["__key__"]) for b in itertools.islice(iter(loader), len(loader))]


@pytest.mark.parametrize("workers", [0, 2])
def test_stopping_at_len_then_iter_again_starts_the_next_epoch(tmp_path, workers):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 13, 7])
    ld = ShardedLoader(root, batch_size=4, num_workers=workers, timeout=60)
    epochs = [_take_len(ld) for _ in range(3)]
    want = []
    for e in range(3):
        fresh = ShardedLoader(root, batch_size=4, num_workers=0)
        fresh.set_epoch(e)
        want.append(read_all(fresh))
    assert epochs == want
    assert all(len(e) == len(want[0]) > 0 for e in epochs)
    assert ld.epoch == 3
    ld.close()


def test_position_after_len_batches_is_the_next_epoch_start(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 13])
    ld = ShardedLoader(root, batch_size=4, num_workers=0)
    _take_len(ld)
    assert ld.epoch == 1
    resumed = ShardedLoader(root, batch_size=4, num_workers=0)
    resumed.load_state_dict(ld.state_dict())
    assert resumed.epoch == 1 and read_all(resumed) == _take_len(ld)
    # set_epoch to the epoch just finished starts it over (as after StopIteration); to the next one
    # is a no-op on a fresh position.
    ld.set_epoch(1)
    again = ShardedLoader(root, batch_size=4, num_workers=0)
    again.set_epoch(1)
    assert read_all(ld) == read_all(again)


def test_breaking_out_mid_epoch_and_iterating_again_continues_without_repeats(tmp_path):
    root, _ = write_dataset(str(tmp_path / "d"), [20, 13])
    ld = ShardedLoader(root, batch_size=4, num_workers=2, timeout=60)
    first = [list(b["__key__"]) for b in itertools.islice(iter(ld), 3)]
    rest = read_all(ld)  # the previous pass's workers are shut down, the position kept
    whole = read_all(ShardedLoader(root, batch_size=4, num_workers=0))
    assert first + rest == whole
    ld.close()


def test_lightning_max_epochs_trains_every_epoch_in_full(tmp_path):
    """Trainer(max_epochs=3) on a ShardedLoader: each epoch gets len(loader) batches, the epochs
    are the loader's epochs 0, 1, 2 (Lightning stops at len() and calls set_epoch on no loader)."""
    import lightning as L
    import torch

    root, _ = write_dataset(str(tmp_path / "d"), [20, 13, 7])
    loader = ShardedLoader(root, batch_size=4, num_workers=0)
    seen: list[tuple[int, list[str]]] = []

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, i):
            seen.append((self.current_epoch, list(batch["__key__"])))
            return (self.w * batch["tokens"].float().mean()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            return loader

    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Tiny())
    want = []
    for e in range(3):
        fresh = ShardedLoader(root, batch_size=4, num_workers=0)
        fresh.set_epoch(e)
        want.append(read_all(fresh))
    got = [[keys for epoch, keys in seen if epoch == e] for e in range(3)]
    assert got == want and trainer.global_step == sum(len(w) for w in want)
