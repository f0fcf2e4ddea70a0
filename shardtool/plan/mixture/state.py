"""The resumable position of a mixture: a step in a deterministic plan, not a history.

A mixture state is the step (global batches served) and the current *phase*. A phase begins at
step 0 and again at every resume that changes something — the weights or schedule, the set of
sources, the data layout. It records what locates every source without any earlier phase:

- the schedule in force (exact weights) and the data layout (DP size, data groups);
- per source, in source order: its dataset version; its expected tokens per unit on this layout
  as ``tokens`` / ``units`` of one source-epoch (so the composition of the phase is computable
  from the state alone, even for a source later removed); and the source-epoch it was in at the
  phase start with that epoch's single-source segment chain (`shardtool.plan.state`), whose last
  segment is on the phase's layout and says how many units per DP rank it had served.

From these, the units a source served since the phase start (closed form,
`shardtool.plan.mixture.compose`) say where it is: in its starting epoch until that runs out, then in
later epochs planned afresh on the phase's layout (``units / dp_size`` per DP rank each). Small,
JSON, identical on every rank.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from ..batching import Batching
from ..layout import DataLayout
from ..state import LoaderState, StateError, parse_about
from .compose import StepUnits

__all__ = [
    "MIXTURE_STATE_VERSION",
    "MIXTURE_VERSION",
    "MixtureState",
    "Phase",
    "SourceRecord",
    "mixture_fingerprint",
    "source_changes",
]

MIXTURE_STATE_VERSION = 1
# Bumped whenever the composition rule changes which source a unit comes from.
MIXTURE_VERSION = 1
KIND = "mixture"


def mixture_fingerprint(batching: Batching) -> str:
    """What the state's units depend on besides the sources: the batching config and the rule."""
    canonical = json.dumps({"mixture_version": MIXTURE_VERSION, "batching": batching.fingerprint()}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _int(where: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise StateError(f"mixture state {where} must be an int >= {low}, found {value!r}")
    return value


@dataclass
class SourceRecord:
    """One source at the start of a phase (see the module docstring)."""

    name: str
    version: str
    tokens: int  # tokens of one source-epoch
    units: int  # units of one source-epoch on the phase's layout (all DP ranks)
    position: LoaderState  # the epoch at the phase start; its last segment on the phase's layout

    @property
    def epoch(self) -> int:
        return self.position.epoch

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "tokens": self.tokens,
            "units": self.units,
            "epoch": self.position.epoch,
            "segments": self.position.to_dict()["segments"],
        }

    @classmethod
    def from_dict(cls, data: Any, fingerprint: str) -> SourceRecord:
        keys = {"name", "version", "tokens", "units", "epoch", "segments"}
        if not isinstance(data, Mapping) or set(data) != keys:
            raise StateError(f"mixture state source: found {data!r}, expected keys {sorted(keys)}")
        name, version = data["name"], data["version"]
        if not isinstance(name, str) or not isinstance(version, str):
            raise StateError(f"mixture state source name and version must be strings, found {name!r}, {version!r}")
        position = LoaderState.from_dict(
            {
                "version": 2,
                "epoch": data["epoch"],
                "dataset_fingerprint": version,
                "batching_fingerprint": fingerprint,
                "segments": data["segments"],
            }
        )
        return cls(
            name,
            version,
            _int(f"source {name!r} tokens", data["tokens"], 1),
            _int(f"source {name!r} units", data["units"], 1),
            position,
        )


@dataclass
class Phase:
    from_step: int
    schedule: list[list[Any]]  # Mixture.schedule_identity(): [[from_step, {name: "p/q"}], ...]
    layout: DataLayout
    sources: list[SourceRecord]
    # Steps skipped in this phase (`ShardedLoader.skip_steps`), (a, b) in run steps, sorted by a:
    # from step a on, the data moves ahead by the units steps a .. b - 1 would have taken (step a
    # takes what step b would have).
    skipped: tuple[tuple[int, int], ...] = ()
    # Packed rows by run step where they ramp ((first step, rows), ...; `StepUnits`); empty: the
    # batching's one batch_size.
    rows: tuple[tuple[int, int], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    def units_from(self, step: int, units: StepUnits) -> int:
        """Where run step ``step`` begins taking the phase's units (counted from its start), the
        skips from a step at or before it passed over."""
        return self._units(step, units, lambda a: a <= step)

    def units_taken(self, step: int, units: StepUnits) -> int:
        """The phase's units the run steps before ``step`` took or skipped: where a state saved
        at ``step`` continues (a skip that begins at ``step`` is still ahead)."""
        return self._units(step, units, lambda a: a < step) if step > self.from_step else 0

    def _units(self, step: int, units: StepUnits, applies) -> int:
        skipped = sum(units.before(b) - units.before(a) for a, b in self.skipped if applies(a))
        return max(units.before(step) - units.before(self.from_step), 0) + skipped

    def with_skip(self, first: int, stop: int) -> Phase:
        """This phase with run steps ``first .. stop - 1``'s data skipped; StateError unless the
        skip begins in the phase, at or after the last one's start, and spans a step."""
        low = _skip_floor(self.skipped, self.from_step)
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (first, stop))
        if not ints or not low <= first < stop:
            after = ", at or after the last skip's first step" if self.skipped else ""
            raise StateError(
                f"steps to skip must be first:stop with {low} <= first < stop{after}, found {first!r}:{stop!r}"
            )
        return replace(self, skipped=(*self.skipped, (first, stop)))

    def entries(self) -> list[tuple[int, tuple[Fraction, ...]]]:
        """The schedule entries in force from the phase start: (first step, weights in source order)."""
        out = []
        for i, (step, weights) in enumerate(self.schedule):
            nxt = self.schedule[i + 1][0] if i + 1 < len(self.schedule) else None
            if nxt is not None and nxt <= self.from_step:
                continue
            out.append((max(step, self.from_step), tuple(Fraction(weights[n]) for n in self.names)))
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "from_step": self.from_step,
            "schedule": [[s, dict(w)] for s, w in self.schedule],
            "layout": self.layout.identity(),
            "sources": [s.to_dict() for s in self.sources],
        }
        if self.skipped:  # only where steps were skipped: states without keep their form
            out["skipped"] = [list(k) for k in self.skipped]
        if self.rows:  # likewise, only where the rows ramp
            out["rows"] = [list(k) for k in self.rows]
        return out

    @classmethod
    def from_dict(cls, data: Any, fingerprint: str) -> Phase:
        keys = {"from_step", "schedule", "layout", "sources"}
        if not isinstance(data, Mapping) or set(data) - {"skipped", "rows"} != keys:
            raise StateError(
                f"mixture state phase: found keys {sorted(data) if isinstance(data, Mapping) else data!r}, "
                f"expected {sorted(keys)}"
            )
        try:
            layout = DataLayout.from_identity(data["layout"])
        except (KeyError, TypeError, ValueError) as e:
            raise StateError(f"mixture state layout {data['layout']!r} is malformed ({e})") from None
        raw = data["sources"]
        if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw:
            raise StateError(f"mixture state sources must be a non-empty list, found {raw!r}")
        sources = [SourceRecord.from_dict(s, fingerprint) for s in raw]
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise StateError(f"mixture state names a source twice: {names}")
        from_step = _int("from_step", data["from_step"], 0)
        return cls(
            from_step,
            _schedule(data["schedule"], names),
            layout,
            sources,
            _skipped(data.get("skipped"), from_step),
            _rows(data.get("rows")),
        )


def _rows(raw: Any) -> tuple[tuple[int, int], ...]:
    """A phase's recorded rows by step: [[0, rows], [first step, rows], ...], steps increasing."""
    if raw is None:
        return ()
    pairs = raw if isinstance(raw, Sequence) and not isinstance(raw, str) else None
    ok = bool(pairs) and all(
        isinstance(k, Sequence)
        and len(k) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in k)
        and k[0] >= 0
        and k[1] >= 1
        for k in pairs or ()
    )
    steps = [k[0] for k in pairs] if ok and pairs else []
    if not ok or steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
        raise StateError(f"mixture state rows must be [[0, rows], [first step, rows], ...], found {raw!r}")
    return tuple((int(a), int(b)) for a, b in pairs or ())


def _skip_floor(skipped: Sequence[tuple[int, int]], from_step: int) -> int:
    """The first step a new skip may begin at: in the phase, not before the last skip begins."""
    return max(from_step, skipped[-1][0] if skipped else 0)


def _skipped(raw: Any, from_step: int) -> tuple[tuple[int, int], ...]:
    if raw is None:
        return ()
    out: list[tuple[int, int]] = []
    if isinstance(raw, Sequence) and not isinstance(raw, str):
        for k in raw:
            ok = (
                isinstance(k, Sequence)
                and len(k) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in k)
            )
            if not ok or not (_skip_floor(out, from_step) <= k[0] < k[1]):
                break
            out.append((k[0], k[1]))
        else:
            if out:
                return tuple(out)
    raise StateError(
        f"mixture state skipped steps must be [[first, stop], ...] in order from the phase start, found {raw!r}"
    )


def _schedule(raw: Any, names: list[str]) -> list[list[Any]]:
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw:
        raise StateError(f"mixture state schedule must be a non-empty list, found {raw!r}")
    out: list[list[Any]] = []
    last = -1
    for entry in raw:
        if not isinstance(entry, Sequence) or len(entry) != 2 or not isinstance(entry[1], Mapping):
            raise StateError(f"mixture state schedule entry {entry!r}: expected [from_step, {{name: weight}}]")
        step = _int("schedule from_step", entry[0], 0)
        if step <= last or (not out and step != 0):
            raise StateError(f"mixture state schedule must start at step 0 and increase, found {raw!r}")
        if sorted(entry[1]) != sorted(names):
            raise StateError(
                f"mixture state schedule entry at step {step} names {sorted(entry[1])}, its sources are {sorted(names)}"
            )
        try:
            weights = {n: str(Fraction(entry[1][n])) for n in names}
        except (TypeError, ValueError, ZeroDivisionError):
            raise StateError(
                f"mixture state schedule entry at step {step}: weights {entry[1]!r} are malformed"
            ) from None
        out.append([step, weights])
        last = step
    return out


@dataclass
class MixtureState:
    step: int
    fingerprint: str
    phase: Phase
    phases_before: int = 0  # phases this run went through before the current one (for reports)
    version: int = field(default=MIXTURE_STATE_VERSION)
    # Source URLs and batching in words (`shardtool.plan.about.describe_mixture`); None in older states.
    about: dict[str, Any] | None = None

    def at(self, step: int) -> MixtureState:
        return MixtureState(step, self.fingerprint, self.phase, self.phases_before, self.version, self.about)

    def skipping(self, first: int, stop: int) -> MixtureState:
        """This state with the data of run steps ``first .. stop - 1`` never served: the steps go
        on counting and from step ``first`` every source is as far ahead as step ``stop`` would
        have had it (`Phase.with_skip`). Only steps not yet served can be skipped."""
        if isinstance(first, int) and not isinstance(first, bool) and first < self.step:
            raise StateError(f"steps to skip must not be served yet: the state is at step {self.step}, found {first}")
        return replace(self, phase=self.phase.with_skip(first, stop))

    def to_dict(self) -> dict[str, Any]:
        out = {
            "version": self.version,
            "kind": KIND,
            "batching_fingerprint": self.fingerprint,
            "step": self.step,
            "phases_before": self.phases_before,
            "phase": self.phase.to_dict(),
        }
        if self.about is not None:
            out["about"] = parse_about(self.about)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> MixtureState:
        if not isinstance(data, Mapping):
            raise StateError(f"loader state must be a mapping, found {type(data).__name__}")
        if data.get("kind") != KIND:
            raise StateError(
                "this loader state was saved by a single-dataset ShardedLoader, not a mixture: load "
                "it into a loader of that dataset (a mixture cannot continue a single dataset's epoch)"
            )
        keys = {"version", "kind", "batching_fingerprint", "step", "phases_before", "phase"}
        if set(data) - {"about"} != keys:  # "about": optional, states from before it lack it
            raise StateError(
                f"mixture state keys: found {sorted(data)}, expected {sorted(keys)} and optionally 'about'"
            )
        if data["version"] != MIXTURE_STATE_VERSION:
            raise StateError(
                f"unsupported mixture state version: found {data['version']!r}, expected {MIXTURE_STATE_VERSION}"
            )
        if not isinstance(data["batching_fingerprint"], str):
            raise StateError(
                f"mixture state batching_fingerprint must be a string, found {data['batching_fingerprint']!r}"
            )
        phase = Phase.from_dict(data["phase"], data["batching_fingerprint"])
        step = _int("step", data["step"], 0)
        if step < phase.from_step:
            raise StateError(f"mixture state step {step} is before its phase's start {phase.from_step}")
        return cls(
            step,
            data["batching_fingerprint"],
            phase,
            _int("phases_before", data["phases_before"], 0),
            MIXTURE_STATE_VERSION,
            parse_about(data.get("about")),
        )


def source_changes(old: Phase, new: Phase) -> list[str]:
    """What a resume from phase ``old`` into ``new`` changed in what the run trains on, in words:
    sources added or removed, weights or schedule, rows by step. Empty when only the layout changed."""
    versions = {rec.name: rec.version for rec in old.sources}
    out = []
    for rec in new.sources:
        if rec.name not in versions:
            out.append(f"source {rec.name!r} added (from its beginning)")
        elif rec.version != versions[rec.name]:
            out.append(
                f"source {rec.name!r} replaced by another dataset (version {versions[rec.name]} -> "
                f"{rec.version}), from its beginning"
            )
    for name in old.names:
        if name not in new.names:
            out.append(f"source {name!r} removed (no more of its data is served)")
    if old.schedule != new.schedule:
        out.append(f"weights {_weights(old)} -> {_weights(new)}")
    if old.rows != new.rows:
        out.append(f"rows by step {_rows_text(old.rows)} -> {_rows_text(new.rows)}")
    return out


def _rows_text(rows: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"step {first}: {n}" for first, n in rows) if rows else "one batch_size"


def _weights(phase: Phase) -> str:
    """The schedule's weights as people read them: one {name: weight} or [[from_step, {...}], ...]."""
    as_float = [
        [step, {n: round(float(Fraction(w)), 4) for n, w in weights.items()}] for step, weights in phase.schedule
    ]
    return str(as_float[0][1]) if len(as_float) == 1 else str(as_float)
