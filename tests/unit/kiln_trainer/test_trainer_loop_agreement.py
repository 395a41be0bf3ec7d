"""kiln_trainer.loop.train_one_epoch across ranks: one agreement per step, rank 0's boundary.

A stand-in context plays the other ranks (its `agree` answers as the collective would), so
these run in one process; tests/integration/test_trainer_ddp_loop.py runs real gloo ranks.
The follower freezer (``main=False``) starts no reference process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils import data as torch_data

from kiln import api, models
from kiln_trainer import loop
from kiln_trainer.distributed import batching, parallel
from kiln_trainer.freezing import controller

SPEC = api.ModelSpec.model_validate(
    {"architecture": "small_cnn", "inputShape": [1, 8, 8], "args": {"depth": 3, "width": 4}})



@dataclasses.dataclass
class OtherRanks:
    """`parallel.Context.agree` as rank 1 of 2 sees it: rank 0 asks to stop at `stop_at` (1-based
    call) and proposes `boundaries[call]` (default 0); records this rank's arguments."""

    stop_at: int | None = None
    boundaries: dict[int, int] = dataclasses.field(default_factory=dict)
    calls: list[tuple[bool, int]] = dataclasses.field(default_factory=list)

    def agree(self, *, stop: bool, decision: int) -> tuple[bool, int]:
        self.calls.append((stop, decision))
        call = len(self.calls)
        return stop or call == self.stop_at, self.boundaries.get(call, 0)


def _setup(*, freezing: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(0)
    model = models.build(SPEC)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    freezer = None
    if freezing:
        settings = controller.Settings(check_every_steps=1, window=3, reference="fp32")
        probe = torch.randn(4, 1, 8, 8)
        freezer = controller.Freezer(model, SPEC, probe, settings, optimizer=optimizer,
                                     num_samples=64, main=False)
    return model, optimizer, scheduler, freezer


def _batches(*, with_indices: bool) -> Iterator[Any]:
    generator = torch.Generator().manual_seed(1)
    dataset = torch_data.TensorDataset(torch.randn(64, 1, 8, 8, generator=generator),
                                       torch.randint(0, 10, (64,), generator=generator))
    return iter(batching.train_batches(dataset, batch_size=8, seed=0, epoch=0,
                                       shard=(1, 2), with_indices=with_indices))


def test_a_stop_on_another_rank_ends_the_stretch_after_the_step_it_was_agreed() -> None:
    model, optimizer, scheduler, _ = _setup(freezing=False)
    ranks = OtherRanks(stop_at=3)
    stats = loop.train_one_epoch(model, _batches(with_indices=False), optimizer=optimizer,
                                 scheduler=scheduler, device=torch.device("cpu"),
                                 ctx=ranks)  # type: ignore[arg-type]
    assert stats.steps == 3 and stats.samples == 3 * 4  # this rank's half of each batch
    assert ranks.calls == [(False, 0)] * 3  # one agreement per step, nothing to propose


def test_a_follower_takes_rank_0s_boundary_at_the_step_it_was_agreed() -> None:
    model, optimizer, scheduler, freezer = _setup(freezing=True)
    ranks = OtherRanks(boundaries={2: 1})
    stats = loop.train_one_epoch(model, _batches(with_indices=True), optimizer=optimizer,
                                 scheduler=scheduler, device=torch.device("cpu"),
                                 freezer=freezer, first_step=10, ctx=ranks)  # type: ignore[arg-type]
    assert freezer.worker is None  # followers run no reference process
    assert [decision for _, decision in ranks.calls] == [0, 0]  # it proposes what it has
    event = stats.boundary_event
    assert stats.steps == 2 and (event.kind, event.modules, event.step) == ("froze", ("stem",), 12)
    assert event.reason == "rank 0 decided"
    assert not any(p.requires_grad for p in model.stem.parameters())
    assert freezer.trainable_module() is not model  # the suffix: the caller re-wraps it
    freezer.close()


def test_a_follower_keeps_the_prefix_across_a_learning_rate_drop_and_follows_rank_0() -> None:
    *_, freezer = _setup(freezing=True)
    assert freezer.apply(1, 5).boundary == 1  # rank 0's decision, at lr 0.05
    assert freezer.propose(6, lr=0.05) == 1
    assert freezer.apply(1, 6) is None
    assert freezer.propose(7, lr=0.005) == 1  # the drop starts a new phase, as on rank 0
    assert freezer.apply(1, 7) is None and freezer.phase_start == 7
    assert freezer.is_probe_step(8)  # the same probe steps as rank 0's
    event = freezer.apply(0, 8)  # rank 0 measured a rise behind the prefix
    assert (event.kind, event.boundary, event.reason) == ("unfroze", 0, "rank 0 decided")
    freezer.close()


def test_one_process_agrees_with_itself_without_any_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def collective(*_: Any, **__: Any) -> None:
        raise AssertionError("a collective in a one-process run")

    for name in ("all_reduce", "broadcast", "broadcast_object_list", "all_gather_object",
                 "barrier"):
        monkeypatch.setattr(parallel.dist, name, collective)
    ctx = parallel.Context()
    assert ctx.agree(stop=True, decision=3) == (True, 3)
    assert ctx.all_reduce_sum([1.5, 2]) == [1.5, 2.0]
    model, optimizer, scheduler, _ = _setup(freezing=False)
    stats = loop.train_one_epoch(model, _batches(with_indices=False), optimizer=optimizer,
                                 scheduler=scheduler, device=torch.device("cpu"), max_steps=2)
    assert stats.steps == 2
