"""A tqdm bar on stderr (samples/s and MB/s), silent when stderr is not a terminal or quiet."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, *, total: int | None, quiet: bool, desc: str = "pack"):
        self.samples = 0
        self.bytes = 0
        self.t0 = time.perf_counter()
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=" samples", file=sys.stderr, smoothing=0.1, dynamic_ncols=True)

    def update(self, samples: int, nbytes: int) -> None:
        self.samples += samples
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(samples)
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.bytes / dt / 1e6:.1f} MB/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0
