"""How many samples a pack skipped, and when that is a warning or a failure.

The fraction counts entries of the skip list (a sample, a file or tar member, or a whole source
or unit that could not be read past some point, each once) against packed samples plus skips:
``skipped / (packed + skipped)``. Samples dropped by ``--max-length`` were asked for, and are
not skips.
"""

from __future__ import annotations

from ..format.errors import ShardtoolError

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
    n = len(skipped)
    if not n:
        return []
    frac = skip_fraction(n, packed)
    total = n + packed
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
    return []


def check_fraction_option(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ShardtoolError(f"--max-skip-fraction must be a number from 0 to 1, got {value!r}")
    return float(value)
