"""`kiln.local.runner`: how a trainer's end is reported (interrupted, failed, killed), the per-job lock,
and trainer text printed verbatim. Fake trainers (tiny Python scripts) stand in for
`python -m kiln_trainer`; the real one runs in tests/integration/test_local_run.py."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kiln import api, contract
from kiln.local import runner


@pytest.fixture(autouse=True)
def _trainers_as_new_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests fake the trainer by replacing subprocess.Popen, which a trainer forked from
    the zygote (`kiln.local.zygote`) would bypass."""
    monkeypatch.setenv(contract.Env.FORK_TRAINERS, "0")


JOB = api.parse_job({
    "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "fake"},
    "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
             "training": {"epochs": 1}},
})
RESULT = contract.to_line(contract.Result(
    metric_name="validation_accuracy", metric=0.5, validation_accuracy=0.5, validation_loss=1.0,
    wall_seconds=1.0, time_to_target_seconds=None, target_reached=False, epochs_run=1, steps=4,
    samples_per_second=100.0, zoo_model=None, resumed_from_epoch=0))


def _run_with_fake_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str
) -> tuple[Any, str]:
    """Run JOB with `script` as the trainer; returns (outcome or exception, console text)."""
    real_popen = subprocess.Popen

    def fake_popen(_command: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        return real_popen([sys.executable, "-c", script], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    out = io.StringIO()
    console = Console(file=out, width=200)
    try:
        outcome: Any = runner.run_jobs([JOB], zoo_uri=str(tmp_path / "zoo"), work_dir=tmp_path, console=console)
    except (KeyboardInterrupt, runner.TrainerFailed) as exc:
        outcome = exc
    return outcome, out.getvalue()


@pytest.mark.parametrize(
    "script",
    [
        pytest.param("import sys; sys.exit(130)", id="exit-130-after-sigint"),
        pytest.param("import sys; sys.exit(143)", id="exit-143-after-sigterm"),
        pytest.param("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", id="sigterm"),
    ],
)
@pytest.mark.process
def test_a_trainer_stopped_by_sigint_or_sigterm_is_an_interruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str
) -> None:
    outcome, text = _run_with_fake_trainer(tmp_path, monkeypatch, script)
    assert isinstance(outcome, KeyboardInterrupt)
    assert "fake: stopped; any checkpoint it saved is kept, `kiln run` again resumes it" in text


@pytest.mark.process
def test_a_trainer_killed_by_a_signal_names_the_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcome, _ = _run_with_fake_trainer(
        tmp_path, monkeypatch, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert isinstance(outcome, runner.TrainerFailed) and outcome.exit_code == -signal.SIGKILL
    assert "job fake: trainer was killed by signal 9 (SIGKILL)" in str(outcome)
    assert "exited with code" not in str(outcome)


@pytest.mark.process
def test_a_trainer_failing_with_an_exit_code_still_names_the_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcome, _ = _run_with_fake_trainer(tmp_path, monkeypatch, "import sys; sys.exit(2)")
    assert isinstance(outcome, runner.TrainerFailed)
    assert "job fake: trainer exited with code 2" in str(outcome)


@pytest.mark.process
def test_trainer_info_and_progress_text_is_printed_verbatim_not_as_markup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = [contract.Info("parent [/] and [red]red[/red]"), contract.Progress(
        epoch=1, epochs=1, step=4, steps_per_epoch=4, train_loss=0.5, validation_accuracy=None,
        validation_loss=None, samples_per_second=None, eta_seconds=None, elapsed_seconds=1.0,
        frozen_modules=1, modules=3, evaluated=True)]  # not a terminal: a line per evaluation
    script = "".join(f"print({contract.to_line(e)!r})\n" for e in events)
    outcome, text = _run_with_fake_trainer(tmp_path, monkeypatch, script + f"print({RESULT!r})")
    assert [o.result["metric"] for o in outcome] == [0.5]
    assert "parent [/] and [red]red[/red]" in text and "frozen 1/3 modules" in text


@pytest.mark.process
def test_stray_output_is_skipped_and_an_unreadable_event_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = ("print('a stray line'); print('{\"event\": \"progress\", \"epoch\": 1}'); "
              f"print({RESULT!r})")
    with pytest.warns(UserWarning, match="unreadable event .*progress event without epochs"):
        outcome, _ = _run_with_fake_trainer(tmp_path, monkeypatch, script)
    assert [o.result["metric"] for o in outcome] == [0.5]


def test_the_job_lock_refuses_a_second_holder_naming_the_first_and_is_released_after(
    tmp_path: Path,
) -> None:
    lock = tmp_path / "job.lock"
    busy = rf"job job is already running \(pid {os.getpid()}\)"
    with (runner.lock(lock, "job"), pytest.raises(runner.JobBusy, match=busy),
          runner.lock(lock, "job")):
        pass
    with runner.lock(lock, "job"):  # released on exit
        pass


def test_a_held_job_lock_stops_run_jobs_before_any_trainer_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_trainer(*_: object, **__: object) -> None:
        raise AssertionError("no trainer may start")

    monkeypatch.setattr(subprocess, "Popen", no_trainer)
    with runner.lock(tmp_path / "fake.lock", "fake"), pytest.raises(runner.JobBusy):
        runner.run_jobs([JOB], zoo_uri=str(tmp_path / "zoo"), work_dir=tmp_path, console=Console())


def test_the_same_job_from_another_directory_on_the_same_directory_zoo_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its checkpoint lives in the zoo: a second run would resume it and race the first.
    def no_trainer(*_: object, **__: object) -> None:
        raise AssertionError("no trainer may start")

    zoo = tmp_path / "zoo"
    with runner.job_locks([JOB], tmp_path / "a", zoo_uri=str(zoo)):
        monkeypatch.setattr(subprocess, "Popen", no_trainer)
        with pytest.raises(runner.JobBusy, match=f"with zoo {zoo}"):
            runner.run_jobs([JOB], zoo_uri=str(zoo), work_dir=tmp_path / "b",
                            console=Console())
    with runner.job_locks([JOB], tmp_path / "b", zoo_uri=str(zoo)):  # released, and
        pass  # an S3 zoo (not a directory) takes no lock here:
    with runner.job_locks([JOB], tmp_path / "c", zoo_uri="s3://bucket"):
        pass


def test_trainers_get_each_job_files_folder_first_on_pythonpath_then_the_users(
        tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    files = [tmp_path / "a" / "one.yaml", tmp_path / "b" / "two.yaml", tmp_path / "a" / "x.yaml"]
    found = runner.python_path(files, {"PYTHONPATH": f"/opt/site{os.pathsep}/srv/lib"})
    assert found["PYTHONPATH"].split(os.pathsep) == [
        str((tmp_path / "a").resolve()), str((tmp_path / "b").resolve()), "/opt/site", "/srv/lib"]
    assert runner.python_path(files[:1], {}) == {"PYTHONPATH": str((tmp_path / "a").resolve())}


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel's parent-death signal")
def test_a_trainer_started_from_the_main_thread_is_asked_to_stop_with_us(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str | None] = []

    def no_trainer(_command: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        asked.append(kwargs["env"].get(contract.Env.STOP_WITH_PARENT))
        raise FileNotFoundError  # nothing starts

    def start(command: list[str]) -> None:
        with open(tmp_path / "log", "w", encoding="utf-8") as log, \
                pytest.raises(runner.TrainerFailed):
            runner.start_trainer("fake", command, log=log, own=False, env={})

    monkeypatch.setattr(subprocess, "Popen", no_trainer)
    trainer = contract.trainer_command(1, ["--job", "j.json"])
    start(trainer)
    # under torchrun its agent would be the trainers' parent, not us
    start(contract.trainer_command(2, ["--job", "j.json"]))
    # the kernel's signal follows the thread that starts a process, which could end first
    elsewhere = threading.Thread(target=start, args=(trainer,))
    elsewhere.start()
    elsewhere.join()
    assert asked == [str(os.getpid()), None, None]


@pytest.mark.process
def test_an_own_command_not_on_path_fails_the_job_naming_the_field(tmp_path: Path) -> None:
    job = api.parse_job({**api.to_wire(JOB), "spec": {
        **api.to_wire(JOB)["spec"], "template": {"command": ["no-such-command-xyz", "--fast"]}}})
    with pytest.raises(runner.TrainerFailed) as caught:
        runner.run_jobs([job], zoo_uri=str(tmp_path / "zoo"), work_dir=tmp_path, console=Console(file=io.StringIO()))
    assert caught.value.exit_code == 127
    assert str(caught.value) == ("job fake: spec.template.command: cannot run "
                                 "'no-such-command-xyz': not found on PATH; install it or give "
                                 "its full path")


@pytest.mark.process
def test_stray_stdout_goes_to_the_log_so_a_failure_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = ("import sys; print('loading my data'); print('oops', file=sys.stderr, flush=True); "
              "print('my loop broke here'); sys.exit(3)")
    outcome, _ = _run_with_fake_trainer(tmp_path, monkeypatch, script)
    assert isinstance(outcome, runner.TrainerFailed)
    assert "exited with code 3" in str(outcome) and "(no output)" not in str(outcome)
    assert "    loading my data\n" in str(outcome) and "    my loop broke here" in str(outcome)
    assert set((tmp_path / "fake.log").read_text(encoding="utf-8").splitlines()) == {
        "loading my data", "oops", "my loop broke here"}
