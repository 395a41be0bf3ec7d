"""Tests for kiln.placement.types: config validation, candidate reduction, plan lookups."""

from __future__ import annotations

import math

import pytest

from kiln.placement import types


def _job(*configs: tuple[str, int, float]) -> types.JobRequest:
    return types.JobRequest("j", tuple(types.Config(p, k, s) for p, k, s in configs))


def test_candidates_keep_the_fastest_parallelism_per_gpu_count() -> None:
    job = _job(("ddp", 4, 30.0), ("fsdp", 4, 25.0), ("single", 1, 100.0))
    assert [(c.parallelism, c.gpus) for c in types.candidates(job)] == [
        ("single", 1), ("fsdp", 4)]


def test_candidates_drop_a_larger_gpu_count_that_is_no_faster() -> None:
    job = _job(("single", 1, 100.0), ("ddp", 2, 60.0), ("ddp", 4, 60.0), ("ddp", 8, 70.0))
    assert [c.gpus for c in types.candidates(job)] == [1, 2]


def test_candidates_drop_infeasible_configs() -> None:
    job = _job(("single", 1, math.inf), ("ddp", 2, 60.0))
    assert [c.gpus for c in types.candidates(job)] == [2]


@pytest.mark.parametrize(("gpus", "seconds"), [
    pytest.param(0, 1.0, id="no-gpus"),
    pytest.param(1, 0.0, id="zero-seconds"),
    pytest.param(1, math.nan, id="nan-seconds"),
])
def test_config_rejects_impossible_values(gpus: int, seconds: float) -> None:
    with pytest.raises(ValueError, match="Config"):
        types.Config("single", gpus, seconds)


def test_a_plan_finds_each_jobs_assignment() -> None:
    a = types.Assignment("a", "n1", 2, "ddp", 10.0, 5.0)
    c = types.Assignment("c", "n2", 1, "single", 3.0, 5.0)
    plan = types.Plan((a, c), 15.0, "heuristic")
    assert plan.for_job("c") == c
    assert plan.for_job("missing") is None
    assert a.end == 15.0


def test_unplaceable_names_each_job_and_why() -> None:
    snapshot = types.Snapshot(0.0, (types.Node("n", 4),), (
        types.JobRequest("big", (types.Config("ddp", 8, 10.0),)),
        types.JobRequest("none", (types.Config("ddp", 2, math.inf),)),
        types.JobRequest("ok", (types.Config("ddp", 2, 1.0),))))
    reasons = types.unplaceable_reasons(snapshot)
    assert set(reasons) == {"big", "none"}
    assert "needs 8 devices but the largest node has 4" in reasons["big"]
    err = types.Unplaceable(reasons)
    assert err.jobs == ("big", "none")
    assert "job big" in str(err) and isinstance(err, ValueError)


def test_a_gpu_job_on_cpu_only_nodes_is_told_no_node_has_gpus() -> None:
    snapshot = types.Snapshot(0.0, (types.Node("cpu-1", 8),), (
        types.JobRequest("four", (), asked_gpus=4),
        types.JobRequest("cpu", (types.Config("single", 1, 5.0),), asked_gpus=0)), device="cpu")
    reasons = types.unplaceable_reasons(snapshot)
    assert set(reasons) == {"four"}
    assert reasons["four"].startswith("asks for 4 GPUs; no node has GPUs")
    assert "spec.resources.gpus: 0" in reasons["four"]


def test_a_job_asking_more_gpus_than_any_node_has_is_told_both_counts() -> None:
    snapshot = types.Snapshot(0.0, (types.Node("n", 2),),
                              (types.JobRequest("big", (), asked_gpus=8),))
    assert types.unplaceable_reasons(snapshot)["big"].startswith(
        "asks for 8 GPUs; the largest node has 2")


def test_a_job_with_no_feasible_config_is_told_what_to_change() -> None:
    snapshot = types.Snapshot(0.0, (types.Node("n", 4),), (
        types.JobRequest("none", (types.Config("ddp", 2, math.inf),)),))
    why = types.unplaceable_reasons(snapshot)["none"]
    assert "infinite" not in why and "at most 4 devices" in why and "smaller model" in why
