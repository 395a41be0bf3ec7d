"""`kiln run` with its trainers forked from the zygote (`kiln.local.zygote`) and, with
``KILN_FORK_TRAINERS=0``, as new interpreters: a job trains, a crash's traceback reaches the
job's log and its exit code the error, SIGTERM checkpoints and stops, and two jobs each see only
their own environment, working directory and modules. A job's model records what it saw.
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
import pytest
import waitfor
import yaml

from kiln import contract
from kiln.zoo import records, store

DEADLINE_SECONDS = 180.0

PROBE = '''
import json, os, sys
from pathlib import Path

import torch

MARK = {mark!r}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if {crash!r} and self.training and x.shape[0] > 1:  # past the one-sample probe
            raise ValueError("the model's own bug")
        return self.fc(x.flatten(1))


def build() -> Net:
    seen = {{"mark": MARK, "env": os.environ.get("KILN_TEST_MARK"), "cwd": os.getcwd(),
            "path0": sys.path[0], "pythonpath": os.environ.get("PYTHONPATH"),
            "ppid": os.getppid(), "pid": os.getpid()}}
    # written whole, then renamed: the test reads it as soon as the name appears
    Path(__file__).with_name("seen.tmp").write_text(json.dumps(seen), encoding="utf-8")
    Path(__file__).with_name("seen.tmp").replace(Path(__file__).with_name("seen.json"))
    return Net()
'''

FORK = [pytest.param("1", id="forked"), pytest.param("0", id="new-interpreter")]


def _job(folder: Path, name: str, *, mark: str, crash: bool = False, epochs: int = 1,
         samples: int | None = 300) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "probe.py").write_text(PROBE.format(mark=mark, crash=crash), encoding="utf-8")
    dataset: dict[str, Any] = {"name": "digits"}
    if samples is not None:
        dataset["maxSamples"] = samples
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
           "spec": {"model": {"entrypoint": "probe:build", "task": "classification",
                              "inputShape": [1, 8, 8]},
                    "dataset": dataset,
                    "training": {"epochs": epochs, "batchSize": 64,
                                 "optimizer": {"name": "adam", "lr": 0.01}},
                    "freezing": {"enabled": False}}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _env(fork: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           contract.Env.FORK_TRAINERS: fork, **extra}
    for name in ("KILN_ZOO", "PYTHONPATH", "KILN_TEST_MARK"):
        if name not in extra:
            env.pop(name, None)
    return env


def _seen(folder: Path) -> dict[str, Any]:
    seen: dict[str, Any] = json.loads((folder / "seen.json").read_text(encoding="utf-8"))
    return seen


def _forked(seen: dict[str, Any], kiln_pid: int) -> bool:
    """Whether the trainer was the zygote's child rather than kiln's."""
    return bool(seen["ppid"] != kiln_pid)


@pytest.mark.parametrize("fork", FORK)
def test_two_jobs_train_each_with_only_its_own_environment_folder_and_modules(
        tmp_path: Path, fork: str) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    job_a = _job(first, "probe-a", mark="a")
    job_b = _job(second, "probe-b", mark="b")
    done = clirun.kiln("run", str(job_a), "--zoo", str(tmp_path / "zoo"), cwd=first,
                       env=_env(fork, KILN_TEST_MARK="only-a"))
    assert done.returncode == 0, done.stdout + done.stderr
    done = clirun.kiln("run", str(job_b), "--zoo", str(tmp_path / "zoo"), cwd=second,
                       env=_env(fork))
    assert done.returncode == 0, done.stdout + done.stderr
    a, b = _seen(first), _seen(second)
    assert (a["mark"], a["env"], a["cwd"], a["path0"]) == ("a", "only-a", str(first), str(first))
    assert (b["mark"], b["env"], b["cwd"], b["path0"]) == ("b", None, str(second), str(second))
    assert a["pythonpath"] == str(first) and b["pythonpath"] == str(second)
    assert _forked(a, os.getpid()) is _forked(b, os.getpid()) is (fork == "1")
    if fork == "1":
        assert a["ppid"] == b["ppid"]  # one zygote for this process, shared
    saved = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert sorted(r.job_name for r in saved) == ["probe-a", "probe-b"]


@pytest.mark.parametrize("fork", FORK)
def test_a_crash_leaves_its_traceback_in_the_log_and_its_exit_code_in_the_error(
        tmp_path: Path, fork: str) -> None:
    job = _job(tmp_path, "probe-crash", mark="c", crash=True)
    done = clirun.kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path, env=_env(fork))
    assert done.returncode == 1
    said = " ".join((done.stdout + done.stderr).split())
    assert f"probe-crash: trainer exited with code {contract.EXIT_UNEXPECTED}" in said, said
    log = (tmp_path / ".kiln" / "runs" / "probe-crash.log").read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in log
    assert "probe.py" in log and "ValueError: the model's own bug" in log
    assert _forked(_seen(tmp_path), os.getpid()) is (fork == "1")


@pytest.mark.parametrize("fork", FORK)
def test_sigterm_to_kiln_checkpoints_the_trainer_and_stops(tmp_path: Path, fork: str) -> None:
    job = _job(tmp_path, "probe-long", mark="l", epochs=500, samples=None)
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "run", str(job), "--zoo", "zoo"], cwd=tmp_path,
        env=_env(fork), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    checkpoint = tmp_path / "zoo" / "checkpoints" / "default" / "probe-long" / "checkpoint.pt"
    waitfor.file_from(process, checkpoint, timeout=DEADLINE_SECONDS, what="the checkpoint")
    saved = checkpoint.stat().st_mtime_ns
    os.kill(process.pid, signal.SIGTERM)  # kiln alone: it must stop its trainer
    out, err = process.communicate(timeout=DEADLINE_SECONDS)
    assert process.returncode == 128 + signal.SIGTERM, err
    said = " ".join((err + out).split())
    assert "probe-long: stopped; any checkpoint it saved is kept" in said, said
    assert "Traceback" not in err
    assert checkpoint.stat().st_mtime_ns > saved  # written again on the way out
    assert _forked(_seen(tmp_path), process.pid) is (fork == "1")


HELD = '''
import json, os, time
from pathlib import Path

import torch


def build() -> torch.nn.Module:
    here = Path(__file__).parent
    seen = {"ppid": os.getppid(), "pid": os.getpid()}
    (here / "seen.tmp").write_text(json.dumps(seen), encoding="utf-8")
    (here / "seen.tmp").replace(here / "seen.json")  # whole when the test sees the name
    while not (here / "go").exists():  # held here until the test lets it go
        time.sleep(0.05)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
'''


@pytest.mark.parametrize("crash", [False, True], ids=["trains", "crashes"])
def test_a_killed_zygote_leaves_its_trainers_and_kiln_run_reports_their_end(
        tmp_path: Path, crash: bool) -> None:
    job = _job(tmp_path, "held", mark="h", crash=crash)
    probe = HELD if not crash else HELD.replace(
        "    return torch.nn", "    raise ValueError('the model is broken')\n    return torch.nn")
    (tmp_path / "probe.py").write_text(probe, encoding="utf-8")
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "run", str(job), "--zoo", "zoo"], cwd=tmp_path,
        env=_env("1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        waitfor.file_from(process, tmp_path / "seen.json", timeout=DEADLINE_SECONDS,
                          what="the trainer's model")
        zygote_pid = _seen(tmp_path)["ppid"]
        assert zygote_pid != process.pid  # forked: the zygote is its parent
        os.kill(zygote_pid, signal.SIGKILL)
        (tmp_path / "go").write_text("", encoding="utf-8")
        out, err = process.communicate(timeout=DEADLINE_SECONDS)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert "Traceback" not in err, err
    said = " ".join((out + err).split())
    if crash:
        assert process.returncode == 1, said
        # the trainer's own code and reason, though the zygote that would report it is gone
        assert f"held: trainer exited with code {contract.EXIT_INVALID}" in said, said
        assert "probe:build() raised ValueError: the model is broken" in said, said
    else:
        assert process.returncode == 0, said
        (record,) = records.list_records(store.DirStore(tmp_path / "zoo"))
        assert record.job_name == "held"
