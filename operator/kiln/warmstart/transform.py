"""Weight transformation: carry a parent's trained weights into a child along an alignment.

ModelKeeper's structure-aware transformation (Lai et al., NSDI '23, §3) on Net2Net's
function-preserving operators (Chen, Goodfellow, Shlens, ICLR '16): a shape-level plan first
(unit maps, heads, identity layers), then `Builder` writes the tensors. No choice, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import networkx as nx
import torch
from torch import Tensor, nn

from kiln.warmstart import graph as graph_mod
from kiln.warmstart import match

# Given the aligned (parent node, child node) pairs from `match.align`, build the child's initial
# state_dict from the parent's, with the published ModelKeeper code's bugs fixed:
#
# * Aligned pairs are processed in reverse topological order (ModelKeeper's cascading mapping).
#   Each copies the overlapping block, truncating where the parent is larger; spatial kernel
#   dims are CENTRED (a 3x3 parent sits in the middle of a 5x5 child, a 5x5 parent gives its
#   centre to a 3x3 child; the published code pastes at the corner).
# * Wider layers (Net2WiderNet): a child with more output units (dim 0) than its parent fills
#   unit k from parent unit k mod old, plus Gaussian noise of std `noise_std` x std(source unit)
#   on the weight (biases are replicated exactly, under the right key: the published code looks
#   up `layer + "bias"` without the dot). Every weighted layer downstream, reached through
#   weightless element-wise ops, pooling, residual adds, flatten and BatchNorm, reads the widened
#   channels as INPUT slices (dim 1): column j copies parent column map(j) divided by the number
#   of replicas of map(j), so with the noise off the function is preserved. BatchNorm is
#   replicated per channel (no division) and passes the map on (the published DFS stops at BN).
#   Unit maps are derived from shapes alone, before any tensor is written, so processing order
#   never changes the result. Input columns with no known map (their producer is not aligned,
#   or a `cat`/attention op lies between) are zero-filled: the new features get no fan-out.
# * BatchNorm running_mean / running_var / num_batches_tracked travel with their layer
#   (replicated for widened channels); the published code transfers parameters only.
# * Deeper layers (Net2DeeperNet): a run of at most `MAX_IDENTITY_RUN` = 2 inserted (unaligned)
#   weighted layers between transferred layers is identity-initialised: conv -> Dirac at the
#   kernel centre (odd kernels; grouped and depthwise convs per group), linear -> eye,
#   BatchNorm -> gamma 1, beta 0, running mean 0, var 1; dense weights get noise of std
#   `noise_std` / sqrt(fan_in) (the published code adds absolute N(0, 0.05) noise, larger than
#   the identity term on wide convs). A wider one (a new stage's projection shortcut) copies
#   input unit k mod in into unit k and passes the composed unit map on, so the next layer
#   divides the copies' fan-out; only where its output reaches a transferred layer or an add
#   through norms alone (inside a block, copies would start alike). A strided one keeps every
#   stride-th position: the child then computes the parent on a subsampled map. With the noise
#   off, an inserted conv+BN+ReLU or Linear+ReLU whose input is non-negative (after a ReLU)
#   computes the identity (BatchNorm in eval mode is off by a factor 1/sqrt(1 + eps), ~5e-6).
# * Inserted residual branches (a whole new transformer or ResNet block, too long a run for the
#   identity): where a residual `add` has an input that computes what the parent did, each other
#   input's last weighted layer (reached through ops that keep zero at zero) starts at zero
#   weight and bias (`residual_plan`), so the new block adds nothing and the child computes the
#   parent's function (a new stage's projection shortcut, identity-initialised as above, is
#   such an input); an add with no such input is left alone. The rest of such a block keeps
#   the child's init and learns once the zeroed layer moves (its gradient is not zero).
#   Without it the new block's init shifts the function: little where blocks start small (a
#   transformer's projections: 0.005 nats), much where they do not.
# * Heads (aligned dense layers with no weighted layer downstream): when the output count
#   differs (10 -> 100 classes), the overlapping rows are copied and the other rows keep the
#   child's init; `TransformResult.notes` says so. Classes are not replicated.
# * Other aligned layers (LayerNorm, Embedding, attention) get a plain overlapping-block copy;
#   everything else (unaligned layers outside short runs, state_dict entries no graph node
#   names) keeps the child's init. Inputs are never mutated. `lr_damping`: see its docstring.
#
# Shapes: O output units, I input units (per group for grouped convs), k kernel dims.



class TransformError(ValueError):
    """A graph, state_dict and alignment that do not belong together (names a missing key)."""


@dataclasses.dataclass(frozen=True)
class TransformResult:
    """The child's warm-started state_dict and what went into it.

    Attributes:
        state_dict: the full child state_dict (every key of the child's), ready for
            `load_state_dict(strict=True)`.
        matched_tensors: child parameter tensors that received parent values.
        total_tensors: child parameter tensors named by the child graph's nodes.
        transferred_params: those parameter keys, in the order written.
        identity_initialised: child keys (parameters and BN buffers) set to the identity, or
            zeroed to drop an inserted residual branch (`residual_plan`).
        untransferred_fraction: 1 - matched_tensors / total_tensors (1.0 when total is 0).
        transferred_buffers: child buffer keys (BN statistics) copied from the parent.
        unchanged: child keys (parameters and buffers) holding their parent tensor exactly: same
            shape, not widened, truncated, padded or perturbed (layer freezing may start there).
        notes: one sentence per special case (head resized, identity skipped, bias dropped).
        similarity: the alignment's similarity in [0, 1].
    """

    state_dict: dict[str, Tensor]
    matched_tensors: int
    total_tensors: int
    transferred_params: list[str]
    identity_initialised: list[str]
    untransferred_fraction: float
    transferred_buffers: list[str] = dataclasses.field(default_factory=list)
    unchanged: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    similarity: float = 0.0


def transform(
    parent_state: Mapping[str, Tensor],
    parent_graph: nx.DiGraph,
    child_state: Mapping[str, Tensor],
    child_graph: nx.DiGraph,
    alignment: match.Alignment,
    *,
    noise_std: float = 0.01,
    generator: torch.Generator | None = None,
) -> TransformResult:
    """Build the child's initial state_dict from the parent's (rules in the comment at the top).

    Args:
        parent_state: the parent's state_dict (tensors on any device; read only).
        parent_graph: the parent's architecture graph (`graph.extract` / `graph.from_json`).
        child_state: a freshly initialised state_dict of the child (read only).
        child_graph: the child's architecture graph.
        alignment: `match.align(parent_graph, child_graph)`.
        noise_std: relative noise on replicated units (x std of the source unit) and, divided
            by sqrt(fan_in), absolute noise on identity-initialised dense weights; 0 turns
            noise off (exact function preservation).
        generator: random source for the noise (CPU); None uses torch's global generator.

    Returns:
        The `TransformResult`; its state_dict holds new tensors on the child's devices/dtypes.

    Raises:
        TransformError: a graph names a state_dict key that is missing, or an aligned pair
            names a node that is not in its graph.
        ValueError: noise_std is negative.
    """
    if noise_std < 0:
        raise ValueError(f"noise_std must be >= 0 (got {noise_std})")
    _check_keys(parent_graph, parent_state, "parent")
    _check_keys(child_graph, child_state, "child")
    pairs = _pairs(alignment, parent_graph, child_graph)
    order = list(nx.topological_sort(child_graph))
    build = Builder(parent_state, child_state, noise_std=noise_std, generator=generator)
    identity, notes = identity_plan(child_graph, order, set(pairs), child_state)
    build.notes.extend(notes)
    branch_ends = residual_plan(child_graph, order, set(pairs), identity)
    if branch_ends:
        build.notes.append("inserted residual branches start at zero, so each new block starts "
                           f"as the identity: {', '.join(branch_ends)}")
    heads = head_layers(child_graph, order, pairs)
    maps = unit_maps(parent_graph, child_graph, order, pairs, identity, heads)
    for v in reversed(order):  # ModelKeeper's cascading order (maps are fixed already)
        if v in pairs:
            in_map = merge_maps(maps, child_graph.predecessors(v))
            build.transfer(parent_graph.nodes[pairs[v]], child_graph.nodes[v], v,
                           in_map=in_map, out_map=maps[v], head=v in heads)
    for v in identity:
        build.identity(child_graph.nodes[v])
    for v in branch_ends:
        build.zero(child_graph.nodes[v])
    total_keys = {k for _, a in child_graph.nodes(data=True) for k in a.get("params", [])}
    matched = [k for k in build.params if k in total_keys]
    total = len(total_keys)
    return TransformResult(
        state_dict=build.state_dict(), matched_tensors=len(matched), total_tensors=total,
        transferred_params=build.params, identity_initialised=build.identity_keys,
        untransferred_fraction=1.0 - len(matched) / total if total else 1.0,
        transferred_buffers=build.buffers, unchanged=build.unchanged, notes=build.notes,
        similarity=alignment.similarity)


def warm_start_state(
    parent_state: Mapping[str, Tensor],
    parent_graph: nx.DiGraph,
    child_model: nn.Module,
    child_input_shape: Sequence[int],
    *,
    noise_std: float = 0.01,
    generator: torch.Generator | None = None,
) -> TransformResult:
    """Extract the child's graph, align it to the parent's, and transform the weights.

    The child model is not modified: load `result.state_dict` into it.

    Args:
        parent_state: the parent's state_dict (e.g. `records.load_weights`).
        parent_graph: the parent's graph (e.g. `graph.from_json(records.load_graph(...))`).
        child_model: the freshly initialised child.
        child_input_shape: one sample's shape without the batch: [C, H, W] or [T].
        noise_std: see `transform`.
        generator: see `transform`.

    Returns:
        The `TransformResult` (its `similarity` is the alignment's).

    Raises:
        graph.GraphError: the child cannot be traced or matched (the caller cold-starts).
        TransformError: the parent graph does not match the parent state_dict.
    """
    child_graph = graph_mod.extract(child_model, child_input_shape)
    alignment = match.align(parent_graph, child_graph)
    result = transform(parent_state, parent_graph, child_model.state_dict(), child_graph,
                       alignment, noise_std=noise_std, generator=generator)
    _follow_ties(result.state_dict, set(result.transferred_params), child_model)
    return result


def _follow_ties(state: dict[str, Tensor], written: set[str], child_model: nn.Module) -> None:
    """Give every name of a tied parameter the value transferred into one of them.

    A tied parameter (a language model's head sharing the token embedding) is one tensor under
    several state_dict keys, and a graph names only one of them; loading the others' stale
    child init afterwards would overwrite the transferred value.
    """
    names: dict[int, list[str]] = {}
    for name, param in child_model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for tied in names.values():
        source = next((n for n in tied if n in written), None)
        if source is not None and len(tied) > 1:
            for name in tied:
                state[name] = state[source]


def lr_damping(
    untransferred: float,
    step: int,
    *,
    steps_per_epoch: int,
    total_steps: int,
    warm_epochs: int = 2,
    max_fraction: float = 0.2,
    floor: float = 0.3,
) -> float:
    """Learning-rate multiplier after a warm start: the more was inherited, the gentler at first.

    ModelKeeper (NSDI '23, its `ray_tuner.py`) trains the first 2 epochs at
    base_lr x clip(1 - matched / parent_layers, 0.3, 1) and then restores base_lr, so the
    inherited weights are not wrecked by a full learning rate. Kiln damps by what the probe
    measured was NOT inherited, 1 - `transfer_quality` (the untransferred tensor fraction only
    for a start the trainer did not probe): counted tensors damp hardest exactly when a
    transfer broke the function, the measured loss does not. ModelKeeper's runs last tens of
    epochs; a short run is damped for at most `max_fraction` of its steps, else a 2-epoch run
    would fine-tune a weaker parent's function at a third of its rate to the end (measured: a
    child with a new stage ended 1.9 points below cold; damped for its first fifth, 0.5 above).

        damped     = min(warm_epochs x steps_per_epoch, ceil(max_fraction x total_steps))
        multiplier = clip(untransferred, floor, 1)   if step < damped
                   = 1                                otherwise

    A cold start (1) is undamped; a perfect transfer (0) starts at `floor`.

    Args:
        untransferred: 1 - `transfer_quality(...)`, or the untransferred tensor fraction
            (`TransformResult.untransferred_fraction`), in [0, 1].
        step: the 0-based optimizer step about to run.
        steps_per_epoch: optimizer steps per epoch, >= 1.
        total_steps: optimizer steps in the whole run, >= 1.
        warm_epochs: how many first epochs are damped at most (ModelKeeper: 2).
        max_fraction: the largest share of the run that is damped, in [0, 1].
        floor: smallest multiplier (ModelKeeper: 0.3).

    Returns:
        The multiplier in [floor, 1].

    Raises:
        ValueError: untransferred or max_fraction outside [0, 1], a negative step or
            warm_epochs, steps_per_epoch or total_steps below 1, or floor outside (0, 1].
    """
    if not 0.0 <= untransferred <= 1.0:
        raise ValueError(f"untransferred must be in [0, 1] (got {untransferred})")
    if step < 0 or warm_epochs < 0:
        raise ValueError(f"step and warm_epochs must be >= 0 (got {step}, {warm_epochs})")
    if steps_per_epoch < 1 or total_steps < 1:
        raise ValueError("steps_per_epoch and total_steps must be >= 1 "
                         f"(got {steps_per_epoch}, {total_steps})")
    if not 0.0 <= max_fraction <= 1.0:
        raise ValueError(f"max_fraction must be in [0, 1] (got {max_fraction})")
    if not 0.0 < floor <= 1.0:
        raise ValueError(f"floor must be in (0, 1] (got {floor})")
    if step >= min(warm_epochs * steps_per_epoch, math.ceil(max_fraction * total_steps)):
        return 1.0
    return min(1.0, max(floor, untransferred))


def transfer_quality(warm_loss: float, cold_loss: float) -> float:
    """How much of the cold start's probe loss the warm start removed: clip(1 - warm / cold, 0,
    1); 0 when either loss is not a finite positive number (nothing measured was inherited)."""
    if not (math.isfinite(warm_loss) and math.isfinite(cold_loss) and cold_loss > 0):
        return 0.0
    return min(1.0, max(0.0, 1.0 - warm_loss / cold_loss))


def _pairs(alignment: match.Alignment, parent_graph: nx.DiGraph,
           child_graph: nx.DiGraph) -> dict[str, str]:
    """child node -> parent node for aligned pairs that carry tensors on both sides."""
    pairs = {}
    for p, c in alignment.pairs:
        if p not in parent_graph or c not in child_graph:
            side = "parent" if p not in parent_graph else "child"
            raise TransformError(f"aligned pair ({p}, {c}) names a node missing from the "
                                 f"{side} graph; align these two graphs again")
        if all(a.get("params") or a.get("buffers")
               for a in (parent_graph.nodes[p], child_graph.nodes[c])):
            pairs[c] = p
    return pairs


def _check_keys(g: nx.DiGraph, state: Mapping[str, Tensor], side: str) -> None:
    """Every parameter a graph names must be in the state_dict (buffers may be
    non-persistent, so a missing buffer only keeps the child's init)."""
    missing = [k for _, a in g.nodes(data=True) for k in a.get("params", []) if k not in state]
    if missing:
        raise TransformError(f"the {side} graph names {len(missing)} keys missing from its "
                             f"state_dict (e.g. {', '.join(missing[:3])}); graph and weights "
                             "do not belong together")


# The shape-level plan of a transfer, decided before any tensor is written, from graphs and
# shapes only: which parent unit each child unit copies (`unit_maps`, Net2WiderNet, Chen et
# al. ICLR '16), which aligned dense layers are heads (`head_layers`), and which inserted layers
# can start as the identity (`identity_plan`, Net2DeeperNet; ModelKeeper's `pad_mapping`). Also
# the node helpers both halves use: `layer_kind` and `dense_keys`. Because unit maps come from
# shapes alone, the order in which `Builder` later writes tensors never changes them.
MAX_IDENTITY_RUN = 2
"""Longest run of inserted weighted layers that is identity-initialised (ModelKeeper: gap < 4)."""

_DENSE_OPS = frozenset({"Conv1d", "Conv2d", "Conv3d", "Linear", "LazyLinear",
                        "NonDynamicallyQuantizableLinear"})
_CHANNEL_NORMS = frozenset({"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"})
# Activations and pooling that map zero to zero, feature by feature.
_ZERO_AT_ZERO = frozenset({
    "ReLU", "ReLU6", "GELU", "SiLU", "Tanh", "Hardswish", "ELU", "LeakyReLU", "Mish", "Hardtanh",
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
})
# Weightless ops that act on each feature separately (or pool over space) and so keep a unit map.
_PASSTHROUGH = frozenset({*_ZERO_AT_ZERO, "Sigmoid", "Hardsigmoid", "add", "sub", "mul", "div",
                          *_CHANNEL_NORMS})
# Separate query, key and value projections, whose rows split into heads (a fused projection's
# rows are three such blocks: it keeps the k mod width map).
_SPLIT_PROJECTIONS = ("_query", "_key", "_value")
# Aligned weighted nodes whose parameters index features along their last dimension.
_FEATURES_LAST = frozenset({"Embedding", "LayerNorm", "RMSNorm", "add", "cat"})



@dataclasses.dataclass(frozen=True)
class UnitMap:
    """Child unit k of a layer's output copies parent unit `index[k]` (of `parent_width`)."""

    index: tuple[int, ...]
    parent_width: int


def identity_plan(g: nx.DiGraph, order: list[str], aligned: set[str],
                  state: Mapping[str, Tensor]) -> tuple[list[str], list[str]]:
    """Inserted layers in runs of <= MAX_IDENTITY_RUN between transferred layers that can be
    identity-initialised, and a note for each of the others saying why not.

    The run through layer v is fwd(v) + bwd(v) - 1, where fwd counts inserted weighted layers
    from the nearest transferred ancestor down to v (shortest path, weightless nodes free) and
    bwd the same towards the nearest transferred descendant (ModelKeeper `pad_mapping`).

    Args:
        g: the child graph.
        order: its nodes in topological order.
        aligned: child nodes aligned to a parent node.
        state: the child's state_dict (for weight shapes).

    Returns:
        (layers to identity-initialise, in `order`; notes on the others).
    """
    weighted = {v for v in order if g.nodes[v].get("params")}
    transferred = weighted & aligned
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    for gaps, nodes, nbrs in ((fwd, order, g.predecessors), (bwd, order[::-1], g.successors)):
        for v in nodes:
            base = min((gaps[u] for u in nbrs(v)), default=math.inf)
            gaps[v] = 0.0 if v in transferred else base + (v in weighted)
    plan: list[str] = []
    notes: list[str] = []
    for v in order:
        if v in transferred or v not in weighted or fwd[v] + bwd[v] - 1 > MAX_IDENTITY_RUN:
            continue
        problem = _identity_problem(g, v, state, transferred)
        if problem is None:
            plan.append(v)
        else:
            notes.append(f"inserted layer {v} ({g.nodes[v]['op']}) keeps the child's "
                         f"init: {problem}")
    return plan, notes


# Weightless ops through which a branch whose last weighted layer outputs zero still does.
_ZERO_KEEPING = frozenset({*_ZERO_AT_ZERO, "Dropout", "Dropout1d", "Dropout2d", "Dropout3d",
                           "Identity"})


def residual_plan(g: nx.DiGraph, order: list[str], aligned: set[str],
                  identity: Sequence[str]) -> list[str]:
    """Inserted layers that end a residual branch: zeroing them drops the branch.

    An `add` with one input that computes what the parent computed (a *clean* input: every
    weighted layer above it transferred or identity-initialised, any branch joined on the way
    dropped) keeps that input alone: each other input whose producer is an inserted layer,
    reached through `_ZERO_KEEPING` ops with no fan-out, is dropped by zeroing that layer. An
    add with no clean input (a projection shortcut that could not start as an identity) is
    left alone: zeroing would cut the signal, not keep the parent's.

    Returns:
        The layers to zero, in `order`.
    """
    weighted = {v for v in order if g.nodes[v].get("params")}
    kept = (weighted & aligned) | set(identity)
    clean: dict[str, bool] = {}
    zero: set[str] = set()  # nodes whose output is zero once the plan is applied
    plan: list[str] = []
    for v in order:
        preds = list(g.predecessors(v))
        if g.nodes[v]["op"] == "add" and v not in weighted and any(clean[u] for u in preds):
            for u in preds:
                if not clean[u] and u not in zero:
                    end, path = _branch_end(g, u, weighted, kept)
                    if end is not None:
                        plan.append(end)
                        zero.update(path)
            clean[v] = all(clean[u] or u in zero for u in preds)
        elif v in weighted:
            clean[v] = v in kept and all(clean[u] for u in preds)
        else:
            clean[v] = bool(preds) and all(clean[u] for u in preds)
    return sorted(plan, key=order.index)


def _branch_end(g: nx.DiGraph, node: str, weighted: set[str],
                kept: set[str]) -> tuple[str | None, set[str]]:
    """The inserted layer a branch ends with, walking up from `node` (an add's input) through
    zero-keeping ops, and the nodes walked; (None, ...) if there is none, or a node on the way
    feeds anything else."""
    path = {node}
    while node not in weighted:
        preds = list(g.predecessors(node))
        if g.nodes[node]["op"] not in _ZERO_KEEPING or len(preds) != 1:
            return None, path
        node = preds[0]
        path.add(node)
    if node in kept or any(g.out_degree(u) != 1 for u in path):
        return None, path
    return node, path


def _identity_problem(g: nx.DiGraph, v: str, state: Mapping[str, Tensor],
                      transferred: set[str]) -> str | None:
    """Why layer v cannot compute the identity, or None if it can.

    A wider layer copies input unit k mod in to output unit k (Net2WiderNet on the identity)
    only where its output reaches a transferred layer or a residual add through norms and
    weightless ops alone (a new stage's projection shortcut): inside a block, copies would make
    the block's units start alike, and the block's own init learns better."""
    node = g.nodes[v]
    kind = layer_kind(node)
    if kind == "norm":
        return None
    weight_key = dense_keys(node, state)[0] if kind == "dense" else ""
    if not weight_key:
        return f"no identity initialisation for {node['op']}"
    shape = list(state[weight_key].shape)
    inputs = shape[1]
    if len(shape) > 2:  # a conv: its kernel centre, and its input and output maps
        in_shape, out_shape = _input_shape(g, v), list(node.get("out_shape", []))
        if any(k % 2 == 0 for k in shape[2:]):
            return f"even kernel {shape[2:]} has no centre"
        if not in_shape or len(in_shape) < 2:
            return "its input shape is unknown"
        if in_shape[1] % shape[1]:
            return f"{in_shape[1]} input channels are not groups of {shape[1]}"
        inputs = in_shape[1]
        if inputs != shape[1] and shape[0] != inputs:  # grouped: one identity per group
            return f"grouped conv: {inputs} input channels -> {shape[0]} output channels"
        if len(out_shape) != len(in_shape) or any(
                o > i for o, i in zip(out_shape[2:], in_shape[2:], strict=True)):
            return f"output shape {out_shape} is larger than input shape {in_shape}"
    if shape[0] < inputs:
        return f"narrower ({inputs} -> {shape[0]})"
    if shape[0] > inputs and not _feeds_join(g, v, transferred):
        return (f"wider ({inputs} -> {shape[0]}) inside a block: its units keep the child's "
                "init so that they differ")
    return None


def _feeds_join(g: nx.DiGraph, v: str, transferred: set[str]) -> bool:
    """Every path down from v reaches a transferred layer or an `add` through norms and
    weightless ops only."""
    stack, seen = list(g.successors(v)), set()
    while stack:
        w = stack.pop()
        if w in seen or w in transferred or g.nodes[w]["op"] == "add":
            continue
        seen.add(w)
        if g.nodes[w].get("params") and layer_kind(g.nodes[w]) != "norm":
            return False
        stack.extend(g.successors(w))
    return True


def head_layers(g: nx.DiGraph, order: list[str], pairs: Mapping[str, str]) -> set[str]:
    """Aligned dense layers with no weighted layer downstream (classifiers, LM heads)."""
    below: dict[str, bool] = {}
    for v in reversed(order):
        below[v] = any(bool(g.nodes[w].get("params")) or below[w] for w in g.successors(v))
    return {v for v in pairs if not below[v] and layer_kind(g.nodes[v]) == "dense"}


def unit_maps(parent_graph: nx.DiGraph, g: nx.DiGraph, order: list[str],
              pairs: Mapping[str, str], identity: list[str],
              heads: set[str]) -> dict[str, UnitMap | None]:
    """Per child node, which parent unit each of its output units copies (None: unknown)."""
    maps: dict[str, UnitMap | None] = {}
    identities = set(identity)
    for v in order:
        node = g.nodes[v]
        kind = layer_kind(node)
        in_map = merge_maps(maps, g.predecessors(v))
        p_shape = parent_graph.nodes[pairs[v]].get("weight_shape") if v in pairs else None
        if p_shape and node.get("weight_shape") and kind != "other" and v not in heads:
            p_width, c_width = int(p_shape[0]), int(node["weight_shape"][0])
            p_heads, c_heads = int(parent_graph.nodes[pairs[v]].get("heads", 0)), \
                int(node.get("heads", 0))
            if kind == "norm" and in_map and in_map.parent_width == p_width \
                    and len(in_map.index) == c_width:
                maps[v] = in_map  # BatchNorm follows its producer's replicas
            elif p_heads and c_heads and not p_width % p_heads and not c_width % c_heads \
                    and str(node["op"]).endswith(_SPLIT_PROJECTIONS):
                maps[v] = head_map(p_width, p_heads, c_width, c_heads)
            else:
                maps[v] = UnitMap(tuple(k % p_width for k in range(c_width)), p_width)
        elif v in identities and in_map and kind == "dense" \
                and int(node["weight_shape"][0]) != len(in_map.index):
            # a wider identity (a new stage's projection): unit k copies input unit k mod in
            maps[v] = UnitMap(tuple(in_map.index[k % len(in_map.index)]
                                    for k in range(int(node["weight_shape"][0]))),
                              in_map.parent_width)
        elif v in identities or (not node.get("params") and node["op"] in _PASSTHROUGH):
            maps[v] = in_map
        elif p_shape and node.get("weight_shape") and node["op"] in _FEATURES_LAST:
            maps[v] = _features_last_map(node["op"], int(p_shape[-1]),
                                         int(node["weight_shape"][-1]), in_map)
        elif node["op"] in ("scaled_dot_product_attention", "matmul"):
            # attention (or its last matmul, weights @ values): each output unit is its value
            # unit mixed over positions by its head's pattern, so it copies what that value
            # unit copies where heads were mapped whole (`head_map`)
            values = [u for u in g.predecessors(v) if str(g.nodes[u]["op"]).endswith("_value")]
            known = len(values) == 1 and g.nodes[values[0]].get("heads")
            maps[v] = maps.get(values[0]) if known else None
        else:
            maps[v] = None
    return maps


def _features_last_map(op: str, p_width: int, c_width: int,
                       in_map: UnitMap | None) -> UnitMap | None:
    """The unit map out of an aligned node with features last: an embedding's table starts one
    (k mod width); a layer norm, or the `add`/`cat` of a ViT's positions and class token,
    passes its input's on when the widths agree (a layer norm over uniformly replicated
    features computes the parent's mean and variance). None when the widths disagree."""
    if op == "Embedding":
        return UnitMap(tuple(k % p_width for k in range(c_width)), p_width)
    if in_map is not None and len(in_map.index) == c_width and in_map.parent_width == p_width:
        return in_map
    return None


def head_map(p_width: int, p_heads: int, c_width: int, c_heads: int) -> UnitMap:
    """The unit map of an attention projection that keeps heads whole: child head h copies
    parent head h x p_heads // c_heads, its units in turn (wrapping), each further child head
    on the same parent head continuing where the previous one stopped.

    With the head width a multiple of the parent's, or the same width and heads a multiple,
    every child head computes its parent head's attention exactly (`query_scale` corrects
    the score scale); otherwise each child head still attends like one parent head, on a
    subset of its units. A plain k mod width map would split heads across parent heads.
    """
    p_dim, c_dim = p_width // p_heads, c_width // c_heads
    index: list[int] = []
    seen: dict[int, int] = {}  # parent head -> child heads mapped onto it so far
    for h in range(c_heads):
        g = h * p_heads // c_heads
        r = seen.get(g, 0)
        seen[g] = r + 1
        index.extend(g * p_dim + (r * c_dim + i) % p_dim for i in range(c_dim))
    return UnitMap(tuple(index), p_width)


def query_scale(p_node: Mapping[str, Any], c_node: Mapping[str, Any]) -> float:
    """Factor on a query projection mapped by `head_map`: attention scores are divided by the
    square root of the head width, and a child head of c_dim units whose units repeat the
    parent head's p_dim ones sums c_dim / p_dim times the parent's score; sqrt(p_dim / c_dim)
    restores it (exactly when c_dim is a multiple of p_dim). 1 elsewhere."""
    if not str(c_node["op"]).endswith("_query"):
        return 1.0
    p_heads, c_heads = int(p_node.get("heads", 0)), int(c_node.get("heads", 0))
    p_shape, c_shape = p_node.get("weight_shape") or [], c_node.get("weight_shape") or []
    if not (p_heads and c_heads and p_shape and c_shape):
        return 1.0
    p_dim, c_dim = int(p_shape[0]) // p_heads, int(c_shape[0]) // c_heads
    return math.sqrt(p_dim / c_dim) if p_dim and c_dim else 1.0


def merge_maps(maps: Mapping[str, UnitMap | None], preds: Iterable[str]) -> UnitMap | None:
    """The common map of all inputs (an add of replicated branches), else None."""
    found = [maps.get(u) for u in preds]
    if not found or found[0] is None or any(m != found[0] for m in found[1:]):
        return None
    return found[0]


def expand_columns(m: UnitMap | None, c_in: int, p_in: int) -> list[int] | None:
    """Input-column map of a consumer with c_in (child) / p_in (parent) columns.

    A flatten between a conv and a linear makes each channel f = H x W consecutive columns
    (channel-major), so channel map m becomes column map j -> m[j // f] * f + j % f.
    """
    if m is None or not m.index or c_in % len(m.index):
        return None
    f = c_in // len(m.index)
    if p_in != m.parent_width * f:
        return None
    return [m.index[j // f] * f + j % f for j in range(c_in)]


def layer_kind(node: dict[str, Any]) -> str:
    """The node's kind for the transfer rules: "dense" (Conv/Linear), "norm" or "other"."""
    op = str(node["op"])
    if op.split("_")[0] in _DENSE_OPS:
        return "dense"
    return "norm" if op in _CHANNEL_NORMS else "other"


def dense_keys(node: dict[str, Any], tensors: Mapping[str, Tensor]) -> tuple[str, str | None]:
    """(weight key, bias key or None) of a Conv/Linear node; ("", None) if not found.

    The weight is the parameter whose shape is the node's weight_shape (rank >= 2); the bias a
    1-D parameter with one entry per output unit.
    """
    shape = [int(d) for d in node.get("weight_shape", [])]
    params = [k for k in node.get("params", []) if k in tensors]
    weight = next((k for k in params if list(tensors[k].shape) == shape and len(shape) >= 2), "")
    if not weight:
        return "", None
    bias = next((k for k in params if k != weight and tensors[k].ndim == 1
                 and tensors[k].shape[0] == shape[0]), None)
    return weight, bias


def _input_shape(g: nx.DiGraph, v: str) -> list[int] | None:
    """The common out_shape of v's producers, or None (no producer, or producers disagree)."""
    shapes = {tuple(g.nodes[u].get("out_shape", [])) for u in g.predecessors(v)}
    return list(shapes.pop()) if len(shapes) == 1 and () not in shapes else None


# The tensor operators: write the tensors, following the plan made from shapes. `Builder.transfer`
# copies one aligned pair: the overlapping block with CENTRED kernel dims (`_paste`), input columns
# by unit map divided by their replica count and output rows replicated with noise (Net2WiderNet,
# Chen et al. ICLR '16), head rows copied where they overlap, biases and BatchNorm statistics with
# their layer. `Builder.identity` initialises an inserted layer as the identity (Net2DeeperNet:
# Dirac/eye, BatchNorm gamma 1, beta 0). It records what it wrote and why (`params`, `buffers`,
# `identity_keys`, `notes`).


class Builder:
    """The child's new state_dict plus the bookkeeping of what was written and why."""

    def __init__(self, parent_state: Mapping[str, Tensor], child_state: Mapping[str, Tensor],
                 *, noise_std: float, generator: torch.Generator | None) -> None:
        self.parent = parent_state
        self.child = child_state  # read only: the child's init
        self.new: dict[str, Tensor] = {}  # keys written so far
        self.noise_std = noise_std
        self.generator = generator
        self.params: list[str] = []
        self.buffers: list[str] = []
        self.identity_keys: list[str] = []
        self.unchanged: list[str] = []
        self.notes: list[str] = []
        self.written: set[str] = set()

    def transfer(self, p_node: dict[str, Any], c_node: dict[str, Any], name: str, *,
                 in_map: UnitMap | None, out_map: UnitMap | None,
                 head: bool) -> None:
        """Copy one aligned pair's tensors into the child."""
        kind = layer_kind(c_node)
        if kind == "dense" and dense_keys(p_node, self.parent)[0] \
                and dense_keys(c_node, self.child)[0]:
            self._dense(p_node, c_node, name, in_map=in_map, out_map=out_map, head=head)
            return
        for pk, ck in _pair_keys(p_node, c_node, self.parent, self.child):
            if ck in self.written:
                continue
            p, c = self._parent(pk, ck), self.child[ck].detach()
            if out_map and p.ndim == c.ndim >= 1 and c.shape[:-1] == p.shape[:-1] \
                    and c.shape[-1] == len(out_map.index) and p.shape[-1] == out_map.parent_width:
                # features last (norms, embeddings, a ViT's class token and positions): they
                # follow the unit map, so replicated features stay equal
                self._write(ck, p[..., list(out_map.index)], c_node,
                            unchanged=list(out_map.index) == list(range(p.shape[-1])))
            elif p.ndim == c.ndim:
                self._write(ck, _paste(c, p, centre_from=c.ndim), c_node,
                            unchanged=c.shape == p.shape)
            else:
                self.notes.append(f"{ck}: parent tensor {pk} has rank {p.ndim}, the child's "
                                  f"{c.ndim}; it keeps the child's init")

    def _dense(self, p_node: dict[str, Any], c_node: dict[str, Any], name: str, *,
               in_map: UnitMap | None, out_map: UnitMap | None, head: bool) -> None:
        """Conv/Linear: centred kernels, input columns by map (divided), rows by the output
        map (k mod old by default; whole heads for attention projections)."""
        (pw_key, pb_key), (cw_key, cb_key) = (dense_keys(p_node, self.parent),
                                              dense_keys(c_node, self.child))
        if cw_key in self.written:  # a shared (tied) weight, written through another node
            return
        c, p = self.child[cw_key].detach(), self._parent(pw_key, cw_key)
        if p.ndim != c.ndim:
            self.notes.append(f"{cw_key}: parent weight {list(p.shape)} and child weight "
                              f"{list(c.shape)} differ in rank; it keeps the child's init")
            return
        c_out, c_in, p_out, p_in = c.shape[0], c.shape[1], p.shape[0], p.shape[1]
        rows = (list(out_map.index) if out_map is not None and len(out_map.index) == c_out
                and out_map.parent_width == p_out else [k % p_out for k in range(c_out)])
        scale_by = query_scale(p_node, c_node)
        block = p
        if c.shape[2:] != p.shape[2:]:
            block = _paste(p.new_zeros((*p.shape[:2], *c.shape[2:])), p, centre_from=2)
        columns = expand_columns(in_map, c_in, p_in)
        if columns is not None and columns != list(range(p_in)):
            # Net2WiderNet: replicas of an input unit share its fan-out equally.
            counts = torch.bincount(torch.tensor(columns), minlength=p_in).to(c.dtype)
            shape = (1, c_in) + (1,) * (c.ndim - 2)
            block = block[:, columns] / counts[columns].reshape(shape).to(block.device)
        elif c_in != p_in:  # truncate, or zero fan-in from inputs the parent never had
            block = _paste(block.new_zeros((p_out, c_in, *block.shape[2:])), block,
                           centre_from=c.ndim)
        if head:
            overlap = min(c_out, p_out)
            weight = c.clone()
            weight[:overlap] = block[:overlap]
            if c_out != p_out:
                self.notes.append(
                    f"head {name} ({c_node['op']}): {p_out} -> {c_out} outputs; copied the "
                    f"{overlap} overlapping rows, the other {max(0, c_out - p_out)} keep the "
                    "child's init")
        else:  # Net2WiderNet: row k copies parent row rows[k]; repeats get noise (symmetry)
            weight = block[rows]  # a copy (advanced indexing)
            repeats, copied = [], set()
            for k, r in enumerate(rows):
                if r in copied:
                    repeats.append(k)
                copied.add(r)
            if repeats and self.noise_std > 0:
                scale = weight[repeats].flatten(1).std(dim=1, unbiased=False) * self.noise_std
                noise = self._noise((len(repeats), *weight.shape[1:]), weight)
                weight[repeats] += noise * scale.reshape(-1, *[1] * (c.ndim - 1))
            weight *= scale_by
        # the parent's tensor itself: no kernel centring, column map or padding, no new rows
        self._write(cw_key, weight, c_node,
                    unchanged=block is p and c.shape == p.shape and rows == list(range(p_out))
                    and scale_by == 1.0)
        if cb_key is not None:
            if pb_key is not None:
                pb = self._parent(pb_key, cb_key)
                cb = self.child[cb_key].detach()
                if head:
                    overlap = min(c_out, p_out)
                    bias = cb.clone()
                    bias[:overlap] = pb[:overlap]
                else:
                    bias = pb[rows] * scale_by
                self._write(cb_key, bias, c_node, unchanged=cb.shape == pb.shape
                            and rows == list(range(p_out)) and scale_by == 1.0)
            else:  # the parent computes no bias: zero it where the parent's units are
                bias = self.child[cb_key].detach().clone()
                bias[: c_out if not head else min(c_out, p_out)] = 0
                self.new[cb_key] = bias
        elif pb_key is not None:
            self.notes.append(f"{name}: the parent's bias {pb_key} is dropped (the child's "
                              "layer has none)")

    def identity(self, node: dict[str, Any]) -> None:
        """Identity-initialise one inserted layer (`identity_plan` chose it)."""
        if layer_kind(node) == "norm":
            values = {"weight": 1.0, "bias": 0.0, "running_mean": 0.0, "running_var": 1.0}
            for key in [*node["params"], *node.get("buffers", [])]:
                local = key.rsplit(".", 1)[-1]
                if local in values and key not in self.written:
                    self._set_identity(key, torch.full_like(self.child[key], values[local]))
            return
        w_key, b_key = dense_keys(node, self.child)
        if w_key in self.written:
            return
        w = torch.zeros_like(self.child[w_key])
        out_units, per_group = w.shape[0], w.shape[1]
        units = torch.arange(out_units)
        centre = [torch.full_like(units, k // 2) for k in w.shape[2:]]
        w[(units, units % per_group, *centre)] = 1.0  # eye for Linear, Dirac for convs
        if self.noise_std > 0:
            fan_in = math.prod(w.shape[1:])
            w += self._noise(tuple(w.shape), w) * (self.noise_std / math.sqrt(fan_in))
        self._set_identity(w_key, w)
        if b_key is not None and b_key not in self.written:
            self._set_identity(b_key, torch.zeros_like(self.child[b_key]))

    def zero(self, node: dict[str, Any]) -> None:
        """Zero the weight and bias of an inserted layer that ends a residual branch
        (`residual_plan` chose it): the branch then adds nothing."""
        for key in node["params"]:
            local = key.rsplit(".", 1)[-1]
            if local in ("weight", "bias") and key not in self.written:
                self._set_identity(key, torch.zeros_like(self.child[key]))

    def state_dict(self) -> dict[str, Tensor]:
        """The child's full state_dict: written tensors, and copies of the untouched ones."""
        return {k: self.new[k] if k in self.new else v.detach().clone()
                for k, v in self.child.items()}

    def _set_identity(self, key: str, value: Tensor) -> None:
        self.new[key] = value
        self.written.add(key)
        self.identity_keys.append(key)

    def _write(self, key: str, value: Tensor, node: dict[str, Any], *,
               unchanged: bool) -> None:
        target = self.child[key]
        self.new[key] = value.to(device=target.device, dtype=target.dtype).contiguous()
        self.written.add(key)
        (self.params if key in node.get("params", []) else self.buffers).append(key)
        if unchanged:  # the parent's tensor as it was (the caller knows from the shapes)
            self.unchanged.append(key)

    def _parent(self, key: str, child_key: str) -> Tensor:
        like = self.child[child_key]
        return self.parent[key].detach().to(device=like.device, dtype=like.dtype)

    def _noise(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        return torch.randn(shape, generator=self.generator).to(device=like.device,
                                                                dtype=like.dtype)


def _pair_keys(p_node: dict[str, Any], c_node: dict[str, Any], p_tensors: Mapping[str, Tensor],
                c_tensors: Mapping[str, Tensor]) -> list[tuple[str, str]]:
    """Pair the parent's and child's parameter/buffer keys of one node pair: by name relative
    to the node's module (`weight`, `running_var`, `in_proj_weight`), then leftovers in order
    when their ranks agree."""
    def local(node: dict[str, Any], tensors: Mapping[str, Tensor]) -> dict[str, str]:
        prefix = str(node.get("target", "")) + "."
        keys = [k for k in [*node.get("params", []), *node.get("buffers", [])] if k in tensors]
        return {k.removeprefix(prefix): k for k in keys}

    p_local, c_local = local(p_node, p_tensors), local(c_node, c_tensors)
    pairs = [(p_local[n], c_local[n]) for n in c_local if n in p_local]
    p_rest = [k for n, k in p_local.items() if n not in c_local]
    c_rest = [k for n, k in c_local.items() if n not in p_local]
    pairs += [(pk, ck) for pk, ck in zip(p_rest, c_rest)
              if p_tensors[pk].ndim == c_tensors[ck].ndim]
    return pairs


def _paste(dst: Tensor, src: Tensor, *, centre_from: int) -> Tensor:
    """A copy of `dst` with the overlapping block of `src` pasted in: from the origin in dims
    below `centre_from`, CENTRED in the others (kernel dims: a smaller kernel sits in the middle
    of a larger one, a larger one gives up its centre)."""
    out = dst.clone()
    to, take = [], []
    for k, (d, s) in enumerate(zip(dst.shape, src.shape)):
        n = min(d, s)
        at_d, at_s = ((d - n) // 2, (s - n) // 2) if k >= centre_from else (0, 0)
        to.append(slice(at_d, at_d + n))
        take.append(slice(at_s, at_s + n))
    out[tuple(to)] = src[tuple(take)]
    return out
