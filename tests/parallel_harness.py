"""Helpers for the trainer's data-parallel tests: W gloo processes, a tiny job, a mini loop.

`run_ranks` runs a target of this module in W processes under torchrun's environment;
`make_job`, `make_dataset`, `build_model` and `train` are a miniature of `kiln_trainer.loop`,
so the tests compare one process with W on identical work.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import distributed as dist
from torch import multiprocessing as mp
from torch import nn
from torch.nn import functional as F
from torch.utils import data as torch_data

from kiln import api, models
from kiln.zoo import store
from kiln_trainer import checkpoint, optim, tracking
from kiln_trainer.distributed import batching, parallel

# What the fork server imports before it forks a rank (benchrun's too: one server a process).
PRELOAD = ["torch", "kiln_trainer.loop", "parallel_harness"]
SAMPLES = 40  # 5 global batches of 8 per epoch
BATCH_SIZE = 8



def run_ranks(
    target: Callable[..., Any],
    world_size: int,
    parallelism: str,
    *args: Any,
    timeout_seconds: float = 240.0,
) -> list[Any]:
    """Run ``target(ctx, *args)`` in `world_size` gloo processes; their results by rank.

    Each process gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT; OMP_NUM_THREADS=1) and calls `parallel.setup(parallelism, "cpu")`. As under
    torchrun, this process (the agent) hosts the rendezvous store on a port the kernel assigns
    as it binds, and the ranks join it as clients (TORCHELASTIC_USE_AGENT_STORE): a port
    picked first and bound later by rank 0 could be taken meanwhile, or picked by two
    concurrent runs whose ranks then met in one store. The ranks fork from a server that
    imported `PRELOAD`, and import `target`'s module by name: it must live in ``tests``
    (on sys.path through pytest's ``pythonpath``).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback inside).
        TimeoutError: the ranks did not finish in `timeout_seconds` (then they are killed).
    """
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children before torch loads
    store = dist.TCPStore(  # type: ignore[attr-defined]  # exported at run time
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_seconds))
    try:
        with tempfile.TemporaryDirectory() as out:
            # Forked from a fork server that imported torch and Kiln once (a spawned rank
            # spends 2-3 CPU-seconds importing them); the server has no thread but its main
            # one, so forking it is safe where forking a pytest-xdist worker is not.
            processes = mp.start_processes(
                _entry, args=(world_size, store.port, out, parallelism, target, args),
                nprocs=world_size, join=False, start_method="forkserver")
            deadline = time.monotonic() + timeout_seconds
            while not processes.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    for process in processes.processes:
                        process.kill()
                    raise TimeoutError(f"{world_size} ranks still running after "
                                       f"{timeout_seconds} s")
            return [torch.load(Path(out) / f"{rank}.pt", weights_only=True)
                    for rank in range(world_size)]
    finally:
        del store  # the server stops with its last reference
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous


def _entry(rank: int, world_size: int, port: int, out: str, parallelism: str,
           target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    ctx = parallel.setup(parallelism, "cpu", timeout_seconds=120)
    try:
        result = target(ctx, *args)
    finally:
        ctx.shutdown()
    torch.save(result, Path(out) / f"{rank}.pt")


# ----------------------------------------------------------------------------------------------
# a miniature training run


def make_job(name: str = "parallel-test") -> api.TrainingJob:
    """small_cnn on [1, 8, 8], global batch 8, Adam with cosine decay, 3 epochs."""
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "model": {"architecture": "small_cnn", "inputShape": [1, 8, 8],
                      "args": {"depth": 2, "width": 4}},
            "training": {"epochs": 3, "batchSize": BATCH_SIZE, "seed": 3,
                         "optimizer": {"name": "adam", "lr": 0.01},
                         "lrSchedule": {"name": "cosine"}, "gradClipNorm": 1.0},
        },
    })


def make_dataset() -> torch_data.TensorDataset:
    """SAMPLES seeded random images Tensor[N, 1, 8, 8] with labels in [0, 10)."""
    generator = torch.Generator().manual_seed(11)
    images = torch.randn(SAMPLES, 1, 8, 8, generator=generator)
    return torch_data.TensorDataset(images, torch.randint(0, 10, (SAMPLES,), generator=generator))


def build_model(job: api.TrainingJob) -> nn.Module:
    """The job's model with seed-0 weights, identical in every process."""
    torch.manual_seed(0)
    return models.build(job.spec.model)


@dataclasses.dataclass
class Training:
    """Optimizer, schedule and position of a miniature run."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: tracking.RunState
    losses: list[float] = dataclasses.field(default_factory=list)


def start_training(job: api.TrainingJob, parameters: Any) -> Training:
    """The job's optimizer over `parameters` and its per-step schedule, at step 0."""
    optimizer = optim.build_optimizer(parameters, job.spec.training.optimizer)
    steps = batching.steps_per_epoch(make_dataset(), batch_size=BATCH_SIZE)
    scheduler = optim.build_schedule(optimizer, job.spec.training, steps_per_epoch=steps)
    return Training(optimizer, scheduler, tracking.RunState())


def train(
    ctx: parallel.Context, job: api.TrainingJob, wrapped: nn.Module, run: Training, *,
    until_step: int,
) -> None:
    """Train until global step `until_step`, from `run.state`'s position, on ctx's shard."""
    dataset, seed = make_dataset(), job.spec.training.seed
    steps_per_epoch = batching.steps_per_epoch(dataset, batch_size=BATCH_SIZE,
                                               world_size=ctx.world_size)
    state = run.state
    while state.step < until_step:
        batches = batching.train_batches(dataset, batch_size=BATCH_SIZE, seed=seed,
                                         epoch=state.epochs_done, start_batch=state.epoch_batch,
                                         shard=ctx.shard)
        for inputs, targets in batches:
            loss = step(wrapped, run, inputs, targets,
                        grad_clip_norm=job.spec.training.grad_clip_norm)
            run.losses.append(ctx.all_reduce_mean(loss))
            state.step, state.epoch_batch = state.step + 1, state.epoch_batch + 1
            state.samples += len(targets)  # this rank's share
            if ctx.any_rank(state.step >= until_step):
                break
        if state.epoch_batch >= steps_per_epoch:
            state.epochs_done, state.epoch_batch = state.epochs_done + 1, 0


def step(wrapped: nn.Module, run: Training, inputs: torch.Tensor, targets: torch.Tensor, *,
         grad_clip_norm: float | None) -> float:
    """One optimizer step of the default loop's kind; returns this rank's mean loss."""
    wrapped.train()
    # Fixed BatchNorm statistics: per-rank batch statistics would make DDP differ from one
    # process.
    for module in wrapped.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
    loss = F.cross_entropy(wrapped(inputs), targets)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    if grad_clip_norm is not None:
        nn.utils.clip_grad_norm_(wrapped.parameters(), grad_clip_norm)
    run.optimizer.step()
    run.scheduler.step()
    return float(loss.detach())


def evaluate_sums(module: nn.Module, shard: tuple[int, int]) -> list[float]:
    """[loss sum, correct, count] of `module` on this rank's part of the dataset (batches of 6,
    so shards get uneven batch sizes and counts)."""
    module.eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.inference_mode():
        for inputs, targets in batching.eval_batches(make_dataset(), batch_size=6, shard=shard):
            logits = module(inputs)
            loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct += int((logits.argmax(-1) == targets).sum())
            count += len(targets)
    return [loss_sum, correct, count]


def parameters_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies of a state dict's floating-point tensors."""
    return {k: v.detach().cpu().clone() for k, v in state.items() if v.is_floating_point()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute element difference between two state dicts with the same keys."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ----------------------------------------------------------------------------------------------
# targets for run_ranks (and, with a one-process context, the reference runs)


def checkpoint_location(directory: str, *, sharded: bool = False) -> checkpoint.Location:
    """Where the tests' checkpoints go (full, or sharded: main object and shards beside)."""
    return checkpoint.Location(store.DirStore(Path(directory)), "parallel-test/" + (
        "sharded.pt" if sharded else "checkpoint.pt"))


def train_with_checkpoint(
    ctx: parallel.Context, directory: str, save_step: int, until_step: int,
    resume_here: bool = False,
) -> dict[str, Any]:
    """Train to `until_step`, saving a checkpoint (rank 0) at `save_step` on the way; under
    FSDP also a sharded one (every rank its shards: `checkpoint.save_shards`).

    Returns (complete on rank 0): final parameters, reported losses, validation sums of the
    final model, under FSDP the bytes of each rank's shard and of the full model state
    (`shard_bytes`, `full_bytes`); with `resume_here`, also the parameters of second runs in
    the same ranks that resumed from the checkpoint (`resumed`) and from the sharded one
    (`resumed_sharded`).
    """
    job = make_job()
    raw = build_model(job)
    wrapped = ctx.wrap(raw)
    run = start_training(job, wrapped.parameters())  # FSDP: over the sharded parameters
    train(ctx, job, wrapped, run, until_step=save_step)
    snapshot = checkpoint.capture(run.state, tracking.Clock(), job, raw, run.optimizer,
                                  run.scheduler, ctx=ctx, wrapped=wrapped, sharded=False)
    full_bytes = 0
    if ctx.is_main:
        full_bytes = checkpoint.save_checkpoint(checkpoint_location(directory), snapshot)
    ctx.barrier()
    result: dict[str, Any] = {}
    if checkpoint.is_sharded(ctx):
        where = checkpoint_location(directory, sharded=True)
        shards = checkpoint.capture(run.state, tracking.Clock(), job, raw, run.optimizer,
                                    run.scheduler, ctx=ctx, wrapped=wrapped)
        result["shard_bytes"] = ctx.gather_objects(checkpoint.save_shards(
            where, shards, raw, run.optimizer, wrapped=wrapped))
        ctx.barrier()
        if ctx.is_main:  # last: it makes the shards current
            checkpoint.save_checkpoint(where, shards)
        result["full_bytes"] = full_bytes
        ctx.barrier()
    train(ctx, job, wrapped, run, until_step=until_step)
    sums = ctx.sum_eval_shards(evaluate_sums(ctx.prepare_eval(wrapped, raw), ctx.eval_shard))
    result.update(params=parameters_of(ctx.full_state_dict(wrapped, raw)), losses=run.losses,
                  eval=sums, samples=run.state.samples)
    if resume_here:
        result["resumed"] = resume(ctx, directory, until_step)
        if checkpoint.is_sharded(ctx):
            result["resumed_sharded"] = resume(ctx, directory, until_step, sharded=True)
    return result


def resume(ctx: parallel.Context, directory: str, until_step: int, *,
           sharded: bool = False) -> dict[str, torch.Tensor]:
    """Resume the saved checkpoint (or the sharded one) under `ctx` and train to `until_step`;
    final parameters."""
    job = make_job()
    where = checkpoint_location(directory, sharded=sharded)
    saved = checkpoint.load_checkpoint(where)
    assert saved is not None and (checkpoint.SHARDS_KEY in saved) == sharded
    raw = build_model(job)
    checkpoint.restore_model(saved, job, raw)  # before wrapping: every parallelism
    wrapped = ctx.wrap(raw)
    run = start_training(job, wrapped.parameters())
    checkpoint.restore_shards(saved, where, job, raw, run.optimizer,  # sharded: after wrapping
                              wrapped=wrapped if checkpoint.is_sharded(ctx) else None)
    run.state = checkpoint.restore_training(saved, job, run.optimizer, run.scheduler, ctx=ctx,
                                            wrapped=wrapped)
    train(ctx, job, wrapped, run, until_step=until_step)
    return parameters_of(ctx.full_state_dict(wrapped, raw))


def freeze_and_rewrap(ctx: parallel.Context) -> dict[str, Any]:
    """Freeze the stem, wrap, train 2 steps; freeze blocks too, re-wrap, train 2 more.

    Returns what DDP's reducer registered after each wrap, the trainable tensor counts, and
    parameter snapshots (before, after the first stretch, at the end).
    """
    job = make_job()
    raw = build_model(job)
    for parameter in raw.stem.parameters():
        parameter.requires_grad_(False)
    wrapped = ctx.wrap(raw)
    reducer = [wrapped._get_ddp_logging_data()]
    run = start_training(job, raw.parameters())
    snapshots = [parameters_of(raw.state_dict())]
    train(ctx, job, wrapped, run, until_step=2)
    stem_grads = [p.grad for p in raw.stem.parameters()]
    snapshots.append(parameters_of(raw.state_dict()))
    trainable = [sum(p.requires_grad for p in raw.parameters())]
    for parameter in raw.blocks.parameters():
        parameter.requires_grad_(False)
    wrapped = ctx.rewrap(wrapped, raw)
    reducer.append(wrapped._get_ddp_logging_data())
    trainable.append(sum(p.requires_grad for p in raw.parameters()))
    train(ctx, job, wrapped, run, until_step=4)
    snapshots.append(parameters_of(raw.state_dict()))
    return {"reducer": [(int(r["num_parameter_tensors"]), int(r["total_parameter_size_bytes"]))
                        for r in reducer],
            "trainable": trainable, "snapshots": snapshots,
            "stem_grads_none": all(g is None for g in stem_grads),
            "wrapper": type(wrapped).__name__}
