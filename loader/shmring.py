"""Reusable shared-memory slots, and how a batch is written into one and copied out of it.

A `Slot` is an anonymous shared file (``memfd_create``: no name, so nothing can ever be left
behind in /dev/shm, whoever dies) created by the trainer before the workers fork, so both
sides hold its descriptor from the start and no descriptor is ever passed per batch. The
worker allocates a batch's arrays inside the slot (a bump allocator; it grows the file when a
batch does not fit), then `encode` replaces every array that lives in the slot by a small
`InSlot` record. Only that record structure (keys, shapes, offsets, small values) is pickled.
The trainer's `decode` copies each array out into a fresh tensor (optionally pinned), so the
slot can go back to the worker at once while the user keeps the batch as long as they like.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import tempfile
from typing import Any

import numpy as np
import torch

from .collate import PackedBytes

ALIGN = 64
INITIAL_SLOT_BYTES = 1 << 20
# Arrays/tensors/bytes smaller than this are pickled with the metadata rather than copied into the slot.
MIN_SLOT_BYTES = 4096


def anonymous_fd(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("shardtool-loader-slot", os.MFD_CLOEXEC)
    else:  # no memfd (not Linux): an unlinked temporary file serves the same purpose
        with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd


class InSlot:
    """Where one value of a batch lies in the slot: kind 'tensor', 'ndarray', 'bytes' or 'packed'."""

    __slots__ = ("kind", "offset", "shape", "dtype", "offsets")

    def __init__(self, kind: str, offset: int, shape: tuple, dtype: str, offsets: np.ndarray | None = None):
        self.kind, self.offset, self.shape, self.dtype, self.offsets = kind, offset, shape, dtype, offsets

    def __reduce__(self):
        return InSlot, (self.kind, self.offset, self.shape, self.dtype, self.offsets)


class Slot:
    """One growable shared buffer, mapped lazily by each process that uses it."""

    def __init__(self, size: int = INITIAL_SLOT_BYTES):
        self.fd = anonymous_fd(size)
        self._mm: mmap.mmap | None = None
        self._mapped = 0
        self._pid: int | None = None
        self.used = 0
        self._allocs: dict[int, int] = {}  # address -> offset of every array allocated this batch
        self._spans: list[tuple[int, int, int]] = []  # (address, end address, offset) of the same

    def _map(self, need: int = 0) -> mmap.mmap:
        if self._pid != os.getpid():  # a forked child must not use the parent's mapping object
            self._mm, self._mapped, self._pid = None, 0, os.getpid()
        if self._mm is None or self._mapped < need:
            size = os.fstat(self.fd).st_size
            self._release()
            # Views into an older mapping stay valid: both map the same shared pages.
            self._mm = mmap.mmap(self.fd, size)
            self._mapped = size
        return self._mm

    def _release(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # an array still views it; it is unmapped when that array goes

    # ------------------------------------------------------------------ writer (worker) side
    def reset(self) -> None:
        self.used = 0
        self._allocs.clear()
        self._spans.clear()

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised array inside the slot (the allocator the reader writes a batch with)."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        off = -(-self.used // ALIGN) * ALIGN
        end = off + nbytes
        if end > os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, max(end, 2 * self._mapped, INITIAL_SLOT_BYTES))
        arr = _view(self._map(end), off, shape, dtype)
        self.used = end
        if nbytes:
            self._allocs[arr.ctypes.data] = off
            self._spans.append((arr.ctypes.data, arr.ctypes.data + nbytes, off))
        return arr

    def offset_of(self, address: int, nbytes: int = 0) -> int | None:
        """Where the ``nbytes`` at ``address`` lie in the slot: an allocation's start, or inside one
        (a view: a packed batch's labels are the second plane of its [3, B, S] block), else None."""
        off = self._allocs.get(address)
        if off is not None or not nbytes:
            return off
        for lo, hi, at in self._spans:  # a handful of allocations per batch
            if lo <= address and address + nbytes <= hi:
                return at + (address - lo)
        return None

    # ------------------------------------------------------------------ reader (trainer) side
    def array(self, offset: int, shape: tuple, dtype: str) -> np.ndarray:
        dt = np.dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        return _view(self._map(offset + nbytes), offset, shape, dt)

    def close(self) -> None:
        self._release()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _view(mm: mmap.mmap, offset: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    # frombuffer, not ndarray(buffer=): it holds a buffer export on the mapping, so `_release`
    # cannot unmap it while an array of this batch still views it (ndarray(buffer=) holds none,
    # and a slot that grew mid-batch left the batch's first arrays pointing at unmapped pages).
    return np.frombuffer(mm, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)


# ---------------------------------------------------------------------- batch <-> slot
def encode(obj: Any, slot: Slot) -> Any:
    """``obj`` with every large array, tensor and bytes value moved into (or found in) the slot."""
    t = type(obj)
    if t is dict:
        return {k: encode(v, slot) for k, v in obj.items()}
    if t is list:
        if obj and type(obj[0]) is str and set(map(type, obj)) == {str}:
            return obj  # keys: nothing in it can move; set(map(type)) runs at C speed
        return [encode(v, slot) for v in obj]
    if t is tuple:
        return tuple(encode(v, slot) for v in obj)
    if isinstance(obj, torch.Tensor):
        return _encode_tensor(obj, slot)
    if t is np.ndarray and obj.dtype.kind in "biufc":
        return _encode_array(obj, slot, "ndarray")
    if t is PackedBytes:
        data = _encode_tensor(obj.data, slot, always=True)
        if isinstance(data, InSlot):
            return InSlot("packed", data.offset, data.shape, data.dtype, np.asarray(obj.offsets))
        return obj
    if t is bytes and len(obj) >= MIN_SLOT_BYTES:
        dst = slot.empty(len(obj), np.uint8)
        dst[:] = np.frombuffer(obj, dtype=np.uint8)
        off = slot.offset_of(dst.ctypes.data)
        if off is None:
            raise RuntimeError("shardtool internal error: an allocation of `empty` with bytes: recorded")
        return InSlot("bytes", off, (len(obj),), "u1")
    return obj


def _encode_tensor(t: torch.Tensor, slot: Slot, always: bool = False) -> Any:
    if t.device.type != "cpu" or t.layout != torch.strided or t.requires_grad:
        return t
    try:
        arr = t.numpy()
    except (TypeError, RuntimeError):
        return t  # a dtype numpy lacks (bfloat16, ...): pickled as it is
    out = _encode_array(arr, slot, "tensor", always)
    return t if out is arr else out


def _encode_array(arr: np.ndarray, slot: Slot, kind: str, always: bool = False) -> Any:
    if arr.flags.c_contiguous:
        off = slot.offset_of(arr.ctypes.data, arr.nbytes) if arr.nbytes else None
        if off is not None:  # born in the slot (or a contiguous view of what was): nothing to copy
            return InSlot(kind, off, arr.shape, arr.dtype.str)
    if arr.nbytes < MIN_SLOT_BYTES and not always:
        return arr
    dst = slot.empty(arr.shape, arr.dtype)
    dst[...] = arr
    off = slot.offset_of(dst.ctypes.data) if dst.nbytes else 0
    if off is None:
        raise RuntimeError("shardtool internal error: an allocation of `empty` with bytes: recorded")
    return InSlot(kind, off, arr.shape, arr.dtype.str)


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def decode(obj: Any, slot: Slot, pin: bool = False) -> Any:
    """The batch ``encode`` described, every slot value copied out (slot reusable afterwards)."""
    t = type(obj)
    if t is dict:
        return {k: decode(v, slot, pin) for k, v in obj.items()}
    if t is list:
        if obj and type(obj[0]) is str and set(map(type, obj)) == {str}:
            return obj
        return [decode(v, slot, pin) for v in obj]
    if t is tuple:
        return tuple(decode(v, slot, pin) for v in obj)
    if t is InSlot:
        src = slot.array(obj.offset, obj.shape, obj.dtype)
        if obj.kind == "tensor":
            out = torch.empty(src.shape, dtype=_torch_dtype(src.dtype), pin_memory=pin)
            out.numpy()[...] = src
            return out
        if obj.kind == "ndarray":
            return src.copy()
        # bytes(memoryview) copies at memcpy speed; ndarray.tobytes is several times slower here.
        mv = src.data  # memoryview(src): numpy's stubs give ndarray __buffer__ only from Python 3.12
        if obj.kind == "bytes":
            return bytes(mv)
        o = obj.offsets.tolist()
        return [bytes(mv[a:b]) for a, b in zip(o[:-1], o[1:])]
    if pin and isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
        return obj.pin_memory()
    return obj
