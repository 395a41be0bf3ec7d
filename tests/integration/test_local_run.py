"""`kiln run` as a user runs it: `kiln` in the test's process (tests/clirun.py), or a real `kiln`
process where a signal must reach it, launches real trainer processes on the bundled digits,
registers in a directory zoo (and an S3 zoo over HTTP) with each run's curves, fails clearly,
stops cleanly on Ctrl-C, and runs several jobs concurrently under a plan (`--slots`).

Subprocesses get OMP_NUM_THREADS=1: tiny models train fastest on one thread on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import clirun
import pytest
import waitfor
import yaml

from kiln.local import runner
from kiln.zoo import records, store

KILN = [sys.executable, "-m", "kiln.cli"]
DEADLINE_SECONDS = 180.0


def _job(path: Path, name: str, **spec_overrides: object) -> Path:
    spec: dict[str, object] = {
        "model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                  "inputShape": [1, 8, 8]},
        "training": {"epochs": 3, "batchSize": 64,
                     "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
    }
    spec.update(spec_overrides)
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
           "spec": spec}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("KILN_ZOO", None)
    return env


def _kiln(*args: str, cwd: Path, env: dict[str, str] | None = None) -> clirun.Done:
    return clirun.kiln(*args, cwd=cwd, env=env or _env())


def test_run_trains_two_jobs_in_order_registers_them_and_prints_results(tmp_path: Path) -> None:
    # Freezing off: its reference processes would only add two more interpreters here.
    off = {"enabled": False}
    first = _job(tmp_path / "a.yaml", "digits-a", freezing=off)
    second = _job(tmp_path / "b.yaml", "digits-b", freezing=off,
                  target={"metric": "validation_accuracy", "value": 0.5})
    # --slots 1: one after another in file order on any machine (the sequential runner).
    done = _kiln("run", str(first), str(second), "--zoo", "zoo", "--slots", "1", cwd=tmp_path,
                 env=_env(KILN_TENSORBOARD_DIR=str(tmp_path / "tensorboard")))
    assert done.returncode == 0, done.stderr
    assert "Kiln results" in done.stdout and "Plan:" not in done.stdout
    assert "digits-a" in done.stdout and "digits-b" in done.stdout
    saved = {r.job_name: r for r in records.list_records(store.DirStore(tmp_path / "zoo"))}
    assert sorted(saved) == ["digits-a", "digits-b"]
    # The second job warm-starts from the first (same architecture: similarity 1) and says so.
    assert saved["digits-a"].parent is None
    assert saved["digits-b"].parent == saved["digits-a"].id
    assert saved["digits-b"].similarity == pytest.approx(1.0)
    assert f"Warm start from {saved['digits-a'].id}" in done.stdout
    # stdout is a pipe: one plain line per evaluation, no bar frame, each history beside its log
    assert "━" not in done.stdout, done.stdout
    for name in ("digits-a", "digits-b"):  # digits-b stops at its target
        said = [line.split(" step ")[0] for line in done.stdout.splitlines()
                if line.startswith(f"{name}: epoch ")]
        history = runner.read_history(tmp_path / ".kiln" / "runs" / f"{name}.metrics.jsonl")
        assert said == [f"{name}: epoch {line['epoch']}/3" for line in history]
        assert len(history) == 3 if name == "digits-a" else history
        assert list((tmp_path / "tensorboard" / name).glob("events.out.tfevents.*"))
    # the commands that read what the run left need no second interpreter
    plotted = clirun.kiln("plot", ".kiln/runs/digits-a.metrics.jsonl", ".kiln/runs/digits-b.log",
                          "--out", "curves.png", cwd=tmp_path)
    assert plotted.returncode == 0 and (tmp_path / "curves.png").stat().st_size > 0, plotted.stderr
    # each model keeps its run's evaluations in the zoo, drawn by model id (a cluster job's way)
    for name, record in saved.items():
        kept = records.read_history(store.DirStore(tmp_path / "zoo"), record)
        ran = runner.read_history(tmp_path / ".kiln" / "runs" / f"{name}.metrics.jsonl")
        assert [(h["step"], h["validation_accuracy"]) for h in kept] == [
            (h["step"], pytest.approx(h["validation_accuracy"])) for h in ran]
    from_zoo = clirun.kiln("plot", saved["digits-b"].id, "--zoo", "zoo", "--out", "zoo.png",
                           cwd=tmp_path)
    assert from_zoo.returncode == 0 and (tmp_path / "zoo.png").stat().st_size > 0, from_zoo.stderr
    listing = clirun.kiln("zoo", "ls", "--zoo", "zoo", cwd=tmp_path)
    assert all(r.id in listing.stdout for r in saved.values()), listing.stdout
    query = clirun.kiln("zoo", "query", str(first), "--zoo", "zoo", cwd=tmp_path)
    assert query.returncode == 0, query.stderr
    assert "1.000" in query.stdout and "Candidate parent" in query.stdout
    assert "only if its guard accepts it" in query.stdout  # a candidate, not yet a parent
    as_json = json.loads(clirun.kiln("zoo", "query", str(first), "--zoo", "zoo", "-o", "json",
                                     cwd=tmp_path).stdout)
    assert as_json["candidate"] in {r.id for r in saved.values()} and "parent" not in as_json


def test_run_registers_in_an_s3_zoo_over_http(tmp_path: Path, s3_server: object,
                                              s3_bucket: str) -> None:
    endpoint = s3_server.endpoint  # type: ignore[attr-defined]
    env = _env(KILN_ZOO_ACCESS_KEY="kiln-test-access", KILN_ZOO_SECRET_KEY="kiln-test-secret")
    job = _job(tmp_path / "a.yaml", "digits-s3", training={"epochs": 1, "batchSize": 64})
    done = _kiln("run", str(job), "--zoo", f"s3://{s3_bucket}", "--zoo-endpoint", endpoint,
                 "-o", "json", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    [result] = json.loads(done.stdout)  # -o json: stdout holds only the results
    assert "━" not in done.stderr, done.stderr  # nor a progress bar's frame on stderr
    assert (result["name"], result["architecture"]) == ("digits-s3", "small_cnn")
    listing = clirun.kiln("zoo", "ls", "--zoo", f"s3://{s3_bucket}", "--zoo-endpoint", endpoint,
                          cwd=tmp_path, env=env)
    assert "digits-s3" not in listing.stderr and "small_cnn" in listing.stdout, listing
    assert result["zoo_model"] in listing.stdout


def test_a_failing_trainer_gives_a_clear_message_and_exit_1(tmp_path: Path) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("too short", encoding="utf-8")
    job = _job(tmp_path / "t.yaml", "text-tiny",
               model={"architecture": "char_transformer", "inputShape": [64]},
               dataset={"name": "text", "path": str(corpus)})
    done = _kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path)
    assert done.returncode == 1
    err = " ".join(done.stderr.split())
    assert "text-tiny: trainer exited with code 2" in err
    assert "spec.dataset.path" in err
    assert "Traceback" not in err


# `kiln` ignoring SIGINT, as a shell leaves a command it starts in the background (`kiln run &`).
KILN_IGNORING_SIGINT = [sys.executable, "-c", (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "runpy.run_module('kiln.cli', run_name='__main__')")]


def _ctrl_c(process: subprocess.Popen[str]) -> None:
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does


def _sigterm_to_kiln_only(process: subprocess.Popen[str]) -> None:
    os.kill(process.pid, signal.SIGTERM)  # `kill PID`, a service manager stopping kiln


@pytest.mark.parametrize(
    ("kiln", "stop", "code"),
    [
        pytest.param(KILN, _ctrl_c, 130, id="both-processes-see-it"),
        # Deterministically the case where the trainer acts on Ctrl-C alone (or first): it
        # checkpoints and exits 130 by itself, which kiln must report as a stop, not a failure.
        pytest.param(KILN_IGNORING_SIGINT, _ctrl_c, 130, id="only-the-trainer-sees-it"),
        # Only kiln sees it: kiln must stop its trainers, which checkpoint.
        pytest.param(KILN, _sigterm_to_kiln_only, 143, id="sigterm-to-kiln-alone"),
    ],
)
def test_ctrl_c_or_sigterm_checkpoints_the_running_job_and_stops(
    tmp_path: Path, kiln: list[str], stop: Callable[[subprocess.Popen[str]], None], code: int,
) -> None:
    job = _job(tmp_path / "long.yaml", "digits-long", training={"epochs": 500, "batchSize": 64},
               freezing={"enabled": False})  # no reference process beside the trainer
    process = subprocess.Popen([*kiln, "run", str(job), "--zoo", "zoo"], cwd=tmp_path,
                               env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    checkpoint = tmp_path / "zoo" / "checkpoints" / "default" / "digits-long" / "checkpoint.pt"
    waitfor.file_from(process, checkpoint, timeout=DEADLINE_SECONDS, what="the checkpoint")
    stop(process)
    out, err = process.communicate(timeout=DEADLINE_SECONDS)
    assert process.returncode == code, err
    said = " ".join((err + out).split())
    assert "digits-long: stopped; any checkpoint it saved is kept, `kiln run` again resumes it" in said
    assert "trainer exited with code" not in said
    assert checkpoint.exists()
    assert "Traceback" not in err
    with runner.lock(tmp_path / ".kiln" / "runs" / "digits-long.lock", "digits-long"):
        pass  # kiln released the job's lock when it exited: a rerun may start


def test_three_jobs_on_two_slots_run_under_a_plan_never_above_capacity(tmp_path: Path) -> None:
    files = [str(_job(tmp_path / f"{n}.yaml", f"digits-{n}",
                      dataset={"name": "digits", "maxSamples": 300},
                      training={"epochs": 1, "batchSize": 64},
                      freezing={"enabled": False}))  # no reference process beside each trainer
             for n in "abc"]
    done = _kiln("run", *files, "--slots", "2", "--zoo", "zoo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())
    assert "Plan: 3 jobs on 2 CPU slots" in out
    assert out.index("Plan: 3 jobs") < out.index("digits-a: training")  # printed first
    assert "planned" in out and "actual" in out  # the results' planned-vs-actual columns
    record = json.loads((tmp_path / ".kiln" / "runs" / "run.json").read_text(encoding="utf-8"))
    jobs = record["jobs"]
    assert [j["state"] for j in jobs] == ["done"] * 3
    # At every trainer start, the devices held by trainers running then never exceed 2.
    for job in jobs:
        held = sum(j["gpus"] for j in jobs
                   if j["start_seconds"] <= job["start_seconds"] < j["end_seconds"])
        assert held <= 2, jobs
    saved = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert sorted(r.job_name for r in saved) == ["digits-a", "digits-b", "digits-c"]
    plotted = clirun.kiln("plot", "--plan", ".kiln/runs/run.json", "--out", "plan.png",
                          cwd=tmp_path)
    assert plotted.returncode == 0 and (tmp_path / "plan.png").stat().st_size > 0, plotted.stderr
