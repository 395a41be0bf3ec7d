"""kiln_trainer.loop: the recipe end to end, in process, on tiny digits and text runs."""

from __future__ import annotations

import copy
import io
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api
from kiln.zoo import records, store
from kiln_trainer import checkpoint, jobcontext, loop, runtime


def _job(name: str = "digits-tiny", **spec: Any) -> api.TrainingJob:
    doc: dict[str, Any] = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "model": {"architecture": "small_cnn", "args": {"depth": 3, "width": 16},
                      "inputShape": [1, 8, 8]},
            "dataset": {"name": "digits", "maxSamples": 600},
            "training": {"epochs": 2, "batchSize": 64,
                         "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
        },
    }
    for section, values in spec.items():
        doc["spec"][section] = {**doc["spec"].get(section, {}), **values}
    return api.parse_job(doc)


def _run(job: api.TrainingJob, tmp_path: Path, **kwargs: Any) -> tuple[dict[str, Any], list[dict]]:
    out = io.StringIO()
    kwargs.setdefault("checkpoint_dir", tmp_path / "checkpoints")
    try:
        result = loop.main(job, out=out, termination_log=None, **kwargs)
    finally:
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
    return result, lines


def test_short_digits_run_registers_a_record_and_emits_the_result_last(tmp_path: Path) -> None:
    zoo_dir = tmp_path / "zoo"
    job = _job(target={"metric": "validation_accuracy", "value": 0.5, "stopAtTarget": False})
    result, lines = _run(job, tmp_path, zoo_uri=str(zoo_dir), checkpoint_dir=None)
    assert lines[-1] == {"event": "result", **result}
    assert [line["event"] for line in lines].count("result") == 1
    progress = [line for line in lines if line["event"] == "progress"]
    assert progress[-1]["epoch"] == 2 and progress[-1]["step"] == result["steps"]
    assert result["epochs_run"] == 2 and result["resumed_from_epoch"] == 0
    assert result["target_reached"] and result["time_to_target_seconds"] <= result["wall_seconds"]
    assert result["metric"] == result["validation_accuracy"]
    (record,) = records.list_records(store.DirStore(zoo_dir))
    assert record.id == result["zoo_model"]
    assert record.architecture == "small_cnn" and record.dataset == "digits"
    assert record.task == "classification" and record.modality == "image"
    assert record.validation_accuracy == result["validation_accuracy"]
    assert record.job_name == "digits-tiny" and record.num_params > 0
    weights = records.load_weights(store.DirStore(zoo_dir), record)
    assert "head.2.weight" in weights
    assert not store.DirStore(zoo_dir).list_keys("checkpoints/")  # finished: removed


@pytest.mark.process
def test_stop_at_target_ends_training_early(tmp_path: Path) -> None:
    job = _job(training={"epochs": 6},
               target={"metric": "validation_loss", "value": 5.0, "stopAtTarget": True})
    result, _ = _run(job, tmp_path)
    assert result["epochs_run"] == 1 and result["target_reached"]
    assert result["metric_name"] == "validation_loss"
    assert result["zoo_model"] is None  # no zoo given


def test_eval_every_steps_evaluates_mid_epoch(tmp_path: Path) -> None:
    job = _job(training={"epochs": 1, "evalEverySteps": 2})
    result, lines = _run(job, tmp_path)
    evaluated_steps = {line["step"] for line in lines
                       if line["event"] == "progress" and line["validation_accuracy"] is not None}
    assert {2, 4, 6} <= evaluated_steps and result["steps"] in evaluated_steps


def test_stop_request_checkpoints_mid_epoch_and_resume_matches_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    straight, _ = _run(_job(), tmp_path / "a")
    stop = threading.Event()
    stop.set()  # stop after the first step
    with pytest.raises(jobcontext.Interrupted):
        _run(_job(), tmp_path / "b", stop=stop)
    saved = checkpoint.load_checkpoint(checkpoint.locate(
        _job(), checkpoint_dir=tmp_path / "b" / "checkpoints", zoo=None))
    assert saved is not None
    assert (saved[checkpoint.EPOCH_KEY], saved[checkpoint.EPOCH_BATCH_KEY]) == (0, 1)
    resumed, lines = _run(_job(), tmp_path / "b")
    assert any(line["event"] == "info" and "resumed" in line["message"] for line in lines)
    assert resumed["steps"] == straight["steps"]
    assert resumed["validation_loss"] == pytest.approx(straight["validation_loss"], rel=1e-5)
    assert resumed["validation_accuracy"] == straight["validation_accuracy"]


class _StopAfterFirstEvaluation(io.StringIO):
    """An output stream that asks the loop to stop once the first evaluation is reported."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__()
        self.stop = stop

    def write(self, text: str) -> int:
        if '"event": "progress"' in text and '"validation_accuracy": null' not in text:
            self.stop.set()
        return super().write(text)


def test_resume_after_a_finished_epoch_reports_that_epoch(tmp_path: Path) -> None:
    stop = threading.Event()
    with pytest.raises(jobcontext.Interrupted):
        loop.main(_job(), out=_StopAfterFirstEvaluation(stop), termination_log=None, stop=stop,
                  checkpoint_dir=tmp_path / "checkpoints")
    result, _ = _run(_job(), tmp_path)
    assert result["resumed_from_epoch"] == 1 and result["epochs_run"] == 2


def test_a_checkpoint_of_another_model_is_refused_with_the_fix(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(jobcontext.Interrupted):
        _run(_job(), tmp_path, stop=stop)
    other = _job(model={"args": {"depth": 2, "width": 16}})
    with pytest.raises(checkpoint.CheckpointError, match="spec.model.args.depth.*delete it"):
        _run(other, tmp_path)


def test_changed_training_settings_on_resume_warn_and_the_job_wins(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(jobcontext.Interrupted):
        _run(_job(), tmp_path, stop=stop)
    result, _ = _run(_job(training={"epochs": 1}), tmp_path)
    assert "spec.training.epochs: checkpoint 2, job 1" in caplog.text
    assert result["epochs_run"] == 1


def test_too_few_model_outputs_for_the_folder_classes_is_an_invalid_spec(tmp_path: Path) -> None:
    from PIL import Image

    for name in ("a", "b", "c"):
        (tmp_path / "folder" / name).mkdir(parents=True)
        for i in range(2):
            Image.new("L", (8, 8), color=40 * i).save(tmp_path / "folder" / name / f"{i}.png")
    job = _job(model={"args": {"depth": 2, "width": 8, "num_classes": 2}},
               dataset={"name": "imagefolder", "path": str(tmp_path / "folder"),
                        "maxSamples": None})
    with pytest.raises(api.InvalidSpec, match="num_classes: the model has 2 outputs.*3 classes"):
        _run(job, tmp_path)


def test_a_text_dataset_for_an_image_model_fails_the_job_checks(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc" * 100, encoding="utf-8")
    job = _job(dataset={"name": "text", "path": str(corpus), "maxSamples": None},
               model={"inputShape": [16]})
    with pytest.raises(api.InvalidSpec):
        _run(job, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_a_gpu_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(runtime.ConfigError, match="spec.training.device: cuda"):
        _run(_job(training={"device": "cuda"}), tmp_path)


def test_character_language_model_trains_on_a_text_file(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 60, encoding="utf-8")
    doc_model = {"architecture": "char_transformer", "args": {"depth": 1, "width": 32,
                 "heads": 2}, "inputShape": [32]}
    job = _job("text-tiny", model=doc_model,
               dataset={"name": "text", "path": str(corpus), "maxSamples": None},
               training={"epochs": 2, "batchSize": 16, "optimizer": {"name": "adamw",
                         "lr": 0.003, "weightDecay": 0.01}},
               target={"metric": "validation_loss", "value": 4.0})
    result, _ = _run(job, tmp_path)
    assert result["metric_name"] == "validation_loss"
    assert 0.0 < result["validation_loss"] < 5.6  # below uniform over 256 bytes (ln 256 = 5.55)
    assert 0.0 <= result["validation_accuracy"] <= 1.0


def test_result_is_written_to_the_termination_log(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    result = loop.main(_job(training={"epochs": 1}), out=io.StringIO(), termination_log=log,
                       checkpoint_dir=tmp_path / "checkpoints")
    assert json.loads(log.read_text()) == {"event": "result", **result}


def test_registration_is_skipped_when_the_job_or_caller_says_so(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    job = _job(training={"epochs": 1})
    off = copy.deepcopy(api.to_wire(job))
    off["spec"]["zoo"] = {"register": False}
    first, _ = _run(api.parse_job(off), tmp_path, zoo_uri=str(zoo))
    second, _ = _run(job, tmp_path, zoo_uri=str(zoo), register=False)
    assert first["zoo_model"] is None and second["zoo_model"] is None
    assert records.list_records(store.DirStore(zoo)) == []


def test_cpu_threads_follow_the_container_quota_unless_omp_says_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("100000 100000\n")
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    runtime.limit_cpu_threads(cpu_max)
    assert torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    runtime.limit_cpu_threads(cpu_max)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    cpu_max.write_text("max 100000\n")
    runtime.limit_cpu_threads(cpu_max)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_several_processes_asked_for_but_one_running_is_said_on_the_console(
    tmp_path: Path, parallelism: str
) -> None:
    job = _job(training={"epochs": 1}, resources={"parallelism": parallelism},
               freezing={"enabled": False})
    result, lines = _run(job, tmp_path)
    notes = [line["message"] for line in lines if line["event"] == "info"
             and line["message"].startswith(f"{parallelism} with one process")]
    assert len(notes) == 1 and "torchrun --nproc-per-node N" in notes[0]
    assert result["epochs_run"] == 1
