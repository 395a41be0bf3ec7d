"""kiln_trainer.jobcontext in one process: the job from the contract's environment, checkpoints
that carry an own loop's position, scaler and extra values (and every key Kiln's own loop's
checkpoint has), and calls made out of order.
(The example own loop runs as a process in tests/integration/test_own_loop.py.)"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
import torch

from kiln import api, contract, models
from kiln_trainer import checkpoint, jobcontext, loop

JOB = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "mine"},
       "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                "training": {"epochs": 3, "precision": "fp16", "device": "cpu"}}}


def _context(tmp_path: Path, out: io.StringIO | None = None) -> jobcontext.JobContext:
    env = {contract.Env.JOB.value: json.dumps(JOB),
           contract.Env.CHECKPOINTS.value: str(tmp_path / "checkpoints")}
    return jobcontext.job_context(environ=env, out=out or io.StringIO(), handle_signals=False)


def _step(ctx: jobcontext.JobContext, model: torch.nn.Module,
          optimizer: torch.optim.Optimizer) -> None:
    with ctx.amp.autocast():
        loss = model(torch.randn(8, 4)).float().square().mean()
    optimizer.zero_grad()
    ctx.amp.backward(loss)
    ctx.amp.step(optimizer)
    ctx.trained(loss, samples=8)


def test_a_resumed_context_restores_weights_position_scaler_and_extra_values(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = _context(tmp_path)
    assert first.job.name == "mine" and first.amp.scaler is not None  # spec.training.precision
    report = first.warm_start(model)
    assert report.parent is None and "no model zoo" in report.reason
    assert first.resume(model, optimizer, steps_per_epoch=2) == 0
    _step(first, model, optimizer)
    _step(first, model, optimizer)
    assert not first.evaluated(accuracy=0.5, loss=1.0)  # 1 of 3 epochs
    first.checkpoint(extra={"note": "kept", "count": 3})
    scale = first.amp.scaler.get_scale()
    first.close()

    out = io.StringIO()
    second = _context(tmp_path, out)
    fresh = torch.nn.Linear(4, 2)
    again = second.warm_start(fresh)  # the first start's record: weights come from the checkpoint
    assert again.reason == report.reason
    assert second.resume(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1),
                         steps_per_epoch=2) == 1
    assert torch.equal(fresh.weight, model.weight)
    assert second.state.step == 2 and second.extra == {"note": "kept", "count": 3}
    assert second.amp.scaler is not None and second.amp.scaler.get_scale() == scale
    assert any(line.startswith('{"event": "info", "message": "resumed from')
               for line in out.getvalue().splitlines())
    second.close()


def test_calls_out_of_order_say_which_call_comes_first(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match=r"call JobContext.resume\(model, optimizer"):
        ctx.trained(1.0, samples=8)
    with pytest.raises(RuntimeError, match=r"before JobContext.freezer"):
        ctx.freezer(model, torch.randn(4, 4))
    ctx.resume(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=1)
    with pytest.raises(RuntimeError, match=r"call JobContext.evaluated\(accuracy=..., loss=...\)"):
        ctx.finish(model)
    ctx.close()


def test_no_job_in_the_environment_exits_invalid_with_the_fix(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        jobcontext.job_context(environ={}, out=io.StringIO(), handle_signals=False)
    assert exited.value.code == contract.EXIT_INVALID
    assert "no job given" in capsys.readouterr().err


def test_standalone_the_job_file_is_passed_and_the_environment_may_be_empty(
        tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(json.dumps(JOB), encoding="utf-8")  # JSON is YAML
    ctx = jobcontext.job_context(job_file, environ={}, out=io.StringIO(), handle_signals=False)
    assert ctx.job.name == "mine" and ctx.zoo is None and ctx.args.metrics_port == 0
    assert ctx.device.type == "cpu" and ctx.amp.precision == "fp16"
    ctx.close()


def test_an_fp16_context_on_the_cpu_tells_the_user_it_is_slow_and_what_to_set(
        tmp_path: Path) -> None:
    out = io.StringIO()
    ctx = _context(tmp_path, out)
    ctx.close()
    (note,) = [e.message for e in map(contract.from_line, out.getvalue().splitlines())
               if isinstance(e, contract.Info)]
    assert note.startswith("spec.training.precision: fp16 on the CPU") and "bf16" in note


def test_evaluated_needs_a_trained_step_and_refuses_a_percentage_or_a_nan(
        tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.resume(model, optimizer, steps_per_epoch=1)
    with pytest.raises(RuntimeError, match=r"train first, then JobContext.evaluated"):
        ctx.evaluated(accuracy=0.5, loss=1.0)
    _step(ctx, model, optimizer)
    with pytest.raises(ValueError, match=r"evaluated\(accuracy=91.0\): accuracy must be a "
                       r"fraction in \[0, 1\]"):
        ctx.evaluated(accuracy=91.0, loss=1.0)
    with pytest.raises(ValueError, match=r"evaluated\(accuracy=nan\)"):
        ctx.evaluated(accuracy=float("nan"), loss=1.0)
    with pytest.raises(ValueError, match=r"evaluated\(loss=inf\): loss must be a finite"):
        ctx.evaluated(accuracy=0.5, loss=float("inf"))
    assert ctx.state.history == [] and ctx.state.epochs_done == 0  # nothing was recorded
    ctx.close()


def test_finish_takes_the_resumed_model_once_and_ends_the_run(tmp_path: Path) -> None:
    out = io.StringIO()
    ctx = _context(tmp_path, out)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.resume(model, optimizer, steps_per_epoch=1)
    _step(ctx, model, optimizer)
    ctx.evaluated(accuracy=0.5, loss=1.0)
    with pytest.raises(ValueError, match=r"finish\(model\): not the model given to "
                       r"JobContext.resume"):
        ctx.finish(torch.nn.Linear(4, 2))
    ctx.finish(model)
    with pytest.raises(RuntimeError, match=r"finish\(...\) was already called"):
        ctx.finish(model)
    with pytest.raises(RuntimeError, match=r"finish\(...\) ended this run"):
        ctx.trained(1.0, samples=8)
    with pytest.raises(RuntimeError, match=r"finish\(...\) ended this run"):
        ctx.evaluated(accuracy=0.5, loss=1.0)
    results = [line for line in out.getvalue().splitlines() if '"event": "result"' in line]
    assert len(results) == 1, results


def test_a_nan_training_loss_exits_invalid_naming_the_step_without_a_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ctx = _context(tmp_path)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.resume(model, optimizer, steps_per_epoch=2)
    _step(ctx, model, optimizer)
    with pytest.raises(SystemExit) as exited:
        ctx.trained(torch.tensor(float("nan")), samples=8)
    assert exited.value.code == contract.EXIT_INVALID
    assert ("training diverged: the loss became nan at step 2; lower "
            "spec.training.optimizer.lr") in capsys.readouterr().err
    assert ctx.state.step == 1 and not list(tmp_path.rglob("checkpoint.pt"))
    ctx.close()


def test_an_own_loop_checkpoint_carries_every_key_of_the_default_loops(tmp_path: Path) -> None:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "same"},
           "spec": {"model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                              "inputShape": [1, 8, 8]},
                    "dataset": {"name": "digits", "maxSamples": 200},
                    "training": {"epochs": 1, "batchSize": 32, "device": "cpu"}}}
    job = api.parse_job(doc)
    stop = threading.Event()
    stop.set()  # Kiln's loop checkpoints after its first step, then stops
    with pytest.raises(jobcontext.Interrupted):
        loop.main(job, checkpoint_dir=tmp_path / "default", stop=stop, out=io.StringIO(),
                  termination_log=None, register=False)
    default = checkpoint.load_checkpoint(
        checkpoint.locate(job, checkpoint_dir=tmp_path / "default", zoo=None))

    env = {contract.Env.JOB.value: json.dumps(doc),
           contract.Env.CHECKPOINTS.value: str(tmp_path / "own")}
    ctx = jobcontext.job_context(environ=env, out=io.StringIO(), handle_signals=False)
    model = models.build(ctx.job.spec.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.warm_start(model)
    ctx.resume(model, optimizer, steps_per_epoch=2)
    loss = torch.nn.functional.cross_entropy(model(torch.rand(4, 1, 8, 8)),
                                             torch.tensor([0, 1, 2, 3]))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ctx.trained(loss, samples=4)
    ctx.checkpoint(extra={"note": "mine"})
    ctx.close()
    own = checkpoint.load_checkpoint(ctx.location)

    assert default is not None and own is not None
    assert sorted(own) == sorted(default)
    for saved in (own, default):  # what an own loop's checkpoint used to lack
        assert saved[checkpoint.WORLD_SIZE_KEY] == 1 and saved[checkpoint.PARALLELISM_KEY] == "single"
        assert len(saved[checkpoint.RANK_RNG_KEY]) == 1 and saved[checkpoint.STEP_KEY] == 1
        assert checkpoint.ZOO_RECORD_KEY in saved
    assert own[checkpoint.OPTIMIZER_NAME_KEY] == jobcontext.OWN_OPTIMIZER
    assert default[checkpoint.OPTIMIZER_NAME_KEY] == job.spec.training.optimizer.name.value
    assert own[checkpoint.USER_KEY] == {"note": "mine"} and default[checkpoint.USER_KEY] == {}
