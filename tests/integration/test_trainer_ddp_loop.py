"""The default trainer under torchrun: ``python -m kiln_trainer --parallelism ddp`` on two gloo
processes, started by `contract.trainer_command`, end to end on digits.

Issue 5: two DDP processes match one process on the same job (final validation numbers and
weights, from the zoo records), and a checkpoint they write on SIGTERM resumes in one process to
the result of an uninterrupted run. Issue 4: with freezing forced early, rank 0 decides and
both ranks freeze at the same step and re-wrap, so the frozen parameters leave DDP's reducer
(the trainer logs what the reducer holds after every wrap), and the replicas stay identical
(the trainer compares a digest of every rank's weights at each checkpoint).

BatchNorm: in training mode DDP normalises with per-rank batch statistics (B/W samples), so a
net with BatchNorm cannot match one process exactly (`kiln_trainer.distributed.parallel`). The equivalence
tests therefore train a tiny `vit` (LayerNorm, per sample: exact up to float rounding); the
freezing test trains small_cnn (BatchNorm), where only the ranks' agreement is asserted.
Adam: an attention key bias has zero gradient in exact arithmetic (softmax ignores a shift
shared by all keys), so Adam turns its rounding noise (~1e-9) into full-size steps that differ
between any two reduction orders; those tensors are left out of the weight comparison.

torchrun runs as a process of its own, its two workers forked from this process's zygote as
the test kubelet forks a pod's (`trainerproc`); they get OMP_NUM_THREADS=1 (see
test_trainer_resume).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, TextIO

import pytest
import torch
import trainerproc
import yaml

from kiln import api, contract, models
from kiln.local import zygote
from kiln.zoo import records, store

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds its module fixtures

RUN_SECONDS = 240  # a whole run, startup included; the tests take far less
EPOCHS = 4  # 40 steps: time for test (c)'s signal to land before the end
TOLERANCE = 1e-5  # float32 reductions in another order, over 40 Adam steps

VIT = {"architecture": "vit", "inputShape": [1, 8, 8],
       "args": {"depth": 2, "width": 16, "heads": 2, "patch_size": 4}}
SMALL_CNN = {"architecture": "small_cnn", "inputShape": [1, 8, 8], "args": {"depth": 3, "width": 8}}
FORCED_FREEZING = {"checkEverySteps": 1, "window": 3, "patience": 1, "tolerance": 10,
                   "peakFraction": 1, "reference": "fp32"}


def _write_job(path: Path, name: str, model: dict[str, Any], *, epochs: int,
               freezing: dict[str, Any]) -> Path:
    job = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "model": model,
            "dataset": {"name": "digits", "maxSamples": 400},  # 320 train: 10 steps per epoch
            "training": {"epochs": epochs, "batchSize": 32, "seed": 5,
                         "optimizer": {"name": "adam", "lr": 0.005, "weightDecay": 0.0}},
            "freezing": freezing,
        },
    }
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


@dataclasses.dataclass
class _Run:
    """A started run: its process, and the read end of its stdout (rank 0's events)."""

    process: subprocess.Popen[bytes] | zygote.Process
    stdout: TextIO


def _start(k: int, argv: list[str], stderr: Path) -> _Run:
    """`contract.trainer_command(k, argv)` with stdout piped and stderr to a file, in a session
    of its own (torchrun puts each worker in another one, with its reference process); started
    as the test kubelet starts a pod's (`trainerproc`: one trainer or torchrun's workers forked,
    torch imported once)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("KILN_ZOO", None)
    read, write = os.pipe()
    try:
        with stderr.open("w") as err:
            process = trainerproc.start(contract.trainer_command(k, argv), env=env, cwd=None,
                                        stdout=write, stderr=err.fileno(), new_session=True)
    finally:
        os.close(write)
    return _Run(process, open(read, encoding="utf-8"))  # closed by its reader


def _kill(run: _Run) -> None:
    """End a run that overran, leaving nothing behind to hold its stdout open: SIGTERM (torchrun
    passes it on and SIGKILLs its workers' process groups 30 s later), then SIGKILL to this
    session (a single trainer and its reference process)."""
    run.process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.process.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.process.pid, signal.SIGKILL)


def _finish(run: _Run, stderr: Path) -> tuple[list[dict[str, Any]], str]:
    """Wait for the run; its JSON events (rank 0's stdout) and its stderr (every rank's log)."""
    watchdog = threading.Timer(RUN_SECONDS, _kill, (run,))
    watchdog.start()
    try:
        with run.stdout:
            stdout = run.stdout.read()
        run.process.wait(timeout=RUN_SECONDS)
    finally:
        watchdog.cancel()
    return _events(stdout), stderr.read_text()


def _events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _zoo_weights(zoo: Path) -> dict[str, torch.Tensor]:
    """The weights of the only model in the zoo at `zoo`."""
    (record,) = records.list_records(store.DirStore(zoo))
    return records.load_weights(store.DirStore(zoo), record)


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest element difference, without the attention key biases (module docstring)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a if not k.endswith("key.bias"))


@pytest.fixture(scope="module")
def vit_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("vit")
    return _write_job(directory / "job.yaml", "digits-vit", VIT, epochs=EPOCHS,
                      freezing={"enabled": False})


@pytest.fixture(scope="module")
def uninterrupted(
    vit_job: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, dict[str, Any]]:
    """The vit job in one process and in two DDP processes (started together): by k, the
    result event, the zoo weights and the stderr log."""
    started = {}
    for k in (1, 2):
        directory = tmp_path_factory.mktemp(f"k{k}")
        argv = ["--job", str(vit_job), "--checkpoint-dir", str(directory / "checkpoints"),
                "--zoo", str(directory / "zoo")]
        started[k] = (_start(k, argv, directory / "stderr"), directory)
    runs = {}
    for k, (process, directory) in started.items():
        lines, log = _finish(process, directory / "stderr")
        assert process.process.returncode == 0, log[-3000:]
        assert lines[-1]["event"] == "result", log[-3000:]
        runs[k] = {"result": lines[-1], "weights": _zoo_weights(directory / "zoo"), "log": log}
    return runs


def test_two_ddp_processes_match_one_process_on_the_same_job(
    uninterrupted: dict[int, dict[str, Any]]
) -> None:
    one, two = uninterrupted[1], uninterrupted[2]
    assert two["result"]["steps"] == one["result"]["steps"] == 10 * EPOCHS  # global batches
    assert two["result"]["validation_accuracy"] == one["result"]["validation_accuracy"]
    assert two["result"]["validation_loss"] == pytest.approx(one["result"]["validation_loss"],
                                                             rel=TOLERANCE)
    assert _max_difference(two["weights"], one["weights"]) < TOLERANCE
    assert "rank 1 kiln_trainer.distributed.parallel: rank 1 of 2 (ddp, gloo on cpu)" in two["log"]
    assert f"step {10 * EPOCHS}: the 2 DDP replicas hold identical weights" in two["log"]


def test_a_checkpoint_from_two_ddp_processes_resumes_in_one_to_the_uninterrupted_result(
    vit_job: Path, tmp_path: Path, uninterrupted: dict[int, dict[str, Any]]
) -> None:
    argv = ["--job", str(vit_job), "--checkpoint-dir", str(tmp_path / "checkpoints"),
            "--zoo", str(tmp_path / "zoo")]
    first = _start(2, argv, tmp_path / "first.stderr")
    watchdog = threading.Timer(RUN_SECONDS, _kill, (first,))
    watchdog.start()
    lines: list[dict[str, Any]] = []
    with first.stdout:
        for line in first.stdout:  # rank 0's warm-start line comes after every rank set up its
            lines += _events(line)  # signal handler and joined the group: stop in epoch 1
            if len(lines) == 1:
                first.process.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    first.process.wait()
    watchdog.cancel()
    log = (tmp_path / "first.stderr").read_text()
    assert first.process.returncode != 0  # torchrun exits 1 whatever its workers' codes: see cli
    assert not any(e["event"] == "result" for e in lines), "finished before the signal"
    stopped = re.fullmatch(r"stopped on request at epoch \d+, step (\d+); checkpoint saved .*",
                           lines[-1]["message"])
    assert stopped, (lines[-1], log[-3000:])
    tracebacks = log.count("Traceback (most recent call last)")  # torchrun prints its own
    assert tracebacks == 0 or (tracebacks == 1 and "SignalException: Process" in log), log

    second = _start(1, argv, tmp_path / "second.stderr")
    resumed, log = _finish(second, tmp_path / "second.stderr")
    assert second.process.returncode == 0, log[-3000:]
    assert any(e["event"] == "info" and e["message"].startswith("resumed from") and
               e["message"].endswith(f"step {stopped.group(1)}") for e in resumed)
    assert "checkpoint written by ddp x 2, resuming as single x 1" in log
    result, reference = resumed[-1], uninterrupted[1]["result"]
    assert result["event"] == "result" and result["steps"] == reference["steps"]
    assert result["validation_accuracy"] == reference["validation_accuracy"]
    assert result["validation_loss"] == pytest.approx(reference["validation_loss"], rel=TOLERANCE)
    weights = _zoo_weights(tmp_path / "zoo")
    assert _max_difference(weights, uninterrupted[1]["weights"]) < TOLERANCE
    assert _max_difference(weights, uninterrupted[2]["weights"]) < TOLERANCE


def test_under_ddp_both_ranks_freeze_at_rank_0s_step_and_frozen_parameters_leave_the_reducer(
    tmp_path: Path,
) -> None:
    job = _write_job(tmp_path / "job.yaml", "digits-freeze", SMALL_CNN, epochs=300,
                     freezing=FORCED_FREEZING)  # long enough for the reference to report
    process = _start(2, ["--job", str(job), "--checkpoint-dir", str(tmp_path / "checkpoints")],
                     tmp_path / "stderr")
    watchdog = threading.Timer(RUN_SECONDS, _kill, (process,))
    watchdog.start()
    lines: list[dict[str, Any]] = []
    with process.stdout:
        for line in process.stdout:
            lines += _events(line)
            froze = [e for e in lines if e["event"] == "info" and e["message"].startswith("froze")]
            if len(froze) == 1 and lines[-1] is froze[-1]:  # a prefix froze, every rank re-wrapped
                process.process.send_signal(signal.SIGTERM)  # once: enough (torchrun forwards)
    process.process.wait()
    watchdog.cancel()
    log = (tmp_path / "stderr").read_text()
    assert lines[-1]["message"].startswith("stopped on request"), log[-3000:]

    # Rank 0 decided (its events), and both ranks moved the boundary at the same steps.
    # A prefix freezes in one decision; another may come before the stop lands.
    announced = [re.match(r"froze (.+?) at epoch \d+, step (\d+):", e["message"]).groups()
                 for e in lines if e["event"] == "info" and e["message"].startswith("froze")]
    assert announced and announced[0][0].split(", ")[0] == "stem", announced
    by_rank = {rank: re.findall(rf"INFO rank {rank} kiln_trainer\.freezing\.controller: "
                                r"froze (.+?) at step (\d+)", log) for rank in (0, 1)}
    assert by_rank[0] == by_rank[1] == announced
    assert re.search(r"INFO rank 1 kiln_trainer\.freezing\.controller: froze stem\b.* at step "
                     r"\d+: rank 0 decided", log)

    # After each boundary move every rank re-wrapped: the reducer holds the trainable tensors.
    model = models.build(api.ModelSpec.model_validate(SMALL_CNN))
    per_block = [len(list(model.get_submodule(b).parameters()))
                 for b in models.natural_blocks(model)]
    boundaries, frozen = [], 0
    for names, _ in announced:
        frozen += len(names.split(", "))
        boundaries.append(frozen)
    expected = [(0, sum(per_block))] + [
        (int(step), sum(per_block[k:])) for k, (_, step) in zip(boundaries, announced, strict=True)]
    for rank in (0, 1):
        wraps = re.findall(rf"INFO rank {rank} kiln_trainer\.distributed\.replicas: step (\d+): DDP over "
                           r"\w+; its reducer holds (\d+) parameter tensors", log)
        assert [(int(step), int(n)) for step, n in wraps] == expected, rank

    # The replicas never diverged, up to the checkpoint written on the signal.
    stopped_step = re.search(r"step (\d+);", lines[-1]["message"]).group(1)
    assert f"step {stopped_step}: the 2 DDP replicas hold identical weights" in log
    assert "differ from rank 0's" not in log


def test_two_ddp_processes_accumulating_quarter_batches_match_one_process_on_whole_ones(
    tmp_path: Path, uninterrupted: dict[int, dict[str, Any]]
) -> None:
    job = yaml.safe_load(_write_job(tmp_path / "job.yaml", "digits-vit", VIT, epochs=EPOCHS,
                                    freezing={"enabled": False}).read_text())
    job["spec"]["training"].update(batchSize=8, gradientAccumulationSteps=4)  # 2 x 4 x 4 = 32
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job), encoding="utf-8")
    argv = ["--job", str(tmp_path / "job.yaml"), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--zoo", str(tmp_path / "zoo")]
    lines, log = _finish(_start(2, argv, tmp_path / "stderr"), tmp_path / "stderr")
    assert lines[-1]["event"] == "result", log[-3000:]
    one = uninterrupted[1]
    assert lines[-1]["steps"] == one["result"]["steps"] == 10 * EPOCHS  # optimizer steps
    assert _max_difference(_zoo_weights(tmp_path / "zoo"), one["weights"]) < TOLERANCE
