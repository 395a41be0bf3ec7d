"""The freezing controller: when to freeze which front blocks, and what that changes (Egeria).

`Freezer` runs Egeria's policy (Wang et al., EuroSys'23, sections 3-4) around any training loop:
it probes plasticity, freezes a contiguous front prefix of blocks once it has converged, and
unfreezes everything on a learning-rate drop. Never freezes the head or non-contiguous blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Self

import torch
from torch import nn

from kiln import api
from kiln_trainer.freezing import cache as activation_cache
from kiln_trainer.freezing import convergence, reference
from kiln_trainer.freezing import partition as partitions

_log = logging.getLogger(__name__)

CHECKPOINT_KEY = "freezing"  # the Freezer's state_dict inside a trainer checkpoint

# Probes closer than this cost more than they tell: measured on digits (23 steps per epoch),
# a probe every 2 steps slowed training by a third when nothing froze, one every 8 by 8%.
MIN_PROBE_SPACING_STEPS = 10


@dataclasses.dataclass(frozen=True)
class Settings:
    """The policy's knobs, resolved from a job (`api.FreezingSpec` says what each means);
    steps are optimizer steps."""

    check_every_steps: int
    window: int = 5
    tolerance: float = 0.1
    peak_fraction: float = 0.1
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
            window=f.window, tolerance=f.tolerance, peak_fraction=f.peak_fraction,
            patience=f.patience,
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


@dataclasses.dataclass(frozen=True)
class Event:
    """A boundary change: ``froze`` one more block, or ``unfroze`` all of them."""

    kind: str
    modules: tuple[str, ...]
    step: int
    boundary: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"modules": list(self.modules)}


class Freezer:
    """Egeria's freezing policy for one model.

    * Every ``check_every_steps`` it takes the training model's block activations on the probe
      batch (eval mode, no grad) and hands them to the `reference.ReferenceWorker` (another
      process; a busy worker drops the probe, training never waits). Plasticity is the SP loss
      between those activations and a quantized reference snapshot's.
    * A reference *cycle* is ``window`` results, after which the reference is refreshed from
      the current weights; `convergence.Convergence` says when a block has converged in a
      cycle. The front-most active block freezes after ``patience`` converged cycles in a row.
    * Freezing block k sets ``requires_grad=False`` on its parameters, drops their ``.grad``,
      keeps its BatchNorm/dropout in eval mode (`train_mode`), and, where the model splits at
      the boundary (`partition.Partition.split`), trains only the suffix, feeding it the
      prefix's output computed under ``no_grad`` or read from the `cache.ActivationCache`.
    * Never the head, never more than ``max_frozen_fraction`` of the blocks, nothing before
      the bootstrap steps (learning-rate warm-up or 10% of the budget) are over.
    * A learning-rate drop to ``unfreeze_lr_ratio`` of the rate at the last freeze unfreezes
      every block, clears the re-activated parameters' optimizer state, resets the histories
      and refreshes the reference.

    Under DDP every rank calls the same methods at the same steps. Only rank 0 (``main=True``)
    runs the reference worker and decides; the other ranks keep no plasticity and take rank
    0's boundary. `after_step` asks `agree` (rank 0's value broadcast) for it at every probe
    step; a loop that already has one collective per step (`kiln_trainer.loop`) calls the two
    halves instead, ``apply(agreed(propose(step, lr=...)), step)``. Either way the boundary is
    identical on every rank at the same step; after a change every rank re-wraps
    `trainable_module()`.

    Args:
        model: the unwrapped training model (on its training device).
        model_spec: how the reference process rebuilds the same architecture; None: it starts
            from a copy of `model` itself (any nn.Module, no registry or entrypoint needed).
        probe: fixed probe batch, Tensor[b, ...] on the model's device (b = probe_batch_size).
        settings: the knobs.
        optimizer: whose state of re-activated parameters is cleared on unfreeze.
        num_samples: training-set size, for the activation cache's index space.
        agree: boundary agreement across ranks (rank 0's value wins); identity when alone.
        main: whether this rank runs the reference worker and takes decisions.

    Raises:
        partition.Unpartitionable: the model has no usable natural blocks (train unfrozen).
    """

    def __init__(self, model: nn.Module, model_spec: api.ModelSpec | None, probe: torch.Tensor,
                 settings: Settings, *, optimizer: torch.optim.Optimizer | None = None,
                 num_samples: int = 0, agree: Callable[[int], int] = lambda k: k,
                 main: bool = True) -> None:
        self.model, self.settings, self.optimizer, self.agree = model, settings, optimizer, agree
        self.probe = probe
        self.partition = partitions.Partition.of(model, probe[:1])
        blocks = self.partition.blocks
        self.max_frozen = min(len(blocks) - 1, int(settings.max_frozen_fraction * len(blocks)))
        self.boundary, self.events = 0, list[Event]()
        self.lr_at_freeze: float | None = None  # learning rate at the last freeze
        self._unfreeze_reason: str | None = None  # set by `propose` on a learning-rate drop
        self._extractor = partitions.extractor(model, blocks)
        self._version, self._results_in_cycle, self._probe_id = 0, 0, 0
        self.convergence = convergence.Convergence(
            blocks[:-1], window=settings.window, tolerance=settings.tolerance,
            peak_fraction=settings.peak_fraction, patience=settings.patience)
        self._skipped_flops_sum, self._steps = 0.0, 0
        # seconds and count of steps without / with a frozen prefix, for `saved_seconds`
        self._step_seconds = {False: [0.0, 0.0], True: [0.0, 0.0]}
        self.cache: activation_cache.ActivationCache | None = None
        if settings.cache and num_samples:
            self.cache = activation_cache.ActivationCache(
                num_samples, memory_limit_bytes=settings.cache_memory_bytes, directory=None)
        self.worker: reference.ReferenceWorker | None = None
        if main:
            self.worker = reference.ReferenceWorker(
                model if model_spec is None else model_spec, blocks, threads=settings.reference_threads, mode=settings.reference)
            self._refresh()
        self._split: partitions.Split | None = None

    # -- what the training step uses ------------------------------------------------------

    @property
    def frozen_modules(self) -> tuple[str, ...]:
        return self.partition.blocks[: self.boundary]

    @property
    def frozen_parameter_ratio(self) -> float:
        counts = self.partition.param_counts
        return sum(counts[: self.boundary]) / max(1, sum(counts))

    @property
    def backward_flops_skipped(self) -> float:
        """Mean share of backward FLOPs skipped per step so far, in [0, 1]."""
        return self._skipped_flops_sum / max(1, self._steps)

    def trainable_module(self) -> nn.Module:
        """What the optimizer step trains and a DDP wrapper wraps: the suffix behind the frozen
        prefix when the model splits there, else the whole model (its frozen parameters have
        ``requires_grad=False``, so autograd and DDP's reducer skip them anyway)."""
        return self._split.suffix if self._split is not None else self.model

    def prefix(self, inputs: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        """The input of `trainable_module()` for a batch: the inputs themselves, or the frozen
        prefix's output — from the activation cache when every index is there, else computed
        under ``no_grad`` (and cached). Shapes: inputs Tensor[B, ...], indices LongTensor[B]."""
        if self._split is None:
            return inputs
        if self.cache is not None and indices is not None:
            cached = self.cache.get(indices)
            if cached is not None:
                return cached.to(inputs.device, non_blocking=True)
        with torch.no_grad():
            outputs: torch.Tensor = self._split.prefix(inputs)
        if self.cache is not None and indices is not None:
            self.cache.put(indices, outputs.detach())
        return outputs

    def train_mode(self) -> None:
        """Put the frozen prefix in eval mode (call after ``model.train()``): its BatchNorm
        statistics stop moving and its dropout is off, so cached outputs stay valid."""
        for module in self.partition.modules(self.boundary):
            module.eval()

    # -- the policy -----------------------------------------------------------------------

    def after_step(self, step: int, *, lr: float, seconds: float | None = None) -> Event | None:
        """Advance the policy after optimizer step `step` (1-based count of steps taken).

        `propose`, then `agree` at probe steps (the ranks' boundaries meet there), then
        `apply`.

        Args:
            step: steps taken so far.
            lr: the learning rate the next step uses (first parameter group).
            seconds: how long this step took (for the saved-time estimate), if measured.

        Returns:
            The boundary change this step caused, if any; the caller then re-wraps
            `trainable_module()` (DDP) and keeps using `prefix`.
        """
        proposal = self.propose(step, lr=lr, seconds=seconds)
        if self._unfreeze_reason is None and step % self.settings.check_every_steps == 0:
            proposal = self.agree(proposal)
        return self.apply(proposal, step)

    def propose(self, step: int, *, lr: float, seconds: float | None = None) -> int:
        """Advance the policy after optimizer step `step`; the boundary this rank proposes.

        The first half of `after_step`, for loops that agree across ranks themselves: the
        main rank returns its decision (0 after a learning-rate drop, one more block when the
        front-most active block converged at a probe step, else the current boundary); a
        follower returns its current boundary, or 0 after the same learning-rate drop (the
        rate is the same on every rank). Nothing changes until `apply`.

        Args:
            step: steps taken so far.
            lr: the learning rate the next step uses (first parameter group).
            seconds: how long this step took (for the saved-time estimate), if measured.
        """
        self._steps += 1
        self._skipped_flops_sum += self.partition.backward_flops_fraction(self.boundary)
        if seconds is not None:
            slot = self._step_seconds[self.boundary > 0]
            slot[0], slot[1] = slot[0] + seconds, slot[1] + 1.0
        self._unfreeze_reason = None
        if self.boundary and self.lr_at_freeze and lr <= self.settings.unfreeze_lr_ratio * \
                self.lr_at_freeze:
            self._unfreeze_reason = f"learning rate fell to {lr:.3g}"
            return 0
        if step % self.settings.check_every_steps:
            return self.boundary
        return self._decide(step) if self.worker is not None else self.boundary

    def apply(self, boundary: int, step: int) -> Event | None:
        """Move to `boundary` (rank 0's proposal, agreed by every rank) after step `step`.

        The second half of `after_step`. Returns the change, or None when `boundary` is the
        current one; the caller then re-wraps `trainable_module()`.

        Raises:
            ValueError: `boundary` outside [0, number of blocks - 1].
        """
        if boundary == self.boundary:
            return None
        reason = (self._unfreeze_reason if boundary == 0 and self._unfreeze_reason
                  else self._reason(boundary))
        return self.set_boundary(boundary, step, reason)

    def _decide(self, step: int) -> int:
        assert self.worker is not None
        for result in self.worker.poll():
            if result.version == self._version:
                self._results_in_cycle += 1
                self.convergence.take(result.plasticity, first_active=self.boundary)
        proposal = self.boundary
        if self._results_in_cycle >= self.settings.window:
            converged = self.convergence.close_cycle(first_active=self.boundary)
            _log.debug("step %d, reference v%d: %s", step, self._version, self.convergence)
            self._refresh()
            if converged and step >= self.settings.bootstrap_steps \
                    and self.boundary < self.max_frozen:
                proposal = self.boundary + 1
        if self.worker.alive:
            self._submit()
        return proposal

    def _submit(self) -> None:
        assert self.worker is not None
        was_training = self.model.training
        with torch.no_grad():
            self._extractor.eval()
            activations = self._extractor(self.probe)
        if was_training:
            self.model.train()
            self.train_mode()
        flat = {name: partitions.flatten(t).cpu() for name, t in activations.items()}
        self._probe_id += 1
        self.worker.submit(self._probe_id, self._version, self.probe.cpu(), flat)

    def _refresh(self) -> None:
        assert self.worker is not None
        self._version += 1
        self._results_in_cycle = 0
        self.convergence.new_cycle()
        weights = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        self.worker.refresh(self._version, weights, self.probe.cpu())

    def _reason(self, proposal: int) -> str:
        return (self.convergence.reason(proposal - 1) if proposal else None) or "rank 0 decided"

    def set_boundary(self, k: int, step: int, reason: str) -> Event:
        """Freeze exactly the first `k` blocks (0: none) now, whatever the policy says.

        The policy calls it; so do fixed schedules (the FreezeOut-like benchmark baseline) and
        users who freeze by hand. Unfreezing clears the re-activated parameters' optimizer
        state; any change invalidates the cache, resets the histories and refreshes the
        reference. The caller re-wraps `trainable_module()` afterwards.

        Raises:
            ValueError: `k` outside [0, number of blocks - 1] (the head never freezes).
        """
        if not 0 <= k < len(self.partition.blocks):
            raise ValueError(f"cannot freeze {k} of {len(self.partition.blocks)} modules; the "
                             f"head never freezes (use 0..{len(self.partition.blocks) - 1})")
        old = self.boundary
        params = self.partition.params(max(k, old))
        frozen = set(map(id, self.partition.params(k)))
        for p in params:
            p.requires_grad_(id(p) not in frozen)
            if id(p) in frozen:
                p.grad = None
            elif self.optimizer is not None and k < old:
                self.optimizer.state.pop(p, None)  # stale momentum would kick re-activated weights
        if k < old:
            for module in self.partition.modules(old):
                module.train(self.model.training)
        self.boundary = k
        self._split = self.partition.split(k) if k else None
        if k and self._split is None:
            _log.info("the model does not split after %s (%s): the frozen prefix still runs "
                      "forward, without gradients", self.partition.blocks[k - 1],
                      self.partition.split_reason(k))
        if self.cache is not None:
            self.cache.invalidate()
        self.lr_at_freeze = self._current_lr() if k > old else self.lr_at_freeze
        self.convergence.reset(forget_peaks=k < old)  # an LR event: measured afresh
        if self.worker is not None:
            self._refresh()
        if k > old:
            event = Event("froze", self.partition.blocks[old:k], step, k, reason)
        else:
            event = Event("unfroze", self.partition.blocks[k:old], step, k, reason)
        self.events.append(event)
        _log.info("%s %s at step %d: %s", event.kind, ", ".join(event.modules), step, reason)
        return event

    def _current_lr(self) -> float | None:
        if self.optimizer is None:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    # -- reporting, checkpoints, teardown --------------------------------------------------

    def saved_seconds(self) -> float:
        """Estimated training seconds saved so far: steps run with a frozen prefix times the
        difference between the mean unfrozen and frozen step times (0 until both are known)."""
        (full, n_full), (part, n_part) = self._step_seconds[False], self._step_seconds[True]
        if not n_full or not n_part:
            return 0.0
        return max(0.0, (full / n_full - part / n_part) * n_part)

    def summary(self) -> dict[str, Any]:
        """What the result JSON records: when each module froze, the final boundary, the mean
        skipped backward FLOPs share, the reference's CPU seconds and quantization."""
        return {
            "frozen": [m for m in self.frozen_modules],
            "events": [e.to_json() for e in self.events][-8:],  # termination log < 4 KiB
            "backward_flops_skipped": round(self.backward_flops_skipped, 4),
            "saved_seconds": round(self.saved_seconds(), 2),
            "reference": str(self.worker.kind) if self.worker is not None else None,
            "reference_cpu_seconds": round(self.worker.cpu_seconds, 2) if self.worker else 0.0,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for checkpoints: the boundary, its history and counters."""
        return {"boundary": self.boundary, "events": [e.to_json() for e in self.events],
                "lr_at_freeze": self.lr_at_freeze, "skipped_flops_sum": self._skipped_flops_sum,
                "steps": self._steps}

    def load_state_dict(self, state: dict[str, Any], *, step: int = 0) -> None:
        """Restore a checkpoint's frozen prefix (plasticity histories start afresh)."""
        self.events = [Event(e["kind"], tuple(e["modules"]), e["step"], e["boundary"],
                             e["reason"]) for e in state.get("events", [])]
        self._skipped_flops_sum = float(state.get("skipped_flops_sum", 0.0))
        self._steps = int(state.get("steps", 0))
        boundary = min(int(state.get("boundary", 0)), self.max_frozen)
        if boundary:
            self.set_boundary(boundary, step, "resumed from the checkpoint")
            self.events.pop()
        self.lr_at_freeze = state.get("lr_at_freeze")

    def close(self) -> None:
        """Stop the reference process and drop the cache (idempotent)."""
        if self.worker is not None:
            self.worker.close()
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
