"""Image-text pairs through packing: each image's tokens reserved in the rows, a tiny VLM trained.

Writes WebDataset tars of image-caption pairs (``0001.png`` + ``0001.txt``): the Adwaita icon
theme's PNGs in five sizes, captioned by their file names (or, without the theme, shapes drawn
with Pillow), trains a small tokenizer on the captions, and packs them with
``shardtool pack pairs-*.tar --tokenizer tok.json --text-field txt --image-field png
--image-patch 8``: each sample's tokens are one ``<image>`` placeholder per 8×8 patch of its image
(its size read from the PNG header), then its caption. The loader packs the samples into rows of
``--seq-len`` tokens (``no-split``: an image is never cut) and hands each batch its images,
turned into patch vectors by ``image_transform`` in the workers. A linear patch embed and a
one-layer causal transformer train on the captions for a few steps. Needs the ``tokenize`` and
``vision`` extras (``pip install -e ".[tokenize,vision]"``).

    python examples/image_text.py [--work DIR] [--seq-len 512] [--steps 20]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tarfile

import numpy as np
import torch
import torch.nn.functional as F

from shardtool.loader import ShardedLoader
from shardtool.loader.packed import block_causal_mask
from shardtool.pack import pack

ICONS = "/usr/share/icons/Adwaita"
SIZES = (16, 24, 32, 48, 64)
PATCH = 8


def pairs(limit: int) -> list[tuple[bytes, str]]:
    """(PNG bytes, caption): real icons where the theme is installed, else drawn shapes."""
    out = []
    if os.path.isdir(os.path.join(ICONS, "16x16")):
        for cat in ("actions", "status", "devices", "places"):
            for name in sorted(os.listdir(os.path.join(ICONS, "16x16", cat))):
                side = SIZES[len(out) % len(SIZES)]
                path = os.path.join(ICONS, f"{side}x{side}", cat, name)
                if name.endswith(".png") and os.path.isfile(path):
                    words = name.split(".")[0].replace("-symbolic", "").replace("-", " ")
                    out.append((open(path, "rb").read(), f"{cat}: {words}"))
                if len(out) == limit:
                    return out
        return out
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)
    colors = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "black": (0, 0, 0)}
    for i in range(limit):
        side = SIZES[i % len(SIZES)]
        color, shape = list(colors)[int(rng.integers(4))], ["circle", "square"][int(rng.integers(2))]
        im = Image.new("RGB", (side, side), "white")
        draw = ImageDraw.Draw(im)
        box = (side // 8, side // 8, side - side // 8, side - side // 8)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=colors[color])
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        out.append((buf.getvalue(), f"a {color} {shape} of {side} pixels"))
    return out


def write_tars(root: str, items: list[tuple[bytes, str]], shards: int = 2) -> list[str]:
    paths = []
    for s in range(shards):
        path = os.path.join(root, f"pairs-{s:03d}.tar")
        with tarfile.open(path, "w") as tf:
            for i in range(s, len(items), shards):
                png, caption = items[i]
                for ext, data in (("png", png), ("txt", caption.encode())):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def patches(png: bytes) -> torch.Tensor:
    """An image as its 8×8 patches, row by row ([K, 192]): what ``image_transform`` runs in the workers."""
    from PIL import Image

    im = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32) / 255
    h, w = im.shape[:2]
    t = torch.from_numpy(im).permute(2, 0, 1).reshape(3, h // PATCH, PATCH, w // PATCH, PATCH)
    return t.permute(1, 3, 0, 2, 4).reshape(-1, 3 * PATCH * PATCH)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="_work/image_text", help="where the tars, tokenizer and dataset go (replaced)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--samples", type=int, default=400)
    args = ap.parse_args()
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    items = pairs(args.samples)
    tars = write_tars(args.work, items)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["[UNK]", "<eos>", "<image>"])
    tok.train_from_iterator([c for _, c in items], trainer)
    tok_path = os.path.join(args.work, "tokenizer.json")
    tok.save(tok_path)
    ds = os.path.join(args.work, "ds")
    # As on the command line: shardtool pack pairs-*.tar -o ds --tokenizer tok.json --text-field txt
    #   --image-field png --image-patch 8 --eos-id 1
    result = pack(tars, ds, tokenizer=tok_path, text_field="txt", image_field="png", image_patch=PATCH, eos_id=1)
    print(result.summary())

    loader = ShardedLoader(
        ds,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        packing="no-split",
        image_transform=patches,
        num_workers=2,
        rank=0,
        world_size=1,
    )
    dim, vocab = 64, tok.get_vocab_size()
    torch.manual_seed(0)
    embed, patch_embed = torch.nn.Embedding(vocab, dim), torch.nn.Linear(3 * PATCH * PATCH, dim)
    layer = torch.nn.TransformerEncoderLayer(dim, 4, 128, batch_first=True)
    head = torch.nn.Linear(dim, vocab)
    params = [*embed.parameters(), *patch_embed.parameters(), *layer.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    for step, batch in enumerate(loader):
        if step == args.steps:
            break
        x = embed(batch["input_ids"])
        # The images' patches, in batch order, take the image positions (row by row, left to right).
        x = x.masked_scatter(batch["image_mask"][..., None], patch_embed(torch.cat(batch["images"])))
        blocked = ~block_causal_mask(batch)[:, 0]  # no attention across samples or to later tokens
        h = layer(x, src_mask=blocked.repeat_interleave(4, dim=0))
        loss = F.cross_entropy(head(h).view(-1, vocab), batch["labels"].view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(
                f"step {step:3d}  loss {loss.item():.3f}  images {len(batch['images'])}  "
                f"image tokens {int(batch['image_mask'].sum())}  text tokens {int(batch['lengths'].sum() - batch['image_mask'].sum())}"
            )
    loader.close()
    print("ok")


if __name__ == "__main__":
    main()
