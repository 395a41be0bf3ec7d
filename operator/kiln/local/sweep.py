"""`kiln sweep run`: a TrainingSweep on this machine, its trials run as `kiln run` runs a job.

Each trial is the TrainingJob `kiln.sweep.trial_job` makes, trained by a trainer subprocess, at
most min(parallelTrials, devices) at once; its evaluations feed the search, whose verdict stops
it (SIGTERM: it checkpoints). The sweep's TrainingSweep document with status is rewritten after
every change as `<work_dir>/<sweep>.sweep.json`, so a rerun resumes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from rich.console import Console
from rich.live import Live
from rich.table import Table

from kiln import api, contract
from kiln.api import jobfile
from kiln.local import output, runner, tables
from kiln.zoo import records, store

# Torch and Optuna load with `kiln sweep run` only: `kiln sweep show` reads a document.
if TYPE_CHECKING:
    from kiln import sweep
    from kiln.local import machine

STATE_SUFFIX = ".sweep.json"
# Fields a rerun may change; any other change is a different search.
RESUMABLE_CHANGES = ("maxTrials", "parallelTrials", "maxFailedTrials")
COMPACT_BELOW_COLUMNS = 120  # the live leaderboard drops its long columns on narrower terminals
_POLL_SECONDS = 0.5  # how often the loop wakes to notice Ctrl-C and overdue stops
_ENDED = (api.sweep.SweepPhase.SUCCEEDED, api.sweep.SweepPhase.FAILED)
_Sweep = api.sweep.TrainingSweep
_Trial = api.sweep.Trial
_State = api.sweep.TrialState


class SweepError(ValueError):
    """A sweep file or its recorded state that cannot be run; the message says the fix."""


def read_sweep(path: Path, text: str | None = None) -> _Sweep:
    """The TrainingSweep document of a YAML or JSON file (or of `text`, read from `path`).

    Raises:
        api.InvalidSpec: not readable, not one TrainingSweep document, or invalid (every field
            named).
    """
    try:
        found = (jobfile.load_documents(path) if text is None
                 else jobfile.parse_documents(text, source=str(path)))
    except api.InvalidSpec as exc:
        if exc.kind not in (api.KIND, api.runtime.RUNTIME_KIND,
                            api.runtime.CLUSTER_RUNTIME_KIND):
            raise  # the sweep's own problems, or a file that is not YAML
        # Another kind that does not validate: what matters here is that it is no sweep.
        found_kind = (f"expected one TrainingSweep document; found an invalid {exc.kind}: "
                      + "; ".join(exc.problems))
        raise api.InvalidSpec([found_kind], source=str(path), kind=api.sweep.SWEEP_KIND
                              ) from None
    if len(found) != 1 or not isinstance(found[0], api.sweep.TrainingSweep):
        kinds = ", ".join(doc.kind for doc in found)
        raise api.InvalidSpec([f"expected one TrainingSweep document; found: {kinds}"],
                              source=str(path), kind=api.sweep.SWEEP_KIND)
    return found[0]


def state_path(work_dir: Path, name: str) -> Path:
    """Where `kiln sweep run` keeps sweep `name`'s document with status."""
    return work_dir / f"{name}{STATE_SUFFIX}"


def write_state(path: Path, swept: _Sweep) -> None:
    """Write the document atomically (a temporary file renamed over it): an interrupted write
    leaves the previous state whole."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(api.to_wire(swept), indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def resumed(given: _Sweep, path: Path) -> _Sweep:
    """The sweep to run: the file's, with the status and uid recorded at `path` when there is
    one (a fresh uid otherwise: it names the trials' zoo records).

    Raises:
        SweepError: the recorded sweep searches something else (only maxTrials, parallelTrials
            and maxFailedTrials may change between runs).
        api.InvalidSpec: the recorded state is damaged.
    """
    if not path.exists():
        meta = given.metadata.model_copy(update={"uid": given.metadata.uid or str(uuid.uuid4())})
        return given.model_copy(update={"metadata": meta, "status": None})
    over = "; delete that file to start the sweep over (its trials' zoo records stay)"
    try:
        stored = read_sweep(path)
    except api.InvalidSpec as exc:
        raise SweepError(f"sweep {given.name}: its recorded state {path} cannot be read ("
                         + "; ".join(exc.problems) + ")" + over) from None
    if stored.name != given.name:
        # The run takes the recorded metadata: its trials would be named after another sweep.
        raise SweepError(f"sweep {given.name}: its recorded state {path} is sweep "
                         f"{stored.name}'s (metadata.name)" + over)
    was, now = api.to_wire(stored.spec), api.to_wire(given.spec)
    changed = sorted(k for k in was.keys() | now.keys()
                     if k not in RESUMABLE_CHANGES and was.get(k) != now.get(k))
    if changed:
        raise SweepError(
            f"sweep {given.name}: spec.{', spec.'.join(changed)} {'differs' if len(changed) == 1 else 'differ'} from the sweep recorded "
            f"in {path}, whose trials ran with them; give the sweep a new metadata.name, or "
            "delete that file to start over (only maxTrials, parallelTrials and "
            "maxFailedTrials may change between runs)")
    from kiln import sweep

    # The driver keeps trial i at history[i]: a state edited by hand may not.
    for i, trial in enumerate(stored.status.history if stored.status else []):
        misfit = sweep.misfit_of(given.spec, trial.params)
        if (trial.index, trial.name) != (i, api.sweep.trial_name(given.name, i)) or misfit:
            raise SweepError(
                f"sweep {given.name}: {path}: status.history[{i}] is not trial {i} of this "
                f"sweep (" + (misfit or f"index {trial.index}, name {trial.name}") + ")" + over)
    return given.model_copy(update={"metadata": stored.metadata, "status": stored.status})


def devices_for(spec: api.sweep.TrainingSweepSpec, slots: int | None) -> machine.Devices:
    """This machine's devices for a sweep: at most parallelTrials of them, one per trial.

    Raises:
        ValueError: more CPU slots than cores (`machine.check_slots`).
    """
    from kiln.local import machine

    kind = machine.check_slots(slots)
    wanted = slots or (spec.parallel_trials if kind.startswith("cuda")
                       else machine.default_slots())
    return machine.local_devices(min(wanted, spec.parallel_trials))


def now_text() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds_since(text: str | None) -> float:
    if not text:
        return 0.0
    began = datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    return max(0.0, (datetime.datetime.now(datetime.UTC) - began).total_seconds())


def objective_of(spec: api.sweep.TrainingSweepSpec, values: dict[str, Any]) -> float | None:
    """The objective metric in a progress event's or result's fields, or None (also when it is
    a value the metric cannot take: `api.sweep.objective_value`)."""
    return api.sweep.objective_value(spec.objective.metric,
                                     values.get(spec.objective.metric.value))


def misreported(spec: api.sweep.TrainingSweepSpec, values: dict[str, Any]) -> str | None:
    """Why the objective a trainer reported in `values` is ignored, or None when it is taken
    (or not reported)."""
    metric = spec.objective.metric
    value = values.get(metric.value)
    if value is None or objective_of(spec, values) is not None:
        return None
    why = (api.metric_problem(metric, value) if isinstance(value, int | float)
           and not isinstance(value, bool) and math.isfinite(value) else "not a finite number")
    return f"reported {metric.value} {value!r}, ignored: {why}"


def conditions(old: Sequence[api.sweep.SweepCondition], standing: sweep.Standing,
               at: str) -> list[api.sweep.SweepCondition]:
    """Kubernetes-style conditions for `standing`: Created, Running, and Succeeded or Failed
    once ended; a condition keeps its lastTransitionTime while its status holds."""
    phase = standing.phase
    kinds = api.sweep.SweepConditionType
    wanted: list[tuple[api.sweep.SweepConditionType, Literal["True", "False"], str, str]] = [(kinds.CREATED, "True", "Validated", "the sweep's spec is valid"),
              (kinds.RUNNING, "True" if phase is api.sweep.SweepPhase.RUNNING else "False",
               standing.reason, standing.message)]
    if phase in _ENDED:
        wanted.append((kinds.SUCCEEDED if phase is api.sweep.SweepPhase.SUCCEEDED
                       else kinds.FAILED, "True", standing.reason, standing.message))
    before = {c.type: c for c in old}
    out = []
    for kind, status, reason, message in wanted:
        prior = before.get(kind)
        since = prior.last_transition_time if prior is not None and prior.status == status \
            else at
        out.append(api.sweep.SweepCondition(type=kind, status=status, reason=reason,
                                            message=message, last_transition_time=since))
    return out


@dataclasses.dataclass
class _Live:
    """A running trial."""

    index: int
    job: api.TrainingJob
    process: runner.Trainer
    log: IO[str]
    device: int
    locks: contextlib.ExitStack
    pump: threading.Thread
    result: dict[str, Any] | None = None
    verdict: sweep.Verdict | None = None  # the search's: stop it, it is behind
    stopping: str | None = None  # why it was asked to stop (the sweep ended)
    stop_deadline: float | None = None


class _Interrupted(Exception):
    """A trainer stopped by a signal kiln did not send: the sweep stops as for Ctrl-C."""


class SweepRun:
    """One `kiln sweep run`: the state and the loop (`run`)."""

    def __init__(self, swept: _Sweep, *, devices: machine.Devices, zoo_uri: str,
                 zoo: store.ObjectStore, work_dir: Path, console: Console,
                 env: dict[str, str]) -> None:
        from kiln import sweep

        self.sweep, self.spec = swept, swept.spec
        status = swept.status or api.sweep.TrainingSweepStatus()
        self.status = status if status.start_time else status.model_copy(
            update={"start_time": now_text()})
        self.history: list[_Trial] = list(status.history)
        self.devices, self.zoo_uri, self.zoo = devices, zoo_uri, zoo
        self.work_dir, self.console, self.env = work_dir, console, env
        self.path = state_path(work_dir, swept.name)
        self.search = sweep.Search(self.spec, self.history)
        self.standing = sweep.standing
        self.exhausted = False
        self.free = list(range(devices.count))
        self.live: dict[int, _Live] = {}
        self.events: queue.Queue[tuple[int, contract.Event | None]] = queue.Queue()
        self.plain = output.wants_plain(console)
        self.wall_seconds = 0.0

    # ------------------------------------------------------------------ state

    def document(self) -> _Sweep:
        """The sweep with its status as it stands now."""
        return self.sweep.model_copy(update={"status": self.status})

    def update(self) -> sweep.Standing:
        """Recompute the status from the trials, write it, and return the standing."""
        standing = self.standing(self.spec, self.history, exhausted=self.exhausted)
        at = now_text()
        ended = standing.phase in _ENDED and not self.live
        self.status = self.status.model_copy(update={
            "phase": standing.phase, "trials": standing.counts, "best": standing.best,
            "history": list(self.history),
            "conditions": conditions(self.status.conditions, standing, at),
            "completion_time": (self.status.completion_time or at) if ended else None})
        write_state(self.path, self.document())
        return standing

    def trial(self, index: int) -> _Trial:
        return self.history[index]

    def set_trial(self, index: int, **changes: Any) -> _Trial:
        self.history[index] = self.history[index].model_copy(update=changes)
        return self.history[index]

    def reserved(self, index: int, job: api.TrainingJob) -> str:
        """The zoo record id this trial registers under (its final and provisional record),
        fixed by the sweep's uid, so it is known before the trainer starts and on a rerun."""
        uid = uuid.uuid5(uuid.NAMESPACE_URL, f"{self.sweep.metadata.uid}/{job.name}")
        return records.job_record_id(job.spec.model.label, str(uid))

    def own_record(self, index: int) -> records.ZooRecord | None:
        """Trial `index`'s record in the zoo (provisional or final), or None; a record under its
        id that another job wrote is not its own."""
        name = api.sweep.trial_name(self.sweep.name, index)
        try:
            job = self.trial_doc(index)
            found = records.read_record(self.zoo, self.reserved(index, job))
        except (store.ObjectNotFound, store.StoreUnavailable, ValueError, OSError,
                api.InvalidSpec):
            return None
        return found if (found.job_name, found.namespace) == (name, self.sweep.namespace) \
            else None

    def trial_doc(self, index: int) -> api.TrainingJob:
        """A started trial's job, as its trainer was given it (`<work_dir>/<trial>.json`).

        Raises:
            OSError, api.InvalidSpec: the file is gone or damaged.
        """
        name = api.sweep.trial_name(self.sweep.name, index)
        path = self.work_dir / f"{name}.json"
        return api.parse_job(json.loads(path.read_text(encoding="utf-8")), source=str(path))

    def preferred(self) -> list[str]:
        """The sweep's own zoo models, best trial first: finished trials' and, in the zoo
        already, running trials' provisional ones."""
        from kiln import sweep

        provisional = {}
        for t in self.history:
            if not t.zoo_model and t.state is _State.RUNNING and t.evaluations:
                found = self.own_record(t.index)
                if found is not None:
                    provisional[t.index] = found.id
        return sweep.own_models(self.spec.objective, self.history, provisional=provisional)

    # ------------------------------------------------------------------ the loop

    def run(self) -> _Sweep:
        """Run the sweep to its end (or resume it); returns its document with status.

        Raises:
            runner.JobBusy: another run here holds the sweep or one of its trials.
            KeyboardInterrupt: Ctrl-C or SIGTERM: running trials checkpointed and stay Running
                in the state, so a rerun resumes them.
        """
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with runner.lock(self.work_dir / f"{self.sweep.name}.sweep.lock", self.sweep.name,
                         kind="sweep"):
            pending = [t.index for t in self.history if t.state is _State.RUNNING]
            if self.history and not pending and self.update().phase in _ENDED:
                self.say(f"sweep {self.sweep.name} had already ended; raise spec.maxTrials to "
                         "search further, or give it a new metadata.name to start over")
            began = time.monotonic()
            with self._display():
                try:
                    self._loop(pending)
                except (KeyboardInterrupt, _Interrupted):
                    self._stop_all(interrupted=True)
                    self.update()
                    self.say(f"sweep {self.sweep.name}: stopped; running trials kept their "
                             "checkpoints, `kiln sweep run` again resumes it")
                    raise KeyboardInterrupt from None
                except BaseException:  # e.g. a trial's lock held elsewhere: stop the rest too
                    self._stop_all(interrupted=True)
                    self.update()
                    raise
            self.wall_seconds = time.monotonic() - began
        return self.document()

    def _loop(self, pending: list[int]) -> None:
        while True:
            standing = self.update()
            if standing.phase in _ENDED:
                for index in list(pending):  # recorded Running, never restarted
                    pending.remove(index)
                    self._end(index, _State.PRUNED, why=standing.message)
                self._stop_live(standing.message)
                if not self.live:
                    self.update()
                    return
            else:
                while pending and self.free:
                    self._start(pending.pop(0), resume=True)
                for _ in range(min(standing.to_start, len(self.free)) if not pending else 0):
                    params = self.search.ask()
                    if params is None:
                        self.exhausted = True
                        break
                    self._start(len(self.history), params=params)
                if not self.live and not pending:
                    standing = self.update()
                    if standing.phase not in _ENDED and (self.exhausted
                                                         or standing.to_start == 0):
                        return  # nothing runs and nothing can start: over by every count
                    continue
            self._wait()

    def _wait(self) -> None:
        """Handle the next trainer event, or kill trainers overdue after a stop."""
        try:
            index, event = self.events.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            now = time.monotonic()
            for lv in self.live.values():
                if lv.stop_deadline is not None and now > lv.stop_deadline:
                    lv.process.kill()
            return
        self._handle(index, event)

    def _handle(self, index: int, event: contract.Event | None, *,
                interrupted: bool = False) -> None:
        lv = self.live.get(index)
        if lv is None:
            return
        if event is None:
            self._ended(lv, interrupted=interrupted)
        elif isinstance(event, contract.Result):
            lv.result = event.to_json()
        elif isinstance(event, contract.Info):
            self.say(f"{lv.job.name}: {event.message}")
            decision = event.warm_start_decision
            if decision is not None and decision.parent and \
                    self.spec.warm_start is api.sweep.SweepWarmStart.CHAIN:
                self.set_trial(lv.index, parent=decision.parent, similarity=decision.similarity)
        elif isinstance(event, contract.Progress):
            runner.append_history(runner.history_path(self.work_dir, lv.job.name), event)
            if event.evaluated and (not event.steps_per_epoch
                                    or event.step % event.steps_per_epoch == 0):
                self._evaluated(lv, event)

    def _evaluated(self, lv: _Live, event: contract.Progress) -> None:
        """An end-of-epoch evaluation: record it, ask the search whether to go on."""
        from kiln import sweep

        value = objective_of(self.spec, event.to_json())
        if value is None:
            why = misreported(self.spec, event.to_json())
            if why:
                self.say(f"{lv.job.name}: epoch {event.epoch}: {why}")
            return
        trial = self.trial(lv.index)
        kept = [e for e in trial.evaluations if e[0] < event.epoch]  # a resumed run repeats
        at = round(_seconds_since(self.status.start_time), 1)
        changes: dict[str, Any] = {"evaluations": [*kept, [event.epoch, value, at]]}
        if trial.parent is None and self.spec.warm_start is api.sweep.SweepWarmStart.CHAIN:
            found = self.own_record(lv.index)  # the provisional record names its parent
            if found is not None:
                changes.update(parent=found.parent, similarity=found.similarity)
        trial = self.set_trial(lv.index, **changes)
        short = tables.SHORT.get(self.spec.objective.metric.value, "objective")
        if self.plain:
            self.say(f"{lv.job.name}: epoch {event.epoch}/{event.epochs} {short} {value:.4f}")
        verdict = self.search.report(lv.index, event.epoch, value,
                                     sweep.inheritance(trial.parent, trial.similarity))
        if verdict is not None and lv.verdict is None and lv.stopping is None:
            lv.verdict = verdict
            self._signal_stop(lv)
            self.say(f"{lv.job.name}: pruning at epoch {verdict.epoch} ({short} "
                     f"{verdict.value:.4f}): {verdict.against}")
        self.update()

    def _start(self, index: int, *, params: dict[str, Any] | None = None,
               resume: bool = False) -> None:
        """Start trial `index`: a new one with `params`, or a recorded one again (`resume`)."""
        name = api.sweep.trial_name(self.sweep.name, index)
        if not resume:
            assert params is not None
            self.history.append(_Trial(index=index, name=name, params=params,
                                       state=_State.RUNNING))
        try:
            job = self._resumed_job(index) if resume else self._new_job(index)
        except (api.InvalidSpec, OSError, ValueError) as exc:
            self._end(index, _State.FAILED, why=f"invalid trial: {exc}")
            return
        runner.write_job_file(job, self.work_dir)
        if resume and self._finished_unwatched(index):
            return
        self.update()  # recorded Running before its trainer starts: a rerun resumes it
        locks = contextlib.ExitStack()
        locks.enter_context(runner.lock(self.work_dir / f"{name}.lock", name))
        device = self.free.pop(0)
        args = contract.TrainerArgs(job_file=str(self.work_dir / f"{name}.json"),
                                    zoo=self.zoo_uri, resume=resume)
        own = runner.own_command(job, args)
        command, own_env = own or (contract.trainer_command(1, args.to_argv()), {})
        extra = {**self.env, **own_env, contract.Env.ZOO_RECORD: self.reserved(index, job)}
        if self.devices.gpu:
            from kiln.local import runplan

            extra["CUDA_VISIBLE_DEVICES"] = runplan.visible_devices((device,))
        log_path = self.work_dir / f"{name}.log"
        log = open(log_path, "a" if resume else "w", encoding="utf-8")  # noqa: SIM115 (closed in _ended)
        try:
            process = runner.start_trainer(
                name, command, log=log, own=own is not None,
                env=runner.trainer_env(extra, threads=str(self.devices.threads)))
        except runner.TrainerFailed as exc:
            log.close()
            locks.close()
            self.free.append(device)
            self._end(index, _State.FAILED, why=str(exc))
            return
        pump = threading.Thread(target=self._pump, args=(index, process, log), daemon=True)
        self.live[index] = _Live(index, job, process, log, device, locks, pump)
        pump.start()
        values = values_text(self.spec, self.trial(index).params)
        self.say(f"{name}: {'resuming' if resume else 'training'} {values} (log: {log_path})")

    def _resumed_job(self, index: int) -> api.TrainingJob:
        """A recorded trial's job: as its trainer was given it, or made again from the sweep
        when that file is gone or damaged (the same uid, so its checkpoint still resumes)."""
        path = self.work_dir / f"{api.sweep.trial_name(self.sweep.name, index)}.json"
        if not path.exists():
            return self._new_job(index)
        try:
            return self.trial_doc(index)
        except (api.InvalidSpec, OSError, ValueError) as exc:
            self.say(f"{path}: unreadable ({exc}); the trial's job is made again from the sweep")
            return self._new_job(index)

    def _finished_unwatched(self, index: int) -> bool:
        """Whether trial `index`, recorded Running, finished while no sweep run watched it
        (its trainer outlived a killed `kiln sweep run`): its final zoo record is there. Then
        it is recorded Succeeded from that record, not trained again."""
        found = self.own_record(index)
        if found is None or found.provisional:
            return False
        values = {"validation_accuracy": found.validation_accuracy,
                  "validation_loss": found.validation_loss,
                  found.metric_name: found.metric_value}
        metric = objective_of(self.spec, values)
        self.set_trial(index, state=_State.SUCCEEDED, metric=metric, zoo_model=found.id,
                       parent=found.parent)
        self.search.tell(index, _State.SUCCEEDED, metric)
        short = tables.SHORT.get(self.spec.objective.metric.value, "objective")
        self.say(f"{found.job_name}: had finished while no sweep run watched it: succeeded, "
                 f"{short} {tables.fmt(metric, digits=4)}, zoo model {found.id}")
        self.update()
        return True

    def _new_job(self, index: int) -> api.TrainingJob:
        from kiln import models, sweep

        doc = sweep.trial_job(self.sweep, index, self.trial(index).params,
                              preferred=self.preferred())
        if self.sweep.metadata.uid:
            # Checkpoints are keyed by a job's uid: a trial of a sweep started over under the
            # same name never resumes the old sweep's trial of that index.
            doc["metadata"]["uid"] = f"{self.sweep.metadata.uid}-t{index}"
        job = api.parse_job(doc, source=f"trial {index}")
        problems = models.check_job(job)
        if problems:
            raise api.InvalidSpec(problems, source=job.name)
        return job

    def _pump(self, index: int, process: runner.Trainer, log: IO[str]) -> None:
        for event in runner.read_events(process, log=log):
            self.events.put((index, event))
        process.wait()
        self.events.put((index, None))

    def _signal_stop(self, lv: _Live) -> None:
        """Ask a trainer to checkpoint and exit (SIGTERM); killed if still running after
        `runner.STOP_GRACE_SECONDS`."""
        if lv.process.poll() is None:
            lv.process.terminate()
        lv.stop_deadline = time.monotonic() + runner.STOP_GRACE_SECONDS

    def _stop_live(self, why: str) -> None:
        for lv in self.live.values():
            if lv.verdict is None and lv.stopping is None:
                lv.stopping = why
                self._signal_stop(lv)
                self.say(f"{lv.job.name}: stopping: {why}")

    def _ended(self, lv: _Live, *, interrupted: bool = False) -> None:
        """A trainer exited: the trial Succeeded (a result), was Pruned (stopped by the search
        or the sweep's end), is kept Running (interrupted), or Failed."""
        del self.live[lv.index]
        lv.log.close()
        lv.locks.close()
        self.free.append(lv.device)
        code = lv.process.wait()  # it has ended (its pump saw it, or `_stop_all` waited)
        if lv.result is not None and code == 0:
            self._succeeded(lv)
        elif lv.verdict is not None or lv.stopping is not None:
            self._end(lv.index, _State.PRUNED, why=lv.stopping or "",
                      pruned_at=lv.verdict.pruned_at() if lv.verdict else None)
        elif interrupted or code in contract.INTERRUPTED_EXIT_CODES:
            self.say(f"{lv.job.name}: stopped; any checkpoint it saved is kept")
            if not interrupted:
                raise _Interrupted(lv.job.name)
        else:
            log_path = self.work_dir / f"{lv.job.name}.log"
            last = next((line for line in reversed(runner.tail(log_path)) if line.strip()), "")
            self._end(lv.index, _State.FAILED,
                      why=f"trainer {runner.how_it_ended(code)}" + (f": {last}" if last else "")
                      + f" (log: {log_path})")

    def _succeeded(self, lv: _Live) -> None:
        result = lv.result or {}
        trial = self.trial(lv.index)
        metric = objective_of(self.spec, result)
        why = misreported(self.spec, result)
        if why:
            self.say(f"{lv.job.name}: its result {why}")
        if metric is None and trial.evaluations:
            metric = trial.evaluations[-1][1]
        # The record a trial may name is the one reserved for it, nothing else.
        reserved = self.reserved(lv.index, lv.job)
        zoo_model = reserved if result.get("zoo_model") == reserved else None
        parent = _zoo_id(result.get("parent"))
        self.set_trial(lv.index, state=_State.SUCCEEDED, metric=metric, zoo_model=zoo_model,
                       parent=parent)
        self.search.tell(lv.index, _State.SUCCEEDED, metric)
        short = tables.SHORT.get(self.spec.objective.metric.value, "objective")
        self.say(f"{lv.job.name}: succeeded, {short} {tables.fmt(metric, digits=4)}, zoo model "
                 f"{zoo_model or '-'}, " + (f"warm from {parent}" if parent else "cold"))
        self.update()

    def _end(self, index: int, state: _State, *, why: str = "",
             pruned_at: api.sweep.PrunedAt | None = None) -> None:
        """Record trial `index` Pruned or Failed (`why`), with its last evaluation as metric and
        its provisional zoo record, if any."""
        trial = self.trial(index)
        last = trial.evaluations[-1] if trial.evaluations else None
        if state is _State.PRUNED and pruned_at is None and last is not None:
            pruned_at = api.sweep.PrunedAt(epoch=int(last[0]), value=float(last[1]), against=why)
        found = self.own_record(index) if state is _State.PRUNED else None
        self.set_trial(index, state=state, metric=last[1] if last else None,
                       pruned_at=pruned_at,
                       zoo_model=found.id if found is not None else None,
                       parent=trial.parent or (found.parent if found is not None else None),
                       message=why if state is _State.FAILED or pruned_at is None else "")
        self.search.tell(index, state, last[1] if last else None)
        name = api.sweep.trial_name(self.sweep.name, index)
        if state is _State.FAILED:
            self.say(f"{name}: failed: {why}")
        elif pruned_at is not None:
            self.say(f"{name}: pruned at epoch {pruned_at.epoch}: {pruned_at.against}")
        else:
            self.say(f"{name}: stopped before its first evaluation: {why}")
        self.update()

    def _stop_all(self, *, interrupted: bool) -> None:
        """SIGTERM every trainer (they checkpoint), wait, and record how each ended."""
        runner.stop_all([lv.process for lv in self.live.values()])
        for lv in list(self.live.values()):
            lv.pump.join(timeout=runner.STOP_GRACE_SECONDS)
        while self.live:
            try:
                index, event = self.events.get_nowait()
            except queue.Empty:  # a pump that never ended: its trial stays Running
                for lv in list(self.live.values()):
                    self._handle(lv.index, None, interrupted=interrupted)
                break
            self._handle(index, event, interrupted=interrupted)

    # ------------------------------------------------------------------ output

    def say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def _display(self) -> contextlib.AbstractContextManager[Any]:
        """The live leaderboard on a terminal (gone at the end, when the ranked one prints);
        nothing when plain: each change is a line."""
        if self.plain:
            return contextlib.nullcontext()

        def render() -> Table:  # below 120 columns the full table folds every cell
            return tables.leaderboard(self.document(), ranked=False,
                                      compact=self.console.width < COMPACT_BELOW_COLUMNS)

        return Live(get_renderable=render, console=self.console, refresh_per_second=2,
                    transient=True)


def _zoo_id(value: Any) -> str | None:
    """A zoo id a trainer reported, if it is one (a job's own command may report anything)."""
    try:
        return records.check_id(value) if isinstance(value, str) else None
    except ValueError:
        return None


def values_text(spec: api.sweep.TrainingSweepSpec, params: dict[str, Any]) -> str:
    """"training.lr=0.01 model.args.depth=2": a trial's values in the spec's order."""
    paths = [p.path for p in spec.parameters]
    paths += [k for k in params if k not in paths]
    return " ".join(f"{k}={output.cell_text(params[k])}" for k in paths if k in params)


def summary(swept: _Sweep, *, wall_seconds: float | None = None) -> list[str]:
    """Lines after the leaderboard: the best trial, its values and zoo model, trials by state,
    the phase and why, the wall time."""
    status = swept.status or api.sweep.TrainingSweepStatus()
    short = tables.SHORT.get(swept.spec.objective.metric.value, "objective")
    best = status.best
    lines = []
    if best is not None:
        values = values_text(swept.spec, best.params)
        lines.append(f"best: {best.trial} ({short} {best.metric:.4f}): {values}")
        lines.append(f"best zoo model: {best.zoo_model or '-'}")
    else:
        lines.append("best: none yet")
    c = status.trials
    lines.append(f"trials: {c.total} ({c.succeeded} succeeded, {c.pruned} pruned, {c.failed} "
                 f"failed, {c.running} running)")
    why = next((cond.message for cond in status.conditions
                if cond.status == "True" and cond.type is not api.sweep.SweepConditionType.CREATED
                and cond.message), "")
    lines.append(f"phase: {status.phase.value if status.phase else 'Pending'}"
                 + (f": {why}" if why else ""))
    if wall_seconds is not None:
        lines.append(f"wall time: {wall_seconds:.0f} s in this run")
    elif status.start_time:
        lines.append(f"started {status.start_time}"
                     + (f", completed {status.completion_time}" if status.completion_time else ""))
    return lines
