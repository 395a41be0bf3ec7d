"""Offline k-medoids clustering of zoo models, for clustered parent search above ~1,000 models.

CLARA-style (Kaufman & Rousseeuw, 1990) so that the cost grows like N * k, not N^2, with
ModelKeeper's distance, assignment and re-election rules. No scoring (callbacks do it), no
cache, no I/O, no torch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

# ModelKeeper (Lai et al., NSDI '23, offline clustering) groups its zoo with k-medoids, k =
# floor(sqrt(N)), over the asymmetric distance d(a, b) = 1 - similarity(a -> b) with the MEDOID IN
# THE PARENT POSITION; a query then scores the child against every medoid and searches the best
# clusters first. It fills the full N x N distance matrix (1e8 ordered pairs for 10,000 models: days
# of matching) and keeps the partition with the smallest maximum cluster diameter over 10,000 random
# restarts.
#
# Kiln keeps the distance, the assignment rule, the re-election rule and the max-diameter choice,
# but builds CLARA-style (Kaufman & Rousseeuw, "Clustering Large Applications", 1990) so that the
# cost grows like N * k instead of N^2:
#
# 1. k = max(1, round(sqrt(N))); draw a seeded random sample of s = min(N, 40 + 2k) models.
# 2. Score the s x s sample matrix and run k-medoids on it `restarts` times (random initial
#    medoids from a seeded generator; assign every point to the medoid m minimising d(m, x);
#    re-elect per cluster the member c minimising sum_x d(c, x); at most `max_iterations`
#    rounds). Keep the partition whose largest cluster diameter (max ordered-pair distance
#    inside a cluster) is smallest; ties go to the lower total distance.
# 3. Assign every other model x to argmin_m d(m, x) over the k medoids: (N - s) * k scores.
#
# Build cost in pair scores: s^2 + (N - s) * k. For N = 10,000: k = 100, s = 240, about
# 1.03e6 pairs instead of 1e8 (see bench/zoo_query.py for seconds). Models with identical graphs
# are scored once (the index deduplicates by graph fingerprint), so real zoos, where one
# architecture is trained many times, cost less.
#
# Incremental upkeep (the index calls these when the zoo changes): a new model is assigned with k
# scores (`assign`); a deleted member just leaves its cluster; a deleted medoid is replaced by the
# remaining member most similar to it (`remove`, no scoring). After the zoo has grown a lot the
# clusters drift from sqrt(N); rebuild (`build`) offline.
#
# Terms: N models in a group, k clusters, s sampled models. Similarities are in [0, 1]; NaN means
# "could not score" and counts as distance 1.
#
# Query (`search`): score the child against every medoid; visit clusters in order of their
# medoid's score; each visit scores the members of THAT cluster. The published
# `query_best_mapping` takes them from `model_clusters[top_i]`, an index into the SORTED medoid
# list, i.e. from the wrong cluster; a regression test in the index's tests guards this. Stop
# once the best similarity reaches the early-exit level (0.95), once a pair budget is spent
# (ours: bounds a query when no parent is that close), or at the deadline.

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

SimilarityBlock = Callable[[Sequence[str], Sequence[str]], FloatArray]
"""(parent ids P, child ids C) -> float64[len(P), len(C)] similarities (NaN: not scored)."""

MAX_ITERATIONS = 100
"""Rounds of assign/re-elect per restart (ModelKeeper allows 1,000; we converge in < 20)."""
SAMPLE_BASE = 40
"""CLARA's sample size is SAMPLE_BASE + 2k (Kaufman & Rousseeuw)."""


@dataclasses.dataclass(frozen=True)
class Partition:
    """A k-medoids solution on a distance matrix.

    Attributes:
        medoids: int64[k], point indices of the medoids (cluster c has medoid medoids[c]).
        labels: int64[s], the cluster of every point (a medoid is in its own cluster).
        max_diameter: the largest cluster diameter (max distance between two members).
        total_distance: sum over points of d(medoid of its cluster, point).
    """

    medoids: IntArray
    labels: IntArray
    max_diameter: float
    total_distance: float


@dataclasses.dataclass
class Clusters:
    """The clusters of one compatibility group (one modality and task) of a zoo.

    Mutable: `ZooIndex` updates it in place, under its lock, with `assign` and `remove`.

    Attributes:
        medoids: the medoid id of each cluster.
        members: the member ids of each cluster, medoid first.
        similarity_to_medoid: similarity(medoid -> id) of every member (1.0 for a medoid).
        max_diameter: the chosen partition's largest cluster diameter on the sample.
        built_size: N when the clusters were built.
    """

    medoids: list[str]
    members: list[list[str]]
    similarity_to_medoid: dict[str, float]
    max_diameter: float
    built_size: int

    @property
    def size(self) -> int:
        """Number of models in the clusters."""
        return len(self.similarity_to_medoid)


@dataclasses.dataclass(frozen=True)
class BuildStats:
    """What one `build` cost.

    Attributes:
        models: N.
        clusters: k.
        sample_size: s.
        pairs_requested: s^2 + (N - s) * k, the pair scores asked of the `SimilarityBlock`.
        max_diameter: the chosen partition's largest cluster diameter on the sample.
        wall_seconds: time spent, scoring included.
    """

    models: int
    clusters: int
    sample_size: int
    pairs_requested: int
    max_diameter: float
    wall_seconds: float


def choose_k(n: int) -> int:
    """Number of clusters for n models: round(sqrt(n)), at least 1 (ModelKeeper: floor)."""
    return max(1, round(math.sqrt(n)))


def sample_size(n: int, k: int) -> int:
    """CLARA sample size for n models and k clusters: min(n, 40 + 2k)."""
    return min(n, SAMPLE_BASE + 2 * k)


def k_medoids(distance: FloatArray, k: int, *, restarts: int, rng: np.random.Generator,
              max_iterations: int = MAX_ITERATIONS) -> Partition:
    """k-medoids with random restarts, keeping the partition of smallest maximum diameter.

    Args:
        distance: float64[s, s], distance[a, b] = d(a -> b) = 1 - similarity(a -> b), with a
            in the parent (medoid) position; need not be symmetric; NaN counts as 1.
        k: number of clusters, 1 <= k <= s.
        restarts: number of random initialisations, >= 1.
        rng: the random generator (seed it for reproducible clusters).
        max_iterations: assign/re-elect rounds per restart.

    Returns:
        The best `Partition` over all restarts.

    Raises:
        ValueError: the matrix is not square, or k or restarts out of range.
    """
    s = distance.shape[0]
    if distance.ndim != 2 or distance.shape[1] != s:
        raise ValueError(f"distance matrix must be square, got shape {distance.shape}")
    if not 1 <= k <= s or restarts < 1:
        raise ValueError(f"need 1 <= k <= {s} and restarts >= 1 (got k={k}, restarts={restarts})")
    d = np.where(np.isnan(distance), 1.0, distance)
    best: Partition | None = None
    for _ in range(restarts):
        candidate = _k_medoids_once(d, rng.choice(s, size=k, replace=False), max_iterations)
        if best is None or (candidate.max_diameter, candidate.total_distance) < (
                best.max_diameter, best.total_distance):
            best = candidate
    assert best is not None  # restarts >= 1
    return best


def _k_medoids_once(d: FloatArray, medoids: IntArray, max_iterations: int) -> Partition:
    medoids = np.sort(medoids).astype(np.int64)
    labels = _assign_labels(d, medoids)
    for _ in range(max_iterations):
        elected = medoids.copy()
        for c in range(len(medoids)):
            members = np.flatnonzero(labels == c)
            # Re-elect the member that, as parent, is closest to all the others (ModelKeeper
            # clustering.py `compute_kernel`): argmin_c sum_x d(c, x).
            elected[c] = members[np.argmin(d[np.ix_(members, members)].sum(axis=1))]
        if np.array_equal(elected, medoids):
            break
        medoids = elected
        labels = _assign_labels(d, medoids)
    diameter = max(float(d[np.ix_(m, m)].max()) for m in
                   (np.flatnonzero(labels == c) for c in range(len(medoids))))
    total = float(d[medoids[labels], np.arange(len(labels))].sum())
    return Partition(medoids=medoids, labels=labels, max_diameter=diameter, total_distance=total)


def _assign_labels(d: FloatArray, medoids: IntArray) -> IntArray:
    """Nearest medoid of every point, medoid as parent; medoids keep their own cluster (two
    medoids with identical graphs are at distance 0 from each other)."""
    labels: IntArray = np.argmin(d[medoids, :], axis=0).astype(np.int64)
    labels[medoids] = np.arange(len(medoids))
    return labels


def build(ids: Sequence[str], score: SimilarityBlock, *, restarts: int, seed: int,
          sample: int | None = None,
          clock: Callable[[], float] = time.monotonic) -> tuple[Clusters, BuildStats]:
    """Cluster one group of models CLARA-style (steps 1-3 in the comment at the top).

    Args:
        ids: the group's model ids (distinct), N >= 1.
        score: scores similarity(parent -> child) for blocks of ids.
        restarts: k-medoids restarts on the sample.
        seed: seeds the sample and the restarts.
        sample: sample size s; default min(N, 40 + 2k).
        clock: monotonic seconds, for `BuildStats.wall_seconds`.

    Returns:
        The clusters and what building them cost.

    Raises:
        ValueError: no ids, or restarts < 1.
    """
    start = clock()
    n = len(ids)
    if n == 0:
        raise ValueError("cannot cluster an empty group of models")
    k = choose_k(n)
    s = max(k, min(n, sample if sample is not None else sample_size(n, k)))
    rng = np.random.default_rng(seed)
    order = np.sort(rng.choice(n, size=s, replace=False))
    sampled = [ids[i] for i in order]
    similarity = score(sampled, sampled)
    partition = k_medoids(1.0 - similarity, k, restarts=restarts, rng=rng)
    medoids = [sampled[m] for m in partition.medoids]
    members: list[list[str]] = [[m] for m in medoids]
    to_medoid = {m: 1.0 for m in medoids}
    for point, label in enumerate(partition.labels):
        record_id = sampled[point]
        if record_id not in to_medoid:
            members[label].append(record_id)
            value = similarity[partition.medoids[label], point]
            to_medoid[record_id] = 0.0 if np.isnan(value) else float(value)
    clusters = Clusters(medoids=medoids, members=members, similarity_to_medoid=to_medoid,
                        max_diameter=partition.max_diameter, built_size=n)
    in_sample = set(sampled)
    assign(clusters, [i for i in ids if i not in in_sample], score)
    stats = BuildStats(models=n, clusters=k, sample_size=s, pairs_requested=s * s + (n - s) * k,
                       max_diameter=partition.max_diameter, wall_seconds=clock() - start)
    return clusters, stats


def assign(clusters: Clusters, ids: Sequence[str], score: SimilarityBlock) -> None:
    """Put each model into the cluster of its nearest medoid (medoid as parent): k scores each.

    Args:
        clusters: updated in place.
        ids: models not yet in `clusters`.
        score: scores similarity(parent -> child) for blocks of ids.
    """
    if not ids:
        return
    similarity = np.nan_to_num(score(clusters.medoids, ids), nan=0.0)
    best = np.argmax(similarity, axis=0)
    for j, record_id in enumerate(ids):
        clusters.members[int(best[j])].append(record_id)
        clusters.similarity_to_medoid[record_id] = float(similarity[best[j], j])


def remove(clusters: Clusters, ids: set[str]) -> None:
    """Drop models from the clusters, in place; no scoring.

    A cluster that loses its medoid elects the remaining member most similar to the old medoid
    (a cheap stand-in for re-election; members keep their stored similarity, now to a
    neighbour of their medoid). A cluster left empty disappears.
    """
    for c in reversed(range(len(clusters.medoids))):
        kept = [m for m in clusters.members[c] if m not in ids]
        if not kept:
            del clusters.medoids[c], clusters.members[c]
            continue
        if clusters.medoids[c] in ids:
            successor = max(kept, key=lambda m: clusters.similarity_to_medoid[m])
            kept.remove(successor)
            kept.insert(0, successor)
            clusters.medoids[c] = successor
            clusters.similarity_to_medoid[successor] = 1.0
        clusters.members[c] = kept
    for record_id in ids:
        clusters.similarity_to_medoid.pop(record_id, None)


def search(clusters: Mapping[tuple[str, str], Clusters], compatible: set[str],
           scores: Mapping[str, float], score: Callable[[Sequence[str]], bool], *,
           early_exit_similarity: float, pair_budget: int | None) -> int:
    """Clustered parent search ("Query" in the comment at the top).

    Args:
        clusters: clusters per group; only clusters whose medoid is in `compatible` are used.
        compatible: ids that passed the query's filter.
        scores: id -> similarity(id -> child) found so far; `score` fills it in.
        score: scores the child against these parents into `scores`; False once the deadline
            has passed.
        early_exit_similarity: stop once the best similarity reaches this.
        pair_budget: visit no further cluster once this many ids were scored (the best-ranked
            cluster is always visited); None: no budget.

    Returns:
        How many clusters had their members scored.
    """
    found = [(group, number, medoid) for group, c in sorted(clusters.items())
             for number, medoid in enumerate(c.medoids) if medoid in compatible]
    in_clusters = {m for group, number, _ in found for m in clusters[group].members[number]}
    # Models outside every cluster (their group was never clustered) are scored like medoids.
    if not score([medoid for _, _, medoid in found] + sorted(compatible - in_clusters)):
        return 0
    ranked = sorted(range(len(found)), key=lambda n: (-scores.get(found[n][2], -1.0), n))
    visited = 0
    for n in ranked:
        if max(scores.values(), default=0.0) >= early_exit_similarity:
            break
        if visited and pair_budget is not None and len(scores) >= pair_budget:
            break
        group, number, _ = found[n]
        visited += 1
        # Members of the cluster whose medoid ranked here, NOT clusters[...][position in the
        # ranking] (the published bug).
        if not score(clusters[group].members[number]):
            break
    return visited
