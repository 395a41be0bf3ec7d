"""The freezing controller: when to freeze which front blocks, and what that changes (Egeria).

`Freezer` runs Egeria's policy (Wang et al., EuroSys'23, sections 3-4) around any training loop:
it probes plasticity, freezes the converged front prefix of blocks a bounded share at a time,
keeps it across learning-rate drops, and unfreezes only when the block behind it measurably moves
faster again. Never freezes the head or non-contiguous blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any, Self

import torch
from torch import nn

from kiln import api
from kiln_trainer.freezing import cache as activation_cache
from kiln_trainer.freezing import convergence, gradient_norm, reference
from kiln_trainer.freezing import partition as partitions

_log = logging.getLogger(__name__)

CHECKPOINT_KEY = "freezing"  # the Freezer's state_dict inside a trainer checkpoint

# Probes closer than this cost more than they tell: measured on digits (23 steps per epoch),
# a probe every 2 steps slowed training by a third when nothing froze; one every 5 steps with
# 16-sample probes and an fp32 reference froze within a few epochs on a ResNet-20-like run.
MIN_PROBE_SPACING_STEPS = 5
#: Base probes over a whole step budget at the least: with a window of 3 and patience 2 the
#: budget then holds over 30 decision latencies (Egeria's regime needs 20), however long an
#: epoch is (a 320-step epoch at 8 probes per epoch held 11).
PROBES_PER_BUDGET = 200
#: A block whose freezing skips less than this share of the backward FLOPs (a stem's conv and
#: BatchNorm) is not worth a decision of its own: it freezes with the next converged block.
NEAR_FREE_FRACTION = 0.02
#: The most of the backward FLOPs one decision freezes (one block always may). At a steady
#: high rate whole networks pass the phase test together: freezing every converged block at
#: once froze 80% of a ResNet-20 within 160 steps of its warm-up and cost 0.8 points; a fifth
#: per decision, one decision per `patience` cycles, stages the prefix over the run instead.
MAX_DECISION_SHARE = 0.2
#: Reference cycles at the start of each learning-rate phase probed at the base cadence; later
#: cycles of the phase probe half as often (blocks change fastest right after a change).
DENSE_CYCLES = 2
#: Version of `Freezer.state_dict`; unversioned states (version 1) still load.
STATE_VERSION = 2


@dataclasses.dataclass(frozen=True)
class Settings:
    """The policy's knobs, resolved from a job (`api.FreezingSpec` says what each means);
    steps are optimizer steps."""

    check_every_steps: int
    window: int = 3
    tolerance: float = 0.1
    peak_fraction: float = 0.1
    patience: int = 2
    probe_batch_size: int = 16
    max_frozen_fraction: float = 0.8
    reference: str = "auto"
    reference_threads: int = 1
    cache: bool = False
    cache_memory_bytes: int = 1 << 30
    bootstrap_steps: int = 0
    phase_lr_ratio: float = 0.5
    plateau_ratio: float = 0.0
    transferred: str = "ignore"
    test: str = "plasticity"
    gradient_percentile: float = 50.0

    @classmethod
    def from_job(cls, spec: api.TrainingJobSpec, *, steps_per_epoch: int) -> Settings:
        """Settings for a job: default base cadence 8 probes per epoch or `PROBES_PER_BUDGET`
        over the step budget, whichever is denser, at least `MIN_PROBE_SPACING_STEPS` apart
        (long epochs would otherwise leave a budget a handful of decisions); bootstrap =
        warm-up epochs or 10% of the step budget, whichever is longer; caching only with
        deterministic inputs; a new learning-rate phase starts at every decay of a step
        schedule (its gamma) and at halvings of other schedules, at most once per reference
        cycle."""
        f, training = spec.freezing, spec.training
        schedule = training.lr_schedule
        ratio = 0.5
        if schedule.name == api.ScheduleName.STEP:
            ratio = max(0.5, schedule.gamma) * (1 + 1e-6)
        return cls(
            check_every_steps=f.check_every_steps or max(
                MIN_PROBE_SPACING_STEPS,
                min(steps_per_epoch // 8, training.epochs * steps_per_epoch // PROBES_PER_BUDGET)),
            window=f.window, tolerance=f.tolerance, peak_fraction=f.peak_fraction,
            patience=f.patience, plateau_ratio=f.plateau_ratio,
            probe_batch_size=f.probe_batch_size, max_frozen_fraction=f.max_frozen_fraction,
            reference=f.reference.value, reference_threads=f.reference_threads,
            cache=(f.cache == api.CacheMode.AUTO
                   and spec.dataset.augmentation == api.Augmentation.NONE),
            cache_memory_bytes=f.cache_memory_mib << 20,
            bootstrap_steps=max(schedule.warmup_epochs * steps_per_epoch,
                                math.ceil(0.1 * training.epochs * steps_per_epoch)),
            phase_lr_ratio=ratio, transferred=f.transferred.value, test=f.test.value,
            gradient_percentile=f.gradient_percentile)


def probe_batch(samples: Sequence[tuple[torch.Tensor, Any]], size: int) -> torch.Tensor:
    """The fixed probe batch: the first `size` samples of `samples` (the validation split,
    which is never augmented), stacked into Tensor[b, ...]."""
    return torch.stack([samples[i][0] for i in range(min(size, len(samples)))])


@dataclasses.dataclass(frozen=True)
class Event:
    """A boundary change: ``froze`` one or more blocks, or ``unfroze`` all of them."""

    kind: str
    modules: tuple[str, ...]
    step: int
    boundary: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"modules": list(self.modules)}


class Freezer:
    """Egeria's freezing policy for one model.

    * At probe steps it takes the training model's activations of the active blocks it may
      still freeze (eval mode, no grad; later blocks and the head are not run) on the probe
      batch and hands them to the `reference.ReferenceWorker` (another process; a busy worker
      drops the probe, training never waits). Plasticity is the SP loss between those
      activations and a reference snapshot's, less the snapshot's quantization noise floor.
      Probes come every ``check_every_steps`` steps for the first `DENSE_CYCLES` cycles of a
      learning-rate phase, every second such step after that.
    * A reference *cycle* is ``window`` results, after which the reference is refreshed from
      the current weights; `convergence.Convergence` says when a block has converged in a
      cycle, comparing plasticity per unit of learning rate x steps (and, when
      ``plateau_ratio`` is set, whether it still falls within a learning-rate phase). At the
      end of a cycle the leading active blocks converged for ``patience`` cycles freeze
      together, up to `MAX_DECISION_SHARE` of the backward FLOPs, at most one decision per
      ``patience`` cycles (near-free blocks, under `NEAR_FREE_FRACTION` of the backward
      FLOPs, join the next one); deeper blocks keep their streaks.
    * Freezing block k sets ``requires_grad=False`` on its parameters, drops their ``.grad``,
      keeps its BatchNorm/dropout in eval mode (`train_mode`), and, where the model splits at
      the boundary (`partition.Partition.split`), trains only the suffix, feeding it the
      prefix's output computed under ``no_grad`` or read from the `cache.ActivationCache`.
    * Never the head, never more than ``max_frozen_fraction`` of the blocks, nothing before
      the bootstrap steps (learning-rate warm-up or 10% of the budget) are over but the
      blocks a warm start copied unchanged (`start_from_transfer`), which may also start
      frozen.
    * A learning-rate drop to ``phase_lr_ratio`` of the phase's rate starts a new phase (denser
      probes, a fresh reference, a new baseline for the rise test) and keeps the frozen
      prefix. Every block unfreezes only when the first active block's normalised plasticity
      stays above `convergence.RISE_FACTOR` times its baseline (its value at the freeze or in
      the phase's first cycle) for ``patience`` cycles; that clears the re-activated
      parameters' optimizer state.

    Under DDP and FSDP every rank calls the same methods at the same steps. Only rank 0
    (``main=True``) runs the reference worker and decides; the other ranks keep no plasticity
    and take rank 0's boundary. On a model sharded by FSDP2 the probe forward and the
    reference's full state dict are collective, so every rank runs them: at each probe step
    rank 0 broadcasts its plan (refresh the reference, probe) through `agree`, and the
    reference weights are gathered to rank 0 (`sharding.full_model_state`). `after_step` asks `agree` (rank 0's value broadcast) for it at every probe
    step (`is_probe_step`, the same on every rank); a loop that already has one collective
    per step (`kiln_trainer.loop`) calls the two halves instead,
    ``apply(agreed(propose(step, lr=...)), step)``. Either way the boundary is identical on
    every rank at the same step; after a change every rank re-wraps `trainable_module()`.

    Args:
        model: the unwrapped training model (on its training device).
        model_spec: how a spawned reference process rebuilds the same architecture; None,
            or a model the process may be forked for (`_forkable`): it starts from a copy of
            `model` itself (any nn.Module, no registry or entrypoint needed; not for a
            sharded model).
        probe: fixed probe batch, Tensor[b, ...] on the model's device (b = probe_batch_size).
        settings: the knobs.
        optimizer: whose state of re-activated parameters is cleared on unfreeze.
        num_samples: training-set size, for the activation cache's index space.
        agree: boundary agreement across ranks (rank 0's value wins); identity when alone.
        main: whether this rank runs the reference worker and takes decisions.

    Raises:
        partition.Unpartitionable: the model has no usable natural blocks (train unfrozen).
        ValueError: a model sharded by FSDP2 without `model_spec`.
    """

    def __init__(self, model: nn.Module, model_spec: api.ModelSpec | None, probe: torch.Tensor,
                 settings: Settings, *, optimizer: torch.optim.Optimizer | None = None,
                 num_samples: int = 0, agree: Callable[[int], int] = lambda k: k,
                 main: bool = True) -> None:
        self.model, self.settings, self.optimizer, self.agree = model, settings, optimizer, agree
        self.main = main
        self.probe = probe
        # FSDP2: the probe forward and the full state dict need every rank
        self.sharded = _sharded(model)
        if self.sharded and main and model_spec is None:
            raise ValueError("a model sharded by FSDP cannot be copied into the reference "
                             "process: pass its model_spec, from which that process rebuilds it")
        self.partition = partitions.Partition.of(model, probe[:1])
        blocks = self.partition.blocks
        self.max_frozen = min(len(blocks) - 1, int(settings.max_frozen_fraction * len(blocks)))
        self.boundary, self.events = 0, list[Event]()
        # the learning-rate phase: its first step and highest rate, the same on every rank
        self.phase_start, self.phase_lr = 0, None if optimizer is None else self._current_lr()
        self._lr = self.phase_lr or 0.0  # the rate of the latest step
        self._decision_reason: tuple[int, str] | None = None  # rank 0's last proposal, why
        self._refresh_owed = False  # a proposed change refreshes the reference once, in apply
        self._cycles_since_freeze = settings.patience  # closed cycles since the last freeze
        # leading blocks a warm start copied unchanged: they may freeze during the bootstrap
        self.copied = 0
        # Probes need the blocks that may still freeze and the one behind them, not the rest.
        probed = blocks[: self.max_frozen + 2]
        self._extractor = partitions.extractor(model, probed)
        self._compared = probed[:-1]  # the blocks whose outputs the reference compares
        self._version, self._results_in_cycle, self._probe_id = 0, 0, 0
        self._refreshed_at = 0  # step of the latest refresh
        self._probe_scales: dict[int, float] = {}  # probe id -> lr x steps since the refresh
        self.convergence = convergence.Convergence(
            blocks[:-1], window=settings.window, tolerance=settings.tolerance,
            peak_fraction=settings.peak_fraction, patience=settings.patience,
            plateau_ratio=settings.plateau_ratio)
        share = self.partition.backward_flops_fraction
        measured = share(len(blocks) - 1) > 0  # without FLOP counts every block counts
        self._shares = [share(i + 1) - share(i) if measured else 0.0
                        for i in range(len(blocks) - 1)]
        self._near_free = [measured and s < NEAR_FREE_FRACTION for s in self._shares]
        self._skipped_flops_sum, self._steps = 0.0, 0
        # seconds and count of steps without / with a frozen prefix, for `saved_seconds`
        self._step_seconds = {False: [0.0, 0.0], True: [0.0, 0.0]}
        # the gradient-norm test reads the blocks' gradients in this process: no reference
        self.gradients: gradient_norm.GradientNormTest | None = None
        if settings.test == api.FreezingTest.GRADIENT_NORM:
            self.gradients = gradient_norm.GradientNormTest(
                blocks[:-1], percentile=settings.gradient_percentile)
        params = [self.partition.params(i) for i in range(len(blocks) - 1)]
        self._block_params = [self.partition.params(i + 1)[len(params[i]):]
                              for i in range(len(blocks) - 1)]
        self._recorded = False  # this step's gradients already went into the test
        self.cache: activation_cache.ActivationCache | None = None
        if settings.cache and num_samples and not self.sharded:  # a sharded model never splits
            self.cache = activation_cache.ActivationCache(
                num_samples, memory_limit_bytes=settings.cache_memory_bytes, directory=None)
        self.worker: reference.ReferenceWorker | None = None
        if main and self.gradients is None:
            self.worker = reference.ReferenceWorker(
                model if model_spec is None or _forkable(model, settings) else model_spec, probed,
                threads=settings.reference_threads, mode=settings.reference)
        if self._refreshes:
            self._refresh(0)
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

    def is_probe_step(self, step: int) -> bool:
        """Whether the policy probes (and ranks agree) after step `step`: every
        ``check_every_steps`` steps in the first `DENSE_CYCLES` cycles of the learning-rate
        phase, every second such step after that. Depends on the step and the rate only."""
        every, since = self.settings.check_every_steps, step - self.phase_start
        if self.gradients is not None:  # one interval per reference cycle's worth of steps
            return step > 0 and step % (self.settings.window * every) == 0
        if since <= 0:
            return False
        dense = since <= DENSE_CYCLES * self.settings.window * every
        return since % (every if dense else 2 * every) == 0

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
        if self.is_probe_step(step):
            proposal = self.agree(proposal)
        return self.apply(proposal, step)

    def propose(self, step: int, *, lr: float, seconds: float | None = None) -> int:
        """Advance the policy after optimizer step `step`; the boundary this rank proposes.

        The first half of `after_step`, for loops that agree across ranks themselves: the
        main rank returns its decision at probe steps (more blocks when the leading active
        ones converged, 0 when the block behind the prefix moves measurably faster again,
        else the current boundary); a follower returns its current boundary. A learning-rate
        drop starts a new phase on every rank (the rate is the same everywhere) and keeps the
        prefix. Nothing changes until `apply`.

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
        self._lr = lr
        if self.phase_lr is None or lr > self.phase_lr:
            if self.phase_lr is not None:
                self.convergence.rate_rose()
            self.phase_lr = lr  # warm-up and restarts raise the phase's rate
        elif (lr <= self.settings.phase_lr_ratio * self.phase_lr
              and step - self.phase_start >= self.settings.window * self.settings.check_every_steps):
            # At most one phase per reference cycle: the tail of a cosine schedule halves its
            # rate every few steps, and each phase refreshes the reference.
            _log.info("learning rate fell to %.3g at step %d: a new phase, %d modules stay "
                      "frozen", lr, step, self.boundary)
            self.phase_start, self.phase_lr = step, lr
            self.convergence.new_phase(self.boundary)
            if self._refreshes:
                self._refresh(step)  # no cycle straddles the drop
        if self.gradients is not None:
            return self._decide_by_gradients(step) if self.main else self.boundary
        if not self.is_probe_step(step) or not (self.worker is not None or self.sharded):
            return self.boundary
        return self._decide(step)

    def apply(self, boundary: int, step: int) -> Event | None:
        """Move to `boundary` (rank 0's proposal, agreed by every rank) after step `step`.

        The second half of `after_step`. Returns the change, or None when `boundary` is the
        current one; the caller then re-wraps `trainable_module()`.

        Raises:
            ValueError: `boundary` outside [0, number of blocks - 1].
        """
        owed, self._refresh_owed = self._refresh_owed, False
        if boundary == self.boundary:
            if owed and self._refreshes:
                self._refresh(step)
            return None
        return self.set_boundary(boundary, step, self._reason(boundary))

    @property
    def _refreshes(self) -> bool:
        """Whether this rank takes part in reference refreshes: rank 0, and every rank of a
        sharded model (its full state dict is collective)."""
        return self.gradients is None and (self.worker is not None or self.sharded)

    def record_gradients(self) -> None:
        """Add this step's gradients to the gradient-norm test now, for a loop that clears
        them before it reports the step (the Hugging Face Trainer zeroes them before its
        step-end callback); otherwise the step's `after_step` reads them itself."""
        if self.gradients is None or not self.main:
            return
        self.gradients.accumulate(([p.grad for p in group] for group in self._block_params),
                                  first_active=self.boundary)
        self._recorded = True

    def _decide_by_gradients(self, step: int) -> int:
        """Rank 0's proposal under the gradient-norm test: every step adds the active blocks'
        gradient norms (this rank's, which under FSDP are its shards'); at the end of an
        interval the leading blocks whose norms settled freeze together, up to the cap (the
        copied ones only during the bootstrap). It never proposes a thaw."""
        assert self.gradients is not None
        if not self._recorded:
            self.record_gradients()
        self._recorded = False
        if not self.is_probe_step(step):
            return self.boundary
        self.gradients.close_interval(first_active=self.boundary)
        k = self.boundary
        limit = self.max_frozen if step >= self.settings.bootstrap_steps else self.copied
        proposal = min(limit, k + self.gradients.passed_prefix(k))
        if proposal <= k:
            return k
        self._decision_reason = (proposal, self.gradients.reason(
            self.partition.blocks[proposal - 1]))
        return proposal

    def _decide(self, step: int) -> int:
        """Rank 0's proposal at a probe step; on a sharded model every rank comes here and
        runs rank 0's plan (refresh, probe) with it."""
        proposal, refresh, owed, probe = self.boundary, False, False, False
        if self.worker is not None:
            closed = self._take_results()
            if closed:
                # a peak only from a cycle wholly after the bootstrap: one that straddles
                # its end still carries the fast start in its first answers
                self.convergence.close_cycle(
                    first_active=self.boundary,
                    peaks=self._refreshed_at >= self.settings.bootstrap_steps)
                self._cycles_since_freeze += 1
                _log.debug("step %d, reference v%d: %s", step, self._version, self.convergence)
                proposal = self._proposal(step)
            kept = proposal == self.boundary
            refresh, owed, probe = closed and kept, closed and not kept, kept and self.worker.ready
        if self.sharded:  # the followers' share of the gather and forward must match rank 0's
            plan = self.agree(refresh | owed << 1 | probe << 2)
            refresh, owed, probe = bool(plan & 1), bool(plan & 2), bool(plan & 4)
        self._refresh_owed = owed  # a change refreshes in `set_boundary`, once
        if refresh:
            self._refresh(step)
        if probe:
            self._submit(step)
        return proposal

    def _take_results(self) -> bool:
        """Feed the worker's answers to the convergence test; whether the cycle is complete."""
        assert self.worker is not None
        floor = self.worker.noise_floor
        for result in self.worker.poll():
            scale = self._probe_scales.pop(result.probe_id, 0.0)
            if result.version == self._version and scale > 0:
                self._results_in_cycle += 1
                # less the quantization noise: after a drop it rivals the real drift
                values = {k: max(0.0, v - floor.get(k, 0.0))
                          for k, v in result.plasticity.items()}
                self.convergence.take(values, first_active=self.boundary, scale=scale)
        self._decision_reason = None
        return self._results_in_cycle >= self.settings.window

    def _proposal(self, step: int) -> int:
        """The boundary after a cycle: 0 on a measured rise, the converged prefix, or as is."""
        k, blocks = self.boundary, self.convergence.blocks
        if k and k < len(blocks) and self.convergence.risen(k):
            why = (f"plasticity of {blocks[k]} per unit of learning rate rose above "
                   f"{convergence.RISE_FACTOR:g}x its value at the freeze for "
                   f"{self.settings.patience} cycles")
            self._decision_reason = (0, why)
            return 0
        # during the bootstrap only the blocks a warm start copied may freeze: they start
        # converged, the others still adapt to the new head
        limit = self.max_frozen if step >= self.settings.bootstrap_steps else self.copied
        if k >= limit or self._cycles_since_freeze < self.settings.patience:
            return k
        proposal = self.convergence.prefix(k, limit, self._near_free,
                                           self._shares, MAX_DECISION_SHARE)
        if proposal > k:
            self._decision_reason = (proposal, self.convergence.reason(proposal - 1) or "")
        return proposal

    def _submit(self, step: int) -> None:
        active = self._compared[self.boundary:]
        activations = self._activations(active)
        if self.worker is None:
            return  # a follower's share of a sharded model's collective forward
        batch = self.probe.shape[0]
        flat = {}
        for name, t in activations.items():
            if name not in active:
                continue
            if t.dim() == 0 or t.shape[0] != batch:
                # No per-sample output (a position embedding: [T, D]): SP compares samples, so
                # it has no plasticity; it freezes along with the next converged block.
                self._near_free[self.convergence.blocks.index(name)] = True
                continue
            flat[name] = partitions.flatten(t).cpu()
        self._probe_id += 1
        if self.worker.submit(self._probe_id, self._version, self.probe.cpu(), flat):
            self._probe_scales[self._probe_id] = self._lr * max(1, step - self._refreshed_at)

    def _activations(self, blocks: Sequence[str]) -> dict[str, torch.Tensor]:
        """The outputs of (at least) `blocks` on the probe batch, in eval mode without
        gradients; every layer's train/eval mode is restored afterwards."""
        saved = partitions.modes(self.model)
        try:
            with torch.no_grad():
                if not self.sharded:
                    activations: dict[str, torch.Tensor] = self._extractor.eval()(self.probe)
                    return activations
                # FSDP2 gathers each block's shards in that block's forward hooks, which the
                # traced extractor would bypass: run the whole model and keep block outputs.
                activations = {}
                hooks = [self.model.get_submodule(name).register_forward_hook(
                    lambda _m, _i, out, name=name: activations.__setitem__(name, out))
                    for name in blocks]
                try:
                    self.model.eval()(self.probe)
                finally:
                    for hook in hooks:
                        hook.remove()
                return activations
        finally:
            partitions.restore_modes(saved)

    def _refresh(self, step: int) -> None:
        self._version += 1
        self._results_in_cycle, self._refreshed_at = 0, step
        self._probe_scales.clear()
        self.convergence.new_cycle()
        if self.sharded:  # collective; full CPU tensors on rank 0, {} on the others
            from kiln_trainer.distributed import sharding  # loaded already under FSDP
            weights = sharding.full_model_state(self.model)
        else:
            weights = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        if self.worker is not None:
            self.worker.refresh(self._version, weights, self.probe.cpu())

    def start_from_transfer(self, copied: Collection[str]) -> str | None:
        """Use what a warm start copied: `copied` names the child's state_dict keys that hold
        their parent's tensor unchanged (`partition.Partition.copied_prefix` finds the leading
        blocks made of them, at most ``max_frozen``). Per ``settings.transferred``: "freeze"
        freezes them now (step 0; they thaw on a measured rise, as any frozen prefix), "judge"
        lets them freeze at the first decision, before the bootstrap is over (the reference
        of the first cycle is the warm weights, so the parent's); "ignore" does nothing.
        Call it once, on a fresh start, on every rank alike.

        Returns:
            What was done, a sentence for the info event; None when nothing was copied or
            the mode is "ignore".
        """
        if not copied or self.settings.transferred == "ignore":
            return None
        blocks = self.partition.blocks
        # one block behind the prefix stays active: the rise test that thaws it watches that one
        k = self.copied = min(self.partition.copied_prefix(copied), self.max_frozen,
                              len(blocks) - 2)
        if not k:
            return (f"freezing: the warm start copied no front module unchanged ({blocks[0]} "
                    "was widened, deepened or initialised); every module is judged as usual")
        said = f"freezing: the warm start copied {', '.join(blocks[:k])} unchanged"
        if self.settings.transferred == "freeze":
            self.set_boundary(k, 0, "copied unchanged from the warm start's parent")
            if self.gradients is not None:
                return f"{said}: they start frozen (the gradient-norm test never thaws)"
            return (f"{said}: they start frozen, and thaw if {blocks[k]} moves "
                    f"{convergence.RISE_FACTOR:g}x faster per unit of learning rate than in its "
                    f"first reference cycle for {self.settings.patience} cycles")
        return (f"{said}: they are judged from step 0 against the parent's weights and may "
                f"freeze before the bootstrap ({self.settings.bootstrap_steps} steps) is over")

    def _reason(self, proposal: int) -> str:
        if self._decision_reason is not None and self._decision_reason[0] == proposal \
                and self._decision_reason[1]:
            return self._decision_reason[1]
        return "rank 0 decided"

    def set_boundary(self, k: int, step: int, reason: str) -> Event:
        """Freeze exactly the first `k` blocks (0: none) now, whatever the policy says.

        The policy calls it; so do fixed schedules (the FreezeOut-like benchmark baseline) and
        users who freeze by hand. Unfreezing clears the re-activated parameters' optimizer
        state; freezing deeper advances the cached outputs through the newly frozen blocks
        (`cache.follow`), other changes forget them. Freezing keeps the deeper blocks'
        convergence streaks, unfreezing restarts the re-activated blocks'; any change
        refreshes the reference, once. The caller re-wraps `trainable_module()` afterwards.

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
        if self.cache is not None:  # deeper: cached outputs go through the new blocks only
            activation_cache.follow(self.cache, self.partition.bridge(old, k) if 0 < old < k
                                    else None)
        if k > old:
            self.convergence.mark_frozen(k)
            if self.gradients is not None:
                self.gradients.mark_frozen(k)
            self._cycles_since_freeze = 0
        else:
            self.convergence.mark_unfrozen(k)
        self._refresh_owed = False
        if self._refreshes:
            self._refresh(step)
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
            "test": self.settings.test,
            "transferred": {"mode": self.settings.transferred,
                            "modules": list(self.partition.blocks[:self.copied])},
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for checkpoints (`STATE_VERSION`): the boundary, its history and
        counters, the learning-rate phase and the blocks' peaks and streaks."""
        return {"version": STATE_VERSION, "boundary": self.boundary,
                "events": [e.to_json() for e in self.events],
                "skipped_flops_sum": self._skipped_flops_sum, "steps": self._steps,
                "phase_start": self.phase_start, "phase_lr": self.phase_lr,
                "copied": self.copied, "convergence": self.convergence.state_dict(),
                "gradients": None if self.gradients is None else self.gradients.state_dict()}

    def load_state_dict(self, state: dict[str, Any], *, step: int = 0) -> None:
        """Restore a checkpoint's frozen prefix, phase and convergence state.

        Reads this version's states and unversioned ones (whose rate at the last freeze
        becomes the phase's rate; their plasticity histories start afresh).

        Raises:
            ValueError: a state from a newer version.
        """
        version = int(state.get("version", 1))
        if version > STATE_VERSION:
            raise ValueError(f"the checkpoint's freezing state has version {version}; this "
                             f"trainer reads up to {STATE_VERSION} (resume with a newer image)")
        self.events = [Event(e["kind"], tuple(e["modules"]), e["step"], e["boundary"],
                             e["reason"]) for e in state.get("events", [])]
        self._skipped_flops_sum = float(state.get("skipped_flops_sum", 0.0))
        self._steps = int(state.get("steps", 0))
        self.copied = min(int(state.get("copied", 0)), self.max_frozen)
        boundary = min(int(state.get("boundary", 0)), self.max_frozen)
        if boundary:
            self.set_boundary(boundary, step, "resumed from the checkpoint")
            self.events.pop()
        if "convergence" in state:
            self.convergence.load_state_dict(state["convergence"])
        if self.gradients is not None and state.get("gradients"):
            self.gradients.load_state_dict(state["gradients"])
        phase_lr = state.get("phase_lr", state.get("lr_at_freeze"))
        self.phase_start = int(state.get("phase_start", 0))
        self.phase_lr = None if phase_lr is None else float(phase_lr)

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


def _forkable(model: nn.Module, settings: Settings) -> bool:
    """Whether the reference process may be forked from this one with a copy of `model`
    rather than spawned to rebuild it from the spec: a spawned process spends seconds of CPU
    importing torch, as much as a short trial's freezing saves. Only for a model on the CPU,
    unsharded, in a process that never initialised CUDA (a forked child cannot use the
    parent's CUDA state), with a single-threaded reference (GNU OpenMP's thread pool does
    not survive a fork; one thread never uses it)."""
    cuda_used = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return (settings.reference_threads == 1 and not cuda_used and not _sharded(model)
            and all(p.device.type == "cpu" for p in model.parameters()))


def _sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards `model` (its module is imported by then: no import cost else)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)
