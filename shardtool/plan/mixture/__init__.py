"""The mixture: several datasets read by token weights, each source with its own cursor.

Files, each importing only those above it in this list (and the plan's own modules):

- `config`   — a mixture's sources, token weights and schedule (`Mixture`, `MixtureSource`)
- `compose`  — which source every unit of a mixture comes from: a closed form of the step
- `state`    — a mixture's resumable position (step and phase: `MixtureState`)
- `planner`  — one DP rank's units of a mixture, every source its own cursor (`MixturePlanner`)
- `span`     — what a span of steps takes from each source; ``max_repeat``
- `cost`     — what each step costs a rank under a cost model (balanced source by source)

This package re-exports the configuration (what ``ShardedLoader(Mixture(...), steps=...)``
takes); the planner and state are imported from their modules.
"""

from __future__ import annotations

from .config import (
    DEFAULT_MAX_REPEAT,
    Mixture,
    MixtureError,
    MixtureSource,
    as_weight,
    is_mixture_file,
    source_batching,
    source_seed,
)

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
