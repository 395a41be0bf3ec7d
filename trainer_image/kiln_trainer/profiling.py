"""The profiling step, ``python -m kiln_trainer --profile``: measure a job's model in its own image
(parameters, forward FLOPs, architecture graph, one device's step time) and decide warm start,
without training. It reads no data: the timed batch is synthetic. Shapes: B batch, T sequence
length, K classes, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import statistics
import time
from typing import Any

import networkx as nx
import torch
from torch import nn
from torch.utils import flop_counter

from kiln import api, contract, models
from kiln.models import checks, entrypoints
from kiln.warmstart import graph
from kiln.zoo import presigned, records
from kiln.zoo import store as zoo_store
from kiln_trainer import loop, optim, precision, runtime, warm

_log = logging.getLogger(__name__)

WARMUP_STEPS = 1  # untimed: the first step allocates optimizer state and picks kernels
TIMED_STEPS = 3  # the step time is their median


class StepStatus(enum.StrEnum):
    """How timing the training step ended (`contract.Profile.step_status`)."""

    OK = "ok"
    OOM = "oom"  # the job's batch does not fit one device


def profile(
    job: api.TrainingJob,
    *,
    zoo_uri: str | None,
    warm_decision_text: str | None = None,
    world_size: int = 1,
) -> contract.Profile:
    """Measure `job`'s model and decide its warm start, as the trainer would, then stop.

    The model is built exactly as for training. FLOPs, the graph and the step time are each
    measured on their own: a model that cannot be counted, traced or timed still gets the
    other measurements (the profile says why one is missing). With a zoo, the full profile
    (graph and whole decision included) is written to `records.profile_key`.

    Args:
        job: the validated job.
        zoo_uri: zoo store (path, file:// or s3://); None: decide cold, write nothing.
        warm_decision_text: a warm-start decision made upstream, as JSON (``--warm-start``);
            None (or one deferred to the trainer): decide here, as `warm.warm_start` would.
        world_size: processes of this run (torchrun's WORLD_SIZE); profiling takes one.

    Returns:
        The profile, `zoo_key` set when the zoo holds it.

    Raises:
        api.InvalidSpec: several processes, a job `models.check_job` refuses, a bad
            ``--warm-start``, or a pinned parent that is not in the zoo.
        models.EntrypointError: the user's model cannot be imported or built.
        runtime.ConfigError: spec.training.device is cuda but no CUDA device is visible.
        zoo_store.StoreUnavailable: the zoo could not be read.
    """
    if world_size > 1:
        raise api.InvalidSpec([(f"{contract.Flag.PROFILE}: profiling runs in one process, but "
                                f"WORLD_SIZE is {world_size}; run python -m "
                                f"{contract.TRAINER_MODULE} {contract.Flag.PROFILE} without "
                                "torchrun")])
    spec = job.spec
    problems = models.check_job(job)
    if problems:
        raise api.InvalidSpec(problems, source=f"job {job.name}")
    decided = warm.parse_decision(warm_decision_text)
    device = runtime.pick_device(spec)
    runtime.seed_everything(spec.training.seed)
    model = models.build(spec.model)
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > checks.MAX_PARAMETERS:  # the operator's limit, checked where the code lives
        raise api.InvalidSpec([(f"spec.model: {spec.model.label} has {parameters:,} parameters; "
                                f"Kiln trains at most {checks.MAX_PARAMETERS:,}; use a smaller "
                                "model (spec.model.args)")])
    flops = count_flops(model, spec.model)
    architecture, untraceable = trace(model, spec.model)
    zoo = presigned.open_zoo(zoo_uri) if zoo_uri else None
    if decided is None:
        decided = warm.decide(job, zoo)
    step_seconds, status, detail = time_step(job, model, device)
    measured = contract.Profile(
        parameters=parameters, flops_per_sample=flops,
        graph_nodes=architecture.number_of_nodes() if architecture is not None else None,
        untraceable=untraceable, device=describe_device(device),
        batch_size=spec.training.batch_size, step_seconds=step_seconds, step_status=status,
        step_detail=detail, warm_start_decision=decided)
    if zoo is None:
        return measured
    return dataclasses.replace(measured, zoo_key=write_profile(
        zoo, job, measured, architecture=architecture, decided=decided))


def count_flops(model: nn.Module, spec: api.ModelSpec) -> float | None:
    """Forward FLOPs of one sample (`torch.utils.flop_counter`), or None when uncountable.

    Counted on a copy built on the `meta` device (no memory, no arithmetic); a model that
    cannot run there (an op without a meta kernel) is counted on the CPU with a batch of one.

    Args:
        model: the built model, on the CPU (run in eval mode without gradients if need be).
        spec: the job's spec.model.
    """
    try:
        with torch.device("meta"):
            meta_model = models.build(spec)
        return _forward_flops(meta_model, models.example_batch(spec, device="meta"))
    except Exception as exc:  # noqa: BLE001  # user code may raise anything; try the CPU
        _log.info("FLOPs: the model cannot run on the meta device (%s); counting on the CPU",
                  _first_line(exc))
    try:
        return _forward_flops(model, models.example_batch(spec, device="cpu"))
    except Exception as exc:  # noqa: BLE001  # user code again: the profile says "unknown"
        _log.warning("FLOPs: cannot count them (%s); the profile leaves them out",
                     _first_line(exc))
        return None


def trace(model: nn.Module, spec: api.ModelSpec) -> tuple[nx.DiGraph | None, str | None]:
    """The architecture graph (`graph.extract`), or None and why no tracer could build it."""
    dtype = models.example_batch(spec, device="meta").dtype
    try:
        return graph.extract(model, spec.input_shape, name=spec.label, input_dtype=dtype), None
    except graph.GraphError as exc:
        _log.info("graph: %s", exc)
        return None, str(exc)


def time_step(job: api.TrainingJob, model: nn.Module,
              device: torch.device) -> tuple[float | None, StepStatus, str]:
    """Seconds of one training step at the job's global batch on `device`, as the loop takes it.

    The step is `loop.train_one_epoch`'s (the job's loss, optimizer, precision and gradient
    clipping) on a synthetic batch (`synthetic_batch`): WARMUP_STEPS untimed, then the median
    of TIMED_STEPS, each between device synchronisations. The model's weights change.

    Returns:
        (seconds, "ok", ""), or (None, "oom", the error's first line).

    Raises:
        models.EntrypointError: the step raised anything but out-of-memory: the model cannot
            train on its declared input (names the user's file and line).
    """
    training = job.spec.training
    try:
        model.to(device)
        batch = synthetic_batch(job.spec.model, model, batch_size=training.batch_size,
                                device=device, seed=training.seed)
        optimizer = optim.build_optimizer(model.parameters(), training.optimizer)
        scheduler = optim.build_schedule(optimizer, training,
                                         steps_per_epoch=WARMUP_STEPS + TIMED_STEPS)
        amp = precision.MixedPrecision(training.precision, device)
        seconds = []
        for _ in range(WARMUP_STEPS + TIMED_STEPS):
            _synchronize(device)
            began = time.perf_counter()
            loop.train_one_epoch(model, iter([batch]), optimizer=optimizer, scheduler=scheduler,
                                 device=device, grad_clip_norm=training.grad_clip_norm,
                                 max_steps=1, amp=amp)
            _synchronize(device)
            seconds.append(time.perf_counter() - began)
    except Exception as exc:  # noqa: BLE001  # the user's forward may raise anything
        if not models.out_of_memory(exc):  # the model's own problem: training would fail too
            spec = job.spec.model
            tail = entrypoints.traceback_tail(exc)
            raise models.EntrypointError(
                f"{entrypoints.MODEL_FIELD}: one training step of {spec.label} on a batch of "
                f"{training.batch_size} samples of shape {list(spec.input_shape)} raised "
                f"{type(exc).__name__}: {_first_line(exc)[:300]}"
                + (f" (at {tail})" if tail else "")
                + "; fix the model or spec.model.inputShape") from None
        _log.warning("timing a training step of batch %d on %s: %s", training.batch_size,
                     device, _first_line(exc))
        return None, StepStatus.OOM, _first_line(exc)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return statistics.median(seconds[WARMUP_STEPS:]), StepStatus.OK, ""


def synthetic_batch(spec: api.ModelSpec, model: nn.Module, *, batch_size: int,
                    device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and targets of the kinds the job's data has, on `device`.

    Images are Tensor[B, *inputShape] with class targets LongTensor[B] below K; token ids are
    LongTensor[B, T] below min(V, 256) (byte-level text), with next-token targets
    LongTensor[B, T] for a language model. K and V are the last size of the model's output for
    one sample.
    """
    example = models.example_batch(spec, batch_size=1, device=device)
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        outputs = int(model(example).shape[-1])
    model.train(was_training)
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, *example.shape[1:])
    if models.task_of(spec) is models.Task.LANGUAGE_MODELING:
        tokens = torch.randint(0, min(outputs, 256), (batch_size, shape[1] + 1),
                               generator=generator)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    if example.dtype == torch.long:  # a text classifier: any byte is a valid token
        inputs = torch.randint(0, 256, shape, generator=generator)
    else:
        inputs = torch.randn(shape, generator=generator)
    targets = torch.randint(0, outputs, (batch_size,), generator=generator)
    return inputs.to(device), targets.to(device)


def describe_device(device: torch.device) -> str:
    """"cpu", or "cuda:<GPU name>" (`contract.Profile.device`)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def write_profile(zoo: zoo_store.ObjectStore, job: api.TrainingJob, measured: contract.Profile,
                  *, architecture: nx.DiGraph | None,
                  decided: api.WarmStartDecision) -> str | None:
    """Put the full profile in the zoo as one JSON object; its key, or None if that failed.

    The object holds the Profile's fields, the job's namespace and name, the architecture
    graph (`graph.to_json`, None when untraceable) and the warm-start decision (by field
    name, what ``--warm-start`` takes). A failed write is logged, not
    raised: the Profile event carries everything but the graph.
    """
    namespace = job.metadata.namespace or "default"
    doc: dict[str, Any] = {
        **measured.to_json(), "namespace": namespace, "job": job.name,
        "graph": graph.to_json(architecture) if architecture is not None else None,
        "decision": decided.model_dump(mode="json")}
    try:
        key = records.profile_key(namespace, job.name)
        doc["zoo_key"] = key
        zoo.put_bytes(key, json.dumps(doc, allow_nan=False).encode("utf-8"))
    except (ValueError, zoo_store.StoreUnavailable) as exc:
        _log.warning("could not write the profile to %s (%s); the profile event has all but the "
                     "graph", zoo.describe(), exc)
        return None
    return key


def _forward_flops(model: nn.Module, example: torch.Tensor) -> float:
    was_training = model.training
    model.eval()  # so a CPU count leaves BatchNorm statistics alone
    try:
        with torch.no_grad(), flop_counter.FlopCounterMode(display=False) as counter:
            model(example)
    finally:
        model.train(was_training)
    return float(counter.get_total_flops())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
