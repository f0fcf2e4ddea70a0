"""What a process holds that a closed loader must give back: child processes (workers), entries
in /dev/shm, open file descriptors (memory files of decompressed shards among them)."""

from __future__ import annotations

import os
import time


def children() -> set[int]:
    me, out = os.getpid(), set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.add(int(pid))
            except (OSError, IndexError, ValueError):
                pass
    return out


def resources() -> tuple:
    shm = sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []
    return shm, len(os.listdir("/proc/self/fd")), children()


def settled(before: tuple, seconds: float = 10.0) -> tuple:
    """The resources of ``before`` once what the test made is gone. /dev/shm is the machine's:
    entries other processes removed meanwhile are not ours to count, only new ones left."""
    deadline = time.monotonic() + seconds
    while True:
        now = resources()
        if not set(now[0]) - set(before[0]) and now[1:] == before[1:]:
            return before
        if time.monotonic() >= deadline:
            return now
        time.sleep(0.1)
