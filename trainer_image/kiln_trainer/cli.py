"""The trainer's entrypoint, ``python -m kiln_trainer``: run one job, map its outcome to an exit
code and events.

Flags, environment, events and exit codes are those of `kiln.contract`.
"""

from __future__ import annotations

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

from kiln import api, contract, models
from kiln.warmstart import decision
from kiln.zoo import presigned
from kiln.zoo import store as zoo_store
from kiln_trainer import checkpoint, data, events, jobcontext, loop, profiling, runtime, warm

_log = logging.getLogger("kiln_trainer")
_STARTED_SECONDS = time.time()  # wall clock, for `_failed_elsewhere`


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer; returns the process exit code (`kiln.contract`'s EXIT_*, or 128 + the
    signal that stopped it after a checkpoint).

    Under torchrun every rank runs this; rank 0 alone writes the events (`loop.main`), and the
    first rank to fail writes the termination log (`_record_failure`).
    """
    rank, world_size = _rank()
    where = f"rank {rank} " if world_size > 1 else ""  # so interleaved stderr names the rank
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s")
    args = contract.parse_trainer_args(argv, os.environ)
    emit = events.EventWriter(sys.stdout, termination_log=events.TERMINATION_LOG)
    stop, received = threading.Event(), list[int]()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        stop.set()  # the loop checkpoints after the current step, then raises Interrupted

    previous = {signum: signal.signal(signum, on_signal)
                for signum in (signal.SIGTERM, signal.SIGINT)}
    runtime.stop_with_parent()
    try:
        job = runtime.load_job(args.job_file, os.environ.get(contract.Env.JOB))
        _check_locations(args)
        if args.profile:  # measure the model and decide warm start, in place of training
            emit.profile(profiling.profile(job, zoo_uri=args.zoo, world_size=world_size,
                                           warm_decision_text=args.warm_start))
        else:
            loop.main(job, zoo_uri=args.zoo, metrics_port=args.metrics_port,
                      register=args.register, checkpoint_dir=args.checkpoint_dir,
                      resume=args.resume, stop=stop, out=sys.stdout,
                      warm_decision=warm.parse_decision(args.warm_start),
                      parallelism=args.parallelism)
    except jobcontext.Interrupted:
        return 128 + (received[0] if received else signal.SIGTERM)
    except (api.InvalidSpec, data.DatasetError, checkpoint.CheckpointError,
            runtime.ConfigError, decision.ApplyError, models.EntrypointError,
            zoo_store.StoreMisconfigured) as exc:
        return _fail(emit, _unwrap_worker_error(str(exc)), contract.EXIT_INVALID)
    except zoo_store.StoreUnavailable as exc:
        return _fail(emit, f"store unavailable: {exc}", contract.EXIT_STORE_UNAVAILABLE)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if not models.out_of_memory(exc):
            _log.exception("unexpected error")
            _record_failure(emit, f"unexpected error: {type(exc).__name__}: {exc}")
            return contract.EXIT_UNEXPECTED
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return _fail(emit, f"out of memory ({first[:300]}); reduce spec.training.batchSize or "
                     "the model size (spec.model.args, e.g. width or depth)",
                     contract.EXIT_UNEXPECTED)
    except Exception as exc:  # noqa: BLE001  # a bug or the environment: log the traceback
        _log.exception("unexpected error")
        _record_failure(emit, f"unexpected error: {type(exc).__name__}: {exc}")
        return contract.EXIT_UNEXPECTED
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:  # arrived after the last step: the result is out, so the run counts as done
        _log.info("signal %d arrived after training finished; exiting normally", received[0])
    return contract.EXIT_OK


def _check_locations(args: contract.TrainerArgs) -> None:
    """Refuse a zoo URI or checkpoint directory no store can use before any work starts.

    Raises:
        api.InvalidSpec: naming the flag (or its environment variable) and the problem.
    """
    checks: list[tuple[str, str | None, Callable[[str], object]]] = [
        (contract.Flag.ZOO, args.zoo, presigned.open_zoo),
        (contract.Flag.CHECKPOINT_DIR, args.checkpoint_dir, zoo_store.DirStore),
    ]
    for flag, value, open_location in checks:
        try:
            if value:
                open_location(value)  # nothing is contacted or created yet
        except ValueError as exc:
            raise api.InvalidSpec([f"{flag} {value}: {exc}"]) from None


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
        message = contract.read_termination_message(termination_log.read_text())
    except (OSError, UnicodeDecodeError):
        return False
    return isinstance(message, contract.Failure)


def _fail(emit: events.EventWriter, message: str, code: int) -> int:
    print(f"kiln_trainer: error: {message}", file=sys.stderr)
    _record_failure(emit, message)
    return code
