"""`kiln_trainer.integrations.lightning.KilnCallback`'s mapping of the job onto `pl.Trainer`
arguments, and the shared helpers both integrations read batches and metrics with."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch

from kiln_trainer.integrations import common

# lightning is imported by the one test that needs it: at collection every pytest-xdist worker
# imports every test module, and lightning's import costs 5 CPU-seconds
_no_lightning = importlib.util.find_spec("lightning") is None


@pytest.mark.skipif(_no_lightning, reason="the lightning extra is not installed")
def test_trainer_arguments_come_from_the_job_and_overrides_win(tmp_path: Path) -> None:
    from kiln_trainer.integrations import lightning

    job = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "pl"},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                    "training": {"epochs": 5, "precision": "bf16"}}}
    env = {"KILN_JOB": json.dumps(job), "KILN_CHECKPOINTS": str(tmp_path)}
    ctx = lightning.job_context(environ=env, out=io.StringIO(), handle_signals=False)
    arguments = lightning.KilnCallback(ctx).trainer_arguments(enable_progress_bar=True)
    assert arguments["max_epochs"] == 5 and arguments["precision"] == "bf16-mixed"
    assert arguments["accelerator"] == "cpu" and arguments["enable_progress_bar"]
    assert not arguments["enable_checkpointing"] and arguments["logger"] is False
    ctx.close()


def test_batch_size_reads_the_first_tensor_of_any_batch() -> None:
    x, y = torch.zeros(5, 3), torch.zeros(5)
    assert common.batch_size((x, y)) == common.batch_size([x]) == 5
    assert common.batch_size({"input_ids": x, "labels": y}) == common.batch_size(x) == 5
    assert common.batch_size((torch.tensor(1.0), x)) == 5  # a 0-d tensor has no samples
    assert common.batch_size(("text", 3)) == 0


def test_metrics_may_be_tensors_as_lightning_logs_them() -> None:
    metrics = {"val_accuracy": torch.tensor(0.5), "val_loss": torch.tensor(0.25)}
    assert common.evaluation(metrics, "val_accuracy", "val_loss") == (0.5, 0.25)
