"""The freezing policy's knobs, resolved from a job (`api.FreezingSpec`), and its probe batch.

Callers: `freezing.controller` (re-exports `Settings` and `probe_batch`), the trainer's
freezing setup, benchmarks. Non-goals: no policy; see `freezing.controller`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from kiln import api

# Probes closer than this cost more than they tell: measured on digits (23 steps per epoch),
# a probe every 2 steps slowed training by a third when nothing froze, one every 8 by 8%.
MIN_PROBE_SPACING_STEPS = 10


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved knobs (see `api.FreezingSpec` for their meaning); steps are optimizer steps."""

    check_every_steps: int
    window: int = 5
    tolerance: float = 0.1
    patience: int = 2
    probe_batch_size: int = 32
    max_frozen_fraction: float = 0.8
    reference: str = "auto"
    reference_threads: int = 1
    cache: bool = False
    cache_memory_bytes: int = 1 << 30
    bootstrap_steps: int = 0
    unfreeze_lr_ratio: float = 0.5

    @classmethod
    def from_job(cls, spec: api.TrainingJobSpec, *, steps_per_epoch: int) -> Settings:
        """Settings for a job: default cadence 8 probes per epoch, at least
        `MIN_PROBE_SPACING_STEPS` apart; bootstrap = warm-up epochs
        or 10% of the step budget, whichever is longer; caching only with deterministic inputs;
        the unfreeze ratio catches every decay of a step schedule (its gamma) and halvings of
        other schedules."""
        f, training = spec.freezing, spec.training
        schedule = training.lr_schedule
        ratio = 0.5
        if schedule.name == api.ScheduleName.STEP:
            ratio = max(0.5, schedule.gamma) * (1 + 1e-6)
        return cls(
            check_every_steps=f.check_every_steps or max(MIN_PROBE_SPACING_STEPS,
                                                        steps_per_epoch // 8),
            window=f.window, tolerance=f.tolerance, patience=f.patience,
            probe_batch_size=f.probe_batch_size, max_frozen_fraction=f.max_frozen_fraction,
            reference=f.reference.value, reference_threads=f.reference_threads,
            cache=(f.cache == api.CacheMode.AUTO
                   and spec.dataset.augmentation == api.Augmentation.NONE),
            cache_memory_bytes=f.cache_memory_mib << 20,
            bootstrap_steps=max(schedule.warmup_epochs * steps_per_epoch,
                                math.ceil(0.1 * training.epochs * steps_per_epoch)),
            unfreeze_lr_ratio=ratio)


def probe_batch(samples: Sequence[tuple[torch.Tensor, Any]], size: int) -> torch.Tensor:
    """The fixed probe batch: the first `size` samples of `samples` (the validation split,
    which is never augmented), stacked into Tensor[b, ...]."""
    return torch.stack([samples[i][0] for i in range(min(size, len(samples)))])
