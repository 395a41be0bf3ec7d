"""Training checkpoints: a plain dict keyed by the constants below, kept in an object store.

A checkpoint holds everything a restarted trainer needs to continue as if never stopped, at a
global position, so one written under any parallelism and world size resumes under any other.
Under FSDP each rank writes its own model and optimizer shards beside it (`save_shards`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import pickle
import random
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from kiln import api
from kiln.zoo import presigned, records
from kiln.zoo import store as zoo_store
from kiln_trainer import optim, precision, tracking
from kiln_trainer.distributed import parallel
from kiln_trainer.freezing import controller as freezing

if TYPE_CHECKING:  # imported where used: DCP takes seconds to import
    from kiln_trainer.distributed import shardstore

_log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # of a sharded checkpoint; a full one is still written as 1 (older readers)
READ_VERSIONS = (1, 2)

FORMAT_KEY = "format_version"  # int: FORMAT_VERSION of the writer
MODEL_KEY = "model"  # the unwrapped model's state_dict
OPTIMIZER_KEY = "optimizer"  # optimizer.state_dict()
OPTIMIZER_NAME_KEY = "optimizer_name"  # spec.training.optimizer.name that produced its state
SCHEDULER_KEY = "scheduler"  # lr scheduler state_dict (LambdaLR: step counter and base lrs)
RNG_KEY = "rng"  # rng_state()
EPOCH_KEY = "epoch"  # epochs completed
EPOCH_BATCH_KEY = "epoch_batch"  # optimizer steps of the next epoch already taken (0 at its end)
STEP_KEY = "step"  # optimizer steps completed
SAMPLES_KEY = "samples"  # training samples consumed
TRAIN_SECONDS_KEY = "train_seconds"  # seconds spent in training steps (throughput)
ELAPSED_KEY = "elapsed_seconds"  # training clock: wall seconds of all runs, checkpoint I/O excluded
TTT_KEY = "time_to_target_seconds"  # float, or None while the target has not been reached
HISTORY_KEY = "history"  # list of evaluation dicts (epoch, step, elapsed_seconds, metrics)
SPEC_KEY = "spec"  # api.to_wire(job.spec) of the run that wrote the checkpoint
WARM_START_KEY = "warm_start"  # dict: the warm start applied (api.WarmStartDecision)
ZOO_RECORD_KEY = "zoo_record_id"  # str | None: the job's provisional zoo record
MLFLOW_RUN_KEY = "mlflow_run_id"  # str | None: the job's MLflow run (absent: none)
PARALLELISM_KEY = "parallelism"  # "single" | "ddp" | "fsdp" of the writer (absent: single)
WORLD_SIZE_KEY = "world_size"  # processes of the writer (absent: 1)
RANK_RNG_KEY = "rank_rng"  # list of every rank's rng_state(), by rank (absent: RNG_KEY only)
USER_KEY = "user"  # dict: an own loop's own values (`JobContext.checkpoint`'s extra)
# dict {"slot": "a" | "b", "ranks": W, "save": id}: model and optimizer are in the per-rank shard
# objects of that slot (`records.checkpoint_shard_key`), not under MODEL_KEY / OPTIMIZER_KEY
SHARDS_KEY = "shards"
# and precision.CHECKPOINT_KEY (the fp16 gradient scaler), freezing.CHECKPOINT_KEY (the Freezer)

DEFAULT_DIR = Path(".kiln") / "checkpoints"
FILE_NAME = "checkpoint.pt"

# Spec sections whose changes alter the training run (the rest: zoo, runPolicy, template...).
_COMPARED_SECTIONS = ("model", "dataset", "training")


class CheckpointError(ValueError):
    """A checkpoint exists but cannot be used; the message names it and the fix."""


@dataclasses.dataclass(frozen=True)
class Location:
    """Where one job's checkpoint lives.

    Attributes:
        store: the object store (the zoo's, or a DirStore on a checkpoint directory).
        key: the object key inside it.
    """

    store: zoo_store.ObjectStore
    key: str

    def describe(self) -> str:
        """Human text naming store and key, for messages."""
        return f"{self.key} in {self.store.describe()}"


def locate(
    job: api.TrainingJob,
    *,
    checkpoint_dir: str | Path | None,
    zoo: zoo_store.ObjectStore | None,
) -> Location:
    """Where `job`'s checkpoint lives: the checkpoint directory, else the zoo, else ./.kiln.

    ``<namespace or 'default'>/<job-name>/<uid>/checkpoint.pt`` under the directory (or
    ``DEFAULT_DIR``), ``checkpoints/<same>`` in the zoo store (`records.checkpoint_key`). A
    job of the operator has a uid, so one created again under its name starts afresh; a job
    of `kiln run` has none (``<namespace>/<job-name>/checkpoint.pt``): a rerun of the same
    file resumes it.

    Args:
        job: the job; its namespace (or "default"), name and uid make the key.
        checkpoint_dir: an explicit directory (wins over the zoo), or None.
        zoo: the zoo store, or None when the job runs without a zoo.
    """
    key = records.checkpoint_key(job.metadata.namespace or "default", job.name,
                                 job.metadata.uid)
    relative = key.removeprefix(records.CHECKPOINTS_PREFIX)
    if checkpoint_dir is not None:
        return Location(zoo_store.DirStore(Path(checkpoint_dir)), relative)
    if zoo is not None:
        return Location(zoo, f"checkpoints/{relative}")
    return Location(zoo_store.DirStore(DEFAULT_DIR), relative)


def save_checkpoint(location: Location, state: dict[str, Any]) -> int:
    """Write `state` (a dict keyed by the *_KEY constants) as one object.

    One `put_bytes` of `torch.save`'s bytes: atomic in `DirStore` (temp file + rename), a single
    PUT in S3, so a reader never sees half a checkpoint. A sharded `state` (`SHARDS_KEY`) goes
    after every rank's `save_shards` has returned: it is what makes the new shards current.

    Returns:
        The checkpoint's size in bytes.

    Raises:
        zoo_store.StoreUnavailable: the store could not be written (after its retries).
    """
    buffer = io.BytesIO()
    version = FORMAT_VERSION if SHARDS_KEY in state else 1
    torch.save({FORMAT_KEY: version, **state}, buffer)
    data = buffer.getvalue()
    location.store.put_bytes(location.key, data)
    return len(data)


def load_checkpoint(
    location: Location, *, map_location: str | torch.device = "cpu"
) -> dict[str, Any] | None:
    """Read the checkpoint at `location`, or None when there is none.

    Raises:
        CheckpointError: the object is not a checkpoint this trainer can read.
        zoo_store.StoreUnavailable: the store could not be read (after its retries).
    """
    try:
        data = location.store.get_bytes(location.key)
    except zoo_store.ObjectNotFound:
        return None
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:200]  # torch's text runs long
        raise CheckpointError(
            f"checkpoint {location.describe()} is unreadable ({type(exc).__name__}: {reason}); "
            "delete it to train from scratch"
        ) from exc
    if not isinstance(state, dict) or state.get(FORMAT_KEY) not in READ_VERSIONS:
        found = state.get(FORMAT_KEY) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"checkpoint {location.describe()} has format {found!r}, this trainer reads "
            f"{' and '.join(map(str, READ_VERSIONS))}; delete it to train from scratch"
        )
    shards = state.get(SHARDS_KEY)
    if SHARDS_KEY in state and not (
            isinstance(shards, dict) and shards.get("slot") in records.CHECKPOINT_SLOTS
            and isinstance(shards.get("save"), str) and type(shards.get("ranks")) is int
            and shards["ranks"] > 0):
        raise CheckpointError(
            f"checkpoint {location.describe()} names its shards as {shards!r}, not a slot "
            f"({' or '.join(records.CHECKPOINT_SLOTS)}), a save id and a number of ranks; "
            "delete it to train from scratch")
    return state


def delete_checkpoint(location: Location) -> None:
    """Remove the checkpoint (a finished job needs none) with the shard objects of both slots,
    whichever world size wrote them (found by listing); missing is fine.

    The main object goes first, so no reader meets a checkpoint whose shards are half gone.
    """
    if location.store.exists(location.key):
        location.store.delete(location.key)
    for key in location.store.list_keys(f"{location.key}.shards/"):
        location.store.delete(key)


def _delete_slot(location: Location, slot: str) -> None:
    """Delete every object of one slot, listed (not derived from a rank count that a resize or
    damaged metadata could make wrong); the metadata last."""
    meta_key = records.checkpoint_shard_key(location.key, slot, None)
    prefix = meta_key.removesuffix(records.SHARDS_METADATA_NAME)
    for key in location.store.list_keys(prefix):
        if key != meta_key:
            location.store.delete(key)
    location.store.delete(meta_key)


def open_location(
    location: Location,
    *,
    fallback: Location | None,
    resume: bool,
    map_location: str | torch.device = "cpu",
) -> tuple[Location, dict[str, Any] | None]:
    """Where this run keeps its checkpoint, and the checkpoint to resume from (None: afresh).

    Without a `fallback` that is `location` and its checkpoint (with `resume`). With one (the
    zoo would hold checkpoints, but the run needs no zoo to start), a checkpoint found at
    `fallback` wins without contacting the zoo: it was written while the zoo was unreachable
    and is newer than any there. Else `location` is read (or, without `resume`, probed), and
    when its store is unavailable the run checkpoints to `fallback` instead, with a warning.

    Raises:
        CheckpointError: the checkpoint is not one this trainer can read.
        zoo_store.StoreUnavailable: `location`'s store failed and there is no `fallback`.
    """
    if fallback is not None and fallback.store.exists(fallback.key):
        _log.warning("checkpointing to %s, where a run left one while the zoo was unreachable",
                     fallback.describe())
        return fallback, load_checkpoint(fallback, map_location=map_location) if resume else None
    try:
        if not resume:  # nothing to read, but fail over now rather than at the first save
            location.store.exists(location.key)
            return location, None
        return location, load_checkpoint(location, map_location=map_location)
    except zoo_store.StoreUnavailable as exc:
        if fallback is None:
            raise
        _log.warning("%s; checkpointing to %s instead (a rerun on this machine resumes from it, "
                     "one elsewhere cannot)", exc, fallback.describe())
        return fallback, None


# ----------------------------------------------------------------------------------------------
# RNG states as checkpoint-safe values: tensors and plain Python values only, so a checkpoint
# holding them loads with ``torch.load(weights_only=True)`` (NumPy's key array travels as an
# int64 tensor)


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values (loadable with weights_only=True)."""
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": random.getstate(),
        "numpy": [torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                  float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned; CUDA states only when the device count matches."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


def spec_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Fields of the model, dataset and training sections that differ, one line each.

    Args:
        saved: the checkpoint's SPEC_KEY (wire form of the spec that wrote it).
        current: api.to_wire(job.spec) of the job now running.

    Returns:
        Lines like ``spec.training.optimizer.lr: checkpoint 0.1, job 0.05``.
    """
    lines: list[str] = []
    for section in _COMPARED_SECTIONS:
        _diff(saved.get(section), current.get(section), f"spec.{section}", lines)
    return lines


def _diff(old: Any, new: Any, path: str, lines: list[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            _diff(old.get(key), new.get(key), f"{path}.{key}", lines)
    elif old != new:
        lines.append(f"{path}: checkpoint {old!r}, job {new!r}")


# ----------------------------------------------------------------------------------------------
# what a run (Kiln's loop or an own one, `kiln_trainer.jobcontext`) keeps in a checkpoint


def capture(
    state: tracking.RunState,
    clock: tracking.Clock,
    job: api.TrainingJob,
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    *,
    ctx: parallel.Context | None = None,
    wrapped: nn.Module | None = None,
    optimizer_name: str | None = None,
    amp: precision.MixedPrecision | None = None,
    freezer: freezing.Freezer | None = None,
    user: Mapping[str, Any] | None = None,
    sharded: bool | None = None,
    previous: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The checkpoint dict for the current position: the one builder, so every checkpoint,
    whichever loop wrote it, holds the same keys.

    Model and optimizer state are gathered full and unsharded, under a single process's keys,
    or, `sharded`, left to `save_shards` (`SHARDS_KEY` names the slot it writes: the one
    `previous` does not use); every rank's RNG state is kept (`RANK_RNG_KEY`).

    Args:
        state: the run's position and history.
        clock: the training clock (elapsed seconds).
        job: the running job (its spec goes in).
        raw_model: the unwrapped model.
        optimizer: its state goes in, full.
        scheduler: its state goes in.
        ctx: the parallel context; with W > 1 this call is collective (every rank makes it)
            and only rank 0's result is complete: save that one only.
        wrapped: the DDP/FSDP wrapper of `raw_model` (FSDP gathers through it); default
            `raw_model`.
        optimizer_name: what built `optimizer`; default the job's ``spec.training.optimizer``.
        amp: the mixed precision whose gradient scaler is kept (fp16), or None.
        freezer: the layer freezing whose state is kept, or None.
        user: an own loop's own values.
        sharded: model and optimizer go in shards (`save_shards`, every rank); default: under
            FSDP with W > 1 (`is_sharded`).
        previous: the checkpoint this run last wrote or resumed from, if any (its slot stays
            intact until the new main object replaces it).
    """
    ctx = ctx or parallel.Context()
    wrapped = raw_model if wrapped is None else wrapped
    rngs = ctx.gather_objects(rng_state())
    if is_sharded(ctx) if sharded is None else sharded:
        # one id on every rank: each object of this save carries it (`shardstore.Layout`)
        tensors: dict[str, Any] = {SHARDS_KEY: {
            "slot": _next_slot(previous), "ranks": ctx.world_size,
            "save": ctx.broadcast_object(secrets.token_hex(8))}}
    else:
        tensors = {MODEL_KEY: ctx.full_state_dict(wrapped, raw_model),
                   OPTIMIZER_KEY: ctx.full_optimizer_state_dict(wrapped, optimizer)}
    return {
        **tensors,
        OPTIMIZER_NAME_KEY: optimizer_name or job.spec.training.optimizer.name.value,
        SCHEDULER_KEY: scheduler.state_dict() if scheduler is not None else None,
        RNG_KEY: rngs[0],
        RANK_RNG_KEY: rngs,
        PARALLELISM_KEY: ctx.parallelism,
        WORLD_SIZE_KEY: ctx.world_size,
        EPOCH_KEY: state.epochs_done,
        EPOCH_BATCH_KEY: state.epoch_batch,
        STEP_KEY: state.step,
        SAMPLES_KEY: state.samples,
        TRAIN_SECONDS_KEY: state.train_seconds,
        ELAPSED_KEY: clock.seconds(),
        TTT_KEY: state.time_to_target_seconds,
        HISTORY_KEY: state.history,
        SPEC_KEY: api.to_wire(job.spec),
        WARM_START_KEY: state.warm_start,
        ZOO_RECORD_KEY: state.zoo_record_id,
        MLFLOW_RUN_KEY: state.mlflow_run_id,
        precision.CHECKPOINT_KEY: amp.state_dict() if amp is not None else {},
        freezing.CHECKPOINT_KEY: freezer.state_dict() if freezer is not None else None,
        USER_KEY: dict(user or {}),
    }


def is_sharded(ctx: parallel.Context) -> bool:
    """Whether this run's checkpoints are sharded: FSDP with W > 1 (gathering would not scale)."""
    return ctx.parallelism == "fsdp" and ctx.distributed


def _next_slot(previous: Mapping[str, Any] | None) -> str:
    used = ((previous or {}).get(SHARDS_KEY) or {}).get("slot")
    return records.CHECKPOINT_SLOTS[1] if used == records.CHECKPOINT_SLOTS[0] else (
        records.CHECKPOINT_SLOTS[0])


def _layout(location: Location, shards: Mapping[str, Any]) -> shardstore.Layout:
    from kiln_trainer.distributed import shardstore  # DCP takes seconds to import
    slot = str(shards["slot"])
    return shardstore.Layout(
        location.store,
        shard_key=lambda rank: records.checkpoint_shard_key(location.key, slot, rank),
        metadata_key=records.checkpoint_shard_key(location.key, slot, None),
        save_id=str(shards["save"]))


def save_shards(
    location: Location,
    state: Mapping[str, Any],
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    wrapped: nn.Module | None = None,
) -> int:
    """Write this rank's model and optimizer shards into the slot `state` names; collective.

    Every rank calls it, with `state` from `capture(sharded=...)`, before rank 0's
    `save_checkpoint(location, state)` (and a barrier between): the main object, written
    last, makes the shards current. Tensors go in one safetensors object per rank, DCP's
    metadata as JSON (`kiln_trainer.distributed.shardstore`).

    Returns:
        The bytes of this rank's object.

    Raises:
        zoo_store.StoreUnavailable: the store could not be written.
        zoo_store.StoreMisconfigured: it refused the write (a presigned pod: no grant for
            this rank's object).
    """
    from torch.distributed.checkpoint import state_dict as dcp_state

    from kiln_trainer.distributed import shardstore
    model_state, optimizer_state = dcp_state.get_state_dict(
        raw_model if wrapped is None else wrapped, optimizer)
    try:
        return shardstore.save({"model": model_state, "optimizer": optimizer_state},
                               _layout(location, state[SHARDS_KEY]))
    except presigned.NotGranted as exc:
        raise _not_granted(exc, state[SHARDS_KEY]["ranks"],
                           "run the job with at most that many processes") from exc


def _not_granted(exc: presigned.NotGranted, ranks: int, fix: str) -> presigned.NotGranted:
    return presigned.NotGranted(
        f"{exc}. A sharded checkpoint has one object per rank (this one: {ranks}); the "
        "operator grants a pod those of ranks below its job's spec.resources.gpus, or, with "
        f"gpus unset, below its --max-gpus-per-job: {fix}")


def drop_previous_shards(location: Location, previous: Mapping[str, Any] | None,
                         current: Mapping[str, Any]) -> None:
    """Delete `previous`'s slot once `current`'s main object is written (rank 0 alone)."""
    old, new = (previous or {}).get(SHARDS_KEY), current.get(SHARDS_KEY) or {}
    if old and old.get("slot") != new.get("slot"):
        _delete_slot(location, str(old["slot"]))


def restore_shards(
    saved: dict[str, Any],
    location: Location,
    job: api.TrainingJob,
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    wrapped: nn.Module | None = None,
    optimizer_name: str | None = None,
) -> None:
    """Load a sharded checkpoint's model and optimizer state (one read of the shards).

    Call on every rank between `restore_model` and `restore_training` (which leave them to
    this call), with `wrapped` under FSDP; any world size and parallelism reads it, as DCP
    reshards to the model's current layout. Nothing happens for a full checkpoint.

    Raises:
        CheckpointError: a shard or the metadata is missing or damaged.
        zoo_store.StoreUnavailable: the store could not be read.
        zoo_store.StoreMisconfigured: it refused a read (a presigned pod: no grant for a
            rank's object, when the checkpoint has more ranks than the pod's grants).
    """
    if SHARDS_KEY not in saved:
        return
    from torch.distributed.checkpoint import state_dict as dcp_state

    from kiln_trainer.distributed import shardstore
    module = raw_model if wrapped is None else wrapped
    with_optimizer = _same_optimizer(saved, job, optimizer_name)
    if with_optimizer:
        model_state, optimizer_state = dcp_state.get_state_dict(module, optimizer)
        target: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    else:
        target = {"model": dcp_state.get_model_state_dict(module)}
    try:
        shardstore.load(target, _layout(location, saved[SHARDS_KEY]))
    except presigned.NotGranted as exc:  # not the checkpoint's fault: keep it
        ranks = saved[SHARDS_KEY]["ranks"]
        raise _not_granted(exc, ranks, f"raise that cap to at least {ranks}, or delete the "
                           f"checkpoint {location.describe()} to train from scratch") from exc
    except (zoo_store.StoreUnavailable, zoo_store.StoreMisconfigured):
        raise
    except (shardstore.ShardsUnreadable, RuntimeError, KeyError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(f"checkpoint {location.describe()}: its shards do not load "
                              f"({reason}); delete it to train from scratch") from exc
    if with_optimizer:
        dcp_state.set_state_dict(module, optimizer, model_state_dict=target["model"],
                                 optim_state_dict=target["optimizer"])
    else:
        dcp_state.set_model_state_dict(module, target["model"])


def _same_optimizer(saved: Mapping[str, Any], job: api.TrainingJob,
                    optimizer_name: str | None) -> bool:
    return bool(saved[OPTIMIZER_NAME_KEY] == (optimizer_name
                                              or job.spec.training.optimizer.name.value))


def restore(
    saved: dict[str, Any],
    job: api.TrainingJob,
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    *,
    location: Location | None = None,
) -> tracking.RunState:
    """Load a checkpoint into model, optimizer, schedule and RNGs; return the run position.

    One process: `restore_model`, `restore_shards` (a sharded checkpoint, read from
    `location`), then `restore_training`. Changed model, dataset or training settings are
    logged as warnings; the job's values win from the next step on (weights and optimizer
    moments come from the checkpoint).

    Raises:
        CheckpointError: the checkpoint was written for a different model, or its shards do
            not load.
        ValueError: a sharded checkpoint without `location`.
    """
    restore_model(saved, job, raw_model)
    if SHARDS_KEY in saved:
        if location is None:
            raise ValueError("a sharded checkpoint loads from its location: pass location=")
        restore_shards(saved, location, job, raw_model, optimizer)
    return restore_training(saved, job, optimizer, scheduler)


def restore_model(
    saved: dict[str, Any],
    job: api.TrainingJob,
    raw_model: nn.Module,
    *,
    ctx: parallel.Context | None = None,
    wrapped: nn.Module | None = None,
) -> None:
    """Check that the checkpoint fits the job's model and load its weights.

    Call on every rank, with the unwrapped model before `parallel.Context.wrap` (then DDP
    and FSDP start from these weights), or with `ctx` and an FSDP `wrapped` after it. A
    sharded checkpoint's weights come from `restore_shards` instead.

    Raises:
        CheckpointError: the checkpoint was written for a different model.
    """
    differences = spec_differences(saved[SPEC_KEY], api.to_wire(job.spec))
    model_changes = [d for d in differences if d.startswith("spec.model.")]
    if model_changes:
        raise CheckpointError(
            f"the checkpoint of job {job.name} was written for another model ("
            f"{'; '.join(model_changes)}); delete it, or give the job a new name")
    if SHARDS_KEY in saved:
        return
    ctx = ctx or parallel.Context()
    ctx.load_full_state_dict(raw_model if wrapped is None else wrapped, raw_model,
                             saved[MODEL_KEY])


def restore_training(
    saved: dict[str, Any],
    job: api.TrainingJob,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    *,
    ctx: parallel.Context | None = None,
    wrapped: nn.Module | None = None,
    optimizer_name: str | None = None,
) -> tracking.RunState:
    """Load optimizer, schedule, RNGs; return the position (global: same for every W).

    Call on every rank after `restore_model` (under FSDP with the optimizer built after
    `wrap`, and `wrapped`), and after `restore_shards` for a sharded checkpoint (whose
    optimizer state it loaded). Changed dataset or training settings and a changed
    parallelism or world size are logged; the job's values win from the next step on.

    Args:
        saved: the checkpoint.
        job: the running job.
        optimizer: receives the saved state unless the optimizer kind changed.
        scheduler: receives the saved state, if any.
        ctx: the parallel context (default: one process).
        wrapped: the FSDP-sharded model the optimizer steps (needed under FSDP only).
        optimizer_name: what built `optimizer` (as `capture` took it); default the job's
            ``spec.training.optimizer``, whose settings then win over the saved ones.

    Raises:
        ValueError: under FSDP without `wrapped`, or the optimizer's parameter groups do not
            fit the saved state.
    """
    spec, ctx = job.spec, ctx or parallel.Context()
    differences = spec_differences(saved[SPEC_KEY], api.to_wire(spec))
    for line in differences:
        if not line.startswith("spec.model."):
            _log.warning("checkpoint and job differ: %s; the job's value wins from here on",
                         line)
    writer = (saved.get(PARALLELISM_KEY, "single"), int(saved.get(WORLD_SIZE_KEY, 1)))
    if writer != (ctx.parallelism, ctx.world_size):
        _log.info("checkpoint written by %s x %d, resuming as %s x %d at the same position",
                  writer[0], writer[1], ctx.parallelism, ctx.world_size)
    name = optimizer_name or spec.training.optimizer.name.value
    if saved[OPTIMIZER_NAME_KEY] != name:
        _log.warning("optimizer changed from %s to %s: its state starts afresh",
                     saved[OPTIMIZER_NAME_KEY], name)
    elif SHARDS_KEY not in saved:  # a sharded one's came with `restore_shards`
        ctx.load_full_optimizer_state_dict(wrapped, optimizer, saved[OPTIMIZER_KEY])
    if scheduler is not None and saved.get(SCHEDULER_KEY) is not None:
        scheduler.load_state_dict(saved[SCHEDULER_KEY])
    if optimizer_name is None and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        optim.apply_job_hyperparameters(optimizer, scheduler, spec.training.optimizer)
    set_rank_rng_state(saved, rank=ctx.rank, world_size=ctx.world_size)
    return tracking.RunState(
        epochs_done=int(saved[EPOCH_KEY]),
        epoch_batch=int(saved[EPOCH_BATCH_KEY]),
        step=int(saved[STEP_KEY]),
        samples=int(saved[SAMPLES_KEY]),
        train_seconds=float(saved[TRAIN_SECONDS_KEY]),
        time_to_target_seconds=saved[TTT_KEY],
        history=list(saved[HISTORY_KEY]),
        warm_start=saved.get(WARM_START_KEY),
        zoo_record_id=saved.get(ZOO_RECORD_KEY),
        mlflow_run_id=saved.get(MLFLOW_RUN_KEY),
    )


def set_rank_rng_state(saved: dict[str, Any], *, rank: int, world_size: int) -> None:
    """Restore this rank's RNG streams from a checkpoint.

    Its own saved state when the writer had the same world size; else rank 0 takes the
    writer's rank 0 state (`RNG_KEY`) and rank r > 0 a stream seeded from a hash of that state
    and r, so ranks never repeat each other's random numbers (augmentation, dropout).
    """
    per_rank = saved.get(RANK_RNG_KEY) or []
    if len(per_rank) == world_size:
        set_rng_state(per_rank[rank])
        return
    set_rng_state(saved[RNG_KEY])
    if rank:
        digest = hashlib.sha256(saved[RNG_KEY]["torch"].numpy().tobytes()
                                + rank.to_bytes(8, "little")).digest()
        seed = int.from_bytes(digest[:8], "little") >> 1
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
