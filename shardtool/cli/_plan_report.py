"""``shardtool plan``'s report: the parts of it computed from the plan's figures (start-up
requests, a batch-size schedule's steps) and the report printed as text."""

from __future__ import annotations

import sys

import numpy as np

from ..format.nodeshare import SHARE_ENV
from ..format.sizes import format_size

__all__ = ["METADATA_READS", "print_report", "schedule_report", "startup_requests"]


def print_report(report: dict, data) -> None:
    """``shardtool plan``'s report as text on stdout (``--json`` prints the dict itself)."""
    lay, b = report["layout"], report["bytes_per_node"]
    out = sys.stdout.write
    out(f"dataset       {report['source']}: {report['samples']:,} samples in {report['shards']:,} shards\n")
    if report["synthetic_seconds"] is not None:
        out(f"              (made up, with its per-shard summaries, in {report['synthetic_seconds']:.1f} s)\n")
    out(
        f"layout        {lay['nodes']} nodes x {lay['ranks_per_node']} ranks = {lay['world_size']} ranks; "
        f"{data.describe()}\n"
    )
    out(f"batches/rank  {report['batches_per_rank']:,} (equal on every rank)\n")
    if report["scope"] == "rank":
        out(
            f"rank          {report['rank']} (DP rank {report['dp_rank']}, data group {report['group']} of "
            f"{report['group_samples']:,} samples): {report['rank_samples']:,} "
            # Packed, a rank serves pieces: a split document's several, so more than the group's samples.
            f"{'pieces of documents' if report['batching'].get('seq_len') else 'samples'}\n"
        )
        out(
            f"{'fill rate' if report['batching']['seq_len'] else 'padding eff.':<14}"
            f"{report['padding_efficiency']:.4f}\n"
        )
        pieces = f"{report['remainder_pieces']:,} pieces, " if report["batching"]["seq_len"] else ""
        out(
            f"remainder     {pieces}{report['remainder_tokens']:,} tokens, {report['remainder_tokens_fraction']:.3%} "
            "of its group's tokens this epoch\n"
        )
        out(
            f"planning      {report['plan_seconds']:.3f} s, peak RSS {report['peak_rss_mb']:.0f} MB "
            "(a fresh process, as a training rank at start-up)\n"
        )
    else:
        if "fill_rate" in report:
            rpr = report["rows_per_rank"]
            out(
                f"rows/rank     {rpr['min']:,}..{rpr['max']:,} of {report['batching']['seq_len']:,} tokens "
                f"({report['batching']['packing']})\n"
            )
            out(f"fill rate     {report['fill_rate']:.4f} (real tokens / row tokens)\n")
            if "piece_cap" in report:
                out(f"NOTE          {report['piece_cap']}\n")
            out(
                f"documents     {report['documents_split']:,} split into pieces, {report['documents_dropped']:,} "
                "dropped (longer than a row, no-split)\n"
            )
        else:
            spr = report["samples_per_rank"]
            out(f"samples/rank  {spr['min']:,}..{spr['max']:,}\n")
            out(f"padding eff.  {report['padding_efficiency']:.4f}\n")
        # Packed rows leave out pieces (a document may lose some and keep others): pieces and
        # tokens are the unit of the loss; samples count only documents no token of which is served.
        unit = f"{report['remainder_samples']:,} samples"
        if "remainder_pieces" in report:
            # A document of no tokens has no piece: never served, and nothing of it lost.
            whole = report["remainder_samples"]
            unit = f"{report['remainder_pieces']:,} pieces of documents ({whole:,} document(s) wholly"
            unit += ": empty ones)" if whole and not report["remainder_pieces"] else ")"
        out(
            f"remainder     {unit}, {report['remainder_tokens']:,} tokens, {report['remainder_tokens_fraction']:.3%} "
            "of the tokens, not served this epoch (rotates across epochs)\n"
        )
        if "padding_batches" in report:
            out(
                f"padding       {report['padding_batches']:,} batches in all, served by ranks short of a batch "
                "(exact: marked not valid, batch['valid'])\n"
            )
        if "compute_balance" in report:
            print_balance(report["compute_balance"], out, report.get("layout"))
        if "schedule" in report:
            _print_schedule(report["schedule"], out)
        out(
            f"planning      {report['plan_seconds']:.2f} s to simulate every group, peak RSS "
            f"{report['peak_rss_mb']:.0f} MB (a training rank plans only its own: --rank R)\n"
        )
    s = report["shards_per_node"]
    out(f"shards/node   {s['min']}..{s['max']}\n")
    r = report["startup_requests"]
    out(
        f"requests      per node {r['per_node']['min']:,}..{r['per_node']['max']:,} reads of metadata ({r['metadata']} of "
        f"manifest, summaries and lengths + a sample index per shard), {r['total']:,} in all: once per node, "
        f"not per rank (without it, {SHARE_ENV}=0: {r['without_sharing']:,})\n"
    )
    out(
        f"bytes/node    min {format_size(b['min'])}  mean {format_size(b['mean'])}  max {format_size(b['max'])} "
        f"(max/mean {report['bytes_per_node_max_over_mean']:.3f}; whole shards to cache)\n"
    )
    if "plain_bytes_per_node" in report:
        p = report["plain_bytes_per_node"]
        out(
            f"plain/node    min {format_size(p['min'])}  mean {format_size(p['mean'])}  max {format_size(p['max'])} "
            f"(the node cache decompresses {report['compression']} shards; bytes/node above is stored, "
            "what warm moves and what warm --keep-compressed keeps)\n"
        )


# Reads of metadata a node makes at start-up besides its shards' sample indexes: the manifest, the
# summaries, the lengths file's header and the node's range of it (tests/cache/test_node_share.py).
METADATA_READS = 4


def startup_requests(shards_per_node: list[int], ranks_per_node: int) -> dict:
    """Reads of metadata files the layout makes at start-up (and for the sample indexes of the
    epoch), each fetched once per node for its ranks (`shardtool.format.nodeshare`)."""
    per_node = [METADATA_READS + n for n in shards_per_node]
    return {
        "metadata": METADATA_READS,
        "per_node": {"min": min(per_node), "max": max(per_node)},
        "total": sum(per_node),
        "without_sharing": sum(per_node) * ranks_per_node,
    }


def schedule_report(schedule, epoch: int, batches: int, position_tokens) -> dict:
    """A batch-size schedule over the planned epoch: its steps by size, with samples (rows) and
    the tokens each size takes (``position_tokens``: each batch position's, over every rank, as
    planned), and where the epochs around it begin."""
    first = schedule.epoch_first_step(epoch, batches)
    before = np.concatenate([[0], np.cumsum(position_tokens)]).astype(np.int64)
    phases, at = [], 0
    for ph in schedule.phases(first, batches):
        phases.append({**ph, "tokens": int(before[at + ph["batches"]] - before[at])})
        at += ph["batches"]
    return {
        "changes": [list(c) for c in schedule.changes],
        **({"seq_len_changes": [list(c) for c in schedule.seq_lens]} if schedule.seq_lens else {}),
        "base": schedule.base,
        "unit": schedule.unit,
        "epoch_first_step": first,
        "next_epoch_first_step": first + schedule.steps(first, batches),
        "steps": schedule.steps(first, batches),
        "phases": phases,
    }


def _print_schedule(report: dict, out) -> None:
    if "seq_len_changes" in report:
        longest = max(n for _, n in report["seq_len_changes"])
        out(
            f"schedule      rows by step {', '.join(f'{s}: {n}' for s, n in report['changes'])}; seq_len by step "
            f"{', '.join(f'{s}: {n}' for s, n in report['seq_len_changes'])}; planned in batches of {report['base']} "
            f"row{'' if report['base'] == 1 else 's'} of {longest:,} tokens, a step takes its rows' tokens in them, "
            "cut to its seq_len\n"
        )
    elif report.get("unit") == "max_tokens":
        out(
            f"schedule      max_tokens by step {', '.join(f'{s}: {n}' for s, n in report['changes'])}; planned at "
            f"{report['base']:,} tokens a batch, a step is a list of max_tokens/{report['base']} of them "
            "(micro-batches, each padded on its own)\n"
        )
    else:
        out(
            f"schedule      batch size by step {', '.join(f'{s}: {n}' for s, n in report['changes'])}; planned at "
            f"{report['base']} a batch, a step takes size/{report['base']} of them\n"
        )
    out(
        f"              this epoch: steps {report['epoch_first_step']:,}..{report['next_epoch_first_step'] - 1:,} "
        f"({report['steps']:,} steps; every epoch before it whole)\n"
    )
    for ph in report["phases"]:
        out(
            f"              steps {ph['from_step']:,}..{ph['to_step']:,}: "
            f"{'max_tokens' if report.get('unit') == 'max_tokens' else 'size'} {ph['size']}"
            f"{' x ' + format(ph['seq_len'], ',') + ' tokens' if 'seq_len' in ph else ''} x {ph['steps']:,} "
            f"steps, {ph['tokens']:,} tokens\n"
        )


FLOOR_HINT = 0.01  # a floor from which `print_balance` says how to prepare the corpus


def print_balance(report: dict, out, layout: dict | None = None) -> None:
    """The compute balance of a plan's steps (``compute_balance`` of a report), with and without;
    ``layout``, the report's, says which data groups' floor the hint speaks of."""
    for name in ("unbalanced", "balanced"):
        bal = report[name]
        if bal is None:
            out(f"compute       {name}: no steps to compare\n")
            continue
        out(
            f"compute       {name + ':':<12} per-step max/mean cost over {bal['dp_ranks']:,} DP ranks: median "
            f"{bal['max_over_mean_median']:.3f}, p90 {bal['max_over_mean_p90']:.3f}, max "
            f"{bal['max_over_mean_max']:.3f}; {bal['time_lost']:.2%} of step time lost waiting for the slowest\n"
        )
    bal = report["balanced"]
    if bal is not None and "time_lost_floor" in bal:
        # What no step order can win back: the ranks' shares differ in total cost.
        one_group = layout is not None and layout.get("data_groups", 1) == 1
        joined = (layout or {}).get("nodes_per_group", 1)
        ranges = "each group's range" if joined > 1 else "each node's range"
        where = "" if one_group else f"; across data groups, in which documents {ranges} holds"
        out(
            f"compute       the least any order of these batches can lose: {bal['time_lost_floor']:.2%} (the DP "
            f"ranks' shares differ in total cost{where})\n"
        )
        if bal["time_lost_floor"] >= FLOOR_HINT and one_group:
            # One group deals its rows across all its ranks: the floor is its blocks' or its rows',
            # not the corpus's storage, which no node's range sets here.
            window = report.get("balance_window")
            out(
                f"compute       one data group deals its rows across its ranks; a --balance-window of {window} "
                "steps deals each block on its own, so the ranks' totals differ by what each block leaves: a "
                "larger window (default: the epoch) evens them\n"
                if window
                else "compute       one data group deals its rows across its ranks; what is left is that each "
                "rank's total is the sum of few costly rows (it falls as the ranks' shares grow)\n"
            )
        elif bal["time_lost_floor"] >= FLOOR_HINT:
            # Within a node the rows are dealt across its ranks, so a floor this high is the nodes':
            # their contiguous ranges hold long documents whole, which storage can spread.
            out(
                "compute       to lower it, cut documents longer than a few rows into shorter ones and store "
                "the corpus in a random order before packing (docs/sequence-packing.md: preparing a corpus "
                "for many nodes)\n"
            )
            if layout is not None and layout.get("data_groups", 1) > 1 and layout.get("nodes", 1) > 1:
                # One group's ranks share one range, so its steps balance across all of them.
                now = f"{layout['data_groups']:,} data groups now" + (
                    f", of {joined} nodes: a larger K" if joined > 1 else ""
                )
                out(
                    f"compute       or let nodes read one range together, --nodes-per-group K (ShardedLoader's "
                    f"nodes_per_group): each of them caches K nodes' share ({now})\n"
                )
