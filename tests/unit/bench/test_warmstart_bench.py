"""bench/warmstart.py's costs to target: the guard's probe steps count as steps (and their
training FLOPs), its batch-norm re-estimation as forward FLOPs only. Runs as the trainer
reports them stand in for training; nothing trains here."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

SIZES = {"steps_per_epoch": 10, "n_train": 640, "n_val": 100, "forward_flops": 1_000}


@pytest.fixture(scope="module")
def warmstart(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("warmstart")


def _run(decision: dict[str, Any] | None) -> dict[str, Any]:
    """A run that met the target at step 4, its fourth evaluation."""
    return {"steps_to_target": 4, "evals_to_target": 4, "steps": 20, "curve": [[1, 0.5]] * 8,
            "time_to_target_seconds": 1.0, "wall_seconds": 5.0,
            "warm_start_decision": decision}


def test_probe_steps_are_steps_and_re_estimation_is_forward_flops(warmstart: ModuleType) -> None:
    cold = warmstart.to_target(_run(None), **SIZES)
    # 4 steps of 64 samples, trained (3x forward), and 4 evaluations of 100 samples
    assert cold["steps"] == 4 and cold["flops"] == 3 * 1_000 * 4 * 64 + 4 * 100 * 1_000
    warm = warmstart.to_target(_run({"guard_steps": 2, "calibration_samples": 512}), **SIZES)
    assert warm["steps"] == 6 and warm["guard_steps"] == 2
    assert warm["calibration_samples"] == 512
    assert warm["flops"] == cold["flops"] + 3 * 1_000 * 2 * 64 + 512 * 1_000
    # an older result without the field costs no re-estimation
    assert warmstart.to_target(_run({"guard_steps": 0}), **SIZES)["flops"] == cold["flops"]
