"""An ImageFolder user's loader: real PNG icons packed with --label-from-dir read back through
ShardedLoader (bytes and labels, in and out of worker processes), batches that stack what
torch's default_collate stacks, and bucketing only where lengths are token counts."""

from __future__ import annotations

import io
import os

import numpy as np
import PIL.Image
import pytest
import torch

import shardtool
from helpers.data_gen import token_records, write_jsonl
from helpers.realdata import icon_tree
from shardtool.format.keys import path_key
from shardtool.loader import ShardedLoader
from shardtool.loader.collate import stack_column
from shardtool.plan import Batching


@pytest.fixture(scope="module")
def icons(tmp_path_factory):
    """(dataset path, {key: (class index, png bytes)}) of 30 real icons per class, 4 classes."""
    root = tmp_path_factory.mktemp("icons")
    made = icon_tree(root / "tree", per_class=30)
    classes = sorted(made)
    label = {}
    for cls, names in made.items():
        for n in names:
            with open(os.path.join(root, "tree", cls, n), "rb") as f:
                label[path_key(f"{cls}/{n}")] = (classes.index(cls), f.read())
    shardtool.pack(str(root / "tree"), str(root / "ds"), label_from_dir=True, samples_per_shard=50)
    return str(root / "ds"), label


def decode_resize(sample: dict) -> dict:
    """What an image pipeline does per sample: decode, convert, resize to one shape."""
    with PIL.Image.open(io.BytesIO(sample["png"])) as im:
        sample["png"] = np.asarray(im.convert("RGB").resize((24, 24)))
    return sample


def _loader(url, **kw):
    kw.setdefault("metrics", False)
    return ShardedLoader(url, rank=0, world_size=1, **kw)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_icon_comes_back_once_with_its_label(icons, num_workers):
    url, label = icons
    loader = _loader(url, batch_size=16, num_workers=num_workers)
    seen = []
    try:
        for batch in loader:
            assert isinstance(batch["cls"], torch.Tensor) and batch["cls"].dtype == torch.int64
            assert all(type(p) is bytes for p in batch["png"])
            for key, png, cls in zip(batch["__key__"], batch["png"], batch["cls"].tolist()):
                assert label[key] == (cls, png)
                seen.append(key)
    finally:
        loader.close()
    assert len(seen) == len(label) - len(loader.remainder) and len(set(seen)) == len(seen)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_decoded_equal_size_images_are_stacked_and_labels_are_a_long_tensor(icons, num_workers):
    url, label = icons
    loader = _loader(url, batch_size=8, num_workers=num_workers, transform=decode_resize, shuffle=False)
    try:
        batches = list(loader)
    finally:
        loader.close()
    assert len(batches) == len(label) // 8
    for b in batches:
        assert b["png"].shape == (8, 24, 24, 3) and b["png"].dtype == torch.uint8
        assert b["cls"].dtype == torch.int64 and b["cls"].shape == (8,)
        for k, key in enumerate(b["__key__"]):
            cls, png = label[key]
            assert b["cls"][k] == cls
            assert torch.equal(b["png"][k], torch.from_numpy(np.array(decode_resize({"png": png})["png"])))


def test_stack_column_stacks_what_default_collate_stacks():
    assert stack_column([1, 2, 3]).dtype == torch.int64
    assert stack_column([0.5, 1.5]).dtype == torch.float64
    assert stack_column([True, False]).dtype == torch.bool
    assert stack_column([np.float32(1), np.float32(2)]).dtype == torch.float32
    assert stack_column([np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32)]).shape == (2, 2, 3)
    t = stack_column([torch.zeros(3, 4, dtype=torch.bfloat16)] * 2)
    assert t.shape == (2, 3, 4) and t.dtype == torch.bfloat16
    # what does not stack stays the list
    for values in (
        [b"a", b"b"],
        ["x", "y"],
        [np.zeros(2), np.zeros(3)],
        [1, 2.5],
        [1, None],
        [2**70, 1],
        [np.array(["a"]), np.array(["b"])],
        [{"a": 1}, {"a": 2}],
    ):
        assert stack_column(values) is values


def _token_dataset(tmp_path) -> str:
    src = write_jsonl(str(tmp_path / "t.jsonl"), token_records(400, max_len=200))
    shardtool.pack(src, str(tmp_path / "tok"), length="tokens", samples_per_shard=100)
    return str(tmp_path / "tok")


def test_bucketing_is_off_by_default_for_images_and_on_for_tokens(icons, tmp_path):
    url, _ = icons
    images = _loader(url, batch_size=8, num_workers=0)
    tokens = _loader(_token_dataset(tmp_path), batch_size=8, num_workers=0)
    try:
        assert images.batching.bucketing is False  # lengths are byte sizes: nothing to pad
        assert tokens.batching.bucketing is True
        # explicit choices are honoured either way
        assert _loader(url, batch_size=8, num_workers=0, bucketing=True).batching.bucketing is True
        assert _loader(tokens.spec.url, batch_size=8, num_workers=0, bucketing=False).batching.bucketing is False
        assert _loader(tokens.spec.url, batch_size=8, num_workers=0, shuffle=False).batching.bucketing is False
        # a token dataset's batches are those of before: same config, same fingerprint
        assert tokens.batching == Batching(batch_size=8)
        assert tokens.batching.fingerprint() == Batching(batch_size=8).fingerprint()
    finally:
        images.close()
        tokens.close()


def test_image_batches_are_not_sorted_by_file_size(icons):
    """With bucketing, every batch would hold icons of like byte size (a window sorted by length)."""
    url, _ = icons
    loader = _loader(url, batch_size=8, num_workers=0, window=120)
    try:
        spreads = [float(b["lengths"].max() - b["lengths"].min()) for b in loader]
        lengths = loader.dataset.manifest.length["summary"]
    finally:
        loader.close()
    assert np.median(spreads) > 0.25 * (lengths["p90"] - lengths["p50"])
