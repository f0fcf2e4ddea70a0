"""How many samples a pack skipped, and when that is a warning or a failure.

The fraction counts the samples the skip list stands for against packed samples plus those:
``skipped / (packed + skipped)``. An entry is one sample, file or tar member, or the rows left in
a unit that could not be read past some point (a Parquet row group, an Arrow record batch). A
source that breaks off where its size is unknown (a truncated ``.jsonl.gz``) loses an unknown
number: a pack with ``--max-skip-fraction`` refuses it, since the fraction cannot be told.
Samples dropped by ``--max-length`` were asked for, and are not skips.
"""

from __future__ import annotations

from ..format.errors import BadSampleError, ShardtoolError


class Skip(str):
    """A skip list entry: its message, and the samples it lost (None: unknown). A str, so that
    skip lists print, join and travel in task fragments as they always did."""

    lost: int | None = 1


def skip_entry(err: BadSampleError) -> Skip:
    entry = Skip(str(err))
    entry.lost = err.lost
    return entry


def skipped_samples(skipped: list[str]) -> tuple[int, int]:
    """(samples the entries stand for, entries whose loss is unknown, counted as one each)."""
    unknown = sum(1 for s in skipped if getattr(s, "lost", 1) is None)
    known = sum(getattr(s, "lost", 1) or 0 for s in skipped)
    return known + unknown, unknown


# Past this a pack still succeeds (unless --max-skip-fraction says otherwise) but says so loudly.
LOUD_FRACTION = 0.5


class PackWarning(UserWarning):
    """Something the user should see about a pack that succeeded (most samples skipped)."""


def skip_fraction(skipped: int, packed: int) -> float:
    total = skipped + packed
    return skipped / total if total else 0.0


def check_skips(skipped: list[str], packed: int, max_fraction: float | None) -> list[str]:
    """Warnings for a pack's summary; raises when more than ``max_fraction`` was skipped. Without
    a limit, skipping more than half is a loud warning."""
    if not skipped:
        return []
    n, unknown = skipped_samples(skipped)
    frac = skip_fraction(n, packed)
    total = n + packed
    if max_fraction is not None and unknown:
        first = next(s for s in skipped if getattr(s, "lost", 1) is None)
        raise ShardtoolError(
            f"{unknown} source(s) could not be read to their end and how many samples they held is unknown, so "
            f"--max-skip-fraction {max_fraction:g} cannot be checked; nothing was published. First: {first}"
        )
    if max_fraction is not None and frac > max_fraction:
        raise ShardtoolError(
            f"{n} of {total} samples were skipped ({frac:.1%}), more than --max-skip-fraction "
            f"{max_fraction:g}; nothing was published. First skipped: {skipped[0]}"
        )
    if max_fraction is None and frac > LOUD_FRACTION:  # a stated limit is the user's own judgement
        return [
            f"MOST SAMPLES WERE SKIPPED: {n} of {total} ({frac:.0%}); the dataset holds only {packed}. "
            f"First skipped: {skipped[0]}. Pass --max-skip-fraction F to make this an error."
        ]
    if max_fraction is None and unknown:
        return [
            f"{unknown} source(s) could not be read to their end, and how many samples they held is unknown: "
            f"the dataset holds {packed}. First: {next(s for s in skipped if getattr(s, 'lost', 1) is None)}"
        ]
    return []


def check_fraction_option(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ShardtoolError(f"--max-skip-fraction must be a number from 0 to 1, got {value!r}")
    return float(value)
