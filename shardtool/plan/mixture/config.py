"""A mixture of datasets: names, where each lives, weights in tokens, and a schedule of weights.

Pure configuration, validated on construction; no I/O except `Mixture.from_file`. Weights are
shares of *tokens* (a weight 0.6 next to 0.4 means 60% of the tokens trained on, whatever the
sources' lengths), kept as exact fractions so that every machine computes the same composition.

A schedule changes the weights at given steps: ``[(0, {...}), (5000, {...})]``. The sources'
own weights are the weights from step 0; a schedule entry names every source (a weight of 0
pauses one), so a misspelt name is an error rather than a silently missing source.

File form (JSON; YAML too when PyYAML is importable), relative local paths taken from the
file's directory::

    {"sources": {"web":  {"url": "s3://bucket/web", "weight": 0.6},
                 "code": {"url": "../code", "weight": 0.4}},
     "schedule": [{"from_step": 5000, "weights": {"web": 0.5, "code": 0.5}}],
     "max_repeat": 10}

A file may also say how the run batches it, as the loader's keywords (`Mixture.batching_args`):
``"seq_len"`` and ``"batch_size"``, each one value or a schedule by step (``{"0": 4, "2000":
8}``), and ``"max_tokens"`` (one budget).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np

from ..batching import Batching

__all__ = [
    "DEFAULT_MAX_REPEAT",
    "Mixture",
    "MixtureError",
    "MixtureSource",
    "as_weight",
    "is_mixture_file",
    "source_batching",
    "source_seed",
]

DEFAULT_MAX_REPEAT = 10
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SUFFIXES = (".json", ".yaml", ".yml")


class MixtureError(ValueError):
    """A mixture that cannot be used as given; the message names the source or entry."""


def as_weight(where: str, value: Any) -> Fraction:
    """A weight as an exact fraction: an int, a float (by its shortest repr: 0.6 is 3/5), a
    Fraction, or a string such as "0.6" or "3/5". Finite and >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction, str, np.integer, np.floating)):
        raise MixtureError(f"{where}: a weight must be a number, found {value!r}")
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        raise MixtureError(f"{where}: a weight must be finite, found {value!r}")
    try:
        w = Fraction(repr(float(value))) if isinstance(value, (float, np.floating)) else Fraction(value)  # type: ignore[arg-type]  # np.integer is a numbers.Integral
    except (ValueError, ZeroDivisionError):
        raise MixtureError(f"{where}: a weight must be a number, found {value!r}") from None
    if w < 0:
        raise MixtureError(f"{where}: a weight must be >= 0, found {value!r}")
    return w


@dataclass(frozen=True)
class MixtureSource:
    """One dataset of a mixture: ``name`` (letters, digits, ``_.-``), its URL and its weight from step 0."""

    name: str
    url: str
    weight: Fraction

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise MixtureError(
                f"source name {self.name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
            )
        if not isinstance(self.url, (str, os.PathLike)) or not str(self.url):
            raise MixtureError(f"source {self.name!r}: url must be a non-empty string, found {self.url!r}")
        object.__setattr__(self, "url", os.fspath(self.url))
        object.__setattr__(self, "weight", as_weight(f"source {self.name!r}", self.weight))


class Mixture:
    """Sources with token weights, an optional schedule of weight changes, and ``max_repeat``:
    the most source-epochs (passes over one source, each freshly shuffled) a run may take.

    ``sources``: ``{name: (url, weight)}``, or a list of `MixtureSource`. ``schedule``: a list of
    ``(from_step, {name: weight})`` naming every source. ``replace``: names of sources that now
    read another dataset than a loader state they resume records under that name (a filtered
    version of a source, say): each starts from its beginning instead of being refused.

    ``batching``: how the run batches the mixture, as the loader's keywords ``batch_size``,
    ``seq_len`` (each one value or ``{first step: value}``) and ``max_tokens``; the loader and
    ``shardtool plan`` take them where their own arguments give none (`batching_args`)."""

    def __init__(
        self,
        sources: Mapping[str, Sequence[Any]] | Sequence[MixtureSource],
        schedule: Sequence[Any] | None = None,
        max_repeat: int = DEFAULT_MAX_REPEAT,
        replace: Sequence[str] = (),
        batching: Mapping[str, Any] | None = None,
    ):
        self.sources: tuple[MixtureSource, ...] = _parse_sources(sources)
        self.batching: dict[str, int | dict[int, int]] = _parse_batching(batching or {})
        if isinstance(replace, (str, bytes)) or not all(isinstance(n, str) for n in replace):
            raise MixtureError(f"replace must be a list of source names, found {replace!r}")
        unknown = sorted(set(replace) - set(self.names))
        if unknown:
            raise MixtureError(
                f"replace names sources this mixture does not have: {unknown} (sources: {list(self.names)})"
            )
        self.replace: frozenset[str] = frozenset(replace)
        if isinstance(max_repeat, bool) or not isinstance(max_repeat, int) or max_repeat < 1:
            raise MixtureError(f"max_repeat must be an int >= 1, found {max_repeat!r}")
        self.max_repeat = max_repeat
        base = (0, tuple(s.weight for s in self.sources))
        self.schedule: tuple[tuple[int, tuple[Fraction, ...]], ...] = (base, *self._parse_schedule(schedule or ()))
        for step, weights in self.schedule:
            if not any(weights):
                at = "the sources' weights" if step == 0 else f"the schedule entry at step {step}"
                raise MixtureError(f"{at}: at least one weight must be > 0, found all 0")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    def _parse_schedule(self, schedule: Sequence[Any]) -> list[tuple[int, tuple[Fraction, ...]]]:
        if isinstance(schedule, (str, bytes, Mapping)):
            raise MixtureError(f"schedule must be a list of (from_step, weights), found {schedule!r}")
        out, last = [], 0
        for entry in schedule:
            step, weights = _pair(f"schedule entry {entry!r}", entry, ("from_step", "weights"))
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise MixtureError(
                    f"schedule entry {entry!r}: from_step must be an int >= 1 (the sources' "
                    "weights are the weights from step 0)"
                )
            if step <= last:
                raise MixtureError(f"schedule entries must have increasing from_step: {step} after {last}")
            out.append((step, self._entry_weights(f"schedule entry at step {step}", weights)))
            last = step
        return out

    def _entry_weights(self, where: str, weights: Any) -> tuple[Fraction, ...]:
        if not isinstance(weights, Mapping):
            raise MixtureError(f"{where}: weights must be a mapping of source name to weight, found {weights!r}")
        unknown = sorted(set(weights) - set(self.names))
        missing = [n for n in self.names if n not in weights]
        if unknown or missing:
            raise MixtureError(
                f"{where}: weights must name every source ({', '.join(self.names)}); "
                f"unknown {unknown}, missing {missing}"
            )
        return tuple(as_weight(f"{where}, source {n!r}", weights[n]) for n in self.names)

    def with_weights(self, weights: Mapping[str, Any]) -> Mixture:
        """The same sources with these weights from step 0 and no schedule (e.g. new weights for
        the rest of a run, given at a resume)."""
        new = self._entry_weights("new weights", weights)
        sources = [replace(s, weight=w) for s, w in zip(self.sources, new)]
        return Mixture(sources, max_repeat=self.max_repeat, replace=sorted(self.replace), batching=self.batching)

    def batching_args(self, **given: Any) -> dict[str, Any]:
        """``given`` (the loader's ``batch_size``, ``seq_len`` and ``max_tokens``, None where not
        given) completed by this mixture's `batching`: a keyword not given takes the mixture's
        value; one given by both must say the same (ValueError naming it otherwise)."""
        out = dict(given)
        for name, other in (("batch_size", "max_tokens"), ("max_tokens", "batch_size")):
            if out.get(name) is not None and other in self.batching and self.batching.get(name) is None:
                raise MixtureError(
                    f"{name}={out[name]!r} given, and the mixture's {other} {self.batching[other]!r}: a batch is "
                    "sized by one of them; give it in one place"
                )
        for name, value in self.batching.items():
            if out.get(name) is None:
                out[name] = value
            elif _changes(name, out[name]) != _changes(name, value):
                raise MixtureError(
                    f"{name}={out[name]!r} differs from the mixture's {name} {value!r}: give it in one place, "
                    "or the same in both"
                )
        return out

    # ------------------------------------------------------------------ identity and files
    def schedule_identity(self) -> list[list[Any]]:
        """The schedule as JSON: [[from_step, {name: "p/q"}], ...] (exact: what a state records)."""
        return [[step, {n: str(w) for n, w in zip(self.names, weights)}] for step, weights in self.schedule]

    def fingerprint(self) -> str:
        data = {
            "sources": [[s.name, s.url] for s in self.sources],
            "schedule": self.schedule_identity(),
            "max_repeat": self.max_repeat,
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out = {
            "sources": {s.name: {"url": s.url, "weight": str(s.weight)} for s in self.sources},
            "schedule": [{"from_step": step, "weights": w} for step, w in self.schedule_identity()[1:]],
            "max_repeat": self.max_repeat,
        }
        if self.replace:
            out["replace"] = sorted(self.replace)
        for name, value in self.batching.items():
            out[name] = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base_dir: str | None = None) -> Mixture:
        """A mixture from its file form; ``base_dir`` resolves relative local paths."""
        if not isinstance(data, Mapping) or "sources" not in data:
            raise MixtureError(
                "a mixture must be a mapping with 'sources' (and optionally 'schedule', 'max_repeat', 'replace')"
            )
        keys = ("sources", "schedule", "max_repeat", "replace", *BATCHING_KEYS)
        extra = sorted(set(data) - set(keys))
        if extra:
            raise MixtureError(f"unknown mixture keys {extra}; expected {', '.join(keys)}")
        raw = data["sources"]
        if not isinstance(raw, Mapping) or not raw:
            raise MixtureError('\'sources\' must map each source name to {"url": ..., "weight": ...}')
        sources = []
        for name, spec in raw.items():
            url, weight = _pair(f"source {name!r}", spec, ("url", "weight"))
            sources.append(MixtureSource(str(name), _resolve(url, base_dir), weight))
        batching = {k: data[k] for k in BATCHING_KEYS if k in data}
        return cls(
            sources,
            data.get("schedule"),
            data.get("max_repeat", DEFAULT_MAX_REPEAT),
            data.get("replace", ()),
            batching=batching,
        )

    @classmethod
    def from_file(cls, path: str) -> Mixture:
        """A mixture file: JSON (``.json``), or YAML (``.yaml``/``.yml``, needs PyYAML)."""
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError as e:
            raise MixtureError(f"cannot read mixture file {path}: {e.strerror or e}") from None
        if path.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError:
                raise MixtureError(
                    f"{path}: YAML mixture files need PyYAML (pip install pyyaml); or write the mixture as JSON"
                ) from None
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise MixtureError(f"{path}: not valid YAML ({e})") from None
        else:
            try:
                data = json.loads(text)
            except ValueError as e:
                raise MixtureError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(data, base_dir=os.path.dirname(os.path.abspath(path)))
        except MixtureError as e:
            raise MixtureError(f"{path}: {e}") from None

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.name}={float(s.weight):g}" for s in self.sources)
        more = f", {len(self.schedule) - 1} schedule entries" if len(self.schedule) > 1 else ""
        return f"Mixture({parts}{more}, max_repeat={self.max_repeat})"


def _pair(what: str, value: Any, keys: tuple[str, str]) -> tuple[Any, Any]:
    """Two values given as ``{keys[0]: a, keys[1]: b}`` or as a pair (the file's two forms)."""
    if isinstance(value, Mapping):
        if set(value) != set(keys):
            raise MixtureError(f"{what}: expected keys {keys[0]} and {keys[1]}, found {sorted(value)}")
        return value[keys[0]], value[keys[1]]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == 2:
        return value[0], value[1]
    raise MixtureError(f"{what}: expected {{{keys[0]!r}: ..., {keys[1]!r}: ...}} or a pair, found {value!r}")


def _parse_sources(sources: Any) -> tuple[MixtureSource, ...]:
    if isinstance(sources, Mapping):
        items = []
        for name, spec in sources.items():
            if isinstance(spec, MixtureSource):
                items.append(spec)
                continue
            items.append(MixtureSource(name, *_pair(f"source {name!r}", spec, ("url", "weight"))))
    elif isinstance(sources, Sequence) and not isinstance(sources, (str, bytes)):
        items = list(sources)
        if not all(isinstance(s, MixtureSource) for s in items):
            raise MixtureError("sources must be a mapping {name: (url, weight)} or a list of MixtureSource")
    else:
        raise MixtureError(f"sources must be a mapping {{name: (url, weight)}}, found {type(sources).__name__}")
    if not items:
        raise MixtureError("a mixture needs at least one source")
    names = [s.name for s in items]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise MixtureError(f"source names must be unique, found {dupes} more than once")
    return tuple(items)


BATCHING_KEYS = ("batch_size", "seq_len", "max_tokens")  # a mixture's `Mixture.batching`, in its file too


def _parse_batching(batching: Mapping[str, Any]) -> dict[str, int | dict[int, int]]:
    """``batch_size`` and ``seq_len`` (an int >= 1, or ``{first step: value}`` from step 0) and
    ``max_tokens`` (an int: a budget by step is not supported yet), checked; a schedule of one
    value is that value."""
    if not isinstance(batching, Mapping):
        raise MixtureError(f"batching must map {', '.join(BATCHING_KEYS)} to values, found {batching!r}")
    out: dict[str, int | dict[int, int]] = {}
    for name, value in batching.items():
        if name not in BATCHING_KEYS:
            raise MixtureError(f"unknown batching key {name!r}; expected {', '.join(BATCHING_KEYS)}")
        if value is None:
            continue
        if name == "max_tokens" and isinstance(value, Mapping):
            raise MixtureError(
                "max_tokens by step is not supported for a mixture: its bucketed step is one batch of one "
                "source; give one max_tokens (a packed mixture ramps batch_size, rows by step)"
            )
        changes = _changes(name, value)
        out[name] = changes[0][1] if len(changes) == 1 else dict(changes)
    return out


def _changes(name: str, value: Any) -> tuple[tuple[int, int], ...]:
    """``value`` (one value, a ``{first step: value}`` dict, or a `Schedule`) as its changes."""
    from ..schedule import Schedule, parse_schedule

    if isinstance(value, Schedule):
        return value.changes
    if isinstance(value, Mapping):
        try:
            return parse_schedule(name, value).changes
        except ValueError as e:
            raise MixtureError(str(e)) from None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise MixtureError(f"{name} must be an int >= 1 or a schedule {{first step: value}}, found {value!r}")
    return ((0, int(value)),)


def _resolve(url: Any, base_dir: str | None) -> str:
    if not isinstance(url, str) or not url:
        raise MixtureError(f"a source url must be a non-empty string, found {url!r}")
    if base_dir is None or "://" in url or os.path.isabs(url):
        return url
    return os.path.normpath(os.path.join(base_dir, url))


def is_mixture_file(path: str) -> bool:
    """A local file named like a mixture (``.json``/``.yaml``/``.yml``) rather than a dataset root."""
    return isinstance(path, str) and path.endswith(_SUFFIXES) and os.path.isfile(path)


def source_seed(seed: int, name: str) -> int:
    """The seed of one source: the loader's seed mixed with the source's name (hashed, never
    ``hash()``), so sources shuffle independently and a source keeps its order when others change."""
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    words = np.random.SeedSequence([int(seed), name_key]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def source_batching(batching: Batching, name: str) -> Batching:
    """How one source of a mixture is planned: its own seed; packed sources in units of one row
    (``batch_size=1``), so that a step can take rows of several sources.

    Under a cost model each source's units are balanced one by one (`shardtool.plan.mixture.cost`):
    a step's units are then of like cost on every rank whatever their number, so gradient
    accumulation needs nothing of its own, and a ``balance_window`` of W steps is W steps' worth
    of a packed source's rows (``W * batch_size``): a source that takes a share s of each step's
    rows spends W / s steps on a block."""
    packed = batching.packing is not None
    size = 1 if packed else batching.batch_size
    out = replace(batching, batch_size=size, seed=source_seed(batching.seed, name))
    if batching.balance is None:
        return out
    window = batching.balance_window
    if window is not None and packed:
        window *= int(batching.batch_size or 1)
    return out.with_balance(batching.balance, window, None)
