"""`kiln run` jobs one after another, and the trainer subprocess both local runs share.

Each job runs `python -m kiln_trainer` (the trainer a cluster pod runs, which registers the
model in the zoo itself); its events drive a live progress bar (one plain line per evaluation
when stdout is not a terminal) and `<job>.metrics.jsonl`, its stderr and stray stdout go to a
log file. Trainer text prints as plain text, never as rich markup. No placement, no kopf.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import locale
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import filelock
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kiln import api, contract
from kiln.local import zygote
from kiln.zoo import sources, store

# How long a trainer gets to write its checkpoint after SIGTERM before it is killed.
STOP_GRACE_SECONDS = 30.0
RUNS = Path(".kiln", "runs")  # where local runs keep their state, from the working directory


class TrainerFailed(RuntimeError):
    """The trainer subprocess exited without a result; the message holds its last log lines."""

    def __init__(self, job_name: str, exit_code: int, log_path: Path, tail: list[str], *,
                 why: str | None = None) -> None:
        self.job_name, self.exit_code, self.log_path = job_name, exit_code, log_path
        shown = "\n    ".join(tail) if tail else "(no output)"
        super().__init__(
            f"job {job_name}: {why}" if why is not None else
            f"job {job_name}: trainer {how_it_ended(exit_code)}; last lines of {log_path}:\n"
            f"    {shown}"
        )


class Trainer(Protocol):
    """What the runner uses of a trainer's process: a `subprocess.Popen`, or a
    `zygote.Process` forked from a process that has imported torch already."""

    @property
    def stdout(self) -> IO[str] | None: ...
    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class JobBusy(RuntimeError):
    """Another `kiln run` in this working directory is running the job (it holds the lock)."""


def how_it_ended(exit_code: int) -> str:
    """"exited with code 2", or "was killed by signal 9 (SIGKILL)" for a negative code; code 0
    (no result event) says how an own training loop reports one."""
    if exit_code == 0:
        return ("exited 0 without reporting a result; an own training loop ends with "
                "`ctx.finish(model)` (ctx = kiln_trainer.job_context()), which writes it")
    if exit_code >= 0:
        return f"exited with code {exit_code}"
    try:
        name = signal.Signals(-exit_code).name
    except ValueError:
        name = "unknown signal"
    hint = ("; the kernel's out-of-memory killer sends it: reduce spec.training.batchSize or the "
            "model size" if -exit_code == signal.SIGKILL else "")
    return f"was killed by signal {-exit_code} ({name}){hint}"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where and when a job ran under a plan, planned vs. actual (seconds since the run began).

    Attributes:
        parallelism: "single", "ddp" or "fsdp".
        gpus: k, devices used (GPUs, or CPU worker slots).
        devices: the device (GPU or slot) indices it held.
        source: where the planned duration came from ("zoo", "profile", "flops", "measured").
        planned_start_seconds: planned start.
        planned_seconds: estimated duration.
        start_seconds: actual start.
        seconds: actual duration (trainer start to exit).
    """

    parallelism: str
    gpus: int
    devices: tuple[int, ...]
    source: str
    planned_start_seconds: float
    planned_seconds: float
    start_seconds: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    """One finished job: its name, architecture, the trainer's result JSON and, when it ran
    under a plan (`kiln.local.runplan`), its placement."""

    name: str
    architecture: str
    result: dict[str, Any]
    placement: Placement | None = None
    has_target: bool = True


def run_jobs(
    jobs: list[api.TrainingJob],
    *,
    zoo_uri: str,
    work_dir: Path,
    console: Console,
    env: dict[str, str] | None = None,
) -> list[JobOutcome]:
    """Train `jobs` one after another, each in a trainer subprocess.

    A job runs at most once at a time per working directory (`job_locks`), so a second
    `kiln run` of the same job fails at once instead of overwriting the first one's log and
    checkpoint. A trainer that ends by SIGINT or SIGTERM is an interruption, not a failure:
    Ctrl-C reaches the whole process group, so the trainer may notice it first.

    Args:
        jobs: validated jobs, run in order.
        zoo_uri: where the trainer registers models and keeps checkpoints (path or s3://).
        work_dir: folder for job files and trainer logs (created).
        console: where progress and messages go.
        env: extra environment for the trainer (zoo endpoint and credentials).

    Returns:
        One outcome per job, in order.

    Raises:
        JobBusy: another `kiln run` in `work_dir` is running one of the jobs (nothing started).
        TrainerFailed: a trainer exited without a result (later jobs are not started).
        KeyboardInterrupt: Ctrl-C, or the trainer stopped by SIGINT/SIGTERM; the running
            trainer was asked to checkpoint and stop, and a rerun resumes it.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    with job_locks(jobs, work_dir, zoo_uri=zoo_uri):
        for job in jobs:
            result = _run_one(job, zoo_uri=zoo_uri, work_dir=work_dir, console=console, env=env)
            outcomes.append(JobOutcome(job.name, job.spec.model.label, result,
                                       has_target=job.spec.target is not None))
    return outcomes


@contextlib.contextmanager
def job_locks(jobs: list[api.TrainingJob], work_dir: Path, *,
              zoo_uri: str | None = None) -> Iterator[None]:
    """Hold every job's lock (`lock`) while in the block; all are taken before any
    training, so a clash wastes no work. On a directory zoo each job is also locked there
    (``locks/<namespace>/<job>.lock``): its checkpoint lives in the zoo, so a run of the same
    job from another directory would resume it and race this one on it.

    Raises:
        JobBusy: another process holds one of them (none is kept).
    """
    shared = _zoo_dir(zoo_uri)
    with contextlib.ExitStack() as locks:
        for job in jobs:
            locks.enter_context(lock(work_dir / f"{job.name}.lock", job.name))
            if shared is not None:
                path = shared / "locks" / job.namespace / f"{job.name}.lock"
                path.parent.mkdir(parents=True, exist_ok=True)
                locks.enter_context(lock(path, job.name, where=(
                    f"with zoo {shared}, whose checkpoint of it both would resume")))
        yield


def _zoo_dir(zoo_uri: str | None) -> Path | None:
    """The directory of a directory zoo (None: none, or an S3 zoo)."""
    if zoo_uri is None:
        return None
    try:
        opened = store.open_store(zoo_uri, env={})
    except ValueError:  # s3:// without the endpoint that `env` would give: not a directory
        return None
    return opened.root if isinstance(opened, store.DirStore) else None


@contextlib.contextmanager
def lock(path: Path, name: str, *, kind: str = "job",
         where: str = "from this directory") -> Iterator[None]:
    """Hold an exclusive lock on `path` for the `kind` (job, sweep) `name` while in the block,
    without waiting; `<path>.pid` names the holder.

    `filelock` takes an OS lock (flock on Unix, msvcrt on Windows; a marker file where the file
    system has no flock), which the OS drops when the process ends, however it ends, so a crash
    leaves no stale lock. The files stay (deleting them would race with the next locker).

    Raises:
        JobBusy: another process holds the lock; the message names its pid.
    """
    held, pid_file = filelock.FileLock(path, timeout=0), path.with_suffix(".pid")
    try:
        held.acquire()
    except filelock.Timeout:
        try:
            holder = pid_file.read_text(encoding="ascii", errors="replace").strip() or "unknown"
        except OSError:  # between the holder's lock and its pid: rare, and only for the message
            holder = "unknown"
        raise JobBusy(
            f"{kind} {name} is already running (pid {holder}) {where}; wait "
            f"for it to finish or stop it (its lock: {path})"
        ) from None
    except OSError as exc:  # a file system that refuses locks altogether: run unguarded
        warnings.warn(f"cannot lock {path} ({exc.strerror or exc}); a second run of "
                      f"{kind} {name} would not be refused", stacklevel=3)
        yield
        return
    try:
        pid_file.write_text(f"{os.getpid()}\n", encoding="ascii")
        yield
    finally:
        held.release()


def _run_one(
    job: api.TrainingJob,
    *,
    zoo_uri: str,
    work_dir: Path,
    console: Console,
    env: dict[str, str] | None,
) -> dict[str, Any]:
    job_file = write_job_file(job, work_dir)
    log_path = work_dir / f"{job.name}.log"
    args = contract.TrainerArgs(job_file=str(job_file), zoo=zoo_uri)
    own = own_command(job, args)
    command, own_env = own or (contract.trainer_command(1, args.to_argv()), {})
    console.print(f"[bold]{escape(job.name)}[/]: training {escape(job.spec.model.label)} "
                  f"on {job.spec.dataset.source} (log: {escape(str(log_path))})")
    interrupted = False
    history = history_path(work_dir, job.name)
    with open(log_path, "w", encoding="utf-8") as log, new_progress(console) as progress:
        task = progress.add_task(job.name, total=job.spec.training.epochs, status="starting")
        process = start_trainer(job.name, command, log=log, own=own is not None,
                                env=trainer_env({**(env or {}), **own_env},
                                                threads=default_threads()))
        result = None
        try:
            for event in read_events(process, log=log):
                if isinstance(event, contract.Result):
                    result = event
                else:
                    append_history(history, event)
                    show(progress, task, event)
            process.wait()
        except KeyboardInterrupt:
            _stop(process)
            interrupted = True
    code = process.wait()  # it has ended: the code it ended with
    if interrupted or (result is None and code in contract.INTERRUPTED_EXIT_CODES):
        # Ctrl-C signals the whole process group: the trainer may see it first, save its
        # checkpoint and exit 130 before (or, with SIGINT ignored here, instead of) us.
        console.print(f"[yellow]{escape(job.name)}: stopped; any checkpoint it saved is kept, "
                      "`kiln run` again resumes it[/]")
        raise KeyboardInterrupt
    if result is None or code != 0:
        raise TrainerFailed(job.name, code, log_path, tail(log_path))
    return result.to_json()


def initialize(jobs: list[api.TrainingJob], *, work_dir: Path, console: Console,
               env: Mapping[str, str]) -> dict[str, str]:
    """Download the jobs' sources (spec.model.pretrained.uri, spec.dataset.uri) before any
    trainer starts, as a pod's init container does: `contract.initializer_command` per job
    that has some, into ``$KILN_DATA_CACHE`` (default ``<work_dir>/cache``, kept across runs:
    entries are named by content). Returns the environment the trainers then find their
    copies with (the manifest of every job's sources); {} when no job has any.

    Raises:
        TrainerFailed: an initializer failed; the message is its own (naming the field).
    """
    wanted = [job for job in jobs if sources.job_sources(job.spec)]
    if not wanted:
        return {}
    cache = env.get(contract.Env.DATA_CACHE) or os.environ.get(contract.Env.DATA_CACHE) or str(
        work_dir / "cache")
    found: list[sources.Fetched] = []
    for job in wanted:
        manifest = work_dir / f"{job.name}.sources.json"
        termination = work_dir / f"{job.name}.initializer.termination-log"
        termination.write_bytes(b"")
        log_path = work_dir / f"{job.name}.initializer.log"
        console.print(f"[bold]{escape(job.name)}[/]: fetching its sources (log: "
                      f"{escape(str(log_path))})")
        with open(log_path, "w", encoding="utf-8") as log:
            code = _run_to_end(
                [*contract.initializer_command(), contract.Flag.JOB.value,
                 str(write_job_file(job, work_dir))], log=log,
                env=trainer_env({**env, contract.Env.SOURCES: str(manifest),
                                 contract.Env.DATA_CACHE: cache,
                                 contract.Env.TERMINATION_LOG: str(termination)},
                                threads=default_threads()))
        if code != 0:
            failure = contract.read_termination_message(termination.read_text("utf-8", "replace"))
            raise TrainerFailed(job.name, code, log_path, tail(log_path),
                                why=failure.message if isinstance(failure, contract.Failure)
                                else None)
        found += sources.Manifest.read(manifest).sources
    # Named by the run's jobs: another `kiln run` in this folder keeps its own manifest.
    names = hashlib.sha256("\0".join(sorted(job.name for job in wanted)).encode()).hexdigest()
    merged = work_dir / f"sources-{names[:12]}.json"
    sources.Manifest(tuple(found)).write(merged)
    return {contract.Env.SOURCES: str(merged)}


def _run_to_end(command: list[str], *, log: IO[str], env: dict[str, str]) -> int:
    """Run `command` with its output to `log`; its exit code. Forked from the zygote where it
    can be (the initializer imports torch as a trainer does), else a process of its own."""
    forked = zygote.start(command, env=env, stdout=log.fileno(), stderr=log.fileno())
    if forked is not None:
        return forked.wait()
    return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False,
                          env=env).returncode


def own_command(job: api.TrainingJob, args: contract.TrainerArgs
                ) -> tuple[list[str], dict[str, str]] | None:
    """A job's own command (``spec.template.command`` + ``args``) and the environment it runs
    with, or None when the job runs Kiln's trainer.

    As in a pod, the command gets Kiln's settings as `contract.Env` variables (`args.to_env`),
    so a loop using kiln_trainer finds its job, zoo and checkpoints, plus the template's plain
    env values (valueFrom and envFrom need a cluster); ``python`` is the interpreter kiln runs
    under (its folder comes first on PATH).
    """
    template = job.spec.template
    if not template.get("command"):
        return None
    env = {str(e["name"]): str(e["value"]) for e in template.get("env") or [] if "value" in e}
    env |= args.to_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return [*template["command"], *(template.get("args") or [])], env


def start_trainer(job_name: str, command: list[str], *, log: IO[str], own: bool,
                  env: dict[str, str]) -> Trainer:
    """Start a trainer: events come on its stdout (`read_events`), its stderr goes to `log`.

    ``python -m kiln_trainer`` with this interpreter is forked from this process's zygote
    (`kiln.local.zygote`: torch and the libraries under it imported once, which a sweep's or a
    plan's many trainers would each import again); anything else, or with
    ``KILN_FORK_TRAINERS=0``, runs as a new process. Either shares our process group, and on
    Linux ``python -m kiln_trainer`` stops as at a SIGTERM (checkpoint, exit) when we end,
    however we end (`_stopping_with_us`): none trains on unwatched, or twice after a rerun.

    Raises:
        TrainerFailed: the program cannot be run (not found on `env`'s PATH, not executable);
            for a job's own command (`own`) the message names spec.template.command.
    """
    env = _stopping_with_us(command, env)
    forked = _fork(command, log=log, env=env)
    if forked is not None:
        return forked
    try:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    except OSError as exc:
        missing = isinstance(exc, FileNotFoundError)
        where = "spec.template.command" if own else "trainer command"
        why = ("not found on PATH; install it or give its full path" if missing
               and os.sep not in command[0] else f"{exc.strerror or exc}; fix the path")
        raise TrainerFailed(job_name, 127 if missing else 126, Path(log.name), [],
                            why=f"{where}: cannot run {command[0]!r}: {why}") from None


def _stopping_with_us(command: list[str], env: dict[str, str]) -> dict[str, str]:
    """`env`, asking the trainer `command` runs to stop when this process ends
    (`contract.Env.STOP_WITH_PARENT`: our pid), where it can: ``python -m kiln_trainer`` (the
    program that reads it; under torchrun its parent would be torchrun's agent), on Linux, and
    started from the main thread (the kernel's parent-death signal follows the thread that
    started a process, and only the main thread lasts as long as we do)."""
    if (sys.platform != "linux" or command[1:3] != ["-m", contract.TRAINER_MODULE]
            or threading.current_thread() is not threading.main_thread()):
        return env
    return {**env, contract.Env.STOP_WITH_PARENT: str(os.getpid())}


def _fork(command: list[str], *, log: IO[str], env: dict[str, str]) -> zygote.Process | None:
    """`command` forked by the zygote with its stdout on a pipe we read as Popen's text mode
    reads it and its stderr to `log`; None where the zygote does not run it."""
    if not (zygote.enabled() and zygote.forkable(command, env, os.getcwd())):
        return None
    read, write = os.pipe()
    stdout = open(read, encoding=locale.getpreferredencoding(False))  # noqa: SIM115 (the reader's)
    try:
        process = zygote.start(command, env=env, stdout=write, stderr=log.fileno(),
                               text_stdout=stdout)
    finally:
        os.close(write)
    if process is None:
        stdout.close()
    return process


def write_job_file(job: api.TrainingJob, work_dir: Path) -> Path:
    """Write the job as `<work_dir>/<name>.json` (the trainer's --job file); returns its path."""
    job_file = work_dir / f"{job.name}.json"
    job_file.write_text(json.dumps(api.to_wire(job), indent=2), encoding="utf-8")
    return job_file


def python_path(job_files: Sequence[Path | str], environ: Mapping[str, str]) -> dict[str, str]:
    """PYTHONPATH for trainers of these job files: each file's folder (absolute, in order), then
    `environ`'s PYTHONPATH, so a job's entrypoint imports packages kept beside its file."""
    folders = [str(Path(f).resolve().parent) for f in job_files]
    folders += [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(folders))}


def trainer_env(env: dict[str, str] | None, *, threads: str) -> dict[str, str]:
    """A trainer's environment: ours plus `env`, OMP_NUM_THREADS `threads` unless already set,
    unbuffered output."""
    return {"OMP_NUM_THREADS": threads, **os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}


def read_events(process: Trainer, *, log: IO[str]) -> Iterator[contract.Event]:
    """The trainer's events from its stdout, until it closes.

    Stray output (a user's print) goes to `log`, beside the trainer's stderr, so a failure's
    last log lines show it; an event the contract cannot read is skipped with a warning.
    """
    assert process.stdout is not None
    for line in process.stdout:
        try:
            event = contract.from_line(line)
        except ValueError as exc:
            warnings.warn(f"trainer pid {process.pid}: unreadable event ({exc}): {line[:200]}",
                          stacklevel=2)
            continue
        if event is not None:
            yield event
        elif not log.closed:  # a planned run closes the log of a trainer it stopped
            log.write(line if line.endswith("\n") else f"{line}\n")
            log.flush()  # the trainer writes its stderr to the same file


def new_progress(console: Console) -> Progress:
    """The live progress display: one bar per job, epochs done, the trainer's numbers."""
    return Progress(
        TextColumn("[bold blue]{task.description}"),
        BarColumn(),
        TextColumn("epoch {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("{task.fields[status]}", markup=False),  # the trainer's numbers, as text
        TimeElapsedColumn(),
        console=console,
        transient=False,
        # off a terminal `show` prints a line per evaluation; a bar's last frame would only
        # repeat the final line, cut to the console's width
        disable=not console.is_terminal,
    )


def show(progress: Progress, task: TaskID, event: contract.Event, *, prefix: str = "") -> None:
    """Show one trainer event: an info line (after `prefix`), or a progress update."""
    if isinstance(event, contract.Info):
        progress.console.print(f"  {prefix}{event.message}", markup=False, highlight=False)
        return
    if not isinstance(event, contract.Progress):
        return
    parts = []
    if event.train_loss is not None:
        parts.append(f"loss {event.train_loss:.3f}")
    if event.validation_accuracy is not None:
        parts.append(f"val acc {event.validation_accuracy:.3f}")
    if event.validation_loss is not None:
        parts.append(f"val loss {event.validation_loss:.3f}")
    if event.samples_per_second:
        parts.append(f"{event.samples_per_second:.0f} samples/s")
    if event.frozen_modules:
        parts.append(f"frozen {event.frozen_modules}/{event.modules or '?'} modules")
    completed = float(event.epoch or 0)
    steps, per_epoch = event.step, event.steps_per_epoch
    if per_epoch:
        completed = max(completed - 1, 0) + min(1.0, (steps % per_epoch or per_epoch) / per_epoch)
        completed = min(completed, float(event.epoch or completed))
    progress.update(task, completed=completed, total=event.epochs or None,  # None: unchanged
                    status="  ".join(parts))
    if event.evaluated and not progress.console.is_terminal:
        # rich draws a bar only on a terminal; a log (CI, nohup, a notebook) would get just
        # the last frame, so each evaluation gets a line of its own there
        name = next((t.description for t in progress.tasks if t.id == task), prefix)
        progress.console.print(
            f"{name}: epoch {event.epoch}/{event.epochs} step {event.step}: {'  '.join(parts)} "
            f"({event.elapsed_seconds:.1f} s)", markup=False, highlight=False, soft_wrap=True)


def history_path(work_dir: Path, job_name: str) -> Path:
    """Where a job's metric history is kept: `<work_dir>/<job>.metrics.jsonl`."""
    return work_dir / f"{job_name}.metrics.jsonl"


def append_history(path: Path, event: contract.Event) -> None:
    """Append `event` to a job's JSON-lines history (`history_path`) when it is an evaluation's
    progress event; ignore other events.

    Each line holds step, epoch, train and validation loss, validation accuracy, frozen modules,
    samples per second, the trainer's training clock (`elapsed_seconds`, across restarts) and
    the wall time (`time`, seconds since the Unix epoch). A rerun appends: a resumed or
    restarted trainer's steps go back, and `read_history` keeps only the latest stretch.
    """
    if not isinstance(event, contract.Progress) or not event.evaluated:
        return
    line = {"step": event.step, "epoch": event.epoch, "epochs": event.epochs,
            "train_loss": event.train_loss, "validation_accuracy": event.validation_accuracy,
            "validation_loss": event.validation_loss,
            "samples_per_second": event.samples_per_second,
            "frozen_modules": event.frozen_modules, "modules": event.modules,
            "elapsed_seconds": event.elapsed_seconds, "time": time.time()}
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    except OSError as exc:  # a full disk loses the curve, never the run
        warnings.warn(f"cannot write {path} ({exc.strerror or exc}); this run's metric "
                      "history is incomplete", stacklevel=2)


def read_history(path: Path) -> list[dict[str, Any]]:
    """A job's evaluations from its history file, in step order, latest stretch only.

    A line whose step is not past the previous line's starts a new stretch (the trainer
    resumed from an earlier checkpoint, or started over): earlier lines at or past its step
    are dropped, as that run's later checkpoints were lost. Lines that are not JSON objects with
    a step (a torn last line after a crash) are skipped.

    Raises:
        OSError: the file cannot be read.
    """
    kept: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", errors="replace") as f:  # a torn or foreign file
        for text in f:
            try:
                line = json.loads(text)
            except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
                continue
            if not isinstance(line, dict) or not isinstance(line.get("step"), int):
                continue
            while kept and kept[-1]["step"] >= line["step"]:
                kept.pop()
            kept.append(line)
    return kept


def _stop(process: Trainer) -> None:
    """Ask the trainer to checkpoint and exit (SIGTERM); kill it if it does not."""
    stop_all([process])


def stop_all(processes: Sequence[Trainer]) -> None:
    """Ask every running trainer to checkpoint and exit (SIGTERM to all, then wait for each);
    kill those still running STOP_GRACE_SECONDS after the signal."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tail(path: Path, lines: int = 12) -> list[str]:
    """The last `lines` lines of a log file ([] when it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip() for line in deque(f, maxlen=lines)]
    except OSError:
        return []


def default_threads() -> str:
    """Torch threads per trainer unless OMP_NUM_THREADS is set: half the cores, at least 1.

    Small models on few cores train several times slower when torch's threads outnumber the
    free cores (spinning OpenMP workers), so leave room for the runner and the rest.
    """
    return str(max(1, (os.cpu_count() or 2) // 2))


def default_work_dir() -> Path:
    """`RUNS` (made now), or a temp folder when it cannot be made or written."""
    try:
        RUNS.mkdir(parents=True, exist_ok=True)
        if os.access(RUNS, os.W_OK):
            return RUNS
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="kiln-runs-"))
