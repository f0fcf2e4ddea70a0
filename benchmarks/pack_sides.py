"""The sides of the newer pack benchmark cases (columnar reference, dicts, tokenize) and their inputs.

Used by ``benchmarks.pack_throughput`` (see its docstring for what each case measures).
"""

from __future__ import annotations

import json
import os
import time

SHARD_BYTES = 256 << 20


def side_arrow_reference(src: str, out: str) -> int:
    """The columnar reference: read the Parquet, write it as one Arrow IPC file, fsync."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out, exist_ok=True)
    pf = pq.ParquetFile(src)
    n = 0
    with open(os.path.join(out, "all.arrow"), "wb") as f:
        with pa.ipc.new_file(f, pf.schema_arrow) as w:
            for batch in pf.iter_batches(batch_size=65536):
                w.write_batch(batch)
                n += batch.num_rows
        f.flush()
        os.fsync(f.fileno())
    return n


def parquet_rows(src: str):
    import pyarrow.parquet as pq

    pos = 0
    for batch in pq.ParquetFile(src).iter_batches(batch_size=8192, use_threads=False):
        tok = batch.column("tokens")
        off, val = tok.offsets.to_numpy(), tok.values.to_numpy()
        srcs = batch.column("source").to_pylist()
        for i in range(batch.num_rows):
            yield pos, val[off[i] : off[i + 1]], srcs[i]
            pos += 1


def _dicts(src: str) -> list[dict]:
    return [{"tokens": tokens, "source": source} for _, tokens, source in parquet_rows(src)]


def side_dicts(src: str, out: str, how: str) -> tuple[int, float]:
    """(samples, seconds) packing the same dicts: shardtool from a list / a generator, or ShardWriter."""
    rows = _dicts(src)
    t0 = time.perf_counter()
    if how == "shardwriter":
        import webdataset as wds

        os.makedirs(out, exist_ok=True)
        with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=SHARD_BYTES, maxcount=10**9, verbose=0) as w:
            for pos, d in enumerate(rows):
                w.write({"__key__": f"{pos:09d}", "tokens.npy": d["tokens"], "source.txt": d["source"]})
        n = len(rows)
    else:
        import shardtool

        source = rows if how == "list" else (d for d in rows)
        n = shardtool.pack(source, out, length="tokens", shard_size=SHARD_BYTES, total=len(rows)).samples
    return n, time.perf_counter() - t0


def _encode_slice(tokenizer_path: str, texts: list[str]) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    return len(encode(texts))


def side_tokenize(src: str, out: str, how: str, workers: int) -> tuple[int, float]:
    """(samples, seconds): tokenize-and-pack the JSONL, or encode its texts with tokenizers alone
    in ``workers`` processes (one encoding thread each; one process: tokenizers' own threads)."""
    tok_path = os.path.join(os.path.dirname(src), "tokenizer.json")
    if how == "shardtool":
        import shardtool

        t0 = time.perf_counter()
        n = shardtool.pack(
            src,
            out,
            format="arrow",
            key="id",
            text_field="text",
            tokenizer=tok_path,
            eos_id=1,
            workers=workers,
            shard_size=SHARD_BYTES,
            overwrite=True,
        ).samples
        return n, time.perf_counter() - t0
    with open(src, "rb") as f:
        texts = [json.loads(line)["text"] for line in f]
    t0 = time.perf_counter()
    if workers == 1:
        n = _encode_slice(tok_path, texts)
    else:
        import multiprocessing as mp

        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        step = -(-len(texts) // workers)
        with mp.get_context("fork").Pool(workers) as pool:
            n = sum(pool.starmap(_encode_slice, [(tok_path, texts[i : i + step]) for i in range(0, len(texts), step)]))
    return n, time.perf_counter() - t0


def keyed_parquet(tok_dir: str) -> str:
    """The token corpus with an ``id`` column (``doc-<n>``), for --key; same row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(tok_dir, "tokens-keyed.parquet")
    if not os.path.exists(path):
        src = pq.ParquetFile(os.path.join(tok_dir, "tokens.parquet"))
        with pq.ParquetWriter(path, src.schema_arrow.insert(0, pa.field("id", pa.string()))) as w:
            start = 0
            for g in range(src.num_row_groups):
                t = src.read_row_group(g)
                w.write_table(t.add_column(0, "id", pa.array([f"doc-{i}" for i in range(start, start + t.num_rows)])))
                start += t.num_rows
    return path


def text_corpus(work: str, n: int) -> str:
    """``n`` JSONL documents of seeded random words (lognormal lengths) and a BPE tokenizer
    trained on them, beside it as tokenizer.json."""
    import numpy as np

    d = os.path.join(work, f"text-{n}")
    path = os.path.join(d, "text.jsonl")
    if os.path.exists(os.path.join(d, "tokenizer.json")):
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    vocab = ["".join(chr(97 + c) for c in rng.integers(0, 26, int(k))) for k in rng.integers(2, 10, 20_000)]
    lengths = np.clip(rng.lognormal(np.log(250), 0.8, n), 5, 4000).astype(int)
    texts = [" ".join(vocab[j] for j in rng.zipf(1.3, int(k)) % len(vocab)) for k in lengths]
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": f"doc-{i}", "text": t}) + "\n")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts[:5000], trainers.BpeTrainer(vocab_size=16_000, special_tokens=["[UNK]", "[EOS]"]))
    tok.save(os.path.join(d, "tokenizer.json"))
    return path
