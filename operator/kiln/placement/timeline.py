"""One node's GPUs in use over time, as a step function, with earliest-fit search.

Reservations may exceed the capacity (they are facts); `earliest` walks the breakpoints for the
first start with k GPUs free for d seconds. The list scheduler keeps one per node.
"""

from __future__ import annotations

import bisect
import math


class Timeline:
    """GPUs in use on one node as a step function; finds the earliest window that fits.

    `times[i]` starts segment i (the first is -inf), `usage[i]` GPUs are held over
    [times[i], times[i + 1]); the last segment runs to +inf.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.times: list[float] = [-math.inf]
        self.usage: list[int] = [0]

    def _split(self, at: float) -> int:
        i = bisect.bisect_right(self.times, at) - 1
        if self.times[i] != at:
            self.times.insert(i + 1, at)
            self.usage.insert(i + 1, self.usage[i])
            i += 1
        return i

    def add(self, start: float, end: float, gpus: int) -> None:
        """Hold `gpus` over [start, end) (may exceed capacity: reservations are facts)."""
        if end <= start:
            return
        first, last = self._split(start), self._split(end)
        for i in range(first, last):
            self.usage[i] += gpus

    def earliest(self, gpus: int, seconds: float, release: float) -> float:
        """Earliest t >= release with `gpus` free over [t, t + seconds)."""
        limit = self.capacity - gpus
        times, usage, n = self.times, self.usage, len(self.times)
        i = bisect.bisect_right(times, release) - 1
        start = release
        while True:
            end = times[i + 1] if i + 1 < n else math.inf
            if usage[i] > limit:
                start = end
            elif end >= start + seconds:
                return start
            i += 1
            if i >= n:
                return start  # beyond the last breakpoint nothing is held

    def peak(self) -> int:
        """Most GPUs held at any time."""
        return max(self.usage)
