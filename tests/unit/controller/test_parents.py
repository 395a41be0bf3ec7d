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

WARM = select.Decision(parent_id="small_cnn-1234abcd", similarity=0.75, parent_metric=0.9,
                       matched_tensors=4, total_tensors=5, reason="warm start from it; 4 of 5",
                       candidates_considered=3, outcome=select.Outcome.PINNED)


@pytest.mark.parametrize("decided", [
    pytest.param(WARM, id="warm"),
    pytest.param(select.cold_start(select.Outcome.COLD_FEW_TENSORS, "cold start: 0 of 5"),
                 id="cold"),
])
def test_a_decision_reads_back_from_status_as_the_trainer_needs_it(
    decided: select.Decision,
) -> None:
    wire = parents.to_status(decided)
    api.WarmStartStatus.model_validate(wire)  # every field is declared in the CRD
    back = parents.from_status(wire)
    for field in ("parent_id", "similarity", "parent_metric", "matched_tensors",
                  "total_tensors", "reason", "outcome"):
        assert getattr(back, field) == getattr(decided, field)


def test_a_status_without_outcome_reads_as_warm_or_cold_by_its_parent() -> None:
    assert parents.from_status({"parent": "p-1", "reason": "r"}).outcome == select.Outcome.WARM
    assert parents.from_status(None).cold_start


def test_the_operator_leaves_an_entrypoint_models_decision_to_the_trainer(
        tmp_path: Path) -> None:
    job = api.parse_job({"apiVersion": api.API_VERSION, "kind": api.KIND,
                         "metadata": {"name": "own"},
                         "spec": {"model": {"entrypoint": "not_importable_here:build",
                                            "inputShape": [1, 8, 8]}}})
    chooser = parents.ParentChooser(store.DirStore(tmp_path), metrics=metrics.OperatorMetrics(),
                                    refresh_seconds=60.0, query_timeout_seconds=5.0)
    decided = asyncio.run(chooser.decide(job))
    assert (decided.outcome, decided.parent_id) == (select.Outcome.IN_TRAINER, None)
    assert "made in the trainer pod, before its first step" in decided.reason


@pytest.mark.process
def test_warming_up_starts_one_graph_worker_before_any_decision(tmp_path: Path) -> None:
    chooser = parents.ParentChooser(store.DirStore(tmp_path), metrics=metrics.OperatorMetrics(),
                                    refresh_seconds=60.0, query_timeout_seconds=5.0)
    try:
        chooser.warm_up().result(timeout=parents.WORKER_START_SECONDS)
        assert [w.alive() for w in chooser._workers].count(True) == 1
    finally:
        chooser.close()


def test_the_trainers_own_decision_reads_back_for_status() -> None:
    report = {"parent": "mixer-1a2b3c4d", "similarity": 0.49, "parent_metric": 0.9,
              "matched_tensors": 30, "total_tensors": 54, "outcome": "warm",
              "reason": "warm start from mixer-1a2b3c4d"}
    decided = select.from_report(report)
    assert decided is not None
    assert parents.to_status(decided) == {
        "parent": "mixer-1a2b3c4d", "similarity": 0.49, "parentMetric": 0.9,
        "matchedTensors": 30, "totalTensors": 54, "reason": "warm start from mixer-1a2b3c4d",
        "outcome": "warm"}
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
        assert decided.outcome == select.Outcome.DISABLED
        assert chooser.decide_now(job).outcome == select.Outcome.DISABLED
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

    async def scenario() -> tuple[select.Decision, select.Decision, bool, select.Decision]:
        first = await chooser.decide(ordinary)  # cached from now on
        slow_task = asyncio.create_task(chooser.decide(slow))
        await asyncio.sleep(0)
        again = await chooser.decide(ordinary)
        overtaken = not slow_task.done()
        return first, again, overtaken, await slow_task

    try:
        first, again, overtaken, slow_decided = asyncio.run(scenario())
        assert first.parent_id is not None and again == first
        assert overtaken  # the cached decision did not wait for the slow one
        assert slow_decided.outcome == select.Outcome.COLD_UNTRACEABLE
        assert "tracing its graph took longer than 1 s" in slow_decided.reason
        # The killed worker is replaced: a new model is traced and matched as usual.
        deeper = chooser.decide_now(_job("small_cnn", {"depth": 4, "width": 8}))
        assert deeper.parent_id == first.parent_id
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
    warm = parents.to_status(WARM)  # 4 of 5 tensors from small_cnn-1234abcd
    assert parents.seconds_saved(known, warm) == pytest.approx(480.0)
    assert parents.seconds_saved(known, {**warm, "parent": "imported-00000000"}) == 0.0
    assert parents.seconds_saved(known, {**warm, "parent": "gone-00000000"}) == 0.0
    cold = parents.to_status(select.cold_start(select.Outcome.COLD_EMPTY, "cold start: empty"))
    assert parents.seconds_saved(known, cold) == parents.seconds_saved(known, None) == 0.0


def test_savings_add_up_per_namespace_in_the_operators_metric() -> None:
    reporter = metrics.OperatorMetrics()
    reporter.count_seconds_saved("team-a", 480.0)
    reporter.count_seconds_saved("team-a", 20.0)
    reporter.count_seconds_saved("team-b", 0.0)
    text = reporter.exposition().decode()
    assert 'kiln_zoo_warm_start_seconds_saved_total{job_namespace="team-a"} 500.0' in text
    assert 'kiln_zoo_warm_start_seconds_saved_total{job_namespace="team-b"} 0.0' in text
