"""kiln_trainer.optim: optimizers, the per-step schedule, and job values winning on resume."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from kiln import api
from kiln_trainer import optim, warm


def _schedule(**fields: object) -> api.LrScheduleSpec:
    return api.LrScheduleSpec.model_validate(fields)


@pytest.mark.parametrize(
    ("name", "kind"),
    [pytest.param("sgd", torch.optim.SGD, id="sgd"), pytest.param("adam", torch.optim.Adam,
     id="adam"), pytest.param("adamw", torch.optim.AdamW, id="adamw")],
)
def test_optimizer_follows_the_spec(name: str, kind: type) -> None:
    spec = api.OptimizerSpec.model_validate({"name": name, "lr": 0.05, "weightDecay": 0.01})
    optimizer = optim.build_optimizer(torch.nn.Linear(2, 2).parameters(), spec)
    assert isinstance(optimizer, kind)
    assert optimizer.defaults["lr"] == 0.05 and optimizer.defaults["weight_decay"] == 0.01


def test_linear_warmup_then_cosine_decays_to_zero_at_the_budget() -> None:
    schedule = _schedule(name="cosine", warmupEpochs=1)
    factors = [optim.lr_factor(s, schedule=schedule, epochs=3, steps_per_epoch=4)
               for s in range(12)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0
    assert factors[8] == pytest.approx(0.5)
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))
    assert optim.lr_factor(12, schedule=schedule, epochs=3, steps_per_epoch=4) == pytest.approx(
        0.0, abs=1e-12)


def test_step_schedule_decays_by_gamma_every_step_epochs() -> None:
    schedule = _schedule(name="step", stepEpochs=2, gamma=0.5)
    factors = [optim.lr_factor(e * 10, schedule=schedule, epochs=8, steps_per_epoch=10)
               for e in range(6)]
    assert factors == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]


def test_constant_schedule_stays_at_one() -> None:
    schedule = _schedule(name="constant")
    assert {optim.lr_factor(s, schedule=schedule, epochs=2, steps_per_epoch=3)
            for s in range(6)} == {1.0}


def test_scheduler_steps_once_per_optimizer_step() -> None:
    spec = api.TrainingSpec.model_validate({"epochs": 2, "optimizer": {"lr": 1.0},
                                            "lrSchedule": {"name": "cosine"}})
    optimizer = optim.build_optimizer(torch.nn.Linear(1, 1).parameters(), spec.optimizer)
    scheduler = optim.build_schedule(optimizer, spec, steps_per_epoch=2)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                  0.5 * (1 + math.cos(3 * math.pi / 4))])


def test_a_warm_starts_damping_holds_for_its_first_steps_only() -> None:
    # 2 epochs of 5 steps, a warm start that kept 90% of the probe loss: damped to the floor
    # for ceil(0.2 x 10) = 2 steps, then the constant schedule's full rate
    spec = api.TrainingSpec.model_validate({"epochs": 2, "optimizer": {"lr": 1.0},
                                            "lrSchedule": {"name": "constant"}})
    kept = api.WarmStartDecision(parent="p", similarity=0.9, outcome=api.WarmStartOutcome.WARM,
                                 reason="r", probe_loss=0.2, cold_probe_loss=2.0)
    optimizer = optim.build_optimizer(torch.nn.Linear(1, 1).parameters(), spec.optimizer)
    scheduler = optim.build_schedule(optimizer, spec, steps_per_epoch=5, damping=functools.partial(
        warm.lr_damping, kept, steps_per_epoch=5, total_steps=10))
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.3, 0.3] + [1.0] * 8)


def test_job_hyperparameters_win_over_a_loaded_optimizer_state() -> None:
    model = torch.nn.Linear(2, 1)
    old = api.TrainingSpec.model_validate({"epochs": 4, "optimizer": {"lr": 0.1, "momentum": 0.9},
                                           "lrSchedule": {"name": "constant"}})
    optimizer = optim.build_optimizer(model.parameters(), old.optimizer)
    scheduler = optim.build_schedule(optimizer, old, steps_per_epoch=1)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    new = api.TrainingSpec.model_validate({"epochs": 4, "optimizer": {"lr": 0.02, "momentum": 0.5},
                                           "lrSchedule": {"name": "constant"}})
    fresh = optim.build_optimizer(model.parameters(), new.optimizer)
    fresh_schedule = optim.build_schedule(fresh, new, steps_per_epoch=1)
    fresh.load_state_dict(optimizer.state_dict())
    fresh_schedule.load_state_dict(scheduler.state_dict())
    optim.apply_job_hyperparameters(fresh, fresh_schedule, new.optimizer)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.02)
    assert fresh.param_groups[0]["momentum"] == 0.5
    assert fresh_schedule.last_epoch == 2
