"""The gradient-norm freezing test (after AutoFreeze, Liu et al. 2021): a front block has
settled when the relative change of its gradient norm between two intervals is among the
smallest of the still-trainable blocks'. Says how many front blocks passed; which freeze is
`freezing.controller`'s decision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch


class GradientNormTest:
    """Per-interval gradient norms of the freezable blocks (all but the head), forward order.

    `accumulate` adds each step's gradient norm per active block; `close_interval` compares
    the interval's sums with the previous interval's: a block's change is
    ``|now - before| / before``, and a block passes when its change is at most the
    ``percentile``-th percentile of the changes of every active block measured in both
    intervals. `passed_prefix` is how many blocks in front, from the first active one, passed
    in a row.

    Args:
        blocks: names of the freezable blocks.
        percentile: the threshold's percentile of the active blocks' changes, in (0, 100].
    """

    def __init__(self, blocks: Sequence[str], *, percentile: float) -> None:
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.blocks, self.percentile = tuple(blocks), percentile
        self._sums: list[torch.Tensor | float] = [0.0 for _ in self.blocks]  # this interval's
        self._before: list[float | None] = [None for _ in self.blocks]  # the last interval's
        self.changes: dict[str, float] = {}  # relative change per block, last closed interval
        self.threshold: float | None = None  # the last closed interval's percentile

    def accumulate(self, grads: Iterable[Iterable[torch.Tensor | None]], *,
                   first_active: int) -> None:
        """Add one step's gradient norm of each active block; `grads[i]` holds block i's
        parameters' ``.grad`` (None for a parameter without one)."""
        for i, block_grads in enumerate(grads):
            if i < first_active or i >= len(self.blocks):
                continue
            norms = [torch.linalg.vector_norm(_local(g).detach().float()) for g in block_grads
                     if g is not None]
            if norms:  # kept on the gradients' device: no synchronisation per step
                self._sums[i] = self._sums[i] + torch.linalg.vector_norm(torch.stack(norms))

    def close_interval(self, *, first_active: int) -> None:
        """End an interval: the active blocks' relative changes and the threshold; the sums
        become the next interval's baseline."""
        self.changes = {}
        for i in range(first_active, len(self.blocks)):
            before, now = self._before[i], float(self._sums[i])
            if before is not None and before > 0 and now > 0:
                self.changes[self.blocks[i]] = abs(now - before) / before
            self._before[i] = now if now > 0 else None
            self._sums[i] = 0.0
        values = list(self.changes.values())
        self.threshold = (float(np.percentile(values, self.percentile)) if len(values) >= 2
                          else None)

    def passed_prefix(self, first_active: int) -> int:
        """Blocks from `first_active` on whose change was at most the threshold, in a row."""
        if self.threshold is None:
            return 0
        passed = 0
        for name in self.blocks[first_active:]:
            change = self.changes.get(name)
            if change is None or change > self.threshold:
                break
            passed += 1
        return passed

    def mark_frozen(self, k: int) -> None:
        """Blocks before `k` froze: their gradients are gone, so is their baseline."""
        for i in range(min(k, len(self.blocks))):
            self._before[i], self._sums[i] = None, 0.0

    def reason(self, name: str) -> str:
        """Why block `name` passed, for the freeze event."""
        return (f"its gradient norm changed by {self.changes.get(name, 0.0):.3g} (relative) "
                f"over the last interval, within the {self.percentile:g}th percentile "
                f"({self.threshold or 0.0:.3g}) of the trainable modules' changes")

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for checkpoints: the last closed interval's norms per block."""
        return {"blocks": list(self.blocks), "before": list(self._before)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output; ignored (measured afresh) for other blocks."""
        if list(state.get("blocks", [])) == list(self.blocks):
            self._before = [None if v is None else float(v) for v in state["before"]]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of `grad`: an FSDP shard's norm would be a collective that only rank 0,
    the one that runs the test, enters (the other ranks never join it: the job hangs)."""
    if type(grad) is torch.Tensor:  # not sharded: no need to import DTensor (0.65 s a process)
        return grad
    from torch.distributed.tensor import DTensor

    return grad.to_local() if isinstance(grad, DTensor) else grad
