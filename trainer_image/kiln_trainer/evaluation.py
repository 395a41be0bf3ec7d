"""Validation for the default loop: accuracy and mean cross-entropy, summed over the ranks.

`evaluate` runs the validation split through a model under ``torch.inference_mode()``. With a
`parallel.Context` it is collective (every rank calls it): under DDP each rank evaluates its
contiguous range of the split with the unwrapped model (rank 0's BatchNorm statistics copied
first, `parallel.Context.prepare_eval`) and the sums are added over the ranks; under FSDP every
rank runs the whole split through the sharded model, whose forward is collective. Either way
every rank gets the numbers one process would report.

Shapes: B batch; images Tensor[B, C, H, W] -> logits Tensor[B, K]; text LongTensor[B, T] ->
logits Tensor[B, T, V]. Loss and accuracy flatten the leading dimensions, so for language
models they are per token (mean cross-entropy in nats, next-byte accuracy).

Callers: `kiln_trainer.loop`; the benchmarks (`bench/warmstart.py`). Non-goals: no metrics
beyond accuracy and loss, no reporting (`kiln_trainer.tracking` does that).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln_trainer import data, tracking
from kiln_trainer.distributed import parallel


def evaluate(
    model: nn.Module,
    splits: data.Splits,
    *,
    batch_size: int,
    device: torch.device,
    num_workers: int = 0,
    ctx: parallel.Context | None = None,
    wrapped: nn.Module | None = None,
) -> tracking.Evaluation:
    """Accuracy and mean cross-entropy on the validation split (per token for LMs).

    Args:
        model: the unwrapped model (`raw_model`); left in train mode afterwards.
        splits: the data; its validation split is evaluated once, in a fixed order.
        batch_size: the global training batch size B; evaluation batches hold 2B samples.
        device: where the batches go.
        num_workers: DataLoader worker processes.
        ctx: the parallel context (default: one process). With W > 1 this call is collective.
        wrapped: the DDP or FSDP wrapper of `model` (default `model`; FSDP evaluates through it).

    Returns:
        The same numbers on every rank.
    """
    ctx = ctx or parallel.Context()
    module = ctx.prepare_eval(model if wrapped is None else wrapped, model)
    module.eval()
    loss_sum, correct, count = 0.0, 0, 0
    loader = data.eval_batches(splits.validation, batch_size=2 * batch_size,
                               num_workers=num_workers, shard=ctx.eval_shard)
    with torch.inference_mode():
        for inputs, targets in loader:
            logits = module(inputs.to(device)).flatten(0, -2)
            targets = targets.to(device).flatten()
            loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct += int((logits.argmax(-1) == targets).sum())
            count += len(targets)
    module.train()
    total_loss, total_correct, total_count = ctx.sum_eval_shards([loss_sum, correct, count])
    return tracking.Evaluation(accuracy=total_correct / total_count,
                               loss=total_loss / total_count)
