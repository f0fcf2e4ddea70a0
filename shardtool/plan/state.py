"""Resumable loader state: a position in a deterministic plan, not a history.

The state names the epoch and, per *segment* of that epoch, the data layout it ran on (DP size
and data groups), the batches every DP rank had in it and how many it served. Segment 0 is the
epoch's plan. A resume onto another data layout (a node lost, a DP size changed) closes the last
segment and deals the batches it had not served yet — in their order, as whole batches — to the
new layout's DP ranks in equal shares: segment j's DP rank d serves positions
[d·n_j, (d+1)·n_j) of that sequence, n_j = (remaining batches) // (new DP size), and the few
left over join the epoch's remainder. So nothing is served twice, every batch is still one of
the epoch's plan, and replaying the chain is arithmetic plus the plans of the groups a rank's
batches come from — about its own share. The state stays a few numbers, JSON, identical on
every rank.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import about as _about
from .batching import Batching
from .layout import DataLayout

__all__ = ["STATE_VERSION", "LoaderState", "Segment", "StateError", "check_compatible"]

STATE_VERSION = 2
_SEGMENT_KEYS = {"dp_size", "groups", "batches", "served"}  # and "skipped", where steps were skipped


class StateError(ValueError):
    """A loader state that cannot be used here; the message says why and what to do."""


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise StateError(f"loader state {name} must be an int >= {low}, found {value!r}")
    return value


@dataclass(frozen=True)
class Segment:
    """One data layout an epoch ran on: the batches every DP rank had in it, and those served.

    Its layout is kept as the state records it (`DataLayout.identity`: DP size and group sizes;
    the nodes never change which samples a DP rank reads), so two segments of one layout compare
    equal wherever their nodes were. The saved form is `to_dict`; only `LoaderState` reads and
    writes it."""

    layout: DataLayout
    batches: int
    served: int  # the position: batches before it were served or skipped
    # Ranges [a, b) of positions never served (`LoaderState.skipping`: steps skipped after a loss
    # spike), sorted and apart; a position at the start of one moves past it.
    skipped: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", DataLayout.from_identity(self.layout.identity()))
        _int("batches", self.batches, 0)
        _int("served", self.served, 0)
        if self.served > self.batches:
            raise StateError(f"segment served {self.served} of only {self.batches} batches")
        ranges = tuple((int(a), int(b)) for a, b in self.skipped)
        for (a, b), nxt in zip(ranges, [*ranges[1:], (self.batches + 1, 0)]):
            if not 0 <= a < b <= self.batches or b >= nxt[0]:
                raise StateError(
                    f"segment skipped ranges must be sorted, apart and in [0, {self.batches}], found {ranges}"
                )
        object.__setattr__(self, "skipped", ranges)
        for a, b in ranges:  # at a skipped range's start, the position is past it
            if a <= self.served < b:
                object.__setattr__(self, "served", b)

    def _skipped_before(self, position: int) -> int:
        return sum(max(0, min(b, position) - a) for a, b in self.skipped)

    @property
    def left(self) -> int:
        """Batches every DP rank has yet to serve in this segment (skipped ones are not)."""
        return self.steps - self.delivered

    @property
    def delivered(self) -> int:
        """Batches every DP rank handed to the trainer in this segment: its steps so far."""
        return self.served - self._skipped_before(self.served)

    @property
    def steps(self) -> int:
        """Batches every DP rank hands over in this segment, skipped ones not counted."""
        return self.batches - self._skipped_before(self.batches)

    def unserved(self) -> np.ndarray:
        """Positions still to serve, in order (``left`` of them)."""
        keep = np.ones(self.batches, dtype=bool)
        keep[: self.served] = False
        for a, b in self.skipped:
            keep[a:b] = False
        return np.flatnonzero(keep).astype(np.int64)

    def after(self, positions: np.ndarray) -> np.ndarray:
        """The position once each of ``positions`` was served: the next one, past a skipped range."""
        nxt = np.asarray(positions, dtype=np.int64) + 1
        for a, b in self.skipped:
            nxt = np.where((nxt >= a) & (nxt < b), b, nxt)
        return nxt

    def position_of(self, step: int) -> int:
        """The position of this segment's ``step``-th delivered batch (steps count as `delivered`)."""
        position = int(step)
        for a, b in self.skipped:
            if a <= position:
                position += b - a
        return position

    def with_served(self, served: int) -> Segment:
        return Segment(self.layout, self.batches, served, self.skipped)

    def with_skipped(self, positions: np.ndarray) -> Segment:
        """This segment with ``positions`` skipped too (merged with its ranges)."""
        mask = np.zeros(self.batches + 1, dtype=bool)
        for a, b in self.skipped:
            mask[a:b] = True
        mask[np.asarray(positions, dtype=np.int64)] = True
        edges = np.flatnonzero(np.diff(np.concatenate([[False], mask])))
        return Segment(self.layout, self.batches, self.served, tuple(zip(edges[::2].tolist(), edges[1::2].tolist())))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.layout.identity(), "batches": self.batches, "served": self.served}
        if self.skipped:
            out["skipped"] = [list(r) for r in self.skipped]
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Segment:
        """A saved segment (``{"dp_size", "groups", "batches", "served"}``, and ``"skipped"``
        where steps were skipped), checked."""
        if not isinstance(data, Mapping) or set(data) - {"skipped"} != _SEGMENT_KEYS:
            raise StateError(f"loader state segment: found {data!r}, expected keys {sorted(_SEGMENT_KEYS)}")
        try:
            layout = DataLayout.from_identity(data)
        except (KeyError, TypeError, ValueError) as e:
            raise StateError(f"segment layout {dict(data)!r} is malformed ({e})") from None
        skipped = data.get("skipped", [])
        if not isinstance(skipped, Sequence) or not all(
            isinstance(r, Sequence) and len(r) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
            for r in skipped
        ):
            raise StateError(f"segment skipped must be a list of [first, stop] positions, found {skipped!r}")
        return cls(layout, data["batches"], data["served"], tuple((a, b) for a, b in skipped))


def _v1_fingerprint(batching: Batching) -> str:
    """The batching fingerprint the previous release (plan version 1) gave this config."""
    fields = {
        "batch_size": batching.batch_size,
        "max_tokens": batching.max_tokens,
        "shuffle": batching.shuffle,
        "seed": batching.seed,
        "window": batching.window,
    }
    canonical = json.dumps({"plan_version": 1, **fields}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass
class LoaderState:
    """Where the loader is: epoch, and per layout segment its batches per DP rank and those served."""

    epoch: int
    dataset_fingerprint: str
    batching_fingerprint: str
    segments: list[Segment] = field(default_factory=list)
    version: int = STATE_VERSION
    # What it was saved for, in words (`shardtool.plan.about`): None in states from before it.
    about: dict[str, Any] | None = None
    # The run's step at the epoch's first batch, kept by a loader with a batch-size schedule
    # (`shardtool.plan.schedule`), whose steps are the run's; None: not recorded (saved as "step").
    step: int | None = None

    @classmethod
    def start(
        cls, epoch: int, dataset_fingerprint: str, batching: Batching, layout: DataLayout, batches: int
    ) -> LoaderState:
        """The state before the first batch of ``epoch`` on ``layout`` (``batches`` per DP rank)."""
        return cls(epoch, dataset_fingerprint, batching.fingerprint(), [Segment(layout, batches, 0)])

    @property
    def last(self) -> Segment:
        if not self.segments:
            raise StateError("loader state has no segments")
        return self.segments[-1]

    @property
    def served(self) -> int:
        """Batches every DP rank has had in this epoch, over all its segments (layouts): the
        trainer's steps of the epoch so far (skipped batches are not among them)."""
        return sum(s.delivered for s in self.segments)

    def skipping(self, first: int, stop: int) -> LoaderState:
        """This state with the epoch's steps ``first .. stop - 1`` never served: the batches the
        run would have had at those steps are dropped, and the steps go on counting (the step
        ``first`` gets the batch of ``stop``; the epoch has ``stop - first`` fewer). Steps count as
        `served` does; only steps not yet served, of the current segment, can be skipped."""
        if not self.segments:
            raise StateError("a state at the start of an epoch on no layout yet: load it into a loader first")
        done, last = self.served, self.last
        earlier = done - last.delivered
        end = earlier + last.steps
        if not (isinstance(first, int) and isinstance(stop, int)) or not done <= first < stop <= end:
            raise StateError(
                f"steps to skip must be first:stop with {done} <= first < stop <= {end} (the epoch's steps "
                f"not yet served), found {first!r}:{stop!r}"
            )
        # The positions of those steps: the segment's unserved ones, from the first's on.
        new = self.copy()
        new.segments[-1] = last.with_skipped(last.unserved()[first - done : stop - done])
        return new

    def same_layout(self, layout: DataLayout) -> bool:
        return bool(self.segments) and self.last.layout.identity() == layout.identity()

    def resumed_on(self, layout: DataLayout, batches: int) -> LoaderState:
        """This state continued on ``layout``: a new segment of ``batches`` per DP rank if the
        layout changed (`shardtool.plan.rank.Planner.continue_on` counts them). A state with
        no segment (the start of an epoch) starts its first one."""
        new = self.copy()
        if not self.same_layout(layout):
            new.segments.append(Segment(layout, batches, 0))
        return new

    def with_served(self, served: int) -> LoaderState:
        """This state after every DP rank has served ``served`` batches of the current segment."""
        new = self.copy()
        new.segments[-1] = new.last.with_served(served)
        return new

    def copy(self) -> LoaderState:
        return LoaderState(
            self.epoch,
            self.dataset_fingerprint,
            self.batching_fingerprint,
            list(self.segments),  # frozen: shared, never changed in place
            self.version,
            self.about,
            self.step,
        )

    def described(self, about: Mapping[str, Any] | None) -> LoaderState:
        """This state with ``about`` (`shardtool.plan.about.describe`) as its description."""
        new = self.copy()
        new.about = parse_about(about)
        return new

    def to_dict(self) -> dict[str, Any]:
        out = {
            "version": self.version,
            "epoch": self.epoch,
            "dataset_fingerprint": self.dataset_fingerprint,
            "batching_fingerprint": self.batching_fingerprint,
            "segments": [s.to_dict() for s in self.segments],
        }
        if self.about is not None:
            out["about"] = parse_about(self.about)
        if self.step is not None:
            out["step"] = self.step
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, batching: Batching | None = None) -> LoaderState:
        """Parse a saved state. A state of the previous release (version 1) loads when it sits at
        the start of an epoch (no batch served), which every plan version agrees on; ``batching``
        (the config it is loaded under) checks that it was saved with the same config."""
        if not isinstance(data, Mapping):
            raise StateError(f"loader state must be a mapping, found {type(data).__name__}")
        if data.get("version") == 1:
            return cls._from_v1(data, batching)
        expected = {"version", "epoch", "dataset_fingerprint", "batching_fingerprint", "segments"}
        # "about": optional, states from before it lack it; "step": a scheduled run's only.
        if set(data) - {"about", "step"} != expected:
            raise StateError(
                f"loader state keys: found {sorted(data)}, expected {sorted(expected)} and optionally 'about', 'step'"
            )
        if data["version"] != STATE_VERSION:
            raise StateError(f"unsupported loader state version: found {data['version']!r}, expected {STATE_VERSION}")
        epoch = _int("epoch", data["epoch"], 0)
        for key in ("dataset_fingerprint", "batching_fingerprint"):
            if not isinstance(data[key], str):
                raise StateError(f"loader state {key} must be a string, found {data[key]!r}")
        segments = data["segments"]
        if not isinstance(segments, Sequence) or isinstance(segments, str) or not segments:
            raise StateError(f"loader state segments must be a non-empty list, found {segments!r}")
        parsed = [Segment.from_dict(seg) for seg in segments]
        return cls(
            epoch,
            data["dataset_fingerprint"],
            data["batching_fingerprint"],
            parsed,
            STATE_VERSION,
            parse_about(data.get("about")),
            _int("step", data["step"], 0) if "step" in data else None,
        )

    @classmethod
    def _from_v1(cls, data: Mapping[str, Any], batching: Batching | None) -> LoaderState:
        segments = data.get("segments") or []
        epoch = data.get("epoch")
        at_start = len(segments) == 1 and isinstance(segments[0], Mapping) and segments[0].get("served") == 0
        if not at_start:
            raise StateError(
                f"this loader state was saved by shardtool 0.1 in the middle of epoch {epoch!r}; its plan "
                "(version 1) ordered batches differently from this release's, so that position cannot be "
                "carried over exactly. Finish the epoch with shardtool 0.1, or start epoch "
                f"{epoch!r} afresh here with loader.set_epoch({epoch!r}) (its samples served before the "
                "checkpoint are then seen again)"
            )
        if batching is not None and data.get("batching_fingerprint") != _v1_fingerprint(batching):
            raise StateError(
                "loader state was saved with another batching config: found fingerprint "
                f"{data.get('batching_fingerprint')!r}, expected {_v1_fingerprint(batching)!r} for "
                f"{batching} (as shardtool 0.1 computed it)"
            )
        # No segment: the start of the epoch, on whatever layout loads it.
        return cls(
            _int("epoch", epoch, 0),
            str(data.get("dataset_fingerprint")),
            batching.fingerprint() if batching is not None else "",
            [],
            STATE_VERSION,
        )


def parse_about(value: Any) -> dict[str, Any] | None:
    """A state's description checked for shape, as a plain JSON copy (None when it has none)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        raise StateError(f"loader state 'about' must map names to mappings, found {value!r}")
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise StateError(f"loader state 'about' is not JSON ({e})") from None


def check_compatible(
    state: LoaderState, dataset_fingerprint: str, batching: Batching, about: Mapping[str, Any] | None = None
) -> LoaderState:
    """``state``, refused where it was saved for another dataset or batching config; ``about``
    (this loader's description, `shardtool.plan.about.describe`) lets the message name both sides.

    A state of this dataset saved before its ranges were cut by sample count
    (`shardtool.plan.about.ranges_changed`) is returned as the start of its epoch under the new
    cut where nothing of the epoch was served or skipped (saved at an epoch's end, or before its
    first batch): it holds no position in the old plan, only which epoch (and step) comes next. So
    is one saved with another batching config: a position inside an epoch is refused, naming both."""
    expected = about or {"batching": batching.describe()}
    untouched = not state.served and not any(s.skipped for s in state.segments)
    if untouched and _about.ranges_changed(state.dataset_fingerprint, dataset_fingerprint) is not None:
        state = LoaderState(
            state.epoch, dataset_fingerprint, state.batching_fingerprint, [], state.version, state.about, state.step
        )
    if state.dataset_fingerprint != dataset_fingerprint:
        raise StateError(_about.dataset_mismatch(state.about, state.dataset_fingerprint, expected, dataset_fingerprint))
    if state.batching_fingerprint != batching.fingerprint():
        if untouched:
            # Likewise for another batching (a cost model calibrated, a batch size changed between
            # epochs): the epoch starts under this one, as set_epoch on a fresh loader would.
            return LoaderState(
                state.epoch,
                state.dataset_fingerprint,
                batching.fingerprint(),
                [],
                state.version,
                state.about,
                state.step,
            )
        raise StateError(
            _about.batching_mismatch(state.about, state.batching_fingerprint, expected, batching.fingerprint())
        )
    return state
