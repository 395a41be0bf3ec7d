"""The reference model: a quantized snapshot of the training model, run in another CPU process.

Both ends of the message protocol (the trainer's `ReferenceWorker` and the worker's loop) stay
in this one file, so the protocol is read in one place. Training never waits for the worker.
Shapes: b probe batch, d flattened features.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import dataclasses
import io
import logging
import math
import multiprocessing
import os
import queue
import signal
import time
import traceback
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, Self

import torch
import torch.multiprocessing
from torch import nn

from kiln import api, models
from kiln_trainer.freezing import partition, plasticity, quantization

_log = logging.getLogger(__name__)

#: Seconds between the worker's checks that the trainer still exists while idle.
ORPHAN_CHECK_SECONDS = 1.0
#: Seconds `close` waits for the worker to stop by itself before terminating it.
CLOSE_JOIN_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """One answered probe.

    Attributes:
        probe_id: as submitted.
        version: the reference snapshot's version (the latest refresh's, else discarded).
        plasticity: dict[block, SP loss] for every block the probe carried activations of.
        seconds: worker CPU seconds spent on this probe (time.process_time).
    """

    probe_id: int
    version: int
    plasticity: dict[str, float]
    seconds: float


# Messages to the worker and back. Tensors travel as torch.save bytes through the pipe, written
# by the queue's feeder thread, not as shared memory: /dev/shm is often 64 MiB in containers,
# and a shared-memory failure in the feeder thread would silently lose the message.
def _packed(message: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(tuple(getattr(message, f.name) for f in dataclasses.fields(message)), buffer)
    return buffer.getvalue()


def _unpacked(kind: type[Any], data: bytes) -> Any:
    return kind(*torch.load(io.BytesIO(data), weights_only=True))


@dataclasses.dataclass(frozen=True)
class _Refresh:
    version: int
    state_dict: dict[str, torch.Tensor]
    calibration: torch.Tensor

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpacked, (_Refresh, _packed(self)))


@dataclasses.dataclass(frozen=True)
class _Probe:
    probe_id: int
    version: int
    inputs: torch.Tensor
    activations: dict[str, torch.Tensor]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpacked, (_Probe, _packed(self)))


@dataclasses.dataclass(frozen=True)
class _Stop:
    pass


@dataclasses.dataclass(frozen=True)
class _Taken:  # the worker dequeued the refresh of `version`: the next may be sent
    version: int


@dataclasses.dataclass(frozen=True)
class _Refreshed:  # the snapshot of `version` is in place
    version: int
    kind: str
    floor: dict[str, float]
    seconds: float


@dataclasses.dataclass(frozen=True)
class _Skipped:  # a probe for an older version than the worker's snapshot: not computed
    probe_id: int


@dataclasses.dataclass(frozen=True)
class _Failed:
    message: str


class ReferenceWorker:
    """The reference model in a spawned CPU process (Egeria, EuroSys'23, section 4).

    Egeria generates the reference on the fly by quantization and runs its forward
    asynchronously on spare CPUs. The worker rebuilds the architecture from the job's spec
    (`models.build`) or, given the model object itself, starts from a CPU deep copy of it;
    then it loads each refreshed snapshot, copies it as int8 or fp32 (`quantization.choose` on
    the first refresh picks the kind cheaper per refresh and probe, later refreshes reuse it)
    and answers probes with one SP loss per block (`plasticity.sp_loss`).

    Flow control (why training never blocks): at most one refresh and one probe are ever in
    flight. `submit` drops a probe (returns False) while an earlier one is unanswered;
    `refresh` holds a newer snapshot back while the worker has not yet taken the previous one
    and replaces a held one (latest wins), so pending snapshots never pile up. Messages travel
    through a multiprocessing queue (its feeder thread, not the caller, serializes and writes
    them); results come back through a pipe read without blocking. Results tagged with any
    version but the latest refresh's are discarded. Any exception in the worker is sent back,
    logged, and marks it dead (`alive` False): the trainer then trains unfrozen.

    The process starts at once: spawned for a spec (no CUDA or lock state is inherited; its
    imports take a few seconds, during which requests wait in the queue); forked for a model
    object, which then reaches the worker as memory, never pickled (the worker touches only
    its CPU copy, never CUDA). Every method returns without
    waiting for the worker, except `wait` and `close`. Call it from one thread. As with any
    spawned process, a script that creates a worker must guard its entry point with
    ``if __name__ == "__main__":`` (the child imports the main module). The worker exits by
    itself when the trainer's process is gone.

    Args:
        model: the architecture to rebuild (`models.build`), as in the job's spec; or the
            training model itself (any nn.Module: an own loop's), copied to the CPU in fp32.
        blocks: natural block names, head last (`partition.extractor`'s argument).
        threads: torch CPU threads of the worker (`torch.set_num_threads`), >= 1.
        mode: "auto" (int8 or fp32, whichever `quantization.choose` measures cheaper on the
            first refresh; later refreshes reuse that kind) or "fp32".

    Raises:
        ValueError: `threads` < 1 or an unknown `mode`.
    """

    def __init__(
        self, model: api.ModelSpec | nn.Module, blocks: Sequence[str], *, threads: int = 1,
        mode: str = "auto",
    ) -> None:
        if threads < 1:
            raise ValueError(f"reference threads must be >= 1 (got {threads})")
        if mode not in ("auto", "fp32"):
            raise ValueError(f"quantization mode must be 'auto' or 'fp32' (got {mode!r})")
        self.blocks = tuple(blocks)
        if isinstance(model, nn.Module):
            model = copy.deepcopy(model).to("cpu", torch.float32).eval()
        self.forked = isinstance(model, nn.Module)  # else spawned
        context = (torch.multiprocessing.get_context("fork") if self.forked
                   else torch.multiprocessing.get_context("spawn"))
        self._inbox = context.Queue()
        self._results, child_end = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_serve,
            args=(model, self.blocks, threads, mode, self._inbox, child_end, os.getpid()),
            name="kiln-reference", daemon=True,
        )
        self._process.start()
        child_end.close()  # the child holds its own copy; EOF here once the child is gone
        self._latest: int | None = None  # version of the latest refresh
        self._refresh_in_flight = False  # sent, not yet taken by the worker
        self._held: _Refresh | None = None  # newest refresh waiting for the worker to take one
        self._probe_in_flight = False
        self._answered: list[ProbeResult] = []
        self._failed = False
        self._closed = False
        self.kind: str | None = None  # quantization kind of the worker's current snapshot
        self.noise_floor: dict[str, float] = {}  # SP of that snapshot vs fp32, per block
        self.cpu_seconds = 0.0  # worker CPU seconds spent on refreshes and probes, as reported
        self.stale_results = 0  # results discarded because a newer refresh came first

    @property
    def pid(self) -> int | None:
        """Process id of the worker (None once closed)."""
        return None if self._closed else self._process.pid

    @property
    def alive(self) -> bool:
        """False once closed, crashed, or exited; the trainer then trains unfrozen."""
        if self._closed or self._failed:
            return False
        if not self._process.is_alive():
            self._mark_dead(f"the reference process exited with code {self._process.exitcode}")
            return False
        return True

    @property
    def ready(self) -> bool:
        """Whether `submit` would send a probe of the latest version now (alive, no probe
        unanswered): callers skip computing activations it would drop."""
        self._drain()
        return not self._probe_in_flight and self.alive

    def refresh(self, version: int, state_dict: Mapping[str, torch.Tensor],
                calibration: torch.Tensor) -> None:
        """Replace the reference with a snapshot of the training model (never blocks).

        The tensors are copied to CPU here, so training may keep updating its weights; the
        queue's feeder thread serializes the copy. If the worker has not taken the
        previous snapshot yet, this one is held back and sent later; a held snapshot is
        replaced by a newer one.

        Args:
            version: increasing snapshot number; results are tagged with it.
            state_dict: the training model's state dict (any device).
            calibration: Tensor[b, ...] inputs for static quantization (the probe batch).
        """
        self._drain()
        self._latest = version
        if not self.alive:
            return
        self._held = _Refresh(
            version,
            {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()},
            calibration.detach().to("cpu", copy=True),
        )
        self._send_held()

    def submit(self, probe_id: int, version: int, inputs: torch.Tensor,
               activations: Mapping[str, torch.Tensor]) -> bool:
        """Hand one probe to the worker, unless it is busy (never blocks).

        Args:
            probe_id: the caller's id, returned in the result.
            version: the refresh the activations should be compared with (the latest).
            inputs: Tensor[b, ...] probe inputs (any device), b >= 2.
            activations: dict[block, Tensor[b, ...]] of the training model on `inputs` (eval
                mode, no grad), flattened here with `partition.flatten` and copied to CPU.

        Returns:
            True if sent; False if dropped: an earlier probe is unanswered, `version` is not the
            latest refresh's, or the worker is dead or closed.

        Raises:
            ValueError: a block is not one of `blocks` but the last (the head), or a batch size
                differs from `inputs'` or is < 2.
        """
        for block, t in activations.items():
            if block not in self.blocks[:-1]:
                raise ValueError(f"{block!r} is not a probed block ({list(self.blocks[:-1])})")
            if t.shape[0] != inputs.shape[0] or inputs.shape[0] < 2:
                raise ValueError(f"block {block}: batch {t.shape[0]}, inputs {inputs.shape[0]};"
                                 " both must be equal and >= 2")
        self._drain()
        if self._probe_in_flight or version != self._latest or not self.alive:
            return False
        flat = {k: partition.flatten(v).to("cpu", copy=True) for k, v in activations.items()}
        self._inbox.put(_Probe(probe_id, version, inputs.detach().to("cpu", copy=True), flat))
        self._probe_in_flight = True
        return True

    def poll(self) -> list[ProbeResult]:
        """Results answered since the last call, for the latest refresh only (never blocks)."""
        self._drain()
        results = [r for r in self._answered if r.version == self._latest]
        self.stale_results += len(self._answered) - len(results)
        self._answered = []
        return results

    def wait(self, timeout_seconds: float) -> bool:
        """Block until the worker has sent something (for tests and shutdown, not training).

        Returns:
            Whether a message is waiting (`poll` then reads it).
        """
        if self._closed or self._failed:
            return False
        return self._results.poll(timeout_seconds)

    def close(self) -> None:
        """Stop the worker: ask, wait `CLOSE_JOIN_SECONDS`, then terminate/kill (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._inbox.put(_Stop())
            self._process.join(CLOSE_JOIN_SECONDS)
            for stop in (self._process.terminate, self._process.kill):
                if self._process.is_alive():
                    stop()
                    self._process.join(1.0)
        finally:
            self._inbox.cancel_join_thread()  # its feeder may be stuck on a pipe nobody reads
            self._inbox.close()
            self._results.close()
            if not self._process.is_alive():
                self._process.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send_held(self) -> None:
        if self._held is not None and not self._refresh_in_flight:
            self._inbox.put(self._held)
            self._held, self._refresh_in_flight = None, True

    def _drain(self) -> None:
        while not self._closed and not self._failed and self._results.poll():
            try:
                message = self._results.recv()
            except (EOFError, OSError) as error:
                self._mark_dead(f"the reference process is gone ({type(error).__name__})")
                return
            if isinstance(message, ProbeResult):
                self._answered.append(message)
                self._probe_in_flight = False
                self.cpu_seconds += message.seconds
            elif isinstance(message, _Skipped):
                self._probe_in_flight = False
            elif isinstance(message, _Taken):
                self._refresh_in_flight = False
                self._send_held()
            elif isinstance(message, _Refreshed):
                level = logging.INFO if message.kind != self.kind else logging.DEBUG
                self.kind, self.noise_floor = message.kind, message.floor
                self.cpu_seconds += message.seconds
                _log.log(level, "reference v%d ready: %s, noise floor max %.3g, %.2f CPU s",
                         message.version, message.kind, max(message.floor.values(), default=0),
                         message.seconds)
            elif isinstance(message, _Failed):
                self._mark_dead(message.message)

    def _mark_dead(self, why: str) -> None:
        if not self._failed and not self._closed:
            self._failed = True
            _log.error("reference worker failed, training continues without freezing: %s", why)


def _serve(spec: api.ModelSpec | nn.Module, blocks: tuple[str, ...], threads: int, mode: str,
           inbox: Any, results: Connection, trainer_pid: int) -> None:
    """The worker process: rebuild the model, then answer refreshes and probes until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker inherits the trainer's
    _die_with(trainer_pid)
    torch.set_num_threads(threads)
    try:
        _loop(spec, blocks, mode, inbox, results)
    except Exception as error:  # noqa: BLE001 - reported to the trainer, which logs it
        with contextlib.suppress(OSError):  # the trainer may be gone: nobody left to tell
            results.send(_Failed(f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        results.close()
    # Skip the interpreter's teardown of torch's modules (a spawned child exits through it,
    # a second and more of CPU while the trainer waits in `close`): nothing is left to flush.
    logging.shutdown()
    os._exit(0)


def _die_with(trainer_pid: int) -> None:
    """Have Linux kill this process when the trainer dies, however it dies (PR_SET_PDEATHSIG).

    The idle orphan check cannot help a worker blocked reading a message the trainer was
    killed half-way through writing (it holds a copy of the queue's write end, so the read
    never ends); the kernel's parent-death signal can. Elsewhere the orphan check remains.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: rely on the orphan check
    if os.getppid() != trainer_pid:  # the trainer died before the signal was armed
        os._exit(0)


def _loop(spec: api.ModelSpec | nn.Module, blocks: tuple[str, ...], mode: str, inbox: Any,
          results: Connection) -> None:
    model = spec if isinstance(spec, nn.Module) else models.build(spec).eval()
    extractor = partition.extractor(model, blocks)
    reference: nn.Module | None = None
    version: int | None = None
    pending: _Probe | None = None
    while True:
        try:
            messages = [inbox.get(timeout=ORPHAN_CHECK_SECONDS)]
        except queue.Empty:
            parent = multiprocessing.parent_process()
            if parent is not None and not parent.is_alive():
                return  # the trainer died without closing us
            continue
        while not inbox.empty():  # take everything that is there: the newest refresh wins
            messages.append(inbox.get())
        refresh: _Refresh | None = None
        for message in messages:
            if isinstance(message, _Stop):
                return
            if isinstance(message, _Refresh):
                refresh = message
                results.send(_Taken(message.version))
            elif isinstance(message, _Probe):
                if pending is not None:
                    results.send(_Skipped(pending.probe_id))
                pending = message
        if refresh is not None:
            started = time.process_time()
            model.load_state_dict(refresh.state_dict)
            if mode == "auto":  # the first refresh measures both kinds; later ones reuse it
                reference, kind, floor, costs = quantization.choose(
                    extractor, refresh.calibration)
                mode = kind
                _log.info("reference: %s chosen by CPU seconds per refresh and probe (%s)",
                          kind, ", ".join(f"{k} {v:.3f}" for k, v in costs.items()))
            else:
                reference, kind, floor = quantization.quantize_with_floor(
                    extractor, refresh.calibration, mode=mode)
            version = refresh.version
            results.send(_Refreshed(version, kind, floor, time.process_time() - started))
        if pending is None or version is None or pending.version > version:
            continue  # wait for the refresh this probe belongs to
        if pending.version < version or reference is None:
            results.send(_Skipped(pending.probe_id))
        else:
            results.send(_answer(reference, pending))
        pending = None


def _answer(reference: nn.Module, probe: _Probe) -> ProbeResult:
    started = time.process_time()
    with quantization.torch_ao_warnings():
        outputs = quantization.outputs(reference, probe.inputs)
    values = {}
    for block, trained in probe.activations.items():
        values[block] = plasticity.sp_loss(trained, partition.flatten(outputs[block]))
        if not math.isfinite(values[block]):
            values.pop(block)  # a diverged activation says nothing about convergence
    return ProbeResult(probe.probe_id, probe.version, values, time.process_time() - started)
