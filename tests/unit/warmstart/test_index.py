"""Unit tests of kiln.warmstart.index, with its clusters and scoring.

Zoos are DirStores in tmp_path with records written by `records.write_record` (tiny weights,
graphs extracted from kiln.models builders on the meta device). Zoo "variants" are extracted
graphs whose weight shapes were widened in the JSON, as bench/zoo_query.py does. Slow or counting
scorers are injected; time comes from a fake clock, except in the one test that checks pool
workers are terminated at the deadline (it waits about one second).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kiln import models
from kiln.warmstart import clusters as cluster
from kiln.warmstart import graph, index, match, scoring
from kiln.zoo import records, store

IMAGE = ("image", "classification")
TEXT = ("text", "language_modeling")
BASES: dict[str, tuple[str, tuple[int, ...], dict[str, Any]]] = {  # name -> (arch, shape, args)
    "resnet_111": ("small_resnet", (3, 16, 16), {"blocks": [1, 1, 1], "width": 8}),
    "resnet_222": ("small_resnet", (3, 16, 16), {"blocks": [2, 2, 2], "width": 8}),
    "cnn_3": ("small_cnn", (3, 16, 16), {"depth": 3, "width": 16}),
    "cnn_5": ("small_cnn", (3, 16, 16), {"depth": 5, "width": 16}),
    "lm_2": ("char_transformer", (32,), {"depth": 2, "width": 32}),
}


@pytest.fixture(scope="module")
def base_graphs() -> dict[str, dict[str, Any]]:
    """Graph JSON of each base architecture (extracted once per module)."""
    graphs = {}
    for name, (architecture, shape, args) in BASES.items():
        with torch.device("meta"):
            model = models.get_model(architecture, input_shape=shape, **args)
        graphs[name] = graph.to_json(graph.extract(model, shape, name=architecture))
    return graphs


def widened(doc: dict[str, Any], seed: int) -> dict[str, Any]:
    """A variant of a graph: some weight tensors get channel dimensions (>= 8) widened."""
    rng = random.Random(seed)
    variant = copy.deepcopy(doc)
    for node in variant["nodes"]:
        if node["weight_shape"] and rng.random() < 0.4:
            extra = rng.randint(1, 6)
            node["weight_shape"] = [d + extra if d >= 8 else d for d in node["weight_shape"]]
    return variant


def make_record(record_id: str, base: str) -> records.ZooRecord:
    architecture, shape, args = BASES[base]
    modality, task = TEXT if base.startswith("lm") else IMAGE
    return records.ZooRecord(
        id=records.ZooModelId(record_id), architecture=architecture, args=args,
        input_shape=shape, modality=modality, task=task, dataset="digits",
        metric_name="validation_accuracy", metric_value=0.9, num_params=10,
        created_time="2024-05-01T12:00:00Z", job_name=record_id, job_spec={})


def write(zoo: store.ObjectStore, record_id: str, base: str, doc: dict[str, Any]) -> None:
    records.write_record(zoo, make_record(record_id, base), {"w": torch.zeros(2)}, doc)


class CountingScorer:
    """match.similarity, counting calls (in-process scoring only)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, parent: graph.Prepared, child: graph.Prepared) -> float:
        self.calls += 1
        return match.similarity(parent, child)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


IN_PROCESS = index.IndexSettings(workers=0)


@pytest.fixture
def small_zoo(tmp_path: Path, base_graphs: dict[str, dict[str, Any]]) -> store.DirStore:
    """One record per base architecture, id = base name with '-' for '_'."""
    zoo = store.DirStore(tmp_path / "zoo")
    for name, doc in base_graphs.items():
        write(zoo, name.replace("_", "-"), name, doc)
    return zoo


def test_exhaustive_query_ranks_the_closest_architecture_first(
        small_zoo: store.DirStore, base_graphs: dict[str, dict[str, Any]]) -> None:
    idx = index.ZooIndex(small_zoo, settings=IN_PROCESS)
    child = widened(base_graphs["resnet_222"], seed=7)

    result = idx.query(child, top_k=None)

    assert result.mode is index.SearchMode.EXHAUSTIVE
    assert result.best is not None and result.best.id == "resnet-222"
    assert 0.5 < result.best.similarity < 1.0
    similarities = [c.similarity for c in result.candidates]
    assert similarities == sorted(similarities, reverse=True)
    assert result.scored == result.compatible == len(BASES)
    assert result.best.record.architecture == "small_resnet"
    assert not result.timed_out


def test_modality_and_task_filter_candidates_before_scoring(
        small_zoo: store.DirStore, base_graphs: dict[str, dict[str, Any]]) -> None:
    scorer = CountingScorer()
    idx = index.ZooIndex(small_zoo, settings=IN_PROCESS, scorer=scorer)

    text = idx.query(base_graphs["lm_2"], modality="text", task="language_modeling")
    assert [c.id for c in text.candidates] == ["lm-2"]
    assert (text.compatible, scorer.calls) == (1, 1)

    image = idx.query(base_graphs["cnn_3"], modality="image", task="classification", top_k=None)
    assert {c.id for c in image.candidates} == {"resnet-111", "resnet-222", "cnn-3", "cnn-5"}
    assert scorer.calls == 1 + 4
    assert idx.query(base_graphs["cnn_3"], task="segmentation").candidates == ()


def test_second_query_for_the_same_architecture_is_served_from_the_cache(
        small_zoo: store.DirStore, base_graphs: dict[str, dict[str, Any]]) -> None:
    scorer = CountingScorer()
    idx = index.ZooIndex(small_zoo, settings=IN_PROCESS, scorer=scorer)
    child = widened(base_graphs["cnn_5"], seed=3)

    first = idx.query(child)
    calls_after_first = scorer.calls
    renamed = dict(child, name="another-job")  # the name is not part of the fingerprint
    second = idx.query(graph.from_json(renamed))

    assert calls_after_first == len(BASES)
    assert scorer.calls == calls_after_first
    assert (second.cache_hits, second.computed) == (len(BASES), 0)
    assert second.candidates == first.candidates


def test_identical_parent_graphs_are_scored_once_per_query(
        tmp_path: Path, base_graphs: dict[str, dict[str, Any]]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    for k in range(3):
        write(zoo, f"cnn-copy-{k}", "cnn_3", base_graphs["cnn_3"])
    scorer = CountingScorer()
    idx = index.ZooIndex(zoo, settings=IN_PROCESS, scorer=scorer)

    result = idx.query(base_graphs["cnn_3"], top_k=None)

    assert scorer.calls == 1
    assert [c.similarity for c in result.candidates] == [1.0, 1.0, 1.0]


def test_corrupt_graph_json_is_skipped_with_a_warning_naming_the_record(
        small_zoo: store.DirStore) -> None:
    small_zoo.put_bytes("models/cnn-3/graph.json", b"{not json")
    small_zoo.put_bytes("models/cnn-5/graph.json", b'{"schema_version": 1, "nodes": 3}')

    with pytest.warns(records.SkippedRecordWarning) as caught:
        idx = index.ZooIndex(small_zoo, settings=IN_PROCESS)

    messages = " ".join(str(w.message) for w in caught)
    assert "cnn-3" in messages and "cnn-5" in messages
    assert len(idx) == len(BASES) - 2 and "cnn-3" not in idx
    report = idx.refresh()  # warned once per version of a record; still skipped
    assert report.skipped == () and len(idx) == len(BASES) - 2


def test_from_records_skips_a_malformed_graph_with_a_warning(
        base_graphs: dict[str, dict[str, Any]]) -> None:
    items = [(make_record("good-1", "cnn_3"), base_graphs["cnn_3"]),
             (make_record("bad-1", "cnn_5"), {"schema_version": 99})]
    with pytest.warns(records.SkippedRecordWarning, match="bad-1"):
        idx = index.ZooIndex.from_records(items, settings=IN_PROCESS)
    assert [r.id for r in idx.all_records()] == ["good-1"]


def test_refresh_picks_up_a_new_record_and_drops_a_deleted_one(
        small_zoo: store.DirStore, base_graphs: dict[str, dict[str, Any]]) -> None:
    idx = index.ZooIndex(small_zoo, settings=IN_PROCESS)
    twin = widened(base_graphs["resnet_111"], seed=11)
    assert idx.query(twin).best.similarity < 1.0  # type: ignore[union-attr]

    write(small_zoo, "resnet-111-wide", "resnet_111", twin)
    added = idx.refresh()
    best = idx.query(twin).best

    assert added.added == ("resnet-111-wide",) and added.removed == ()
    assert best is not None and (best.id, best.similarity) == ("resnet-111-wide", 1.0)

    records.delete_record(small_zoo, "resnet-111-wide")
    removed = idx.refresh()
    assert removed.removed == ("resnet-111-wide",)
    assert "resnet-111-wide" not in {c.id for c in idx.query(twin, top_k=None).candidates}


def test_timeout_returns_partial_results_marked_timed_out(
        small_zoo: store.DirStore, base_graphs: dict[str, dict[str, Any]]) -> None:
    clock = FakeClock()

    def slow_scorer(parent: graph.Prepared, child: graph.Prepared) -> float:
        clock.now += 10.0  # every pair takes ten (fake) seconds
        return match.similarity(parent, child)

    idx = index.ZooIndex(small_zoo, settings=IN_PROCESS, scorer=slow_scorer, clock=clock)
    result = idx.query(base_graphs["cnn_3"], top_k=None, timeout_seconds=25.0)

    assert result.timed_out
    assert result.scored == len(result.candidates) == 3  # pairs started at t = 0, 10, 20
    assert result.compatible == len(BASES)
    assert result.wall_seconds == pytest.approx(30.0)


def hang_on_big_parents(parent: graph.Prepared, child: graph.Prepared) -> float:
    """Scores small parents; never returns for parents of more than 20 nodes (pool test)."""
    if parent.n > 20:
        threading.Event().wait()
    return match.similarity(parent, child)


@pytest.mark.process
def test_pool_workers_are_terminated_at_the_deadline(
        tmp_path: Path, base_graphs: dict[str, dict[str, Any]]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    for k in range(40):
        base = "cnn_3" if k % 2 else "resnet_222"
        write(zoo, f"m-{k:02d}", base, widened(base_graphs[base], seed=k))
    settings = index.IndexSettings(workers=2, in_process_below=8)
    with index.ZooIndex(zoo, settings=settings, scorer=hang_on_big_parents) as idx:
        first = idx.query(base_graphs["cnn_3"], timeout_seconds=1.0)
        again = idx.query(base_graphs["cnn_5"], timeout_seconds=1.0)  # on a fresh pool

    for result in (first, again):
        assert result.timed_out
        assert result.scored < result.compatible == 40


@pytest.mark.process
def test_pool_scores_a_model_added_after_its_workers_started(
        small_zoo: store.DirStore, base_graphs: dict[str, dict[str, Any]]) -> None:
    pooled = index.IndexSettings(workers=2, in_process_below=1)  # every query uses the pool
    newcomer = widened(base_graphs["cnn_3"], seed=5)
    with index.ZooIndex(small_zoo, settings=pooled) as idx:
        before = idx.query(newcomer, top_k=None)  # workers start with the 5 graphs preloaded
        write(small_zoo, "cnn-3-new", "cnn_3", newcomer)
        idx.refresh()
        after = idx.query(newcomer, top_k=None)  # the newcomer travels with the task

    assert before.scored == len(BASES) and not before.timed_out
    assert after.best is not None and (after.best.id, after.best.similarity) == ("cnn-3-new", 1.0)
    assert {c.id: c.similarity for c in after.candidates if c.id != "cnn-3-new"} == {
        c.id: c.similarity for c in before.candidates}
    assert after.cache_hits == len(BASES)


BUILD: dict[str, Any] = {"restarts": 3, "seed": 1, "sample_size": 30}


@dataclasses.dataclass
class ClusteredZoo:
    store: store.DirStore
    ids: dict[str, str]  # id -> base name
    docs: dict[str, dict[str, Any]]  # id -> graph JSON
    index: index.ZooIndex


@pytest.fixture(scope="module")
def clustered_zoo(tmp_path_factory: pytest.TempPathFactory,
                  base_graphs: dict[str, dict[str, Any]]) -> Iterator[ClusteredZoo]:
    """60 distinct image-classifier variants and 4 LMs, clustered (exhaustive limit 20)."""
    zoo = store.DirStore(tmp_path_factory.mktemp("clustered") / "zoo")
    ids, docs, seen = {}, {}, set()
    seed = 0
    for k in range(64):
        base = "lm_2" if k >= 60 else ["resnet_111", "resnet_222", "cnn_3", "cnn_5"][k % 4]
        while True:  # every variant distinct, so that a twin's best match is unique
            seed += 1
            doc = widened(base_graphs[base], seed)
            if index.fingerprint(doc) not in seen:
                break
        seen.add(index.fingerprint(doc))
        record_id = f"{base.replace('_', '-')}-{k:02d}"
        write(zoo, record_id, base, doc)
        ids[record_id], docs[record_id] = base, doc
    # Stop only at an identical graph (similarity 1), and never for lack of budget.
    settings = index.IndexSettings(exhaustive_limit=20, clustered_pair_budget=None,
                                   early_exit_similarity=1.0)
    idx = index.ZooIndex(zoo, settings=settings)
    stats = idx.build_clusters(**BUILD)
    assert [s.models for s in stats] == [60, 4]  # (image, classification), (text, lm)
    yield ClusteredZoo(zoo, ids, docs, idx)
    idx.close()


def non_medoid_members(clusters: cluster.Clusters) -> list[tuple[int, str]]:
    return [(c, m) for c, members in enumerate(clusters.members) for m in members[1:]]


@pytest.mark.process  # `clustered_zoo` builds its clusters in a process pool
def test_clustered_search_finds_the_same_best_parent_as_exhaustive(
        clustered_zoo: ClusteredZoo) -> None:
    exhaustive = index.ZooIndex(clustered_zoo.store)
    image_clusters = clustered_zoo.index.clusters()[IMAGE]
    assert len(image_clusters.medoids) == 8  # round(sqrt(60))
    twins = [m for _, m in non_medoid_members(image_clusters)][::7]
    for record_id in twins:
        child = clustered_zoo.docs[record_id]
        clustered = clustered_zoo.index.query(child, modality="image")
        reference = exhaustive.query(child, modality="image")

        assert clustered.mode is index.SearchMode.CLUSTERED
        assert reference.mode is index.SearchMode.EXHAUSTIVE
        assert clustered.best is not None and reference.best is not None
        assert clustered.best.id == reference.best.id == record_id
        assert clustered.scored < reference.scored


@pytest.mark.process
def test_clustered_search_scores_the_members_of_the_best_medoids_cluster(
        clustered_zoo: ClusteredZoo) -> None:
    """Regression: ModelKeeper's query_best_mapping takes members from the cluster at the
    medoid's RANK instead of the medoid's own cluster."""
    image_clusters = clustered_zoo.index.clusters()[IMAGE]
    number, twin = next((c, m) for c, m in non_medoid_members(image_clusters) if c != 0)
    one_cluster = index.IndexSettings(exhaustive_limit=20, clustered_pair_budget=1,
                                      early_exit_similarity=2.0)
    idx = index.ZooIndex(clustered_zoo.store, settings=one_cluster)
    idx.build_clusters(**BUILD)
    assert idx.clusters()[IMAGE] == image_clusters

    result = idx.query(clustered_zoo.docs[twin], modality="image", top_k=None)

    assert result.clusters_visited == 1
    scored = {c.id for c in result.candidates}
    assert scored == set(image_clusters.medoids) | set(image_clusters.members[number])
    assert result.best is not None and (result.best.id, result.best.similarity) == (twin, 1.0)


@pytest.mark.process
def test_clustered_search_stops_early_at_a_close_enough_parent(
        clustered_zoo: ClusteredZoo) -> None:
    idx = index.ZooIndex(clustered_zoo.store, settings=index.IndexSettings(exhaustive_limit=20))
    idx.build_clusters(**BUILD)
    image_clusters = idx.clusters()[IMAGE]
    exhaustive = index.ZooIndex(clustered_zoo.store)

    early = 0
    for record_id in [m for _, m in non_medoid_members(image_clusters)][::3]:
        result = idx.query(clustered_zoo.docs[record_id], modality="image")
        reference = exhaustive.query(clustered_zoo.docs[record_id], modality="image")
        assert result.best is not None and reference.best is not None
        if result.best.id != reference.best.id:  # stopped at a parent close enough
            assert result.best.similarity >= index.EARLY_EXIT_SIMILARITY
            assert result.scored < reference.scored
            early += 1
    assert early > 0


@pytest.mark.process
def test_refresh_adds_a_new_model_to_its_nearest_medoids_cluster(
        clustered_zoo: ClusteredZoo, base_graphs: dict[str, dict[str, Any]]) -> None:
    idx = index.ZooIndex(clustered_zoo.store, settings=index.IndexSettings(exhaustive_limit=20))
    idx.build_clusters(**BUILD)
    newcomer = widened(base_graphs["cnn_5"], seed=999)
    write(clustered_zoo.store, "cnn-5-new", "cnn_5", newcomer)
    try:
        idx.refresh()
        clusters = idx.clusters()[IMAGE]
        home = next(c for c, members in enumerate(clusters.members) if "cnn-5-new" in members)
        medoid_scores = [match.similarity(graph.prepare(graph.from_json(clustered_zoo.docs[m])),
                                          graph.prepare(graph.from_json(newcomer)))
                         for m in clusters.medoids]
        assert home == int(np.argmax(medoid_scores))
        assert clusters.size == 61
    finally:
        records.delete_record(clustered_zoo.store, "cnn-5-new")


# ----------------------------------------------------------------------------------------------
# clusters the index builds and keeps itself (maintain_clusters), on zoos above a small limit

MAINTAINED = index.IndexSettings(exhaustive_limit=10, workers=0, maintain_clusters=True)


def run_now(work: Callable[[], None]) -> None:
    work()


class Deferred:
    """A spawn that keeps the background builder until the test runs it."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def __call__(self, work: Callable[[], None]) -> None:
        self.pending.append(work)

    def run(self) -> None:
        while self.pending:
            self.pending.pop(0)()


def write_variants(zoo: store.ObjectStore, base_graphs: dict[str, dict[str, Any]],
                   numbers: range) -> dict[str, dict[str, Any]]:
    """Distinct image-classifier variants `img-<n>` (bases in turn); their graphs by id."""
    docs = {}
    for n in numbers:
        base = ["resnet_111", "resnet_222", "cnn_3", "cnn_5"][n % 4]
        doc = widened(base_graphs[base], seed=10_000 + n)
        while any(index.fingerprint(doc) == index.fingerprint(d) for d in docs.values()):
            doc = widened(base_graphs[base], seed=random.randrange(10**6))
        record_id = f"img-{n:03d}"
        write(zoo, record_id, base, doc)
        docs[record_id] = doc
    return docs


def test_index_clusters_a_large_group_in_the_background_and_searches_exhaustively_until_then(
        tmp_path: Path, base_graphs: dict[str, dict[str, Any]]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    docs = write_variants(zoo, base_graphs, range(16))
    write(zoo, "lm", "lm_2", base_graphs["lm_2"])  # a group of one: never clustered
    spawn = Deferred()
    idx = index.ZooIndex(zoo, settings=MAINTAINED, spawn=spawn)
    twin = docs["img-005"]

    before = idx.query(twin, modality="image")
    assert before.mode is index.SearchMode.EXHAUSTIVE and idx.clusters() == {}
    spawn.run()

    clusters = idx.clusters()
    assert set(clusters) == {IMAGE}
    assert len(clusters[IMAGE].medoids) == 4 and clusters[IMAGE].size == 16  # round(sqrt(16))
    after = idx.query(twin, modality="image")
    assert after.mode is index.SearchMode.CLUSTERED
    assert after.best is not None and before.best is not None
    assert after.best.id == before.best.id == "img-005" and after.best.similarity == 1.0
    assert idx.query(base_graphs["lm_2"], modality="text").mode is index.SearchMode.EXHAUSTIVE


def test_maintained_clusters_find_the_exhaustive_best_parent_of_every_member(
        tmp_path: Path, base_graphs: dict[str, dict[str, Any]]) -> None:
    """A member's own graph is its best parent (similarity 1); the clustered search must visit
    that member's cluster first, as its medoid is the one it was assigned to."""
    zoo = store.DirStore(tmp_path / "zoo")
    docs = write_variants(zoo, base_graphs, range(16))
    idx = index.ZooIndex(zoo, settings=MAINTAINED, spawn=run_now)
    exhaustive = index.ZooIndex(zoo, settings=IN_PROCESS)
    for record_id in sorted(docs)[::3]:
        clustered = idx.query(docs[record_id], modality="image")
        reference = exhaustive.query(docs[record_id], modality="image")

        assert clustered.mode is index.SearchMode.CLUSTERED
        assert reference.mode is index.SearchMode.EXHAUSTIVE
        assert clustered.best is not None and reference.best is not None
        assert clustered.best.id == reference.best.id == record_id


def test_refresh_assigns_new_models_to_maintained_clusters_and_rebuilds_after_doubling(
        tmp_path: Path, base_graphs: dict[str, dict[str, Any]]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    write_variants(zoo, base_graphs, range(12))
    idx = index.ZooIndex(zoo, settings=MAINTAINED, spawn=run_now)
    built = idx.clusters()[IMAGE]
    assert (len(built.medoids), built.built_size) == (3, 12)  # round(sqrt(12))

    write_variants(zoo, base_graphs, range(12, 20))
    idx.refresh()
    grown = idx.clusters()[IMAGE]
    assert grown.medoids == built.medoids and grown.built_size == 12  # assigned, not rebuilt
    assert grown.size == 20 and {"img-012", "img-019"} <= set(grown.similarity_to_medoid)

    write_variants(zoo, base_graphs, range(20, 24))
    idx.refresh()
    rebuilt = idx.clusters()[IMAGE]
    assert (len(rebuilt.medoids), rebuilt.built_size, rebuilt.size) == (5, 24, 24)


def test_a_group_that_loses_a_medoid_is_clustered_again(
        tmp_path: Path, base_graphs: dict[str, dict[str, Any]]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    write_variants(zoo, base_graphs, range(13))
    idx = index.ZooIndex(zoo, settings=MAINTAINED, spawn=run_now)
    medoid = idx.clusters()[IMAGE].medoids[0]
    member = non_medoid_members(idx.clusters()[IMAGE])[-1][1]

    records.delete_record(zoo, member)
    idx.refresh()
    assert idx.clusters()[IMAGE].built_size == 13  # a member left: nothing to rebuild
    records.delete_record(zoo, medoid)
    idx.refresh()

    clusters = idx.clusters()[IMAGE]
    assert clusters.built_size == 11 and clusters.size == 11
    assert medoid not in clusters.similarity_to_medoid


def test_a_build_past_its_time_budget_is_abandoned_until_the_group_grows(
        tmp_path: Path, base_graphs: dict[str, dict[str, Any]],
        caplog: pytest.LogCaptureFixture) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    write_variants(zoo, base_graphs, range(12))
    clock = FakeClock()
    calls = 0

    def slow(parent: graph.Prepared, child: graph.Prepared) -> float:
        nonlocal calls
        calls += 1
        clock.now += 1.0  # every pair takes a second
        return match.similarity(parent, child)

    budget = dataclasses.replace(MAINTAINED, cluster_build_seconds=50.0)
    with caplog.at_level("WARNING", logger="kiln.warmstart.index"):
        idx = index.ZooIndex(zoo, settings=budget, scorer=slow, clock=clock, spawn=run_now)
    assert idx.clusters() == {}
    assert "abandoned" in caplog.text and "cluster_build_seconds" in caplog.text
    assert calls == 50  # 144 pairs needed

    write_variants(zoo, base_graphs, range(12, 14))
    idx.refresh()  # grown, but not twofold: no second attempt
    assert calls == 50 and idx.clusters() == {}
    result = idx.query(base_graphs["cnn_3"], modality="image", timeout_seconds=1e6)
    assert result.mode is index.SearchMode.EXHAUSTIVE and result.scored == 14


def test_close_stops_background_cluster_builds(
        tmp_path: Path, base_graphs: dict[str, dict[str, Any]]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    write_variants(zoo, base_graphs, range(12))
    counting = CountingScorer()
    spawn = Deferred()
    idx = index.ZooIndex(zoo, settings=MAINTAINED, scorer=counting, spawn=spawn)

    idx.close()
    spawn.run()
    write_variants(zoo, base_graphs, range(12, 30))
    idx.refresh()

    assert counting.calls == 0 and idx.clusters() == {} and spawn.pending == []


def test_an_index_made_for_one_query_never_clusters(
        tmp_path: Path, base_graphs: dict[str, dict[str, Any]]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    write_variants(zoo, base_graphs, range(12))
    spawn = Deferred()
    idx = index.ZooIndex(zoo, settings=dataclasses.replace(MAINTAINED, maintain_clusters=False),
                         spawn=spawn)

    result = idx.query(base_graphs["cnn_3"], modality="image")

    assert spawn.pending == [] and idx.clusters() == {}
    assert result.mode is index.SearchMode.EXHAUSTIVE and result.scored == 12


# ----------------------------------------------------------------------------------------------
# kiln.warmstart.clusters and kiln.warmstart.scoring on their own


def test_k_medoids_separates_two_obvious_groups_with_the_medoid_as_parent() -> None:
    # Points 0-2 are close to each other, 3-5 too; d is asymmetric (row = parent).
    d = np.full((6, 6), 0.9)
    d[:3, :3] = 0.1
    d[3:, 3:] = 0.2
    d[1, :3] = 0.05  # point 1 is the best parent of its group
    np.fill_diagonal(d, 0.0)

    partition = cluster.k_medoids(d, 2, restarts=5, rng=np.random.default_rng(0))

    assert sorted(partition.labels[:3]) == [partition.labels[0]] * 3
    assert sorted(partition.labels[3:]) == [partition.labels[3]] * 3
    assert partition.labels[0] != partition.labels[3]
    assert 1 in partition.medoids
    assert partition.max_diameter == pytest.approx(0.2)


def test_cluster_search_takes_members_from_the_ranked_medoids_own_cluster() -> None:
    clusters = {IMAGE: cluster.Clusters(
        medoids=["a", "b", "c"], members=[["a", "a1"], ["b", "b1"], ["c", "c1"]],
        similarity_to_medoid={}, max_diameter=0.0, built_size=6)}
    similarity = {"a": 0.1, "b": 0.2, "c": 0.8, "a1": 0.1, "b1": 0.2, "c1": 0.9}
    scores: dict[str, float] = {}
    calls: list[list[str]] = []

    def score(ids: Any) -> bool:
        calls.append(list(ids))
        scores.update({i: similarity[i] for i in ids})
        return True

    visited = cluster.search(clusters, set(similarity), scores, score,
                             early_exit_similarity=0.95, pair_budget=4)

    assert calls == [["a", "b", "c"], ["c", "c1"]]  # the published code would scan ["a", "a1"]
    assert visited == 1


@pytest.mark.parametrize("shape", [(1, 1), (100, 1), (3, 250), (240, 240), (7, 9000)])
def test_pool_tasks_cover_the_grid_exactly_once(shape: tuple[int, int]) -> None:
    covered = np.zeros(shape, dtype=int)
    for rows, cols in scoring.tasks(*shape, workers=2):
        covered[rows, cols] += 1
        assert covered[rows, cols].size <= max(scoring.PAIRS_PER_TASK, max(shape))
    assert (covered == 1).all()


def test_query_rejects_a_bad_top_k_or_timeout(small_zoo: store.DirStore,
                                              base_graphs: dict[str, dict[str, Any]]) -> None:
    idx = index.ZooIndex(small_zoo, settings=IN_PROCESS)
    bad: list[Callable[[], object]] = [
        lambda: idx.query(base_graphs["cnn_3"], top_k=0),
        lambda: idx.query(base_graphs["cnn_3"], timeout_seconds=0.0)]
    for call in bad:
        with pytest.raises(ValueError):
            call()
    with pytest.raises(graph.GraphError):
        idx.query({"schema_version": 1, "nodes": []})
