"""Freezing from what a warm start copied: the unchanged tensors of a transform, the leading
natural blocks made of them (copied vs widened vs deepened vs new), and what the `Freezer` does
with them per ``spec.freezing.transferred``.

Freezers here are built as ranks that do not decide (``main=False``: no reference process),
so nothing waits on a worker.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from kiln import api, cli, models
from kiln.warmstart import graph, transform
from kiln_trainer.freezing import controller, convergence, partition

SHAPE = (1, 8, 8)


def _resnet(blocks: list[int], width: int) -> nn.Module:
    return models.get_model("small_resnet", input_shape=SHAPE, blocks=blocks, width=width)


def _warm(child_blocks: list[int], child_width: int) -> tuple[nn.Module,
                                                               transform.TransformResult]:
    """A [1, 1, 1] x 8 parent's weights transformed into a fresh child, loaded."""
    torch.manual_seed(0)
    parent, child = _resnet([1, 1, 1], 8), _resnet(child_blocks, child_width)
    result = transform.warm_start_state(parent.state_dict(), graph.extract(parent, SHAPE),
                                        child, SHAPE)
    child.load_state_dict(result.state_dict)
    return child, result


def test_unchanged_lists_exactly_the_tensors_equal_to_their_parent_tensor() -> None:
    torch.manual_seed(0)
    parent = _resnet([1, 1, 1], 8)
    same, result = _warm([1, 1, 1], 8)
    assert set(result.unchanged) == set(parent.state_dict())  # every tensor, buffers too
    for key in result.unchanged:
        assert torch.equal(same.state_dict()[key], parent.state_dict()[key]), key
    _, wider = _warm([1, 1, 1], 12)
    widened = set(wider.transferred_params) - set(wider.unchanged)
    assert "stem.0.weight" in widened and "stages.0.0.conv1.weight" in widened
    # the ten classes' biases alone keep their parent's shape and values
    assert {k for k in wider.unchanged if k.endswith(("weight", "bias"))} == {"head.2.bias"}


def test_a_meta_model_dry_run_still_says_what_is_unchanged() -> None:
    # the operator counts a transfer on the meta device, where no value can be compared
    parent = _resnet([1, 1, 1], 8)
    with torch.device("meta"):
        child = _resnet([1, 1, 1, 1], 8)
    result = transform.warm_start_state(parent.state_dict(), graph.extract(parent, SHAPE),
                                        child, SHAPE)
    assert "stages.2.0.conv2.weight" in result.unchanged
    assert not any(k.startswith("stages.3.") for k in result.unchanged)


@pytest.mark.parametrize(("blocks", "width", "copied"), [
    pytest.param([1, 1, 1], 8, ["stem", "stages.0.0", "stages.1.0", "stages.2.0"],
                 id="same-shape: every block but the head"),
    pytest.param([1, 1, 1, 1], 8, ["stem", "stages.0.0", "stages.1.0", "stages.2.0"],
                 id="a new stage behind the copied three"),
    pytest.param([2, 1, 1], 8, ["stem", "stages.0.0"],
                 id="an inserted block ends the prefix"),
    pytest.param([1, 1, 1], 12, [], id="widened from the stem on: nothing"),
])
def test_the_copied_prefix_is_the_leading_blocks_copied_unchanged(
        blocks: list[int], width: int, copied: list[str]) -> None:
    child, result = _warm(blocks, width)
    split = partition.Partition.of(child, torch.zeros(1, *SHAPE))
    assert split.blocks[:split.copied_prefix(result.unchanged)] == tuple(copied)
    assert split.copied_prefix(set(result.unchanged) - {"stages.0.0.bn1.weight"}) == min(
        1, len(copied))  # one parameter not copied ends the prefix at its block


def _freezer(child: nn.Module, transferred: str, *, epochs: int = 10) -> controller.Freezer:
    spec = api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "c"},
        "spec": {"model": {"architecture": "small_resnet", "inputShape": list(SHAPE)},
                 "dataset": {"name": "digits"}, "training": {"epochs": epochs},
                 "freezing": {"transferred": transferred}}}).spec
    settings = controller.Settings.from_job(spec, steps_per_epoch=20)
    optimizer = torch.optim.SGD(child.parameters(), lr=0.1)
    return controller.Freezer(child, None, torch.zeros(4, *SHAPE), settings,
                              optimizer=optimizer, main=False)


def test_freeze_starts_the_copied_prefix_frozen_at_step_0_and_leaves_one_block_watched() -> None:
    child, result = _warm([1, 1, 1], 8)
    freezer = _freezer(child, "freeze")
    said = freezer.start_from_transfer(result.unchanged)
    # every body block was copied; the last stays active so a rise behind the prefix can show
    assert freezer.frozen_modules == ("stem", "stages.0.0", "stages.1.0")
    assert said is not None and "start frozen" in said and "stages.2.0 moves 3x faster" in said
    (event,) = freezer.events
    assert (event.kind, event.step, event.boundary) == ("froze", 0, 3)
    assert all(not p.requires_grad for p in freezer.partition.params(3))
    assert freezer.summary()["transferred"] == {
        "mode": "freeze", "modules": ["stem", "stages.0.0", "stages.1.0"]}


def test_judge_leaves_everything_trainable_and_lets_only_the_copies_freeze_early() -> None:
    child, result = _warm([2, 1, 1], 8)
    freezer = _freezer(child, "judge")
    said = freezer.start_from_transfer(result.unchanged)
    assert said is not None and "judged from step 0" in said
    assert freezer.boundary == 0 and not freezer.events and freezer.copied == 2
    # every block converged (as the reference would say): before the bootstrap is over only
    # the copies may go, after it the policy's usual prefix
    names = freezer.convergence.blocks
    for level in (1.0, 0.01, 0.01):
        for _ in range(3):
            freezer.convergence.take(dict.fromkeys(names, level), first_active=0)
        freezer.convergence.close_cycle(first_active=0)
        freezer.convergence.new_cycle()
    early = freezer.settings.bootstrap_steps - 1
    assert 0 < freezer._proposal(early) <= 2
    assert freezer._proposal(freezer.settings.bootstrap_steps) > 0
    restored = _freezer(_warm([2, 1, 1], 8)[0], "judge")
    restored.load_state_dict(freezer.state_dict())
    assert restored.copied == 2  # a resumed run keeps judging its copies early


@pytest.mark.parametrize("transferred", ["ignore", "freeze", "judge"])
def test_nothing_happens_without_copies_or_when_told_to_ignore_them(transferred: str) -> None:
    child, result = _warm([1, 1, 1], 12)  # widened: no copied block
    freezer = _freezer(child, transferred)
    said = freezer.start_from_transfer(result.unchanged)
    assert freezer.boundary == 0 and freezer.copied == 0
    assert (said is None) == (transferred == "ignore")
    same, copied = _warm([1, 1, 1], 8)
    ignoring = _freezer(same, "ignore")
    assert ignoring.start_from_transfer(copied.unchanged) is None
    assert ignoring.boundary == 0 and ignoring.copied == 0


def test_a_prefix_frozen_during_a_warm_up_is_measured_against_the_full_rate() -> None:
    blocks = ("stem", "layer1", "layer2", "layer3")
    state = convergence.Convergence(blocks, window=3, tolerance=1e-9, peak_fraction=0.1,
                                    patience=2)

    def cycle(value: float, scale: float) -> None:
        for j in (1, 2, 3):
            state.take(dict.fromkeys(blocks, value * j / 3), first_active=2, scale=scale)
        state.close_cycle(first_active=2)
        state.new_cycle()

    state.mark_frozen(2)  # at step 0, as `transferred: freeze` does
    # the first cycle, at a hundredth of the rate: per unit of rate a hundred times too plastic
    cycle(1.0, scale=0.01)
    state.rate_rose()  # the warm-up goes on: the baseline is retaken
    cycle(0.05, scale=1.0)  # the full rate's baseline
    for _ in range(2):  # layer2 moves 10x as fast as then: a rise a warm-up baseline would hide
        cycle(0.5, scale=1.0)
    assert state.risen(2)


@pytest.mark.parametrize(("spec", "message"), [
    ({"freezing": {"transferred": "Freeze"}},
     "spec.freezing.transferred: Input should be 'judge', 'freeze' or 'ignore' (got 'Freeze')"),
    ({"freezing": {"transferred": 1}}, "spec.freezing.transferred: Input should be"),
    ({"freezing": {"enabled": False, "transferred": "freeze"}},
     ("spec.freezing.transferred: freeze needs spec.freezing.enabled: true (got enabled: "
      "false); enable freezing, or leave transferred at ignore")),
    ({"freezing": {"transferred": "judge"}, "warmStart": {"parent": "small_cnn-0a0b0c0d"},
      "training": {"peft": {"rank": 4, "targetModules": ["head.2"]}}},
     ("spec.freezing.transferred: a LoRA job (spec.training.peft) trains only its adapter, "
      "so nothing of it freezes (got judge); leave transferred at ignore")),
])
def test_kiln_validate_refuses_a_transferred_mode_that_is_wrong_or_can_do_nothing(
        tmp_path: Path, spec: dict[str, Any], message: str) -> None:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t"},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": list(SHAPE)}, **spec}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        code = cli.main(["validate", str(path)])
    assert code == 2 and message in " ".join(said.getvalue().split()), said.getvalue()
