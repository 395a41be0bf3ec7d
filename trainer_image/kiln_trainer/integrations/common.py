"""What the integrations share: evaluation metrics to Kiln's, a training batch's model input
for the freezer's probe, and ending a run the user must fix as `JobContext` ends one."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, NoReturn

import torch

from kiln import contract
from kiln_trainer.jobcontext import JobContext


def evaluation(metrics: Mapping[str, Any], accuracy_key: str, loss_key: str) -> tuple[float, float]:
    """(accuracy, loss) from a framework's evaluation metrics (numbers or 0-d tensors).

    Raises:
        ValueError: a key is missing, naming the metrics there are and the fix.
    """
    missing = [key for key in (accuracy_key, loss_key) if key not in metrics]
    if missing:
        raise ValueError(
            f"KilnCallback: the evaluation metrics {sorted(metrics)} lack {missing}; report the "
            "validation accuracy (correct / total) and mean loss under those names, or pass "
            "KilnCallback(accuracy_key=..., loss_key=...) naming yours")
    return float(metrics[accuracy_key]), float(metrics[loss_key])


def first_samples(loader: Any, samples: int) -> Any:
    """The first `samples` samples of `loader`'s dataset, collated as `loader` collates them
    (read by index, so the loader's shuffle is untouched)."""
    dataset = loader.dataset
    return loader.collate_fn([dataset[i] for i in range(min(samples, len(dataset)))])


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor (in a tuple, list or dict)."""
    values = batch.values() if isinstance(batch, Mapping) else (
        batch if isinstance(batch, tuple | list) else (batch,))
    first = next((v for v in values if isinstance(v, torch.Tensor) and v.dim()), None)
    return int(first.shape[0]) if first is not None else 0


def refuse(ctx: JobContext, message: str) -> NoReturn:
    """End the run as `JobContext` ends one the user must fix: `contract.EXIT_INVALID`, the
    message on stderr and as the failure event (the operator fails the job, no retry)."""
    ctx.close(failure=message)
    print(f"kiln_trainer: error: {message}", file=sys.stderr)
    ctx.emit.failure(message)
    raise SystemExit(contract.EXIT_INVALID)
