"""A rank's part of in-job staging (`shardtool.cache.stager`): publish its touch order and its
progress on the node's board; on local rank 0 with ``stage=True``, run the node's stager.

The stager is a process forked from local rank 0 when its loader is made, before any DataLoader
worker, as those workers are: it inherits the storage configuration (registered filesystems,
credentials in the environment) and imports nothing new. It exits by itself when the node's
shards are in, when every rank closed its loader, or when rank 0's process is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Mapping
from typing import Any

from ..cache.stager import Board, board_dir, follow, stage_run
from ..format.sizes import parse_size
from ..plan.stageorder import touch_order

log = logging.getLogger(__name__)

MODES = {"1": True, "true": True, "0": False, "false": False, "": False, "external": "external"}


def stage_mode(stage: Any, env: Mapping[str, str]) -> bool | str:
    """``stage=`` as given, else SHARDTOOL_STAGE ("1", "0", "external"), else off."""
    if stage is None:
        raw = env.get("SHARDTOOL_STAGE", "").strip().lower()
        if raw not in MODES:
            raise ValueError(f"SHARDTOOL_STAGE must be one of 1, 0, external; found {raw!r}")
        stage = MODES[raw]
    if stage not in (True, False, "external"):
        raise ValueError(
            f"stage must be True (local rank 0 stages the node's shards), 'external' (a `shardtool "
            f"warm --follow` step does) or False, found {stage!r}"
        )
    return stage


def stager_options(env: Mapping[str, str]) -> dict:
    """Local rank 0's stager settings: SHARDTOOL_STAGE_AHEAD (shards ahead of the slowest rank,
    default 16), SHARDTOOL_STAGE_AHEAD_BYTES, SHARDTOOL_STAGE_JOBS (concurrent fetches, default 4),
    SHARDTOOL_STAGE_BANDWIDTH (bytes per second, e.g. 500M); the same as `shardtool warm --follow`'s
    --ahead, --ahead-bytes, -j and --bandwidth."""

    def number(key: str, default: int | None, parse) -> int | None:
        raw = env.get(key, "").strip()
        if not raw:
            return default
        try:
            value = parse(raw)
        except ValueError as e:
            raise ValueError(f"{key}={raw!r}: {e}") from None
        if value is None or value < 1:
            raise ValueError(f"{key} must be >= 1, found {raw!r}")
        return value

    def sized(raw):
        return parse_size(raw, what="size")

    return {
        "ahead_shards": number("SHARDTOOL_STAGE_AHEAD", 16, int),
        "ahead_bytes": number("SHARDTOOL_STAGE_AHEAD_BYTES", None, sized),
        "jobs": number("SHARDTOOL_STAGE_JOBS", 4, int),
        "bandwidth": number("SHARDTOOL_STAGE_BANDWIDTH", None, sized),
    }


def _run_stager(url: str, cache_dir: str, storage_options: dict | None, parent: int, kw: dict) -> None:
    from ..cache import open_cache

    cache = open_cache(url, cache_dir, storage_options=storage_options)
    report = follow(cache, parent=parent, **kw)
    log.info("local rank 0's stager: %s", report.summary())
    if report.error:
        log.warning("local rank 0's stager stopped: %s (the readers fetch what is missing)", report.error)


class Staging:
    """Created by a loader with a cache and ``stage`` on; every rank publishes, local rank 0 may stage."""

    def __init__(self, mode: bool | str, cache, placement, *, env: Mapping[str, str]):
        rpn = placement.layout.ranks_per_node
        run = stage_run(env)
        self.board = Board(board_dir(cache.cache_dir, run, cache.version), placement.rank % rpn)
        self.shard_offsets = cache.manifest.shard_offsets()
        self.process = None
        if mode is True and placement.rank % rpn == 0:
            kw = dict(run=run, ranks=rpn, **stager_options(env))
            self.process = multiprocessing.get_context("fork").Process(
                target=_run_stager,
                args=(cache.url, cache.cache_dir, cache.storage_options, os.getpid(), kw),
                name="shardtool-stager",
                daemon=True,
            )
            self.process.start()

    def begin_pass(self, epoch: int, plan, start: int) -> None:
        self.board.publish_order(epoch, touch_order(plan.ids, plan.offsets, self.shard_offsets, start), start)

    def served(self, epoch: int, n: int) -> None:
        self.board.progress(epoch, n)

    def close(self) -> None:
        self.board.close()
        # The stager stays while other ranks still read; it exits when they close or this process ends.


def staging_for(source, placement, stage: bool | str | None, cache_dir: str | None) -> Staging | None:
    """The staging of a `ShardedLoader` reading ``source`` (`loader.source.Source`; None for a
    Mixture's loader, which is not staged) on ``placement`` (None: off), from ``stage=`` or
    SHARDTOOL_STAGE."""
    one_dataset = source is not None
    if not one_dataset and stage is None:
        return None  # SHARDTOOL_STAGE set for a job does not apply to a Mixture's loader
    mode = stage_mode(stage, os.environ)
    if not mode:
        return None
    if not cache_dir or not one_dataset:
        raise ValueError("stage= stages one dataset into a node cache: give cache_dir= (a Mixture is not staged)")
    cache = source.cache
    if cache.read_only:  # root's prolog cache: what it lacks goes to the user's own cache, on a miss
        log.warning("stage=%r: the node cache %s is not writable by this user; not staging", mode, cache.cache_dir)
        return None
    return Staging(mode, cache, placement, env=os.environ)
