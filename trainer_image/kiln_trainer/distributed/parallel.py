"""Data-parallel execution for the trainer: one process, DDP or FSDP, under torchrun.

`setup(parallelism, device_kind)` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), joins the process group (gloo on CPU, NCCL on CUDA) and returns a
`Context`; with one process (or parallelism "single") there is no process group and every
collective of the context is the identity, so single, DDP and FSDP share one code path (STYLE
B6).

Semantics (issue 5 item 1). ``spec.training.batchSize`` is the *global* batch B: each of the W
ranks trains on its contiguous B/W share of every global batch (`kiln_trainer.distributed.batching`), and
DDP averages the ranks' gradients, so a step equals the single-process step on the same B
samples up to float rounding. Caveat: BatchNorm normalises with per-rank batch statistics
(B/W samples) in training mode, as in torchvision's reference recipe without ``--sync-bn``;
SyncBatchNorm is not used (torch runs it on GPUs only), so nets with BatchNorm match the
single process only approximately, and exactly when their BN layers are in eval mode.

`Context` itself (wrapping after freezing decisions, full state for checkpoints and the zoo,
the control collectives) lives in `kiln_trainer.distributed.ranks` and is re-exported here, so callers
write `parallel.Context`.

`launch_command` gives the one-node torchrun command; pods spanning nodes would add ``--nnodes
N --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB`` (the same
environment reaches `setup`).

Callers: `kiln_trainer.loop`, `kiln_trainer.checkpoint`, the local runner and the operator
(`launch_command`). Non-goals: no tensor/pipeline parallelism, no mixed precision, no sharded
(distributed-checkpoint) files, no multi-node launching here.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Mapping, Sequence

import torch
from torch import distributed as dist

from kiln_trainer import runtime
from kiln_trainer.distributed import ranks

_log = logging.getLogger(__name__)

PARALLELISMS = ("single", "ddp", "fsdp")
DEVICE_KINDS = ("cpu", "cuda")


# Re-export: the context `setup` returns (kiln_trainer.distributed.ranks).
Context = ranks.Context


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
    _log.info("rank %d of %d (%s, %s on %s)", rank, world, parallelism, backend, device)
    return Context(parallelism, rank, world, local_rank, device, backend, control)


def launch_command(k: int, argv: Sequence[str], *, python: str = sys.executable) -> list[str]:
    """The command that runs the trainer with `k` processes on this machine.

    k = 1: ``python -m kiln_trainer ARGV``; k > 1: ``python -m torch.distributed.run
    --standalone --nproc-per-node k -m kiln_trainer ARGV`` (torchrun with a private rendezvous
    on a free port, so concurrent jobs do not collide). Only rank 0 writes the JSON-lines
    events, and torchrun passes the workers' stdout through, so the runner reads it as usual.

    Args:
        k: processes (GPUs, or CPU worker slots).
        argv: the trainer's arguments (e.g. ``["--job", "job.yaml", "--parallelism", "ddp"]``).
        python: the interpreter (default: this one).

    Raises:
        ValueError: k < 1.
    """
    if k < 1:
        raise ValueError(f"k: {k} processes; need at least 1")
    if k == 1:
        return [python, "-m", "kiln_trainer", *argv]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(k),
            "-m", "kiln_trainer", *argv]


# ----------------------------------------------------------------------------------------------
# helpers


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

