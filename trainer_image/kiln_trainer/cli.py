"""The trainer's command line: ``python -m kiln_trainer --job FILE [options]``.

Options and their environment fallbacks (pods set the environment, people the flags):

| flag | env | meaning |
|---|---|---|
| --job FILE | KILN_JOB_FILE, or KILN_JOB (the job as JSON text) | the TrainingJob (YAML/JSON) |
| --zoo URI | KILN_ZOO | zoo store: a path, file://..., or s3://bucket[/prefix] |
| --metrics-port N | KILN_METRICS_PORT | Prometheus endpoint; 0 (default) serves none |
| --checkpoint-dir DIR | KILN_CHECKPOINTS | keep checkpoints here instead of the zoo store |
| --no-register | | train but do not add the model to the zoo |
| --no-resume | | ignore an existing checkpoint and start afresh |
| --parallelism MODE | KILN_PARALLELISM | auto (default), single, ddp or fsdp (see below) |

Exit codes: 0 success; 2 the job, dataset, checkpoint or settings are wrong (one message on
stderr, no traceback; also in /dev/termination-log); 3 the zoo or checkpoint store stayed
unavailable after retries (the checkpoint is kept, a rerun continues); 1 out of memory (one
message: reduce batchSize or the model) or an unexpected error (traceback on stderr). SIGTERM
and SIGINT save a checkpoint at the next step and exit 128 + signal (143, 130), as if the
signal had ended the process.

Parallel runs. --parallelism auto takes spec.resources.parallelism, and ddp when that is auto
too (single with one process). Under torchrun (`kiln_trainer.distributed.parallel.launch_command`, or the
pod command; W > 1 processes) every rank runs this `main`; stderr lines carry ``rank R``. Rank 0
alone writes the stdout protocol (progress, info, the result) and the result to
/dev/termination-log. A failure goes to the termination log as ``rank R of W: ...`` from the
first rank that fails (once one rank dies, the others' collectives fail with messages that
only echo it, so they leave the first in place). A signal to torchrun reaches every rank, and
any rank's stop request stops all of them after the same step; rank 0 writes the checkpoint
and the "stopped on request" info line.

**Exit codes are lost under torchrun**: it exits 1 whenever a worker exits non-zero, and on
SIGTERM, whatever the workers' codes (2, 3, 143). Callers of a torchrun command must therefore
go by the events, which are authoritative: a ``result`` event on stdout (rank 0; also in the
termination log) means success; a last stdout line "stopped on request ..." means interrupted
with a checkpoint; otherwise the run failed, and the termination log's ``error`` event (and
stderr) says why. Rank 0 writes one of these on every path it survives (on a failure, unless
another rank's failure is already there), including a collective that fails because another
rank died (that message then points to the other ranks' logs).

Callers: `kiln_trainer.__main__`, the local runner (as a subprocess), trainer pods.
Non-goals: no torchrun launching (`parallel.launch_command` and the pod command do that).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

import torch

from kiln import api
from kiln.api import jobfile
from kiln.zoo import store as zoo_store
from kiln_trainer import checkpoint, data, events, loop
from kiln_trainer.distributed import parallel

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_INVALID = 2
EXIT_STORE_UNAVAILABLE = 3

_log = logging.getLogger("kiln_trainer")
_STARTED_SECONDS = time.time()  # wall clock, for `_failed_elsewhere`


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the flags, with environment fallbacks (see the module docstring)."""
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="python -m kiln_trainer", description="Train one Kiln TrainingJob."
    )
    parser.add_argument("--job", default=env.get("KILN_JOB_FILE"),
                        help="TrainingJob file (YAML or JSON); env KILN_JOB_FILE or KILN_JOB")
    parser.add_argument("--zoo", default=env.get("KILN_ZOO") or None,
                        help="zoo store URI (path, file://, s3://bucket/prefix); env KILN_ZOO")
    parser.add_argument("--metrics-port", type=int, default=env.get("KILN_METRICS_PORT", "0"),
                        help="Prometheus port; 0 = no endpoint (default)")
    parser.add_argument("--checkpoint-dir", default=env.get("KILN_CHECKPOINTS") or None,
                        help="checkpoint directory (default: the zoo store, else "
                        f"{checkpoint.DEFAULT_DIR})")
    parser.add_argument("--no-register", action="store_true", help="do not register in the zoo")
    parser.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint")
    parser.add_argument("--parallelism", default=env.get("KILN_PARALLELISM") or "auto",
                        choices=("auto", *parallel.PARALLELISMS),
                        help="auto (ddp under torchrun with several processes, else single), "
                        "single, ddp or fsdp; env KILN_PARALLELISM")
    parser.add_argument("--parent", default=env.get("KILN_WARM_START_PARENT") or None,
                        metavar="ID", help="warm-start parent decided upstream: a zoo id, or "
                        "none for a cold start (default: choose from the zoo)")
    return parser.parse_args(argv)


def load_job(job_file: str | None, job_json: str | None) -> api.TrainingJob:
    """The job from a file, else from JSON text (KILN_JOB).

    Raises:
        api.InvalidSpec: no job given, a bad file, several jobs in one file, or an invalid job.
    """
    if job_file:
        jobs = jobfile.load_jobs(job_file)
        if len(jobs) != 1:
            problem = f"the file holds {len(jobs)} jobs; the trainer runs exactly one (split it)"
            raise api.InvalidSpec([problem], source=job_file)
        return jobs[0]
    if job_json:
        try:
            doc = json.loads(job_json)
        except json.JSONDecodeError as exc:
            raise api.InvalidSpec([f"not valid JSON: {exc}"], source="KILN_JOB") from None
        except RecursionError:
            raise api.InvalidSpec(["JSON nested too deeply to read"], source="KILN_JOB") from None
        return api.parse_job(doc, source="KILN_JOB")
    raise api.InvalidSpec(["no job given: pass --job FILE, or set KILN_JOB_FILE or KILN_JOB"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer; returns the process exit code (see the module docstring)."""
    rank, world_size = _rank()
    where = f"rank {rank} " if world_size > 1 else ""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s")
    args = parse_args(argv)
    emit = events.EventWriter(sys.stdout, termination_log=events.TERMINATION_LOG)
    stop, received = threading.Event(), list[int]()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        stop.set()  # the loop checkpoints after the current step, then raises Interrupted

    previous = {signum: signal.signal(signum, on_signal)
                for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        job = load_job(args.job, os.environ.get("KILN_JOB"))
        _check_locations(args)
        loop.main(job, zoo_uri=args.zoo, metrics_port=args.metrics_port,
                  register=not args.no_register, checkpoint_dir=args.checkpoint_dir,
                  resume=not args.no_resume, stop=stop, parent=args.parent, out=sys.stdout,
                  parallelism=args.parallelism)
    except loop.Interrupted:
        return 128 + (received[0] if received else signal.SIGTERM)
    except (api.InvalidSpec, data.DatasetError, checkpoint.CheckpointError,
            loop.ConfigError) as exc:
        return _fail(emit, _unwrap_worker_error(str(exc)), EXIT_INVALID)
    except zoo_store.StoreUnavailable as exc:
        return _fail(emit, f"store unavailable: {exc}", EXIT_STORE_UNAVAILABLE)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if not _is_out_of_memory(exc):
            _log.exception("unexpected error")
            _record_failure(emit, f"unexpected error: {type(exc).__name__}: {exc}")
            return EXIT_UNEXPECTED
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return _fail(emit, f"out of memory ({first[:300]}); reduce spec.training.batchSize or "
                     "the model size (spec.model.args, e.g. width or depth)", EXIT_UNEXPECTED)
    except Exception as exc:  # noqa: BLE001  # a bug or the environment: log the traceback
        _log.exception("unexpected error")
        _record_failure(emit, f"unexpected error: {type(exc).__name__}: {exc}")
        return EXIT_UNEXPECTED
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:  # arrived after the last step: the result is out, so the run counts as done
        _log.info("signal %d arrived after training finished; exiting normally", received[0])
    return EXIT_OK


def _check_locations(args: argparse.Namespace) -> None:
    """Refuse a zoo URI or checkpoint directory no store can use before any work starts.

    Raises:
        api.InvalidSpec: naming the flag (or its environment variable) and the problem.
    """
    checks: list[tuple[str, str | None, Callable[[str], object]]] = [
        ("--zoo", args.zoo, zoo_store.open_store),
        ("--checkpoint-dir", args.checkpoint_dir, zoo_store.DirStore),
    ]
    for flag, value, open_location in checks:
        try:
            if value:
                open_location(value)  # nothing is contacted or created yet
        except ValueError as exc:
            raise api.InvalidSpec([f"{flag} {value}: {exc}"]) from None


_MEMORY_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory",
                    "cannot allocate memory")


def _is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc).lower()
    return any(m in text for m in _MEMORY_MESSAGES)


def _unwrap_worker_error(message: str) -> str:
    """The original message of an error re-raised from a DataLoader worker process.

    Workers send ``Caught DatasetError in DataLoader worker process 0. Original Traceback
    ...`` whose last line is ``kiln_trainer.data.DatasetError: <message>``; keep <message>.
    """
    if not message.startswith("Caught ") or "Original Traceback" not in message:
        return message
    last = message.strip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def _rank() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) from torchrun's environment; (0, 1) outside it or when malformed
    (`parallel.setup` refuses a malformed one with a message)."""
    try:
        return int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 0, 1


def _record_failure(emit: events.EventWriter, message: str) -> None:
    """Put the failure in the termination log, naming the rank when there are several
    (``rank 1 of 2: ...``); an unexpected error also points to the other ranks' logs.

    The first rank to fail wins: once one rank dies, the collectives of the others fail too,
    with messages that only echo it, so a rank leaves an error another rank of this run
    already wrote (newer than this process) in place and logs its own on stderr instead.
    """
    rank, world_size = _rank()
    if world_size > 1:
        hint = (" (if another rank failed first, its log has the cause)"
                if message.startswith("unexpected error") else "")
        message = f"rank {rank} of {world_size}: {message}{hint}"
        if _failed_elsewhere(emit.termination_log):
            _log.error("not replacing another rank's failure in %s: %s", emit.termination_log,
                       message)
            return
    emit.failure(message)


def _failed_elsewhere(termination_log: Path | None) -> bool:
    """Whether the termination log holds an error event written since this process started."""
    try:
        if termination_log is None or termination_log.stat().st_mtime < _STARTED_SECONDS:
            return False
        return bool(json.loads(termination_log.read_text()).get("event") == "error")
    except (OSError, ValueError, AttributeError):
        return False


def _fail(emit: events.EventWriter, message: str, code: int) -> int:
    print(f"kiln_trainer: error: {message}", file=sys.stderr)
    _record_failure(emit, message)
    return code
