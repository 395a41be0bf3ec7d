"""Optimizer and learning-rate schedule from `spec.training`.

The schedule steps once per *optimizer step* (not per epoch), so warm-up and cosine decay are
smooth even for runs of a few epochs. No parameter groups (e.g. no decay exemption for norms).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from kiln import api


def build_optimizer(
    parameters: Iterable[nn.Parameter], spec: api.OptimizerSpec
) -> torch.optim.Optimizer:
    """The optimizer `spec.training.optimizer` names, over `parameters`.

    Weight decay is L2 for sgd and adam, decoupled for adamw.
    """
    params = list(parameters)
    if spec.name == api.OptimizerName.SGD:
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay,
            nesterov=spec.nesterov and spec.momentum > 0,
        )
    if spec.name == api.OptimizerName.ADAM:
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)


def lr_factor(
    step: int, *, schedule: api.LrScheduleSpec, epochs: int, steps_per_epoch: int
) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based, about to be taken).

      * warm-up: ``(s + 1) / W`` for the first W = warmupEpochs * steps_per_epoch steps;
      * constant: 1;
      * cosine: ``0.5 * (1 + cos(pi * (s - W) / (S - W)))`` over the remaining S - W steps,
        where S = epochs * steps_per_epoch (decays to 0 at the end of the epoch budget);
      * step: ``gamma ** ((epoch - warmupEpochs) // stepEpochs)``, epoch = s // steps_per_epoch.
    """
    warmup_steps = schedule.warmup_epochs * steps_per_epoch
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule.name == api.ScheduleName.COSINE:
        total_steps = max(epochs * steps_per_epoch, warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule.name == api.ScheduleName.STEP:
        epoch = step // steps_per_epoch
        return float(schedule.gamma ** ((epoch - schedule.warmup_epochs) // schedule.step_epochs))
    return 1.0


def build_schedule(
    optimizer: torch.optim.Optimizer,
    spec: api.TrainingSpec,
    *,
    steps_per_epoch: int,
    damping: Callable[[int], float] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-optimizer-step LambdaLR applying `lr_factor` to every parameter group.

    Its state_dict (step counter, base lrs) goes in checkpoints.

    Args:
        optimizer: the optimizer to schedule.
        spec: `spec.training`.
        steps_per_epoch: optimizer steps per epoch.
        damping: extra multiplier by 0-based optimizer step (warm start damps its first
            steps, `kiln_trainer.warm`); None: 1.
    """

    def factor(step: int) -> float:
        scale = damping(step) if damping is not None else 1.0
        return scale * lr_factor(
            step, schedule=spec.lr_schedule, epochs=spec.epochs, steps_per_epoch=steps_per_epoch
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def apply_job_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    spec: api.OptimizerSpec,
) -> None:
    """After loading a checkpoint, make the job's optimizer settings win over the saved ones.

    `load_state_dict` restores the saved hyperparameters (lr, momentum, weight decay); the job
    running now may have changed them. The optimizer was built from the job, so its `defaults`
    hold the job's values; the scheduler's base learning rate is reset to ``spec.lr`` and the
    current rate recomputed from the restored step counter.
    """
    for group in optimizer.param_groups:
        group.update({k: v for k, v in optimizer.defaults.items() if k != "lr"})
        group["initial_lr"] = spec.lr
    scheduler.base_lrs = [spec.lr for _ in optimizer.param_groups]
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["lr"] = spec.lr * lr_lambda(scheduler.last_epoch)
