"""An own training loop on kiln_trainer's job context, run as a pod or `kiln run` runs it: the
example script examples/own-model/train_loop.py as a process with the contract's environment.

It reports progress the contract's reader parses, reaches its target, registers in the zoo,
and a deeper variant that `kiln run` runs from its job file warm-starts from it; it freezes on
a longer run, checkpoints on SIGTERM and resumes, and trains under DDP in two torchrun
processes; `kiln run` says when a loop exits without a result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import clirun
import scriptrun
import yaml

from kiln import contract
from kiln.zoo import records, store

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own-model"
SCRIPT = EXAMPLE / "train_loop.py"
DEADLINE_SECONDS = 300.0


def _job(tmp_path: Path, name: str, **spec: Any) -> Path:
    """The example's job file, renamed, with `spec`'s sections updated."""
    doc = yaml.safe_load((EXAMPLE / "own-loop.yaml").read_text(encoding="utf-8"))
    doc["metadata"]["name"] = name
    for section, values in spec.items():
        if isinstance(values, dict) and isinstance(doc["spec"].get(section), dict):
            doc["spec"][section].update(values)
        else:
            doc["spec"][section] = values
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _env(tmp_path: Path, job_file: Path) -> dict[str, str]:
    """The container's environment (`scriptrun.container_env`) with TensorBoard on."""
    return scriptrun.container_env(tmp_path, job_file, EXAMPLE, {
        contract.Env.TENSORBOARD_DIR.value: str(tmp_path / "tensorboard")})


def _run(tmp_path: Path, job_file: Path) -> tuple[list[contract.Event], contract.Result]:
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path,
                          env=_env(tmp_path, job_file), capture_output=True, text=True,
                          timeout=DEADLINE_SECONDS, check=False)
    assert done.returncode == contract.EXIT_OK, done.stderr[-3000:]
    events = scriptrun.events(done.stdout)
    assert isinstance(events[-1], contract.Result), done.stdout[-2000:]
    return events, events[-1]


def _kiln_run(tmp_path: Path, job_file: Path, *flags: str, **extra: str) -> clirun.Done:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop(contract.Env.ZOO.value, None)
    return clirun.kiln("run", str(job_file), *flags, "--zoo", "zoo", "--slots", "1",
                       cwd=tmp_path, env=env)


def test_an_own_loop_reports_registers_and_a_deeper_variant_warm_starts_from_it(
        tmp_path: Path) -> None:
    events, first = _run(tmp_path, _job(tmp_path, "own-a"))
    progress = [e for e in events if isinstance(e, contract.Progress)]
    assert progress and progress[-1].steps_per_epoch == 23  # 1437 samples / 64
    assert progress[-1].validation_accuracy is not None and progress[-1].modules == 4
    assert any(e.evaluated for e in progress)  # `ctx.evaluated` marks its progress event
    assert list((tmp_path / "tensorboard" / "own-a").glob("events.out.tfevents.*"))
    assert first.target_reached and first.time_to_target_seconds is not None
    assert first.metric is not None and first.metric >= 0.9 and first.zoo_model
    assert first.parent is None and first.warm_start.startswith("cold start")
    termination = contract.read_termination_message(
        (tmp_path / "termination-log").read_text(encoding="utf-8"))
    assert isinstance(termination, contract.Result) and termination.zoo_model == first.zoo_model
    (record,) = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert record.id == first.zoo_model and record.entrypoint == "train_loop:mlp"
    assert record.job_spec["training"]["precision"] == "bf16"

    # `kiln run` runs the deeper variant from its job file, one epoch: its warm start is what
    # is checked, not its accuracy (one parent for both: they were two tests, each training one)
    done = _kiln_run(tmp_path, _job(tmp_path, "own-b", model={"args": {"hidden": 96, "depth": 3}},
                                    training={"epochs": 1}), "-o", "json",
                     PYTHONPATH=str(EXAMPLE))  # a job file outside the example's folder
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (second,) = json.loads(done.stdout)
    assert second["parent"] == first.zoo_model
    assert second["similarity"] is not None and 0.3 < second["similarity"] < 1.0
    assert "weight tensors" in second["warm_start"]
    assert second["zoo_model"] not in (None, first.zoo_model)
    saved = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert {r.job_name for r in saved} == {"own-a", "own-b"}


def test_an_own_loop_freezes_its_front_layers_on_a_longer_run(tmp_path: Path) -> None:
    # peakFraction 1 passes every cycle's peak test, so the freeze waits only for the reference
    # process's answers: at the default 0.1 this MLP's stem came within a few cycles of the end
    # of 30 epochs, and on a loaded machine the reference answers later and it never froze
    job = _job(tmp_path, "own-long", training={"epochs": 10},
               target={"metric": "validation_accuracy", "value": 0.9, "stopAtTarget": False},
               freezing={"checkEverySteps": 5, "peakFraction": 1.0}, zoo={"register": False})
    events, result = _run(tmp_path, job)
    assert any(m.startswith("froze stem") for m in scriptrun.infos(events)), scriptrun.infos(events)
    assert result.freezing is not None and "stem" in result.freezing["frozen"]
    assert result.epochs_run == 10 and result.zoo_model is None


def test_an_own_loop_checkpoints_on_sigterm_and_resumes(tmp_path: Path) -> None:
    # 230 steps: far more than any machine trains between the first line and the signal
    job = _job(tmp_path, "own-stop", training={"epochs": 10},
               target={"metric": "validation_accuracy", "value": 0.99, "stopAtTarget": False})
    process = subprocess.Popen([sys.executable, str(SCRIPT)], cwd=tmp_path,
                               env=_env(tmp_path, job), stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    first_line = process.stdout.readline()  # the warm-start sentence: handlers are installed
    assert isinstance(contract.from_line(first_line), contract.Info), first_line
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=DEADLINE_SECONDS)
    assert process.returncode == 128 + signal.SIGTERM
    stopped = scriptrun.infos(scriptrun.events(rest))
    assert stopped and stopped[-1].startswith(contract.STOPPED_PREFIX), rest[-2000:]
    assert (tmp_path / "checkpoints" / "default" / "own-stop" / "checkpoint.pt").exists()

    events, result = _run(tmp_path, job)
    infos = scriptrun.infos(events)
    assert any(m.startswith("resumed from") for m in infos), infos
    assert result.epochs_run == 10 and result.steps > 10 * 23  # the stopped steps count too
    assert not (tmp_path / "checkpoints" / "default" / "own-stop" / "checkpoint.pt").exists()


def test_an_own_loop_under_torchrun_trains_with_ddp_through_the_same_context(
        tmp_path: Path) -> None:
    job = _job(tmp_path, "own-ddp", training={"epochs": 1},
               target={"metric": "validation_accuracy", "value": 0.99, "stopAtTarget": False})
    done = subprocess.run([sys.executable, *contract.TORCHRUN, "--nproc-per-node", "2",
                           str(SCRIPT)], cwd=tmp_path, env=_env(tmp_path, job),
                          capture_output=True, text=True, timeout=DEADLINE_SECONDS, check=False)
    assert done.returncode == contract.EXIT_OK, done.stderr[-3000:]
    events = scriptrun.events(done.stdout)  # rank 0 alone speaks
    results = [e for e in events if isinstance(e, contract.Result)]
    assert len(results) == 1 and events[-1] is results[0], done.stdout[-2000:]
    assert results[0].steps == 23 and results[0].epochs_run == 1  # global batches
    # the context saw both ranks: it says why the layers stay unfrozen under DDP
    assert any(m.startswith("freezing off: an own loop under DDP") for m in scriptrun.infos(events))
    (record,) = records.list_records(store.DirStore(tmp_path / "zoo"))  # rank 0's, once
    assert record.id == results[0].zoo_model and record.entrypoint == "train_loop:mlp"


def test_kiln_run_says_when_an_own_loop_exits_without_a_result(tmp_path: Path) -> None:
    progress = contract.to_line(contract.Progress(
        epoch=1, epochs=1, step=1, steps_per_epoch=1, train_loss=0.5, validation_accuracy=None,
        validation_loss=None, samples_per_second=None, eta_seconds=None, elapsed_seconds=0.1))
    job = _job(tmp_path, "own-quiet",  # reports progress, never calls ctx.finish
               template={"command": ["python", "-c", f"print({progress!r})"]})
    done = _kiln_run(tmp_path, job)
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "own-quiet: trainer exited 0 without reporting a result" in said, said[-2000:]
    assert "ctx.finish(model)" in said


def test_an_own_loop_with_an_invalid_job_fails_permanently_naming_the_field(
        tmp_path: Path) -> None:
    job = _job(tmp_path, "own-bad", training={"precision": "fp8"})
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, env=_env(tmp_path, job),
                          capture_output=True, text=True, timeout=DEADLINE_SECONDS, check=False)
    assert done.returncode == contract.EXIT_INVALID, done.stderr[-2000:]
    assert "spec.training.precision" in done.stderr and "Traceback" not in done.stderr
    failure = contract.read_termination_message(
        (tmp_path / "termination-log").read_text(encoding="utf-8"))
    assert isinstance(failure, contract.Failure) and "spec.training.precision" in failure.message
