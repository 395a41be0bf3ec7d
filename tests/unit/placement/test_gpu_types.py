"""Heterogeneous GPU types: per-type configs, placement on the type a job gains most from."""

from __future__ import annotations

import pytest

from kiln import api
from kiln.controller import cluster
from kiln.placement import estimate, planner, simulate, types

FAST, SLOW = "cuda:NVIDIA-H100-80GB-HBM3", "cuda:Tesla-T4"
NODES = (types.Node("fast", 4, FAST), types.Node("slow", 4, SLOW))
HEURISTIC = types.Settings(use_milp=False, objective="makespan")


def _job(name: str, fast: float, slow: float) -> types.JobRequest:
    return types.JobRequest(name, (types.Config("ddp", 4, fast, device_type=FAST),
                                   types.Config("ddp", 4, slow, device_type=SLOW)))


def test_candidates_keep_each_types_configs() -> None:
    job = types.JobRequest("j", (types.Config("single", 1, 100.0, device_type=FAST),
                                 types.Config("ddp", 2, 60.0, device_type=FAST),
                                 types.Config("single", 1, 400.0, device_type=SLOW),
                                 types.Config("ddp", 2, 500.0, device_type=SLOW)))
    kept = types.candidates(job)
    assert [(c.device_type, c.gpus) for c in kept] == [(FAST, 1), (SLOW, 1), (FAST, 2)]


def test_a_typed_config_fits_only_its_type() -> None:
    config = types.Config("single", 1, 10.0, device_type=FAST)
    assert types.fits(config, NODES[0])
    assert not types.fits(config, NODES[1])
    assert types.fits(types.Config("single", 1, 10.0), NODES[1])  # untyped: anywhere


@pytest.mark.parametrize("settings", [
    HEURISTIC, pytest.param(types.Settings(objective="makespan"), marks=pytest.mark.process)])
def test_the_job_that_gains_most_gets_the_fast_type(settings: types.Settings) -> None:
    gains_much, gains_little = _job("big", 100.0, 1000.0), _job("small", 500.0, 550.0)
    plan = planner.plan(types.Snapshot(0.0, NODES, (gains_much, gains_little)), settings)
    assert plan.for_job("big") is not None and plan.for_job("big").node == "fast"  # type: ignore[union-attr]
    assert plan.for_job("small") is not None and plan.for_job("small").node == "slow"  # type: ignore[union-attr]
    assert plan.makespan == pytest.approx(550.0)


def test_a_job_estimated_for_no_present_type_is_unplaceable() -> None:
    job = types.JobRequest("j", (types.Config("single", 1, 10.0, device_type="cuda:B200"),))
    problems = types.unplaceable_reasons(types.Snapshot(0.0, NODES, (job,)))
    assert "GPU type" in problems["j"]


def test_simulator_runs_true_durations_of_the_node_type() -> None:
    jobs = [simulate.SimJob("big", _job("big", 100.0, 1000.0).configs),
            simulate.SimJob("small", _job("small", 500.0, 550.0).configs),
            simulate.SimJob("late", _job("late", 50.0, 60.0).configs, arrival=10.0)]
    result = simulate.run(jobs, NODES, simulate.kiln_policy(HEURISTIC, replanning=True))
    by_name = {r.name: r for r in result.jobs}
    assert by_name["big"].node == "fast"
    assert by_name["big"].end - by_name["big"].start == pytest.approx(100.0)
    for record in by_name.values():  # each ran as long as its node's type takes
        fast = {"big": 100.0, "small": 500.0, "late": 50.0}[record.name]
        slow = {"big": 1000.0, "small": 550.0, "late": 60.0}[record.name]
        took = record.end - record.start
        assert took == pytest.approx(fast if record.node == "fast" else slow)


def test_device_models_scale_by_gpu_product() -> None:
    h100, generic = estimate.device_model(FAST), estimate.device_model("cuda")
    assert h100.flops_per_second > 3 * generic.flops_per_second
    assert h100.memory_bytes == 80 * 2**30
    assert estimate.device_model("cuda:Some-New-GPU") == generic
    assert estimate.gpu_device_type("NVIDIA H100 80GB HBM3") == FAST


def test_a_measured_step_scales_to_another_product_until_measured_there() -> None:
    measured = estimate.ModelMeasurement(parameters=10, flops_per_sample=None,
                                         device_type="cuda:NVIDIA A100-SXM4-40GB",
                                         batch_size=32, step_seconds=0.32)
    assert measured.step_on("cuda:NVIDIA-A100-SXM4-40GB", 32) == pytest.approx(0.32)
    assert measured.step_on(FAST, 32) == pytest.approx(0.1)
    assert measured.measured_on("cuda:NVIDIA-A100-SXM4-40GB")
    assert not measured.measured_on(FAST)


def _seconds(architecture: str, shape: list[int], device_type: str) -> float:
    job = api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
        "spec": {"model": {"architecture": architecture, "args": {}, "inputShape": shape},
                 "training": {"epochs": 1, "batchSize": 64}, "resources": {"gpus": 1}}})
    return estimate.configs(job, zoo=None, profile_cache=None, max_gpus=1,
                            device_type=device_type)[0].seconds - \
        estimate.device_model(device_type).startup_seconds


def test_a_large_model_gains_more_from_the_fast_type_than_a_tiny_one() -> None:
    def gain(architecture: str, shape: list[int]) -> float:
        return _seconds(architecture, shape, SLOW) / _seconds(architecture, shape, FAST)
    assert gain("resnet18", [3, 32, 32]) > 2 * gain("small_cnn", [1, 8, 8])


def test_cluster_reads_the_gpu_type_label() -> None:
    def node(name: str, product: str | None) -> dict[str, object]:
        labels = {"nvidia.com/gpu.product": product} if product else {}
        return {"metadata": {"name": name, "labels": labels},
                "status": {"allocatable": {"nvidia.com/gpu": "4"},
                           "conditions": [{"type": "Ready", "status": "True"}]}}
    pools = cluster.pools([node("a", "NVIDIA-H100-80GB-HBM3"), node("b", None)], [],
                          cpu_slots=1, now=0.0)
    assert pools.nodes[cluster.GPU_POOL] == (types.Node("a", 4, FAST), types.Node("b", 4, ""))
