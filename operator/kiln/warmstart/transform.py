"""Weight transformation: carry a parent's trained weights into a child along an alignment.

Role: given the aligned (parent node, child node) pairs from `kiln.warmstart.match.align`, build
the child's initial state_dict from the parent's: ModelKeeper's structure-aware transformation
(Lai et al., NSDI '23, §3; shared/research/modelkeeper.md §3) built on Net2Net's
function-preserving operators (Chen, Goodfellow, Shlens, "Net2Net: Accelerating Learning via
Knowledge Transfer", ICLR '16), with the published code's bugs fixed (digest §8):

* Aligned pairs are processed in reverse topological order (ModelKeeper's cascading mapping).
  Each copies the overlapping block, truncating where the parent is larger; spatial kernel
  dims are CENTRED (a 3x3 parent sits in the middle of a 5x5 child, a 5x5 parent gives its
  centre to a 3x3 child; the published code pastes at the corner).
* Wider layers (Net2WiderNet): a child with more output units (dim 0) than its parent fills
  unit k from parent unit k mod old, plus Gaussian noise of std `noise_std` x std(source unit)
  on the weight (biases are replicated exactly, under the right key: the published code looks
  up `layer + "bias"` without the dot). Every weighted layer downstream, reached through
  weightless element-wise ops, pooling, residual adds, flatten and BatchNorm, reads the widened
  channels as INPUT slices (dim 1): column j copies parent column map(j) divided by the number
  of replicas of map(j), so with the noise off the function is preserved. BatchNorm is
  replicated per channel (no division) and passes the map on (the published DFS stops at BN).
  Unit maps are derived from shapes alone, before any tensor is written, so processing order
  never changes the result. Input columns with no known map (their producer is not aligned,
  or a `cat`/attention op lies between) are zero-filled: the new features get no fan-out.
* BatchNorm running_mean / running_var / num_batches_tracked travel with their layer
  (replicated for widened channels); the published code transfers parameters only.
* Deeper layers (Net2DeeperNet): a run of at most `MAX_IDENTITY_RUN` = 2 inserted (unaligned)
  weighted layers between transferred layers is identity-initialised: conv -> Dirac at the
  kernel centre (in == out channels, same spatial size, odd kernels; grouped and depthwise
  convs per group), linear -> eye when square, BatchNorm -> gamma 1, beta 0, running mean 0,
  var 1; dense weights get noise of std `noise_std` / sqrt(fan_in) (the published code adds
  absolute N(0, 0.05) noise, larger than the identity term on wide convs). With the noise off,
  an inserted conv+BN+ReLU or Linear+ReLU whose input is non-negative (after a ReLU) computes
  the identity (BatchNorm in eval mode is off by a factor 1/sqrt(1 + eps), about 5e-6).
* Heads (aligned dense layers with no weighted layer downstream): when the output count
  differs (10 -> 100 classes), the overlapping rows are copied and the other rows keep the
  child's init; `TransformResult.notes` says so. Classes are not replicated.
* Other aligned layers (LayerNorm, Embedding, attention) get a plain overlapping-block copy;
  everything else (unaligned layers outside short runs, state_dict entries no graph node
  names) keeps the child's init. Inputs are never mutated. `lr_damping`: see its docstring.

Shapes: O output units, I input units (per group for grouped convs), k kernel dims.
Callers: the trainer (`warm_start_state`, `lr_damping`), the zoo index (`transform` counts for
`select.finalize`). Non-goals: no parent choice (`select`), no matching (`match`), no I/O.
Code: this module plans and assembles; `transferplan` derives unit maps, heads and identity
layers from shapes, `net2net` writes the tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import networkx as nx
import torch
from torch import nn

from kiln.warmstart import graph as graph_mod
from kiln.warmstart import match, net2net, transferplan

MAX_IDENTITY_RUN = transferplan.MAX_IDENTITY_RUN  # re-exported: the module docstring's name

Tensor = torch.Tensor


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
        identity_initialised: child keys (parameters and BN buffers) set to the identity.
        untransferred_fraction: 1 - matched_tensors / total_tensors (1.0 when total is 0).
        transferred_buffers: child buffer keys (BN statistics) copied from the parent.
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
    """Build the child's initial state_dict from the parent's (rules in the module docstring).

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
    build = net2net.Builder(parent_state, child_state, noise_std=noise_std, generator=generator)
    identity, notes = transferplan.identity_plan(child_graph, order, set(pairs), child_state)
    build.notes.extend(notes)
    heads = transferplan.head_layers(child_graph, order, pairs)
    maps = transferplan.unit_maps(parent_graph, child_graph, order, pairs, identity, heads)
    for v in reversed(order):  # ModelKeeper's cascading order (maps are fixed already)
        if v in pairs:
            in_map = transferplan.merge_maps(maps, child_graph.predecessors(v))
            build.transfer(parent_graph.nodes[pairs[v]], child_graph.nodes[v], v,
                           in_map=in_map, out_map=maps[v], head=v in heads)
    for v in identity:
        build.identity(child_graph.nodes[v])
    total_keys = {k for _, a in child_graph.nodes(data=True) for k in a.get("params", [])}
    matched = [k for k in build.params if k in total_keys]
    total = len(total_keys)
    return TransformResult(
        state_dict=build.state_dict(), matched_tensors=len(matched), total_tensors=total,
        transferred_params=build.params, identity_initialised=build.identity_keys,
        untransferred_fraction=1.0 - len(matched) / total if total else 1.0,
        transferred_buffers=build.buffers, notes=build.notes, similarity=alignment.similarity)


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
    return transform(parent_state, parent_graph, child_model.state_dict(), child_graph,
                     alignment, noise_std=noise_std, generator=generator)


def lr_damping(
    untransferred_fraction: float,
    epoch: int,
    *,
    warm_epochs: int = 2,
    floor: float = 0.3,
) -> float:
    """Learning-rate multiplier after a warm start: the more transferred, the gentler at first.

    ModelKeeper (NSDI '23; digest §4, `ray_tuner.py`) trains the first 2 epochs at
    base_lr x clip(1 - matched / parent_layers, 0.3, 1) and then restores base_lr, so the
    inherited weights are not wrecked by a full learning rate. Kiln uses the same formula with
    the CHILD's count (DESIGN §4, "damp in proportion to what was not transferred"):

        multiplier = clip(untransferred_fraction, floor, 1)   if epoch < warm_epochs
                   = 1                                         otherwise

    A cold start (fraction 1) is undamped; a full transfer (fraction 0) starts at `floor`.

    Args:
        untransferred_fraction: `TransformResult.untransferred_fraction` in [0, 1].
        epoch: the 0-based epoch about to run.
        warm_epochs: how many first epochs are damped (ModelKeeper: 2).
        floor: smallest multiplier (ModelKeeper: 0.3).

    Returns:
        The multiplier in [floor, 1].

    Raises:
        ValueError: untransferred_fraction outside [0, 1], negative epoch or warm_epochs, or
            floor outside (0, 1].
    """
    if not 0.0 <= untransferred_fraction <= 1.0:
        raise ValueError(f"untransferred_fraction must be in [0, 1] "
                         f"(got {untransferred_fraction})")
    if epoch < 0 or warm_epochs < 0:
        raise ValueError(f"epoch and warm_epochs must be >= 0 (got {epoch}, {warm_epochs})")
    if not 0.0 < floor <= 1.0:
        raise ValueError(f"floor must be in (0, 1] (got {floor})")
    if epoch >= warm_epochs:
        return 1.0
    return min(1.0, max(floor, untransferred_fraction))


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
