"""``shardtool trace``: which samples a rank's batch at a step holds, from the plan alone."""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

from ..format.errors import ShardtoolError
from ._args import add_storage_option_argument, storage_options_from
from ._plan import (
    add_batching_arguments,
    batch_size_of,
    max_tokens_of,
    require_size,
    schedule_of,
    seq_len_of,
    take_mixture_batching,
)

HELP = "which samples (and pieces of them) a rank's batch at a step holds, from the plan alone"
DESCRIPTION = """\
Which samples a training rank's batch at a step holds: key, shard, place in the shard, global
index and length; for packed rows every piece (row, document, offset in it, tokens). Computed
from the dataset's metadata, the layout, the batching options and the seed, as the loader plans
them: no sample is read, and the answer is what the loader delivers (or delivered) there. Give
the options the run's loader was built with; for a resumed run, the loader state it saved
(--state), whose epoch and layout segments it then follows.

--key K (or --sample SHARD:I) answers the other way: the steps and DP ranks that serve that
sample in the epoch (packed: each piece of it); with --state, as the run went (served before an
elastic resume, re-dealt after it, or skipped). For a mixture: the run's steps of the state's phase
that serve it, in every source that has the key (--source NAME for one).

A step counts as len(loader) does: batches of the epoch from its first. After an elastic resume
(another number of ranks), the steps served on the earlier layout are traced with that layout.

URL may be a mixture file (as shardtool plan takes it) with the run's length, --steps N (or
--tokens T): the step is then the run's global batch, and each sample names its source; with a
--state saved before a change of weights or sources, the steps from the resume on are traced.

Examples:
  shardtool trace ./ds --step 1200 --rank 5 --nodes 2 --ranks-per-node 8 --seq-len 4096 --batch-size 2
  shardtool trace ./ds --step 1200 --rank 5 --nodes 2 --ranks-per-node 8 --max-tokens 65536 \\
      --state ckpt/loader_state.json --json
"""


def add_arguments(p) -> None:
    p.add_argument("url", help="dataset root (local path or fsspec URL), or a mixture file (.json, .yaml)")
    add_storage_option_argument(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--step", metavar="N", help="the step (batch of the epoch) to trace, or a span A:B (steps A to B-1)"
    )
    what.add_argument("--key", metavar="K", help="instead: the steps and ranks that serve the sample with key K")
    what.add_argument(
        "--sample", metavar="SHARD:I", help="instead: the steps and ranks that serve sample I of SHARD (path or number)"
    )
    p.add_argument("--rank", type=int, default=0, metavar="R", help="global rank (default 0)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--ranks-per-node", type=int, default=1, metavar="G", help="ranks (GPUs) per node (default 1)")
    add_batching_arguments(p)
    p.add_argument("--epoch", type=int, default=None, help="the epoch (default: the state's, else 0)")
    p.add_argument(
        "--state",
        default=None,
        metavar="STATE",
        help="the loader state the run saved (loader.state_dict()): a JSON file, or a torch checkpoint holding it",
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, default=None, metavar="N", help="a mixture's length: steps")
    length.add_argument("--tokens", type=int, default=None, metavar="T", help="a mixture's length: tokens")
    p.add_argument(
        "--dump",
        metavar="DIR",
        help="with --step: write the step(s) as the loader delivers them to DIR (reads the samples): "
        "step-00000002.rank-1.npz (the batch's arrays; step and rank as numbers, the step 8 digits) and "
        ".json (the trace and the batch's keys)",
    )
    p.add_argument(
        "--source", metavar="NAME", help="a mixture's source the --key or --sample is of (default: every source)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from ..loader.trace import dump, find, sample_of, traces
    from ..plan.mixture import Mixture, is_mixture_file

    source = args.url
    if is_mixture_file(args.url):
        try:
            source = Mixture.from_file(args.url)
            take_mixture_batching(args, source)  # its sizes, as `shardtool plan` takes them
        except ValueError as e:
            raise ShardtoolError(str(e)) from None
    elif args.steps is not None or args.tokens is not None:
        raise ShardtoolError("--steps and --tokens give a mixture's length (URL a mixture file); a dataset has epochs")
    else:
        try:
            require_size(args)
        except ValueError as e:
            raise ShardtoolError(str(e)) from None
    try:
        schedule = schedule_of(args)
    except ValueError as e:
        raise ShardtoolError(str(e)) from None
    kw = dict(
        batch_size=dict(schedule.changes) if schedule is not None and not schedule.micro else batch_size_of(args),
        max_tokens=dict(schedule.changes) if schedule is not None and schedule.micro else max_tokens_of(args),
        seq_len=dict(schedule.seq_lens) if schedule is not None and schedule.seq_lens else seq_len_of(args),
        packing=args.packing,
        eos_id=args.eos_id,
        max_docs_per_row=args.max_docs_per_row,
        seed=args.seed,
        shuffle=not args.no_shuffle,
        shuffle_block=args.shuffle_block,
        drop_last={"auto": None, "yes": True, "no": False}[args.drop_last],
        cost_model=args.cost_model,
        balance_window=args.balance_window,
        micro_batches=args.micro_batches,
    )
    if args.exact:  # only where asked: a Mixture's loader takes no exact
        kw["exact"] = True
    if source is not args.url:
        kw.update(steps=args.steps, tokens=args.tokens)
    try:
        with warnings.catch_warnings():
            # The loader's note that packed batches leave out a dataset's non-token fields names a
            # keyword (token_fields) this command does not take; the trace lists every sample anyway.
            warnings.filterwarnings("ignore", message="packed batches carry the tokens", category=UserWarning)
            ld = _loader(source, args, kw)
    except ValueError as e:
        raise ShardtoolError(str(e)) from None
    try:
        if args.state:
            from ._statefile import read_state_file

            try:
                ld.load_state_dict(read_state_file(args.state).state)
            except ValueError as e:
                raise ShardtoolError(f"--state {args.state}: {e}") from None
        try:
            if args.step is not None:
                first, stop = _span(args.step)
                if args.dump:
                    if args.epoch is not None and args.epoch != ld.epoch:
                        raise ValueError("--dump reads the loader's own epoch: give --state, not --epoch")
                    paths = dump(ld, first, stop, args.dump)
                    print(f"wrote {len(paths)} files to {args.dump} (steps {first}..{stop - 1}, rank {args.rank})")
                    return 0
                steps = traces(ld, first, stop, epoch=args.epoch)
                got = steps[0] if ":" not in args.step else {"steps": steps}
            elif args.dump:
                raise ValueError("--dump writes steps: give --step N or --step A:B")
            else:
                where: dict[str, Any] = {"key": args.key}
                if args.key is None:
                    shard, _, index = args.sample.rpartition(":")
                    if not shard or not index.isdigit():
                        raise ValueError(
                            f"--sample takes SHARD:I (a shard's path or number, an index), found {args.sample!r}"
                        )
                    where = {"shard": shard, "index": int(index)}
                if isinstance(source, Mixture):
                    got = _find_in_mixture(ld, args.source, where)
                else:
                    gid = sample_of(ld, **where)
                    epoch = args.epoch if args.epoch is not None else ld.epoch
                    got = {"epoch": epoch, "sample": gid, "served": find(ld, gid, epoch=epoch)}
        except (TypeError, ValueError) as e:
            raise ShardtoolError(str(e)) from None
    finally:
        ld.close()
    if args.json:
        json.dump(got, sys.stdout)
        sys.stdout.write("\n")
        return 0
    if "served" in got:
        _print_served(got)
    else:
        for one in got.get("steps", [got]):
            _print(one, packed=args.seq_len is not None)
    return 0


def _find_in_mixture(ld: Any, name: str | None, where: dict[str, Any]) -> dict[str, Any]:
    """`find` in each source of the mixture that has the sample (or in ``name`` alone)."""
    from ..loader.trace import find, sample_of

    names = [name] if name else list(ld.datasets)
    samples, served = [], []
    for n in names:
        try:
            gid = sample_of(ld, source=n, **where)
        except ValueError:
            if name:
                raise
            continue
        samples.append({"source": n, "sample": gid})
        served += find(ld, gid, source=n)
    if not samples:
        raise ValueError(f"no source of the mixture ({', '.join(names)}) has that sample")
    return {"samples": samples, "served": sorted(served, key=lambda e: (e["step"], e["dp_rank"]))}


def _span(text: str) -> tuple[int, int]:
    """``N`` -> (N, N + 1); ``A:B`` -> (A, B)."""
    a, sep, b = text.partition(":")
    try:
        first, stop = (int(a), int(b)) if sep else (int(a), int(a) + 1)
    except ValueError:
        raise ValueError(f"--step takes N or A:B (steps A to B-1), found {text!r}") from None
    if not 0 <= first < stop:
        raise ValueError(f"--step {text}: give 0 <= A < B")
    return first, stop


def _print_served(got: dict) -> None:
    served = got["served"]
    if "samples" in got:  # a mixture: steps of the run
        names = ", ".join(f"sample {s['sample']} of {s['source']}" for s in got["samples"])
        print(f"{names}: {'served at' if served else 'not served in the steps of this phase'}")
        for e in served:
            piece = f", row {e['row']}, from its token {e['offset']}" if "row" in e else ""
            print(f"  step {e['step']}, DP rank {e['dp_rank']}, {e['source']} epoch {e['source_epoch']}{piece}")
        return
    if not served:
        print(f"sample {got['sample']}: not served in epoch {got['epoch']} (left out for equal batch counts)")
        return
    print(f"sample {got['sample']}: served in epoch {got['epoch']} at")
    for e in served:
        piece = f", row {e['row']}, from its token {e['offset']}" if "row" in e else ""
        print(f"  step {e['step']}, DP rank {e['dp_rank']}{piece}: {e['length']} tokens")


def _print(got: dict, packed: bool) -> None:
    samples = got["samples"]
    when = f"epoch {got['epoch']}, " if "epoch" in got else ""
    what = "pieces" if packed else "samples"
    print(f"{when}step {got['step']}, rank {got['rank']} (DP rank {got['dp_rank']}): {len(samples)} {what}")
    fields = ["row"] if packed else []
    fields += ["micro_batch"] if samples and "micro_batch" in samples[0] else []  # a token-budget ramp's step
    fields += ["source"] if samples and "source" in samples[0] else []
    fields += ["key", "shard", "index", "sample"] + (["offset", "length"] if packed else ["length"])
    fields += ["valid"] if samples and "valid" in samples[0] else []  # exact: padding stands in, not valid
    head = ["tokens" if (packed and f == "length") else f for f in fields]
    rows = [[str(s[f]) for f in fields] for s in samples]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


def _loader(source, args, kw: dict):
    from ..loader import ShardedLoader

    return ShardedLoader(
        source,
        rank=args.rank,
        world_size=args.nodes * args.ranks_per_node,
        ranks_per_node=args.ranks_per_node,
        num_workers=0,
        metrics=False,
        stall_timeout=None,
        storage_options=storage_options_from(args),
        **kw,
    )
