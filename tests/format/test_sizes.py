"""One size grammar for every size option: pack's --shard-size as warm's --max-bytes."""

import pytest

from helpers.runcli import shardtool_cli
from shardtool.format.sizes import SizeError, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10G", 10 * 1000**3),
        ("10GB", 10 * 1000**3),
        ("10GiB", 10 * 1024**3),
        ("10Gi", 10 * 1024**3),
        ("10gib", 10 * 1024**3),
        ("262144", 262144),
        ("1.5G", 1_500_000_000),
        ("256MiB", 256 << 20),
        ("500K", 500_000),
        ("2T", 2 * 1000**4),
        ("8b", 8),
        (" 3 Mi ", 3 << 20),
        (4096, 4096),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["10X", "G", "-1", "1e3", "10 GiBs", "", True])
def test_bad_sizes_say_what_a_size_looks_like(text):
    with pytest.raises(SizeError, match="examples|must be a size"):
        parse_size(text)


def test_zero_is_refused_where_a_positive_size_is_needed():
    assert parse_size("0") == 0
    with pytest.raises(SizeError, match="positive"):
        parse_size("0", what="--shard-size", positive=True)


def test_every_size_flag_takes_the_same_grammar(tmp_path):
    # `--shard-size 10Gi` used to fail where `--max-bytes 10Gi` worked.
    from shardtool.pack.synthetic import write_synthetic

    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"tokens": [1, 2, 3]}\n')
    out = shardtool_cli("pack", str(raw), "-o", str(tmp_path / "ds"), "--shard-size", "10Gi", "-q")
    assert out.returncode == 0, out.stderr
    ds = write_synthetic(str(tmp_path / "syn"), 50, samples_per_shard=10).root
    out = shardtool_cli(
        "warm", ds, "--cache-dir", str(tmp_path / "c"), "--max-bytes", "10GiB", "--min-free", "1M", "-q"
    )
    assert out.returncode == 0, out.stderr
    out = shardtool_cli("pack", str(raw), "-o", str(tmp_path / "ds2"), "--shard-size", "10 parsecs")
    assert out.returncode == 2 and "examples: 262144" in out.stderr
