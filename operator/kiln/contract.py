"""The operator-trainer interface: how to launch the trainer and how to read what it says.

The operator's pods, `kiln run` and `kiln profile` build the trainer's command line and
environment here; the trainer parses them here and writes its JSON-lines events, exit code and
termination message with the types here. Standard library, pydantic and `kiln.api` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import signal
import sys
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import pydantic

from kiln import api

# ----------------------------------------------------------------------------------------------
# Launching: ``python -m kiln_trainer [flags]``, or k processes of it under torchrun.

TRAINER_MODULE = "kiln_trainer"
# torchrun as a module, so the command needs only the interpreter; ``--standalone`` gives each
# launch a private rendezvous on a free port, so concurrent jobs on one machine never collide.
# A launch spanning nodes uses a c10d rendezvous instead (`Rendezvous`); the trainer reads the
# same environment either way.
TORCHRUN = ("-m", "torch.distributed.run", "--standalone")
TORCHRUN_MODULE = ("-m", "torch.distributed.run")
RENDEZVOUS_PORT = 29400  # torchrun's default c10d port, served by the first node's agent


class Flag(enum.StrEnum):
    """The trainer's command-line flags (each also read from its `Env` variable, if any)."""

    JOB = "--job"  # TrainingJob file (YAML or JSON); env KILN_JOB_FILE, or KILN_JOB as JSON text
    ZOO = "--zoo"  # zoo store URI: a path, file://..., or s3://bucket[/prefix]
    METRICS_PORT = "--metrics-port"  # Prometheus port; 0 (default) serves no endpoint
    CHECKPOINT_DIR = "--checkpoint-dir"  # keep checkpoints here instead of the zoo store
    NO_REGISTER = "--no-register"  # train, but do not add the model to the zoo
    NO_RESUME = "--no-resume"  # ignore an existing checkpoint and start afresh
    PARALLELISM = "--parallelism"  # auto (default), single, ddp or fsdp
    WARM_START = "--warm-start"  # the whole warm-start decision as JSON (see TrainerArgs)
    PROFILE = "--profile"  # measure the model and decide warm start, then exit (no training)


class Env(enum.StrEnum):
    """Every KILN_* environment variable the operator, `kiln run` or the trainer read or set."""

    JOB = "KILN_JOB"  # the job as JSON text (pods), when no --job file is given
    JOB_FILE = "KILN_JOB_FILE"  # --job
    ZOO = "KILN_ZOO"  # --zoo
    ZOO_ENDPOINT = "KILN_ZOO_ENDPOINT"  # S3 endpoint (host:port or http(s)://host:port)
    ZOO_ACCESS_KEY = "KILN_ZOO_ACCESS_KEY"  # S3 credentials (pods: from a Secret)
    ZOO_SECRET_KEY = "KILN_ZOO_SECRET_KEY"
    ZOO_REGION = "KILN_ZOO_REGION"  # optional S3 region
    ZOO_SESSION_TOKEN = "KILN_ZOO_SESSION_TOKEN"  # temporary S3 credentials' token
    ZOO_CREDENTIALS = "KILN_ZOO_CREDENTIALS"  # "iam": AWS IAM / web identity instead of keys
    ZOO_SHARE = "KILN_ZOO_SHARE"  # new records' share when spec.zoo.share is unset
    ZOO_RECORD = "KILN_ZOO_RECORD"  # the record id the operator reserved for the job's model
    TRAINER_IMAGE = "KILN_TRAINER_IMAGE"  # the pod's image, recorded with the model
    METRICS_PORT = "KILN_METRICS_PORT"  # --metrics-port
    CHECKPOINTS = "KILN_CHECKPOINTS"  # --checkpoint-dir
    PARALLELISM = "KILN_PARALLELISM"  # --parallelism
    WARM_START = "KILN_WARM_START"  # --warm-start
    TENSORBOARD_DIR = "KILN_TENSORBOARD_DIR"  # trainer: write TensorBoard runs under it
    DEVICES = "KILN_DEVICES"  # GPUs (or CPU slots) the pod holds; informational
    TERMINATION_LOG = "KILN_TERMINATION_LOG"  # moves the termination log (test kubelets)
    DATA_CACHE = "KILN_DATA_CACHE"  # where s3:// sources are cached (default: a temp folder)
    SOURCES = "KILN_SOURCES"  # the initializer's manifest: each source's local copy
    SECRETS_DIR = "KILN_SECRETS_DIR"  # folders of Secret keys (<dir>/<secret>/<key>)
    FORK_TRAINERS = "KILN_FORK_TRAINERS"  # kiln run: "0" starts no trainer from a zygote
    # kiln run / kiln sweep run, to its trainers: its pid; on Linux the trainer has the kernel
    # send it SIGTERM when that parent dies, however it dies (never set in pods)
    STOP_WITH_PARENT = "KILN_STOP_WITH_PARENT"


# The initializer: ``python -m kiln_trainer.initializer`` downloads a job's s3:// sources
# (spec.model.pretrained.uri, spec.dataset.uri) into the cache and writes the manifest the
# trainer reads; in a pod it is an init container of the trainer's image.
INITIALIZER_MODULE = "kiln_trainer.initializer"
INITIALIZER_CONTAINER = "kiln-initializer"
SOURCES_DIR = "/var/lib/kiln/sources"  # the pod's emptyDir: the manifest (and cache, unclaimed)
SOURCES_MANIFEST = "sources.json"
SOURCE_CACHE_DIR = "/var/cache/kiln"  # spec.initializer.cacheClaim's volume
SECRETS_DIR = "/var/run/secrets/kiln"  # the initializer's Secrets: <dir>/<secret>/<key>


def initializer_command(*, python: str = sys.executable) -> list[str]:
    """The command that runs the initializer (it reads the job as the trainer does)."""
    return [python, "-m", INITIALIZER_MODULE]


# Under ``--zoo-pod-access presigned`` a pod's KILN_ZOO is ``presigned:<manifest>``: the
# manifest of presigned URLs the operator mints into the job's Secret, mounted read-only here.
ZOO_ACCESS_SCHEME = "presigned"
ZOO_ACCESS_DIR = "/var/run/kiln/zoo-access"
ZOO_ACCESS_FILE = "manifest.json"


@dataclasses.dataclass(frozen=True)
class TrainerArgs:
    """The trainer's settings, from its flags with environment fallbacks.

    Attributes:
        job_file: the TrainingJob file; None: the job comes from KILN_JOB.
        zoo: zoo store URI, or None (no zoo).
        metrics_port: Prometheus port; 0 serves no endpoint.
        checkpoint_dir: checkpoint directory, or None (the zoo store, else the trainer's default).
        register: add the trained model to the zoo.
        resume: continue from an existing checkpoint.
        parallelism: "auto" (ddp under torchrun with several processes, else single),
            "single", "ddp" or "fsdp".
        warm_start: the whole warm-start decision as JSON text, or None; the trainer decodes it
            with the warm-start decision type's ``from_json``.
        profile: run the profiling step instead of training: build the model, trace its
            graph, count its FLOPs and parameters, time a few training steps on one device,
            decide warm start, and write one `Profile` event (stdout and termination log).
    """

    job_file: str | None = None
    zoo: str | None = None
    metrics_port: int = 0
    checkpoint_dir: str | None = None
    register: bool = True
    resume: bool = True
    parallelism: str = api.Parallelism.AUTO.value
    warm_start: str | None = None
    profile: bool = False

    def to_argv(self) -> list[str]:
        """The flags that give these settings (defaults are left out)."""
        argv: list[str] = []
        for flag, value in ((Flag.JOB, self.job_file), (Flag.ZOO, self.zoo),
                            (Flag.CHECKPOINT_DIR, self.checkpoint_dir),
                            (Flag.WARM_START, self.warm_start)):
            if value is not None:
                argv += [flag, value]
        if self.metrics_port:
            argv += [Flag.METRICS_PORT, str(self.metrics_port)]
        if self.parallelism != api.Parallelism.AUTO:
            argv += [Flag.PARALLELISM, self.parallelism]
        argv += [Flag.NO_REGISTER] * (not self.register) + [Flag.NO_RESUME] * (not self.resume)
        argv += [Flag.PROFILE] * self.profile
        return [str(a) for a in argv]

    def to_env(self) -> dict[str, str]:
        """The same settings as `Env` variables (defaults left out), for a process that reads
        its settings from the environment, like a job's own command."""
        env = {Env.JOB_FILE: self.job_file, Env.ZOO: self.zoo, Env.CHECKPOINTS: self.checkpoint_dir,
               Env.WARM_START: self.warm_start,
               Env.METRICS_PORT: str(self.metrics_port) if self.metrics_port else None,
               Env.PARALLELISM: (self.parallelism if self.parallelism != api.Parallelism.AUTO
                                 else None)}
        return {str(k): v for k, v in env.items() if v is not None}


def parse_trainer_args(argv: Sequence[str] | None, environ: Mapping[str, str]) -> TrainerArgs:
    """The trainer's settings from `argv` (None: sys.argv), falling back on `environ`.

    Raises:
        SystemExit: unknown flags or bad values (argparse prints the usage).
    """
    parser = argparse.ArgumentParser(prog=f"python -m {TRAINER_MODULE}",
                                     description="Train one Kiln TrainingJob.")
    parser.add_argument(Flag.JOB, default=environ.get(Env.JOB_FILE) or None,
                        help=f"TrainingJob file (YAML or JSON); env {Env.JOB_FILE} or {Env.JOB}")
    parser.add_argument(Flag.ZOO, default=environ.get(Env.ZOO) or None,
                        help=f"zoo store URI (path, file://, s3://bucket/prefix); env {Env.ZOO}")
    parser.add_argument(Flag.METRICS_PORT, type=int, default=environ.get(Env.METRICS_PORT, "0"),
                        help=f"Prometheus port; 0 = no endpoint (default); env {Env.METRICS_PORT}")
    parser.add_argument(Flag.CHECKPOINT_DIR, default=environ.get(Env.CHECKPOINTS) or None,
                        help="checkpoint directory (default: the zoo store, else "
                        f"./.kiln/checkpoints); env {Env.CHECKPOINTS}")
    parser.add_argument(Flag.NO_REGISTER, action="store_true", help="do not register in the zoo")
    parser.add_argument(Flag.NO_RESUME, action="store_true", help="ignore an existing checkpoint")
    parser.add_argument(Flag.PARALLELISM,
                        default=environ.get(Env.PARALLELISM) or api.Parallelism.AUTO.value,
                        choices=[p.value for p in api.Parallelism],
                        help="auto (ddp under torchrun with several processes, else single), "
                        f"single, ddp or fsdp; env {Env.PARALLELISM}")
    parser.add_argument(Flag.WARM_START, default=environ.get(Env.WARM_START) or None,
                        metavar="JSON", help="the warm-start decision made upstream, as JSON "
                        f"(default: decide from the zoo); env {Env.WARM_START}")
    parser.add_argument(Flag.PROFILE, action="store_true",
                        help="measure the model (graph, FLOPs, parameters, step time) and "
                        "decide warm start, then exit without training")
    ns = parser.parse_args(argv)
    return TrainerArgs(job_file=ns.job, zoo=ns.zoo, metrics_port=ns.metrics_port,
                       checkpoint_dir=ns.checkpoint_dir, register=not ns.no_register,
                       resume=not ns.no_resume, parallelism=ns.parallelism,
                       warm_start=ns.warm_start, profile=ns.profile)


def torchrun_command(processes: int, module: str, argv: Sequence[str], *,
                     python: str = sys.executable) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node K -m MODULE ARGV``."""
    return [python, *TORCHRUN, "--nproc-per-node", str(processes), "-m", module, *argv]


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """How the torchrun agents of a launch spanning several machines find each other (c10d).

    Attributes:
        nodes: machines in the launch (one torchrun agent each), >= 2.
        node: this machine's index, 0-based; node 0 hosts the rendezvous store.
        endpoint: ``HOST:PORT`` of node 0's store (in a cluster, its pod's DNS name).
        run_id: the same on every node and new for every attempt, so a restarted launch
            never joins an old one's rendezvous.
        local_addr: this machine's address as the others reach it. torchrun gives group ranks
            in the sorted order of these addresses, so node i's must sort i-th (global rank 0,
            the one that reports, is then on node 0).
    """

    nodes: int
    node: int
    endpoint: str
    run_id: str
    local_addr: str

    def __post_init__(self) -> None:
        if self.nodes < 2 or not 0 <= self.node < self.nodes:
            raise ValueError(f"Rendezvous: node {self.node} of {self.nodes}; need 2 or more "
                             "nodes and 0 <= node < nodes")

    def torchrun_flags(self) -> list[str]:
        """torchrun's flags for this node (besides ``--nproc-per-node``)."""
        return ["--nnodes", str(self.nodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
                "--rdzv-conf", f"is_host={int(self.node == 0)}",
                "--local-addr", self.local_addr]


def trainer_command(processes: int, argv: Sequence[str], *, python: str = sys.executable,
                    rendezvous: Rendezvous | None = None) -> list[str]:
    """The command that runs the trainer with `processes` processes on this machine.

    One process: ``python -m kiln_trainer ARGV``; more: the same under torchrun. Only rank 0
    writes the events, and torchrun passes the workers' stdout through, so readers read it as
    from one process. With `rendezvous` the launch spans machines: torchrun runs `processes`
    here and joins the others through a c10d rendezvous (even with one process here).

    Args:
        processes: worker processes on this machine (GPUs, or CPU worker slots).
        argv: the trainer's flags (`TrainerArgs.to_argv`); a multi-process run should pass
            ``--parallelism`` ddp or fsdp.
        python: the interpreter (default: this one; pods use the image's ``python``).
        rendezvous: how this machine joins a launch spanning several (None: one machine).

    Raises:
        ValueError: processes < 1.
    """
    if processes < 1:
        raise ValueError(f"processes: {processes}; need at least 1")
    if rendezvous is not None:
        return [python, *TORCHRUN_MODULE, *rendezvous.torchrun_flags(),
                "--nproc-per-node", str(processes), "-m", TRAINER_MODULE, *argv]
    if processes == 1:
        return [python, "-m", TRAINER_MODULE, *argv]
    return torchrun_command(processes, TRAINER_MODULE, argv, python=python)


# ----------------------------------------------------------------------------------------------
# How a run ends: the exit code.
#
# Under torchrun exit codes are lost (it exits 1 whenever a worker fails, and on SIGTERM), so
# callers of a multi-process run go by the events: a `Result` means success; a last `Info`
# starting with STOPPED_PREFIX means stopped with a checkpoint; otherwise the run failed and
# the termination log's `Failure` (and stderr) says why.

EXIT_OK = 0
EXIT_UNEXPECTED = 1  # out of memory (one message), or a bug (traceback on stderr)
EXIT_INVALID = 2  # the job, dataset, checkpoint or settings are wrong (one message on stderr)
EXIT_STORE_UNAVAILABLE = 3  # zoo or checkpoint store unreachable after retries; rerun continues
# SIGTERM/SIGINT: the trainer checkpoints at the next step and exits 128 + signal (143, 130);
# a process that died of the signal itself reports minus the signal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
INTERRUPTED_EXIT_CODES = frozenset({128 + s for s in STOP_SIGNALS} | {-s for s in STOP_SIGNALS})
STOPPED_PREFIX = "stopped on request"  # the Info message of a run stopped by a signal


# ----------------------------------------------------------------------------------------------
# Events: one JSON object per stdout line, ``{"event": KIND, ...fields}``, the result last.
# Non-finite numbers (a diverged loss) are written as null, so every line is strict JSON.

EVENT_KEY = "event"


@dataclasses.dataclass(frozen=True)
class Progress:
    """After every evaluation, and at most every few seconds in between.

    Attributes:
        epoch: the 1-based epoch in progress (equal to `epochs` at the end).
        epochs: the epoch budget.
        step: optimizer steps so far, across restarts.
        steps_per_epoch: optimizer steps in one epoch.
        train_loss: recent mean training loss; None until known.
        validation_accuracy: last validation accuracy in [0, 1]; None until evaluated.
        validation_loss: last mean validation loss in nats; None until evaluated.
        samples_per_second: recent training throughput; None until known.
        eta_seconds: estimated seconds to the end of the budget; None until known.
        elapsed_seconds: training clock so far.
        frozen_modules: front modules frozen now (None: freezing off).
        modules: natural blocks of the model (None: freezing off).
        evaluated: True on the event an evaluation sends (its validation numbers are new);
            False on the ones in between.
    """

    KIND: ClassVar[str] = "progress"

    epoch: int
    epochs: int
    step: int
    steps_per_epoch: int
    train_loss: float | None
    validation_accuracy: float | None
    validation_loss: float | None
    samples_per_second: float | None
    eta_seconds: float | None
    elapsed_seconds: float
    frozen_modules: int | None = None
    modules: int | None = None
    evaluated: bool = False

    def to_json(self) -> dict[str, Any]:
        """The fields, JSON-ready (no kind key; non-finite numbers as None)."""
        return _to_json(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Progress:
        """Read back `to_json` (unknown keys ignored); ValueError names missing fields."""
        return _from_json(cls, doc)


@dataclasses.dataclass(frozen=True)
class Info:
    """One sentence a person should see (resumed, target reached, registered, stopped).

    Attributes:
        message: the sentence.
        warm_start_decision: on the info that says which warm start the run applied, that
            decision (by field name); a sweep's driver learns from it what the trial inherited
            before its first evaluation. None on every other info.
    """

    KIND: ClassVar[str] = "info"

    message: str
    warm_start_decision: api.WarmStartDecision | None = None

    def to_json(self) -> dict[str, Any]:
        """The fields, JSON-ready (no kind key; non-finite numbers as None)."""
        return _to_json(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Info:
        """Read back `to_json` (unknown keys ignored); ValueError names missing fields."""
        return _from_json(cls, doc)


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of a training run: the last stdout line, once, and the termination message.

    Attributes:
        metric_name: the target metric, or validation_accuracy without a target.
        metric: its final value.
        validation_accuracy: final validation accuracy in [0, 1] (token accuracy for LMs).
        validation_loss: final mean validation cross-entropy in nats.
        wall_seconds: training clock of all runs (checkpoint and zoo I/O excluded).
        time_to_target_seconds: training clock when the target was first met; None if never.
        target_reached: whether the final or any earlier evaluation met the target.
        epochs_run: epochs completed, across restarts.
        steps: optimizer steps, across restarts.
        samples_per_second: mean training throughput (training steps only).
        zoo_model: the registered zoo id, or None.
        resumed_from_epoch: epochs already done when this process resumed; 0 if fresh.
        parent: the zoo model the run warm-started from, or None (cold start).
        similarity: architectural similarity to that parent (or the best match) in [0, 1].
        warm_start: one sentence: which parent and how much transferred, or why cold.
        freezing: the freezer's summary (frozen modules, boundary ``events``, mean skipped
            backward-FLOPs share, estimated saved seconds, reference CPU seconds); None when
            freezing was off.
        warm_start_decision: the warm-start decision the run applied (by field name), the
            probe guard's scores included (None when not probed); the operator records it in
            status.warmStart when the trainer made or probed it. None if unknown.
    """

    KIND: ClassVar[str] = "result"

    metric_name: str
    metric: float | None
    validation_accuracy: float | None
    validation_loss: float | None
    wall_seconds: float
    time_to_target_seconds: float | None
    target_reached: bool
    epochs_run: int
    steps: int
    samples_per_second: float | None
    zoo_model: str | None
    resumed_from_epoch: int
    parent: str | None = None
    similarity: float | None = None
    warm_start: str = ""
    freezing: dict[str, Any] | None = None
    warm_start_decision: api.WarmStartDecision | None = None

    def to_json(self) -> dict[str, Any]:
        """The fields, JSON-ready (no kind key; non-finite numbers as None)."""
        return _to_json(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Result:
        """Read back `to_json` (unknown keys ignored); ValueError names missing fields."""
        return _from_json(cls, doc)


@dataclasses.dataclass(frozen=True)
class Failure:
    """A permanent failure: written to the termination log only (stdout gets no result).

    Under torchrun the message starts ``rank R of W: `` (the first rank to fail wins).
    """

    KIND: ClassVar[str] = "error"

    message: str

    def to_json(self) -> dict[str, Any]:
        """The fields, JSON-ready (no kind key; non-finite numbers as None)."""
        return _to_json(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Failure:
        """Read back `to_json` (unknown keys ignored); ValueError names missing fields."""
        return _from_json(cls, doc)


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the profiling step (`Flag.PROFILE`) measured of a job's model in its own image.

    Written once to stdout and as the termination message; the operator records it in
    status.profile and status.warmStart before placement, `kiln run` in its profile cache.

    Attributes:
        parameters: the model's parameter count.
        flops_per_sample: forward FLOPs of one sample (`torch.utils.flop_counter`); None when
            they cannot be counted.
        graph_nodes: nodes of the architecture graph; None when no tracer could trace it.
        untraceable: why no tracer could (torch.fx, Hugging Face's tracer, torch.export); None
            when traced.
        device: where the step was timed: "cpu" or "cuda:<GPU name>".
        batch_size: the global batch the step was timed at (the job's).
        step_seconds: seconds of one timed optimizer step at `batch_size` on one device; None
            unless `step_status` is "ok".
        step_status: "ok" or "oom" (the batch does not fit one device); a step that raises
            anything else fails the profiling step as invalid input (the model's problem).
        step_detail: why, for statuses other than "ok".
        warm_start_decision: the warm-start decision (by field name); the trainer launched
            later applies it unchanged.
        zoo_key: the zoo object holding the full profile (graph included), or None (no zoo).
    """

    KIND: ClassVar[str] = "profile"

    parameters: int
    flops_per_sample: float | None
    graph_nodes: int | None
    untraceable: str | None
    device: str
    batch_size: int
    step_seconds: float | None
    step_status: str
    step_detail: str = ""
    warm_start_decision: api.WarmStartDecision | None = None
    zoo_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The fields, JSON-ready (no kind key; non-finite numbers as None)."""
        return _to_json(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Profile:
        """Read back `to_json` (unknown keys ignored); ValueError names missing fields."""
        return _from_json(cls, doc)


Event = Progress | Info | Result | Failure | Profile
_KINDS: dict[str, type[Event]] = {
    cls.KIND: cls for cls in (Progress, Info, Result, Failure, Profile)}


def _strict_fields(cls: type[Event]) -> dict[str, pydantic.TypeAdapter[Any]]:
    """A strict validator per field of `cls` (an int is a float; nothing else converts)."""
    hints = typing.get_type_hints(cls)
    strict = pydantic.ConfigDict(strict=True)
    return {f.name: pydantic.TypeAdapter(hints[f.name], config=strict)
            for f in dataclasses.fields(cls)}


_FIELD_TYPES = {cls: _strict_fields(cls) for cls in _KINDS.values()}


def to_line(event: Event) -> str:
    """The event as one strict JSON line (no newline)."""
    return json.dumps({EVENT_KEY: event.KIND, **event.to_json()}, allow_nan=False)


def from_line(line: str) -> Event | None:
    """The event on one stdout line; None for anything else (stray output, an unknown kind).

    Raises:
        ValueError: a known kind with missing fields.
    """
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        doc = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    kind = _KINDS.get(str(doc.get(EVENT_KEY))) if isinstance(doc, dict) else None
    return kind.from_json(doc) if kind is not None else None


# ----------------------------------------------------------------------------------------------
# Live progress: Prometheus metrics on the metrics port, each labelled job and namespace.

METRIC_PREFIX = "kiln_trainer_"


class Metric(enum.StrEnum):
    """The trainer's metrics the operator reads, named METRIC_PREFIX + value.

    A counter's sample adds ``_total`` (``kiln_trainer_steps_total``).
    """

    EPOCH = "epoch"  # epochs completed
    STEPS = "steps"  # counter: optimizer steps, across restarts
    TRAIN_LOSS = "train_loss"  # mean training loss since the previous report
    VALIDATION_ACCURACY = "validation_accuracy_ratio"  # in [0, 1]
    VALIDATION_LOSS = "validation_loss"  # mean validation cross-entropy in nats
    SAMPLES_PER_SECOND = "samples_per_second"  # training throughput
    ETA = "eta_seconds"  # estimated seconds left for the remaining epochs
    FROZEN_MODULES = "frozen_modules"  # front modules frozen now
    COMPUTE = "compute_ratio"  # share of the full model's per-step compute still done, (0, 1]
    # Info-style (always 1): the warm start the trainer applied, labels outcome, parent, reason.
    WARM_START = "warm_start_info"
    PROBE_LOSS = "warm_start_probe_loss"  # the started model's loss on the guard's probe batch
    COLD_PROBE_LOSS = "warm_start_cold_probe_loss"  # a cold-initialised model's probe loss
    PROBE_ACCURACY = "warm_start_probe_accuracy_ratio"  # the started model's probe accuracy
    COLD_PROBE_ACCURACY = "warm_start_cold_probe_accuracy_ratio"  # a cold model's


# ----------------------------------------------------------------------------------------------
# The termination message: Kubernetes shows the file at the pod's terminationMessagePath in the
# container's status, and keeps at most 4096 bytes of it. The trainer writes its Result there
# (or a Failure); the operator reads it back with `read_termination_message`.

TERMINATION_LOG_PATH = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
TERMINATION_MESSAGE_MAX_BYTES = 4000  # under Kubernetes' 4096, clear of the edge


def termination_message(event: Result | Failure | Profile) -> bytes:
    """The termination log's content for `event`: one whole JSON line of at most
    TERMINATION_MESSAGE_MAX_BYTES, so `read_termination_message` always reads it back.

    What does not fit goes a whole part at a time, never cut mid-JSON (texts at a character,
    marked "..."). A failure's message is shortened. A profile's free texts are shortened,
    then its decision's reason. A result drops its freezing history, then the freezing
    summary, shortens its warm-start sentence, then the decision's reason, drops the decision,
    and at last keeps only its required fields, so `zoo_model`, `metric_name`, `metric` and
    `target_reached` always survive. The full event is the trainer's last stdout line.
    """
    for candidate in _smaller_versions(event):
        data = to_line(candidate).encode("utf-8")
        if len(data) <= TERMINATION_MESSAGE_MAX_BYTES:
            return data
    # Only names or ids of kilobytes get here (zoo ids are at most 128 characters).
    return to_line(Failure(f"the trainer's {event.KIND} does not fit the termination message "
                           "even without its optional fields; its last stdout line holds it")
                   ).encode("utf-8")


def read_termination_message(text: str) -> Result | Failure | Profile | None:
    """The trainer's Result, Failure or Profile in a termination message; None for anything
    else (empty, cut off, or the log tail Kubernetes falls back to)."""
    try:
        event = from_line(text)
    except ValueError:
        return None
    return event if isinstance(event, Result | Failure | Profile) else None


# ----------------------------------------------------------------------------------------------
# helpers


def _to_json(event: Event) -> dict[str, Any]:
    return {f.name: _finite(getattr(event, f.name)) for f in dataclasses.fields(event)}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, pydantic.BaseModel):
        return {k: _finite(v) for k, v in value.model_dump(mode="json").items()}
    return value


_E = TypeVar("_E", Progress, Info, Result, Failure, Profile)


def _from_json(cls: type[_E], doc: Mapping[str, Any]) -> _E:
    """`cls` from its JSON fields (the kind key and unknown keys are ignored).

    Each field must have its declared JSON type: the events come from user code too, and a
    number written as a string must fail here, naming the field, not later in a reader.
    """
    fields = dataclasses.fields(cls)
    missing = [f.name for f in fields if f.name not in doc
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{cls.KIND} event without {', '.join(missing)}")
    values = {}
    for name, adapter in _FIELD_TYPES[cls].items():
        if name not in doc:
            continue
        try:
            values[name] = adapter.validate_python(doc[name])
        except pydantic.ValidationError as exc:
            raise _wrong_field(cls.KIND, name, exc) from None
    return cls(**values)


def _wrong_field(kind: str, name: str, exc: pydantic.ValidationError) -> ValueError:
    """The error for field `name` of a `kind` event: its path (into a nested model), what is
    wrong, and the value."""
    first = exc.errors(include_url=False)[0]
    where = ".".join([name, *map(str, first["loc"])])
    shown = repr(first["input"])
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    what = first["msg"][:1].lower() + first["msg"][1:]
    return ValueError(f"{kind} event field {where!r}: {what}; got "
                      f"{type(first['input']).__name__} {shown}")



def _smaller_versions(event: Result | Failure | Profile) -> Iterator[Event]:
    """`event`, then ever smaller versions of it, in the order `termination_message` gives."""
    if isinstance(event, Failure):
        yield _shortened(event.message, Failure)
    elif isinstance(event, Profile):
        yield from _smaller_profiles(event)
    else:
        yield from _smaller_results(event)


def _smaller_results(result: Result) -> Iterator[Result]:
    yield result
    if isinstance(result.freezing, dict) and "events" in result.freezing:
        result = dataclasses.replace(
            result, freezing={k: v for k, v in result.freezing.items() if k != "events"})
        yield result
    result = dataclasses.replace(result, freezing=None)
    yield result
    result = _shortened(result.warm_start, _setting(result, "warm_start"))
    yield result
    result = _with_shorter_reason(result)
    yield result
    result = dataclasses.replace(result, warm_start_decision=None)
    yield result
    yield Result(**{f.name: getattr(result, f.name) for f in dataclasses.fields(Result)
                    if f.default is dataclasses.MISSING})


def _smaller_profiles(profile: Profile) -> Iterator[Profile]:
    # Their usual lengths first: enough to say why, short enough for a condition message.
    profile = dataclasses.replace(
        profile, untraceable=None if profile.untraceable is None else profile.untraceable[:800],
        step_detail=profile.step_detail[:500])
    yield profile
    if profile.untraceable is not None:
        profile = _shortened(profile.untraceable, _setting(profile, "untraceable"))
        yield profile
    profile = _shortened(profile.step_detail, _setting(profile, "step_detail"))
    yield profile
    yield _with_shorter_reason(profile)


_R = TypeVar("_R", Result, Profile)


def _with_shorter_reason(event: _R) -> _R:
    """`event` with its warm-start decision's reason shortened to fit (if it has one)."""
    decision = event.warm_start_decision
    if decision is None:
        return event
    return _shortened(decision.reason, lambda text: dataclasses.replace(
        event, warm_start_decision=decision.model_copy(update={"reason": text})))


def _setting(event: _E, field: str) -> Callable[[str], _E]:
    """Builds `event` with the text field `field` replaced."""
    def build(text: str) -> _E:
        changes: dict[str, Any] = {field: text}
        return dataclasses.replace(event, **changes)

    return build


def _shortened(text: str, build: Callable[[str], _E]) -> _E:
    """`build(text)` if its line fits the termination message, else `build` with the longest
    prefix of `text` (marked "...") that fits, else ``build("")``."""
    def fits(event: _E) -> bool:
        return len(to_line(event).encode("utf-8")) <= TERMINATION_MESSAGE_MAX_BYTES

    whole = build(text)
    if fits(whole):
        return whole
    low, high = 0, len(text)  # longer prefixes never encode shorter: bisect the longest
    while low < high:
        middle = (low + high + 1) // 2
        if fits(build(text[:middle] + "...")):
            low = middle
        else:
            high = middle - 1
    return build(text[:low] + "..." if low else "")

