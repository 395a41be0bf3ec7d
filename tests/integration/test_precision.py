"""Mixed precision through its real interfaces: `kiln run` of a bf16 job on the CPU trains and
says so in the zoo record; an fp16 run (CPU autocast, gradient scaler) checkpoints the scaler
and resumes from it, telling the user fp16 is slow on the CPU; the spec refuses an unknown
precision, naming the field.
"""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import clirun
import pytest
import torch
import yaml

from kiln import api, contract
from kiln.zoo import records, store
from kiln_trainer import checkpoint, jobcontext, loop, precision


def _doc(name: str, precision_name: str, *, epochs: int = 4) -> dict[str, object]:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                               "inputShape": [1, 8, 8]},
                     "training": {"epochs": epochs, "batchSize": 64, "device": "cpu",
                                  "precision": precision_name,
                                  "optimizer": {"name": "adam", "lr": 0.01,
                                                "weightDecay": 0.0}}}}


def test_kiln_run_trains_a_bf16_job_on_the_cpu(tmp_path: Path) -> None:
    job = tmp_path / "bf16.yaml"
    job.write_text(yaml.safe_dump(_doc("digits-bf16", "bf16")), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("KILN_ZOO", None)
    done = clirun.kiln("run", str(job), "--zoo", "zoo", "--slots", "1", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    (record,) = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert record.job_spec["training"]["precision"] == "bf16"
    # Ten classes: chance is 0.1; four bf16 epochs of a small CNN get far above it.
    assert record.validation_accuracy is not None and record.validation_accuracy > 0.5


def test_a_bf16_loop_reports_falling_validation_loss_in_its_progress_events(
        tmp_path: Path) -> None:
    job = api.parse_job(_doc("digits-bf16-loop", "bf16", epochs=3))
    out = io.StringIO()
    result = loop.main(job, out=out, termination_log=None, register=False,
                       checkpoint_dir=tmp_path)
    evaluated = [e.validation_loss for e in map(contract.from_line, out.getvalue().splitlines())
                 if isinstance(e, contract.Progress) and e.validation_loss is not None]
    assert len(evaluated) >= 3
    assert "no fast kernels" not in out.getvalue()  # bf16 is the CPU's fast precision
    assert evaluated[-1] < evaluated[0]
    assert result["validation_accuracy"] > 0.5


def test_an_fp16_run_checkpoints_its_grad_scaler_and_resumes_from_it(tmp_path: Path) -> None:
    job = api.parse_job(_doc("digits-fp16", "fp16", epochs=2))
    stop = threading.Event()
    stop.set()  # stop after the first step: the checkpoint holds the scaler's state
    with pytest.raises(jobcontext.Interrupted):
        loop.main(job, checkpoint_dir=tmp_path, stop=stop, out=io.StringIO(),
                  termination_log=None, register=False)
    where = checkpoint.locate(job, checkpoint_dir=tmp_path, zoo=None)
    saved = checkpoint.load_checkpoint(where)
    assert saved is not None
    scaler = saved[precision.CHECKPOINT_KEY]
    assert scaler["scale"] > 0 and scaler["growth_interval"] == 2000
    assert saved[checkpoint.STEP_KEY] == 1
    out = io.StringIO()
    result = loop.main(job, checkpoint_dir=tmp_path, out=out, termination_log=None,
                       register=False)
    assert result["resumed_from_epoch"] == 0 and result["steps"] > 1
    assert "resumed from" in out.getvalue()
    assert result["validation_accuracy"] > 0.3  # trained, not diverged, in fp16
    # the user hears that fp16 is slow on the CPU, and what to set instead
    (note,) = [e.message for e in map(contract.from_line, out.getvalue().splitlines())
               if isinstance(e, contract.Info) and "fp16 on the CPU" in e.message]
    assert "spec.training.precision" in note and "bf16" in note


def test_fp16_autocast_runs_the_forward_in_half_precision_on_the_cpu() -> None:
    amp = precision.MixedPrecision("fp16", torch.device("cpu"))
    model = torch.nn.Linear(4, 3)
    with amp.autocast():
        out = model(torch.randn(2, 4))
    assert out.dtype == torch.float16
    fp32 = precision.MixedPrecision("fp32", torch.device("cpu"))
    with fp32.autocast():
        assert model(torch.randn(2, 4)).dtype == torch.float32
    assert fp32.scaler is None and fp32.state_dict() == {}


def test_an_unknown_precision_is_refused_naming_the_field(tmp_path: Path) -> None:
    job = tmp_path / "bad.yaml"
    job.write_text(yaml.safe_dump(_doc("digits-bad", "fp8")), encoding="utf-8")
    done = clirun.kiln("validate", str(job), cwd=tmp_path)
    assert done.returncode != 0
    assert "spec.training.precision" in done.stdout + done.stderr
