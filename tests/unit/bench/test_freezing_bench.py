"""bench/freezing.py: the fixed schedule matches Kiln's savings, and the summary's arithmetic.

Synthetic arm records stand in for training runs; nothing trains here.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def bench(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("freezing")


def _mean_skipped(schedule: list[tuple[int, int]], fractions: list[float], total: int) -> float:
    """The backward share a run on `schedule` skips, step by step as the Freezer counts it."""
    boundary, skipped = 0, 0.0
    for step in range(1, total + 1):
        skipped += fractions[boundary]  # the step runs with the boundary set before it
        boundary = max([boundary] + [k for s, k in schedule if s == step])
    return skipped / total


# a ResNet-20's measured shares with k = 0..8 blocks frozen, as one run of the benchmark had them
RESNET20 = [0.0, 0.0036, 0.1201, 0.2365, 0.353, 0.4436, 0.56, 0.6765, 0.7671]


@pytest.mark.parametrize(("fractions", "target", "total"), [
    ([0.0, 0.1, 0.3, 0.6], 0.05, 2000), ([0.0, 0.1, 0.3, 0.6], 0.2, 2000),
    ([0.0, 0.1, 0.3, 0.6], 0.45, 2000),
    (RESNET20, 0.4529, 640),  # Kiln froze 6 blocks at once there: beyond an evenly spread span
])
def test_fixed_schedule_skips_the_kiln_arms_share(bench: ModuleType, fractions: list[float],
                                                  target: float, total: int) -> None:
    t0, schedule = bench.fixed_schedule(fractions, target, total)
    steps = [s for s, _ in schedule]
    assert [k for _, k in schedule] == list(range(1, len(schedule) + 1))
    assert steps == sorted(steps) and steps[0] == round(t0 * total)
    assert _mean_skipped(schedule, fractions, total) == pytest.approx(target, abs=0.005)


def test_fixed_schedule_freezes_nothing_when_kiln_did_not(bench: ModuleType) -> None:
    assert bench.fixed_schedule([0.0, 0.2, 0.5], 0.0, 1000) == (1.0, [])
    assert bench.fixed_schedule([0.0], 0.3, 1000) == (1.0, [])


def test_fixed_schedule_caps_at_freezing_from_the_start(bench: ModuleType) -> None:
    t0, schedule = bench.fixed_schedule([0.0, 0.5], 0.9, 1000)
    assert t0 == pytest.approx(0.0, abs=1e-6)
    assert schedule == [(1, 1)]


def test_eval_steps_are_dense_after_the_first_decay(bench: ModuleType) -> None:
    steps = bench.eval_steps(2240, (4, 24))
    assert steps == sorted(set(steps)) and steps[-1] == 2240
    assert [s for s in steps if s < 1120] == [280, 560, 840]
    assert len([s for s in steps if s >= 1120]) == 25


def _arm(points: list[tuple[int, float, float, float]], *, skipped: float = 0.0,
         events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An arm record: (step, wall seconds, CPU seconds, accuracy) per evaluation."""
    return {"curve": [{"step": s, "seconds": w, "cpu_seconds": c, "accuracy": a,
                       "skipped": skipped, "frozen": 0} for s, w, c, a in points],
            "freezing": {"backward_flops_skipped": skipped}, "events": events or [],
            "train_seconds": points[-1][1], "train_cpu_seconds": points[-1][2],
            "reference_cpu_seconds": 1.0, "forward_flops": 1.0, "backward_flops": 2.0,
            "first_freeze_fraction": 0.5}


def _run(kiln_final: float, fixed_final: float) -> dict[str, Any]:
    return {"total_steps": 100, "budget_decisions": 20.0, "arms": {
        "full": _arm([(50, 50.0, 50.0, 0.80), (90, 90.0, 90.0, 0.9195), (100, 100.0, 100.0, 0.92)]),
        "kiln": _arm([(50, 40.0, 45.0, 0.80), (90, 60.0, 70.0, 0.9195),
                      (100, 70.0, 80.0, kiln_final)], skipped=0.25,
                     events=[{"kind": "froze", "step": 30, "boundary": 1}]),
        "fixed": _arm([(50, 40.0, 45.0, 0.80), (90, 60.0, 70.0, 0.90),
                       (100, 70.0, 80.0, fixed_final)], skipped=0.25)}}


def test_summary_ratios_target_and_verdicts(bench: ModuleType) -> None:
    case = bench.Case("c", "small_resnet", {}, [1, 28, 28], {}, {}, epochs=4)
    runs = {"c": {0: _run(0.921, 0.915), 1: _run(0.9185, 0.914), 2: _run(0.92, 0.913)}}
    idle = {"ratio": 1.02, "cpu_ratio": 1.05}
    summary, per_case = bench.summarize(runs, [case], idle)
    seed0 = per_case["c"]["per_seed"]["0"]
    # final accuracy = the mean of the evaluations after the last decay (steps 90 and 100)
    assert seed0["full_final_accuracy"] == pytest.approx(0.91975)
    assert seed0["target"] == pytest.approx(0.91875)
    # full meets 0.919 at step 90 (90 s); kiln at step 90 after 60 s wall and 70 s CPU
    assert seed0["kiln_wall_ratio"] == pytest.approx(1.5)
    assert seed0["kiln_cpu_ratio"] == pytest.approx(90 / 70, abs=1e-4)
    assert seed0["kiln_flops_ratio"] == pytest.approx(3.0 / 2.5)
    # fixed never reaches the target: its whole budget counts, flagged
    assert seed0["fixed_reached"] is False
    assert seed0["fixed_wall_ratio"] == pytest.approx(90 / 70, abs=1e-4)
    assert summary["median_tta_ratio"] == pytest.approx(1.5)
    # deltas of the means +0.05, -0.075, 0: the worst case's median over seeds is the goal's
    assert summary["worst_final_metric_delta"] == pytest.approx(0.0)
    assert summary["worst_seed_final_delta"] == pytest.approx(-0.075)  # seed 1
    assert summary["worst_seed_last_eval_delta"] == pytest.approx(-0.15)  # seed 1's last evaluation
    assert summary["beats_fixed_schedule"] is True
    assert summary["kiln_loses"] == {}
    assert summary["goal_met"] is True
    assert per_case["c"]["unreached"] == {"kiln": 0, "fixed": 3}


def test_summary_lists_the_cases_kiln_loses(bench: ModuleType) -> None:
    case = bench.Case("c", "small_resnet", {}, [1, 28, 28], {}, {}, epochs=4)
    runs = {"c": {0: _run(0.912, 0.92)}}
    summary, _ = bench.summarize(runs, [case], {"ratio": 1.10, "cpu_ratio": 1.2})
    assert summary["kiln_loses"] == {"c": ["final delta -0.40"]}
    assert summary["goal_met"] is False  # final delta and idle overhead both miss
    runs = {"c": {0: _run(0.912, 0.92), 1: _run(0.921, 0.92), 2: _run(0.92, 0.92)}}
    summary, _ = bench.summarize(runs, [case], {"ratio": 1.0, "cpu_ratio": 1.0})
    assert summary["kiln_loses"] == {"c": ["one seed's final delta -0.40"]}  # the median is 0


def test_the_gpu_cases_are_egerias_regime_and_fit_the_estimate(bench: ModuleType,
                                                                 tmp_path: Any) -> None:
    import torch

    from kiln import models

    gpu = bench.gpu_cases(tmp_path)
    assert [c.label for c in gpu] == ["resnet20-gpu", "resnet56-gpu"]
    for case in gpu:
        assert case.epochs % 4 == 0  # warm-up, then the decays at 50% and 75%
        job = bench.make_job(case, seed=0, device="cuda")
        assert job.spec.training.device == "cuda"
        n_train = case.dataset["maxSamples"] - round(
            case.dataset["maxSamples"] * case.dataset["validationFraction"])
        spe = -(-n_train // case.batch_size)
        latency = bench.decision_latency_steps(job, spe)
        assert case.epochs * spe >= bench.DECISIONS_PER_BUDGET * latency
        model = models.build(job.spec.model)  # builds and runs at 32 px on the CPU here
        assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 10)
    # one seed of both cases within 8 minutes at the assumed GPU step times
    assert bench.estimate_seconds(gpu, [0], 300) <= 8 * 60


def test_the_fixed_schedule_is_beaten_on_the_clock_named(bench: ModuleType) -> None:
    # equal final accuracy; Kiln reaches the target sooner in CPU seconds (its reference
    # process on another core is not on them) but later on the wall clock than the schedule
    case = bench.Case("c", "small_resnet", {}, [1, 28, 28], {}, {}, epochs=4)
    run = _run(0.92, 0.92)
    run["arms"]["kiln"] = _arm([(50, 50.0, 45.0, 0.80), (90, 95.0, 70.0, 0.9195),
                                (100, 100.0, 80.0, 0.92)], skipped=0.25)
    run["arms"]["fixed"] = _arm([(50, 45.0, 50.0, 0.80), (90, 80.0, 85.0, 0.9195),
                                 (100, 90.0, 95.0, 0.92)], skipped=0.25)
    idle = {"ratio": 1.0, "cpu_ratio": 1.0}
    summary, per_case = bench.summarize({"c": {0: run}}, [case], idle)
    assert per_case["c"]["kiln_cpu_ratio"] > per_case["c"]["fixed_cpu_ratio"]
    assert summary["beats_fixed_schedule"] is True
    summary, per_case = bench.summarize({"c": {0: run}}, [case], idle, beats_on="wall")
    assert per_case["c"]["kiln_wall_ratio"] < per_case["c"]["fixed_wall_ratio"]
    assert summary["beats_fixed_schedule"] is False


def test_device_cuda_without_a_gpu_says_so(bench: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: --device cuda would run")
    monkeypatch.setattr("sys.argv", ["freezing.py", "--device", "cuda"])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2
    assert "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err
