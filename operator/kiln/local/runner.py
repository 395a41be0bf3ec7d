"""`kiln run` jobs one after another, and the trainer subprocess both local runs share.

Each job runs `python -m kiln_trainer` (the trainer a cluster pod runs, which registers the
model in the zoo itself); its events drive a live progress bar, its stderr and stray stdout
go to a log file. Trainer text prints as plain text, never as rich markup. No placement, no kopf.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kiln import api, contract

# How long a trainer gets to write its checkpoint after SIGTERM before it is killed.
STOP_GRACE_SECONDS = 30.0


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
    with job_locks(jobs, work_dir):
        for job in jobs:
            result = _run_one(job, zoo_uri=zoo_uri, work_dir=work_dir, console=console, env=env)
            outcomes.append(JobOutcome(job.name, job.spec.model.label, result,
                                       has_target=job.spec.target is not None))
    return outcomes


@contextlib.contextmanager
def job_locks(jobs: list[api.TrainingJob], work_dir: Path) -> Iterator[None]:
    """Hold every job's lock (`_job_lock`) while in the block; all are taken before any
    training, so a clash wastes no work.

    Raises:
        JobBusy: another process holds one of them (none is kept).
    """
    with contextlib.ExitStack() as locks:
        for job in jobs:
            locks.enter_context(_job_lock(work_dir / f"{job.name}.lock", job.name))
        yield


@contextlib.contextmanager
def _job_lock(path: Path, job_name: str) -> Iterator[None]:
    """Hold an exclusive, non-blocking `flock` on `path` (holding our pid) while in the block.

    The kernel drops the lock when the process ends, however it ends, so a crash leaves no
    stale lock; the file itself stays (deleting it would race with the next locker).

    Raises:
        JobBusy: another process holds the lock; the message names its pid.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the trainer
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", errors="replace").strip() or "unknown"
            raise JobBusy(
                f"job {job_name} is already running (pid {holder}) from this directory; wait "
                f"for it to finish or stop it (its lock: {path})"
            ) from None
        except OSError as exc:  # a file system without flock (some NFS mounts): run unguarded
            warnings.warn(f"cannot lock {path} ({exc.strerror or exc}); a second `kiln run` of "
                          f"job {job_name} would not be refused", stacklevel=3)
        yield
    finally:
        os.close(fd)  # releases the lock


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
                    show(progress, task, event)
            process.wait()
        except KeyboardInterrupt:
            _stop(process)
            interrupted = True
    if interrupted or (result is None and process.returncode in contract.INTERRUPTED_EXIT_CODES):
        # Ctrl-C signals the whole process group: the trainer may see it first, save its
        # checkpoint and exit 130 before (or, with SIGINT ignored here, instead of) us.
        console.print(f"[yellow]{escape(job.name)}: stopped; its last checkpoint is kept, "
                      "`kiln run` again resumes it[/]")
        raise KeyboardInterrupt
    if result is None or process.returncode != 0:
        raise TrainerFailed(job.name, process.returncode, log_path, tail(log_path))
    return result.to_json()


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
                  env: dict[str, str]) -> subprocess.Popen[str]:
    """Start a trainer: events come on its stdout (`read_events`), its stderr goes to `log`.

    Raises:
        TrainerFailed: the program cannot be run (not found on `env`'s PATH, not executable);
            for a job's own command (`own`) the message names spec.template.command.
    """
    try:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    except OSError as exc:
        missing = isinstance(exc, FileNotFoundError)
        where = "spec.template.command" if own else "trainer command"
        why = ("not found on PATH; install it or give its full path" if missing
               and os.sep not in command[0] else f"{exc.strerror or exc}; fix the path")
        raise TrainerFailed(job_name, 127 if missing else 126, Path(log.name), [],
                            why=f"{where}: cannot run {command[0]!r}: {why}") from None


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


def read_events(process: subprocess.Popen[str], *, log: IO[str]) -> Iterator[contract.Event]:
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


def _stop(process: subprocess.Popen[str]) -> None:
    """Ask the trainer to checkpoint and exit (SIGTERM); kill it if it does not."""
    stop_all([process])


def stop_all(processes: list[subprocess.Popen[str]]) -> None:
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
    """`./.kiln/runs`, or a temp folder when the working directory is not writable."""
    base = Path(".kiln")
    try:
        base.mkdir(exist_ok=True)
        return base / "runs"
    except OSError:
        return Path(tempfile.mkdtemp(prefix="kiln-runs-"))
