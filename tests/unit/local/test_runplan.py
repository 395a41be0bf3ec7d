"""`kiln.local.runplan`: jobs start in the plan's queue order when their devices are free, never above
capacity; a failure or an interruption stops every trainer; run.json records planned vs.
actual. Fake trainers (tiny Python scripts chosen by job name) stand in for `python -m
kiln_trainer`; the real one runs in tests/integration/test_local_run.py."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kiln import api, contract
from kiln.local import machine, runner, runplan
from kiln.placement import profilecache, types
from kiln_trainer import warm


@pytest.fixture(autouse=True)
def _trainers_as_new_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests fake the trainer by replacing subprocess.Popen, which a trainer forked from
    the zygote (`kiln.local.zygote`) would bypass."""
    monkeypatch.setenv(contract.Env.FORK_TRAINERS, "0")


PROGRESS = contract.Progress(
    epoch=1, epochs=1, step=4, steps_per_epoch=4, train_loss=None, validation_accuracy=None,
    validation_loss=None, samples_per_second=100.0, eta_seconds=None, elapsed_seconds=1.0)
RESULT = contract.Result(
    metric_name="validation_accuracy", metric=0.5, validation_accuracy=0.5, validation_loss=1.0,
    wall_seconds=1.0, time_to_target_seconds=None, target_reached=False, epochs_run=1, steps=4,
    samples_per_second=100.0, zoo_model=None, resumed_from_epoch=0)
OK = f"print({contract.to_line(PROGRESS)!r}); print({contract.to_line(RESULT)!r})"
# Waits until stopped; SIGTERM -> checkpoint and exit 143, as the real trainer does.
LONG = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); "
        "print('{\"event\": \"info\", \"message\": \"running\"}', flush=True); time.sleep(120)")
FAIL = "import sys; print('boom', file=sys.stderr); sys.exit(2)"
STOPPED = "import sys; sys.exit(130)"
# torchrun's way: rank 0 says it stopped, torchrun exits 1.
STOPPED_UNDER_TORCHRUN = ("import sys; print({!r}); sys.exit(1)".format(contract.to_line(
    contract.Info(f"{contract.STOPPED_PREFIX} at epoch 1, step 3; checkpoint saved to x"))))


def _job(name: str, template: dict[str, Any] | None = None) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                 "dataset": {"maxSamples": 300}, "training": {"epochs": 1},
                 "template": template or {}},
    })


def _plan(*rows: tuple[str, int, float, float]) -> types.Plan:
    """A plan on node "local" from (job, k, start, seconds) rows."""
    assignments = tuple(types.Assignment(job, runplan.NODE, k, "single" if k == 1 else "ddp",
                                         start, seconds) for job, k, start, seconds in rows)
    return types.Plan(assignments, max(a.end for a in assignments), "heuristic")


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, the_plan: types.Plan,
         scripts: dict[str, str], *, slots: int = 2,
         templates: dict[str, dict[str, Any]] | None = None
         ) -> tuple[Any, str, dict[str, Any], list[list[str]]]:
    """Run the plan with fake trainers (jobs named in `templates` run their own command, for
    real); returns (outcomes or exception, console text, run.json, the commands the runner
    built)."""
    real_popen = subprocess.Popen
    commands: list[list[str]] = []

    def fake_popen(command: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        commands.append(command)
        if "--job" not in command:  # a job's own command
            return real_popen(command, **kwargs)
        name = Path(command[command.index("--job") + 1]).stem
        return real_popen([sys.executable, "-c", scripts[name]], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    jobs = [_job(a.job, (templates or {}).get(a.job))
            for a in sorted(the_plan.assignments, key=lambda a: a.job)]
    configs = {a.job: (types.Config(a.parallelism, a.gpus, a.seconds, "flops"),)
               for a in the_plan.assignments}
    devices = machine.Devices("cpu", slots, 1, lambda k, argv: ["torchrun", str(k), *argv])
    out = io.StringIO()
    try:
        outcome: Any = runplan.run_planned(
            jobs, the_plan=the_plan, configs=configs, devices=devices, zoo_uri=str(tmp_path / "zoo"),
            work_dir=tmp_path, console=Console(file=out, width=200))
    except (KeyboardInterrupt, runner.TrainerFailed) as exc:
        outcome = exc
    record = json.loads((tmp_path / "run.json").read_text(encoding="utf-8"))
    return outcome, out.getvalue(), record, commands


def _most_at_once(record: dict[str, Any]) -> int:
    """The most devices held at any moment, from run.json's start/end times."""
    ran = [j for j in record["jobs"] if "start_seconds" in j]
    return max(sum(int(j["gpus"]) for j in ran if j["start_seconds"] <= t["start_seconds"]
                   < j["end_seconds"]) for t in ran)


@pytest.mark.process
def test_jobs_start_in_queue_order_as_devices_free_and_report_planned_vs_actual(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    the_plan = _plan(("a", 1, 0.0, 8.0), ("b", 1, 0.0, 8.0), ("c", 1, 8.0, 8.0))
    outcomes, _, record, _ = _run(tmp_path, monkeypatch, the_plan, {n: OK for n in "abc"})
    assert [o.name for o in outcomes] == ["a", "b", "c"]
    jobs = {j["name"]: j for j in record["jobs"]}
    assert {j["state"] for j in jobs.values()} == {"done"}
    assert jobs["c"]["start_seconds"] >= min(jobs["a"]["end_seconds"], jobs["b"]["end_seconds"])
    assert _most_at_once(record) <= 2
    c = outcomes[2].placement
    assert (c.parallelism, c.gpus, c.planned_start_seconds, c.planned_seconds) == \
        ("single", 1, 8.0, 8.0)
    assert set(c.devices) <= {0, 1} and c.seconds >= 0
    assert record["plan"]["makespan_seconds"] == 16.0


@pytest.mark.process
def test_a_job_needing_every_device_waits_for_them_and_runs_under_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    the_plan = _plan(("a", 1, 0.0, 5.0), ("b", 2, 5.0, 5.0), ("c", 1, 10.0, 5.0))
    _, _, record, commands = _run(tmp_path, monkeypatch, the_plan, {n: OK for n in "abc"})
    jobs = {j["name"]: j for j in record["jobs"]}
    assert jobs["b"]["start_seconds"] >= jobs["a"]["end_seconds"]
    assert jobs["c"]["start_seconds"] >= jobs["b"]["end_seconds"]  # queue order, not just room
    assert jobs["b"]["devices"] == [0, 1] and _most_at_once(record) <= 2
    ddp = next(c for c in commands if c[0] == "torchrun")
    assert ddp[1] == "2" and ddp[-2:] == ["--parallelism", "ddp"]


@pytest.mark.process
def test_a_failed_trainer_stops_the_others_and_queued_jobs_never_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    the_plan = _plan(("a", 1, 0.0, 5.0), ("b", 1, 0.0, 5.0), ("c", 1, 5.0, 5.0))
    failed, text, record, _ = _run(tmp_path, monkeypatch, the_plan,
                                   {"a": LONG, "b": FAIL, "c": OK})
    assert isinstance(failed, runner.TrainerFailed) and failed.job_name == "b"
    assert "boom" in str(failed)
    assert [j["state"] for j in record["jobs"]] == ["stopped", "failed", "not started"]
    assert "a: stopped because another job failed; any checkpoint it saved is kept" in text


@pytest.mark.process
def test_an_own_command_not_on_path_fails_its_job_as_any_failed_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    the_plan = _plan(("a", 1, 0.0, 5.0), ("b", 1, 0.0, 5.0), ("c", 1, 5.0, 5.0))
    failed, text, record, _ = _run(tmp_path, monkeypatch, the_plan, {"a": LONG, "c": OK},
                                   templates={"b": {"command": ["no-such-command-xyz"]}})
    assert isinstance(failed, runner.TrainerFailed) and failed.job_name == "b"
    assert "b: spec.template.command: cannot run 'no-such-command-xyz': not found on PATH" in \
        str(failed)
    assert [j["state"] for j in record["jobs"]] == ["stopped", "failed", "not started"]
    assert "a: stopped because another job failed; any checkpoint it saved is kept" in text


@pytest.mark.parametrize("stopped", [pytest.param(STOPPED, id="exit-130"),
                                     pytest.param(STOPPED_UNDER_TORCHRUN, id="torchrun-exit-1")])
@pytest.mark.process
def test_a_trainer_stopped_by_a_signal_interrupts_the_whole_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopped: str
) -> None:
    the_plan = _plan(("a", 1, 0.0, 5.0), ("b", 1, 0.0, 5.0))
    outcome, text, record, _ = _run(tmp_path, monkeypatch, the_plan, {"a": LONG, "b": stopped})
    assert isinstance(outcome, KeyboardInterrupt)
    assert [j["state"] for j in record["jobs"]] == ["stopped", "stopped"]
    assert "b: stopped; any checkpoint it saved is kept" in text
    assert "a: stopped; any checkpoint it saved is kept" in text


@pytest.mark.process
def test_ctrl_c_in_the_runner_stops_every_running_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def ctrl_c(*_: object, **__: object) -> None:
        raise KeyboardInterrupt  # as if Ctrl-C arrived while showing a trainer's message

    monkeypatch.setattr(runner, "show", ctrl_c)
    the_plan = _plan(("a", 1, 0.0, 5.0), ("b", 1, 0.0, 5.0), ("c", 1, 5.0, 5.0))
    outcome, text, record, _ = _run(tmp_path, monkeypatch, the_plan,
                                    {"a": LONG, "b": LONG, "c": OK})
    assert isinstance(outcome, KeyboardInterrupt)
    assert [j["state"] for j in record["jobs"]] == ["stopped", "stopped", "not started"]
    # 143 once a fake trainer has set its handler, -15 if SIGTERM came before.
    assert all(j["exit_code"] in contract.INTERRUPTED_EXIT_CODES for j in record["jobs"][:2])
    assert text.count("stopped; any checkpoint it saved is kept") == 2


def test_every_lock_is_taken_before_any_trainer_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_trainer(*_: object, **__: object) -> None:
        raise AssertionError("no trainer may start")

    monkeypatch.setattr(subprocess, "Popen", no_trainer)
    the_plan = _plan(("a", 1, 0.0, 5.0), ("b", 1, 0.0, 5.0))
    devices = machine.Devices("cpu", 2, 1, None)
    with runner.lock(tmp_path / "b.lock", "b"), pytest.raises(runner.JobBusy):
        runplan.run_planned([_job("a"), _job("b")], the_plan=the_plan, configs={},
                            devices=devices, zoo_uri=str(tmp_path / "zoo"), work_dir=tmp_path,
                            console=Console(file=io.StringIO()))


def test_planned_devices_reuse_devices_freed_by_earlier_jobs() -> None:
    the_plan = _plan(("a", 2, 0.0, 4.0), ("b", 1, 0.0, 6.0), ("c", 2, 4.0, 2.0),
                     ("d", 3, 6.0, 1.0))
    assert runplan.planned_devices(the_plan, 3) == {"a": (0, 1), "b": (2,), "c": (0, 1),
                                                    "d": (0, 1, 2)}


def test_a_replan_says_which_queued_jobs_changed_config_and_when_they_start() -> None:
    before = {a.job: a for a in _plan(("b", 2, 14.0, 5.0), ("c", 1, 19.0, 5.0)).assignments}
    after = _plan(("c", 1, 10.0, 5.0), ("b", 1, 10.0, 8.0)).assignments
    assert runplan.replan_summary(before, after) == (
        "re-planned with measured speeds: b now single×1 (was ddp×2), planned start 10 s")
    same = _plan(("c", 1, 10.0, 5.0), ("b", 2, 15.0, 5.0)).assignments
    assert runplan.replan_summary(before, same) == (
        "re-planned with measured speeds: same configs, planned starts c at 10 s, b at 15 s")


def test_without_a_multi_process_trainer_only_single_is_planned() -> None:
    assert machine.Devices("cpu", 4, 1, None).parallelisms() == ("single",)
    launcher = machine.Devices("cpu", 4, 1, lambda k, argv: list(argv))
    assert launcher.parallelisms() == ("single", "ddp")
    assert machine.Devices("cuda:X", 4, 1, launcher.launcher).parallelisms() == \
        ("single", "ddp", "fsdp")
    assert machine.Devices("cpu", 1, 1, launcher.launcher).parallelisms() == ("single",)


def test_the_plan_of_real_estimates_fits_the_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runplan.os, "cpu_count", lambda: 4)
    devices = machine.local_devices(3)
    if devices.gpu:
        pytest.skip("this machine has GPUs; the CPU slot plan is what is checked here")
    the_plan, configs = runplan.make_plan([_job("a"), _job("b"), _job("c")], devices=devices,
                                          zoo=None, profile_cache=None,
                                          settings=types.Settings(use_milp=False))
    assert devices.count == 3 and devices.threads >= 1
    assert {a.job for a in the_plan.assignments} == {"a", "b", "c"}
    assert all(c.source == "flops" for cs in configs.values() for c in cs)
    assert all(a.gpus == 1 and a.start == 0.0 for a in the_plan.assignments)


def test_more_cpu_slots_than_cores_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runplan.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(machine.profile, "device_type", lambda device="auto": "cpu")
    with pytest.raises(ValueError, match=r"--slots 3: this machine has 2 CPU cores .* at most"):
        machine.local_devices(3)
    assert machine.local_devices(2).count == 2


# ---- profiling entrypoint models before planning ---------------------------------------------

DECISION = api.WarmStartDecision(
    parent="mixer-1a2b", similarity=0.8, parent_metric=0.9, matched_tensors=6, total_tensors=8,
    outcome=api.WarmStartOutcome.WARM, reason="warm start from mixer-1a2b: similarity 0.80")
PROFILE = contract.Profile(parameters=12345, flops_per_sample=4.0e5, graph_nodes=20,
                           untraceable=None, device="cpu", batch_size=64, step_seconds=0.0081,
                           step_status="ok", warm_start_decision=DECISION)
PROFILED = f"print({contract.to_line(PROFILE)!r})"


def _entrypoint_job(name: str, template: dict[str, Any] | None = None) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {"model": {"entrypoint": "mynets.mixer:mixer", "args": {"dim": 8},
                           "inputShape": [1, 8, 8]},
                 "dataset": {"maxSamples": 300}, "training": {"epochs": 1, "batchSize": 64},
                 "template": template or {}},
    })


def _profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: list[api.TrainingJob],
             scripts: dict[str, str]) -> tuple[Any, str, list[tuple[list[str], dict[str, str]]]]:
    """`profile_jobs` with fake profiling trainers chosen by job name; returns (the profiles or
    exception, console text, each command with its environment)."""
    real_popen = subprocess.Popen
    started: list[tuple[list[str], dict[str, str]]] = []

    def fake_popen(command: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        started.append((command, kwargs["env"]))
        name = Path(command[command.index("--job") + 1]).stem
        return real_popen([sys.executable, "-c", scripts[name]], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the trainer's own default is tested
    out = io.StringIO()
    try:
        profiled: Any = runplan.profile_jobs(
            jobs, devices=machine.Devices("cpu", 2, 3, None), zoo_uri=str(tmp_path / "zoo"),
            work_dir=tmp_path / "runs", console=Console(file=out, width=300),
            profile_cache=tmp_path / "profiles.json", env={"PYTHONPATH": "/jobs"})
    except (KeyboardInterrupt, runner.TrainerFailed) as exc:
        profiled = exc
    return profiled, out.getvalue(), started


@pytest.mark.process
def test_entrypoint_jobs_are_profiled_into_the_cache_plan_and_warm_start_decision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = [_entrypoint_job("m"), _job("registry"),
            _entrypoint_job("own", {"command": ["python", "-m", "train_loop"]})]
    profiled, text, started = _profile(tmp_path, monkeypatch, jobs, {"m": PROFILED})
    assert list(profiled) == ["m"]  # a registry model and an own command are not profiled
    command, env = started[0]
    assert command[1:3] == ["-m", "kiln_trainer"] and "--profile" in command
    assert env["PYTHONPATH"] == "/jobs" and env["OMP_NUM_THREADS"] == "3"  # as its training
    assert "m: profiled 12,345 parameters, 400 kFLOPs/sample, 8.1 ms/step on cpu; warm start: " \
        "warm start from mixer-1a2b: similarity 0.80" in text

    entries = json.loads((tmp_path / "profiles.json").read_text(encoding="utf-8"))["entries"]
    key = profilecache.cache_key(jobs[0].spec.model, batch_size=64, parallelism="single",
                                 gpus=1, kind="cpu")
    assert entries[key]["step_seconds"] == 0.0081 and entries[key]["status"] == "ok"

    # The trainer reads the decision as one made upstream: it applies it, deciding nothing.
    decided = warm.parse_decision(profiled["m"].warm_start)
    assert decided is not None and decided.parent == "mixer-1a2b"
    assert decided.outcome is api.WarmStartOutcome.WARM and decided.matched_tensors == 6

    devices = machine.Devices("cpu", 2, 1, None)
    _, configs = runplan.make_plan([jobs[0]], devices=devices, zoo=None, profile_cache=None,
                                   settings=types.Settings(use_milp=False), profiled=profiled)
    assert [c.source for c in configs["m"]] == ["profile"]


@pytest.mark.process
def test_a_user_code_error_while_profiling_fails_the_job_as_its_training_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed, _, started = _profile(tmp_path, monkeypatch,
                                  [_entrypoint_job("a"), _entrypoint_job("b")],
                                  {"a": FAIL, "b": PROFILED})
    assert isinstance(failed, runner.TrainerFailed) and failed.job_name == "a"
    assert "job a: trainer exited with code 2; last lines of" in str(failed)
    assert "boom" in str(failed) and len(started) == 1  # b is never profiled


@pytest.mark.parametrize("broken", [
    pytest.param("import sys; sys.exit(1)", id="exit-1"),
    pytest.param("import os; os.abort()", id="crash"),
    pytest.param("print('no profile')", id="no-profile-event"),
])
@pytest.mark.process
def test_another_profiling_failure_warns_and_plans_the_job_from_the_nominal_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    profiled, text, _ = _profile(tmp_path, monkeypatch,
                                 [_entrypoint_job("a"), _entrypoint_job("b")],
                                 {"a": broken, "b": PROFILED})
    assert list(profiled) == ["b"]
    text = " ".join(text.split())
    assert "warning: a: profiling" in text
    assert "planning it from the nominal estimate, and its trainer decides warm start" in text


@pytest.mark.process
def test_an_out_of_memory_step_is_cached_and_rules_out_the_single_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    oom = dataclasses.replace(PROFILE, step_seconds=None, step_status="oom",
                              step_detail="CUDA out of memory", warm_start_decision=None)
    profiled, text, _ = _profile(tmp_path, monkeypatch, [_entrypoint_job("m")],
                                 {"m": f"print({contract.to_line(oom)!r})"})
    assert profiled["m"].measurement.out_of_memory and profiled["m"].warm_start is None
    assert "batch 64 out of memory on cpu; warm start: decided by the trainer" in text
    entries = json.loads((tmp_path / "profiles.json").read_text(encoding="utf-8"))["entries"]
    assert [e["status"] for e in entries.values()] == ["oom"]


@pytest.mark.process
def test_a_profiled_decision_reaches_its_trainer_until_a_job_of_the_run_registers_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered = dataclasses.replace(RESULT, zoo_model="a-1234")
    ok_registered = f"print({contract.to_line(registered)!r})"
    the_plan = _plan(("a", 1, 0.0, 5.0), ("b", 1, 0.0, 5.0), ("c", 1, 5.0, 5.0))
    real_popen = subprocess.Popen
    commands: list[list[str]] = []

    def fake_popen(command: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        commands.append(command)
        return real_popen([sys.executable, "-c", ok_registered], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    text = api.WarmStartDecision(outcome=api.WarmStartOutcome.COLD_EMPTY,
                                 reason="empty zoo").model_dump_json()
    measurement = runplan.measurement_of(PROFILE)
    profiled = {n: runplan.Profiled(measurement, text) for n in "abc"}
    runplan.run_planned(
        [_job(n) for n in "abc"], the_plan=the_plan,
        configs={a.job: (types.Config("single", 1, a.seconds, "profile"),)
                 for a in the_plan.assignments},
        devices=machine.Devices("cpu", 2, 1, None), zoo_uri=str(tmp_path / "zoo"), work_dir=tmp_path,
        console=Console(file=io.StringIO()), profiled=profiled)
    by_job = {Path(c[c.index("--job") + 1]).stem: c for c in commands}
    for name in "ab":
        assert by_job[name][by_job[name].index("--warm-start") + 1] == text
    assert "--warm-start" not in by_job["c"]  # a or b registered: c decides against the zoo
