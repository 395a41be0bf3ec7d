"""Scoring one query's child against zoo parents by record id, through an LRU score cache.

Role: the per-query half of `kiln.warmstart.index` (module docstring there). `score_ids` looks each
parent up in the `ScoreCache` (keyed by (parent id, child graph fingerprint)), groups the misses
by parent graph fingerprint so identical graphs are scored once, hands them to the
`scoring.PairScorer` with the query's deadline, and records scores, failures (NaN) and cache
entries in the query's `Search`.

Callers: `kiln.warmstart.index` only, holding its lock around every call. Non-goals: no candidate
filtering or ranking, no clusters, no process pool (`scoring`), no locking, no I/O.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping

from kiln.warmstart import dag, prepared, scoring

_log = logging.getLogger(__name__)


class ScoreCache:
    """similarity(parent record id -> child fingerprint), the least recently used dropped first.

    Args:
        capacity: most entries kept after `trim` (about 150 bytes each).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._scores: collections.OrderedDict[tuple[str, str], float] = (
            collections.OrderedDict())

    def __len__(self) -> int:
        return len(self._scores)

    def get(self, record_id: str, child_fingerprint: str) -> float | None:
        """The cached score, marked as recently used; None on a miss."""
        key = (record_id, child_fingerprint)
        cached = self._scores.get(key)
        if cached is not None:
            self._scores.move_to_end(key)
        return cached

    def put(self, record_id: str, child_fingerprint: str, value: float) -> None:
        """Cache a score (`trim` enforces the capacity)."""
        self._scores[(record_id, child_fingerprint)] = value

    def trim(self) -> None:
        """Drop the least recently used entries beyond `capacity`."""
        while len(self._scores) > self.capacity:
            self._scores.popitem(last=False)

    def forget(self, ids: set[str]) -> None:
        """Drop every score of these parents (deleted or replaced records)."""
        for key in [k for k in self._scores if k[0] in ids]:
            del self._scores[key]


@dataclasses.dataclass
class Search:
    """One query's progress."""

    child: dag.Prepared
    child_fingerprint: str
    deadline: float
    scores: dict[str, float] = dataclasses.field(default_factory=dict)
    failed: set[str] = dataclasses.field(default_factory=set)
    cache_hits: int = 0
    computed: int = 0
    timed_out: bool = False


def score_ids(search: Search, ids: Iterable[str], *, entries: Mapping[str, prepared.Entry],
              cache: ScoreCache, pairs: scoring.PairScorer) -> bool:
    """Score the child against these parents: cache first, each distinct graph once.

    Args:
        search: the query; its scores, failures and counters are updated.
        ids: parent record ids, keys of `entries`.
        entries: the index's entries by record id.
        cache: the index's score cache.
        pairs: the index's pair scorer.

    Returns:
        False once the query's deadline has passed.
    """
    misses: dict[str, list[str]] = {}
    for record_id in ids:
        if record_id in search.scores or record_id in search.failed:
            continue
        cached = cache.get(record_id, search.child_fingerprint)
        if cached is not None:
            search.scores[record_id] = cached
            search.cache_hits += 1
        else:
            misses.setdefault(entries[record_id].fingerprint, []).append(record_id)
    if not misses or search.timed_out:
        return not search.timed_out
    same_graph = list(misses.values())
    parents = [(key, entries[group[0]].prepared) for key, group in misses.items()]
    grid = pairs.grid(parents, [(search.child_fingerprint, search.child)],
                      deadline=search.deadline)
    search.timed_out |= grid.timed_out
    search.computed += int(grid.done.sum())
    for group, value, done in zip(same_graph, grid.values[:, 0], grid.done[:, 0]):
        if not done:
            continue
        if math.isnan(value):
            search.failed.update(group)
            continue
        for record_id in group:
            search.scores[record_id] = float(value)
            cache.put(record_id, search.child_fingerprint, float(value))
    cache.trim()
    for message in grid.errors[:3]:
        _log.warning("zoo index: a pair score failed: %s", message)
    return not search.timed_out
