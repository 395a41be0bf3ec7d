"""Zoo index for warm-start parent search: every model's graph prepared once, scored on demand.

`ZooIndex` loads every record's metadata and graph and answers "which zoo models are most
similar, as parents, to this child architecture?" within a deadline. No selection policy, no
weights, no writes to the store; calls block (the operator runs them in an executor).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import hashlib
import json
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self, TypeAlias

import networkx as nx
import numpy as np

from kiln.warmstart import clusters as cluster
from kiln.warmstart import graph, match, scoring
from kiln.zoo import records, store

# The values `ZooIndex` takes and returns: its settings and defaults, query results, refresh
# reports.
EXHAUSTIVE_LIMIT = 1000
"""Score every compatible candidate up to this many (ModelKeeper's mode_threshold)."""
EARLY_EXIT_SIMILARITY = 0.95
"""Clustered search stops once a parent is at least this similar (ModelKeeper's threshold)."""
CLUSTERED_PAIR_BUDGET = 1000
"""Clustered search visits no further cluster once this many pairs were scored."""
CACHE_ENTRIES = 100_000
"""Most (parent id, child fingerprint) scores kept (LRU; about 150 bytes each)."""
CLUSTER_RESTARTS = 20
"""k-medoids restarts of a cluster build (ModelKeeper: 10,000 "spawns")."""
CLUSTER_REBUILD_GROWTH = 2.0
"""A maintained group is clustered again from scratch once it has this many times the models
it had at its last build."""
CLUSTER_BUILD_SECONDS = 7200.0
"""Time budget of one background cluster build of a group (the benchmark built 10,000 models'
clusters in 17 minutes on 2 cores; a background build has half the workers)."""
BUILD_CHUNK_PAIRS = 20_000
"""Background builds score at most this many pairs per pool call, checking for `close` between
calls (seconds of work)."""


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
    """Knobs of a `ZooIndex` (see the comment above `ZooIndex`).

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
        maintain_clusters: build the clusters of every group above `exhaustive_limit` in the
            background and keep them current on `refresh` (long-lived indexes: the operator's).
            Off by default: a build costs about sqrt(N) exhaustive queries, so an index made
            for one query (`kiln run`, `kiln zoo query`) searches exhaustively.
        cluster_build_seconds: time budget of one background build of one group; past it the
            build is abandoned until the group has grown by `CLUSTER_REBUILD_GROWTH`.
    """

    exhaustive_limit: int = EXHAUSTIVE_LIMIT
    workers: int | None = None
    in_process_below: int = scoring.IN_PROCESS_BELOW
    early_exit_similarity: float = EARLY_EXIT_SIMILARITY
    clustered_pair_budget: int | None = CLUSTERED_PAIR_BUDGET
    cache_entries: int = CACHE_ENTRIES
    start_method: str | None = None
    maintain_clusters: bool = False
    cluster_build_seconds: float = CLUSTER_BUILD_SECONDS


@dataclasses.dataclass(frozen=True)
class RefreshReport:
    """What `ZooIndex.refresh` changed: ids added (new or replaced), removed, skipped."""

    added: tuple[records.ZooModelId, ...]
    removed: tuple[records.ZooModelId, ...]
    skipped: tuple[records.ZooModelId, ...]


Spawn: TypeAlias = Callable[[Callable[[], None]], None]
"""Runs a `ZooIndex`'s background cluster builder (by default in a daemon thread)."""


# Zoo records in matchable form. An `Entry` keeps a record's graph only as arrays
# (`graph.Prepared`, its parent-side segments built once; never networkx: 10,000 models take
# tens of MiB) with the `fingerprint` that keys scores and de-duplicates identical graphs.
GraphInput: TypeAlias = nx.DiGraph | Mapping[str, Any]
"""A graph from `graph.extract`/`graph.from_json`, or its JSON dict (`graph.to_json`)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One indexed record: its metadata, prepared graph and graph fingerprint."""

    record: records.ZooRecord
    prepared: graph.Prepared
    fingerprint: str

    @property
    def group(self) -> tuple[str, str]:
        """(modality, task): a query compares only records of one group."""
        return (self.record.modality, self.record.task)


def fingerprint(g: GraphInput) -> str:
    """Stable SHA-256 (hex) of a graph's JSON form, without its `name` (which never affects
    scoring): equal architectures share cache entries whatever the job called them.

    Args:
        g: a graph, or its JSON dict as written by `graph.to_json` (hashed as given).
    """
    doc = graph.to_json(g) if isinstance(g, nx.DiGraph) else dict(g)
    doc.pop("name", None)
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def make_entry(record: records.ZooRecord, graph_input: GraphInput) -> Entry:
    """Prepare a record's graph; the networkx graph is dropped, only arrays stay.

    Raises:
        graph.GraphError: the graph JSON is malformed or cannot be prepared.
    """
    g = graph_input if isinstance(graph_input, nx.DiGraph) else graph.from_json(dict(graph_input))
    prepared = graph.prepare(g)
    prepared.segments()  # the parent-side arrays, built once here instead of in every worker
    return Entry(record, prepared, fingerprint(g))


def distinct_graphs(entries: Sequence[Entry]) -> tuple[list[int], list[scoring.Keyed]]:
    """Positions into the distinct graphs of `entries`, and those (fingerprint, graph)."""
    position: dict[str, int] = {}
    distinct: list[scoring.Keyed] = []
    positions = []
    for entry in entries:
        if entry.fingerprint not in position:
            position[entry.fingerprint] = len(distinct)
            distinct.append((entry.fingerprint, entry.prepared))
        positions.append(position[entry.fingerprint])
    return positions, distinct


def array_bytes(p: graph.Prepared) -> int:
    """Bytes held in the numpy arrays of a prepared graph (segments included)."""
    arrays: list[Any] = [p.op_codes, p.dims, p.ranks, p.sizes, p.pred_rows, p.stages,
                         p.fan_in, *p.preds]
    segments = p.cache.get("segments")
    if segments is not None:
        arrays += [getattr(segments, f.name) for f in dataclasses.fields(segments)]
    return sum(int(a.nbytes) for a in arrays)


# Scoring one query's child against zoo parents by record id. `score_ids` looks each
# parent up in the `ScoreCache` (keyed by (parent id, child graph fingerprint)), groups the misses
# by parent graph fingerprint so identical graphs are scored once, hands them to the
# `scoring.PairScorer` with the query's deadline, and records scores, failures (NaN) and cache
# entries in the query's `Search`.
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

    child: graph.Prepared
    child_fingerprint: str
    deadline: float
    scores: dict[str, float] = dataclasses.field(default_factory=dict)
    failed: set[str] = dataclasses.field(default_factory=set)
    cache_hits: int = 0
    computed: int = 0
    timed_out: bool = False


def score_ids(search: Search, ids: Iterable[str], *, entries: Mapping[str, Entry],
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


# The index: the in-memory side of ModelKeeper's zoo (Lai et al., NSDI '23, system design and
# scale tricks). `ZooIndex` keeps each record's graph only in its prepared array form:
#
# * Candidates are filtered to the given modality and task BEFORE any scoring.
# * Up to `exhaustive_limit` candidates (1,000, ModelKeeper's `mode_threshold`): all are scored
#   with `match.similarity`, in-process when few, else in a persistent process pool
#   (`kiln.warmstart.scoring`, min(4, CPUs) workers, prepared graphs sent in chunks).
# * Above it, once the group has clusters (CLARA-style k-medoids, `kiln.warmstart.clusters`):
#   medoids first, then the members of each medoid's own cluster, best medoid first, until a
#   parent reaches `early_exit_similarity` (0.95) or `clustered_pair_budget` pairs were scored.
# * Clusters come from `build_clusters` (blocking, for benchmarks) or, with `maintain_clusters`,
#   from one background builder: each (modality, task) group above `exhaustive_limit` is
#   clustered, and clustered again from scratch once it has doubled (`CLUSTER_REBUILD_GROWTH`)
#   or lost a medoid. A build scores on half the pool's workers, in a pool of its own, within
#   `cluster_build_seconds`, holding the index only to install its result: queries never wait
#   for one and search exhaustively until their group's clusters are ready. Clusters live in
#   memory only; a new index builds its own.
# * Every query has a deadline: past it the pool's workers are terminated and what was scored
#   comes back with `timed_out=True`. A query never hangs.
# * Scores are cached per (parent id, child graph fingerprint), LRU; parents with identical
#   graphs are scored once per query.
# * `refresh()` re-lists the store, loads only new or changed records, drops deleted ones and
#   keeps clusters current (a new model joins its nearest medoid's cluster).
#
# Unusable records are skipped with a `records.SkippedRecordWarning` naming them, never raised:
# `records.list_records` skips damaged meta.json, the index missing or malformed graph.json.

_DEFAULT_SETTINGS = IndexSettings()  # frozen: one shared default is safe


class ZooIndex:
    """The zoo's models in matchable form, with parent search (see the comment above the class).

    Thread-safe: queries, refreshes and cluster builds may come from several threads; queries
    run one at a time. Use as a context manager, or call `close`, to stop the worker pool and
    background cluster builds.

    Example:
        >>> index = ZooIndex(store.open_store("./.kiln/zoo"))      # doctest: +SKIP
        >>> result = index.query(child_graph, modality="image", task="classification")
        >>> result.best.id, result.best.similarity, result.mode   # ('resnet18-7f3c2a1b', ...)
    """

    def __init__(self, zoo: store.ObjectStore | None = None, *,
                 settings: IndexSettings = _DEFAULT_SETTINGS,
                 scorer: scoring.Scorer = match.similarity,
                 clock: Callable[[], float] = time.monotonic,
                 spawn: Spawn | None = None) -> None:
        """Load every usable record of `zoo` (see `refresh`); None: an empty index.

        Args:
            zoo: the store to index, or None (fill with `from_records`).
            settings: search knobs.
            scorer: similarity(parent, child); inject to count or slow down scoring in tests.
            clock: monotonic seconds, for deadlines and wall times.
            spawn: runs the background cluster builder (`maintain_clusters`); None: in a
                daemon thread. Tests pass one that runs it at once, or later.

        Raises:
            StoreUnavailable: the store failed.
        """
        self._zoo = zoo
        self._settings = settings
        self._clock = clock
        self._pairs = scoring.PairScorer(scorer=scorer, workers=settings.workers,
                                         in_process_below=settings.in_process_below,
                                         start_method=settings.start_method,
                                         catalog=self._catalog, clock=clock)
        # Builds leave half the workers to queries, and a pool of their own, so a query's
        # timeout never terminates a build's workers.
        self._build_pairs = scoring.PairScorer(
            scorer=scorer, workers=max(1, self._pairs.workers // 2) if self._pairs.workers else 0,
            in_process_below=settings.in_process_below, start_method=settings.start_method,
            catalog=self._catalog, clock=clock)
        self._spawn = spawn or _in_daemon_thread
        self._entries: dict[str, Entry] = {}
        self._skipped: dict[str, records.ZooRecord] = {}
        self._clusters: dict[tuple[str, str], cluster.Clusters] = {}
        self._built_size: dict[tuple[str, str], int] = {}  # models at a group's last build
        self._stale: set[tuple[str, str]] = set()  # groups that lost a medoid since their build
        self._building = False  # the background builder is scheduled or running
        self._closed = threading.Event()
        self._cache = ScoreCache(settings.cache_entries)
        self._lock = threading.RLock()
        self._refresh_lock = threading.Lock()
        self._warned_unclustered = False
        if zoo is not None:
            self.refresh()

    @classmethod
    def from_records(cls, items: Iterable[tuple[records.ZooRecord, GraphInput]], *,
                     settings: IndexSettings = _DEFAULT_SETTINGS,
                     scorer: scoring.Scorer = match.similarity,
                     clock: Callable[[], float] = time.monotonic,
                     spawn: Spawn | None = None) -> ZooIndex:
        """An index of the given (record, graph) pairs, without a store (benchmarks, tests).

        Items are consumed one at a time, so a generator keeps only prepared graphs alive.
        Malformed graphs are skipped with a `records.SkippedRecordWarning`; a repeated id keeps
        the last pair. `refresh` does nothing on such an index.
        """
        index = cls(None, settings=settings, scorer=scorer, clock=clock, spawn=spawn)
        for record, graph_input in items:
            try:
                entry = make_entry(record, graph_input)
            except graph.GraphError as exc:
                _warn_skip(record.id, "given to ZooIndex.from_records", exc)
                continue
            index._entries[record.id] = entry
        index._start_builder_if_due()
        return index

    # ------------------------------------------------------------------------------------------
    # contents

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, record_id: object) -> bool:
        return record_id in self._entries

    def all_records(self) -> list[records.ZooRecord]:
        """The indexed records, sorted by id."""
        with self._lock:
            return [self._entries[i].record for i in sorted(self._entries)]

    def prepared_bytes(self) -> int:
        """Bytes held in numpy arrays of the prepared graphs (segments included)."""
        with self._lock:
            graphs = [e.prepared for e in self._entries.values()]
        return sum(array_bytes(p) for p in graphs)

    def clusters(self) -> dict[tuple[str, str], cluster.Clusters]:
        """A copy of the clusters per (modality, task) group; empty until a build finished."""
        with self._lock:
            return copy.deepcopy(self._clusters)

    def close(self) -> None:
        """Stop the worker pool (a later query starts a new one) and cluster builds for good (a
        running one stops after its current chunk of `BUILD_CHUNK_PAIRS`)."""
        self._closed.set()
        self._pairs.close()

    def _catalog(self) -> dict[str, graph.Prepared]:
        """Every distinct prepared graph by fingerprint: what pool workers start with."""
        with self._lock:
            return {e.fingerprint: e.prepared for e in self._entries.values()}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # keeping up with the store

    def refresh(self) -> RefreshReport:
        """Re-list the store: load new or replaced records, drop deleted ones.

        Only records whose meta.json changed are read again; clusters (if built) lose deleted
        models and gain new ones (k scores each); with `maintain_clusters`, groups that are due
        a build get one in the background. Records `records.list_records` cannot use,
        and records whose graph.json is missing, not JSON or not a valid graph, are skipped
        with a `records.SkippedRecordWarning` naming them (once per version of the record).

        Returns:
            The ids added, removed and skipped; all empty for an index without a store.

        Raises:
            StoreUnavailable: the store failed (the index is unchanged).
        """
        if self._zoo is None:
            return RefreshReport((), (), ())
        zoo = self._zoo
        with self._refresh_lock:
            listed = {r.id: r for r in records.list_records(zoo)}
            with self._lock:
                known = {i: e.record for i, e in self._entries.items()}
                skipped_before = dict(self._skipped)
            removed = [i for i, r in known.items() if listed.get(records.ZooModelId(i)) != r]
            loaded: list[Entry] = []
            skipped: dict[str, records.ZooRecord] = {}
            for record_id, record in listed.items():
                if known.get(record_id) == record:
                    continue
                if skipped_before.get(record_id) == record:
                    skipped[record_id] = record  # warned about this version already
                    continue
                try:
                    loaded.append(make_entry(record, records.load_graph(zoo, record)))
                except (records.CorruptRecord, graph.GraphError) as exc:
                    _warn_skip(record_id, f"in {zoo.describe()}", exc)
                    skipped[record_id] = record
                except store.ObjectNotFound:
                    _log.debug("zoo record %s vanished while the index read it", record_id)
            with self._lock:
                self._remove_locked(set(removed))
                for entry in loaded:
                    self._entries[entry.record.id] = entry
                self._skipped = skipped
                self._assign_to_clusters_locked([e.record.id for e in loaded])
        self._start_builder_if_due()
        new_skips = tuple(sorted(records.ZooModelId(i) for i, r in skipped.items()
                                 if skipped_before.get(i) != r))
        return RefreshReport(added=tuple(sorted(e.record.id for e in loaded)),
                             removed=tuple(sorted(map(records.ZooModelId, removed))),
                             skipped=new_skips)

    def _remove_locked(self, ids: set[str]) -> None:
        if not ids:
            return
        for record_id in ids:
            self._entries.pop(record_id, None)
        self._cache.forget(ids)
        self._stale |= _remove_from_clusters(self._clusters, ids)

    def _assign_to_clusters_locked(self, ids: Sequence[str],
                                   groups: Iterable[tuple[str, str]] | None = None) -> None:
        """Put new entries into the clusters of their group (of `groups` only, if given)."""
        score = functools.partial(self._score_ids_block, self._entries)
        for group in list(self._clusters if groups is None else groups):
            clusters = self._clusters[group]
            joining = [i for i in ids if self._entries[i].group == group]
            if joining and clusters.medoids:
                cluster.assign(clusters, joining, score)
            elif joining:  # every model of the group had been deleted: start over
                self._clusters[group] = cluster.Clusters(
                    medoids=[joining[0]], members=[[joining[0]]],
                    similarity_to_medoid={joining[0]: 1.0}, max_diameter=0.0, built_size=1)
                cluster.assign(self._clusters[group], joining[1:], score)

    # ------------------------------------------------------------------------------------------
    # clusters

    def build_clusters(self, *, restarts: int = CLUSTER_RESTARTS, seed: int = 0,
                       sample_size: int | None = None) -> list[cluster.BuildStats]:
        """Cluster every (modality, task) group CLARA-style (`kiln.warmstart.clusters`), now.

        Scoring runs in temporary pools of the index's full size, without holding the index:
        queries keep being answered meanwhile. Cost: s^2 + (N - s) * k pair scores per group
        (N = 10,000: about 1e6 pairs, against 1e8 for ModelKeeper's full matrix); see
        `BuildStats`. With `maintain_clusters` the index does this itself, in the background.

        Args:
            restarts: k-medoids restarts on the sample (ModelKeeper: 10,000 "spawns").
            seed: seeds the sample and the restarts.
            sample_size: CLARA sample size per group; default min(N, 40 + 2k).

        Returns:
            One `BuildStats` per group, sorted by (modality, task).
        """
        with self._lock:
            snapshot = dict(self._entries)
        by_group: dict[tuple[str, str], list[str]] = {}
        for record_id in sorted(snapshot):
            by_group.setdefault(snapshot[record_id].group, []).append(record_id)
        built: dict[tuple[str, str], cluster.Clusters] = {}
        stats = []
        score = functools.partial(self._score_ids_block, snapshot)
        for group, ids in sorted(by_group.items()):
            built[group], group_stats = cluster.build(
                ids, score, restarts=restarts, seed=seed, sample=sample_size, clock=self._clock)
            stats.append(group_stats)
            _log_build(group, group_stats)
        with self._lock:
            self._built_size.update({group: len(ids) for group, ids in by_group.items()})
            self._install_locked(snapshot, built)
        return stats

    def _install_locked(self, snapshot: Mapping[str, Entry],
                        built: Mapping[tuple[str, str], cluster.Clusters]) -> None:
        """Make clusters built from `snapshot` current, catching up with refreshes since."""
        changed = {i for i, e in snapshot.items() if self._entries.get(i) is not e}
        self._stale -= set(built)  # the medoids lost were those of the clusters replaced here
        self._stale |= _remove_from_clusters(built, changed)
        self._clusters.update(built)
        self._assign_to_clusters_locked(
            [i for i, e in self._entries.items() if e.group in built and snapshot.get(i) is not e],
            groups=built)

    def _due_groups_locked(self) -> dict[tuple[str, str], int]:
        """Groups the background builder should cluster now, with their sizes: above the
        exhaustive limit and never built, grown by `CLUSTER_REBUILD_GROWTH`, or short of a
        medoid."""
        sizes = collections.Counter(e.group for e in self._entries.values())
        due = {}
        for group, size in sizes.items():
            last = self._built_size.get(group)
            if size > self._settings.exhaustive_limit and (
                    last is None or size >= CLUSTER_REBUILD_GROWTH * last
                    or group in self._stale):
                due[group] = size
        return due

    def _start_builder_if_due(self) -> None:
        """Start the background builder when a group is due and none runs (`maintain_clusters`)."""
        with self._lock:
            if (not self._settings.maintain_clusters or self._building or self._closed.is_set()
                    or not self._due_groups_locked()):
                return
            self._building = True
        try:
            self._spawn(self._build_due_clusters)
        except BaseException:
            with self._lock:
                self._building = False
            raise

    def _build_due_clusters(self) -> None:
        """The background builder: cluster the due groups one at a time until none is due."""
        try:
            while True:
                self._build_pairs.close()  # idle between builds: no workers held
                with self._lock:
                    due = self._due_groups_locked()
                    if not due or self._closed.is_set():
                        self._building = False
                        return
                    group = min(due)
                    # Recorded before building: a build past its budget is not retried until
                    # the group has grown again.
                    self._built_size[group] = due[group]
                    self._stale.discard(group)
                    snapshot = {i: e for i, e in self._entries.items() if e.group == group}
                self._build_group(group, snapshot)
        except BaseException:
            self._build_pairs.close()
            with self._lock:
                self._building = False
            raise

    def _build_group(self, group: tuple[str, str], snapshot: Mapping[str, Entry]) -> None:
        """Cluster one group of the background builder and install the result, or log why not."""
        deadline = self._clock() + self._settings.cluster_build_seconds
        score = functools.partial(self._score_for_build, snapshot, deadline)
        try:
            built, stats = cluster.build(sorted(snapshot), score, restarts=CLUSTER_RESTARTS,
                                         seed=0, clock=self._clock)
        except _BuildAbandoned as exc:
            _log.warning("zoo index: clustering %d %s/%s models was abandoned: %s; its queries "
                         "score every model until it has grown %gx", len(snapshot), *group, exc,
                         CLUSTER_REBUILD_GROWTH)
            return
        _log_build(group, stats)
        with self._lock:
            self._install_locked(snapshot, {group: built})

    def _score_for_build(self, entries: Mapping[str, Entry], deadline: float,
                         parent_ids: Sequence[str], child_ids: Sequence[str]
                         ) -> np.ndarray[Any, np.dtype[np.float64]]:
        """`_score_ids_block` for a background build: the build's own pool, in chunks of
        `BUILD_CHUNK_PAIRS`, within the build's deadline.

        Raises:
            _BuildAbandoned: the deadline passed or the index was closed.
        """
        parent_positions, parents = distinct_graphs([entries[i] for i in parent_ids])
        child_positions, children = distinct_graphs([entries[i] for i in child_ids])
        values = np.full((len(parents), len(children)), np.nan)
        errors: list[str] = []
        step = max(1, BUILD_CHUNK_PAIRS // max(1, len(parents)))
        for start in range(0, len(children), step):
            if self._closed.is_set():
                raise _BuildAbandoned("the index was closed")
            grid = self._build_pairs.grid(parents, children[start:start + step],
                                          deadline=deadline)
            if grid.timed_out:
                raise _BuildAbandoned(
                    f"it ran past its budget of {self._settings.cluster_build_seconds:g} s "
                    "(IndexSettings.cluster_build_seconds)")
            values[:, start:start + step] = grid.values
            errors += grid.errors
        if errors:
            _log.warning("clustering: %d pair scores failed (counted as distance 1); first: %s",
                         len(errors), errors[0])
        return values[np.ix_(parent_positions, child_positions)]

    def _score_ids_block(self, entries: Mapping[str, Entry], parent_ids: Sequence[str],
                         child_ids: Sequence[str]) -> np.ndarray[Any, np.dtype[np.float64]]:
        """similarity(parent -> child) for id blocks, each distinct graph pair scored once."""
        parent_positions, parents = distinct_graphs([entries[i] for i in parent_ids])
        child_positions, children = distinct_graphs([entries[i] for i in child_ids])
        grid = self._pairs.grid(parents, children, persistent=False)
        if grid.errors:
            _log.warning("clustering: %d pair scores failed (counted as distance 1); first: %s",
                         len(grid.errors), grid.errors[0])
        return grid.values[np.ix_(parent_positions, child_positions)]

    # ------------------------------------------------------------------------------------------
    # queries

    def query(self, child_graph: GraphInput, *, modality: str | None = None,
              task: str | None = None, top_k: int | None = 5,
              timeout_seconds: float = 30.0) -> QueryResult:
        """The zoo models most similar to `child_graph` as parents (comment above the class).

        Args:
            child_graph: the new model's graph (`graph.extract`) or its JSON dict.
            modality: keep only records of this modality (``image``, ``text``); None: all.
            task: keep only records of this task (``classification``, ...); None: all.
            top_k: how many candidates to return; None: every scored one (for callers that
                bucket by similarity and then pick by accuracy).
            timeout_seconds: deadline for the whole query, > 0.

        Returns:
            The candidates and how the search went.

        Raises:
            ValueError: top_k < 1 or timeout_seconds <= 0.
            graph.GraphError: `child_graph` is not a valid graph (callers cold-start).
        """
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None (got {top_k})")
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0 (got {timeout_seconds})")
        start = self._clock()
        child_nx = (child_graph if isinstance(child_graph, nx.DiGraph)
                    else graph.from_json(dict(child_graph)))
        child = graph.prepare(child_nx)
        match.self_score(child)  # cached on `child`, so pool workers receive it with the graph
        search = Search(child, fingerprint(child_nx), deadline=start + timeout_seconds)
        with self._lock:
            compatible = [i for i, e in self._entries.items()
                          if (modality is None or e.record.modality == modality)
                          and (task is None or e.record.task == task)]
            clustered = len(compatible) > self._settings.exhaustive_limit
            if clustered and not any(self._entries[i].group in self._clusters
                                     for i in compatible):
                if not self._warned_unclustered:  # expected for a one-shot index
                    _log.info("zoo index: %d candidates exceed the exhaustive limit %d and are "
                              "not clustered (yet); scoring all of them", len(compatible),
                              self._settings.exhaustive_limit)
                    self._warned_unclustered = True
                clustered = False
            visited = 0
            if clustered:
                visited = cluster.search(
                    self._clusters, set(compatible), search.scores,
                    functools.partial(self._score_ids, search),
                    early_exit_similarity=self._settings.early_exit_similarity,
                    pair_budget=self._settings.clustered_pair_budget)
            else:
                self._score_ids(search, compatible)
            ranked = sorted(search.scores.items(), key=lambda kv: (-kv[1], kv[0]))
            candidates = tuple(Candidate(records.ZooModelId(i), s, self._entries[i].record)
                               for i, s in ranked[:top_k])
        failed = sorted(search.failed)
        if failed:
            _log.warning("zoo index: scoring failed for %d candidates: %s", len(failed),
                         ", ".join(failed[:5]))
        return QueryResult(
            candidates=candidates,
            mode=SearchMode.CLUSTERED if clustered else SearchMode.EXHAUSTIVE,
            compatible=len(compatible), scored=len(search.scores), cache_hits=search.cache_hits,
            computed=search.computed, clusters_visited=visited,
            failed=tuple(records.ZooModelId(i) for i in failed),
            wall_seconds=self._clock() - start, timed_out=search.timed_out)

    def _score_ids(self, search: Search, ids: Iterable[str]) -> bool:
        """`score_ids` on this index; False once the query's deadline has passed."""
        return score_ids(search, ids, entries=self._entries, cache=self._cache,
                                    pairs=self._pairs)


class _BuildAbandoned(Exception):
    """A background cluster build stopped before it finished (the message says why)."""


def _remove_from_clusters(clusters: Mapping[tuple[str, str], cluster.Clusters],
                          ids: set[str]) -> set[tuple[str, str]]:
    """Drop models from the clusters of every group (`cluster.remove`).

    Returns:
        The groups that lost a medoid.
    """
    lost = set()
    for group, group_clusters in clusters.items():
        if ids.intersection(group_clusters.medoids):
            lost.add(group)
        cluster.remove(group_clusters, ids)
    return lost


def _log_build(group: tuple[str, str], stats: cluster.BuildStats) -> None:
    _log.info("clustered %d %s/%s models into %d clusters: %d pair scores, %.1f s, "
              "max diameter %.3f", stats.models, *group, stats.clusters, stats.pairs_requested,
              stats.wall_seconds, stats.max_diameter)


def _in_daemon_thread(work: Callable[[], None]) -> None:
    """The default `Spawn`: run `work` in a daemon thread (it never delays interpreter exit)."""
    threading.Thread(target=work, name="kiln-zoo-clusters", daemon=True).start()


def _warn_skip(record_id: str, where: str, exc: Exception) -> None:
    warnings.warn(f"zoo record {record_id} {where} skipped by the zoo index: {exc}",
                  records.SkippedRecordWarning, stacklevel=3)
