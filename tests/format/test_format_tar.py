"""The tar writer's fast header path gives exactly the bytes of the reference construction."""

from hypothesis import given, settings
from hypothesis import strategies as st

from shardtool.format.tarshard import _header, _header_slow


@settings(max_examples=200, deadline=None)
@given(
    name=st.binary(min_size=1, max_size=100).filter(lambda b: b"\x00" not in b),
    size=st.integers(0, 8**11 - 1),
    typeflag=st.sampled_from([b"0", b"x"]),
)
def test_fast_header_matches_reference(name, size, typeflag):
    assert _header(name, size, typeflag) == _header_slow(name, size, typeflag)
