"""What a loader state was saved for, in words: the dataset (URL, version) and the batching.

A state is identified by fingerprints — the dataset's manifest hash and a hash of the batching
config. A refusal that quotes only hashes leaves the user guessing which dataset or which
setting differs, so a state also carries this small description (a few short strings and
numbers, JSON, the same on every rank: it is built from the loader's arguments and the
manifest), and the found/expected messages quote it. States saved before it have none; loading
them still works, and a refusal then says that the state does not name what it was saved for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .batching import Batching

__all__ = [
    "RANGES_BY_SAMPLES",
    "batching_mismatch",
    "dataset_identity",
    "dataset_mismatch",
    "describe",
    "describe_mixture",
    "ranges_changed",
    "render",
]

NO_DESCRIPTION = "a state saved before shardtool described what it was saved for"


def describe(url: str, version: str, samples: int, batching: Batching) -> dict[str, Any]:
    """The description a single-dataset loader's state carries."""
    return {
        "dataset": {"url": str(url), "version": str(version), "samples": int(samples)},
        "batching": batching.describe(),
    }


def describe_mixture(urls: Mapping[str, str], batching: Batching) -> dict[str, Any]:
    """The description a mixture's state carries: every source's URL by name (versions are in its records)."""
    return {"sources": {str(n): str(u) for n, u in urls.items()}, "batching": batching.describe()}


def render(settings: Mapping[str, Any]) -> str:
    """``{max_tokens: 65536, seed: 0, shuffle: true}``: compact, JSON values, keys unquoted."""

    def value(v: Any) -> str:
        return render(v) if isinstance(v, Mapping) else json.dumps(v)

    return "{" + ", ".join(f"{k}: {value(v)}" for k, v in settings.items()) + "}"


def _dataset(about: Mapping[str, Any] | None, fingerprint: str, *, saved: bool) -> str:
    ds = (about or {}).get("dataset")
    if not ds:
        return f"dataset fingerprint {fingerprint!r}" + (f" ({NO_DESCRIPTION}: it names no URL)" if saved else "")
    samples = f", {ds['samples']:,} samples" if isinstance(ds.get("samples"), int) else ""
    return f"dataset {ds.get('url')!r} (version {ds.get('version', fingerprint)!r}{samples})"


# What a state's dataset fingerprint adds to the version where the ranges are cut by sample
# count (`ShardSummaries.by_samples`): a state saved when they were cut by bytes positions in
# other groups' samples, so it must not load.
RANGES_BY_SAMPLES = "/ranges=samples"


def dataset_identity(dataset: Any) -> str:
    """The dataset fingerprint a loader state records of ``dataset`` (a `shardtool.format.Dataset`):
    its version, marked where its ranges are cut by sample count (`ShardSummaries.by_samples`)."""
    return dataset.version + RANGES_BY_SAMPLES if dataset.summaries.by_samples else dataset.version


def ranges_changed(found_fingerprint: str, expected_fingerprint: str) -> str | None:
    """The refusal of a state of this very dataset saved when its ranges were cut by bytes; None
    where the two fingerprints differ otherwise."""
    if expected_fingerprint != found_fingerprint + RANGES_BY_SAMPLES:
        return None
    return (
        "loader state was saved by a shardtool that cut this dataset (its lengths are byte sizes) into "
        "the data groups' ranges by bytes, so that some ranks' batches held fewer than batch_size samples; "
        "ranges are now cut by sample count, and the state's position is in the old plan. Finish the epoch "
        "with the shardtool that saved it (a state saved at an epoch's end loads here), or start the next "
        "epoch E afresh with this one (loader.set_epoch(E), without loading the state)"
    )


def dataset_mismatch(
    found: Mapping[str, Any] | None, found_fingerprint: str, expected: Mapping[str, Any], expected_fingerprint: str
) -> str:
    """The refusal of a state saved for another dataset (``found``: the state's description)."""
    changed = ranges_changed(found_fingerprint, expected_fingerprint)
    if changed is not None:
        return changed
    was, now = _dataset(found, found_fingerprint, saved=True), _dataset(expected, expected_fingerprint, saved=False)
    return (
        f"loader state was saved for another dataset: found {was}, expected {now}. A changed dataset has "
        "another plan: its position cannot be carried over; start without loading the state, or load it into "
        "a loader of that dataset"
    )


def batching_mismatch(
    found: Mapping[str, Any] | None, found_fingerprint: str, expected: Mapping[str, Any], expected_fingerprint: str
) -> str:
    """The refusal of a state saved with another batching config (``found``: the state's description)."""
    was = (found or {}).get("batching")
    now = expected.get("batching") or {}
    if was is None:
        return (
            f"loader state was saved with another batching config: found batching fingerprint "
            f"{found_fingerprint!r} ({NO_DESCRIPTION}: it names no settings), expected {render(now)} "
            f"(fingerprint {expected_fingerprint!r})"
        )
    if dict(was) == dict(now):
        return (
            f"loader state was saved with batching {render(was)} as here, but by another plan version "
            f"(found fingerprint {found_fingerprint!r}, expected {expected_fingerprint!r}): its batches were "
            "ordered by another planner, so the position cannot be carried over"
        )
    differ = [k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    return (
        f"loader state was saved with another batching config: found batching {render(was)}, expected "
        f"{render(now)} (differing: {', '.join(differ)}). Load it into a loader with the same batching, or "
        "start without loading it"
    )
