"""Real text made on this machine, for tests that must see real shapes (long, heavy-tailed documents):
the Python standard library's source files, and the text files of /usr/share/doc.

Synthetic lognormal corpora hide what these show: most stdlib files are longer than a 512-token
row, a few are over 100k bytes, and /usr/share/doc has single files of several MB."""

from __future__ import annotations

import os

import numpy as np

from shardtool.benchmarks.realdocs import STDLIB, doc_files, doc_lengths, stdlib_files, stdlib_lengths

__all__ = [
    "STDLIB",
    "byte_ids",
    "doc_files",
    "doc_lengths",
    "issue32_lengths",
    "long_and_short_files",
    "long_and_short_mixture",
    "pack_long_and_short",
    "stdlib_files",
    "stdlib_lengths",
    "stdlib_line_lengths",
    "stdlib_package_lengths",
    "train_tokenizer",
    "write_stdlib_jsonl",
]


def byte_ids(path: str) -> np.ndarray:
    """A file as token ids: its bytes (a byte-level vocabulary of 256)."""
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8).astype(np.int32)


def long_and_short_files(stdlib: int, docs: int, *, least: int) -> list[str]:
    """``stdlib`` non-empty stdlib files (long documents) and ``docs`` /usr/share/doc files of at
    most 4 KiB (short ones); the test is skipped where fewer than ``least`` are found."""
    from .skips import require

    paths = [p for p in stdlib_files(stdlib) if os.path.getsize(p) > 0]
    paths += [p for p in doc_files() if 0 < os.path.getsize(p) <= 4096][:docs]
    require(len(paths) >= least, "too few stdlib files or /usr/share/doc files here")
    return paths


def pack_long_and_short(
    root: str, stdlib: int, docs: int, *, least: int, fmt: str = "arrow", shards: int = 3, paths: bool = False
) -> str:
    """`long_and_short_files` as byte ids packed into ``root`` (``fmt``, about ``shards`` shards;
    ``paths``: each sample's file path too, as field ``path``). Returns ``root``."""
    import shardtool

    rows = [
        {"tokens": byte_ids(p), **({"path": p} if paths else {})}
        for p in long_and_short_files(stdlib, docs, least=least)
    ]
    size = sum(r["tokens"].nbytes for r in rows) // shards
    shardtool.pack(rows, root, format=fmt, length="tokens", shard_size=size)
    return root


def long_and_short_mixture(
    root: str, long: tuple[int, int], short: tuple[int, int], weights: tuple[float, float], *, least: int
):
    """A `Mixture` of two sources of other shapes packed under ``root``: "long" (mostly stdlib
    files: ``long`` = (stdlib, docs) counts, 3 shards) and "short" (mostly /usr/share/doc files,
    2 shards), at ``weights``."""
    from shardtool.plan.mixture import Mixture

    a = pack_long_and_short(os.path.join(root, "long"), *long, least=least)
    b = pack_long_and_short(os.path.join(root, "short"), *short, least=least, shards=2)
    return Mixture({"long": (a, weights[0]), "short": (b, weights[1])})


def issue32_lengths() -> np.ndarray:
    """Issue 32's shape of packed rows at seq_len 1,024: 1,003 documents, 617 of them longer than
    1,024 tokens (stdlib files as byte ids), the rest short files of /usr/share/doc, in a fixed
    shuffled order."""
    from helpers.skips import require

    long = stdlib_lengths()
    long = long[long > 1024][:617]
    short = doc_lengths()
    short = short[(short > 0) & (short <= 1024)][:386]
    require(long.size == 617 and short.size == 386, "too few stdlib files or /usr/share/doc files here")
    both = np.concatenate([long, short])
    return both[np.random.default_rng(32).permutation(both.size)]


def train_tokenizer(texts: list[str], vocab: int = 2000):
    """A BPE tokenizer trained here on ``texts`` (nothing downloaded), with [UNK] and [EOS]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]", "[EOS]"]))
    return tok


def write_stdlib_jsonl(path: str, limit: int | None = None, subdirs: tuple[str, ...] = ()) -> list[str]:
    """The stdlib files as JSONL rows {"id", "text"}; returns their texts."""
    import json

    texts = []
    with open(path, "w") as f:
        for i, p in enumerate(stdlib_files(limit, subdirs=subdirs)):
            with open(p, encoding="utf-8", errors="replace") as src:
                text = src.read()
            texts.append(text)
            f.write(json.dumps({"id": f"f{i:05d}", "text": text}) + "\n")
    return texts


def stdlib_package_lengths() -> np.ndarray:
    """Very long documents: each stdlib package directory's files concatenated (bytes); most are
    over 100k, the largest several MB."""
    sizes: dict[str, int] = {}
    for p in stdlib_files():
        rel = os.path.relpath(p, STDLIB).split(os.sep)
        top = rel[0] if len(rel) > 1 else "_modules"
        sizes[top] = sizes.get(top, 0) + os.path.getsize(p)
    return np.array([sizes[k] for k in sorted(sizes)], dtype=np.int64)


def stdlib_line_lengths(limit: int = 30000) -> np.ndarray:
    """Short documents: the non-empty lines of the stdlib files (bytes), the first ``limit``."""
    out: list[int] = []
    for p in stdlib_files():
        with open(p, "rb") as f:
            out += [len(line) for line in f.read().split(b"\n") if line.strip()]
        if len(out) >= limit:
            break
    return np.array(out[:limit], dtype=np.int64)


CORPORA = {
    "stdlib": stdlib_lengths,
    "doc": doc_lengths,
    "packages": stdlib_package_lengths,
    "lines": stdlib_line_lengths,
}
