"""`kiln_trainer.integrations.hf.KilnCallback` maps the Hugging Face Trainer's events onto a real
`JobContext`: the job's settings become `TrainingArguments`, steps become progress, evaluations
become Kiln's (an epoch counted once), the end registers and writes the result, and what the
user must fix ends the run with `contract.EXIT_INVALID` naming the fix.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kiln import contract
from kiln_trainer.integrations import common

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


class Net(nn.Module):
    """A linear classifier as the Trainer calls one: labels in, {"loss", "logits"} out."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.linear(input_ids)
        return {"logits": logits} | ({} if labels is None else
                                     {"loss": F.cross_entropy(logits, labels)})


def _integration() -> Any:
    """Kiln's integration, imported by the tests that use it: at collection every pytest-xdist
    worker imports every test module, and this import (the Trainer, peft) costs 3.4 CPU-seconds."""
    from kiln_trainer.integrations import hf

    return hf


def _callback(tmp_path: Path, **training: Any) -> tuple[Any, io.StringIO]:
    job = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "hf"},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                    "training": {"epochs": 2, "batchSize": 4, "seed": 3,
                                 "optimizer": {"name": "adamw", "lr": 0.01}, **training},
                    "freezing": {"enabled": False}}}
    env = {"KILN_JOB": json.dumps(job), "KILN_CHECKPOINTS": str(tmp_path / "checkpoints")}
    out = io.StringIO()
    hf = _integration()
    ctx = hf.job_context(environ=env, out=out, handle_signals=False)
    return hf.KilnCallback(ctx), out


def _events(out: io.StringIO) -> list[contract.Event]:
    return [e for e in map(contract.from_line, out.getvalue().splitlines()) if e is not None]


def test_training_arguments_come_from_the_job_and_overrides_win(tmp_path: Path) -> None:
    callback, _ = _callback(tmp_path, precision="bf16")
    args = callback.training_arguments(str(tmp_path / "out"), logging_steps=7)
    assert (args.num_train_epochs, args.per_device_train_batch_size, args.learning_rate,
            args.seed) == (2, 4, 0.01, 3)
    assert args.bf16 and not args.fp16 and args.use_cpu and args.logging_steps == 7
    assert str(args.eval_strategy.value) == "epoch" and str(args.save_strategy.value) == "no"
    callback.ctx.close()


@pytest.mark.parametrize(("global_step", "epochs_done", "ended"), [
    (10, 0, True),  # the first epoch's end
    (10, 1, False),  # an evaluation after training, at the step already counted
    (15, 1, False),  # mid-epoch (eval_strategy="steps")
    (20, 1, True),
    (0, 0, False),  # eval_on_start
])
def test_an_evaluation_closes_an_epoch_once(global_step: int, epochs_done: int,
                                            ended: bool) -> None:
    assert _integration().epoch_ended(global_step, 10, epochs_done) is ended


def test_evaluation_metrics_map_to_accuracy_and_loss_or_name_the_fix() -> None:
    assert common.evaluation({"eval_accuracy": 0.75, "eval_loss": 0.5, "epoch": 1.0},
                         "eval_accuracy", "eval_loss") == (0.75, 0.5)
    with pytest.raises(ValueError, match=r"lack \[.eval_accuracy.\].*accuracy_key"):
        common.evaluation({"eval_loss": 0.5}, "eval_accuracy", "eval_loss")


def _trainer_objects(callback: Any, tmp_path: Path) -> dict[str, Any]:
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = [{"input_ids": torch.randn(4), "labels": i % 2} for i in range(8)]
    loader = torch.utils.data.DataLoader(data, batch_size=4,
                                         collate_fn=transformers.default_data_collator)
    return {"model": model, "optimizer": optimizer, "train_dataloader": loader,
            "lr_scheduler": None}


def test_the_trainer_events_drive_the_job_context_to_a_result(tmp_path: Path) -> None:
    callback, out = _callback(tmp_path)
    args = callback.training_arguments(str(tmp_path / "out"))
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    objects = _trainer_objects(callback, tmp_path)
    callback.on_train_begin(args, state, control, **objects)
    assert callback.steps_per_epoch == 2 and state.global_step == 0
    model, optimizer = objects["model"], objects["optimizer"]
    for epoch in range(2):
        for batch in objects["train_dataloader"]:
            loss = model(**batch)["loss"]  # the hook keeps it; evaluation below runs no grad
            loss.backward()
            optimizer.step()
            state.global_step += 1
            callback.on_step_end(args, state, control)
        with torch.no_grad():
            model(input_ids=torch.randn(4, 4))  # evaluation forwards are not training steps
        callback.on_evaluate(args, state, control,
                             metrics={"eval_accuracy": 0.5 + epoch / 4, "eval_loss": 0.6})
    assert control.should_training_stop  # the epoch budget is spent
    callback.on_train_end(args, state, control, model=model)
    events = _events(out)
    progress = [e for e in events if isinstance(e, contract.Progress) and e.evaluated]
    assert [(e.epoch, e.validation_accuracy) for e in progress] == [(1, 0.5), (2, 0.75)]
    result = events[-1]
    assert isinstance(result, contract.Result)
    assert (result.steps, result.epochs_run, result.validation_accuracy) == (4, 2, 0.75)
    assert result.samples_per_second is not None and result.warm_start.startswith("cold start")
    callback.on_evaluate(args, state, control,  # trainer.evaluate() after training: no run
                         metrics={"eval_accuracy": 0.9, "eval_loss": 0.6})
    assert len(_events(out)) == len(events)  # nothing more said


def test_a_resumed_run_starts_the_trainer_at_the_epochs_done(tmp_path: Path) -> None:
    callback, _ = _callback(tmp_path, epochs=3)
    args = callback.training_arguments(str(tmp_path / "out"))
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    objects = _trainer_objects(callback, tmp_path)
    callback.on_train_begin(args, state, control, **objects)
    for batch in objects["train_dataloader"]:
        objects["model"](**batch)["loss"].backward()
        state.global_step += 1
        callback.on_step_end(args, state, control)
    callback.on_evaluate(args, state, control, metrics={"eval_accuracy": 0.5, "eval_loss": 0.6})
    callback.ctx.close()  # the process ends; its checkpoint stays

    again, out = _callback(tmp_path, epochs=3)
    state = transformers.TrainerState()
    again.on_train_begin(args, state, control, **_trainer_objects(again, tmp_path))
    assert state.global_step == 2  # one epoch of 2 steps done: the Trainer's max_steps ends it
    assert any(isinstance(e, contract.Info) and e.message.startswith("resumed from")
               for e in _events(out))
    again.ctx.close()


def test_a_model_without_a_loss_or_metrics_without_accuracy_end_the_run_as_invalid(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    callback, _ = _callback(tmp_path)
    args = callback.training_arguments(str(tmp_path / "out"))
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    objects = _trainer_objects(callback, tmp_path)
    callback.on_train_begin(args, state, control, **objects)
    objects["model"](input_ids=torch.randn(4, 4))  # no labels: no loss
    with pytest.raises(SystemExit) as stopped:
        callback.on_step_end(args, state, control)
    assert stopped.value.code == contract.EXIT_INVALID
    assert "returned no loss" in capsys.readouterr().err

    callback, _ = _callback(tmp_path)
    objects = _trainer_objects(callback, tmp_path)
    callback.on_train_begin(args, state, control, **objects)
    objects["model"](**next(iter(objects["train_dataloader"])))
    callback.on_step_end(args, state, control)
    with pytest.raises(SystemExit) as stopped:
        callback.on_evaluate(args, state, control, metrics={"eval_loss": 0.6})
    assert stopped.value.code == contract.EXIT_INVALID
    assert "compute_metrics" in capsys.readouterr().err


def test_a_trainer_that_never_evaluates_is_refused_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    callback, _ = _callback(tmp_path)
    args = callback.training_arguments(str(tmp_path / "out"), eval_strategy="no")
    with pytest.raises(SystemExit) as stopped:
        callback.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(),
                                **_trainer_objects(callback, tmp_path))
    assert stopped.value.code == contract.EXIT_INVALID
    assert "eval_strategy='epoch'" in capsys.readouterr().err
