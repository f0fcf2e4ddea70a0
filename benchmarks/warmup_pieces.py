"""What a sequence-length warmup's short steps hold: rows cut from the longest length's plan
against rows packed at the short length from the start.

Real documents made on this machine (stdlib .py files and /usr/share/doc text as byte ids, heavy
tailed), packed once. For each short length L: one rank's epoch planned at L (what a run of
``seq_len=L`` serves), and the epoch planned at the longest length with its rows cut into rows of
L (what ``seq_len={0: L, ...: longest}`` serves at its short steps, `shardtool.plan.rowsplit.cut_rows`).
Printed per length: rows, fill rate, pieces per row, the mean piece, and the share of pieces that
begin inside a document (a continuation: it attends to nothing before it). No timing: the result
does not depend on machine load.

    python -m shardtool.benchmarks.warmup_pieces                      # 512, 2048 from 8192
    python -m shardtool.benchmarks.warmup_pieces --lengths 256,1024 --longest 4096
    python -m shardtool.benchmarks.warmup_pieces --max-bytes 4096     # short documents only
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from shardtool import pack
from shardtool.loader import ShardedLoader
from shardtool.plan.packing import Rows
from shardtool.plan.rowsplit import cut_rows

from .realdocs import doc_files, stdlib_files


def _rows(root: str, seq_len: int, packing: str) -> Rows:
    ld = ShardedLoader(root, seq_len=seq_len, batch_size=1, packing=packing, seed=1, num_workers=0, pin_memory=False)
    rows = ld.plan.rows
    ld.close()
    if rows is None:
        raise SystemExit("shardtool internal error: a packed loader's plan has rows")
    return rows


def _line(name: str, rows: Rows) -> str:
    pieces = len(rows.span_pos)
    inside = float((rows.span_start > 0).mean()) if pieces else 0.0
    return (
        f"  {name:<28} {rows.num_rows:>8,} {rows.fill_rate():>6.3f} {pieces / max(rows.num_rows, 1):>8.2f} "
        f"{rows.tokens / max(pieces, 1):>10,.0f} {inside:>10.1%}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="512,2048", help="the short lengths, comma-separated (default %(default)s)")
    p.add_argument("--longest", type=int, default=8192, help="the warmup's last length (default %(default)s)")
    p.add_argument("--packing", default="best-fit", help="the packing policy (default %(default)s)")
    p.add_argument("--docs", type=int, default=2000, help="/usr/share/doc files besides the stdlib (default 2000)")
    p.add_argument("--max-bytes", type=int, default=None, help="only documents of at most this many bytes (short ones)")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(args.longest % n for n in lengths):
        p.error(f"every length must divide --longest {args.longest}")
    paths = stdlib_files() + [q for q in doc_files() if os.path.getsize(q) > 0][: args.docs]
    if args.max_bytes is not None:
        paths = [q for q in paths if 0 < os.path.getsize(q) <= args.max_bytes]
    docs = [{"tokens": np.fromfile(q, dtype=np.uint8).astype(np.uint16)} for q in paths]
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "docs")
        pack(docs, root, format="arrow", length="tokens", shard_size=64 << 20)
        tokens = sum(len(d["tokens"]) for d in docs)
        print(f"{len(docs):,} documents, {tokens:,} tokens; packing {args.packing}; one rank's epoch")
        longest = _rows(root, args.longest, args.packing)
        print(f"  {'rows of':<28} {'rows':>8} {'fill':>6} {'pieces/row':>8} {'mean piece':>10} {'continued':>10}")
        print(_line(f"{args.longest:,} (the plan)", longest))
        for n in lengths:
            print(_line(f"{n:,} packed at {n:,}", _rows(root, n, args.packing)))
            print(_line(f"{n:,} cut from {args.longest:,}", cut_rows(longest, n)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
