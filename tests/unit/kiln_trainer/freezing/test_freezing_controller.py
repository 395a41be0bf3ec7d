"""kiln_trainer.freezing.controller: the Freezer around a real training loop on digits.

The reference model runs in its real worker process where a test needs its answers; only the
policy's knobs are set so that decisions come within a few dozen steps (tolerance and peak
fraction high: every window counts as converged). Tests that set the boundary by hand build the
Freezer as a rank that does not decide (``main=False``: no worker process to start). One test
scripts the reference's answers (`_ScriptedReference`), since it needs a pace of plasticity
that real training does not give on demand.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kiln import api, models
from kiln_trainer import data, optim
from kiln_trainer.distributed import batching
from kiln_trainer.freezing import controller, reference

SPEC = api.ModelSpec.model_validate(
    {"architecture": "small_cnn", "inputShape": [1, 8, 8], "args": {"depth": 3, "width": 8}}
)


@pytest.fixture(scope="module")
def splits() -> data.Splits:
    spec = api.DatasetSpec.model_validate({"name": "digits", "maxSamples": 400})
    return data.load(spec, input_shape=[1, 8, 8], seed=0)


def _setup(
    splits: data.Splits, *, lr: float = 0.05, main: bool = True, **knobs: Any
) -> tuple[nn.Module, torch.optim.Optimizer, controller.Freezer]:
    torch.manual_seed(0)
    model = models.build(SPEC)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-3)
    settings = controller.Settings(
        **{
            "check_every_steps": 1,
            "window": 3,
            "tolerance": 100.0,
            "peak_fraction": 1.0,
            "patience": 1,
            "probe_batch_size": 16,
            "reference": "fp32",
            **knobs,
        }
    )
    probe = controller.probe_batch(splits.validation, settings.probe_batch_size)
    freezer = controller.Freezer(
        model, SPEC, probe, settings, optimizer=optimizer, num_samples=len(splits.train),
        main=main,
    )  # type: ignore[arg-type]
    return model, optimizer, freezer


def _steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    freezer: controller.Freezer,
    splits: data.Splits,
    n: int,
    *,
    first: int = 0,
    lr: float | None = None,
) -> list[controller.Event]:
    """Train `n` steps the way kiln_trainer.loop does; return the boundary events."""
    changes = []
    batches = batching.train_batches(
        splits.train, batch_size=32, seed=0, epoch=first, with_indices=True
    )
    step = first
    while step < first + n:
        for inputs, targets, indices in batches:
            trainable = freezer.trainable_module()
            model.train()
            freezer.train_mode()
            loss = F.cross_entropy(trainable(freezer.prefix(inputs, indices)), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            event = freezer.after_step(step, lr=lr or optimizer.param_groups[0]["lr"])
            if event is not None:
                changes.append(event)
            if step >= first + n:
                break
    return changes


def _wait_for_results(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    freezer: controller.Freezer,
    splits: data.Splits,
    boundary: int,
) -> tuple[list[controller.Event], int]:
    """Train until the boundary reaches `boundary` (bounded by pytest-timeout); the events
    and the next step (how long that took depends on the reference process's start-up)."""
    events: list[controller.Event] = []
    step = 0
    while freezer.boundary < boundary:
        events += _steps(model, optimizer, freezer, splits, 8, first=step)
        step += 8
    return events, step


def test_frozen_parameters_stay_bit_identical_and_never_get_a_gradient(splits) -> None:
    model, optimizer, freezer = _setup(splits, cache=True, main=False)
    with freezer:
        freezer.load_state_dict({"boundary": 2})
        frozen = freezer.partition.params(2)
        before = [p.detach().clone() for p in frozen]
        state_before = [dict(optimizer.state.get(p, {})) for p in frozen]
        freezer.settings = controller.Settings(
            **{**freezer.settings.__dict__, "check_every_steps": 10_000}
        )
        _steps(model, optimizer, freezer, splits, 6)
        assert all(torch.equal(a, p) for a, p in zip(before, frozen, strict=True))
        assert all(p.grad is None and not p.requires_grad for p in frozen)
        assert [dict(optimizer.state.get(p, {})) for p in frozen] == state_before
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert trainable and all(p.grad is not None for p in trainable)


@pytest.mark.process
def test_the_converged_prefix_freezes_in_one_decision_up_to_the_cap(
        splits, monkeypatch: pytest.MonkeyPatch) -> None:
    # without the per-decision share cap (its own test is in test_freezing_policy.py)
    monkeypatch.setattr(controller, "MAX_DECISION_SHARE", 1.0)
    model, optimizer, freezer = _setup(splits, max_frozen_fraction=0.5)
    with freezer:
        events, step = _wait_for_results(model, optimizer, freezer, splits, 1)
        events += _steps(model, optimizer, freezer, splits, 40, first=step)
    assert freezer.max_frozen == len(freezer.partition.blocks) // 2 == 2
    # every module converges in every cycle here: the whole allowed prefix goes at once (what
    # follows depends on which probes a loaded machine's reference process answered in time)
    event = events[0]
    assert (event.kind, event.boundary) == ("froze", 2)
    assert event.modules == freezer.partition.blocks[:2] == ("stem", "blocks.0")
    assert re.search(r"plasticity \S+ .*, converged for \d+ reference cycles", event.reason)
    assert freezer.partition.blocks[-1] not in freezer.frozen_modules  # never the head


def test_decisions_are_staged_by_share_and_spaced_by_patience_cycles(splits) -> None:
    # Every module counts as converged; only the per-decision share and the spacing of one
    # decision per `patience` closed cycles hold the prefix back.
    _, _, freezer = _setup(splits, max_frozen_fraction=0.8, patience=2, main=False)
    with freezer:
        convergence = freezer.convergence
        convergence._streaks = [2] * len(convergence.blocks)  # converged for `patience` cycles
        first = freezer._proposal(step=10)
        share = freezer.partition.backward_flops_fraction
        assert first >= 1 and (first == 1 or share(first) <= controller.MAX_DECISION_SHARE
                               + 1e-9)
        freezer.set_boundary(first, 10, "the first decision")
        assert freezer._proposal(step=11) == first  # no cycle closed since the freeze
        freezer._cycles_since_freeze = 1
        assert freezer._proposal(step=12) == first  # one of `patience`
        freezer._cycles_since_freeze = 2
        assert freezer._proposal(step=13) > first


@pytest.mark.process
def test_a_step_decay_keeps_the_frozen_prefix_and_starts_a_denser_phase(splits) -> None:
    model, optimizer, freezer = _setup(splits, check_every_steps=2, max_frozen_fraction=0.5,
                                       peak_fraction=0.1, tolerance=0.01)
    with freezer:
        freezer.set_boundary(2, 0, "by hand")
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
        events: list[controller.Event] = []
        step = 0
        while "blocks.1" not in freezer.convergence.normalised:  # a cycle closed
            events += _steps(model, optimizer, freezer, splits, 4, first=step)
            step += 4
        before = freezer.convergence.normalised["blocks.1"]
        scheduler.step()  # the decay, lr 0.05 -> 0.005
        drop = step + 1
        while freezer.convergence.normalised["blocks.1"] == before:  # a cycle after the drop
            events += _steps(model, optimizer, freezer, splits, 4, first=step)
            step += 4
        after = freezer.convergence.normalised["blocks.1"]
        assert freezer.phase_start == drop and freezer.phase_lr == pytest.approx(0.005)
        assert freezer.is_probe_step(drop + 2) and not freezer.is_probe_step(drop + 3)
        assert not freezer.is_probe_step(drop + 14) and freezer.is_probe_step(drop + 16)
        # the phase's first cycle after the drop is the new baseline of the rise test
        for _ in range(4):
            events += _steps(model, optimizer, freezer, splits, 4, first=step)
            step += 4
        risen = freezer.convergence.risen(2)
    assert after > 0 and not risen
    assert events == [] and freezer.boundary == 2


def test_cached_prefix_outputs_match_the_computed_ones_within_fp16(splits) -> None:
    model, _optimizer, freezer = _setup(splits, cache=True, main=False)
    with freezer:
        freezer.load_state_dict({"boundary": 2})
        assert freezer.trainable_module() is not model, "small_cnn splits after blocks.0"
        model.eval()
        inputs, _, indices = next(
            iter(
                batching.train_batches(splits.train, batch_size=32, seed=0, epoch=0, with_indices=True)
            )
        )
        computed = freezer.prefix(inputs, indices)  # fills the cache
        cached = freezer.prefix(inputs, indices)
        assert computed.dtype == cached.dtype == torch.float32
        torch.testing.assert_close(cached, computed, atol=1e-3, rtol=1e-3)
        suffix = freezer.trainable_module()
        torch.testing.assert_close(suffix(cached), model(inputs), atol=1e-3, rtol=1e-3)


@pytest.mark.process
def test_a_cpu_models_reference_is_forked_and_a_multithreaded_one_spawned(splits) -> None:
    # A spawned reference spends seconds of CPU importing torch, a short trial's whole saving;
    # forked, it starts from a copy of the model, and freezing still decides from its answers.
    model, optimizer, freezer = _setup(splits)
    with freezer:
        assert freezer.worker is not None and freezer.worker.forked
        events, _ = _wait_for_results(model, optimizer, freezer, splits, 1)
    assert events[0].kind == "froze"
    # GNU OpenMP's thread pool does not survive a fork: a multi-threaded reference is spawned
    _, _, threaded = _setup(splits, reference_threads=2)
    with threaded:
        assert threaded.worker is not None and not threaded.worker.forked


@pytest.mark.process
def test_a_stopped_reference_never_stalls_training(splits) -> None:
    model, optimizer, freezer = _setup(splits)
    with freezer:
        assert freezer.worker is not None
        os.kill(freezer.worker.pid, signal.SIGSTOP)
        try:
            events = _steps(model, optimizer, freezer, splits, 30)
        finally:
            os.kill(freezer.worker.pid, signal.SIGCONT)
    assert events == [] and freezer.boundary == 0


@pytest.mark.process
def test_state_dict_round_trip_keeps_the_frozen_prefix(splits) -> None:
    model, optimizer, freezer = _setup(splits)
    with freezer:
        _wait_for_results(model, optimizer, freezer, splits, 1)
        state = freezer.state_dict()
    _model2, _optimizer2, resumed = _setup(splits, main=False)  # loading needs no reference
    with resumed:
        resumed.load_state_dict(state, step=123)
        assert resumed.boundary == freezer.boundary >= 1
        assert resumed.events == freezer.events
        assert not any(p.requires_grad for p in resumed.partition.params(resumed.boundary))


def test_settings_from_a_job_pick_cadence_bootstrap_and_cache() -> None:
    job = api.parse_job(
        {
            "apiVersion": "kiln.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "x"},
            "spec": {
                "model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                "dataset": {"augmentation": "flip-crop"},
                "training": {
                    "epochs": 10,
                    "lrSchedule": {"name": "step", "gamma": 0.8, "warmupEpochs": 2},
                },
            },
        }
    )
    settings = controller.Settings.from_job(job.spec, steps_per_epoch=40)
    assert settings.check_every_steps == 5  # 8 per epoch, not closer than 5 steps
    assert controller.Settings.from_job(job.spec, steps_per_epoch=20).check_every_steps == 5
    # 10 epochs of 400 steps: 8 per epoch would be 50 steps apart, 200 over the budget 20
    assert controller.Settings.from_job(job.spec, steps_per_epoch=400).check_every_steps == 20
    # a long budget of short epochs keeps 8 per epoch
    long = job.model_copy(update={"spec": job.spec.model_copy(update={
        "training": job.spec.training.model_copy(update={"epochs": 1000})})})
    assert controller.Settings.from_job(long.spec, steps_per_epoch=400).check_every_steps == 50
    assert (settings.window, settings.probe_batch_size) == (3, 16)
    assert settings.plateau_ratio == 0.0  # the phase test is opt-in: it costs accuracy
    opted = job.model_copy(update={"spec": job.spec.model_copy(update={
        "freezing": job.spec.freezing.model_copy(update={"plateau_ratio": 0.5})})})
    assert controller.Settings.from_job(opted.spec, steps_per_epoch=40).plateau_ratio == 0.5
    assert settings.bootstrap_steps == 80  # two warm-up epochs beat 10% of 400 steps
    assert settings.cache is False  # random augmentation: outputs differ every epoch
    assert 0.8 <= settings.phase_lr_ratio < 0.81  # one step decay starts a phase
    factor = optim.lr_factor(
        80, schedule=job.spec.training.lr_schedule, epochs=10, steps_per_epoch=40
    )
    assert factor == 1.0


def test_checkpoint_state_is_versioned_and_unversioned_states_still_load(splits) -> None:
    *_, freezer = _setup(splits, main=False)
    with freezer:
        freezer.set_boundary(1, 7, "by hand")
        state = freezer.state_dict()
        assert state["version"] == controller.STATE_VERSION
        assert state["convergence"]["blocks"] == list(freezer.partition.blocks[:-1])
        old = {"boundary": 2, "events": [], "lr_at_freeze": 0.05, "skipped_flops_sum": 3.0,
               "steps": 10}  # what trainers before the versioned state wrote
        freezer.load_state_dict(old, step=10)
        assert (freezer.boundary, freezer.phase_lr, freezer.phase_start) == (2, 0.05, 0)
        with pytest.raises(ValueError, match="version 99"):
            freezer.load_state_dict({**state, "version": 99})
    _model2, _optimizer2, resumed = _setup(splits, main=False)
    with resumed:
        resumed.load_state_dict(state, step=7)
        assert resumed.boundary == 1 and resumed.state_dict()["convergence"] == \
            state["convergence"]


@pytest.mark.process
def test_a_measured_rise_behind_the_prefix_unfreezes_it(
        splits, monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawned, as a GPU job's reference is: the baseline is the cycle its first answers close.
    # A forked one answers from the first step, and with no converged prefix behind this
    # hand-set boundary the baseline then varies with when answers land (failed 1 run in 4).
    monkeypatch.setattr(controller, "_forkable", lambda *_: False)
    model, optimizer, freezer = _setup(splits, lr=0.005, check_every_steps=2,
                                       max_frozen_fraction=0.5, peak_fraction=0.1,
                                       tolerance=0.01)
    assert freezer.worker is not None and not freezer.worker.forked
    with freezer:
        freezer.set_boundary(2, 0, "by hand")
        step = 0
        while "blocks.1" not in freezer.convergence.normalised:  # the baseline's cycle
            assert _steps(model, optimizer, freezer, splits, 4, first=step) == []
            step += 4
        # the same learning rate, 20x the gradient: blocks.1 now moves 20x faster per unit
        # of learning rate than when the prefix froze
        events: list[controller.Event] = []
        batches = batching.train_batches(splits.train, batch_size=32, seed=1, epoch=0)
        for _ in range(20):  # epochs: a rise is measured within the first (a bound, not a wait)
            if events:
                break
            for inputs, targets in batches:
                model.train()
                freezer.train_mode()
                logits = freezer.trainable_module()(freezer.prefix(inputs))
                loss = 20 * F.cross_entropy(logits, targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                event = freezer.after_step(step, lr=optimizer.param_groups[0]["lr"])
                if event is not None:
                    events.append(event)
                    break
    assert events, "no rise measured in 20 epochs at 20x the gradient"
    (event,) = events
    assert (event.kind, event.boundary) == ("unfroze", 0)
    assert "rose above 3x" in event.reason and freezer.phase_start == 0


class _ScriptedReference:
    """Stands in for the reference process: answers each probe at once with a plasticity that
    grows with the probes since the refresh (a block that still moves drifts away from its
    snapshot, so the slope test never passes) times `pace`, which the test sets per step."""

    pace = 1.0

    def __init__(self, _model: Any, blocks: Any, **_: Any) -> None:
        self.blocks, self.noise_floor = tuple(blocks), {}
        self.ready, self.alive = True, True
        self._version, self._since_refresh = 0, 0
        self._answers: list[reference.ProbeResult] = []

    def refresh(self, version: int, *_: Any) -> None:
        self._version, self._since_refresh = version, 0

    def submit(self, probe_id: int, version: int, _inputs: Any, activations: Any) -> bool:
        self._since_refresh += 1
        value = type(self).pace * self._since_refresh
        self._answers.append(reference.ProbeResult(
            probe_id, version, {name: value for name in activations}, 0.0))
        return True

    def poll(self) -> list[reference.ProbeResult]:
        answers, self._answers = self._answers, []
        return [a for a in answers if a.version == self._version]

    def close(self) -> None:
        self.alive = False


def test_the_peak_is_taken_after_the_bootstrap_so_a_fast_start_freezes_nothing(
        splits, monkeypatch: pytest.MonkeyPatch) -> None:
    # The bootstrap's cycles move 100x faster per unit of learning rate than the steady pace
    # after it (a network leaving its random initialisation does); a peak taken from them would
    # freeze the stem as soon as the bootstrap ends. Only a real fall below a tenth of the pace
    # after the bootstrap freezes it.
    monkeypatch.setattr(controller.reference, "ReferenceWorker", _ScriptedReference)
    monkeypatch.setattr(_ScriptedReference, "pace", 100.0)
    model, optimizer, freezer = _setup(splits, lr=0.01, tolerance=0.1, peak_fraction=0.1,
                                       patience=2, bootstrap_steps=12, max_frozen_fraction=0.5)
    with freezer:
        assert _steps(model, optimizer, freezer, splits, 12) == []
        monkeypatch.setattr(_ScriptedReference, "pace", 1.0)
        assert _steps(model, optimizer, freezer, splits, 48, first=12) == []
        assert freezer.convergence.normalised["stem"] > 0.5  # measured, at the steady pace
        monkeypatch.setattr(_ScriptedReference, "pace", 0.02)
        events = _steps(model, optimizer, freezer, splits, 60, first=60)
    assert events and events[0].kind == "froze" and events[0].modules[0] == "stem"
    assert "of its peak per unit of learning rate" in events[0].reason, events[0].reason
