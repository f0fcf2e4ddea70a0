"""``shardtool state``: read and edit a saved loader state (``ShardedLoader.state_dict()`` as JSON)."""

from __future__ import annotations

import json
import os
import sys

from ..format.errors import ShardtoolError
from ._plan import batch_size_arg, max_tokens_arg, schedule_of, seq_len_arg
from ._statefile import StateFile, read_state_file

HELP = "show a saved loader state, or skip steps in it (after a loss spike) before resuming"
DESCRIPTION = """\
A loader state (what ShardedLoader.state_dict() returns, saved as JSON, on its own or as a key of
a larger checkpoint file) is a position in the deterministic plan: the epoch, and per data layout
the batches each rank had and served.

  show   prints the epoch, the steps served and left, and any steps skipped (the default:
         shardtool state STATE).
  skip   records steps A..B-1 of the epoch as never served, as loader.skip_steps(A, B) does: the
         resumed run's steps go on counting and its data moves past them (step A gets the batch
         of step B; the epoch has B - A fewer steps). Only steps not yet served can be skipped.
         A mixture's state: the run's steps (a mixture has no epochs), every source moving as far
         ahead; the run still ends at its steps=. A state of a loader with a schedule by step
         (batch_size={...}, seq_len={...}, max_tokens={...}): give the schedule, --batch-size
         0:4,2000:8, as the loader had it; the file does not hold it.
         The file is replaced atomically (or written to -o OUT); every rank loads the same state.

The loss-spike workflow: the spike at step N -> `shardtool trace --step N` (its documents) ->
roll back to the checkpoint before it -> `shardtool state skip STATE --steps N-2:N+1` -> resume.

examples:
  shardtool state show ckpt/loader_state.json
  shardtool state skip ckpt/loader_state.json --steps 35:40
  shardtool state skip ckpt/trainer.json --key loader --steps 35:40 -o ckpt/trainer-skip.json
  shardtool state skip ckpt/loader_state.json --steps 35:40 --batch-size 0:4,2000:8
  shardtool state show ckpt/latest.pt          # a torch checkpoint holding {"loader": loader.state_dict(), ...}
  shardtool state skip ckpt/latest.pt --steps 35:40 -o ckpt/loader_state.json
"""


def add_arguments(p) -> None:
    p.add_argument(
        "action",
        nargs="?",
        default="show",
        choices=["show", "skip"],
        help="show the state (the default), or skip steps",
    )
    p.add_argument(
        "path",
        metavar="STATE",
        help="a JSON file holding the loader state, or a torch checkpoint holding it (torch.save({..., "
        '"loader": loader.state_dict()}), read with weights_only=True)',
    )
    p.add_argument(
        "--key",
        help="the loader state is this top-level key of the file (default: the whole file, or the one top-level "
        "value that is a loader state)",
    )
    p.add_argument("--steps", metavar="A:B", help="skip: the epoch's steps A to B-1 (steps as len(loader) counts)")
    p.add_argument("-o", "--output", metavar="OUT", help="skip: write the edited state here instead of STATE")
    p.add_argument("--json", action="store_true", help="show: print one JSON object")
    sched = p.add_argument_group("skip, a state of a loader with a schedule by step (as the loader was given it)")
    sched.add_argument("--batch-size", type=batch_size_arg, metavar="N|STEP:N,...", help="its batch_size, 0:4,2000:8")
    sched.add_argument("--seq-len", type=seq_len_arg, metavar="S|STEP:S,...", help="its seq_len, 0:2048,50000:8192")
    sched.add_argument(
        "--max-tokens", type=max_tokens_arg, metavar="T|STEP:T,...", help="its max_tokens, 0:16384,2000:65536"
    )


def _steps(text: str | None) -> tuple[int, int]:
    try:
        first, stop = (int(v) for v in str(text).split(":"))
    except ValueError:
        raise ShardtoolError(f"--steps must be A:B (the epoch's steps A to B-1), found {text!r}") from None
    return first, stop


def run(args) -> int:
    from ..plan.state import LoaderState, StateError

    if args.path in ("show", "skip") and not os.path.exists(args.path):
        raise ShardtoolError(f"give the state file: shardtool state {args.path} STATE")
    found = read_state_file(args.path, args.key)
    raw = found.state
    if isinstance(raw, dict) and raw.get("kind") == "mixture":
        edited_mixture = _mixture(args, raw)
        if edited_mixture is None:
            return 0
        _write(args, found, edited_mixture)
        return 0
    try:
        state = LoaderState.from_dict(raw)
    except StateError as e:
        raise ShardtoolError(f"{args.path}: {e}") from None
    if args.action == "show":
        return _show(state, args.json, _clock(args, state) if state.step is not None else None)
    if args.steps is None:
        raise ShardtoolError("skip needs --steps A:B")
    first, stop = _steps(args.steps)
    try:
        a, b = _scheduled(args, state, first, stop) if state.step is not None else (first, stop)
        edited = state.skipping(a, b).to_dict()
    except StateError as e:
        raise ShardtoolError(f"{args.path}: {e}") from None
    out = _write(args, found, edited)
    sys.stdout.write(f"{out}: epoch {state.epoch}, steps {first}..{stop - 1} skipped ({stop - first} a rank)\n")
    return 0


def _scheduled(args, state, first: int, stop: int) -> tuple[int, int]:
    """The planned batches of steps ``first .. stop - 1`` of a scheduled loader's state (its
    ``step``: the run's step at the epoch's first batch), by the schedule given as the loader was
    (`loader.skip_steps` takes the same from the loader); the file does not hold the schedule."""
    clock = _clock(args, state)
    if clock is None:
        raise ShardtoolError(
            f"{args.path}: a state of a loader with a schedule by step (its steps take several planned batches "
            "each): give the schedule as the loader had it, --batch-size 0:4,2000:8 (and --seq-len "
            "0:2048,50000:8192 for a warmup, or --max-tokens 0:16384,2000:65536), or skip with loader.skip_steps(A, B) after load_state_dict"
        )
    return clock.batches(state, first, stop)


def _clock(args, state):
    """The schedule's steps over ``state`` (`shardtool.plan.schedule.StepClock`), from the schedule
    given as the loader had it; None where none is given."""
    from ..plan.schedule import StepClock

    try:
        schedule = schedule_of(args)
    except ValueError as e:
        raise ShardtoolError(f"--seq-len: {e}") from None
    if schedule is None:
        return None
    batching = (state.about or {}).get("batching")
    if batching:  # (a state saved without its description cannot be checked)
        wrong = _misfit(batching, schedule)
        if wrong is not None:
            raise ShardtoolError(
                f"{args.path}: the state was planned {wrong}, the schedule given ({schedule.describe()}) "
                "would not have planned it: give the schedule its loader had"
            )
    return StepClock(schedule, int(state.step))


def _misfit(batching: dict, schedule) -> str | None:
    """How the batching a state was planned with (its description) differs from what ``schedule``
    plans, in words; None where they agree. A schedule of another kind or base counts other
    planned batches as a step, and the skip would drop other steps' data than asked."""
    from ..plan.schedule import RUN_STEPS

    unit, other = ("max_tokens", "batch_size") if schedule.micro else ("batch_size", "max_tokens")
    if batching.get(other) is not None or batching.get(unit) != schedule.base:
        return "at " + ", ".join(
            f"{k} {batching[k]}" for k in ("batch_size", "max_tokens") if batching.get(k) is not None
        )
    packed = (batching.get("packing") or {}).get("seq_len")
    if schedule.row_len is not None and packed != schedule.row_len:
        return f"with seq_len {packed}" if packed is not None else "without packed rows (no seq_len)"
    runs = batching.get("run_batches")
    if runs is not None and runs != schedule.run_batches:
        return (
            f"in runs of {runs} batches (a batch-size ramp whose largest size is {runs // RUN_STEPS * schedule.base})"
        )
    return None


def _write(args, found: StateFile, edited: dict) -> str:
    """The edited state into the file (where it was found), replaced atomically, or to ``-o OUT``;
    from a torch checkpoint, only the state, as JSON to ``-o OUT`` (the checkpoint is not rewritten)."""
    from ..format.atomic import atomic_write_bytes

    if not found.json:
        if args.output is None:
            raise ShardtoolError(
                f"{args.path}: a torch checkpoint is not rewritten: give -o OUT.json for the edited loader state, "
                "and load it with loader.load_state_dict(json.load(open(OUT.json)))"
            )
        doc = edited
    elif found.key is not None:
        doc = found.doc
        doc[found.key] = edited
    else:
        doc = edited
    out = args.output or args.path
    atomic_write_bytes(out, (json.dumps(doc, indent=1) + "\n").encode())
    return out


def _mixture(args, raw: dict) -> dict | None:
    """A mixture's state: shown, or its skip recorded (the loader checks the run's length and
    max_repeat when it loads it); None when there is nothing to write."""
    from ..plan.mixture.state import MixtureState
    from ..plan.state import StateError

    try:
        state = MixtureState.from_dict(raw)
    except StateError as e:
        raise ShardtoolError(f"{args.path}: {e}") from None
    phase = state.phase
    if args.action == "show":
        report = {
            "step": state.step,
            "phase_from_step": phase.from_step,
            "sources": list(phase.names),
            "skipped": [list(k) for k in phase.skipped],
        }
        skipped = f"; steps skipped {report['skipped']}" if phase.skipped else ""
        print(
            json.dumps(report)
            if args.json
            else f"mixture at step {state.step:,} (phase from step {phase.from_step:,}, sources {', '.join(phase.names)}){skipped}"
        )
        return None
    if args.steps is None:
        raise ShardtoolError("skip needs --steps A:B")
    first, stop = _steps(args.steps)
    try:
        edited = state.skipping(first, stop)
    except StateError as e:
        raise ShardtoolError(f"{args.path}: cannot skip steps {first}:{stop}: {e}") from None
    sys.stdout.write(f"mixture: the data of steps {first}..{stop - 1} skipped; step {first} takes step {stop}'s\n")
    return edited.to_dict()


def _show(state, as_json: bool, clock=None) -> int:
    """The epoch's steps served and in all; a scheduled loader's state counts its planned batches
    unless its schedule (``clock``) says how many make a step."""
    done = state.served
    total = done - state.last.delivered + state.last.steps if state.segments else 0
    if clock is not None and state.segments:
        done, total = clock.steps(state)
    unit = "planned batches" if state.step is not None and clock is None else "steps"
    report = {
        "epoch": state.epoch,
        "steps_served": done,
        "steps_in_epoch": total,
        "unit": unit,
        "segments": [
            {
                "dp_size": s.layout.dp_size,
                "batches": s.batches,
                "served": s.delivered,
                "skipped": [list(r) for r in s.skipped],
            }
            for s in state.segments
        ],
    }
    if as_json:
        print(json.dumps(report))
        return 0
    print(f"epoch {report['epoch']}: {done:,} of {total:,} {unit} served")
    if unit != "steps":
        print(
            "  (a loader with a schedule by step: give it, --batch-size 0:4,2000:8 and --seq-len 0:2048,50000:8192 "
            "or --max-tokens 0:16384,2000:65536 as the loader had them, to count its steps)"
        )
    for i, s in enumerate(report["segments"]):
        skipped = f", positions skipped {s['skipped']}" if s["skipped"] else ""
        print(
            f"  segment {i}: {s['dp_size']} DP ranks, {s['batches']:,} batches a rank, {s['served']:,} served{skipped}"
        )
    return 0
