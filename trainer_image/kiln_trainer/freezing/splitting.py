"""torch.fx plumbing under `partition`: trace with blocks as leaves, check, own, and cut.

Role: `trace` records a model's forward with every natural block as one call (train and eval
mode, to see whether they differ); `block_calls` checks that the blocks run once each, in
order, as units; `assign_params` gives every parameter to the block that freezing it must
stop; `cut` splits the traced graph after a block (and the parameter-free glue after it) into
a frozen-prefix and a trainable-suffix GraphModule, or says why one tensor cannot carry the
boundary. Also here: `Unpartitionable` and `Split`, re-exported by `partition`, and the layer
mode helpers (`modes`, `restore_modes`) that keep tracing from changing a model.

Callers: `partition` (which re-exports `TRACE_ERRORS`, `Unpartitionable`, `Split`), `flops`
(mode helpers). Non-goals: no FLOP counting (`flops`), no freezing policy, no I/O. Shapes: b
batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import fx, nn

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
        raise Unpartitionable(
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
