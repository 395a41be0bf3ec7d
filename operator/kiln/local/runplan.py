"""Several jobs at once on this machine, under a plan (issue 5 item 5; DESIGN.md sections 1, 6).

`kiln run A.yaml B.yaml ... [--slots N]` with several jobs and devices. Devices
(`kiln.local.machine`): the GPUs here (at most N), else N CPU worker slots (default
`default_slots`), each running one trainer process with cores // N torch threads
(OMP_NUM_THREADS wins when set). A config with k > 1
runs k processes under torchrun (`kiln_trainer.distributed.parallel.launch_command`; DDP over gloo on CPU,
NCCL on GPUs) once the installed trainer takes ``--parallelism``; until then every job runs
single on one device. Jobs fixing ``spec.resources.gpus`` count CPU slots here.

Plan: `estimate.configs` per job (zoo, else the `kiln profile` cache, else FLOPs) on one node
"local" with N devices, `plan.plan` (heuristic, then the MILP), printed before anything starts
(`kiln.local.tables.plan`). Running follows Saturn's per-node queue (research digest 7.7): jobs start
in planned order, the head as soon as its k devices are free (never by wall clock), so at most
N devices are ever busy. When a job ends, the queued jobs are re-planned (`plan.replan`,
heuristic only, kept unless clearly beaten) with running jobs pinned for their measured
remaining time (`estimate.remaining_seconds`); a queued job with the same model and batch as a
finished one takes its measured throughput (`estimate.refine`; learning-rate copies run at the
same speed, as Saturn assumes).

Warm start: a job warm-starts from the zoo as it is when the job *starts*: jobs running at the
same time never warm-start from each other; a job started after another finished may.
``--slots 1`` keeps the sequential runner (`local.run_jobs`, file order), where each job sees
every earlier one.

Failures and Ctrl-C: a failed trainer stops the run: the others are asked to checkpoint and
stop (SIGTERM), queued jobs never start, and `local.TrainerFailed` names the failed job.
Ctrl-C, or a trainer stopped by SIGINT/SIGTERM, stops every trainer the same way and raises
KeyboardInterrupt; a rerun resumes stopped jobs from their checkpoints. Every job's lock
(`local.job_locks`) is held for the whole run. ``<work_dir>/run.json`` records the plan and,
per job, its config, devices, state and planned and actual start and end (seconds since the
run began), written however the run ends.

Callers: `kiln.cli`. Non-goals: no multi-node runs, no moving a running job to another k; no
device discovery (`kiln.local.machine`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, TaskID

from kiln import api
from kiln.local import machine
from kiln.local import runner as local
from kiln.placement import estimate, plan, types
from kiln.zoo import records, store

NODE = "local"
PLAN_SETTINGS = types.Settings(time_limit_seconds=5.0)
REPLAN_SETTINGS = types.Settings(use_milp=False)  # between jobs: fast, no solver process
_POLL_SECONDS = 0.5  # how often the loop wakes to notice Ctrl-C while trainers are quiet
# torchrun exits 1 whatever its workers' codes (143 after SIGTERM included), so a k > 1 job's
# stop shows only in rank 0's info event (kiln_trainer.loop: "stopped on request at ...").
_STOPPED_MESSAGE_PREFIX = "stopped on request"



def make_plan(
    jobs: Sequence[api.TrainingJob],
    *,
    devices: machine.Devices,
    zoo: store.ObjectStore | None,
    profile_cache: Path | None,
    settings: types.Settings = PLAN_SETTINGS,
) -> tuple[types.Plan, dict[str, tuple[types.Config, ...]]]:
    """Estimate every job's configs and plan them on one node of `devices.count` devices.

    Returns:
        The plan (times in seconds from 0) and each job's configs.

    Raises:
        types.Unplaceable: a job has no config that fits (e.g. it fixes more GPUs than here).
        profile.ProfileCacheError: the profile cache is unusable.
    """
    zoo_records = records.list_records(zoo) if zoo is not None else []
    configs = {job.name: estimate.configs(
        job, zoo=None, zoo_records=zoo_records, profile_cache=profile_cache,
        max_gpus=devices.count, device_type=devices.kind, parallelisms=devices.parallelisms())
        for job in jobs}
    snapshot = types.Snapshot(0.0, (types.Node(NODE, devices.count),),
                              tuple(types.JobRequest(n, c) for n, c in configs.items()))
    return plan.plan(snapshot, settings), configs


def planned_devices(the_plan: types.Plan, count: int) -> dict[str, tuple[int, ...]]:
    """Device indices per job if the plan ran exactly on time (lowest free first)."""
    ends: list[tuple[float, tuple[int, ...]]] = []
    free, out = list(range(count)), {}
    for a in sorted(the_plan.assignments, key=lambda a: (a.start, a.job)):
        for end, held in sorted(ends):
            if end <= a.start + 1e-9:
                free.extend(held)
                ends.remove((end, held))
        free.sort()
        out[a.job], free = tuple(free[: a.gpus]), free[a.gpus:]
        ends.append((a.end, out[a.job]))
    return out


def source_of(configs: Sequence[types.Config], a: types.Assignment) -> str:
    """The source of the estimate behind assignment `a` ("?" when it is not among `configs`)."""
    return next((c.source for c in configs
                 if (c.parallelism, c.gpus) == (a.parallelism, a.gpus)), "?")


@dataclasses.dataclass
class _Live:
    """A running trainer."""

    assignment: types.Assignment
    process: subprocess.Popen[str]
    log: IO[str]
    devices: tuple[int, ...]
    start: float
    result: dict[str, Any] | None = None
    samples_per_second: float | None = None
    samples_done: int = 0
    stopped: bool = False  # the trainer said it stopped on request (checkpoint saved)


class _Interrupted(Exception):
    """A trainer ended by SIGINT/SIGTERM: the run stops as for Ctrl-C."""


def run_planned(
    jobs: Sequence[api.TrainingJob],
    *,
    the_plan: types.Plan,
    configs: Mapping[str, tuple[types.Config, ...]],
    devices: machine.Devices,
    zoo_uri: str,
    work_dir: Path,
    console: Console,
    env: dict[str, str] | None = None,
) -> list[local.JobOutcome]:
    """Run `jobs` concurrently per `the_plan` (module docstring: order, capacity, re-planning).

    Returns:
        One outcome per job, in the order of `jobs`, each with its `local.Placement`.

    Raises:
        local.JobBusy: another `kiln run` here holds a job's lock (nothing started).
        local.TrainerFailed: a trainer failed; the others were checkpointed and stopped.
        KeyboardInterrupt: Ctrl-C or a trainer stopped by a signal; all were stopped.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    run = _Run(list(jobs), the_plan, dict(configs), devices, zoo_uri, work_dir, console, env or {})
    with local.job_locks(list(jobs), work_dir):
        try:
            with local.new_progress(console) as progress:
                run.loop(progress)
        finally:
            run.write_record(work_dir / "run.json")
    return [run.outcomes[job.name] for job in jobs]


class _Run:
    """The state of one planned run; `loop` is the whole algorithm."""

    def __init__(self, jobs: list[api.TrainingJob], the_plan: types.Plan,
                 configs: dict[str, tuple[types.Config, ...]], devices: machine.Devices, zoo_uri: str,
                 work_dir: Path, console: Console, env: dict[str, str]) -> None:
        self.jobs = {job.name: job for job in jobs}
        self.plan, self.first_plan, self.configs, self.devices = the_plan, the_plan, configs, devices
        self.zoo_uri, self.work_dir, self.console, self.env = zoo_uri, work_dir, console, env
        self.queue = list(the_plan.queues().get(NODE, []))
        self.preferred = planned_devices(the_plan, devices.count)
        self.free = list(range(devices.count))
        self.live: dict[str, _Live] = {}
        self.events: queue.Queue[tuple[str, dict[str, Any] | None]] = queue.Queue()
        self.outcomes: dict[str, local.JobOutcome] = {}
        self.record: dict[str, dict[str, Any]] = {}
        self.measured: dict[str, float] = {}  # job -> final samples/s
        self.began = time.monotonic()
        self.tasks: dict[str, TaskID] = {}

    def now(self) -> float:
        return time.monotonic() - self.began

    def loop(self, progress: Progress) -> None:
        for a in self.queue:
            self.tasks[a.job] = progress.add_task(
                a.job, total=self.jobs[a.job].spec.training.epochs,
                status=f"queued: planned start {a.start:.0f} s, {a.parallelism}×{a.gpus}")
        try:
            while self.queue or self.live:
                while self.queue and len(self.free) >= self.queue[0].gpus:
                    self.start(self.queue.pop(0), progress)
                try:
                    name, event = self.events.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    continue
                if event is None:
                    self.ended(name, progress)
                elif event.get("event") == "result":
                    self.live[name].result = event
                else:
                    self.note(name, event)
                    local.show(progress, self.tasks[name], event, prefix=f"{name}: ")
        except (KeyboardInterrupt, _Interrupted):
            self.stop_all("stopped")
            raise KeyboardInterrupt from None
        except local.TrainerFailed:
            self.stop_all("stopped because another job failed")
            raise

    def start(self, a: types.Assignment, progress: Progress) -> None:
        job = self.jobs[a.job]
        wanted = self.preferred.get(a.job, ())
        held = wanted if len(wanted) == a.gpus and set(wanted) <= set(self.free) \
            else tuple(sorted(self.free)[: a.gpus])
        self.free = [d for d in self.free if d not in held]
        argv = ["--job", str(local.write_job_file(job, self.work_dir)), "--zoo", self.zoo_uri]
        if a.gpus > 1 and self.devices.launcher is not None:
            command = self.devices.launcher(a.gpus, [*argv, "--parallelism", a.parallelism])
        else:
            command = [sys.executable, "-m", "kiln_trainer", *argv]
        extra = dict(self.env)
        if self.devices.gpu:  # our indices count the GPUs visible to us
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(
                visible[d] if len(visible) > d and visible[d] else str(d) for d in held)
        log_path = self.work_dir / f"{a.job}.log"
        log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed in `ended`)
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True,
                                   env=local.trainer_env(extra, threads=str(self.devices.threads)))
        self.live[a.job] = _Live(a, process, log, held, self.now())
        threading.Thread(target=self._pump, args=(a.job, process), daemon=True).start()
        progress.console.print(
            f"[bold]{escape(a.job)}[/]: training {escape(job.spec.model.architecture)} on "
            f"{job.spec.dataset.name}, {a.parallelism}×{a.gpus} on {self.devices.noun[:-1]}(s) "
            f"{','.join(map(str, held))} (log: {escape(str(log_path))})")
        progress.update(self.tasks[a.job], status="starting")

    def _pump(self, name: str, process: subprocess.Popen[str]) -> None:
        for event in local.read_events(process):
            self.events.put((name, event))
        process.wait()
        self.events.put((name, None))

    def note(self, name: str, event: dict[str, Any]) -> None:
        live = self.live[name]
        if event.get("event") == "info" and \
                str(event.get("message", "")).startswith(_STOPPED_MESSAGE_PREFIX):
            live.stopped = True
        if event.get("samples_per_second"):
            live.samples_per_second = float(event["samples_per_second"])
        if event.get("step") is not None:
            live.samples_done = int(event["step"]) * self.jobs[name].spec.training.batch_size

    def ended(self, name: str, progress: Progress) -> None:
        live = self.live.pop(name)
        live.log.close()
        self.free.extend(live.devices)
        code = live.process.returncode
        self._record(name, live, state="done" if code == 0 and live.result else "ended",
                     code=code)
        if live.result is None or code != 0:
            if live.result is None and (code in local.INTERRUPTED_EXIT_CODES or live.stopped):
                self.record[name]["state"] = "stopped"
                self.console.print(f"[yellow]{escape(name)}: stopped; its last checkpoint is "
                                   "kept, `kiln run` again resumes it[/]")
                raise _Interrupted(name)
            self.record[name]["state"] = "failed"
            log_path = self.work_dir / f"{name}.log"
            raise local.TrainerFailed(name, code, log_path, local.tail(log_path))
        if live.result.get("samples_per_second"):
            self.measured[name] = float(live.result["samples_per_second"])
        a, rec = live.assignment, self.record[name]
        placement = local.Placement(a.parallelism, a.gpus, live.devices, rec["source"],
                                    rec["planned_start_seconds"], rec["planned_seconds"],
                                    live.start, rec["end_seconds"] - live.start)
        spec = self.jobs[name].spec
        self.outcomes[name] = local.JobOutcome(name, spec.model.architecture, live.result,
                                               placement, has_target=spec.target is not None)
        progress.update(self.tasks[name], completed=self.jobs[name].spec.training.epochs)
        self.replan()

    def replan(self) -> None:
        """Re-plan the queued jobs with what was measured (module docstring)."""
        if not self.queue:
            return
        for a in self.queue:
            self.configs[a.job] = self._refined(a.job)
        running = tuple(types.Running(n, NODE, lv.assignment.gpus, lv.assignment.parallelism,
                                      self._remaining(n, lv)) for n, lv in self.live.items())
        queued = tuple(types.JobRequest(a.job, self.configs[a.job]) for a in self.queue)
        snapshot = types.Snapshot(self.now(), (types.Node(NODE, self.devices.count),), queued,
                                  running)
        try:
            fresh = plan.replan(self.plan, snapshot, REPLAN_SETTINGS)
        except ValueError as exc:  # Unplaceable cannot happen with unchanged shapes; keep order
            self.console.print(f"re-planning skipped: {exc}", markup=False, highlight=False)
            return
        if not fresh.kept_current:
            self.console.print(f"re-planned: {fresh.reason}", markup=False, highlight=False)
        self.plan, self.queue = fresh, list(fresh.queues().get(NODE, []))
        self.preferred.update(planned_devices(fresh, self.devices.count))

    def _refined(self, name: str) -> tuple[types.Config, ...]:
        job, configs = self.jobs[name], self.configs[name]
        for other, sps in self.measured.items():
            if _speed_key(self.jobs[other]) != _speed_key(job):
                continue
            ran = self.outcomes[other].placement
            match = next((c for c in configs if ran is not None and
                          (c.parallelism, c.gpus) == (ran.parallelism, ran.gpus)), None)
            if match is not None:
                return estimate.refine(configs, work=estimate.workload(job), running=match,
                                       measured_samples_per_second=sps,
                                       device=estimate.device_model(self.devices.kind))
        return configs

    def _remaining(self, name: str, live: _Live) -> float:
        if live.samples_per_second:
            return max(1.0, estimate.remaining_seconds(
                estimate.workload(self.jobs[name]), samples_done=live.samples_done,
                measured_samples_per_second=live.samples_per_second))
        return max(1.0, live.start + live.assignment.seconds - self.now())

    def stop_all(self, why: str) -> None:
        """SIGTERM every running trainer (they checkpoint), wait, and say so per job."""
        local.stop_all([lv.process for lv in self.live.values()])
        for name, live in list(self.live.items()):
            live.log.close()
            self._record(name, live, state="stopped", code=live.process.returncode)
            self.console.print(f"[yellow]{escape(name)}: {why}; its last checkpoint is kept, "
                               "`kiln run` again resumes it[/]")
        self.live.clear()

    def _record(self, name: str, live: _Live, *, state: str, code: int | None) -> None:
        """Note how a job ran; "planned" is the printed (first) plan's start and duration."""
        a = live.assignment
        first = self.first_plan.for_job(name) or a
        self.record[name] = {
            "name": name, "state": state, "exit_code": code, "parallelism": a.parallelism,
            "gpus": a.gpus, "devices": list(live.devices),
            "source": source_of(self.configs[name], a), "planned_start_seconds": first.start,
            "planned_seconds": first.seconds, "start_seconds": live.start,
            "end_seconds": self.now()}

    def write_record(self, path: Path) -> None:
        """Write run.json (module docstring); jobs that never started are "not started"."""
        jobs = [self.record.get(name, {"name": name, "state": "not started"})
                for name in self.jobs]
        doc = {"devices": {"kind": self.devices.kind, "count": self.devices.count},
               "plan": {"solver": self.first_plan.solver, "reason": self.first_plan.reason,
                        "makespan_seconds": self.first_plan.makespan,
                        "assignments": [dataclasses.asdict(a)
                                        for a in self.first_plan.assignments]},
               "jobs": jobs}
        path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def _speed_key(job: api.TrainingJob) -> str:
    """Jobs with equal keys train at the same speed (same model, input shape and batch)."""
    m = job.spec.model
    return json.dumps([m.architecture, m.args, list(m.input_shape),
                       job.spec.training.batch_size], sort_keys=True)
