"""Score blocks of (parent, child) graph pairs in-process or in a process pool, with a deadline.

The engine under `kiln.warmstart.index`: given prepared graphs (`graph.Prepared`, arrays only)
it fills a similarity grid [parents x children]. No caching, no de-duplication, no ids, no I/O.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import dataclasses
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from kiln.warmstart import graph, match

# As ModelKeeper's `query_scores` does with its process pool and batch timeout (Lai et al.,
# NSDI '23), never shipping networkx graphs:
#
# * Fewer pairs than `in_process_below` are scored in this process, checking the deadline before
#   every pair: starting workers and shipping graphs would cost more than the scoring.
# * Otherwise the grid is cut along its longer side into tasks (about 4 per worker, at most
#   `PAIRS_PER_TASK` pairs each, the shorter side travelling whole with every task) and sent to
#   a `ProcessPoolExecutor`: a persistent one for queries, a temporary one for cluster builds.
# * Graphs travel by key. Each pool starts with the index's whole catalogue (key -> prepared
#   graph, keys are graph fingerprints, so an entry is never stale), handed to its workers once
#   at start-up (inherited for free under fork); a task names catalogue graphs by key and carries
#   only the others (the query's child, models added since). Pickling prepared graphs per query
#   would cost more than scoring them: ~1.3 s for 800 graphs, each a few dozen small arrays.
#   When most of a grid's parents are missing from the pool's catalogue, the pool is restarted.
# * Past the deadline, pending tasks are cancelled and the workers terminated (running tasks
#   cannot be interrupted otherwise); the grid keeps what finished, `timed_out=True`. A worker
#   that dies fails only its tasks. A scorer that raises `ValueError`, `ArithmeticError`,
#   `IndexError` or `MemoryError` fails only its pair (NaN), its message kept in `Grid.errors`.

IN_PROCESS_BELOW = 64
"""Fewer pairs than this are scored in-process: pool hand-off would cost more than it saves."""
PAIRS_PER_TASK = 2000
"""Largest pool task, in pairs (a few seconds): bounds the work lost to a timeout."""

Scorer: TypeAlias = Callable[[graph.Prepared, graph.Prepared], float]
"""(parent, child) -> similarity in [0, 1]; must be picklable (module-level) for the pool."""
Keyed: TypeAlias = tuple[str, graph.Prepared]
"""A graph with its catalogue key (the index uses graph fingerprints)."""
Catalog: TypeAlias = Callable[[], Mapping[str, graph.Prepared]]
"""Returns every graph a pool's workers should hold from start-up, by key."""

_SCORING_ERRORS = (ValueError, ArithmeticError, IndexError, MemoryError)
_WORKER_CATALOG: dict[str, graph.Prepared] = {}  # in pool workers: the graphs preloaded at start


@dataclasses.dataclass
class Grid:
    """Similarities of parents x children.

    Attributes:
        values: float64[P, C], similarity(parent i -> child j); NaN if not scored or failed.
        done: bool[P, C], pairs that were tried (NaN and done: the scorer raised).
        timed_out: the deadline passed before every pair was tried.
        errors: messages of failed pairs (and of dead workers).
    """

    values: npt.NDArray[np.float64]
    done: npt.NDArray[np.bool_]
    timed_out: bool = False
    errors: list[str] = dataclasses.field(default_factory=list)


class PairScorer:
    """Scores grids of graph pairs; owns the persistent worker pool. Thread-safe."""

    def __init__(self, *, scorer: Scorer = match.similarity, workers: int | None = None,
                 in_process_below: int = IN_PROCESS_BELOW, start_method: str | None = None,
                 catalog: Catalog = dict, clock: Callable[[], float] = time.monotonic) -> None:
        """Set up (no process starts before the first pooled grid).

        Args:
            scorer: similarity(parent, child).
            workers: pool processes; None: min(4, CPUs); 0: never use a pool.
            in_process_below: grids with fewer pairs are scored in-process.
            start_method: multiprocessing start method (None: platform default; "forkserver"
                is safer in a threaded process, at ~1 s of worker start-up plus one pickled
                copy of the catalogue per worker).
            catalog: the graphs to preload into each new pool's workers.
            clock: monotonic seconds; deadlines are on this clock.
        """
        self.scorer = scorer
        self.workers = min(4, os.cpu_count() or 1) if workers is None else max(0, workers)
        self.in_process_below = in_process_below
        self.start_method = start_method
        self.catalog = catalog
        self.clock = clock
        self._pool: _Pool | None = None
        self._lock = threading.Lock()

    def grid(self, parents: Sequence[Keyed], children: Sequence[Keyed], *,
             deadline: float | None = None, persistent: bool = True) -> Grid:
        """Score every (parent, child) pair until the deadline (see the comment at the top).

        Args:
            parents: (key, graph) in the parent position, P of them.
            children: (key, graph) in the child position, C of them.
            deadline: `clock()` time to give up at; None: no deadline.
            persistent: use (and keep) the shared pool; False: a temporary pool, so that a
                long job (cluster build) is never terminated by a query's timeout.

        Returns:
            The `Grid`.
        """
        shape = (len(parents), len(children))
        grid = Grid(np.full(shape, np.nan), np.zeros(shape, dtype=bool))
        pairs = shape[0] * shape[1]
        if pairs == 0:
            return grid
        if self.workers == 0 or pairs < self.in_process_below:
            self._in_process(grid, [g for _, g in parents], [g for _, g in children], deadline)
        elif persistent:
            pool = self._persistent_pool(parents)
            if not self._in_pool(grid, pool, parents, children, deadline):
                with self._lock:
                    if self._pool is pool:
                        self._pool = None
                _terminate(pool.executor)
        else:
            pool = self._new_pool()
            try:
                self._in_pool(grid, pool, parents, children, deadline)
            finally:
                _terminate(pool.executor)
        return grid

    def close(self) -> None:
        """Stop the persistent pool, waiting for running tasks (a later grid starts another)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.executor.shutdown(wait=True, cancel_futures=True)

    def _persistent_pool(self, parents: Sequence[Keyed]) -> _Pool:
        """The shared pool; restarted first when it lacks most of these parents."""
        with self._lock:
            stale = self._pool
            if stale is not None:
                missing = sum(key not in stale.preloaded for key, _ in parents)
                if missing <= max(IN_PROCESS_BELOW, len(parents) // 4):
                    return stale
            self._pool = self._new_pool()
            pool = self._pool
        if stale is not None:
            stale.executor.shutdown(wait=True)
        return pool

    def _in_process(self, grid: Grid, parents: Sequence[graph.Prepared],
                    children: Sequence[graph.Prepared], deadline: float | None) -> None:
        for j, child in enumerate(children):
            for i, parent in enumerate(parents):
                if deadline is not None and self.clock() >= deadline:
                    grid.timed_out = True
                    return
                try:
                    grid.values[i, j] = self.scorer(parent, child)
                except _SCORING_ERRORS as exc:
                    grid.errors.append(f"{type(exc).__name__}: {exc}")
                grid.done[i, j] = True

    def _in_pool(self, grid: Grid, pool: _Pool, parents: Sequence[Keyed],
                 children: Sequence[Keyed], deadline: float | None) -> bool:
        """Fill `grid` from pool tasks; False when the pool must go (timed out, or died)."""
        parent_refs = [(key, None if key in pool.preloaded else g) for key, g in parents]
        child_refs = [(key, None if key in pool.preloaded else g) for key, g in children]
        futures = {pool.executor.submit(_score_block, self.scorer, parent_refs[rows],
                                        child_refs[cols]): (rows, cols)
                   for rows, cols in tasks(len(parents), len(children), self.workers)}
        healthy = True
        remaining = None if deadline is None else max(0.0, deadline - self.clock())
        try:
            for future in concurrent.futures.as_completed(futures, timeout=remaining):
                rows, cols = futures[future]
                try:
                    values, errors = future.result()
                except concurrent.futures.process.BrokenProcessPool as exc:
                    values = np.full(grid.values[rows, cols].shape, np.nan)
                    errors = [f"a worker process died ({exc})"]
                    healthy = False
                grid.values[rows, cols] = values
                grid.done[rows, cols] = True
                grid.errors.extend(errors)
        except TimeoutError:
            grid.timed_out = True
            healthy = False
            for future in futures:
                future.cancel()
        return healthy

    def _new_pool(self) -> _Pool:
        catalog = dict(self.catalog())
        context = multiprocessing.get_context(self.start_method) if self.start_method else None
        executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=max(1, self.workers), mp_context=context,
            initializer=_load_catalog, initargs=(catalog,))
        return _Pool(executor, frozenset(catalog))


@dataclasses.dataclass(frozen=True)
class _Pool:
    executor: concurrent.futures.ProcessPoolExecutor
    preloaded: frozenset[str]


def tasks(n_parents: int, n_children: int, workers: int) -> list[tuple[slice, slice]]:
    """Cut a P x C grid along its longer side into >= 4 tasks per worker of <= PAIRS_PER_TASK.

    Returns:
        (parent slice, child slice) per task, covering the grid exactly once.
    """
    count = max(4 * max(1, workers), math.ceil(n_parents * n_children / PAIRS_PER_TASK))
    split_parents = n_parents > n_children  # the other side travels whole with every task
    length = n_parents if split_parents else n_children
    other = n_children if split_parents else n_parents
    step = max(1, min(math.ceil(length / count), PAIRS_PER_TASK // max(1, other)))
    cuts = [slice(a, min(a + step, length)) for a in range(0, length, step)]
    whole = slice(0, other)
    return [(cut, whole) if split_parents else (whole, cut) for cut in cuts]


def _load_catalog(catalog: Mapping[str, graph.Prepared]) -> None:
    """Pool worker initializer: keep the preloaded graphs for the worker's lifetime."""
    _WORKER_CATALOG.clear()
    _WORKER_CATALOG.update(catalog)


def _score_block(scorer: Scorer, parents: Sequence[tuple[str, graph.Prepared | None]],
                 children: Sequence[tuple[str, graph.Prepared | None]]
                 ) -> tuple[npt.NDArray[np.float64], list[str]]:
    """Pool task: similarities [len(parents), len(children)] (NaN where scoring raised).

    A graph given as None is taken from the preloaded catalogue. Child-major order: a child's
    self-score (cached on it) is computed once per task.
    """
    parent_graphs = [g if g is not None else _WORKER_CATALOG[k] for k, g in parents]
    values = np.full((len(parents), len(children)), np.nan)
    errors = []
    for j, (key, g) in enumerate(children):
        child = g if g is not None else _WORKER_CATALOG[key]
        for i, parent in enumerate(parent_graphs):
            try:
                values[i, j] = scorer(parent, child)
            except _SCORING_ERRORS as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    return values, errors


def _terminate(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stop a pool now, running tasks included. ProcessPoolExecutor has no public way before
    Python 3.14 (`terminate_workers`); ModelKeeper terminates `_processes` the same way."""
    processes: list[Any] = list((pool._processes or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5.0)
