"""Data-parallel execution for the trainer: one process, DDP or FSDP, under torchrun.

`setup` builds this process's `Context` from torchrun's environment; with one process every
collective of the context is the identity, so single, DDP and FSDP share one code path.
Never here: tensor/pipeline parallelism, mixed precision.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import distributed as dist
from torch import nn

from kiln_trainer import runtime

_log = logging.getLogger(__name__)

PARALLELISMS = ("single", "ddp", "fsdp")
DEVICE_KINDS = ("cpu", "cuda")

# Semantics: ``spec.training.batchSize`` is the *global* batch B. Each of the W ranks trains on
# its contiguous B/W share of every global batch (`distributed.batching`), and DDP averages the
# ranks' gradients, so a step equals the single-process step on the same B samples up to float
# rounding. Caveat: BatchNorm normalises with per-rank batch statistics (B/W samples) in
# training mode, as in torchvision's reference recipe without ``--sync-bn``; SyncBatchNorm is
# not used (torch runs it on GPUs only), so nets with BatchNorm match the single process only
# approximately, and exactly when their BN layers are in eval mode.
#
# Wrapping: DDP wraps the module *after* freezing decisions: its reducer takes only parameters
# with ``requires_grad`` at construction, so `Context.rewrap` builds a new wrapper whenever the
# frozen prefix changes (a stale reducer would wait for gradients that never come). FSDP uses
# FSDP2 (`distributed.sharding`, imported on first use: it takes seconds to import), which
# shards in place, so the optimizer must be built after `Context.wrap`; freezing needs no
# re-wrap there, as FSDP2 reduces only the gradients that exist. The zoo and non-FSDP
# checkpoints hold full tensors keyed like a single process's ``state_dict()``; FSDP
# checkpoints hold per-rank shards (`kiln_trainer.checkpoint.save_shards`) that DCP reshards on
# load, so any (parallelism, W) loads any other's. Control messages (stop flags, reported
# losses, rank 0's decisions) use a CPU gloo group, so they never force a CUDA synchronisation.


@dataclasses.dataclass(frozen=True)
class Context:
    """This process's place in the run, and the collectives between the ranks.

    Attributes:
        parallelism: "single", "ddp" or "fsdp" (effective: "single" whenever W = 1).
        rank: global rank in [0, W).
        world_size: W, processes in the run.
        local_rank: rank on this node (picks the GPU).
        device: where the model and batches go.
        backend: "gloo", "nccl", or None without a process group.
    """

    parallelism: str = "single"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    control_group: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes events, checkpoints, metrics and zoo records."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether there are other ranks (W > 1)."""
        return self.world_size > 1

    @property
    def shard(self) -> tuple[int, int]:
        """(rank, W) for `batching.train_batches`."""
        return self.rank, self.world_size

    @property
    def eval_shard(self) -> tuple[int, int]:
        """(rank, W) of the validation split this rank evaluates: its range under DDP; all of
        it under FSDP, whose forward is collective and must run the same batches everywhere."""
        return (self.rank, self.world_size) if self.parallelism == "ddp" else (0, 1)

    def local_batch_size(self, batch_size: int) -> int:
        """Samples per rank in a full global batch of `batch_size` (B/W).

        Raises:
            runtime.ConfigError: B is not a multiple of W.
        """
        if batch_size % self.world_size:
            lower = batch_size - batch_size % self.world_size
            options = ", ".join(str(b) for b in (lower, lower + self.world_size) if b > 0)
            raise runtime.ConfigError(
                f"spec.training.batchSize: {batch_size} is the global batch, which "
                f"{self.world_size} {self.parallelism} processes cannot share evenly; use a "
                f"multiple of {self.world_size} (e.g. {options}) or another process count")
        return batch_size // self.world_size

    # ------------------------------------------------------------------------------------------
    # wrapping

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to train: `model` itself (single), a DDP wrapper, or `model` sharded in
        place by FSDP2. Call after freezing decisions and after every rank holds the same
        weights (DDP broadcasts rank 0's; FSDP does not: see `broadcast_weights`).

        Returns:
            The wrapper; keep `model` (the unwrapped module) beside it for state dicts.
        """
        if not self.distributed:
            return model
        if self.parallelism == "fsdp":
            from kiln_trainer.distributed import sharding
            return sharding.shard(model, self.device, self.world_size)
        if not any(p.requires_grad for p in model.parameters()):
            _log.info("nothing to train in %s: no DDP wrapper", type(model).__name__)
            return model  # DDP refuses a module without trainable parameters
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def rewrap(self, wrapped: nn.Module, module: nn.Module) -> nn.Module:
        """The wrapper for `module` after ``requires_grad`` changed (freezing, unfreezing).

        DDP gets a new wrapper over `module` (the raw model, or the trainable suffix behind a
        frozen prefix), so frozen parameters leave its reducer; drop the old wrapper. FSDP2
        keeps `wrapped`: it reduces only the gradients that exist.

        Raises:
            ValueError: under FSDP, `module` is not the sharded model (FSDP cannot shard a
                module split off a sharded model; freeze by ``requires_grad`` only).
        """
        if not self.distributed:
            return module
        if self.parallelism == "fsdp":
            if module is not wrapped:
                raise ValueError("FSDP trains the whole sharded model: freeze its prefix by "
                                 "requires_grad instead of training a split-off suffix")
            return wrapped
        return self.wrap(module)

    def prepare_eval(self, wrapped: nn.Module, raw_model: nn.Module) -> nn.Module:
        """The module to evaluate (collective under DDP and FSDP: every rank calls it).

        DDP: `raw_model`, whose forward has no collectives (so ranks may run different batch
        counts), with rank 0's buffers (BatchNorm statistics) copied to every rank first, so
        all shards evaluate the weights rank 0 checkpoints. FSDP: `wrapped`. Single:
        `raw_model`.
        """
        if self.parallelism == "fsdp" and self.distributed:
            return wrapped
        if self.distributed:
            with torch.no_grad():
                for buffer in raw_model.buffers():
                    dist.broadcast(buffer, src=0)
        return raw_model

    def broadcast_weights(self, module: nn.Module) -> None:
        """Copy rank 0's parameters and buffers into `module` on every rank (collective).

        Needed before FSDP's `wrap` when ranks may hold different weights (warm start done on
        rank 0 only); DDP does this itself at construction.
        """
        if not self.distributed:
            return
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)

    # ------------------------------------------------------------------------------------------
    # full (unsharded) state for checkpoints and the zoo

    def full_state_dict(self, wrapped: nn.Module, raw_model: nn.Module) -> dict[str, Any]:
        """The model's full state dict (keys of ``raw_model.state_dict()``), for rank 0.

        Collective under FSDP (every rank calls it): rank 0 gets full CPU tensors, the other
        ranks an empty dict. Otherwise ``raw_model.state_dict()`` on every rank (no copy).
        """
        if self.parallelism != "fsdp" or not self.distributed:
            return raw_model.state_dict()
        from kiln_trainer.distributed import sharding
        return sharding.full_model_state(wrapped)

    def load_full_state_dict(
        self, wrapped: nn.Module, raw_model: nn.Module, state: Mapping[str, Any]
    ) -> None:
        """Load a full state dict (any parallelism's) into the model; every rank passes it.

        Before `wrap`, or outside FSDP, this is ``raw_model.load_state_dict(state)``; an
        FSDP-sharded model keeps its shard of each tensor (collective).

        Raises:
            RuntimeError: missing or unexpected keys, or shapes that differ.
        """
        if self.parallelism != "fsdp" or not self.distributed:
            raw_model.load_state_dict(state)
            return
        from kiln_trainer.distributed import sharding
        sharding.load_full_model_state(wrapped, state)

    def full_optimizer_state_dict(
        self, wrapped: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """The optimizer's full state in ``torch.optim.Optimizer.state_dict()`` form (integer
        parameter ids in param-group order), for rank 0.

        Collective under FSDP: rank 0 gets full CPU tensors, the other ranks an empty dict.
        """
        if self.parallelism != "fsdp" or not self.distributed:
            return optimizer.state_dict()
        from kiln_trainer.distributed import sharding
        return sharding.full_optimizer_state(wrapped, optimizer)

    def load_full_optimizer_state_dict(
        self,
        wrapped: nn.Module | None,
        optimizer: torch.optim.Optimizer,
        state: Mapping[str, Any],
    ) -> None:
        """Load a full optimizer state (integer ids, any parallelism's) on every rank.

        Args:
            wrapped: the sharded model the optimizer steps (FSDP; None elsewhere is fine).
            optimizer: built over the model's (sharded) parameters.
            state: ``Optimizer.state_dict()`` form, e.g. from `full_optimizer_state_dict`.

        Raises:
            ValueError: the state's parameter groups do not fit the optimizer's; FSDP without
                `wrapped`.
        """
        if self.parallelism != "fsdp" or not self.distributed:
            optimizer.load_state_dict(dict(state))
            return
        if wrapped is None:
            raise ValueError("loading an optimizer state under FSDP needs the sharded model")
        from kiln_trainer.distributed import sharding
        sharding.load_full_optimizer_state(wrapped, optimizer, state)

    # ------------------------------------------------------------------------------------------
    # control collectives (CPU, gloo): identity with one process

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank (e.g. its freezing boundary)."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(tensor, src=0, group=self.control_group)
        return int(tensor.item())

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's picklable `obj` on every rank (e.g. the warm-start record)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, by rank, on every rank (e.g. RNG states)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control_group)
        return out

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (stop requests, time budgets), so all
        ranks leave a training stretch after the same step."""
        if not self.distributed:
            return flag
        tensor = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.control_group)
        return bool(tensor.item())

    def agree(self, *, stop: bool, decision: int) -> tuple[bool, int]:
        """One collective per training step: whether any rank's `stop` is set, and rank 0's
        `decision` (e.g. its freezing boundary), on every rank.

        Args:
            stop: this rank wants the stretch to end (stop request, time budget).
            decision: rank 0's value is returned; other ranks' values are ignored.

        Raises:
            ValueError: rank 0's `decision` is negative (the reduction needs >= 0).
        """
        if self.is_main and decision < 0:
            raise ValueError(f"decision {decision}: must be >= 0")
        if not self.distributed:
            return stop, decision
        tensor = torch.tensor([int(stop), decision if self.is_main else -1], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.control_group)
        return bool(tensor[0].item()), int(tensor[1].item())

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over the ranks (float64), on every rank."""
        if not self.distributed:
            return [float(v) for v in values]
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(tensor, group=self.control_group)
        return [float(v) for v in tensor.tolist()]

    def all_reduce_mean(self, value: float) -> float:
        """Mean of `value` over the ranks (e.g. the training loss for reports)."""
        return self.all_reduce_sum([value])[0] / self.world_size

    def sum_eval_shards(self, values: Sequence[float]) -> list[float]:
        """Totals (loss sum, correct, count) over the validation shards: a sum under DDP, the
        values themselves where every rank evaluated everything (`eval_shard`)."""
        if self.eval_shard[1] > 1:
            return self.all_reduce_sum(values)
        return [float(v) for v in values]

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.distributed:
            dist.barrier(group=self.control_group)

    def shutdown(self) -> None:
        """Leave the process group (idempotent; a no-op without one)."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def setup(
    parallelism: str, device_kind: str, *, timeout_seconds: float = 1800.0
) -> Context:
    """This process's `Context`, joining torchrun's process group when W > 1.

    Args:
        parallelism: "single", "ddp", "fsdp", or "auto" (ddp when W > 1, else single).
        device_kind: "cpu" (gloo) or "cuda" (NCCL; the GPU is LOCAL_RANK's).
        timeout_seconds: how long a collective may wait for the other ranks.

    Returns:
        The context; "ddp"/"fsdp" with one process gives a "single" context (logged).

    Raises:
        runtime.ConfigError: an unknown parallelism or device kind; "single" under torchrun
            with W > 1; a malformed torchrun environment; CUDA asked for but LOCAL_RANK has no
            visible GPU.
    """
    if parallelism not in (*PARALLELISMS, "auto"):
        raise runtime.ConfigError(f"parallelism {parallelism!r} is not one of "
                                  f"{', '.join(PARALLELISMS)} or auto")
    if device_kind not in DEVICE_KINDS:
        raise runtime.ConfigError(f"device {device_kind!r} is not one of cpu, cuda")
    env = os.environ
    world, rank, local_rank = (_env_int(env, name, default) for name, default in
                               (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0)))
    if world < 1 or not 0 <= rank < world:
        raise runtime.ConfigError(f"torchrun environment: RANK={rank}, WORLD_SIZE={world}; "
                                  "need 0 <= RANK < WORLD_SIZE (start the trainer with torchrun)")
    if parallelism == "auto":
        parallelism = "ddp" if world > 1 else "single"
    if parallelism == "single" and world > 1:
        raise runtime.ConfigError(
            f"parallelism single, but torchrun started {world} processes (WORLD_SIZE={world}); "
            "use ddp or fsdp, or --nproc-per-node 1")
    device = _device(device_kind, local_rank)
    if world == 1:
        if parallelism != "single":
            _log.info("%s with one process: training as a single process", parallelism)
        return Context("single", 0, 1, local_rank, device, None)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise runtime.ConfigError(f"torchrun environment: WORLD_SIZE={world} but "
                                  f"{', '.join(missing)} unset; start the trainer with torchrun")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_seconds))
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    atexit.unregister(_release_at_exit)  # once per process, however often it joins
    atexit.register(_release_at_exit)
    _log.info("rank %d of %d (%s, %s on %s)", rank, world, parallelism, backend, device)
    return Context(parallelism, rank, world, local_rank, device, backend, control)


# ----------------------------------------------------------------------------------------------
# helpers


def _release_at_exit() -> None:
    """Leave the process group and collect what still holds it, while Python is alive.

    A DDP wrapper holds the group inside a reference cycle (its unit test shows it); left to the
    interpreter's last collection, gloo's threads were torn down after it and a rank could abort
    ("terminate called without an active exception") with its work done.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "")
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise runtime.ConfigError(f"torchrun environment: {name}={text!r} is not an integer; "
                                  "start the trainer with torchrun") from None


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= visible:
        raise runtime.ConfigError(
            f"device cuda: LOCAL_RANK {local_rank} needs GPU {local_rank} but {visible} are "
            "visible; start at most that many processes per node, or train on cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device

