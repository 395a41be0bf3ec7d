"""The gradient-norm freezing test (``spec.freezing.test: gradientNorm``): per-interval gradient
norms, the percentile threshold, and the `Freezer` freezing the settled front prefix with it.

The Freezer tests set each block's ``.grad`` themselves, so which blocks settle is decided by
the test, not by how a run happens to train.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kiln import api, cli, models
from kiln_trainer import loop
from kiln_trainer.freezing import controller, gradient_norm

SHAPE = (1, 8, 8)
BLOCKS = ("stem", "stages.0.0", "stages.1.0", "stages.2.0")  # small_resnet [1, 1, 1]'s, no head


def _interval(test: gradient_norm.GradientNormTest, norms: list[float], *,
              first_active: int = 0, steps: int = 3) -> None:
    for _ in range(steps):
        test.accumulate([[torch.full((2, 2), n / 2)] for n in norms],  # norm of 4 x n/2 = n
                        first_active=first_active)
    test.close_interval(first_active=first_active)


def test_the_settled_front_blocks_pass_and_the_first_moving_one_ends_the_prefix() -> None:
    test = gradient_norm.GradientNormTest(BLOCKS, percentile=50)
    _interval(test, [1.0, 2.0, 1.0, 1.0])
    assert test.threshold is None and test.passed_prefix(0) == 0  # no baseline yet
    _interval(test, [1.0, 2.2, 3.0, 5.0])
    assert test.changes == pytest.approx(
        {"stem": 0.0, "stages.0.0": 0.1, "stages.1.0": 2.0, "stages.2.0": 4.0})
    assert test.threshold == pytest.approx(1.05)  # the median of the four changes
    assert test.passed_prefix(0) == 2
    assert "0.1 (relative)" in test.reason("stages.0.0")
    # a settled block behind a moving one never starts a prefix
    _interval(test, [9.0, 2.2, 3.0, 5.0])
    assert test.passed_prefix(0) == 0


def test_frozen_blocks_leave_the_comparison_and_lose_their_baseline() -> None:
    test = gradient_norm.GradientNormTest(BLOCKS, percentile=50)
    _interval(test, [1.0, 1.0, 1.0, 1.0])
    test.mark_frozen(2)
    _interval(test, [0.0, 0.0, 1.0, 3.0], first_active=2)  # frozen blocks have no gradients
    assert set(test.changes) == {"stages.1.0", "stages.2.0"}
    assert test.passed_prefix(2) == 1
    restored = gradient_norm.GradientNormTest(BLOCKS, percentile=50)
    restored.load_state_dict(json.loads(json.dumps(test.state_dict())))
    assert restored.state_dict() == test.state_dict()
    with pytest.raises(ValueError, match="percentile must be in"):
        gradient_norm.GradientNormTest(BLOCKS, percentile=0)


def _freezer(*, bootstrap: int = 15, fraction: float = 0.8) -> controller.Freezer:
    torch.manual_seed(0)
    model = models.get_model("small_resnet", input_shape=SHAPE, blocks=[1, 1, 1], width=8)
    settings = controller.Settings(check_every_steps=5, window=3, bootstrap_steps=bootstrap,
                                   max_frozen_fraction=fraction, test="gradientNorm",
                                   gradient_percentile=50.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return controller.Freezer(model, None, torch.zeros(4, *SHAPE), settings,
                              optimizer=optimizer, main=True)


def _run(freezer: controller.Freezer, scales: list[Any], steps: int) -> list[controller.Event]:
    """`steps` steps whose block i's every gradient is ``scales[i](step)``."""
    events = []
    for step in range(1, steps + 1):
        for i, group in enumerate(freezer._block_params):
            for p in group:
                p.grad = None if not p.requires_grad else torch.full_like(p, scales[i](step))
        event = freezer.after_step(step, lr=0.1)
        if event is not None:
            events.append(event)
    return events


STEADY, GROWING, FASTER = (lambda step: 1.0), (lambda step: float(step)), (lambda step: float(step**2))


def test_the_freezer_freezes_the_settled_prefix_at_an_interval_end_with_no_reference() -> None:
    with _freezer() as freezer:
        assert freezer.worker is None  # no reference process for this test
        assert [s for s in range(1, 61) if freezer.is_probe_step(s)] == [15, 30, 45, 60]
        events = _run(freezer, [STEADY, STEADY, GROWING, FASTER], 45)
        # step 15 sets the baseline; at 30 the two steady blocks pass, the growing ones not
        first, second = events
        assert (first.kind, first.step, first.modules) == ("froze", 30, BLOCKS[:2])
        assert "gradient norm changed by 0 " in first.reason
        # at 45 the slower-growing of the two left is within their median: it freezes next
        assert (second.step, second.modules) == (45, BLOCKS[2:3])
        assert all(not p.requires_grad for p in freezer.partition.params(3))
        summary = freezer.summary()
        assert summary["test"] == "gradientNorm" and summary["reference"] is None
        assert summary["frozen"] == list(BLOCKS[:3])
        restored = _freezer()
        restored.load_state_dict(json.loads(json.dumps(freezer.state_dict())), step=45)
        assert restored.frozen_modules == BLOCKS[:3]
        assert restored.gradients is not None and freezer.gradients is not None
        assert restored.gradients.state_dict() == freezer.gradients.state_dict()
        restored.close()


def test_gradients_recorded_before_a_trainer_clears_them_still_count() -> None:
    """The Hugging Face Trainer zeroes the gradients before its step-end callback: its
    callback records them after the optimizer step, so the test still sees each step's."""
    with _freezer() as freezer, _freezer() as recorded:
        scales = [STEADY, STEADY, GROWING, FASTER]
        expected = [(e.step, e.modules) for e in _run(freezer, scales, 45)]
        events = []
        for step in range(1, 46):
            for i, group in enumerate(recorded._block_params):
                for p in group:
                    p.grad = torch.full_like(p, scales[i](step)) if p.requires_grad else None
            recorded.record_gradients()
            for p in recorded.model.parameters():
                p.grad = None  # zero_grad(set_to_none=True) before the step's end is reported
            event = recorded.after_step(step, lr=0.1)
            if event is not None:
                events.append((event.step, event.modules))
        assert events == expected == [(30, BLOCKS[:2]), (45, BLOCKS[2:3])]


def test_nothing_freezes_in_the_bootstrap_and_the_cap_and_head_hold() -> None:
    with _freezer(bootstrap=40) as freezer:
        assert _run(freezer, [STEADY] * 4, 30) == []  # settled, but the bootstrap runs to 40
    with _freezer(fraction=0.5) as freezer:
        (event,) = _run(freezer, [STEADY] * 4, 60)
        # every block settled; half the five blocks may freeze, never the head
        assert event.boundary == freezer.max_frozen == 2
        assert all(p.requires_grad for p in freezer.model.get_submodule("head").parameters())


def _job_doc(freezing: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "g"},
            "spec": {"model": {"architecture": "small_resnet", "inputShape": list(SHAPE),
                               "args": {"blocks": [1, 1, 1], "width": 8}},
                     "dataset": {"name": "digits", "validationFraction": 0.5},
                     "training": {"epochs": 6, "batchSize": 64, "device": "cpu",
                                  "lrSchedule": {"name": "cosine", "warmupEpochs": 1},
                                  "optimizer": {"name": "adam", "lr": 0.003}},
                     "freezing": freezing}}


def test_a_job_with_the_gradient_norm_test_trains_without_a_reference_process(
        tmp_path: Path) -> None:
    job = api.parse_job(_job_doc({"test": "gradientNorm", "gradientPercentile": 100}))
    out = io.StringIO()
    result = loop.main(job, out=out, termination_log=None, checkpoint_dir=tmp_path)
    infos = [json.loads(line).get("message", "") for line in out.getvalue().splitlines()]
    assert any("gradient norms compared every 15 steps" in m for m in infos), infos
    freezing = result["freezing"]
    assert freezing["test"] == "gradientNorm" and freezing["reference_cpu_seconds"] == 0.0
    # percentile 100: every trainable module's change is within it, so the cap freezes
    assert freezing["frozen"] == ["stem", "stages.0.0", "stages.1.0", "stages.2.0"]


@pytest.mark.parametrize(("freezing", "message"), [
    ({"test": "gradientnorm"},
     "spec.freezing.test: Input should be 'plasticity' or 'gradientNorm' (got 'gradientnorm')"),
    ({"test": "gradientNorm", "gradientPercentile": 0},
     "spec.freezing.gradientPercentile: Input should be greater than 0"),
    ({"enabled": False, "test": "gradientNorm"},
     ("spec.freezing.test: gradientNorm needs spec.freezing.enabled: true (got enabled: "
      "false); enable freezing, or leave test at plasticity")),
])
def test_kiln_validate_refuses_a_wrong_test_or_one_that_cannot_run(
        tmp_path: Path, freezing: dict[str, Any], message: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job_doc(freezing)), encoding="utf-8")
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        code = cli.main(["validate", str(path)])
    assert code == 2 and message in " ".join(said.getvalue().split()), said.getvalue()


def test_kiln_validate_accepts_the_gradient_norm_test(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job_doc({"test": "gradientNorm"})), encoding="utf-8")
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        code = cli.main(["validate", str(path)])
    assert code == 0, said.getvalue()


def test_under_fsdp_the_test_sums_this_ranks_shards_with_no_collective(tmp_path: Path) -> None:
    """Only rank 0 runs the test: a norm of a DTensor gradient would be a collective the
    other ranks never join (the job hangs), so each block's sum is its local shards' norm."""
    from torch.distributed import fsdp

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fsdp.fully_shard(model[0])
        fsdp.fully_shard(model)
        model(torch.randn(3, 4)).sum().backward()
        grads = [[p.grad for p in model[0].parameters()]]
        test = gradient_norm.GradientNormTest(["0"], percentile=50.0)
        test.accumulate(grads, first_active=0)
        local = [g.to_local() for g in grads[0]]  # type: ignore[union-attr]
        expected = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in local])))
        summed = test._sums[0]
        assert type(summed) is torch.Tensor, type(summed)  # not a DTensor
        assert float(summed) == pytest.approx(expected)
    finally:
        torch.distributed.destroy_process_group()
