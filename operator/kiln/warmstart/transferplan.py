"""The shape-level plan of a weight transfer, decided before any tensor is written.

Role: the half of `kiln.warmstart.transform` (rules in its module docstring) that reads only
graphs and shapes: which parent unit each child unit copies (`unit_maps`, Net2WiderNet, Chen et
al. ICLR '16), which aligned dense layers are heads (`head_layers`), and which inserted layers
can start as the identity (`identity_plan`, Net2DeeperNet; ModelKeeper's `pad_mapping`). Also
the node helpers both halves use: `layer_kind` and `dense_keys`. Because unit maps come from
shapes alone, the order in which `net2net.Builder` later writes tensors never changes them.

Callers: `transform` (planning), `net2net` (helpers). Non-goals: no tensor is written or
copied here, no I/O. Shapes: O output units, I input units.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import networkx as nx
import torch

MAX_IDENTITY_RUN = 2
"""Longest run of inserted weighted layers that is identity-initialised (ModelKeeper: gap < 4)."""

_DENSE_OPS = frozenset({"Conv1d", "Conv2d", "Conv3d", "Linear", "LazyLinear",
                        "NonDynamicallyQuantizableLinear"})
_CHANNEL_NORMS = frozenset({"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"})
# Weightless ops that act on each feature separately (or pool over space) and so keep a unit map.
_PASSTHROUGH = frozenset({
    "ReLU", "ReLU6", "GELU", "SiLU", "Sigmoid", "Tanh", "Hardswish", "Hardsigmoid", "ELU",
    "LeakyReLU", "Mish", "Hardtanh", "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d",
    "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "add", "sub", "mul", "div",
    *_CHANNEL_NORMS,
})

Tensor = torch.Tensor


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
        problem = _identity_problem(g, v, state)
        if problem is None:
            plan.append(v)
        else:
            notes.append(f"inserted layer {v} ({g.nodes[v]['op']}) keeps the child's "
                         f"init: {problem}")
    return plan, notes


def _identity_problem(g: nx.DiGraph, v: str, state: Mapping[str, Tensor]) -> str | None:
    """Why layer v cannot compute the identity, or None if it can."""
    node = g.nodes[v]
    kind = layer_kind(node)
    if kind == "norm":
        return None
    weight_key = dense_keys(node, state)[0] if kind == "dense" else ""
    if not weight_key:
        return f"no identity initialisation for {node['op']}"
    shape = list(state[weight_key].shape)
    if len(shape) == 2:
        return None if shape[0] == shape[1] else f"not square ({shape[1]} -> {shape[0]})"
    in_shape = _input_shape(g, v)
    if any(k % 2 == 0 for k in shape[2:]):
        return f"even kernel {shape[2:]} has no centre"
    if not in_shape or len(in_shape) < 2:
        return "its input shape is unknown"
    if in_shape[1] % shape[1] or shape[0] != in_shape[1]:
        return f"{in_shape[1]} input channels -> {shape[0]} output channels"
    if list(node.get("out_shape", [])) != in_shape:
        return f"output shape {node.get('out_shape')} differs from input shape {in_shape}"
    return None


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
            if kind == "norm" and in_map and in_map.parent_width == p_width \
                    and len(in_map.index) == c_width:
                maps[v] = in_map  # BatchNorm follows its producer's replicas
            else:
                maps[v] = UnitMap(tuple(k % p_width for k in range(c_width)), p_width)
        elif v in identities or (not node.get("params") and node["op"] in _PASSTHROUGH):
            maps[v] = in_map
        else:
            maps[v] = None
    return maps


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
