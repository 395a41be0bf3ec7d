"""A zoo or working folder that cannot be written: `kiln run` and `kiln sweep run` refuse a zoo
they cannot write before any training (exit 2, naming the path and the fix), a run whose
folder cannot hold its state says where it went, and the commands that only read keep working.

The folders are really unwritable: mode 0555, and for root, whom modes do not stop, also the
immutable attribute (where the file system and capabilities allow it; else the test skips).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import clirun
import pytest
import yaml

from kiln import cli
from kiln.local import runner
from kiln.local import sweep as local_sweep
from kiln.zoo import store

JOB: dict[str, Any] = {
    "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "small"},
    "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
             "training": {"epochs": 2}}}
SWEEP: dict[str, Any] = {
    "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "search"},
    "spec": {"template": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                          "training": {"epochs": 2}},
             "parameters": [{"path": "model.args.width", "categorical": [8, 16]}]}}
# Linux's FS_IOC_GETFLAGS / FS_IOC_SETFLAGS and FS_IMMUTABLE_FL (chattr +i), as chattr uses them.
_GETFLAGS, _SETFLAGS, _IMMUTABLE = 0x80086601, 0x40086602, 0x10


def _writable(folder: Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def _immutable(folder: Path, on: bool) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, _GETFLAGS, flags, True)
        flags[0] = flags[0] | _IMMUTABLE if on else flags[0] & ~_IMMUTABLE
        fcntl.ioctl(fd, _SETFLAGS, flags, True)
    finally:
        os.close(fd)


@pytest.fixture
def read_only(request: pytest.FixtureRequest) -> Any:
    """`read_only(folder)` makes `folder` unwritable for this process until the test ends."""
    def make(folder: Path) -> Path:
        folder.mkdir(exist_ok=True)
        folder.chmod(0o555)
        request.addfinalizer(lambda: folder.chmod(0o755))
        if _writable(folder):  # root
            try:
                _immutable(folder, True)
            except OSError as exc:
                pytest.skip(f"cannot make {folder} unwritable for root here: {exc}")
            request.addfinalizer(lambda: _immutable(folder, False))
        if _writable(folder):
            pytest.skip(f"cannot make {folder} unwritable here")
        return folder
    return make


def _no_training(*_: object, **__: object) -> None:
    raise AssertionError("training must not start")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KILN_ZOO", None)
    return env


@pytest.mark.parametrize("command", [["run", "job.yaml"], ["sweep", "run", "tsw.yaml"]],
                         ids=["run", "sweep-run"])
@pytest.mark.parametrize("where", ["zoo-flag", "default-zoo"])
def test_a_zoo_that_cannot_be_written_is_refused_before_training(
    tmp_path: Path, read_only: Any, monkeypatch: pytest.MonkeyPatch, command: list[str],
    where: str,
) -> None:
    monkeypatch.setattr(runner, "run_jobs", _no_training)
    monkeypatch.setattr(local_sweep, "SweepRun", _no_training)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB), encoding="utf-8")
    (tmp_path / "tsw.yaml").write_text(yaml.safe_dump(SWEEP), encoding="utf-8")
    argv = [str(tmp_path / a) if a.endswith(".yaml") else a for a in command]
    if where == "zoo-flag":  # an existing zoo on a read-only mount
        zoo = tmp_path / "zoo"
        zoo.mkdir()
        read_only(zoo)
        done = clirun.kiln(*argv, "--zoo", str(zoo), cwd=tmp_path, env=_env())
        named = f"--zoo {zoo}: cannot write to directory {zoo}:"
    else:  # the default ./.kiln/zoo in a read-only folder: it cannot be made
        here = read_only(tmp_path / "here")
        done = clirun.kiln(*argv, cwd=here, env=_env())
        named = (f"--zoo {cli.DEFAULT_ZOO}: cannot write to directory {here}/.kiln/zoo (nor "
                 f"make it in {here}):")
    assert done.returncode == cli.EXIT_USAGE, done.stdout + done.stderr
    err = " ".join(done.stderr.split())
    assert named in err and "pass --zoo a writable directory" in err, err
    assert "Traceback" not in done.stderr


def test_dir_store_check_writable_passes_where_it_can_write_and_leaves_nothing(
        tmp_path: Path) -> None:
    store.DirStore(tmp_path / "new" / "zoo").check_writable()  # made on the first write
    assert list(tmp_path.iterdir()) == []
    zoo = store.DirStore(tmp_path)
    zoo.put_bytes("a/b", b"x")
    zoo.check_writable()
    assert zoo.list_keys("") == ["a/b"] and sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_sweep_whose_folder_cannot_hold_its_state_says_where_it_went(
    tmp_path: Path, read_only: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Path] = []

    class Finished:  # the run, without training: the sweep as given
        wall_seconds = 0.0

        def __init__(self, swept: Any, *, work_dir: Path, **_: object) -> None:
            self.swept = swept
            seen.append(work_dir)

        def run(self) -> Any:
            return self.swept

    monkeypatch.setattr(local_sweep, "SweepRun", Finished)
    (tmp_path / "tsw.yaml").write_text(yaml.safe_dump(SWEEP), encoding="utf-8")
    here = read_only(tmp_path / "here")
    done = clirun.kiln("sweep", "run", str(tmp_path / "tsw.yaml"), "--zoo",
                       str(tmp_path / "zoo"), cwd=here, env=_env())
    (work_dir,) = seen
    with contextlib.suppress(OSError):
        shutil.rmtree(work_dir)
    assert done.returncode == cli.EXIT_OK, done.stdout + done.stderr
    assert work_dir.name.startswith("kiln-runs-") and work_dir.is_absolute()
    err = " ".join(done.stderr.split())
    assert (f"warning: {here}/.kiln/runs cannot be written, so this run keeps its state in "
            f"{work_dir}") in err
    assert f"kiln sweep show {work_dir}/search.sweep.json" in err


def test_reading_commands_work_on_a_read_only_zoo_and_folder(
    tmp_path: Path, read_only: Any,
) -> None:
    import torch

    from kiln.zoo import records

    here = tmp_path / "here"
    zoo, runs = here / ".kiln" / "zoo", here / ".kiln" / "runs"
    record = records.ZooRecord(
        id=records.ZooModelId("small_cnn-0badc0de"), architecture="small_cnn", args={}, input_shape=(1, 8, 8),
        modality="image", task="classification", dataset="digits",
        metric_name="validation_accuracy", metric_value=0.9, num_params=10,
        created_time="2025-01-01T00:00:00Z", job_name="j", job_spec={})
    records.write_record(store.DirStore(zoo), record, {"w": torch.zeros(2)}, {})
    runs.mkdir(parents=True)
    state = {**SWEEP, "status": {"phase": "Succeeded", "trials": {"total": 1, "succeeded": 1},
                                 "history": [{"index": 0, "name": "search-t0",
                                              "state": "Succeeded", "metric": 0.9,
                                              "params": {"model.args.width": 8},
                                              "evaluations": [[2, 0.9, 5.0]]}]}}
    (runs / "search.sweep.json").write_text(json.dumps(state), encoding="utf-8")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB), encoding="utf-8")
    for folder in (zoo, runs, here / ".kiln", here):
        read_only(folder)
    listed = clirun.kiln("zoo", "ls", cwd=here, env=_env())
    assert listed.returncode == cli.EXIT_OK, listed.stderr
    assert "small_cnn-0badc0de" in listed.stdout
    shown = clirun.kiln("zoo", "show", "small_cnn-0badc0de", cwd=here, env=_env())
    assert shown.returncode == cli.EXIT_OK, shown.stderr
    swept = clirun.kiln("sweep", "show", "search", cwd=here, env=_env())
    assert swept.returncode == cli.EXIT_OK, swept.stderr
    assert "search-t0" in swept.stdout and "warning" not in swept.stderr
    valid = clirun.kiln("validate", str(tmp_path / "job.yaml"), cwd=here, env=_env())
    assert valid.returncode == cli.EXIT_OK, valid.stderr
    assert sorted(p.name for p in here.iterdir()) == [".kiln"]  # nothing was made
