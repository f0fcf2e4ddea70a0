"""Per-shard summaries: what a planner needs at scale, in O(number of shards).

For every shard: its sample count, its token sum, its longest sample, its *weight* (sum of max(length, 1): the
quantity node ranges balance, so that runs of empty samples are still spread) and a coarse
length histogram — per octave of length, the count, the token sum and the sum of squared lengths
of the samples in it (so a planner knows both where in the octave they lie and how spread out). A
training rank reads these instead of every sample's length; it reads per-sample lengths only for
its own range.

Stored beside the manifest as ``summaries.arrow`` (an Arrow IPC file). It is derived from the
lengths, so it is bound to them by the lengths file's hash rather than listed in the manifest:
a dataset packed before summaries existed gets them with `shardtool upgrade` without changing
its manifest, its version or the caches and loader states keyed on it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import numpy as np
import pyarrow as pa

from .errors import FormatError
from .hashing import format_digest, new_hasher
from .manifest import Manifest, length_pads
from .sindex import as_numpy, ipc_file_bytes
from .sketch import ShardSketch

__all__ = [
    "BINS",
    "SUMMARIES_NAME",
    "ShardSummaries",
    "SummariesMissing",
    "length_bins",
    "planned_summaries",
    "stored_summaries",
]

SUMMARIES_NAME = "summaries.arrow"
SUMMARIES_VERSION = "1"
SKETCH_VERSION = "2"  # version 1 plus the weight-quantile sketch (format.sketch)
# Bin b holds lengths in [2^(b-1), 2^b) (bin 0: length 0); the last bin also everything longer
# (2^30 and up: no sample of a trainable dataset).
BINS = 32


def length_bins(lengths: np.ndarray) -> np.ndarray:
    """The histogram bin of every length: its bit length, capped at BINS - 1."""
    exponent = np.frexp(np.asarray(lengths, dtype=np.float64))[1]
    return np.minimum(exponent, BINS - 1).astype(np.int64)


@dataclass(frozen=True, eq=False)
class ShardSummaries:
    samples: np.ndarray  # int64 [S]
    tokens: np.ndarray  # int64 [S]: sum of lengths
    weight: np.ndarray  # int64 [S]: sum of max(length, 1)
    longest: np.ndarray  # int64 [S]: the longest sample (0 for an empty shard)
    hist_count: np.ndarray  # int64 [S, BINS]
    hist_tokens: np.ndarray  # int64 [S, BINS]
    hist_squares: np.ndarray  # float64 [S, BINS]: sum of length^2 (exact to 53 bits: a variance, not an id)
    sketch: ShardSketch | None = None  # weight quantiles inside shards (None: packed before they existed)
    # Ranges balance samples, not weight: the dataset's length is a byte size (`manifest.length_pads`),
    # so equal sample counts give every rank full batches. Not stored: the manifest says it.
    by_samples: bool = False

    @property
    def num_shards(self) -> int:
        return int(self.samples.size)

    @classmethod
    def from_lengths(cls, lengths: np.ndarray, counts: np.ndarray, sketch_cells: int | None = None) -> ShardSummaries:
        """Summaries of shards holding ``counts`` consecutive samples of ``lengths`` each; with a
        sketch of ``sketch_cells`` cells a shard (`format.sketch`; None: none, as packs before it)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        shards = counts.size
        owner = np.repeat(np.arange(shards, dtype=np.int64), counts)
        cell = owner * BINS + length_bins(lengths)
        size = shards * BINS
        hist_count = np.bincount(cell, minlength=size).reshape(shards, BINS).astype(np.int64)
        hist_tokens = np.bincount(cell, weights=lengths, minlength=size).reshape(shards, BINS)
        squares = lengths.astype(np.float64) ** 2
        hist_squares = np.bincount(cell, weights=squares, minlength=size).reshape(shards, BINS)
        tokens = np.bincount(owner, weights=lengths, minlength=shards)
        weight = np.bincount(owner, weights=np.maximum(lengths, 1), minlength=shards)
        longest = np.zeros(shards, dtype=np.int64)
        np.maximum.at(longest, owner, lengths)
        # bincount sums in float64: exact below 2^53 tokens per shard, far past any real shard.
        sketch = ShardSketch.from_lengths(lengths, counts, sketch_cells) if sketch_cells and sketch_cells > 1 else None
        return cls(
            counts.copy(),
            tokens.astype(np.int64),
            weight.astype(np.int64),
            longest,
            hist_count,
            hist_tokens.astype(np.int64),
            hist_squares,
            sketch,
        )

    @classmethod
    def concat(cls, parts: list[ShardSummaries]) -> ShardSummaries:
        sketches = [p.sketch for p in parts]
        if any(k is None for k in sketches) and not all(k is None for k in sketches):
            raise ValueError("summaries with and without a sketch cannot be joined")
        return cls(
            *(
                np.concatenate([getattr(p, name) for p in parts])
                for name in ("samples", "tokens", "weight", "longest", "hist_count", "hist_tokens", "hist_squares")  # type: ignore[call-arg, arg-type]  # mypy cannot count a starred generator's fields
            ),
            ShardSketch.concat(cast("list[ShardSketch]", sketches)) if parts and sketches[0] is not None else None,
        )

    def content_hash(self) -> str:
        """A hash of every array, stored in the file and checked when read: the file is not in the
        manifest by hash, and a damaged value (a sketch's, which no total checks) cut other ranges."""
        h = new_hasher()
        ints = [self.samples, self.tokens, self.weight, self.longest, self.hist_count, self.hist_tokens]
        if self.sketch is not None:
            ints += [self.sketch.pos, self.sketch.tokens, self.sketch.weight]
        for a in ints:
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.hist_squares, dtype=np.float64).tobytes())
        return format_digest(h)

    def digest(self) -> str:
        """What the data groups' ranges are cut from: ranks whose digests differ plan other ranges
        (a node that fell back to summaries computed from the lengths, without the weight sketch),
        and would read some samples twice and others never."""
        return f"{self.content_hash()}/{'samples' if self.by_samples else 'weight'}"

    def to_bytes(self, lengths_hash: str) -> bytes:
        def fixed(a: np.ndarray) -> pa.Array:
            return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), BINS)

        columns = {
            "samples": self.samples,
            "tokens": self.tokens,
            "weight": self.weight,
            "longest": self.longest,
            "hist_count": fixed(self.hist_count),
            "hist_tokens": fixed(self.hist_tokens),
            "hist_squares": fixed(self.hist_squares),
        }
        meta = {
            "shardtool": "summaries",
            "version": SUMMARIES_VERSION,
            "bins": f"log2x{BINS}",
            "lengths_hash": lengths_hash,
            "content_hash": self.content_hash(),
        }
        if self.sketch is not None:
            inner = self.sketch.cells - 1
            for name in ("pos", "tokens", "weight"):
                columns[f"sketch_{name}"] = pa.FixedSizeListArray.from_arrays(
                    pa.array(getattr(self.sketch, name).reshape(-1)), inner
                )
            meta.update(version=SKETCH_VERSION, sketch_cells=str(self.sketch.cells))
        table = pa.table(columns)
        return ipc_file_bytes(table.replace_schema_metadata(meta))

    @classmethod
    def from_bytes(
        cls, data: bytes, *, lengths_hash: str | None, counts: np.ndarray, total_tokens: int | None, source: str
    ) -> ShardSummaries:
        """Read and check against the manifest: the lengths they were computed from, every shard's
        count, the dataset's token total. Raises FormatError naming ``source`` on any mismatch."""
        try:
            reader = pa.ipc.open_file(pa.py_buffer(data))
            # One record batch (as written): its columns are zero-copy views of ``data``, where a
            # table's chunked columns would be copied — at 10^5 shards, tens of MB per rank.
            table = reader.get_batch(0) if reader.num_record_batches == 1 else reader.read_all().combine_chunks()
        except (pa.ArrowInvalid, OSError) as e:
            raise FormatError(f"{source}: unreadable summaries ({e})") from None
        if isinstance(table, pa.Table):
            table = table.to_batches()[0] if table.num_rows else pa.RecordBatch.from_pylist([], schema=table.schema)
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        if meta.get("shardtool") != "summaries" or meta.get("bins") != f"log2x{BINS}":
            raise FormatError(f"{source}: not shardtool per-shard summaries (version {meta.get('version')!r})")
        if lengths_hash is not None and meta.get("lengths_hash") != lengths_hash:
            raise FormatError(f"{source}: computed from other lengths than this dataset's (stale summaries)")

        def col(name: str) -> np.ndarray:
            return as_numpy(table.column(name)).astype(np.int64, copy=False)

        def hist(name: str, dtype=np.int64) -> np.ndarray:
            flat = as_numpy(table.column(name).flatten()).astype(dtype, copy=False)
            return flat.reshape(table.num_rows, BINS)

        try:
            sketch = None
            if "sketch_cells" in meta:
                cells = int(meta["sketch_cells"])

                def inner(name: str) -> np.ndarray:
                    flat = as_numpy(table.column(name).flatten()).astype(np.int64, copy=False)
                    return flat.reshape(table.num_rows, cells - 1)

                sketch = ShardSketch(cells, inner("sketch_pos"), inner("sketch_tokens"), inner("sketch_weight"))
            out = cls(
                col("samples"),
                col("tokens"),
                col("weight"),
                col("longest"),
                hist("hist_count"),
                hist("hist_tokens"),
                hist("hist_squares", np.float64),
                sketch,
            )
        except (KeyError, ValueError) as e:
            raise FormatError(f"{source}: malformed summaries ({e})") from None
        if "content_hash" in meta and out.content_hash() != meta["content_hash"]:
            raise FormatError(f"{source}: its values do not match their hash (a damaged file)")
        counts = np.asarray(counts, dtype=np.int64)
        if out.samples.shape != counts.shape or not np.array_equal(out.samples, counts):
            raise FormatError(f"{source}: per-shard sample counts disagree with the manifest")
        if not np.array_equal(out.hist_count.sum(axis=1), out.samples) or not np.array_equal(
            out.hist_tokens.sum(axis=1), out.tokens
        ):
            raise FormatError(f"{source}: histograms disagree with the shard totals")
        if total_tokens is not None and int(out.tokens.sum()) != int(total_tokens):
            raise FormatError(
                f"{source}: token total {int(out.tokens.sum())} disagrees with the manifest's {int(total_tokens)}"
            )
        return out


def stored_summaries(
    data: bytes | None, manifest: Manifest, counts: np.ndarray, source: str
) -> tuple[ShardSummaries | None, str]:
    """(the stored summaries, "") when ``data`` (the summaries file's bytes, None: no file) is
    usable for the dataset of ``manifest`` with shards of ``counts`` samples, else (None, why not)."""
    if data is None:
        return None, "has no per-shard summaries (packed by shardtool < 0.2)"
    total = (manifest.length.get("summary") or {}).get("total")
    try:
        return ShardSummaries.from_bytes(
            data, lengths_hash=manifest.lengths_file.get("hash"), counts=counts, total_tokens=total, source=source
        ), ""
    except FormatError as e:
        return None, f"has unusable per-shard summaries ({e})"


class SummariesMissing(UserWarning):
    """A dataset without usable per-shard summaries: planning reads every sample's length."""


def planned_summaries(
    data: bytes | None, manifest: Manifest, counts: np.ndarray, all_lengths: Callable[[], np.ndarray], url: str
) -> ShardSummaries:
    """The summaries a dataset of ``manifest`` at ``url`` is planned with: the stored ones
    (``data``, the file's bytes), or, where a dataset packed by an older shardtool has none or they
    do not match its lengths, computed from ``all_lengths()`` with a warning (that reads the whole
    lengths file on every rank); `ShardSummaries.by_samples` where its length is a byte size."""
    summaries, reason = stored_summaries(data, manifest, counts, f"{url}/{SUMMARIES_NAME}")
    if summaries is None:
        warnings.warn(
            f"dataset {url} {reason}: computing them from every sample's length, on every "
            f"rank; run `shardtool upgrade {url}` once to store them",
            SummariesMissing,
            stacklevel=4,  # the caller of `Dataset.load_summaries` (or of its `summaries`)
        )
        summaries = ShardSummaries.from_lengths(all_lengths(), counts)
    return replace(summaries, by_samples=not length_pads(manifest.length))
