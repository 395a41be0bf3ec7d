"""Model -> architecture graph: the representation that warm-start matching works on.

Role: turn an `nn.Module` into a `networkx.DiGraph` of its layers, the analogue of the ONNX graph
that ModelKeeper (Lai et al., NSDI '23; shared/research/modelkeeper.md §1.1) builds per zoo
model, but with `torch.fx` instead of the ONNX exporter. The model is copied onto the
`meta` device first (parameters become storage-less meta tensors, so extraction costs no memory
or time for weights and never touches the caller's model), traced with
`torch.fx.symbolic_trace`, and run once on a meta input to record output shapes.

Node attributes (node id = the fx node name, unique per graph):
    op (str): module class name for `call_module` nodes (`Conv2d`, `BatchNorm2d`); the
        canonical function or method name otherwise (`add`, `cat`, `matmul`), where functions
        that have a module twin take the module's name (`F.relu` -> `ReLU`) so that coding style
        does not split op kinds. Linear-like attention projections get a suffix
        (`Linear_query`, `Linear_key`, `Linear_value`, `Linear_qkv`) so they never cross-match.
    weight_shape (list[int]): shape of the node's weight (a parameter named `weight`, else one
        ending in `weight`, else its first parameter); [] if the node has no parameters.
    params (list[str]): the state_dict keys of the parameters the node uses, including ones
        reached through `get_attr` (a ViT class token attaches to the `cat` that consumes it).
    buffers (list[str]): the state_dict keys of its buffers (BatchNorm running statistics).
    out_shape (list[int]): shape of its (first) output for a batch of one, e.g. [1, C, H, W].
    target (str): the fx target (module path for `call_module`, else the op name).

Edges run from tensor producers to consumers. Pure shape and bookkeeping ops (view, reshape,
flatten, permute, transpose, getitem, size, contiguous, dropout, identity, ...), nodes that do
not depend on the model input (`arange`, `zeros`), nodes whose output is not a tensor, dead
code, and the placeholder/output markers are all dropped, their predecessors reconnected to
their successors (ModelKeeper keeps ONNX's shape ops, about 100 nodes per transformer layer;
shared/research/modelkeeper.md §1.2 suggests pruning them).

Shapes: B batch (always 1 here), C channels, H height, W width, T sequence length.

Callers: `kiln.warmstart.match` (alignment), the zoo (graphs stored as JSON beside weights), the
trainer (graph of the job's model). Non-goals: no matching, no weights, no I/O.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Iterable, Sequence
from typing import Any

import networkx as nx
import torch
import torch.fx
from torch import nn

SCHEMA_VERSION = 1
"""Version of the `to_json` layout; `from_json` rejects other versions."""

NODE_FIELDS = ("op", "weight_shape", "params", "buffers", "out_shape", "target")
"""Attributes of every node (see the module docstring)."""

# Module classes that only reshape, copy or randomly zero their input: never layers to match.
_DROP_MODULES = frozenset({
    "Identity", "Flatten", "Unflatten", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d",
    "AlphaDropout", "FeatureAlphaDropout", "StochasticDepth",
})
# Canonical function/method names that move, view or annotate data without computing on it.
_DROP_OPS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "size", "dim", "numel",
    "getattr", "getitem", "permute", "transpose", "t", "swapaxes", "movedim", "contiguous",
    "expand", "expand_as", "repeat", "unsqueeze", "squeeze", "chunk", "split", "unbind",
    "narrow", "select", "to", "type", "type_as", "float", "double", "half", "bfloat16", "int",
    "long", "bool", "clone", "detach", "assert", "dropout", "dropout1d", "dropout2d",
    "dropout3d", "alpha_dropout", "feature_alpha_dropout", "identity", "zeros_like",
    "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_empty", "new_full",
    "stochastic_depth",
})
# Functions with a module twin take the twin's class name; arithmetic spellings collapse.
_OP_ALIASES = {
    "relu": "ReLU", "relu6": "ReLU6", "gelu": "GELU", "silu": "SiLU", "sigmoid": "Sigmoid",
    "tanh": "Tanh", "hardswish": "Hardswish", "hardsigmoid": "Hardsigmoid", "elu": "ELU",
    "leaky_relu": "LeakyReLU", "softmax": "Softmax", "log_softmax": "LogSoftmax",
    "max_pool1d": "MaxPool1d", "max_pool2d": "MaxPool2d", "avg_pool1d": "AvgPool1d",
    "avg_pool2d": "AvgPool2d", "adaptive_avg_pool1d": "AdaptiveAvgPool1d",
    "adaptive_avg_pool2d": "AdaptiveAvgPool2d", "adaptive_max_pool2d": "AdaptiveMaxPool2d",
    "linear": "Linear", "conv1d": "Conv1d", "conv2d": "Conv2d", "embedding": "Embedding",
    "layer_norm": "LayerNorm", "group_norm": "GroupNorm",
    "iadd": "add", "radd": "add", "isub": "sub", "rsub": "sub", "imul": "mul", "rmul": "mul",
    "truediv": "div", "itruediv": "div", "rtruediv": "div", "bmm": "matmul",
    "rmatmul": "matmul", "concat": "cat", "concatenate": "cat",
}
_LINEAR_LIKE = frozenset({"Linear", "LazyLinear", "NonDynamicallyQuantizableLinear", "Conv1d"})


class GraphError(ValueError):
    """A model whose architecture graph cannot be built (or a malformed graph JSON).

    Callers treat it as "cannot warm-start this model": the job cold-starts, nothing crashes.
    """


def extract(
    model: nn.Module,
    input_shape: Sequence[int],
    *,
    name: str = "",
    input_dtype: torch.dtype | None = None,
) -> nx.DiGraph:
    """Build the architecture graph of `model` (see the module docstring for node attributes).

    The caller's model is not modified: a meta-device copy is traced (in eval mode, so the graph
    is the inference graph and BatchNorm statistics are not touched).

    Args:
        model: the model, on any device (meta included).
        input_shape: shape of one input sample without the batch dimension, as in
            `spec.model.input_shape`: [C, H, W] for images, [T] for token sequences.
        name: architecture name used in error messages and stored as graph attribute `name`.
        input_dtype: dtype of the example input; default float32 for images (rank 3 shapes)
            and int64 token ids for sequences (rank 1 shapes).

    Returns:
        A DiGraph whose nodes are in a topological order (fx order), with graph attributes
        `name`, `input_shape` (list[int]) and `input_dtype` (str, e.g. "float32").

    Raises:
        GraphError: `input_shape` is empty or not positive; the model cannot be copied to the
            meta device, traced by torch.fx, or run on a meta input; or it has no layers.
    """
    label = name or type(model).__name__
    shape = [int(d) for d in input_shape]
    if not shape or any(d <= 0 for d in shape):
        raise GraphError(f"{label}: input_shape must be a non-empty list of positive sizes "
                         f"(got {list(input_shape)})")
    dtype = input_dtype or (torch.int64 if len(shape) == 1 else torch.float32)
    meta_model = _meta_copy(model, label)
    try:
        traced = torch.fx.symbolic_trace(meta_model)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError, ...
        raise GraphError(f"{label}: torch.fx cannot trace its forward ({type(exc).__name__}: "
                         f"{_first_line(exc)}); it cannot be warm-started") from exc
    example = torch.zeros([1, *shape], dtype=dtype, device="meta")
    recorder = _ShapeRecorder(traced)
    try:
        with torch.no_grad():
            recorder.run(example)
    except Exception as exc:  # any op without a meta kernel or a shape error in the forward
        raise GraphError(f"{label}: running it on a meta input of shape {[1, *shape]} "
                         f"({_dtype_name(dtype)}) failed at node {recorder.current!r} "
                         f"({type(exc).__name__}: {_first_line(exc)})") from exc
    g = _build(traced, recorder.shapes, meta_model)
    if g.number_of_nodes() == 0:
        raise GraphError(f"{label}: the traced graph has no layers that depend on the input")
    g.graph.update(name=name, input_shape=shape, input_dtype=_dtype_name(dtype))
    return g


def to_json(g: nx.DiGraph) -> dict[str, Any]:
    """Serialise a graph from `extract` to a JSON-ready dict (node and edge order preserved).

    Args:
        g: an architecture graph.

    Returns:
        {"schema_version": 1, "name", "input_shape", "input_dtype", "nodes": [{"id", "op",
        "weight_shape", "params", "buffers", "out_shape", "target"}], "edges": [[src, dst]]}.
    """
    nodes = [{"id": str(v), "op": str(a["op"]),
              "weight_shape": [int(d) for d in a.get("weight_shape", [])],
              "params": [str(k) for k in a.get("params", [])],
              "buffers": [str(k) for k in a.get("buffers", [])],
              "out_shape": [int(d) for d in a.get("out_shape", [])],
              "target": str(a.get("target") or a["op"])}
             for v, a in g.nodes(data=True)]
    return {
        "schema_version": SCHEMA_VERSION,
        "name": str(g.graph.get("name", "")),
        "input_shape": [int(d) for d in g.graph.get("input_shape", [])],
        "input_dtype": str(g.graph.get("input_dtype", "")),
        "nodes": nodes,
        "edges": [[u, v] for u, v in g.edges()],
    }


def from_json(d: dict[str, Any]) -> nx.DiGraph:
    """Rebuild a graph written by `to_json`.

    Args:
        d: the dict (e.g. parsed from a zoo record's graph.json).

    Returns:
        The DiGraph, equal in nodes, attributes, edges and their order to the original.

    Raises:
        GraphError: the schema version is not `SCHEMA_VERSION`, a field is missing or has the
            wrong type, an edge names an unknown node, or the edges form a cycle.
    """
    if not isinstance(d, dict):
        raise GraphError(f"graph JSON must be an object (got {type(d).__name__})")
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise GraphError(f"graph JSON schema_version {version!r} is not supported "
                         f"(expected {SCHEMA_VERSION}); re-extract the graph")
    label = d.get("name") or "<unnamed>"
    g = nx.DiGraph(name=str(d.get("name", "")), input_shape=list(d.get("input_shape", [])),
                   input_dtype=str(d.get("input_dtype", "")))
    for k, node in enumerate(_field(d, "nodes", list, label)):
        where = f"{label} nodes[{k}]"
        node_id = _field(node, "id", str, where)
        if node_id in g:
            raise GraphError(f"{where}: duplicate node id {node_id!r}")
        attrs: dict[str, Any] = {"op": _field(node, "op", str, where),
                                 "target": str(node.get("target") or node["op"])}
        for f, kind in (("weight_shape", int), ("params", str), ("buffers", str),
                        ("out_shape", int)):
            items = _field(node, f, list, where)
            if not all(isinstance(x, kind) and not isinstance(x, bool) for x in items):
                raise GraphError(f"{where}: field {f!r} must be a list of {kind.__name__}")
            attrs[f] = list(items)
        g.add_node(node_id, **attrs)
    for k, edge in enumerate(_field(d, "edges", list, label)):
        if not (isinstance(edge, list) and len(edge) == 2 and all(v in g for v in edge)):
            raise GraphError(f"{label} edges[{k}] = {edge!r} is not a pair of known node ids")
        g.add_edge(edge[0], edge[1])
    if not nx.is_directed_acyclic_graph(g):
        raise GraphError(f"{label}: graph JSON edges contain a cycle")
    return g


class _ShapeRecorder(torch.fx.Interpreter):
    """Runs a traced module once, recording the shape of each node's first tensor output."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module)
        self.shapes: dict[str, list[int]] = {}
        self.current = ""

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n.name
        result = super().run_node(n)
        tensor = _first_tensor(result)
        if tensor is not None:
            self.shapes[n.name] = [int(d) for d in tensor.shape]
        return result


def _meta_copy(model: nn.Module, label: str) -> nn.Module:
    """Deep-copy `model` with every parameter and buffer replaced by a meta tensor (no data)."""
    memo: dict[int, Any] = {}
    try:
        for t in itertools.chain(model.parameters(), model.buffers()):
            meta = torch.empty_like(t, device="meta")
            is_param = isinstance(t, nn.Parameter)
            memo[id(t)] = nn.Parameter(meta, t.requires_grad) if is_param else meta
        clone = copy.deepcopy(model, memo)
    except (TypeError, ValueError, RuntimeError, NotImplementedError, copy.Error) as exc:
        raise GraphError(f"{label}: cannot copy the model to the meta device "
                         f"({type(exc).__name__}: {_first_line(exc)})") from exc
    return clone.eval()


def _build(gm: torch.fx.GraphModule, shapes: dict[str, list[int]], root: nn.Module) -> nx.DiGraph:
    """Keep layer nodes of the fx graph, bridging dropped nodes (see module docstring)."""
    param_shapes = {k: list(p.shape) for k, p in root.named_parameters(remove_duplicate=False)}
    buffer_names = {k for k, _ in root.named_buffers(remove_duplicate=False)}
    nodes = list(gm.graph.nodes)
    live = _ancestors_of_output(nodes)
    # flow[x] = (kept producers, params, buffers) that node x passes on to its consumers.
    flow: dict[torch.fx.Node, tuple[list[str], list[str], list[str]]] = {}
    g = nx.DiGraph()
    for node in nodes:
        if node not in live or node.op in ("placeholder", "output"):
            flow[node] = ([], [], [])
            continue
        if node.op == "get_attr":
            target = str(node.target)
            flow[node] = ([], [target] if target in param_shapes else [],
                          [target] if target in buffer_names else [])
            continue
        ins = [flow[x] for x in node.all_input_nodes]
        producers = _unique(p for f in ins for p in f[0])
        params = _unique(p for f in ins for p in f[1])
        buffers = _unique(b for f in ins for b in f[2])
        op, own_params, own_buffers = _describe(node, gm)
        keep = (op not in _DROP_MODULES and op not in _DROP_OPS and node.name in shapes
                and (node.op == "call_module" or bool(producers)))
        if not keep:
            flow[node] = (producers, params, buffers)
            continue
        params = _unique([*own_params, *params])
        buffers = _unique([*own_buffers, *buffers])
        if op in _LINEAR_LIKE:
            owner = str(node.target) if node.op == "call_module" else params[0] if params else ""
            op += _attention_suffix(owner.removesuffix(".weight"))
        prefix = str(node.target) + "." if node.op == "call_module" else ""
        g.add_node(node.name, op=op, weight_shape=_weight_shape(params, param_shapes, prefix),
                   params=params, buffers=buffers, out_shape=shapes[node.name],
                   target=str(node.target) if node.op == "call_module" else op)
        for p in producers:
            g.add_edge(p, node.name)
        flow[node] = ([node.name], [], [])
    return g


def _describe(node: torch.fx.Node, gm: torch.fx.GraphModule) -> tuple[str, list[str], list[str]]:
    """Op name and own parameter/buffer state_dict keys of a call_* node."""
    if node.op == "call_module":
        target = str(node.target)
        module = gm.get_submodule(target)
        return (type(module).__name__,
                [f"{target}.{k}" for k, _ in module.named_parameters(remove_duplicate=False)],
                [f"{target}.{k}" for k, _ in module.named_buffers(remove_duplicate=False)])
    raw = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    name = str(raw or node.target)
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    name = name.strip("_")  # in-place `add_`, private `_assert`
    return _OP_ALIASES.get(name, name), [], []


def _attention_suffix(owner: str) -> str:
    """`_query`/`_key`/`_value`/`_qkv` when a projection's module name says which it is."""
    last = owner.rsplit(".", 1)[-1].lower()
    tokens = set(re.split(r"[_\W]+", last))
    if "qkv" in tokens or last in ("in_proj", "c_attn", "wqkv"):
        return "_qkv"
    for suffix, words in (("_query", {"q", "query", "wq"}), ("_key", {"k", "key", "wk"}),
                          ("_value", {"v", "value", "wv"})):
        if tokens & words:
            return suffix
    return ""


def _weight_shape(params: list[str], param_shapes: dict[str, list[int]], prefix: str) -> list[int]:
    """Shape of the node's weight: `weight`, else `*weight`, else its first parameter.

    Names are taken relative to the node's module (`prefix`), so a MultiheadAttention node's
    weight is its own `in_proj_weight`, not its submodule's `out_proj.weight`.
    """
    known = [p for p in params if p in param_shapes]
    local = {p: p.removeprefix(prefix) if prefix else p.rsplit(".", 1)[-1] for p in known}
    for pick in ([p for p in known if local[p] == "weight"],
                 [p for p in known if local[p].endswith("weight")], known):
        if pick:
            return list(param_shapes[pick[0]])
    return []


def _ancestors_of_output(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes the output depends on (dead code is not part of the architecture)."""
    live: set[torch.fx.Node] = set()
    stack = [n for n in nodes if n.op == "output"]
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    return live


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _field(d: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(d, dict) or not isinstance(d.get(key), kind):
        got = type(d.get(key)).__name__ if isinstance(d, dict) else type(d).__name__
        raise GraphError(f"{where}: field {key!r} must be a {kind.__name__} (got {got})")
    return d[key]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
