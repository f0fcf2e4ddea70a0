"""Reading a packed dataset through fsspec: manifest, lengths, sample indexes, samples.

Every sample is one positioned read of the byte range its index records; tar shards are never
parsed at read time. Local files use ``os.pread`` on one descriptor per shard; remote ones one
ranged request per read.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from .arrowshard import KEY_COLUMN, check_schema, row_values, schema_from_tail
from .coalesce import read_coalesced
from .decode import decode_sample
from .decompress import range_batch
from .errors import FormatError
from .hashing import hash_bytes, range_checksum
from .lengthsfile import lengths_from_indexes, read_lengths, read_lengths_range
from .manifest import MANIFEST_NAME, Manifest, manifest_hash
from .sindex import ShardIndex
from .storage import cat_shared, dataset_fs, is_local, open_range, read_file, read_manifest, shard_location
from .summaries import SUMMARIES_NAME, ShardSummaries, SummariesMissing, planned_summaries, stored_summaries

__all__ = ["Dataset", "SummariesMissing", "is_local", "open_dataset", "open_range"]


class Dataset:
    """A packed dataset. Cheap to open: reads the manifest and the lengths file only."""

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict | None = None,
        allow_pickle: bool = False,
        fs=None,
        root: str | None = None,
        manifest_bytes: bytes | None = None,
    ):
        self.url = url
        self.storage_options = storage_options
        self._own_fs = fs is None  # made from the URL here, so a forked child may make its own
        if fs is None:
            fs, root = dataset_fs(url, storage_options)
        self._fs, self._fs_pid = fs, os.getpid()
        self.root = root.rstrip("/") if root not in ("/", None) else (root or "")
        self.allow_pickle = allow_pickle
        if manifest_bytes is None:
            manifest_bytes = read_manifest(fs, self.root, url)
        self.manifest_bytes = manifest_bytes
        self.manifest = Manifest.from_json(manifest_bytes, source=f"{url}/{MANIFEST_NAME}")
        self.version = manifest_hash(manifest_bytes)
        self._lengths: np.ndarray | None = None
        self._summaries: ShardSummaries | None = None
        self._indexes: dict[int, ShardIndex] = {}
        self._ranges: dict[int, Any] = {}
        self._arrow: dict[int, Any] = {}
        self._remote_schema: Any = None  # the schema remote record batches are decoded with
        self._last_batch: tuple = (None, None, None)  # rows of one record batch are read in runs
        self._lock, self._schema_lock = threading.Lock(), threading.Lock()
        self._field_names = self.manifest.field_names
        # shard s holds samples [offsets[s], offsets[s+1]); computed once, not per shard index loaded
        self._offsets = self.manifest.shard_offsets()

    @property
    def fs(self):
        """The dataset's filesystem, this process's own: fsspec's async clients (s3fs, gcsfs)
        refuse to be used in a forked child ("not fork-safe"), as `shardtool plan`'s forked
        simulation of many groups does, so a child remakes it from the URL."""
        if self._fs_pid != os.getpid() and self._own_fs and not is_local(self._fs):
            self._fs, _ = dataset_fs(self.url, self.storage_options)
        self._fs_pid = os.getpid()
        return self._fs

    def reopened(self) -> Dataset:
        """This dataset for another process (a forked loader worker): its own filesystem session
        and file handles, the metadata already read and parsed carried over (manifest, summaries,
        lengths, sample indexes, the remote schema), so a worker makes no request for them."""
        ds = Dataset(
            self.url,
            storage_options=self.storage_options,
            allow_pickle=self.allow_pickle,
            manifest_bytes=self.manifest_bytes,
        )
        ds.adopt(self.parsed())
        return ds

    def parsed(self) -> tuple:
        """The metadata this dataset has read and parsed so far (for `reopened`)."""
        return self._summaries, self._lengths, self._remote_schema, dict(self._indexes)

    def adopt(self, parsed: tuple) -> None:
        """Take ``parsed`` (another process's `parsed` of the same version) as read."""
        self._summaries, self._lengths, self._remote_schema, self._indexes = parsed

    # ------------------------------------------------------------------ paths
    def _path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if self.root else rel

    def shard_path(self, shard: int) -> str:
        """Where ``shard``'s bytes are read, on `shard_fs` (an in-place tar: its source, or a copy under the root)."""
        return self.shard_location(shard)[1]

    def shard_fs(self, shard: int):
        return self.shard_location(shard)[0]

    def shard_location(self, shard: int) -> tuple:
        """(filesystem, path) of shard ``shard``'s bytes."""
        info = self.manifest.shards[shard]
        if info.source is not None and is_local(self.fs) and os.path.exists(self._path(info.path)):
            return self.fs, self._path(info.path)
        return shard_location(self.fs, self.root, info)

    def index_path(self, shard: int) -> str:
        return self._path(self.manifest.shards[shard].index)

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    def __len__(self) -> int:
        return self.manifest.num_samples

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every sample, decoded, in dataset order: shard by shard as the manifest lists them."""
        for shard, count in enumerate(self.shard_counts.tolist()):
            for i in range(count):
                yield self.read(shard, i)

    # ------------------------------------------------------------------ random access
    def __getitem__(self, i: Any) -> Any:
        """Sample ``i`` by its global index (negative: from the end), decoded; a slice gives a list.
        Reads that sample's byte range only (Arrow: its record batch), after the shard's index once."""
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"a dataset is indexed by an int or a slice, found {type(i).__name__}")
        n = len(self)
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"sample {int(i)} is out of range: {self.url} has {n} samples")
        shard = int(np.searchsorted(self._offsets, j, side="right")) - 1
        return self.read(shard, j - int(self._offsets[shard]))

    def locate_key(self, key: str) -> int:
        """The global index of the sample keyed ``key``: the shards' sample indexes are searched in
        order until one holds it (no shard is read; a miss reads every index, then KeyError)."""
        want = str(key)
        for s in range(self.num_shards):
            keys = self.shard_index(s).keys
            for i, k in enumerate(keys):
                if (k.decode() if isinstance(k, bytes) else str(k)) == want:
                    return int(self._offsets[s]) + i
        raise KeyError(f"no sample has key {want!r} in {self.url}")

    def get(self, key: str) -> dict[str, Any]:
        """The sample keyed ``key``, decoded (`locate_key`, then its byte range)."""
        return self[self.locate_key(key)]

    # ------------------------------------------------------------------ metadata
    @property
    def lengths(self) -> np.ndarray:
        """Every sample's length, concatenated over shards in manifest order."""
        if self._lengths is None:
            path = self._path(self.manifest.lengths_file["path"])
            self._lengths = read_lengths(self.fs, path, self.manifest, self.url)
        return self._lengths

    def use_lengths(self, lengths: np.ndarray) -> None:
        """Every sample's length, read already (the node cache reads the lengths file as it copies
        it, checked against the manifest's sample count): `lengths` then reads no file."""
        if len(lengths) != self.manifest.num_samples:
            raise FormatError(f"{self.url}: {len(lengths)} lengths for {self.manifest.num_samples} samples")
        self._lengths = lengths

    def lengths_range(self, lo: int, hi: int) -> np.ndarray:
        """Lengths of samples ``[lo, hi)`` without reading the others: a memory map of the local
        lengths file, or one ranged read of a remote one (a planner reads only its own range)."""
        if self._lengths is not None:
            return self._lengths[lo:hi]
        lf = self.manifest.lengths_file
        return read_lengths_range(self.fs, self._path(lf["path"]), len(self), lo, hi, self.url, lf.get("bytes"))

    def lengths_from_indexes(self, lo: int, hi: int) -> np.ndarray:
        """Lengths of samples ``[lo, hi)`` from the (hash-checked) sample indexes of the shards
        holding them: for a reader that has those indexes at hand (the node cache) and not the
        dataset-wide lengths file."""
        return lengths_from_indexes(self.manifest, self._offsets, self._indexes.get, self.load_index_bytes, lo, hi)

    @property
    def summaries(self) -> ShardSummaries:
        """Per-shard counts, token sums and length histograms (O(shards) to read)."""
        if self._summaries is None:
            self._summaries = self.load_summaries(self.read_summaries_bytes())
        return self._summaries

    def read_summaries_bytes(self) -> bytes | None:
        try:
            return cat_shared(self.fs, self._path(SUMMARIES_NAME))
        except FileNotFoundError:
            return None

    def load_summaries(self, data: bytes | None) -> ShardSummaries:
        """The summaries this dataset is planned with, from ``data`` (the stored file's bytes, or
        None), as `planned_summaries` decides them."""
        return planned_summaries(data, self.manifest, self.shard_counts, lambda: self.lengths, self.url)

    def stored_summaries(self, data: bytes | None) -> tuple[ShardSummaries | None, str]:
        """(the stored summaries, "") when ``data`` is usable for this dataset, else (None, why not)."""
        return stored_summaries(data, self.manifest, self.shard_counts, f"{self.url}/{SUMMARIES_NAME}")

    @property
    def shard_counts(self) -> np.ndarray:
        return np.diff(self._offsets)

    def shard_lengths(self, shard: int) -> np.ndarray | None:
        """The lengths file's lengths of ``shard``'s samples, to check its index against; None
        for a remote dataset whose lengths are not loaded (one more ranged request per shard
        index: the loader checks what it reads against its plan's lengths instead)."""
        if self._lengths is None and not is_local(self.fs):
            return None
        return self.lengths_range(int(self._offsets[shard]), int(self._offsets[shard + 1]))

    def load_index_bytes(self, shard: int) -> bytes:
        info = self.manifest.shards[shard]
        data = read_file(self.fs, self.index_path(shard), what=f"shard {info.path}")
        if len(data) != info.index_bytes or hash_bytes(data) != info.index_hash:
            raise FormatError(
                f"{info.path}: its sample index {info.index} does not match its size/hash in the manifest"
            )
        return data

    def shard_index(self, shard: int, *, against_lengths: bool = True) -> ShardIndex:
        """``shard``'s sample index, checked against the manifest and the lengths file; without
        ``against_lengths`` (verify, where the lengths file itself is bad) not against that file,
        and not kept."""
        idx = self._indexes.get(shard)
        if idx is None:
            info = self.manifest.shards[shard]
            idx = ShardIndex.from_bytes(
                self.load_index_bytes(shard),
                self._field_names,
                shard=info.path,
                tar=self.manifest.shard_format == "tar",
            )
            lengths = self.shard_lengths(shard) if against_lengths else None
            idx.check(shard=info.path, samples=info.samples, shard_bytes=info.bytes, lengths=lengths)
            if against_lengths:
                self._indexes[shard] = idx
        return idx

    # ------------------------------------------------------------------ samples
    def shard_compressed(self, shard: int) -> bool:
        """Whether ``shard``'s record batches are compressed where this dataset reads them."""
        return self.manifest.compression is not None

    def make_present(self, shard: int) -> None:
        """Before ``shard`` is opened: the node cache (cache/dcache.py) fetches it on a miss."""

    def held_plain(self, shard: int) -> bool:
        """The copy read is stored decompressed: record batches read by number, not index ranges."""
        return False

    def _range(self, shard: int):
        r = self._ranges.get(shard)
        if r is None:
            self.make_present(shard)
            with self._lock:
                if (r := self._ranges.get(shard)) is None:
                    r = self._ranges[shard] = open_range(self.shard_fs(shard), self.shard_path(shard))
        return r

    def read_raw(self, shard: int, i: int) -> dict[str, Any]:
        """Undecoded fields of sample ``i`` of ``shard`` (bytes for tar; Arrow values for arrow)."""
        idx = self.shard_index(shard)
        if not 0 <= i < len(idx):
            raise IndexError(f"shard {self.manifest.shards[shard].path} has {len(idx)} samples, asked for #{i}")
        if self.manifest.shard_format == "arrow":
            return self._read_arrow(shard, idx, i)
        return self._tar_fields(idx, i, self._verified_range(shard, idx, i))

    def _arrow_reader(self, shard: int):
        reader = self._arrow.get(shard)
        if reader is None:
            self.make_present(shard)
            fs, path = self.shard_fs(shard), self.shard_path(shard)
            source = pa.memory_map(path) if is_local(fs) else fs.open(path, "rb", block_size=0, cache_type="none")
            try:
                reader = pa.ipc.open_file(source)
            except (pa.ArrowInvalid, OSError) as e:
                raise FormatError(f"{self.manifest.shards[shard].path}: not a readable Arrow IPC file ({e})") from None
            check_schema(reader.schema, self.manifest.fields, self.manifest.shards[shard].path)
            self._arrow[shard] = reader
        return reader

    def _verified_range(self, shard: int, idx: ShardIndex, i: int) -> bytes:
        """The byte range of sample ``i``, checked against its index checksum before any use."""
        off, size = int(idx.offsets[i]), int(idx.sizes[i])
        return self._checked(shard, idx, i, self._range(shard).read(off, size))

    def _checked(self, shard: int, idx: ShardIndex, i: int, data):
        if idx.checksums is not None and range_checksum(data) != int(idx.checksums[i]):
            raise FormatError(
                f"shard {self.manifest.shards[shard].path} sample #{i} ({idx.keys[i]!r}): bytes at offset "
                f"{int(idx.offsets[i])} do not match the checksum in the sample index (corrupt shard or storage)"
            )
        return data

    def verified_ranges(self, shard: int, samples: list[int], gap: int | None, watch=None) -> list[memoryview]:
        """The checked byte ranges of ``samples`` of ``shard`` (tar: the samples; Arrow: their
        record batches), neighbours within ``gap`` bytes read as one request (`format.coalesce`);
        ``watch(start, size)``, where given, is a context manager around each request."""
        idx, at = self.shard_index(shard), np.asarray(samples, dtype=np.int64)
        got = read_coalesced(self._range(shard).read, idx.offsets[at], idx.sizes[at], gap, watch)
        return [self._checked(shard, idx, i, data) for i, data in zip(at.tolist(), got)]

    def raw_samples(self, shard: int, samples: list[int], gap: int | None, watch=None) -> list[dict[str, Any]]:
        """`read_raw` of several samples of a tar shard, neighbours read together (`verified_ranges`)."""
        idx, blobs = self.shard_index(shard), self.verified_ranges(shard, samples, gap, watch)
        return [self._tar_fields(idx, i, blob) for i, blob in zip(samples, blobs)]

    def _tar_fields(self, idx: ShardIndex, i: int, blob) -> dict[str, Any]:
        blob = memoryview(blob)
        out: dict[str, Any] = {KEY_COLUMN: idx.keys[i]}
        for j, name in enumerate(self._field_names):
            fo = int(idx.field_offsets[i, j])  # type: ignore[index]  # a tar index has field columns
            out[name] = blob[fo : fo + int(idx.field_sizes[i, j])]  # type: ignore[index]  # a tar index has field columns
        return out

    def record_batches(self, shard: int, samples: list[int], gap: int | None = None, watch=None) -> list:
        """The record batches holding ``samples`` of an Arrow shard: their bytes as stored, read by
        range (`verified_ranges`: neighbours within ``gap`` in one request, each ``watch``-ed) and
        checked against the index checksum before they are decoded (decompressed). Safe to call
        from several threads at once (readers that fetch batches in parallel)."""
        idx = self.shard_index(shard)
        if idx.checksums is None:
            reader = self._arrow_reader(shard)  # footer and schema, checked once per shard
            with self._lock:  # an older dataset: read through the shard's one open file
                return [reader.get_batch(int(idx.batch[i])) for i in samples]  # type: ignore[index]  # an Arrow index has batch
        schema = self.batch_schema(shard)
        name = self.manifest.shards[shard].path
        return [range_batch(data, schema, name) for data in self.verified_ranges(shard, samples, gap, watch)]

    def batch_schema(self, shard: int):
        """The schema a record batch of ``shard`` is decoded with: a local shard's own footer's;
        for remote shards one footer's for all (each is the manifest's fields, checked on that
        read), read once however many threads fetch: one ranged read of the shard's tail."""
        fs = self.shard_fs(shard)
        if is_local(fs):
            return self._arrow_reader(shard).schema
        with self._schema_lock:
            if self._remote_schema is None:
                path, info = self.shard_path(shard), self.manifest.shards[shard]
                read = lambda a, b: cat_shared(fs, path, a, b)  # noqa: E731
                self._remote_schema = schema_from_tail(read, info.bytes, self.manifest.fields, info.path)
        return self._remote_schema

    def _read_arrow(self, shard: int, idx: ShardIndex, i: int) -> dict[str, Any]:
        b = int(idx.batch[i])  # type: ignore[index]  # an Arrow index has batch and row columns
        if self._last_batch[:2] == (shard, b):
            batch = self._last_batch[2]
        else:
            self.make_present(shard)  # fetched on a miss: then whether it is held plain is known
            batch = (
                self._arrow_reader(shard).get_batch(b) if self.held_plain(shard) else self.record_batches(shard, [i])[0]
            )
            self._last_batch = (shard, b, batch)
        return row_values(batch, int(idx.row[i]), self.manifest.fields)  # type: ignore[index]  # as above

    def read(self, shard: int, i: int, *, decode: bool = True) -> dict[str, Any]:
        """Sample ``i`` of ``shard``: ``__key__`` plus every field, decoded by its encoding."""
        raw = self.read_raw(shard, i)
        if not decode:
            return {k: (bytes(v) if isinstance(v, memoryview) else v) for k, v in raw.items()}
        where = f"{self.manifest.shards[shard].path} sample #{i}"
        return decode_sample(self.manifest, raw, allow_pickle=self.allow_pickle, where=where)

    def close(self) -> None:
        for r in self._ranges.values():
            r.close()
        self._ranges.clear()
        self._arrow.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_dataset(url: str, *, storage_options: dict | None = None, allow_pickle: bool = False) -> Dataset:
    """Open a packed dataset at a local path or any fsspec URL (``file://``, ``s3://``, …)."""
    return Dataset(url, storage_options=storage_options, allow_pickle=allow_pickle)
