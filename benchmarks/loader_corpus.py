"""The loader benchmark's corpora, as tar shards: the lognormal token corpus and the image-like one.

Apart from `loader_throughput` (which times the sides on them) so that the benchmarks on the same
token corpus (`peer_packing`, `peer_resume`) import its one definition, not the harness.
"""

from __future__ import annotations


# ---------------------------------------------------------------------- corpora
def write_tokens(root: str, n: int, per_shard: int) -> None:
    """The lognormal token corpus (median ~350, int32), tar shards at the top of ``root``."""
    from shardtool.pack.synthetic import write_synthetic

    write_synthetic(
        root, n, samples_per_shard=per_shard, vocab=50_000, key_prefix="t", key_width=8, shard_name="tok-{:05d}"
    )


def write_images(root: str, n: int, per_shard: int) -> None:
    """Image-like samples: one raw ``jpg`` field of 50-150 KB of random bytes."""
    from shardtool.pack.synthetic import write_synthetic

    write_synthetic(
        root,
        n,
        samples_per_shard=per_shard,
        kind="bytes",
        field="jpg",
        sample_bytes=100_000,
        seed=1,
        key_prefix="i",
        key_width=8,
        shard_name="img-{:05d}",
    )
