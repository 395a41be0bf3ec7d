"""Where a model can be cut for layer freezing: blocks, their parameters and FLOPs, fx splits.

Egeria (Wang et al., EuroSys'23, section 3) freezes a contiguous front prefix of a model's
natural blocks (`models.natural_blocks`, head last). Never a freezing policy (when to freeze).
Shapes: b batch, C channels, H height, W width, T tokens, D width, d features.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Collection, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import flop_counter

from kiln import models

# What torch.fx raises on a forward it cannot trace: control flow on a traced value (TraceError),
# an op that rejects a Proxy (TypeError), shape logic that needs real sizes, and so on.
TRACE_ERRORS = (
    torch.fx.proxy.TraceError,
    TypeError,
    RuntimeError,
    AttributeError,
    NotImplementedError,
    ValueError,
    KeyError,
    IndexError,
)


class Unpartitionable(ValueError):
    """The model cannot be split into a freezable front prefix; the job trains without freezing.

    Args:
        model_name: the model's class name.
        reason: why, e.g. "it has 1 natural block(s); freezing needs 2".

    Attributes:
        model_name: as given.
        reason: as given.
    """

    def __init__(self, model_name: str, reason: str) -> None:
        super().__init__(
            f"cannot freeze layers of {model_name}: {reason}; the job trains without freezing"
        )
        self.model_name = model_name
        self.reason = reason


class Untraceable(Unpartitionable):
    """torch.fx cannot trace the model's forward (a model with a layer stack still partitions
    along it, `Partition.of`)."""


@dataclasses.dataclass(frozen=True)
class Split:
    """A model cut at a block boundary: `suffix(prefix(x))` computes `model(x)`, op for op.

    Both are torch.fx GraphModules holding the model's own submodules and parameters (nothing
    is copied). `prefix.eval()` therefore also puts the model's prefix layers in eval mode,
    which freezing wants anyway (BatchNorm statistics of frozen blocks must stop moving).

    Attributes:
        prefix: blocks [0, k) and the parameter-free glue right after block k-1 (activation,
            pooling, flatten); forward(*model inputs) -> the boundary Tensor[b, ...].
        suffix: everything else; forward(boundary) -> the model's output.
        boundary: the fx name of the value that crosses (for logs), e.g. "maxpool".
    """

    prefix: nn.Module
    suffix: nn.Module
    boundary: str


#: `flatten` pools image maps to at most this many positions per side (4 x 4 = 16 per channel).
MAX_SPATIAL = 4
#: `flatten` pools token sequences to at most this many positions.
MAX_TOKENS = 8

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

    A forward torch.fx cannot trace even with the blocks as leaves (a Hugging Face model's
    own) gets a `HookExtractor` instead: the same outputs, taken by forward hooks.

    Raises:
        Unpartitionable: fewer than 2 blocks or a name that is no submodule.
    """
    name = type(model).__name__
    if len(blocks) < 2:
        raise Unpartitionable(name, f"it has {len(blocks)} natural block(s); freezing needs 2")
    for block in blocks:
        try:
            model.get_submodule(block)
        except AttributeError as error:
            raise Unpartitionable(name, f"block {block!r} is no submodule ({error})") from error
    # Imported here: torchvision's import costs a trainer half a second, and a job without
    # freezing never partitions.
    from torchvision.models import feature_extraction

    saved_modes = modes(model)
    try:
        module: nn.Module = feature_extraction.create_feature_extractor(
            model, return_nodes={block: block for block in blocks[:-1]}
        )
        return module
    except TRACE_ERRORS:
        try:  # blocks fx cannot trace into (Hugging Face layers): their outputs, blocks as leaves
            return _leaf_extractor(model, blocks)
        except (*TRACE_ERRORS, Unpartitionable):
            return HookExtractor(model, blocks[:-1])
    finally:
        restore_modes(saved_modes)  # torchvision resets every layer to the root's mode


def _leaf_extractor(model: nn.Module, blocks: Sequence[str]) -> nn.Module:
    """`extractor` from a trace that keeps every block one call (a leaf): a block's output is
    its call's. For models whose blocks torch.fx cannot trace into but whose top-level forward
    it can; the graph is the eval-mode one (the blocks themselves still follow their mode)."""
    graph, _ = trace(model, blocks)
    calls = {str(n.target): n for n in graph.nodes if n.op == "call_module"}
    missing = [block for block in blocks[:-1] if block not in calls]
    if missing:
        raise Unpartitionable(type(model).__name__, f"blocks {missing} are never called")
    for node in [n for n in graph.nodes if n.op == "output"]:
        graph.erase_node(node)
    graph.output({block: calls[block] for block in blocks[:-1]})
    module = fx.GraphModule(model, graph, class_name="BlockOutputs")
    module.graph.eliminate_dead_code()
    module.recompile()
    return module


class _Done(Exception):
    """Raised by `HookExtractor`'s last hook: the rest of the forward is not needed."""


class HookExtractor(nn.Module):
    """`extractor` for a forward torch.fx cannot trace: runs the model with a forward hook on
    each block, and stops it after the last one.

    A block that returns a tuple gives its first tensor (a Hugging Face layer's hidden
    states). The hooks live only during a call, so a copy (the reference's) works alike; the
    model is a submodule, so `.train()` / `.eval()` switch its layers, as for the traced kind.
    """

    def __init__(self, model: nn.Module, blocks: Sequence[str]) -> None:
        super().__init__()
        self.model, self.blocks = model, tuple(blocks)

    def forward(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's inputs -> dict[block name, Tensor[b, ...]], in block order.

        Raises:
            RuntimeError: a block did not run (or returned no tensor).
        """
        found: dict[str, torch.Tensor] = {}

        def keep(block: str) -> Callable[[nn.Module, object, object], None]:
            def hook(module: nn.Module, args: object, output: object) -> None:
                found[block] = next(_tensors(output))
                if len(found) == len(self.blocks):
                    raise _Done

            return hook

        handles = [self.model.get_submodule(block).register_forward_hook(keep(block))
                   for block in self.blocks]
        try:
            self.model(*inputs)
        except _Done:
            pass
        finally:
            for handle in handles:
                handle.remove()
        missing = [block for block in self.blocks if block not in found]
        if missing:
            raise RuntimeError(f"blocks {missing} of {type(self.model).__name__} did not run")
        return {block: found[block] for block in self.blocks}


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
        graph: fx.Graph | None,
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
        self._bridges: dict[tuple[int, int], nn.Module] = {}
        counted = count_flops(model, blocks, example)
        self.flops, self.backward_flops, self.flops_source = counted[0], counted[1], counted[2]
        self._backward_total_flops = counted[3]

    @classmethod
    def of(cls, model: nn.Module, example: torch.Tensor) -> Partition:
        """Partition `model` at its natural blocks (`models.natural_blocks`).

        Traces the forward with torch.fx twice (train and eval mode, every block a leaf) and
        counts FLOPs on `example` with one forward and one backward in eval mode; neither
        changes the model (gradients go to `torch.autograd.grad`, not `.grad`; layer modes
        and `requires_grad` flags are restored). A forward torch.fx cannot trace (a Hugging
        Face model's own) partitions along its layer stack (`models.layer_stack`: embeddings,
        each layer, the head) when it has one: `layer_partition`.

        Args:
            model: the unwrapped model (not a DDP/FSDP wrapper).
            example: an input batch Tensor[b, ...] (b >= 1) on the model's device.

        Returns:
            The partition.

        Raises:
            Unpartitionable: fewer than 2 blocks; blocks that are not submodules or nest; two
                blocks sharing a parameter; a forward torch.fx cannot trace, of a model without
                a layer stack; a block that is not called exactly once as a unit, blocks called
                out of order, or a block's internals used outside it.
        """
        name = type(model).__name__
        blocks = tuple(models.natural_blocks(model))
        if _sharded(model):  # FSDP2 initialises on the root's first forward, before any block's
            saved_modes = modes(model)
            with torch.no_grad():
                model.eval()(example)  # collective: every rank partitions at the same point
            restore_modes(saved_modes)
        probe = extractor(model, blocks)  # also checks count, names and traceability
        for block in blocks:
            nested = [other for other in blocks if other.startswith(block + ".")]
            if nested:
                raise Unpartitionable(name, f"blocks {nested} lie inside block {block!r}")
        try:
            graph, mode_dependent = trace(model, blocks)
        except Untraceable:
            if models.layer_stack(model) is None:
                raise
            return layer_partition(model, blocks, example, probe)
        block_nodes = block_calls(name, graph, blocks)
        params = assign_params(name, model, blocks, block_nodes, graph)
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

    def copied_prefix(self, copied: Collection[str]) -> int:
        """How many leading blocks (never the head) have every parameter named in `copied`
        (state_dict keys a warm start copied unchanged from its parent; a tied parameter
        counts under any of its names). Blocks without parameters carry a prefix on but
        never end one."""
        wanted = set(copied)
        names: dict[int, set[str]] = {}
        for name, p in self._model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), set()).add(name)
        prefix = 0
        for i, group in enumerate(self._params[:-1]):
            if not all(names.get(id(p), set()) & wanted for p in group):
                break
            if group:
                prefix = i + 1
        return prefix

    def modules(self, k: int) -> list[nn.Module]:
        """The submodules of the first k blocks (to put in eval mode when frozen)."""
        self._check(k, 0, len(self.blocks))
        return [self._model.get_submodule(block) for block in self.blocks[:k]]

    def backward_flops_fraction(self, k: int) -> float:
        """Share of the model's backward FLOPs that a frozen prefix of k blocks skips, in [0, 1].

        With the prefix frozen autograd stops at the boundary: the prefix needs neither weight
        gradients nor input gradients (Egeria section 3). Measured:
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
        or top-level glue that differs between train and eval mode; also for a model sharded
        by FSDP2, whose blocks' parameters exist whole only within its own forward.
        `split_reason(k)` says which. Results are memoised.

        Args:
            k: frozen blocks, 1 <= k <= len(blocks) - 1 (the head is never frozen).

        Raises:
            ValueError: k out of range.
        """
        self._check(k, 1, len(self.blocks) - 1)
        if k not in self._splits and self._graph is None:
            self._splits[k] = (f"cannot cut after block {self.blocks[k - 1]!r}: torch.fx cannot "
                               "trace the forward, so the frozen prefix runs there, without "
                               "gradients")
        if k not in self._splits and _sharded(self._model):
            self._splits[k] = (f"cannot cut after block {self.blocks[k - 1]!r}: FSDP shards the "
                               "model, and only its own forward gathers each block's "
                               "parameters, so the frozen prefix runs there, without gradients")
        if k not in self._splits:
            assert self._graph is not None
            self._splits[k] = cut(self._model, self._graph, self.blocks,
                                            self._block_nodes, k,
                                            mode_dependent=self._mode_dependent)
        result = self._splits[k]
        return result if isinstance(result, Split) else None

    def bridge(self, old: int, new: int) -> nn.Module | None:
        """Blocks [old, new) as one module from `split(old)`'s boundary to `split(new)`'s.

        What moves cached prefix outputs forward when the frozen boundary deepens: for a
        boundary Tensor[b, ...] of `split(old).prefix`, ``bridge(old, new)(boundary)`` equals
        `split(new).prefix` of the same inputs, op for op. Holds the model's own submodules
        (nothing is copied); None when either split is None. Results are memoised.

        Args:
            old: frozen blocks before, 1 <= old < new.
            new: frozen blocks after, new <= len(blocks) - 1.

        Raises:
            ValueError: `old` or `new` out of range.
        """
        self._check(old, 1, len(self.blocks) - 2)
        self._check(new, old + 1, len(self.blocks) - 1)
        if self.split(old) is None or self.split(new) is None:
            return None
        if (old, new) not in self._bridges:
            assert self._graph is not None  # else no split
            self._bridges[old, new] = bridge(self._model, self._graph, self._block_nodes,
                                             old, new)
        return self._bridges[old, new]

    def split_reason(self, k: int) -> str:
        """Why `split(k)` is None ("" when it is not). Raises ValueError as `split` does."""
        result = self.split(k)
        return "" if result is not None else str(self._splits[k])

    def _check(self, k: int, low: int, high: int) -> None:
        if not low <= k <= high:
            raise ValueError(
                f"k must be in [{low}, {high}] for {len(self.blocks)} blocks (got {k})"
            )


def layer_partition(model: nn.Module, blocks: Sequence[str], example: torch.Tensor,
                    probe: nn.Module) -> Partition:
    """The `Partition` of a model torch.fx cannot trace, along its natural blocks alone.

    One eval-mode forward of `example` with hooks checks that every block runs once, in
    order, and that nothing inside a block runs outside its call. Block i owns the parameters
    of submodule `blocks[i]`; a parameter tied between blocks (GPT-2's token embedding and
    head) counts with the last of them, and one of no block with the head: neither freezes
    while something behind the frozen prefix uses it (a block may so own none). The model
    never splits (`split` is
    None): the frozen prefix runs in the model's own forward, without gradients.

    Raises:
        Unpartitionable: a block runs twice, out of order, or has internals used outside it.
    """
    _check_block_calls(model, blocks, example)
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for param in model.get_submodule(block).parameters():
            owner[id(param)] = i  # the last block holding a tied parameter keeps it
    groups: list[list[nn.Parameter]] = [[] for _ in blocks]
    for param in model.parameters():
        groups[owner.get(id(param), len(blocks) - 1)].append(param)
    return Partition(model=model, blocks=tuple(blocks), graph=None, block_nodes=(),
                     params=tuple(tuple(group) for group in groups), mode_dependent=False,
                     probe_extractor=probe, example=example)


def _check_block_calls(model: nn.Module, blocks: Sequence[str], example: torch.Tensor) -> None:
    """Run `example` once (eval mode, no gradients) and check how the blocks are called, as
    `block_calls` does on a graph.

    Raises:
        Unpartitionable: naming the block and what it did.
    """
    name, calls, active, strays = type(model).__name__, list[str](), list[str](), list[str]()

    def enter(block: str) -> Callable[[nn.Module, object], None]:
        def hook(module: nn.Module, args: object) -> None:
            calls.append(block)
            active.append(block)
        return hook

    def leave(module: nn.Module, args: object, output: object) -> None:
        active.pop()

    def inner(block: str, path: str) -> Callable[[nn.Module, object], None]:
        def hook(module: nn.Module, args: object) -> None:
            if block not in active:
                strays.append(f"{path!r} of block {block!r}")
        return hook

    handles = []
    for block in blocks:
        module = model.get_submodule(block)
        handles += [module.register_forward_pre_hook(enter(block)),
                    module.register_forward_hook(leave)]
        handles += [sub.register_forward_pre_hook(inner(block, f"{block}.{path}"))
                    for path, sub in module.named_modules() if path]
    saved = modes(model)
    try:
        with torch.no_grad():
            model.eval()(example)
    finally:
        restore_modes(saved)
        for handle in handles:
            handle.remove()
    if strays:
        raise Unpartitionable(name, f"{strays[0]} is used outside the block's forward")
    for block in blocks:
        if calls.count(block) != 1:
            raise Unpartitionable(
                name, f"block {block!r} is called {calls.count(block)} times as a unit "
                "(needs exactly 1)")
    if calls != list(blocks):
        raise Unpartitionable(name, f"its forward runs the blocks in the order {calls}")


# ----------------------------------------------------------------------------------------------
# torch.fx: trace with blocks as leaves, check that they run once each, in order, as units;
# give every parameter to the block that freezing it must stop; cut the graph after a block


def cut(model: nn.Module, graph: fx.Graph, blocks: Sequence[str],
        block_nodes: Sequence[fx.Node], k: int, *, mode_dependent: bool) -> Split | str:
    """The traced `graph` cut after block k-1 and its parameter-free glue, or why not.

    Args:
        model: the model `graph` was traced from (`trace`).
        graph: its eval-mode graph, blocks as leaves.
        blocks: natural block names, head last.
        block_nodes: each block's call node (`block_calls`).
        k: blocks in the prefix, 1 <= k <= len(blocks) - 1.
        mode_dependent: the forward traces differently in train and eval mode.

    Returns:
        The `Split`, or a sentence saying why the prefix output is not one cacheable tensor.
    """
    after = f"after block {blocks[k - 1]!r}"
    if mode_dependent:
        return f"cannot cut {after}: the top-level forward differs between train and eval mode"
    boundary = _glue_end(model, block_nodes[k - 1], set(block_nodes))
    inside = _ancestors(boundary)
    unfed = [b for b, n in zip(blocks[:k], block_nodes[:k]) if n not in inside]
    if unfed:
        return f"cannot cut {after}: block(s) {unfed} do not feed its output"
    crossing, copied = [], []
    for node in graph.nodes:
        # A value of the prefix side (or a model input) that the suffix also reads.
        before = node in inside or node.op == "placeholder"
        if node is boundary or not before or all(user in inside for user in node.users):
            continue
        if node in inside and node.op == "get_attr" and not _is_parameter(model, node):
            copied.append(node)  # a buffer or constant: both sides may read it
        else:
            crossing.append(node.name)
    if crossing:
        return (
            f"cannot cut {after}: {len(crossing) + 1} values cross the boundary "
            f"({[boundary.name, *crossing]}; a skip connection, or the input or a parameter "
            "used on both sides), so the prefix output is not one cacheable tensor"
        )
    prefix, env = fx.Graph(), dict[fx.Node, fx.Node]()
    for node in graph.nodes:
        if node.op == "placeholder" or node in inside:
            env[node] = prefix.node_copy(node, env.__getitem__)
    prefix.output(env[boundary])
    suffix = fx.Graph()
    env = {boundary: suffix.placeholder("boundary")}
    for node in copied:
        env[node] = suffix.node_copy(node, env.__getitem__)
    for node in graph.nodes:
        if node.op != "placeholder" and node not in inside:
            env[node] = suffix.node_copy(node, env.__getitem__)
    return Split(
        prefix=fx.GraphModule(model, prefix, class_name="FrozenPrefix"),
        suffix=fx.GraphModule(model, suffix, class_name="TrainableSuffix"),
        boundary=boundary.name,
    )


def bridge(model: nn.Module, graph: fx.Graph, block_nodes: Sequence[fx.Node], old: int,
           new: int) -> nn.Module:
    """The traced `graph` between the cuts after blocks old-1 and new-1, both valid (`cut`).

    The nodes the deeper cut adds to its prefix, fed by the shallower cut's boundary (its
    only value that crosses, besides buffers and constants, which are copied).
    """
    calls = set(block_nodes)
    start = _glue_end(model, block_nodes[old - 1], calls)
    end = _glue_end(model, block_nodes[new - 1], calls)
    before = _ancestors(start)
    inside = _ancestors(end) - before
    out = fx.Graph()
    env = {start: out.placeholder("boundary")}
    for node in graph.nodes:
        if node not in inside:
            continue
        for arg in node.all_input_nodes:
            if arg not in env:  # a buffer or constant of the shallower prefix
                env[arg] = out.node_copy(arg, env.__getitem__)
        env[node] = out.node_copy(node, env.__getitem__)
    out.output(env[end])
    return fx.GraphModule(model, out, class_name="FrozenBridge")


class _BlockTracer(fx.Tracer):
    """torch.fx tracer that keeps every natural block as one call (a leaf)."""

    def __init__(self, blocks: Sequence[str]) -> None:
        super().__init__()
        self.block_names = frozenset(blocks)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.block_names or super().is_leaf_module(
            m, module_qualified_name
        )


def trace(model: nn.Module, blocks: Sequence[str]) -> tuple[fx.Graph, bool]:
    """The eval-mode graph with blocks as leaves, and whether train mode traces differently."""
    saved = modes(model)
    graphs = []
    try:
        for training in (True, False):
            model.train(training)
            graphs.append(_BlockTracer(blocks).trace(model))
    except TRACE_ERRORS as error:
        raise Untraceable(
            type(model).__name__, f"torch.fx cannot trace its forward ({error})"
        ) from error
    finally:
        restore_modes(saved)
    return graphs[1], str(graphs[0]) != str(graphs[1])


def block_calls(name: str, graph: fx.Graph, blocks: Sequence[str]) -> tuple[fx.Node, ...]:
    """The one call node of each block, checking the blocks run once each, in order, as units."""
    calls: dict[str, list[fx.Node]] = {block: [] for block in blocks}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in calls:
            calls[str(node.target)].append(node)
        elif node.op in ("call_module", "get_attr"):
            owner = _owner(str(node.target), blocks)
            if owner is not None:
                raise Unpartitionable(
                    name, f"{node.target!r} of block {owner!r} is used outside the block's forward"
                )
    for block, nodes in calls.items():
        if len(nodes) != 1:
            raise Unpartitionable(
                name, f"block {block!r} is called {len(nodes)} times as a unit (needs exactly 1)"
            )
    order = [str(n.target) for n in graph.nodes if n.op == "call_module" and n.target in calls]
    if order != list(blocks):
        raise Unpartitionable(name, f"its forward runs the blocks in the order {order}")
    return tuple(calls[block][0] for block in blocks)


def assign_params(
    name: str,
    model: nn.Module,
    blocks: Sequence[str],
    block_nodes: Sequence[fx.Node],
    graph: fx.Graph,
) -> tuple[tuple[nn.Parameter, ...], ...]:
    """Each block's parameters; parameters of no block join the first block that uses them."""
    groups: list[list[nn.Parameter]] = []
    owner_of: dict[int, str] = {}
    for block in blocks:
        groups.append([])
        for param in model.get_submodule(block).parameters():
            if id(param) in owner_of:
                raise Unpartitionable(
                    name,
                    f"blocks {owner_of[id(param)]!r} and {block!r} share a parameter (tied "
                    "weights), so freezing the first would also freeze the second",
                )
            owner_of[id(param)] = block
            groups[-1].append(param)
    index = {node: i for i, node in enumerate(block_nodes)}
    for param_name, param in model.named_parameters():
        if id(param) not in owner_of:
            users = [
                node
                for node in graph.nodes
                if node.op in ("get_attr", "call_module")
                and (param_name == node.target or param_name.startswith(f"{node.target}."))
            ]
            fed = [_first_block_fed(node, index, len(blocks) - 1) for node in users]
            groups[min(fed, default=0)].append(param)
    return tuple(tuple(group) for group in groups)


def _first_block_fed(start: fx.Node, index: dict[fx.Node, int], default: int) -> int:
    """The lowest block index reached from `start` along data flow (`default` if none)."""
    best, stack, seen = default, [start], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in index and node is not start:
            best = min(best, index[node])
        else:
            stack.extend(node.users)
    return best


def _glue_end(model: nn.Module, node: fx.Node, block_nodes: set[fx.Node]) -> fx.Node:
    """Follow `node` through glue that is a function of it alone (ReLU, pooling, flatten).

    Stops at a block, at an op with more inputs or users, at dropout (training semantics), and
    at a module holding parameters or buffers (they must stay trainable or in their mode).
    """
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user in block_nodes or user.op not in ("call_function", "call_method", "call_module"):
            break
        if user.all_input_nodes != [node] or "dropout" in str(user.target).lower():
            break
        if user.op == "call_module":
            module = model.get_submodule(str(user.target))
            stateful = any(True for _ in module.parameters()) or any(True for _ in module.buffers())
            if stateful or "dropout" in type(module).__name__.lower():
                break
        node = user
    return node


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it depends on."""
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(current.all_input_nodes)
    return found


def _sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards `model` (its module is imported by then: no import cost else)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def _owner(target: str, blocks: Sequence[str]) -> str | None:
    return next((b for b in blocks if target == b or target.startswith(f"{b}.")), None)


def _is_parameter(model: nn.Module, node: fx.Node) -> bool:
    return any(node.target == name for name, _ in model.named_parameters())


def modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Every layer of `model` with its train/eval mode, for `restore_modes`."""
    return [(module, module.training) for module in model.modules()]


def restore_modes(saved: list[tuple[nn.Module, bool]]) -> None:
    """Put every layer back in the mode `modes` recorded."""
    for module, training in saved:
        module.training = training


# ----------------------------------------------------------------------------------------------
# FLOPs per block, forward and backward, for the savings estimate


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
    saved_modes, flags = modes(model), [(p, p.requires_grad) for p in model.parameters()]
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
        restore_modes(saved_modes)
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
