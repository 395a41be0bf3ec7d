"""FLOPs per natural block, forward and backward, for Egeria's savings estimate.

Role: `count_flops` runs one forward and one forward+backward of a model in eval mode under
`torch.utils.flop_counter.FlopCounterMode` and attributes the counts to the natural blocks, so
`partition.Partition` can say what share of the backward a frozen prefix skips (Egeria,
EuroSys 2023, section 3; /work/shared/research/egeria.md section 3). The model is left as it
was: layer modes and `requires_grad` flags are restored, gradients go to
`torch.autograd.grad`, not `.grad`.

Callers: `partition.Partition` only. Non-goals: no tracing or cutting (`splitting`), no
wall-clock timing, no I/O. Shapes: b batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils import flop_counter

from kiln_trainer.freezing import splitting


def count_flops(
    model: nn.Module, blocks: Sequence[str], example: torch.Tensor
) -> tuple[tuple[float, ...], tuple[float, ...], str, float]:
    """(forward per block, backward per block, source, whole backward), FLOPs per sample.

    FlopCounterMode names modules by path from the root's class name ("ResNet.layer1.0") and
    attributes backward ops to the module whose forward made them (via ModuleTracker's
    gradient hooks); backward = (forward + backward run) - (forward-only run). Falls back to
    2 x forward when the attribution fails its sanity check. Runs in eval mode (BatchNorm in
    train mode rejects b = 1).
    """
    batch = max(1, example.shape[0])
    root = type(model).__name__
    modes, flags = splitting.modes(model), [(p, p.requires_grad) for p in model.parameters()]
    try:
        model.eval()
        for param, _ in flags:
            param.requires_grad_(True)
        with torch.inference_mode(False), torch.enable_grad():
            example = example.clone()
            with flop_counter.FlopCounterMode(display=False) as forward_counter:
                model(example)
            with flop_counter.FlopCounterMode(display=False) as total_counter:
                outputs = [t.float().sum() for t in _tensors(model(example)) if t.requires_grad]
                if outputs and flags:
                    loss = torch.stack(outputs).sum()
                    torch.autograd.grad(loss, [p for p, _ in flags], allow_unused=True)
    finally:
        splitting.restore_modes(modes)
        for param, requires_grad in flags:
            param.requires_grad_(requires_grad)
    forward_counts, total_counts = (
        forward_counter.get_flop_counts(),
        total_counter.get_flop_counts(),
    )

    def flops(counts: dict[str, dict[object, int]], key: str) -> float:
        return sum(counts.get(key, {}).values()) / batch

    forward = tuple(flops(forward_counts, f"{root}.{block}") for block in blocks)
    total = tuple(flops(total_counts, f"{root}.{block}") for block in blocks)
    backward = tuple(t - f for t, f in zip(total, forward))
    whole_forward = flops(forward_counts, "Global")
    whole_backward = flops(total_counts, "Global") - whole_forward
    # Sanity: every trainable block costs >= 1x its forward in backward, and the blocks' shares
    # cannot exceed the whole (they do when a module takes a list of tensors, as DenseNet's
    # layers do: the tracker then keeps it "entered" through later modules' backward).
    if 0 < 0.5 * sum(forward) <= sum(backward) <= 1.001 * whole_backward:
        return forward, backward, "measured", whole_backward
    return forward, tuple(2.0 * f for f in forward), "estimated", 2.0 * whole_forward


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors in a model output (a Tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
