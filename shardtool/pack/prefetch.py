"""Read ahead in a thread, so decoding the next batch overlaps packing this one.

Parquet/Arrow decoding releases the GIL, so on a 2-core machine one packing process keeps both
cores busy. Items and errors arrive in order; the consumer stopping early stops the thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterable
from typing import TypeVar

T = TypeVar("T")
_END = object()


def prefetch(items: Iterable[T], depth: int = 2) -> Generator[T, None, None]:
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def run() -> None:
        try:
            for x in items:
                if not put((x, None)):
                    return
        except BaseException as e:  # handed to the consumer, raised there in order
            put((_END, e))
            return
        put((_END, None))

    t = threading.Thread(target=run, name="shardtool-prefetch", daemon=True)
    t.start()
    try:
        while True:
            x, err = q.get()
            if x is _END:
                if err is not None:
                    raise err
                return
            yield x
    finally:
        stop.set()
        t.join()
