"""Values of the zoo index's API: its settings and defaults, query results, refresh reports.

Role: the data `kiln.warmstart.index.ZooIndex` takes and returns, apart from the mechanism, so the
index module holds only the index. Every name here is re-exported by `index` (callers write
`index.IndexSettings`, `index.QueryResult`, ...).

Callers: `kiln.warmstart.index`. Non-goals: no behaviour beyond `QueryResult.best`, no I/O.
"""

from __future__ import annotations

import dataclasses
import enum

from kiln.warmstart import scoring
from kiln.zoo import records

EXHAUSTIVE_LIMIT = 1000
"""Score every compatible candidate up to this many (ModelKeeper's mode_threshold)."""
EARLY_EXIT_SIMILARITY = 0.95
"""Clustered search stops once a parent is at least this similar (ModelKeeper's threshold)."""
CLUSTERED_PAIR_BUDGET = 1000
"""Clustered search visits no further cluster once this many pairs were scored."""
CACHE_ENTRIES = 100_000
"""Most (parent id, child fingerprint) scores kept (LRU; about 150 bytes each)."""


class SearchMode(enum.StrEnum):
    """How a query searched the zoo."""

    EXHAUSTIVE = "exhaustive"
    CLUSTERED = "clustered"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A scored zoo model: its id, similarity(parent=it, child=query) in [0, 1], record."""

    id: records.ZooModelId
    similarity: float
    record: records.ZooRecord


@dataclasses.dataclass(frozen=True, kw_only=True)
class QueryResult:
    """The answer to `ZooIndex.query` and how it was found.

    Attributes:
        candidates: best first (ties by id), at most top_k.
        mode: exhaustive or clustered.
        compatible: models passing the modality/task filter.
        scored: candidates with a similarity (cache hits included).
        cache_hits: of those, how many came from the cache.
        computed: pairs actually scored (after de-duplicating identical parent graphs).
        clusters_visited: clusters whose members were scored (0 when exhaustive).
        failed: ids whose scoring raised (logged); they are not candidates.
        wall_seconds: time the query took.
        timed_out: the deadline passed; `candidates` covers only what was scored by then.
    """

    candidates: tuple[Candidate, ...]
    mode: SearchMode
    compatible: int
    scored: int
    cache_hits: int
    computed: int
    clusters_visited: int
    failed: tuple[records.ZooModelId, ...]
    wall_seconds: float
    timed_out: bool

    @property
    def best(self) -> Candidate | None:
        """The most similar candidate, or None when nothing was scored."""
        return self.candidates[0] if self.candidates else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexSettings:
    """Knobs of a `ZooIndex` (module docstring).

    Attributes:
        exhaustive_limit: score all compatible candidates up to this many.
        workers: pool processes; None: min(4, CPUs); 0: never use a pool.
        in_process_below: fewer pairs than this are scored in-process.
        early_exit_similarity: clustered search stops at this similarity.
        clustered_pair_budget: clustered search visits no further cluster after this many
            scored pairs (the first cluster is always visited); None: no budget.
        cache_entries: LRU capacity of the score cache.
        start_method: multiprocessing start method of the pool (None: the platform default;
            "forkserver" is safer in a threaded process, at ~1 s of worker start-up).
    """

    exhaustive_limit: int = EXHAUSTIVE_LIMIT
    workers: int | None = None
    in_process_below: int = scoring.IN_PROCESS_BELOW
    early_exit_similarity: float = EARLY_EXIT_SIMILARITY
    clustered_pair_budget: int | None = CLUSTERED_PAIR_BUDGET
    cache_entries: int = CACHE_ENTRIES
    start_method: str | None = None


@dataclasses.dataclass(frozen=True)
class RefreshReport:
    """What `ZooIndex.refresh` changed: ids added (new or replaced), removed, skipped."""

    added: tuple[records.ZooModelId, ...]
    removed: tuple[records.ZooModelId, ...]
    skipped: tuple[records.ZooModelId, ...]
