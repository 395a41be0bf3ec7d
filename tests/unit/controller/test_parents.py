"""kiln.controller.parents: the warm-start decision survives its trip through status."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kiln import api, models
from kiln.controller import metrics, parents
from kiln.warmstart import decision, graph, select
from kiln.zoo import records, store

WARM = api.WarmStartDecision(
    parent="small_cnn-1234abcd", similarity=0.75, parent_metric=0.9,
    metric_name="validation_accuracy", matched_tensors=4, total_tensors=5,
    reason="warm start from it; 4 of 5", candidates_considered=3,
    outcome=api.WarmStartOutcome.PINNED, alternatives=("small_cnn-5678abcd",))


@pytest.mark.parametrize("decided", [
    pytest.param(WARM, id="warm"),
    pytest.param(select.cold_start(api.WarmStartOutcome.COLD_FEW_TENSORS, "cold start: 0 of 5"),
                 id="cold"),
])
def test_a_decision_reads_back_from_status_as_the_trainer_needs_it(
    decided: api.WarmStartDecision,
) -> None:
    wire = api.to_wire(decided)  # status.warmStart: the same type, by alias
    problems = api.check_schema({"apiVersion": api.API_VERSION, "kind": api.KIND,
                                 "metadata": {"name": "j"}, "spec": {},
                                 "status": {"warmStart": wire}})
    assert [p for p in problems if p.startswith("status")] == []  # the CRD declares it all
    assert api.TrainingJobStatus.model_validate({"warmStart": wire}).warm_start == decided
    if decided.parent is not None:
        assert (wire["parentMetric"], wire["candidatesConsidered"]) == (0.9, 3)


def test_a_status_without_outcome_reads_as_warm_or_cold_by_its_parent() -> None:
    older = api.WarmStartDecision.model_validate({"parent": "p-1", "similarity": 0.8,
                                                  "reason": "r"})
    assert older.outcome == api.WarmStartOutcome.WARM and not older.cold_start
    cold = api.WarmStartDecision.model_validate({"similarity": 0.1, "reason": "cold start: r"})
    assert cold.outcome == api.WarmStartOutcome.COLD_EMPTY and cold.cold_start
    assert api.WarmStartDecision.model_validate({}).cold_start


@pytest.mark.parametrize(("wire", "field"), [
    pytest.param({"parent": 7, "outcome": "warm"}, "parent", id="number-as-id"),
    pytest.param({"similarity": "0.5", "outcome": "warm"}, "similarity", id="text-as-number"),
    pytest.param({"similarity": 1.5, "outcome": "warm"}, "similarity", id="beyond-1"),
    pytest.param({"matchedTensors": True, "outcome": "warm"}, "matchedTensors", id="bool"),
    pytest.param({"alternatives": [1], "outcome": "warm"}, "alternatives", id="id-as-number"),
    pytest.param({"outcome": "lukewarm"}, "outcome", id="unknown-outcome"),
])
def test_a_malformed_decision_is_refused_naming_the_field(wire: dict[str, Any],
                                                          field: str) -> None:
    with pytest.raises(ValueError, match=f"warm-start decision: {field}"):
        select.from_report(wire)


def test_the_operator_leaves_an_entrypoint_models_decision_to_the_trainer(
        tmp_path: Path) -> None:
    job = api.parse_job({"apiVersion": api.API_VERSION, "kind": api.KIND,
                         "metadata": {"name": "own"},
                         "spec": {"model": {"entrypoint": "not_importable_here:build",
                                            "inputShape": [1, 8, 8]}}})
    chooser = parents.ParentChooser(store.DirStore(tmp_path), metrics=metrics.OperatorMetrics(),
                                    refresh_seconds=60.0, query_timeout_seconds=5.0)
    decided = asyncio.run(chooser.decide(job))
    assert (decided.outcome, decided.parent) == (api.WarmStartOutcome.IN_TRAINER, None)
    assert "made in the trainer pod, before its first step" in decided.reason


@pytest.mark.process
def test_warming_up_starts_one_graph_worker_once_the_zoo_has_a_model(tmp_path: Path) -> None:
    chooser = parents.ParentChooser(store.DirStore(tmp_path / "zoo"),
                                    metrics=metrics.OperatorMetrics(), refresh_seconds=0.0,
                                    query_timeout_seconds=5.0)
    try:
        chooser.warm_up().result(timeout=parents.WORKER_START_SECONDS)
        assert not any(w.alive() for w in chooser._workers)  # nothing to search: no tracing
        _zoo_with_one_parent(tmp_path)
        warming = chooser.warm_up()  # each new job calls it: one worker, once
        assert chooser.warm_up() is warming
        warming.result(timeout=parents.WORKER_START_SECONDS)
        assert [w.alive() for w in chooser._workers].count(True) == 1
        assert chooser.warm_up() is warming
    finally:
        chooser.close()


def test_the_trainers_own_decision_reads_back_for_status() -> None:
    report = {"parent": "mixer-1a2b3c4d", "similarity": 0.49, "parent_metric": 0.9,
              "matched_tensors": 30, "total_tensors": 54, "outcome": "warm",
              "reason": "warm start from mixer-1a2b3c4d"}
    decided = select.from_report(report)
    assert decided is not None
    assert api.to_wire(decided) == {
        "parent": "mixer-1a2b3c4d", "similarity": 0.49, "parentMetric": 0.9,
        "matchedTensors": 30, "totalTensors": 54, "reason": "warm start from mixer-1a2b3c4d",
        "outcome": "warm", "candidatesConsidered": 0, "droppedIncompatible": 0,
        "droppedOutliers": 0, "alternatives": []}
    assert select.from_report({"outcome": "in_trainer"}) is None
    assert select.from_report({}) is None


class _DownStore:
    """A zoo whose every call fails as an unreachable store does."""

    calls = 0

    def _down(self, *_: Any) -> Any:
        _DownStore.calls += 1
        raise store.StoreUnavailable("the zoo is down")

    put_bytes = get_bytes = list_keys = delete = exists = describe = _down


def _job(architecture: str, args: dict[str, Any], *, enabled: bool = True) -> api.TrainingJob:
    return api.parse_job({"apiVersion": api.API_VERSION, "kind": api.KIND,
                          "metadata": {"name": "child"},
                          "spec": {"model": {"architecture": architecture, "args": args,
                                             "inputShape": [1, 8, 8]},
                                   "warmStart": {"enabled": enabled}}})


def _zoo_with_one_parent(tmp_path: Path) -> store.DirStore:
    zoo = store.DirStore(tmp_path / "zoo")
    spec = _job("small_cnn", {"depth": 3, "width": 8}).spec
    model = models.build(spec.model)
    record = records.ZooRecord(
        id=records.new_id("small_cnn"), architecture="small_cnn", args=dict(spec.model.args),
        input_shape=(1, 8, 8), modality="image", task="classification", dataset="digits",
        metric_name="validation_accuracy", metric_value=0.9, validation_accuracy=0.9,
        validation_loss=0.1, samples_per_second=100.0,
        num_params=sum(p.numel() for p in model.parameters()),
        created_time="2026-11-30T00:00:00Z", job_name="parent", job_spec=api.to_wire(spec),
        parent=None, similarity=None, weights_sha256="")
    records.write_record(zoo, record, model.state_dict(),
                         graph.to_json(decision.model_graph(spec.model)))
    return zoo


def test_a_job_with_warm_start_disabled_never_touches_the_zoo() -> None:
    chooser = parents.ParentChooser(_DownStore(), metrics=metrics.OperatorMetrics(),  # type: ignore[arg-type]
                                    refresh_seconds=0.0, query_timeout_seconds=5.0)
    try:
        job = _job("small_cnn", {}, enabled=False)
        decided = asyncio.run(chooser.decide(job))
        assert decided.outcome == api.WarmStartOutcome.DISABLED
        assert chooser.decide_now(job).outcome == api.WarmStartOutcome.DISABLED
        assert _DownStore.calls == 0
    finally:
        chooser.close()


@pytest.mark.process
def test_a_model_too_slow_to_trace_cold_starts_without_holding_other_decisions(
        tmp_path: Path) -> None:
    chooser = parents.ParentChooser(_zoo_with_one_parent(tmp_path),
                                    metrics=metrics.OperatorMetrics(), refresh_seconds=600.0,
                                    query_timeout_seconds=30.0, graph_timeout_seconds=1.0)
    ordinary = _job("small_cnn", {"depth": 3, "width": 8})
    # 12 s of CPU to trace here: past the 1 s deadline on a machine many times faster
    slow = _job("vit", {"depth": 1000, "width": 8, "heads": 1})

    async def scenario() -> tuple[api.WarmStartDecision, api.WarmStartDecision, bool,
                                  api.WarmStartDecision]:
        first = await chooser.decide(ordinary)  # cached from now on
        slow_task = asyncio.create_task(chooser.decide(slow))
        await asyncio.sleep(0)
        again = await chooser.decide(ordinary)
        overtaken = not slow_task.done()
        return first, again, overtaken, await slow_task

    try:
        first, again, overtaken, slow_decided = asyncio.run(scenario())
        assert first.parent is not None and again == first
        assert overtaken  # the cached decision did not wait for the slow one
        assert slow_decided.outcome == api.WarmStartOutcome.COLD_UNTRACEABLE
        assert "tracing its graph took longer than 1 s" in slow_decided.reason
        # The killed worker is replaced: a new model is traced and matched as usual.
        deeper = chooser.decide_now(_job("small_cnn", {"depth": 4, "width": 8}))
        assert deeper.parent == first.parent
    finally:
        chooser.close()


# ----------------------------------------------------------------------------------------------
# what warm starts saved, per namespace


def _trained(record_id: str, train_seconds: float | None) -> records.ZooRecord:
    return records.ZooRecord(
        id=records.ZooModelId(record_id), architecture="small_cnn", args={},
        input_shape=(1, 8, 8), modality="image", task="classification", dataset="digits",
        metric_name="validation_accuracy", metric_value=0.9, num_params=10,
        created_time="2026-12-01T00:00:00Z", job_name="parent", job_spec={},
        train_seconds=train_seconds)


def test_a_warm_start_saves_its_parents_training_in_the_share_transferred() -> None:
    known = [_trained("small_cnn-1234abcd", 600.0), _trained("imported-00000000", None)]
    assert parents.seconds_saved(known, WARM) == pytest.approx(480.0)  # 4 of 5 tensors
    for other in ("imported-00000000", "gone-00000000"):
        assert parents.seconds_saved(known, WARM.model_copy(update={"parent": other})) == 0.0
    cold = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "cold start: empty")
    assert parents.seconds_saved(known, cold) == parents.seconds_saved(known, None) == 0.0


def test_savings_add_up_per_namespace_in_the_operators_metric() -> None:
    reporter = metrics.OperatorMetrics()
    reporter.count_seconds_saved("team-a", 480.0)
    reporter.count_seconds_saved("team-a", 20.0)
    reporter.count_seconds_saved("team-b", 0.0)
    text = reporter.exposition().decode()
    assert 'kiln_zoo_warm_start_seconds_saved_total{job_namespace="team-a"} 500.0' in text
    assert 'kiln_zoo_warm_start_seconds_saved_total{job_namespace="team-b"} 0.0' in text


@pytest.mark.process
def test_a_graph_worker_that_dies_while_starting_is_a_graph_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    # The spawned process runs os.abort(conn): a TypeError before it ever says "ready".
    monkeypatch.setattr(parents, "_serve_graphs", os.abort)
    worker = parents._GraphWorker()
    with pytest.raises(graph.GraphError, match=r"died while starting \(exit code"):
        worker.start()
    assert not worker.alive()
