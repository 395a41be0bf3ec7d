"""`kiln run --slots N` with several jobs: plan them on this machine's devices, then run them.

Jobs start as the placement queue says (`queues.NodeQueues`: a job starts when it heads the
queue and its devices are free); when one ends, the rest are re-planned with what was measured.
`<work_dir>/run.json` records the plan and how each job ran, however the run ends.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, TaskID

from kiln import api, contract
from kiln.local import machine, runner
from kiln.placement import estimate, planner, queues, types
from kiln.zoo import records, store

NODE = "local"  # this machine, the planner's only node
PLAN_SETTINGS = types.Settings(time_limit_seconds=5.0)
REPLAN_SETTINGS = types.Settings(use_milp=False)  # between jobs: fast, no solver process
_POLL_SECONDS = 0.5  # how often the loop wakes to notice Ctrl-C while trainers are quiet


def make_plan(
    jobs: Sequence[api.TrainingJob],
    *,
    devices: machine.Devices,
    zoo: store.ObjectStore | None,
    profile_cache: Path | None,
    settings: types.Settings = PLAN_SETTINGS,
) -> tuple[types.Plan, dict[str, tuple[types.Config, ...]]]:
    """Estimate every job's configs and plan them on one node of `devices.count` devices.

    Estimates come from the zoo, else the `kiln profile` cache, else FLOPs (`estimate.configs`);
    the plan is the heuristic's, or the MILP's when it does better (`planner.plan`).

    Returns:
        The plan (times in seconds from 0) and each job's configs.

    Raises:
        types.Unplaceable: a job has no config that fits (e.g. it fixes more GPUs than here).
        profilecache.ProfileCacheError: the profile cache is unusable.
    """
    zoo_records = records.list_records(zoo) if zoo is not None else []
    configs = {job.name: estimate.configs(
        job, zoo=None, zoo_records=zoo_records, profile_cache=profile_cache,
        max_gpus=devices.count, device_type=devices.kind, parallelisms=devices.parallelisms())
        for job in jobs}
    snapshot = types.Snapshot(0.0, (types.Node(NODE, devices.count),),
                              tuple(types.JobRequest(n, c) for n, c in configs.items()))
    return planner.plan(snapshot, settings), configs


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
) -> list[runner.JobOutcome]:
    """Run `jobs` concurrently per `the_plan`, at most `devices.count` devices busy at once.

    A job warm-starts from the zoo as it is when the job *starts*: jobs running at the same
    time never warm-start from each other. A config with k > 1 runs k processes under
    torchrun (`devices.launcher`); each job's lock (`runner.job_locks`) is held for the whole
    run, so a rerun resumes stopped jobs from their checkpoints.

    Returns:
        One outcome per job, in the order of `jobs`, each with its `runner.Placement`.

    Raises:
        runner.JobBusy: another `kiln run` here holds a job's lock (nothing started).
        runner.TrainerFailed: a trainer failed; the others were asked to checkpoint and stop
            (SIGTERM) and queued jobs never start.
        KeyboardInterrupt: Ctrl-C or a trainer stopped by a signal; all were stopped.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    run = _Run(list(jobs), the_plan, dict(configs), devices, zoo_uri, work_dir, console, env or {})
    with runner.job_locks(list(jobs), work_dir):
        try:
            with runner.new_progress(console) as progress:
                run.loop(progress)
        finally:
            run.write_record(work_dir / "run.json")
    return [run.outcomes[job.name] for job in jobs]


class _Run:
    """The state of one planned run; `loop` is the whole algorithm."""

    def __init__(self, jobs: list[api.TrainingJob], the_plan: types.Plan,
                 configs: dict[str, tuple[types.Config, ...]], devices: machine.Devices,
                 zoo_uri: str, work_dir: Path, console: Console, env: dict[str, str]) -> None:
        self.jobs = {job.name: job for job in jobs}
        self.first_plan, self.configs, self.devices = the_plan, configs, devices
        self.zoo_uri, self.work_dir, self.console, self.env = zoo_uri, work_dir, console, env
        self.queue = queues.NodeQueues(the_plan)
        self.preferred = planned_devices(the_plan, devices.count)
        self.free = list(range(devices.count))
        self.live: dict[str, _Live] = {}
        self.events: queue.Queue[tuple[str, contract.Event | None]] = queue.Queue()
        self.outcomes: dict[str, runner.JobOutcome] = {}
        self.record: dict[str, dict[str, Any]] = {}
        self.measured: dict[str, float] = {}  # job -> final samples/s
        self.began = time.monotonic()
        self.tasks: dict[str, TaskID] = {}

    def now(self) -> float:
        return time.monotonic() - self.began

    def loop(self, progress: Progress) -> None:
        for a in self.queue.waiting():
            self.tasks[a.job] = progress.add_task(
                a.job, total=self.jobs[a.job].spec.training.epochs,
                status=f"queued: planned start {a.start:.0f} s, {a.parallelism}×{a.gpus}")
        try:
            while self.queue or self.live:
                for a in self.queue.start_heads({NODE: len(self.free)}):
                    self.start(a, progress)
                try:
                    name, event = self.events.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    continue
                if event is None:
                    self.ended(name, progress)
                elif isinstance(event, contract.Result):
                    self.live[name].result = event.to_json()
                else:
                    self.note(name, event)
                    runner.show(progress, self.tasks[name], event, prefix=f"{name}: ")
        except (KeyboardInterrupt, _Interrupted):
            self.stop_all("stopped")
            raise KeyboardInterrupt from None
        except runner.TrainerFailed:
            self.stop_all("stopped because another job failed")
            raise

    def start(self, a: types.Assignment, progress: Progress) -> None:
        job = self.jobs[a.job]
        wanted = self.preferred.get(a.job, ())
        held = wanted if len(wanted) == a.gpus and set(wanted) <= set(self.free) \
            else tuple(sorted(self.free)[: a.gpus])
        self.free = [d for d in self.free if d not in held]
        args = contract.TrainerArgs(job_file=str(runner.write_job_file(job, self.work_dir)),
                                    zoo=self.zoo_uri)
        own = runner.own_command(job, dataclasses.replace(args, parallelism=a.parallelism))
        if own is not None:  # the job's own command, with Kiln's settings in its environment
            command = own[0]
        elif a.gpus > 1 and self.devices.launcher is not None:
            parallel = dataclasses.replace(args, parallelism=a.parallelism)
            command = self.devices.launcher(a.gpus, parallel.to_argv())
        else:
            command = contract.trainer_command(1, args.to_argv())
        extra = {**self.env, **(own[1] if own is not None else {})}
        if self.devices.gpu:  # our indices count the GPUs visible to us
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(
                visible[d] if len(visible) > d and visible[d] else str(d) for d in held)
        log_path = self.work_dir / f"{a.job}.log"
        log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed in `ended`)
        try:
            process = runner.start_trainer(
                a.job, command, log=log, own=own is not None,
                env=runner.trainer_env(extra, threads=str(self.devices.threads)))
        except runner.TrainerFailed as exc:  # its program cannot be run: a failed job
            log.close()
            self.record[a.job] = {"name": a.job, "state": "failed", "exit_code": exc.exit_code}
            raise
        self.live[a.job] = _Live(a, process, log, held, self.now())
        threading.Thread(target=self._pump, args=(a.job, process, log), daemon=True).start()
        progress.console.print(
            f"[bold]{escape(a.job)}[/]: training {escape(job.spec.model.label)} on "
            f"{job.spec.dataset.source}, {a.parallelism}×{a.gpus} on {self.devices.noun[:-1]}(s) "
            f"{','.join(map(str, held))} (log: {escape(str(log_path))})")
        progress.update(self.tasks[a.job], status="starting")

    def _pump(self, name: str, process: subprocess.Popen[str], log: IO[str]) -> None:
        for event in runner.read_events(process, log=log):
            self.events.put((name, event))
        process.wait()
        self.events.put((name, None))

    def note(self, name: str, event: contract.Event) -> None:
        live = self.live[name]
        if isinstance(event, contract.Info) and event.message.startswith(contract.STOPPED_PREFIX):
            # torchrun exits 1 whatever its workers' codes, so a k > 1 job's stop shows only
            # in rank 0's info event
            live.stopped = True
        if isinstance(event, contract.Progress):
            if event.samples_per_second:
                live.samples_per_second = float(event.samples_per_second)
            live.samples_done = event.step * self.jobs[name].spec.training.batch_size

    def ended(self, name: str, progress: Progress) -> None:
        live = self.live.pop(name)
        live.log.close()
        self.free.extend(live.devices)
        code = live.process.returncode
        self._record(name, live, state="done" if code == 0 and live.result else "ended",
                     code=code)
        if live.result is None or code != 0:
            if live.result is None and (code in contract.INTERRUPTED_EXIT_CODES or live.stopped):
                self.record[name]["state"] = "stopped"
                self.console.print(f"[yellow]{escape(name)}: stopped; its last checkpoint is "
                                   "kept, `kiln run` again resumes it[/]")
                raise _Interrupted(name)
            self.record[name]["state"] = "failed"
            log_path = self.work_dir / f"{name}.log"
            raise runner.TrainerFailed(name, code, log_path, runner.tail(log_path))
        if live.result.get("samples_per_second"):
            self.measured[name] = float(live.result["samples_per_second"])
        a, rec = live.assignment, self.record[name]
        placement = runner.Placement(a.parallelism, a.gpus, live.devices, rec["source"],
                                    rec["planned_start_seconds"], rec["planned_seconds"],
                                    live.start, rec["end_seconds"] - live.start)
        spec = self.jobs[name].spec
        self.outcomes[name] = runner.JobOutcome(name, spec.model.label, live.result,
                                               placement, has_target=spec.target is not None)
        progress.update(self.tasks[name], completed=self.jobs[name].spec.training.epochs)
        self.replan()

    def replan(self) -> None:
        """Re-plan the queued jobs with what was measured, running ones pinned.

        A queued job with the same model and batch as a finished one takes its measured
        throughput (`_refined`); running jobs hold their devices for their measured remaining
        time (`_remaining`). The plan in force is kept unless clearly beaten.
        """
        waiting = self.queue.waiting()
        if not waiting:
            return
        for a in waiting:
            self.configs[a.job] = self._refined(a.job)
        running = tuple(types.Running(n, NODE, lv.assignment.gpus, lv.assignment.parallelism,
                                      self._remaining(n, lv)) for n, lv in self.live.items())
        queued = tuple(types.JobRequest(a.job, self.configs[a.job]) for a in waiting)
        snapshot = types.Snapshot(self.now(), (types.Node(NODE, self.devices.count),), queued,
                                  running)
        try:
            fresh = self.queue.replan(snapshot, REPLAN_SETTINGS)
        except ValueError as exc:  # Unplaceable cannot happen with unchanged shapes; keep order
            self.console.print(f"re-planning skipped: {exc}", markup=False, highlight=False)
            return
        if not fresh.kept_current:
            self.console.print(f"re-planned: {fresh.reason}", markup=False, highlight=False)
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
        runner.stop_all([lv.process for lv in self.live.values()])
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
        """Write run.json: the first plan, and per job its config, devices, state and planned and
        actual start and end (seconds since the run began); jobs never started are "not started"."""
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
    """Jobs with equal keys train at the same speed (same model, input shape and batch; the
    learning rate does not change it, as Saturn assumes)."""
    m = job.spec.model
    return json.dumps([m.label, m.args, list(m.input_shape),
                       job.spec.training.batch_size], sort_keys=True)
