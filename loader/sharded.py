"""`ShardedLoader`: the plan of this rank's batches, read by workers, resumable by position."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..plan import data_parallel
from ..plan.env import rank_placement
from ..plan.mesh import as_mesh
from .batchsource import BatchSource, Reading
from .cachelayout import warmed_layout_mismatch
from .epochs import DatasetEpochs
from .mixed import MixtureSteps
from .observability.observe import Observer
from .options import batch_options, mixture_batching, worker_options
from .passrun import PassRunner
from .reader import BatchReader
from .sourceviews import SourceViews

log = logging.getLogger(__name__)


class ShardedLoader(PassRunner, SourceViews):
    """Batches of a packed dataset for one rank of a (possibly multi-node) training job.

    Every rank yields ``len(loader)`` batches an epoch, known before the first batch and equal on
    every rank; ``state_dict()`` is the position after the batches handed out (small, JSON, equal
    on every rank) and ``load_state_dict`` continues exactly there, on any number of ranks. Every
    decision is a pure plan from the dataset's metadata, the seed and the layout
    (docs/plan.md). The default batch pads the length field (``LongTensor [B, L]`` and
    ``lengths``) and stacks the others as ``default_collate`` would; packed rows carry
    ``input_ids``, ``labels``, ``position_ids``, ``cu_seqlens``... (docs/sequence-packing.md).

    Args:
        url: The dataset (a path or any fsspec URL), or a `shardtool.plan.mixture.Mixture` of
            several read by token weights (give ``steps`` or ``tokens``; docs/mixtures.md). A
            mixture's ``batching`` (its file's ``batch_size``, ``seq_len``, ``max_tokens``) gives
            those not given here.
        batch_size: Samples per batch, or rows per batch with ``seq_len``; or a schedule by the
            run's step, ``{0: 4, 2000: 8}`` (planned at the sizes' gcd; docs/run-changes.md).
        max_tokens: Instead of ``batch_size``: batch size x longest length, padding counted. Or a
            ramp by step, ``{0: 16384, 2000: 65536}``: each step is then a list of micro-batches of
            the smallest budget, ``max_tokens(step) / smallest`` of them (docs/run-changes.md).
        shuffle: Shuffle each epoch (False: each data group's range in dataset order).
        seed: The shuffle's seed; the same seed gives the same batches.
        bucketing: Sort by length within shuffle windows to cut padding. Default: on with
            ``shuffle`` where the dataset's length counts what a batch pads, off for byte sizes.
        rank, world_size, ranks_per_node: The layout; default: torch.distributed, else torchrun's
            or SLURM's environment, else one process.
        dp_rank, dp_size, mesh, dp_dim: Who is data-parallel under TP/PP/CP: a torch DeviceMesh (or
            `shardtool.plan.Mesh`) and its DP dimension name(s), or the DP size and rank. Ranks of
            one DP rank get byte-identical batches.
        nodes_per_group: Nodes that read one range together (a data group): each caches all of it
            (that many times the disk), and a cost model balances steps across all their ranks,
            where single nodes' ranges differ by what they hold (docs/sequence-packing.md). Give
            `shardtool warm` and the prolog the same. Default 1: a node reads its own range.
        seq_len: Pack documents into rows of exactly this many tokens (sequence packing); or a
            warmup by step, ``{0: 2048, 50000: 8192}`` (shorter rows are cut from the longest's
            plan; docs/run-changes.md).
        packing: ``"best-fit"``, ``"concat"``, ``"no-split"`` or ``"stream"`` (docs/sequence-packing.md).
        eos_id: Appended to each packed document (not where the pack stored one).
        max_docs_per_row: The most pieces in a packed row (sizes ``cu_seqlens``).
        num_workers, prefetch_factor, pin_memory, timeout: Worker processes and their prefetch,
            as torch's DataLoader (``pin_memory=None``: where CUDA is available). Without a node
            cache, each process also fetches the record batches of the ``prefetch_factor`` batches
            it loads next from a remote dataset (docs/scale.md#no-local-disk).
        cache_dir: The node cache: shards read from local disk, fetched on a miss (docs/slurm.md).
            None on a remote dataset: read from the store, nothing written to disk.
        transform: Per sample, in the workers, before collation (not with ``seq_len``).
        collate_fn: Replaces the default collation of a batch's samples (not with ``seq_len``).
        pad_id: What pads the length field or packed rows.
        storage_options: For fsspec (credentials, an S3 endpoint).
        window: Samples sorted together by length (default: 256 batches' worth).
        metrics, metrics_every, metrics_dir, metrics_reduce: Counters, a JSON line every
            ``metrics_every`` steps under ``metrics_dir`` (``shardtool stats`` merges them), and an
            all-gather across ranks at those steps (docs/observability.md).
        stall_timeout: A batch not delivered within it raises `LoaderError` naming the shard,
            offset and tier being read, after dumping every process's stacks (None: no watchdog).
        steps, tokens: A mixture's length.
        drop_last: False serves every sample on any number of DP ranks (ranks short of batches
            split some); True may leave out a rotating surplus of at most 0.2% of the tokens.
        stage: In-job staging into ``cache_dir`` (True, ``"external"``; default SHARDTOOL_STAGE).
        packed_outputs: ``"full"``, or ``"lean"``: only what the GPU cannot derive
            (`shardtool.loader.packed.lean_to_full` adds labels and positions there).
        cost_model, balance_window, micro_batches: Steps of equal compute on every DP rank
            (a model shape, measured ``{"a", "b"}`` or a preset such as ``"llama-7b"``), balanced
            in blocks of ``balance_window`` steps, over ``micro_batches`` accumulated batches.
        shuffle_block: Shuffle blocks of this many neighbouring samples, the blocks in random
            order: a weaker shuffle that reads a shard or two at once.
        exact: Serve every sample exactly once on any number of ranks (evaluation); padding
            batches and rows are marked in ``batch["valid"]`` (`shardtool.loader.ValidSum`).
        token_fields: The per-token array fields packed rows carry (default: every array field).
        image_transform: Applied in the workers to each image of an image-text dataset's rows.

    Raises:
        ValueError: Options that contradict each other or the dataset, naming them.
        FormatError: A dataset that cannot be read, naming the file.
        LoaderError: A batch that cannot be read or is not delivered in time, naming the shard.

    ``len(loader)`` counts the epoch's batches from its first, also after a resume (as Lightning
    counts); ``batches_left`` is what the next pass yields. After the last batch of an epoch the
    loader is in the next one: resume with ``start_epoch = loader.epoch``. ``set_epoch`` to an
    epoch before a loaded state's is refused (it would replay it).
    """

    def __init__(
        self,
        url: Any,
        *,
        batch_size: int | Mapping[int, int] | None = None,
        max_tokens: int | Mapping[int, int] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        bucketing: bool | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        mesh: Any = None,
        dp_dim: str | tuple[str, ...] = "dp",
        nodes_per_group: int = 1,
        seq_len: int | Mapping[int, int] | None = None,
        packing: str = "best-fit",
        eos_id: int | None = None,
        max_docs_per_row: int | None = None,
        num_workers: int = 2,
        prefetch_factor: int = 2,
        pin_memory: bool | None = None,
        cache_dir: str | None = None,
        transform: Callable | None = None,
        collate_fn: Callable | None = None,
        pad_id: int = 0,
        storage_options: dict | None = None,
        timeout: float = 300.0,
        window: int | None = None,
        metrics: bool = True,
        metrics_every: int | None = 100,
        metrics_dir: str | None = None,
        metrics_reduce: bool = False,
        stall_timeout: float | None = 300.0,
        steps: int | None = None,
        tokens: int | None = None,
        drop_last: bool | None = None,
        stage: bool | str | None = None,
        packed_outputs: str = "full",
        cost_model: Any = None,
        balance_window: int | None = None,
        micro_batches: int | None = None,
        shuffle_block: int | None = None,
        exact: bool = False,
        token_fields: Sequence[str] | None = None,
        image_transform: Callable[[bytes], Any] | None = None,
    ):
        import torch

        work = worker_options(num_workers, prefetch_factor, pin_memory, timeout)
        batch_size, seq_len, max_tokens = mixture_batching(url, batch_size, seq_len, max_tokens)
        opts = batch_options(
            batch_size=batch_size,
            max_tokens=max_tokens,
            shuffle=shuffle,
            seed=seed,
            window=window,
            bucketing=bucketing,
            seq_len=seq_len,
            packing=packing,
            eos_id=eos_id,
            max_docs_per_row=max_docs_per_row,
            packed_outputs=packed_outputs,
            drop_last=drop_last,
            cost_model=cost_model,
            balance_window=balance_window,
            micro_batches=micro_batches,
            shuffle_block=shuffle_block,
            exact=exact,
            transform=transform,
            collate_fn=collate_fn,
            pad_id=pad_id,
            token_fields=token_fields,
        )
        if image_transform is not None and seq_len is None:
            raise ValueError("image_transform applies to the images of packed rows (seq_len); use transform otherwise")
        dist = torch.distributed if torch.distributed.is_available() else None
        self.placement = rank_placement(rank, world_size, ranks_per_node, env=os.environ, dist=dist)
        if self.placement.rank is None:
            raise RuntimeError("shardtool internal error: rank_placement always places a rank (0 of 1 by default)")
        self.rank, self.layout = self.placement.rank, self.placement.layout
        self.data_layout, self.dp_rank = data_parallel(
            self.placement,
            dp_rank=dp_rank,
            dp_size=dp_size,
            mesh=as_mesh(mesh),
            dp_dims=_dp_dims(dp_dim),
            nodes_per_group=nodes_per_group,
        )
        self.num_workers, self.prefetch_factor = work.num_workers, work.prefetch_factor
        self.pin_memory, self.timeout = work.pin_memory, work.timeout
        self.packed_outputs, self.pad_id = opts.packed_outputs, opts.pad_id
        self.transform, self.collate_fn, self.image_transform = opts.transform, opts.collate_fn, image_transform
        reading = Reading(
            opts, bucketing, image_transform, self.placement, self.data_layout, self.dp_rank, cache_dir, storage_options
        )
        # Which batches, chosen once: one dataset's epochs, or a mixture's steps (loader/batchsource.py).
        self.batch_source: BatchSource = open_source(url, reading, steps, tokens)
        for reader in self.batch_source.readers.values():
            cache = reader.source.cache
            said = None if cache is None else warmed_layout_mismatch(cache, self.placement, self.data_layout)
            if said is not None:
                log.warning("rank %d: %s", self.rank, said)
        self._staging = None
        try:
            self._obs = Observer(
                self.batch_source.readers,
                self.placement,
                num_workers=num_workers,
                prefetch_factor=prefetch_factor,
                metrics=metrics,
                metrics_every=metrics_every,
                metrics_dir=metrics_dir,
                metrics_reduce=metrics_reduce,
                cache_dir=cache_dir,
                stall_timeout=stall_timeout,
            )
            self._obs.micro = self.batching.micro_batches or 1
            from .rankstaging import staging_for  # lazy: imports the cache, as a loader with a cache_dir does

            self._staging = staging_for(self.batch_source.staged, self.placement, stage, cache_dir)
            # No "cache behind the plan" warning while staging: the stager keeps it a bounded distance ahead.
            self._obs.staged = self._staging is not None
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ what every source has
    @property
    def batching(self) -> Any:
        """The plan's `shardtool.plan.Batching`, as the dataset completed it (bucketing, EOS)."""
        return self.batch_source.batching

    @property
    def packing(self) -> Any:
        """Sequence packing (`shardtool.plan.packing.Packing`), or None."""
        return self.batching.packing

    @property
    def token_fields(self) -> tuple[str, ...]:
        """The per-token fields packed batches carry."""
        return self.batch_source.token_fields

    @property
    def readers(self) -> dict[str, BatchReader]:
        """The readers, by source name (one dataset: its URL)."""
        return self.batch_source.readers

    @property
    def length_field(self) -> str | None:
        """The field whose padded tensor the default batch carries (the dataset's length field;
        packed: ``input_ids``)."""
        return self.batch_source.length_field

    @property
    def mixture(self) -> Any:
        """The `shardtool.plan.mixture.Mixture` read, or None for one dataset."""
        return getattr(self.batch_source, "mixture", None)

    @property
    def planner(self) -> Any:
        """The pure planner: `shardtool.plan.Planner`, or a mixture's `MixturePlanner`."""
        return self.batch_source.planner

    def __len__(self) -> int:
        """This rank's batches in the current epoch, counted from its first batch, after a resume
        too (as torchdata's StatefulDataLoader counts): a trainer restores its own count of the
        batches done and ends the epoch when it reaches ``len()`` (Lightning does). After an
        elastic resume: the batches served on the earlier layout(s) plus this layout's share of
        the rest. `batches_left` is what the next pass yields. Once every batch of an epoch was
        handed over, the next epoch's (a trainer reads it there to size that epoch). A mixture:
        ``steps``, the whole run, also after a resume."""
        self._settle()
        return self.batch_source.length()

    @property
    def batches_left(self) -> int:
        """Batches the next pass yields: ``len(loader)`` from an epoch's start, less after a resume."""
        self._settle()
        return self.batch_source.left()

    @property
    def resuming(self) -> bool:
        """A state was loaded and no batch has been asked for since (adapters check who restored it)."""
        return self.batch_source.resuming

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch handed out: small, JSON-ready, equal on every rank, no I/O.
        A mixture's: the step and the current phase."""
        return self.batch_source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` (from `state_dict`, on any rank) was: on the same data
        layout from the next batch; on another one (DP size changed) with the epoch's unserved
        batches dealt over the new DP ranks. Refuses a state of another dataset or config.

        A mixture continues at the state's step; under other weights or schedule, with sources
        added or removed, or on another layout, in a new phase from that step in which every kept
        source continues from its cursor (nothing repeated, nothing skipped) and a new source
        starts at its beginning. It refuses a state past ``steps``."""
        self.batch_source.load_state_dict(state)

    def skip_steps(self, first: int, stop: int) -> None:
        """Never serve the batches of steps ``first .. stop - 1`` (steps as ``len(loader)`` counts
        them: of this epoch, or of a mixture's run): after ``load_state_dict`` from a checkpoint
        before a loss spike, before the first batch. The steps go on counting and the data moves
        past them: step ``first`` gets the batch of step ``stop``, and the epoch has ``stop -
        first`` fewer (a mixture's run still ends at ``steps``). The skip is recorded in
        `state_dict` (so a later resume, elastic or not, keeps it, and `shardtool trace` answers
        for the run as it went). Every rank must skip the same steps; a later skip may not start
        before an earlier one."""
        self._settle()
        self._before_first_batch("skip_steps")
        self.batch_source.skip_steps(first, stop)

    def close(self) -> None:
        self._close_pass()
        if hasattr(self, "_obs"):
            self._obs.close()
        if getattr(self, "_staging", None) is not None:
            self._staging.close()
        for reader in self.batch_source.readers.values():  # a mixture's every source
            reader.close()


def open_source(url: Any, reading: Reading, steps: int | None, tokens: int | None) -> BatchSource:
    """The source of ``url``, chosen once: a mixture's steps for a `Mixture`, else one dataset's epochs."""
    from ..plan.mixture import Mixture

    if isinstance(url, Mixture):
        return MixtureSteps(url, reading, steps=steps, tokens=tokens)
    return DatasetEpochs(url, reading, steps=steps, tokens=tokens)


def _dp_dims(dp_dim: str | tuple[str, ...]) -> tuple[str, ...]:
    return (dp_dim,) if isinstance(dp_dim, str) else tuple(dp_dim)
