"""Checks on DDP's replicas: what its reducer holds, and whether the ranks still agree.

Never repairs diverged replicas; FSDP shards are out of scope (they differ by design).
"""

from __future__ import annotations

import hashlib
import logging

import torch
from torch import nn

from kiln_trainer.distributed import parallel

_log = logging.getLogger(__name__)


def describe(model: nn.Module, step: int) -> nn.Module:
    """Log what a DDP wrapper's reducer holds (INFO: tensors and bytes); returns `model`.

    DDP averages gradients only over the parameters its reducer registered when the wrapper was
    built; logging that set after every (re)wrap shows a frozen prefix leaving it.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        reducer = model._get_ddp_logging_data()  # type: ignore[no-untyped-call]
        _log.info("step %d: DDP over %s; its reducer holds %d parameter tensors (%d bytes)",
                  step, type(model.module).__name__, reducer.get("num_parameter_tensors", -1),
                  reducer.get("total_parameter_size_bytes", -1))
    return model


def digest(module: nn.Module) -> str:
    """A 128-bit hex digest of the module's parameters' bytes, in registration order."""
    hasher = hashlib.blake2b(digest_size=16)
    for parameter in module.parameters():
        flat = parameter.detach().reshape(-1).contiguous().cpu()
        hasher.update(flat.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def check(ctx: parallel.Context, raw_model: nn.Module, step: int) -> bool:
    """Whether every rank holds the same parameters as rank 0 (collective under DDP).

    Rank 0 logs the outcome after step `step`: INFO with the digest when they agree, a
    WARNING naming the differing ranks when not (a rank-dependent decision or a
    non-deterministic kernel; checkpoints and zoo records keep rank 0's weights). Without DDP
    replicas: True, no collective.
    """
    if ctx.parallelism != "ddp" or not ctx.distributed:
        return True
    digests = ctx.gather_objects(digest(raw_model))
    differing = [rank for rank, d in enumerate(digests) if d != digests[0]]
    if ctx.is_main and differing:
        _log.warning("step %d: the weights of rank(s) %s differ from rank 0's; the ranks went "
                     "different ways (checkpoints keep rank 0's)", step, differing)
    elif ctx.is_main:
        _log.info("step %d: the %d DDP replicas hold identical weights (digest %s)", step,
                  len(digests), digests[0])
    return not differing
