"""A reused buffer for a batch's narrowed copy of its tokens (the reader's and the packed reader's)."""

from __future__ import annotations

import numpy as np

__all__ = ["Scratch"]


class Scratch:
    """Memory reused batch after batch: a fresh array per batch would page-fault on every batch.
    Pickled empty, so a worker process makes its own rather than receiving the rank's."""

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None

    def array(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype`` over the buffer (grown as needed;
        valid until the next call)."""
        need = int(np.prod(shape)) * dtype.itemsize
        if self._buf is None or self._buf.size < need:
            self._buf = np.empty(max(need, 1 << 20), np.uint8)
        return np.ndarray(shape, dtype, buffer=self._buf)

    def __getstate__(self) -> dict:
        return {"_buf": None}
