"""kiln_trainer.cli: job sources, clear failures with exit code 2, and the package surface."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kiln_trainer
from kiln import api, contract
from kiln_trainer import cli, data, loop, runtime

JOB = {
    "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "cli-job"},
    "spec": {"model": {"architecture": "small_cnn", "args": {"depth": 1, "width": 4},
                       "inputShape": [1, 8, 8]},
             "dataset": {"name": "digits", "maxSamples": 64},
             "training": {"epochs": 1, "batchSize": 32}},
}


def test_an_invalid_job_file_exits_2_with_one_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("apiVersion: kiln.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\n"
                   "spec: {model: {architecture: small_cnn, inputShape: [1, 8, 8]}, "
                   "trainig: {}}\n", encoding="utf-8")
    assert cli.main(["--job", str(job)]) == contract.EXIT_INVALID
    err = capsys.readouterr().err
    assert "spec.trainig: unknown field; did you mean 'training'?" in err
    assert "Traceback" not in err


def test_a_missing_job_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--job", str(tmp_path / "absent.yaml")]) == contract.EXIT_INVALID
    assert "absent.yaml: invalid file:\n  cannot read the file" in capsys.readouterr().err


def test_no_job_at_all_says_how_to_give_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KILN_JOB_FILE", raising=False)
    monkeypatch.delenv("KILN_JOB", raising=False)
    assert cli.main([]) == contract.EXIT_INVALID
    assert "pass --job FILE, or set KILN_JOB_FILE or KILN_JOB" in capsys.readouterr().err


def test_a_dataset_error_exits_2_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads(json.dumps(JOB))
    doc["spec"]["model"]["inputShape"] = [1, 8, 8]
    doc["spec"]["dataset"] = {"name": "imagefolder", "path": str(tmp_path / "no-such-folder")}
    job = tmp_path / "job.json"
    job.write_text(json.dumps(doc), encoding="utf-8")
    assert cli.main(["--job", str(job), "--checkpoint-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "no-such-folder is not a directory" in err and "Traceback" not in err


def test_job_from_kiln_job_env_runs_and_prints_the_result_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KILN_JOB_FILE", raising=False)
    monkeypatch.setenv("KILN_JOB", json.dumps(JOB))
    monkeypatch.setenv("KILN_CHECKPOINTS", str(tmp_path / "ckpt"))
    assert cli.main(["--no-register"]) == contract.EXIT_OK
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["event"] == "result"


def test_a_file_with_two_jobs_is_refused(tmp_path: Path) -> None:
    job = tmp_path / "two.yaml"
    one = json.dumps(JOB)
    job.write_text(f"{one}\n---\n{one}\n", encoding="utf-8")
    with pytest.raises(api.InvalidSpec, match="holds 2 jobs; the trainer runs exactly one"):
        runtime.load_job(str(job), None)


@pytest.mark.process
def test_package_root_exports_few_names_and_imports_no_operator_stack() -> None:
    assert len(kiln_trainer.__all__) <= 8
    assert callable(kiln_trainer.run)
    code = ("import sys, kiln_trainer, kiln_trainer.loop; "
            "print(sorted(m for m in sys.modules if m.startswith("
            "('kopf', 'kubernetes', 'pyomo', 'kiln.controller', 'kiln.local.runner', 'kiln.cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["kiln_trainer", "kiln_trainer.metrics"])
def test_docstring_examples_run(module: str) -> None:
    import doctest
    import importlib

    failures, tried = doctest.testmod(importlib.import_module(module))
    assert tried > 0 and failures == 0


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
                     id="cuda"),
        pytest.param(RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. "
                                  "DefaultCPUAllocator: can't allocate memory: you tried to "
                                  "allocate 4000000000000 bytes. Error code 12"), id="cpu"),
        pytest.param(MemoryError(), id="python"),
    ],
)
def test_running_out_of_memory_exits_1_with_one_message_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    error: BaseException,
) -> None:
    def exhausted(*_: object, **__: object) -> None:
        raise error

    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB), encoding="utf-8")
    monkeypatch.setattr(loop, "main", exhausted)
    assert cli.main(["--job", str(job)]) == contract.EXIT_UNEXPECTED
    err = capsys.readouterr().err
    assert "kiln_trainer: error: out of memory (" in err
    assert "reduce spec.training.batchSize or the model size" in err
    assert "Traceback" not in err


def test_a_dataset_error_from_a_loader_worker_shows_only_its_own_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    wrapped = ("Caught DatasetError in DataLoader worker process 0.\nOriginal Traceback (most "
               "recent call last):\n  File \"x.py\", line 1, in f\nkiln_trainer.data."
               "DatasetError: spec.dataset.path: cannot read image bad.png; remove or fix the file")

    def broken(*_: object, **__: object) -> None:
        raise data.DatasetError(wrapped)

    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB), encoding="utf-8")
    monkeypatch.setattr(loop, "main", broken)
    assert cli.main(["--job", str(job)]) == contract.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.strip() == ("kiln_trainer: error: spec.dataset.path: cannot read image bad.png; "
                           "remove or fix the file")


def test_a_zoo_that_is_a_file_exits_2_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB), encoding="utf-8")
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    assert cli.main(["--job", str(job), "--zoo", str(tmp_path / "afile")]) == contract.EXIT_INVALID
    err = capsys.readouterr().err
    assert f"--zoo {tmp_path / 'afile'}: " in err and "is a file, not a directory" in err


def test_under_torchrun_a_failure_names_its_rank_and_the_first_ranks_failure_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    monkeypatch.setattr(cli.events, "TERMINATION_LOG", log)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("KILN_JOB", "{not json")
    monkeypatch.delenv("KILN_JOB_FILE", raising=False)
    assert cli.main([]) == contract.EXIT_INVALID
    first = json.loads(log.read_text())
    assert first["event"] == "error"
    assert first["message"].startswith("rank 1 of 2: KILN_JOB: invalid TrainingJob")
    monkeypatch.setenv("RANK", "0")  # rank 0 fails next, e.g. in a collective: it echoes rank 1
    assert cli.main([]) == contract.EXIT_INVALID
    assert json.loads(log.read_text()) == first
    assert "not replacing another rank's failure" in caplog.text
