"""Image-text pairs through packing (issue 37, item 3): real PNG icons of five sizes with captions
from their file names, as WebDataset tar pairs (``0001.png`` + ``0001.txt``). Each image costs a
token per 8×8 patch of its size (read from its header at pack time); packed rows reserve those
places, and every batch carries each image once per pass, in the row of its caption."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.realdata import ICONS
from helpers.runcli import shardtool_cli
from helpers.skips import require
from helpers.webtars import write_tar
from shardtool.format import BadSampleError, Dataset, ShardtoolError
from shardtool.loader import ShardedLoader
from shardtool.loader.packed import block_causal_mask, lean_to_full
from shardtool.pack import pack
from shardtool.plan.packing import Packing, pack_rows

SIZES = (16, 24, 32, 48, 64)
PATCH = 8
SPECIALS = ["[UNK]", "<eos>", "<image>"]


def icon_pairs(limit: int = 240) -> list[tuple[str, bytes, str, int]]:
    """(key, PNG bytes, caption, side) of real icons, sizes taken in turn."""
    require(os.path.isdir(ICONS), "real PNG icons not installed (apt-get install adwaita-icon-theme)")
    root = os.path.dirname(ICONS)
    out = []
    for cat in ("actions", "status", "devices"):
        names = sorted(n for n in os.listdir(os.path.join(root, "16x16", cat)) if n.endswith(".png"))
        for n in names:
            side = SIZES[len(out) % len(SIZES)]
            path = os.path.join(root, f"{side}x{side}", cat, n)
            if not os.path.isfile(path):
                continue
            words = n.split(".")[0].replace("-symbolic", "").replace("-", " ")
            out.append((f"i{len(out):04d}", open(path, "rb").read(), f"{cat}: {words}", side))
            if len(out) == limit:
                return out
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("imagetext")
    items = icon_pairs()
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([c for _, _, c, _ in items], trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS))
    tok.save(str(root / "tokenizer.json"))
    tars = [
        write_tar(
            str(root / f"pairs-{s:03d}.tar"), [(k, {"png": png, "txt": c.encode()}) for k, png, c, _ in items[s::3]]
        )
        for s in range(3)
    ]
    ds = str(root / "ds")
    res = shardtool_cli(
        "pack", *tars, "-o", ds, "--tokenizer", str(root / "tokenizer.json"), "--text-field", "txt",
        "--image-field", "png", "--image-patch", str(PATCH), "--image-max-tokens", "64", "--eos-id", "1",
        timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    info = {k: (png, c, side) for k, png, c, side in items}
    return ds, info, tok


def test_pack_reserves_each_images_patches_before_its_caption(pairs):
    ds, info, tok = pairs
    d = Dataset(ds)
    assert d.manifest.length["image"] == {"field": "png", "token_id": 2, "patch": PATCH, "max": 64}
    n = 0
    for s in range(len(d.manifest.shards)):
        idx = d.shard_index(s)
        for i in range(d.manifest.shards[s].samples):
            sample = d.read(s, i)
            png, caption, side = info[sample["__key__"]]
            k = math.ceil(side / PATCH) ** 2
            want = [2] * k + tok.encode(caption).ids + [1]
            assert sample["tokens"].tolist() == want and sample["png"] == png
            assert idx.lengths[i] == len(want)  # the plan counts the image like text
            n += 1
    assert n == len(info)
    res = shardtool_cli("verify", ds, timeout=120)  # lengths, hashes and index against the shards
    assert res.returncode == 0, res.stderr


def check_batch(batch: dict, info: dict, tok, seq: int) -> list[str]:
    """Every image against its sample: its placeholders where the batch says, its bytes, its caption
    right after it in the same row; labels never target an image. Returns the images' keys."""
    ids, mask = batch["input_ids"], batch["image_mask"]
    assert torch.equal(mask, ids == 2)
    keys = [k for row in batch["__key__"] for k in row]
    cu = batch["cu_seqlens"].tolist()
    seen = []
    for j, img in enumerate(batch["images"]):
        r, o, k = (int(batch[f][j]) for f in ("image_rows", "image_offsets", "image_tokens"))
        at = r * seq + o
        piece = next(p for p in range(len(keys)) if cu[p] <= at < cu[p + 1])
        key = keys[piece]
        png, caption, side = info[key]
        assert img == png and k == math.ceil(side / PATCH) ** 2 and at == cu[piece]
        assert bool(mask[r, o : o + k].all()) and (o + k == seq or not bool(mask[r, o + k]))
        text = tok.encode(caption).ids
        assert ids[r, o + k : o + k + len(text)].tolist() == text
        assert int(batch["labels"][r, o + k - 1]) == text[0]  # the caption is trained from the image
        seen.append(key)
    assert bool((batch["labels"][:, :-1][mask[:, 1:]] == -100).all())
    return seen


@pytest.mark.parametrize("seq, world, workers", [(256, 1, 0), (1024, 2, 2)])
def test_every_image_once_per_pass_in_the_row_of_its_caption(pairs, seq, world, workers):
    ds, info, tok = pairs
    seen = []
    for rank in range(world):
        ld = ShardedLoader(
            ds, seq_len=seq, batch_size=2, packing="no-split", num_workers=workers, rank=rank, world_size=world,
            drop_last=False,
        )  # fmt: skip
        for batch in ld:
            seen += check_batch(batch, info, tok, seq)
        ld.close()
    assert sorted(seen) == sorted(info)


def test_lean_batches_and_image_transforms(pairs):
    ds, info, tok = pairs
    kw = dict(seq_len=512, batch_size=2, packing="no-split", rank=0, world_size=1, num_workers=2)
    full = ShardedLoader(ds, **kw)
    lean = ShardedLoader(ds, packed_outputs="lean", image_transform=len, **kw)
    for a, b in zip(full, lean):
        derived = lean_to_full(b)
        assert torch.equal(derived["labels"], a["labels"]) and torch.equal(b["image_mask"], a["image_mask"])
        assert b["images"] == [len(x) for x in a["images"]]  # the transform ran in the workers
    full.close()
    lean.close()


def test_a_tiny_vision_language_model_consumes_a_batch(pairs):
    """A linear patch embed and a one-layer causal transformer: the images' patches take the
    image positions, in batch order; the loss reaches the patch embed."""
    from PIL import Image

    ds, info, tok = pairs

    def patches(png: bytes) -> torch.Tensor:
        import io

        im = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32) / 255
        h, w = im.shape[:2]
        t = torch.from_numpy(im).permute(2, 0, 1).reshape(3, h // PATCH, PATCH, w // PATCH, PATCH)
        return t.permute(1, 3, 0, 2, 4).reshape(-1, 3 * PATCH * PATCH)  # [K, 192], row-major patches

    ld = ShardedLoader(ds, seq_len=512, batch_size=2, packing="no-split", rank=0, world_size=1, num_workers=2,
                       image_transform=patches)  # fmt: skip
    batch = next(iter(ld))
    ld.close()
    dim, vocab = 32, tok.get_vocab_size()
    torch.manual_seed(0)
    embed, patch_embed = torch.nn.Embedding(vocab, dim), torch.nn.Linear(3 * PATCH * PATCH, dim)
    layer = torch.nn.TransformerEncoderLayer(dim, 4, 64, batch_first=True)
    head = torch.nn.Linear(dim, vocab)
    x = embed(batch["input_ids"])
    feats = patch_embed(torch.cat(batch["images"]))
    assert feats.shape[0] == int(batch["image_tokens"].sum()) == int(batch["image_mask"].sum())
    x = x.masked_scatter(batch["image_mask"][..., None], feats)
    allowed = block_causal_mask(batch)[:, 0]  # [B, S, S], True = may attend
    h = layer(x, src_mask=(~allowed).repeat_interleave(4, dim=0))
    loss = F.cross_entropy(head(h).view(-1, vocab), batch["labels"].view(-1))
    loss.backward()
    assert torch.isfinite(loss) and patch_embed.weight.grad.abs().sum() > 0


def test_realistic_image_text_mix_fills_rows(pairs):
    """Captions of 10-60 tokens with images of 64-576 tokens pack into rows at least 99% full."""
    rng = np.random.default_rng(37)
    lengths = rng.integers(10, 61, 20000) + rng.integers(64, 577, 20000)
    for seq in (4096, 8192):
        rows = pack_rows(lengths, Packing(seq, "no-split"))
        fill = int(rows.span_len.sum()) / (rows.num_rows * seq)
        assert fill >= 0.99, (seq, fill)


def test_refusals_name_what_is_wrong(pairs, tmp_path):
    ds, info, tok = pairs
    with pytest.raises(ValueError, match="would cut an image across rows; use packing='no-split'"):
        ShardedLoader(ds, seq_len=512, batch_size=2, rank=0, world_size=1)
    with pytest.raises(ValueError, match="'png' holds the samples' images"):
        ShardedLoader(ds, seq_len=512, batch_size=2, packing="no-split", rank=0, world_size=1, token_fields=["png"])
    plain = str(tmp_path / "plain")
    pack([{"tokens": np.arange(5, dtype=np.int32)}] * 4, plain, length="tokens")
    with pytest.raises(ValueError, match="image_transform is for image-text datasets"):
        ShardedLoader(plain, seq_len=64, batch_size=2, rank=0, world_size=1, image_transform=len)
    bad = write_tar(str(tmp_path / "bad-000.tar"), [("a1", {"png": b"not a png", "txt": b"x"})])
    with pytest.raises(BadSampleError, match=r"bad-000.tar.*--image-field 'png': not a readable image"):
        pack(bad, str(tmp_path / "o"), tokenizer=os.path.join(os.path.dirname(ds), "tokenizer.json"),
             text_field="txt", image_field="png", image_patch=8)  # fmt: skip


def test_the_image_text_example_runs(tmp_path):
    import subprocess
    import sys

    from helpers.torchrun import ROOT

    cmd = [sys.executable, os.path.join(ROOT, "examples", "image_text.py"), "--work", str(tmp_path / "w")]
    done = subprocess.run([*cmd, "--samples", "120", "--steps", "3"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "image tokens" in done.stdout and done.stdout.rstrip().endswith("ok")


def test_a_parquet_column_of_image_bytes_packs_the_same(pairs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    ds, info, tok = pairs
    keys = sorted(info)[:50]
    table = pa.table({"id": keys, "png": [info[k][0] for k in keys], "txt": [info[k][1] for k in keys]})
    pq.write_table(table, str(tmp_path / "pairs.parquet"))
    out = str(tmp_path / "pq")
    tokenizer = os.path.join(os.path.dirname(ds), "tokenizer.json")
    pack(str(tmp_path / "pairs.parquet"), out, tokenizer=tokenizer, text_field="txt", image_field="png",
         image_patch=PATCH, image_max_tokens=64, eos_id=1, key="id")  # fmt: skip
    from_parquet = Dataset(out)
    for i, key in enumerate(keys):
        got = from_parquet.read(0, i)
        assert got["__key__"] == key and got["png"] == info[key][0]
        side = info[key][2]
        assert got["tokens"].tolist() == [2] * math.ceil(side / PATCH) ** 2 + tok.encode(info[key][1]).ids + [1]
    ld = ShardedLoader(out, seq_len=512, batch_size=2, packing="no-split", rank=0, world_size=1, num_workers=0,
                       drop_last=False)  # fmt: skip
    assert sorted(k for b in ld for k in check_batch(b, info, tok, 512)) == keys
    ld.close()


def test_interleaved_documents_keep_their_images_in_order(pairs, tmp_path):
    """Documents of text and images in turn (an intro, then image, caption, image, caption …), from
    Parquet (image bytes in a list of structs) and from JSONL (image paths beside the file)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    ds, info, tok = pairs
    keys = sorted(info)
    docs = []
    for d in range(40):
        chosen = keys[d * 3 : d * 3 + 1 + d % 3]  # one to three images each
        parts = [{"text": f"document {d} shows {len(chosen)} icons", "image": None}]
        for k in chosen:
            parts += [{"text": None, "image": info[k][0]}, {"text": info[k][1], "image": None}]
        docs.append((f"d{d:03d}", parts, chosen))
    pq.write_table(
        pa.table({"id": [k for k, _, _ in docs], "parts": [p for _, p, _ in docs]}), str(tmp_path / "docs.parquet")
    )
    with open(tmp_path / "docs.jsonl", "w") as f:
        for key, parts, chosen in docs:
            for k in chosen:
                (tmp_path / f"{k}.png").write_bytes(info[k][0])
            names = iter(chosen)
            rows = [p["text"] if p["text"] is not None else {"image": f"{next(names)}.png"} for p in parts]
            f.write(json.dumps({"id": key, "parts": rows}) + "\n")
    tokenizer = os.path.join(os.path.dirname(ds), "tokenizer.json")
    outs = []
    for src in ("docs.parquet", "docs.jsonl"):
        out = str(tmp_path / src.replace(".", "_"))
        pack(str(tmp_path / src), out, tokenizer=tokenizer, interleaved_field="parts", image_patch=PATCH,
             eos_id=1, key="id")  # fmt: skip
        outs.append(out)
    a, b = Dataset(outs[0]), Dataset(outs[1])
    assert a.manifest.length["image"]["sizes"] == "image_bytes"
    for i, (key, parts, chosen) in enumerate(docs):
        x, y = a.read(0, i), b.read(0, i)
        want = []
        for p in parts:
            if p["text"] is not None:
                want += tok.encode(p["text"]).ids
            else:
                side = next(info[k][2] for k in keys if info[k][0] == p["image"])
                want += [2] * math.ceil(side / PATCH) ** 2
        assert x["tokens"].tolist() == want + [1] and np.array_equal(x["tokens"], y["tokens"])
        assert x["images"] == y["images"] == b"".join(info[k][0] for k in chosen)
    ld = ShardedLoader(outs[1], seq_len=1024, batch_size=2, packing="no-split", rank=0, world_size=1, num_workers=2,
                       drop_last=False)  # fmt: skip
    by_key = {key: chosen for key, _, chosen in docs}
    served = {}
    for batch in ld:
        keys_flat = [k for row in batch["__key__"] for k in row]
        cu = batch["cu_seqlens"].tolist()
        for j, img in enumerate(batch["images"]):
            r, o, n = (int(batch[f][j]) for f in ("image_rows", "image_offsets", "image_tokens"))
            at = r * 1024 + o
            doc = keys_flat[next(p for p in range(len(keys_flat)) if cu[p] <= at < cu[p + 1])]
            served.setdefault(doc, []).append(img)
            caption = tok.encode(info[by_key[doc][len(served[doc]) - 1]][1]).ids
            assert batch["input_ids"][r, o + n : o + n + len(caption)].tolist() == caption
    ld.close()
    assert served == {key: [info[k][0] for k in chosen] for key, chosen in by_key.items()}


def test_bad_interleaved_parts_are_named(pairs, tmp_path):
    import json

    ds, info, tok = pairs
    tokenizer = os.path.join(os.path.dirname(ds), "tokenizer.json")
    for i, parts in enumerate(
        [["intro", {"image": "missing.png"}], ["intro", {"text": "a", "image": "x.png"}], "text"]
    ):
        src = tmp_path / f"bad{i}.jsonl"
        src.write_text(json.dumps({"parts": ["fine"]}) + "\n" + json.dumps({"parts": parts}) + "\n")
        want = ["image 'missing.png' cannot be read", "part 1 is neither text nor one image", "is not a list of text"][
            i
        ]
        with pytest.raises(BadSampleError, match=rf"bad{i}.jsonl \(line 2\).*{want}"):
            pack(str(src), str(tmp_path / f"o{i}"), tokenizer=tokenizer, interleaved_field="parts", image_tokens=4)
        assert not os.path.exists(tmp_path / f"o{i}" / "index.json")


def test_a_mixture_carries_its_image_sources_images(pairs, tmp_path):
    """An image-text source mixed with a text-only one (the captions alone): each step's images are
    those of the image source's rows, at their rows of the step."""
    import json

    from shardtool.plan.mixture import Mixture

    ds, info, tok = pairs
    with open(tmp_path / "captions.jsonl", "w") as f:
        for key in sorted(info):
            f.write(json.dumps({"id": f"t{key}", "text": info[key][1]}) + "\n")
    text = str(tmp_path / "text")
    tokenizer = os.path.join(os.path.dirname(ds), "tokenizer.json")
    pack(str(tmp_path / "captions.jsonl"), text, tokenizer=tokenizer, text_field="text", key="id", eos_id=1)
    mix = Mixture({"img": (ds, 0.6), "txt": (text, 0.4)})
    ld = ShardedLoader(
        mix, seq_len=512, batch_size=4, packing="no-split", steps=12, rank=0, world_size=1, num_workers=2
    )
    images = 0
    for batch in ld:
        got = check_batch(batch, info, tok, 512)
        assert all(batch["__source__"][int(r)] == "img" for r in batch["image_rows"])
        images += len(got)
    ld.close()
    assert images > 0
    with pytest.raises(ValueError, match="mixture source 'img'.*use packing='no-split'"):
        ShardedLoader(mix, seq_len=512, batch_size=4, steps=12, rank=0, world_size=1)
    with pytest.raises(ValueError, match="seq_len by step is not supported for image-text sources"):
        ShardedLoader(mix, seq_len={0: 256, 6: 512}, batch_size=4, packing="no-split", steps=12, rank=0, world_size=1)


def test_an_image_folder_is_captioned_by_its_class_names(pairs, tmp_path):
    """Real icons in class folders (torchvision's ImageFolder layout): each image's caption is its
    class's name; the label stays beside it."""
    from helpers.realdata import icon_tree

    ds, info, tok = pairs
    made = icon_tree(str(tmp_path / "tree"), per_class=12)
    out = str(tmp_path / "folder")
    tokenizer = os.path.join(os.path.dirname(ds), "tokenizer.json")
    pack(str(tmp_path / "tree"), out, label_from_dir=True, tokenizer=tokenizer, image_field="png", image_patch=PATCH,
         eos_id=1)  # fmt: skip
    d = Dataset(out)
    classes = d.manifest.extra["classes"]
    assert classes == sorted(made)
    n = 0
    for s in range(len(d.manifest.shards)):
        for i in range(d.manifest.shards[s].samples):
            sample = d.read(s, i)
            k = math.ceil(48 / PATCH) ** 2  # the tree's icons are 48x48
            assert sample["tokens"].tolist() == [2] * k + tok.encode(classes[sample["cls"]]).ids + [1]
            n += 1
    assert n == sum(len(v) for v in made.values())
    ld = ShardedLoader(out, seq_len=256, batch_size=2, packing="no-split", rank=0, world_size=1, num_workers=0,
                       drop_last=False)  # fmt: skip
    assert sum(len(b["images"]) for b in ld) == n
    ld.close()
    with pytest.raises(ShardtoolError, match="or with their class names"):
        pack(str(tmp_path / "tree"), str(tmp_path / "x"), tokenizer=tokenizer, image_field="png", image_patch=PATCH)
