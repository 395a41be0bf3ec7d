"""Where a model can be cut for Egeria layer freezing: blocks, parameters, FLOPs, fx splits.

Role: Egeria (Wang et al., EuroSys 2023, section 3; /work/shared/research/egeria.md sections 3
and 4) freezes a contiguous front prefix of a model's natural blocks (`models.natural_blocks`:
stem, residual blocks or transformer layers, head last). This module answers, for a prefix of
k blocks: which parameters and modules to freeze (`Partition.params`, `Partition.modules`),
what it saves (`Partition.flops`, `Partition.backward_flops_fraction`), and how to run the
frozen prefix apart from the trainable suffix so its outputs can be cached (`Partition.split`).
`extractor` returns every block's activation for the plasticity probes, and `flatten` shrinks
an activation to a small fp32 matrix for the SP loss (`plasticity.sp_loss`).

Callers: the freezing controller, `reference.ReferenceWorker` (`extractor`, `flatten`), the
activation cache's users. Non-goals: no freezing policy (when to freeze), no optimizer or DDP
handling, no I/O. Shapes: b batch, C channels, H height, W width, T tokens, D width, d features.
The torch.fx work (tracing with blocks as leaves, checks, parameter ownership, the cut) is in
`splitting`, FLOP counting in `flops`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn
from torchvision.models import feature_extraction

from kiln import models
from kiln_trainer.freezing import flops, splitting

#: `flatten` pools image maps to at most this many positions per side (4 x 4 = 16 per channel).
MAX_SPATIAL = 4
#: `flatten` pools token sequences to at most this many positions.
MAX_TOKENS = 8

# Re-exports: callers (the freezing controller, the trainer loop, tests) write `partition.X`.
TRACE_ERRORS = splitting.TRACE_ERRORS
Unpartitionable = splitting.Unpartitionable
Split = splitting.Split


def extractor(model: nn.Module, blocks: Sequence[str]) -> nn.Module:
    """A module returning the output of every natural block but the last (the head).

    Built with `torchvision.models.feature_extraction.create_feature_extractor`, whose tracer
    descends into every block (torch.nn layers are its leaves) and returns, for a block name,
    the last traced operation inside that block: the block's output for all registered models
    (checked against forward hooks in the tests). The result is a GraphModule holding the very
    submodules and parameters of `model`: a weight update of the model (in place, as optimizers
    do) is seen by the extractor, and no memory is copied.

    Train/eval: torchvision traces the forward twice, in train and in eval mode, and the result
    switches between the two graphs with `.train()` / `.eval()` (it starts in `model`'s mode;
    each layer's mode is restored after tracing). The submodules are shared, so `extractor.eval()`
    also puts the model's layers (BatchNorm, dropout) in eval mode: save and restore their modes
    around a probe of a live training model, or build the extractor on a copy.

    Args:
        model: the unwrapped model (not a DDP/FSDP wrapper).
        blocks: natural block names, head last (`models.natural_blocks(model)`).

    Returns:
        A module mapping the model's input to dict[block name, Tensor[b, ...]] for blocks[:-1],
        in block order.

    Raises:
        Unpartitionable: fewer than 2 blocks, a name that is no submodule, or a forward that
            torch.fx cannot trace.
    """
    name = type(model).__name__
    if len(blocks) < 2:
        raise Unpartitionable(name, f"it has {len(blocks)} natural block(s); freezing needs 2")
    for block in blocks:
        try:
            model.get_submodule(block)
        except AttributeError as error:
            raise Unpartitionable(name, f"block {block!r} is no submodule ({error})") from error
    modes = splitting.modes(model)
    try:
        module: nn.Module = feature_extraction.create_feature_extractor(
            model, return_nodes={block: block for block in blocks[:-1]}
        )
        return module
    except splitting.TRACE_ERRORS as error:
        raise Unpartitionable(name, f"torch.fx cannot trace its forward ({error})") from error
    finally:
        splitting.restore_modes(modes)  # torchvision resets every layer to the root's mode


def flatten(t: torch.Tensor) -> torch.Tensor:
    """One small fp32 row per sample, for the SP loss (Tung & Mori 2019) of Egeria's probes.

    Pooling keeps messages to the reference worker small and makes the rows of the training and
    the reference side comparable at any resolution; SP compares b x b Gram matrices, so the
    row width d may be anything.

      * Tensor[b, C, H, W] (image maps): adaptive average pool to min(H, 4) x min(W, 4), then
        flatten: d = C * min(H, 4) * min(W, 4).
      * Tensor[b, T, D] (token sequences): adaptive average pool along T to min(T, 8) positions
        (runs of neighbouring tokens are averaged, so per-position information survives, unlike
        a mean over all of T), then flatten: d = min(T, 8) * D.
      * Tensor[b, d]: unchanged (cast to fp32). Tensor[b]: one column. Other ranks: flattened.

    Args:
        t: an activation Tensor[b, ...], any float or integer dtype, any device.

    Returns:
        Tensor[b, d] float32, detached, on `t`'s device.
    """
    t = t.detach().float()
    if t.dim() == 4:
        size = (min(t.shape[2], MAX_SPATIAL), min(t.shape[3], MAX_SPATIAL))
        t = F.adaptive_avg_pool2d(t, size)
    elif t.dim() == 3:
        t = F.adaptive_avg_pool1d(t.transpose(1, 2), min(t.shape[1], MAX_TOKENS)).transpose(1, 2)
    elif t.dim() == 1:
        return t.unsqueeze(1)
    return t.flatten(1)


class Partition:
    """A model's natural blocks with what freezing a front prefix of k of them means.

    Build with `Partition.of`. Block i owns the parameters of submodule `blocks[i]`; parameters
    owned by no block (e.g. a class token on the root module) count with the first block whose
    output depends on them in the traced forward (the first block if none does, the head if
    only code after the head uses them), so `params(k)` is exactly what a frozen prefix of k
    blocks stops training. `k` counts blocks from the front: 0 <= k <= len(blocks).

    Attributes:
        blocks: natural block names, head last.
        param_counts: parameters (elements) per block, attached root parameters included.
        flops: forward FLOPs per sample per block (FlopCounterMode: matmuls, convolutions,
            attention; elementwise ops, norms and pooling count 0).
        backward_flops: backward FLOPs per sample per block, measured (see `flops_source`).
        flops_source: "measured" (FlopCounterMode attributed the backward ops to the blocks)
            or "estimated" (backward = 2 x forward per block).
        probe_extractor: `extractor(model, blocks)`, built while checking traceability.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        blocks: tuple[str, ...],
        graph: fx.Graph,
        block_nodes: tuple[fx.Node, ...],
        params: tuple[tuple[nn.Parameter, ...], ...],
        mode_dependent: bool,
        probe_extractor: nn.Module,
        example: torch.Tensor,
    ) -> None:
        self.blocks = blocks
        self.probe_extractor = probe_extractor
        self.param_counts = tuple(sum(p.numel() for p in group) for group in params)
        self._model, self._graph, self._block_nodes = model, graph, block_nodes
        self._params, self._mode_dependent = params, mode_dependent
        self._splits: dict[int, Split | str] = {}
        counted = flops.count_flops(model, blocks, example)
        self.flops, self.backward_flops, self.flops_source = counted[0], counted[1], counted[2]
        self._backward_total_flops = counted[3]

    @classmethod
    def of(cls, model: nn.Module, example: torch.Tensor) -> Partition:
        """Partition `model` at its natural blocks (`models.natural_blocks`).

        Traces the forward with torch.fx twice (train and eval mode, every block a leaf) and
        counts FLOPs on `example` with one forward and one backward in eval mode; neither
        changes the model (gradients go to `torch.autograd.grad`, not `.grad`; layer modes
        and `requires_grad` flags are restored).

        Args:
            model: the unwrapped model (not a DDP/FSDP wrapper).
            example: an input batch Tensor[b, ...] (b >= 1) on the model's device.

        Returns:
            The partition.

        Raises:
            Unpartitionable: fewer than 2 blocks; blocks that are not submodules or nest; two
                blocks sharing a parameter; a forward torch.fx cannot trace; a block that is
                not called exactly once as a unit, blocks called out of order, or a block's
                internals used outside it.
        """
        name = type(model).__name__
        blocks = tuple(models.natural_blocks(model))
        probe = extractor(model, blocks)  # also checks count, names and traceability
        for block in blocks:
            nested = [other for other in blocks if other.startswith(block + ".")]
            if nested:
                raise Unpartitionable(name, f"blocks {nested} lie inside block {block!r}")
        graph, mode_dependent = splitting.trace(model, blocks)
        block_nodes = splitting.block_calls(name, graph, blocks)
        params = splitting.assign_params(name, model, blocks, block_nodes, graph)
        return cls(
            model=model,
            blocks=blocks,
            graph=graph,
            block_nodes=block_nodes,
            params=params,
            mode_dependent=mode_dependent,
            probe_extractor=probe,
            example=example,
        )

    def params(self, k: int) -> list[nn.Parameter]:
        """The parameters of the first k blocks (what a frozen prefix of k blocks freezes)."""
        self._check(k, 0, len(self.blocks))
        return [p for group in self._params[:k] for p in group]

    def modules(self, k: int) -> list[nn.Module]:
        """The submodules of the first k blocks (to put in eval mode when frozen)."""
        self._check(k, 0, len(self.blocks))
        return [self._model.get_submodule(block) for block in self.blocks[:k]]

    def backward_flops_fraction(self, k: int) -> float:
        """Share of the model's backward FLOPs that a frozen prefix of k blocks skips, in [0, 1].

        With the prefix frozen autograd stops at the boundary: the prefix needs neither weight
        gradients nor input gradients (Egeria section 3; egeria.md section 3). Measured:
        sum(backward_flops[:k]) / the whole backward, where the first block usually costs 1x
        its forward (no input gradient: the input needs none) and the others about 2x. If the
        measurement failed (`flops_source` "estimated"), backward = 2 x forward per block and
        the share is sum(flops[:k]) / sum(forward). 0.0 when FlopCounterMode counted nothing.
        """
        self._check(k, 0, len(self.blocks))
        if self._backward_total_flops <= 0:
            return 0.0
        return min(1.0, sum(self.backward_flops[:k]) / self._backward_total_flops)

    def split(self, k: int) -> Split | None:
        """The model cut after block k-1 (and its parameter-free glue), or None if not one value.

        None when more than one value crosses the boundary: a skip connection over it, the input
        or a parameter used on both sides, a block of the prefix that does not feed block k-1,
        or top-level glue that differs between train and eval mode. `split_reason(k)` says
        which. Results are memoised.

        Args:
            k: frozen blocks, 1 <= k <= len(blocks) - 1 (the head is never frozen).

        Raises:
            ValueError: k out of range.
        """
        self._check(k, 1, len(self.blocks) - 1)
        if k not in self._splits:
            self._splits[k] = splitting.cut(self._model, self._graph, self.blocks,
                                            self._block_nodes, k,
                                            mode_dependent=self._mode_dependent)
        result = self._splits[k]
        return result if isinstance(result, Split) else None

    def split_reason(self, k: int) -> str:
        """Why `split(k)` is None ("" when it is not). Raises ValueError as `split` does."""
        result = self.split(k)
        return "" if result is not None else str(self._splits[k])

    def _check(self, k: int, low: int, high: int) -> None:
        if not low <= k <= high:
            raise ValueError(
                f"k must be in [{low}, {high}] for {len(self.blocks)} blocks (got {k})"
            )
