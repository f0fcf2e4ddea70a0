"""What a rank's plan of an epoch is, said in the log: its batches and remainder, and the notes
a user should act on (an elastic re-deal's leftover batches, rows at the packing piece cap)."""

from __future__ import annotations

import logging
from typing import Any

from ..plan import RankPlan
from ..plan.packing import Packing, piece_cap_note
from .batchsource import Reading

log = logging.getLogger(__name__)

__all__ = ["log_plan"]


def log_plan(p: RankPlan, epoch: int, reading: Reading, url: Any, packing: Packing | None, *, cap_noted: bool) -> bool:
    """Log the plan ``p`` of ``epoch`` on this rank (``reading``: its placement and DP rank).
    Returns whether the piece-cap note has been given: once a loader, since the same data caps
    every epoch alike."""
    left = (
        f"remainder {p.remainder.size} samples, {p.remainder_pieces} pieces, {p.remainder_tokens} tokens of its group"
        if p.remainder is not None
        else f"{p.leftover_batches} batches left over by the resume's re-deal"
    )
    where = reading.placement
    log.info(
        "epoch %d rank %d/%d (DP rank %d of %d): %d batches, padding efficiency %.3f, %s",
        epoch,
        where.rank,
        where.layout.world_size,
        reading.dp_rank,
        reading.data_layout.dp_size,
        p.batches_per_rank,
        p.padding_efficiency,
        left,
    )
    if p.leftover_batches and reading.dp_rank == 0:  # the same on every rank: said once
        log.warning(
            "%s: the elastic resume deals the rest of epoch %d in whole batches, in equal shares over "
            "%d DP ranks: %d batch(es) left over are not served this epoch, whatever drop_last says "
            "(`loader.remainder` lists their samples). exact=True serves every batch: a rank short "
            "of one serves a padding batch",
            url,
            epoch,
            reading.data_layout.dp_size,
            p.leftover_batches,
        )
    if p.rows is not None and packing is not None and not cap_noted:
        note = piece_cap_note(p.rows.at_piece_cap(packing), p.rows.num_rows, p.rows.tokens, packing)
        if note is not None:
            log.warning("%s: %s", url, note)
        return True
    return cap_noted
