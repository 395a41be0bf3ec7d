"""`kiln run --slots N` with several jobs: profile entrypoint models, plan, run on this machine.

Jobs start as the placement queue says (`queues.NodeQueues`: a job starts when it heads the
queue and its devices are free); when one ends, the rest are re-planned with what was measured.
`<work_dir>/run.json` records the plan and how each job ran, however the run ends.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import queue
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
from kiln.placement import estimate, planner, profilecache, queues, types
from kiln.warmstart import select
from kiln.zoo import records, store

NODE = "local"  # this machine, the planner's only node
PLAN_SETTINGS = types.Settings(time_limit_seconds=5.0)
REPLAN_SETTINGS = types.Settings(use_milp=False)  # between jobs: fast, no solver process
_POLL_SECONDS = 0.5  # how often the loop wakes to notice Ctrl-C while trainers are quiet


@dataclasses.dataclass(frozen=True)
class Profiled:
    """What profiling an entrypoint model in its trainer's environment gives the plan and run.

    Attributes:
        measurement: parameters, FLOPs and the one-device step (`estimate.configs(measured=)`).
        warm_start: the profile's warm-start decision as `contract.TrainerArgs.warm_start` JSON,
            or None (the trainer decides itself).
    """

    measurement: estimate.ModelMeasurement
    warm_start: str | None


def needs_profile(job: api.TrainingJob) -> bool:
    """True for a model from user code that Kiln's trainer runs: only its trainer can build it,
    so only a profiling run can count it (a job's own command is never profiled)."""
    return job.spec.model.entrypoint is not None and not job.spec.template.get("command")


def profile_jobs(
    jobs: Sequence[api.TrainingJob],
    *,
    devices: machine.Devices,
    zoo_uri: str,
    work_dir: Path,
    console: Console,
    profile_cache: Path | None,
    env: dict[str, str] | None = None,
) -> dict[str, Profiled]:
    """Profile every job that `needs_profile`, one at a time, before planning.

    Each runs ``python -m kiln_trainer --profile`` with the environment, PYTHONPATH and job file
    its training will get, on one device (GPU 0, or one CPU slot's threads), and prints one line.
    An ok or out-of-memory step goes into the `kiln profile` cache as the single k = 1 config.
    A profiling run that fails otherwise (exit 1, a crash, no profile) is warned about and
    the job is planned from the nominal estimate.

    Args:
        jobs: the run's jobs; those not needing a profile are skipped.
        devices: this machine's devices (kind, CPU threads per slot).
        zoo_uri: the zoo the warm-start decision searches.
        work_dir: folder for job files and the ``<job>.profile.log`` logs.
        console: where the profile lines and warnings go.
        profile_cache: the `kiln profile` cache file to update (None: none).
        env: extra environment for the trainer (zoo settings, PYTHONPATH).

    Returns:
        Per profiled job name, its measurement and warm-start decision.

    Raises:
        runner.JobBusy: another `kiln run` here holds a job's lock (nothing profiled).
        runner.TrainerFailed: a profiling run found the job or its code wrong (exit 2), as its
            training would; later jobs are not profiled.
        KeyboardInterrupt: Ctrl-C, or the profiling run stopped by a signal.
        profilecache.ProfileCacheError: the profile cache is unusable.
    """
    wanted = [job for job in jobs if needs_profile(job)]
    if not wanted:
        return {}
    entries = profilecache.read_cache(profile_cache) if profile_cache is not None else {}
    work_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    with runner.job_locks(wanted, work_dir, zoo_uri=zoo_uri):
        for job in wanted:
            found = _profile_one(job, devices=devices, zoo_uri=zoo_uri, work_dir=work_dir,
                                 console=console, env=env or {})
            if found is None:
                continue
            out[job.name] = Profiled(measurement_of(found),
                                     _warm_start_text(found))
            console.print(profile_line(job.name, found), markup=False, highlight=False)
            # `kiln profile` keeps no failed steps either: a later one measures them again
            if profile_cache is not None and found.step_status in (profilecache.STATUS_OK,
                                                                   profilecache.STATUS_OOM):
                entries[_cache_key(job, found)] = _cache_entry(job, found)
                profilecache.write_cache(profile_cache, entries)
    return out


def _profile_one(job: api.TrainingJob, *, devices: machine.Devices, zoo_uri: str,
                 work_dir: Path, console: Console, env: dict[str, str]
                 ) -> contract.Profile | None:
    """Run one job's profiling trainer; its Profile event, or None after a warning."""
    args = contract.TrainerArgs(job_file=str(runner.write_job_file(job, work_dir)),
                                zoo=zoo_uri, profile=True)
    extra = {**env, **({"CUDA_VISIBLE_DEVICES": visible_devices((0,))} if devices.gpu else {})}
    log_path = work_dir / f"{job.name}.profile.log"
    console.print(f"[bold]{escape(job.name)}[/]: profiling {escape(job.spec.model.label)} "
                  f"(log: {escape(str(log_path))})")
    found = None
    with open(log_path, "w", encoding="utf-8") as log:
        process = runner.start_trainer(
            job.name, contract.trainer_command(1, args.to_argv()), log=log, own=False,
            env=runner.trainer_env(extra, threads=str(devices.threads)))
        try:
            for event in runner.read_events(process, log=log):
                if isinstance(event, contract.Profile):
                    found = event
                elif isinstance(event, contract.Info):  # kept beside its stderr
                    log.write(f"{event.message}\n")
                    log.flush()
            process.wait()
        except KeyboardInterrupt:
            runner.stop_all([process])
            raise
    code = process.wait()
    if code in contract.INTERRUPTED_EXIT_CODES:
        console.print(f"[yellow]{escape(job.name)}: profiling stopped; nothing was trained[/]")
        raise KeyboardInterrupt
    if code == contract.EXIT_INVALID:  # the job or its code is wrong: training would fail too
        raise runner.TrainerFailed(job.name, code, log_path, runner.tail(log_path))
    if found is None or code != contract.EXIT_OK:
        how = "exited 0 without a profile" if code == 0 else runner.how_it_ended(code)
        console.print(f"[yellow]warning:[/] {escape(job.name)}: profiling {how} (log: "
                      f"{escape(str(log_path))}); planning it from the nominal estimate, and "
                      "its trainer decides warm start itself", highlight=False)
        return None
    return found


def measurement_of(found: contract.Profile) -> estimate.ModelMeasurement:
    """A profile as the estimator reads it (a step only when it was timed ok)."""
    ok = found.step_status == profilecache.STATUS_OK
    return estimate.ModelMeasurement(
        parameters=found.parameters, flops_per_sample=found.flops_per_sample,
        device_type=found.device, batch_size=found.batch_size,
        step_seconds=found.step_seconds if ok else None,
        out_of_memory=found.step_status == profilecache.STATUS_OOM)


def _warm_start_text(found: contract.Profile) -> str | None:
    decided = select.from_report(found.warm_start_decision)  # checked as the profile was read
    return None if decided is None else decided.model_dump_json()


def profile_line(name: str, found: contract.Profile) -> str:
    """One console line: "mixer: profiled 12,345 parameters, 0.4 MFLOPs/sample, 8.1 ms/step on
    cpu; warm start: <reason>"."""
    flops = "FLOPs not countable" if found.flops_per_sample is None else \
        f"{_si(found.flops_per_sample)}FLOPs/sample"
    if found.step_status == profilecache.STATUS_OK and found.step_seconds is not None:
        step = f"{found.step_seconds * 1000:.1f} ms/step" if found.step_seconds < 1 else \
            f"{found.step_seconds:.2f} s/step"
    elif found.step_status == profilecache.STATUS_OOM:
        step = f"batch {found.batch_size} out of memory"
    else:
        step = f"step not timed ({found.step_detail or found.step_status})"
    decided = found.warm_start_decision
    reason = decided.reason if decided is not None and decided.reason else "decided by the trainer"
    return (f"{name}: profiled {found.parameters:,} parameters, {flops}, {step} on "
            f"{found.device}; warm start: {reason}")


def _si(value: float) -> str:
    """0.4 M, 12 G: a FLOP count with an SI prefix (the unit follows)."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


def _cache_key(job: api.TrainingJob, found: contract.Profile) -> str:
    """The single k = 1 config's key, on the device kind the step was timed on."""
    return profilecache.cache_key(job.spec.model, batch_size=job.spec.training.batch_size,
                                  parallelism="single", gpus=1, kind=found.device)


def _cache_entry(job: api.TrainingJob, found: contract.Profile) -> dict[str, Any]:
    """A cache entry as `kiln profile` writes it."""
    step = profilecache.Measurement("single", 1, measurement_of(found).step_seconds,
                                    found.step_status, found.step_detail)
    return {**dataclasses.asdict(step), "architecture": job.spec.model.label,
            "device_type": found.device, "batch_size": job.spec.training.batch_size,
            "measured_time": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def visible_devices(held: Sequence[int]) -> str:
    """CUDA_VISIBLE_DEVICES for our device indices, which count the GPUs visible to us."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    return ",".join(visible[d] if len(visible) > d and visible[d] else str(d) for d in held)


def make_plan(
    jobs: Sequence[api.TrainingJob],
    *,
    devices: machine.Devices,
    zoo: store.ObjectStore | None,
    profile_cache: Path | None,
    settings: types.Settings = PLAN_SETTINGS,
    profiled: Mapping[str, Profiled] | None = None,
) -> tuple[types.Plan, dict[str, tuple[types.Config, ...]]]:
    """Estimate every job's configs and plan them on one node of `devices.count` devices.

    Estimates come from a job's profile (`profile_jobs`), else the zoo, else the `kiln profile`
    cache, else FLOPs (`estimate.configs`); the plan is the heuristic's, or the MILP's when it
    does better (`planner.plan`) and Pyomo and HiGHS are installed (the `local` extra).

    Returns:
        The plan (times in seconds from 0) and each job's configs.

    Raises:
        types.Unplaceable: a job has no config that fits (e.g. it fixes more GPUs than here).
        profilecache.ProfileCacheError: the profile cache is unusable.
    """
    zoo_records = records.list_records(zoo) if zoo is not None else []
    configs = {job.name: estimate.configs(
        job, zoo=None, zoo_records=zoo_records, profile_cache=profile_cache,
        max_gpus=devices.count, device_type=devices.kind, parallelisms=devices.parallelisms(),
        measured=_measured(profiled, job.name))
        for job in jobs}
    snapshot = types.Snapshot(0.0, (types.Node(NODE, devices.count),),
                              tuple(types.JobRequest(n, c) for n, c in configs.items()))
    if not milp_installed():  # the `local` extra is missing: the heuristic plans alone
        settings = dataclasses.replace(settings, use_milp=False)
    return planner.plan(snapshot, settings), configs


def milp_installed() -> bool:
    """Whether Pyomo and HiGHS, which the MILP planner needs, are installed here."""
    return all(importlib.util.find_spec(name) is not None for name in ("pyomo", "highspy"))


def _measured(profiled: Mapping[str, Profiled] | None,
              name: str) -> estimate.ModelMeasurement | None:
    found = (profiled or {}).get(name)
    return found.measurement if found is not None else None


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


def _queued_status(a: types.Assignment) -> str:
    return f"queued: planned start {a.start:.0f} s, {a.parallelism}×{a.gpus}"


def replan_summary(before: Mapping[str, types.Assignment],
               after: Sequence[types.Assignment]) -> str:
    """What a re-plan with measured speeds changed for the queued jobs, in a line."""
    changed = [f"{a.job} now {a.parallelism}×{a.gpus} (was {was.parallelism}×{was.gpus}), "
               f"planned start {a.start:.0f} s"
               for a in sorted(after, key=lambda a: (a.start, a.job))
               if (was := before.get(a.job)) is not None
               and (was.parallelism, was.gpus) != (a.parallelism, a.gpus)]
    if changed:
        return "re-planned with measured speeds: " + "; ".join(changed)
    starts = ", ".join(f"{a.job} at {a.start:.0f} s"
                       for a in sorted(after, key=lambda a: (a.start, a.job)))
    return f"re-planned with measured speeds: same configs, planned starts {starts}"


def source_of(configs: Sequence[types.Config], a: types.Assignment) -> str:
    """The source of the estimate behind assignment `a` ("?" when it is not among `configs`)."""
    return next((c.source for c in configs
                 if (c.parallelism, c.gpus) == (a.parallelism, a.gpus)), "?")


@dataclasses.dataclass
class _Live:
    """A running trainer."""

    assignment: types.Assignment
    process: runner.Trainer
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
    profiled: Mapping[str, Profiled] | None = None,
) -> list[runner.JobOutcome]:
    """Run `jobs` concurrently per `the_plan`, at most `devices.count` devices busy at once.

    A job warm-starts from the zoo as it is when the job *starts*: jobs running at the same
    time never warm-start from each other. A profiled job's trainer gets its profile's
    warm-start decision unless a job of this run has registered a model since (then the
    trainer decides again, against the grown zoo). A config with k > 1 runs k processes under
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
    run = _Run(list(jobs), the_plan, dict(configs), devices, zoo_uri, work_dir, console, env or {},
               decisions={n: p.warm_start for n, p in (profiled or {}).items() if p.warm_start})
    with runner.job_locks(list(jobs), work_dir, zoo_uri=zoo_uri):
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
                 zoo_uri: str, work_dir: Path, console: Console, env: dict[str, str], *,
                 decisions: dict[str, str]) -> None:
        self.jobs = {job.name: job for job in jobs}
        self.decisions = decisions  # job -> the profile's warm-start decision (JSON)
        self.zoo_grew = False  # a job of this run registered a model: decisions may be stale
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
        self.progress: Progress | None = None

    def now(self) -> float:
        return time.monotonic() - self.began

    def loop(self, progress: Progress) -> None:
        self.progress = progress
        for a in self.queue.waiting():
            self.tasks[a.job] = progress.add_task(
                a.job, total=self.jobs[a.job].spec.training.epochs, status=_queued_status(a))
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
                    runner.append_history(runner.history_path(self.work_dir, name), event)
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
                                    zoo=self.zoo_uri,
                                    warm_start=None if self.zoo_grew else self.decisions.get(a.job))
        own = runner.own_command(job, dataclasses.replace(args, parallelism=a.parallelism))
        if own is not None:  # the job's own command, with Kiln's settings in its environment
            command = own[0]
        elif a.gpus > 1 and self.devices.launcher is not None:
            parallel = dataclasses.replace(args, parallelism=a.parallelism)
            command = self.devices.launcher(a.gpus, parallel.to_argv())
        else:
            command = contract.trainer_command(1, args.to_argv())
        extra = {**self.env, **(own[1] if own is not None else {})}
        if self.devices.gpu:
            extra["CUDA_VISIBLE_DEVICES"] = visible_devices(held)
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

    def _pump(self, name: str, process: runner.Trainer, log: IO[str]) -> None:
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
        code = live.process.wait()  # it has ended: its pump saw it
        self._record(name, live, state="done" if code == 0 and live.result else "ended",
                     code=code)
        if live.result is None or code != 0:
            if live.result is None and (code in contract.INTERRUPTED_EXIT_CODES or live.stopped):
                self.record[name]["state"] = "stopped"
                self.console.print(f"[yellow]{escape(name)}: stopped; any checkpoint it saved "
                                   "is kept, `kiln run` again resumes it[/]")
                raise _Interrupted(name)
            self.record[name]["state"] = "failed"
            log_path = self.work_dir / f"{name}.log"
            raise runner.TrainerFailed(name, code, log_path, runner.tail(log_path))
        if live.result.get("samples_per_second"):
            self.measured[name] = float(live.result["samples_per_second"])
        self.zoo_grew = self.zoo_grew or bool(live.result.get("zoo_model"))
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
        before = {a.job: a for a in waiting}
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
            self.console.print(replan_summary(before, self.queue.waiting()), markup=False,
                               highlight=False)
            for a in self.queue.waiting():
                if self.progress is not None and a.job in self.tasks:
                    self.progress.update(self.tasks[a.job], status=_queued_status(a))
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
            self.console.print(f"[yellow]{escape(name)}: {why}; any checkpoint it saved is kept, "
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
