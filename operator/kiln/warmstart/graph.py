"""Architecture graphs: a model as a DAG of its layers, and the array form alignment works on.

`extract` traces a model on the `meta` device (no weights are read; torch.fx, else Hugging
Face's fx tracer, else torch.export) into a networkx graph, stored in the zoo as JSON
(`to_json`/`from_json`); `Prepared` is that graph linearised for `kiln.warmstart.match`, built
once per graph. No matching, no I/O.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import itertools
import math
import re
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import networkx as nx
import numpy as np
import numpy.typing as npt
import torch
import torch.fx
from torch import nn

from kiln.models import tracing

# Extraction: an `nn.Module` becomes a `networkx.DiGraph` of its layers, the analogue of the ONNX
# graph that ModelKeeper (Lai et al., NSDI '23) builds per zoo model, but with `torch.fx` instead of
# the ONNX exporter. The model is copied onto the `meta` device first (parameters become
# storage-less meta tensors, so extraction costs no memory or time for weights and never touches the
# caller's model), traced with `torch.fx.symbolic_trace`, and run once on a meta input to record
# output shapes. A forward fx cannot trace (Hugging Face transformers models, control flow on
# shapes) gets two more tries: Hugging Face's own fx tracer when the model is or wraps a
# `transformers.PreTrainedModel` and the installed transformers has one, then `torch.export`,
# whose graph holds ATen functions on `get_attr` parameters instead of module calls. There a
# function is a layer when it depends on the input or reads a parameter (`linear`, `embedding`,
# `layer_norm`, `addmm`), so exported and fx graphs of one model share their weighted layers.
#
# Node attributes (node id = the fx node name, unique per graph):
#     op (str): module class name for `call_module` nodes (`Conv2d`, `BatchNorm2d`); the
#         canonical function or method name otherwise (`add`, `cat`, `matmul`), where functions
#         that have a module twin take the module's name (`F.relu` -> `ReLU`) so that coding style
#         does not split op kinds. Linear-like attention projections get a suffix
#         (`Linear_query`, `Linear_key`, `Linear_value`, `Linear_qkv`) so they never cross-match.
#     weight_shape (list[int]): shape of the node's weight (a parameter named `weight`, else one
#         ending in `weight`, else its first parameter); [] if the node has no parameters.
#     params (list[str]): the state_dict keys of the parameters the node uses, including ones
#         reached through `get_attr` (a ViT class token attaches to the `cat` that consumes it).
#     buffers (list[str]): the state_dict keys of its buffers (BatchNorm running statistics).
#     out_shape (list[int]): shape of its (first) output for a batch of one, e.g. [1, C, H, W].
#     target (str): the fx target (module path for `call_module`, else the op name).
#     heads (int, optional): on a query, key or value projection, the attention heads its
#         output splits into, when the module that owns it says (`heads`, `num_heads`, `n_head`,
#         `n_heads`, `num_attention_heads`); absent otherwise and in graphs written before it.
#
# Edges run from tensor producers to consumers. Pure shape and bookkeeping ops (view, reshape,
# flatten, permute, transpose, getitem, size, contiguous, dropout, identity, ...), nodes that do
# not depend on the model input (`arange`, `zeros`), nodes whose output is not a tensor, dead
# code, and the placeholder/output markers are all dropped, their predecessors reconnected to
# their successors (ModelKeeper keeps ONNX's shape ops, about 100 nodes per transformer layer).
#
# Shapes: B batch (always 1 here), C channels, H height, W width, T sequence length.
SCHEMA_VERSION = 1
"""Version of the `to_json` layout; `from_json` rejects other versions."""

NODE_FIELDS = ("op", "weight_shape", "params", "buffers", "out_shape", "target")
"""Attributes of every node (see the comment on extraction above)."""

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
    # ATen spellings of the above, as torch.export writes them
    "unsafe_view", "slice", "alias", "lift_fresh_copy", "to_copy", "split_with_sizes",
    "assert_tensor_metadata", "sym_size", "sym_numel",
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
# `addmm` is a Hugging Face `Conv1D` (GPT-2's projections, weight [in, out]) once traced.
_LINEAR_LIKE = frozenset({"Linear", "LazyLinear", "NonDynamicallyQuantizableLinear", "Conv1d",
                          "addmm"})


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
    """Build the architecture graph of `model` (node attributes: the comment on extraction above).

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
            meta device, traced (by torch.fx, Hugging Face's tracer or torch.export: the
            message gives each one's reason), or run on a meta input; or it has no layers.
    """
    label = name or type(model).__name__
    shape = [int(d) for d in input_shape]
    if not shape or any(d <= 0 for d in shape):
        raise GraphError(f"{label}: input_shape must be a non-empty list of positive sizes "
                         f"(got {list(input_shape)})")
    dtype = input_dtype or (torch.int64 if len(shape) == 1 else torch.float32)
    meta_model = _meta_copy(model, label)
    example = torch.zeros([1, *shape], dtype=dtype, device="meta")
    with tracing.LOCK:  # tracers patch module calls process-wide; so may a trace elsewhere
        traced, functional = _trace(meta_model, example, label)
        recorder = _ShapeRecorder(traced)
        try:
            with torch.no_grad():
                recorder.run(example)
        except Exception as exc:  # any op without a meta kernel or a shape error in the forward
            raise GraphError(f"{label}: running it on a meta input of shape {[1, *shape]} "
                             f"({_dtype_name(dtype)}) failed at node {recorder.current!r} "
                             f"({type(exc).__name__}: {_first_line(exc)})") from exc
    g = _build(traced, recorder.shapes, meta_model, functional=functional)
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
        "weight_shape", "params", "buffers", "out_shape", "target", and "heads" where known}],
        "edges": [[src, dst]]}.
    """
    nodes = [{"id": str(v), "op": str(a["op"]),
              "weight_shape": [int(d) for d in a.get("weight_shape", [])],
              "params": [str(k) for k in a.get("params", [])],
              "buffers": [str(k) for k in a.get("buffers", [])],
              "out_shape": [int(d) for d in a.get("out_shape", [])],
              "target": str(a.get("target") or a["op"]),
              **({"heads": int(a["heads"])} if a.get("heads") else {})}
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
            wrong type, an edge names an unknown node, the edges form a cycle, or the graph is
            larger than MAX_NODES nodes or MAX_EDGES_PER_NODE edges per node.
    """
    if not isinstance(d, dict):
        raise GraphError(f"graph JSON must be an object (got {type(d).__name__})")
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise GraphError(f"graph JSON schema_version {version!r} is not supported "
                         f"(expected {SCHEMA_VERSION}); re-extract the graph")
    label = d.get("name") or "<unnamed>"
    nodes, edges = _field(d, "nodes", list, label), _field(d, "edges", list, label)
    if len(nodes) > MAX_NODES or len(edges) > MAX_EDGES_PER_NODE * max(len(nodes), 1):
        raise GraphError(f"{label}: {len(nodes)} nodes and {len(edges)} edges; a model graph "
                         f"has at most {MAX_NODES} nodes and {MAX_EDGES_PER_NODE} edges per "
                         "node (re-extract it)")
    g = nx.DiGraph(name=str(d.get("name", "")), input_shape=list(d.get("input_shape", [])),
                   input_dtype=str(d.get("input_dtype", "")))
    for k, node in enumerate(nodes):
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
        heads = node.get("heads")
        if heads is not None:
            if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
                raise GraphError(f"{where}: field 'heads' must be a positive int")
            attrs["heads"] = heads
        g.add_node(node_id, **attrs)
    for k, edge in enumerate(edges):
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


def _trace(model: nn.Module, example: torch.Tensor,
           label: str) -> tuple[torch.fx.GraphModule, bool]:
    """The traced model, and whether its graph is functional (torch.export: no module calls).

    The caller holds `tracing.LOCK`: every tracer here patches process-wide state.

    Raises:
        GraphError: no tracer could trace it; the message gives each tracer's reason.
    """
    tries: list[str] = []
    try:
        return torch.fx.symbolic_trace(model), False
    except Exception as exc:  # noqa: BLE001  # fx raises TraceError, TypeError, ...
        tries.append(f"torch.fx cannot trace its forward ({type(exc).__name__}: "
                     f"{_first_line(exc)})")
    hf_fx = _hf_fx_module() if _wraps_pretrained(model) else None
    if hf_fx is not None:
        try:  # a PreTrainedModel knows its dummy inputs; a wrapper is traced as it is
            if _is_pretrained(model):
                return hf_fx.symbolic_trace(model), False
            return torch.fx.GraphModule(model, hf_fx.HFTracer().trace(model)), False
        except Exception as exc:  # noqa: BLE001  # whatever the traced code raises
            tries.append(f"Hugging Face's fx tracer failed ({type(exc).__name__}: "
                         f"{_first_line(exc)})")
    try:
        exported = torch.export.export(model, (example,), strict=False)
        module = exported.module()
    except Exception as exc:  # export raises Unsupported, UserError, RuntimeError, ...
        tries.append(f"torch.export failed ({type(exc).__name__}: {_first_line(exc)})")
        raise GraphError(f"{label}: {'; '.join(tries)}; it cannot be warm-started") from exc
    if not isinstance(module, torch.fx.GraphModule):
        raise GraphError(f"{label}: {'; '.join(tries)}; torch.export gave a "
                         f"{type(module).__name__}, not a graph; it cannot be warm-started")
    return module, True


def _wraps_pretrained(model: nn.Module) -> bool:
    """Whether `model` is or holds a Hugging Face `PreTrainedModel` (without importing it)."""
    return any(_is_pretrained(module) for module in model.modules())


def _is_pretrained(module: nn.Module) -> bool:
    return any(base.__name__ == "PreTrainedModel" and base.__module__.startswith("transformers")
               for base in type(module).__mro__)


def _hf_fx_module() -> Any:
    """`transformers.utils.fx` when the installed transformers still ships it, else None."""
    try:
        return importlib.import_module("transformers.utils.fx")
    except ImportError:  # not installed, or transformers 5 (it dropped its fx tracer)
        return None


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


def _build(gm: torch.fx.GraphModule, shapes: dict[str, list[int]], root: nn.Module, *,
           functional: bool = False) -> nx.DiGraph:
    """Keep layer nodes of the fx graph, bridging dropped nodes (see the extraction comment).

    `functional` graphs (torch.export) also keep functions that read a parameter or depend on
    the input: there, layers are functions, and their parameters arrive through `get_attr`.
    """
    param_shapes = {k: list(p.shape) for k, p in root.named_parameters(remove_duplicate=False)}
    buffer_names = {k for k, _ in root.named_buffers(remove_duplicate=False)}
    nodes = list(gm.graph.nodes)
    live = _ancestors_of_output(nodes)
    # flow[x] = (kept producers, params, buffers) that node x passes on to its consumers.
    flow: dict[torch.fx.Node, tuple[list[str], list[str], list[str]]] = {}
    on_input = {n for n in nodes if n.op == "placeholder"}  # nodes that depend on the input
    g = nx.DiGraph()
    for node in nodes:
        if node not in live or node.op in ("placeholder", "output"):
            flow[node] = ([], [], [])
            continue
        if any(x in on_input for x in node.all_input_nodes):
            on_input.add(node)
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
                and (node.op == "call_module" or bool(producers)
                     or (functional and (node in on_input or bool(params)))))
        if not keep:
            flow[node] = (producers, params, buffers)
            continue
        params = _unique([*own_params, *params])
        buffers = _unique([*own_buffers, *buffers])
        extra: dict[str, int] = {}
        if op in _LINEAR_LIKE:
            weights = [p for p in params if p.endswith("weight")] or params  # addmm: bias first
            owner = str(node.target) if node.op == "call_module" else weights[0] if weights else ""
            owner = owner.removesuffix(".weight")
            suffix = _attention_suffix(owner)
            op += suffix
            heads = _heads(root, owner) if suffix else 0
            if heads:
                extra["heads"] = heads
        prefix = str(node.target) + "." if node.op == "call_module" else ""
        g.add_node(node.name, op=op, weight_shape=_weight_shape(params, param_shapes, prefix),
                   params=params, buffers=buffers, out_shape=shapes[node.name],
                   target=str(node.target) if node.op == "call_module" else op, **extra)
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
    # An ATen operator (torch.export) is named by its packet: `aten.linear.default` -> linear.
    called: Any = getattr(node.target, "overloadpacket", node.target)
    raw = called if isinstance(called, str) else getattr(called, "__name__", "")
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


_HEAD_COUNTS = ("heads", "num_heads", "n_head", "n_heads", "num_attention_heads")


def _heads(root: nn.Module, owner: str) -> int:
    """The head count the module owning projection `owner` declares, else 0."""
    try:
        module = root.get_submodule(owner.rpartition(".")[0])
    except AttributeError:
        return 0
    for name in _HEAD_COUNTS:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


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


# The array form: linearise a graph the way ModelKeeper does (Lai et al., NSDI '23, model matching:
# a DFS-flavoured topological order that keeps chains contiguous, predecessor position lists with
# the virtual start as position 0) and precompute what `kiln.warmstart.match`'s vectorised dynamic
# program needs: op codes, weight dims, padded predecessor arrays and, for graphs used as parents,
# their chain segments with hop distances. Built once per zoo model and reused for every query.
#
# Terms: a graph has n nodes; "row" r in 0..n is the DP position of node r-1, row 0 the virtual
# start (an edge to every source). H is the number of segment heads (see `Segments`).
MAX_NODES = 5000
# Layer graphs are sparse (a DenseNet-121 layer has 1.8 inputs on average, a concatenation at
# most a few dozen); a record with far more edges is damaged or hostile and would stall the
# matcher for every query.
MAX_EDGES_PER_NODE = 16
"""Largest graph accepted (ModelKeeper's MAX_MATCH_NODES); DP tables are O(n * m)."""

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
# Layers whose weight is [out, in, ...] (not ConvTranspose: [in, out]; not addmm: [in, out]).
_FAN_IN_OPS = re.compile(r"(Lazy)?Conv[123]d$|(Lazy|NonDynamicallyQuantizable)?Linear(_\w+)?$")


@dataclasses.dataclass(frozen=True, eq=False)
class Segments:
    """The DAG cut into chain segments, in hops (edges), for the DP's deletion chains.

    A row r continues the segment of row r-1 when its only predecessor is r-1 (the DFS-flavoured
    order keeps chains contiguous); other rows, and row 0, head a segment. Segments are
    contiguous runs of rows, numbered in order.

    Attributes:
        segment: float64[n+1], segment number of each row (non-decreasing).
        head_of: int64[n+1], the same number as an index into the heads.
        hops_from_head: float64[n+1], r minus the row of r's segment head.
        head_preds: int64[H, d], predecessor rows of each head, padded by repetition; row
            n+1 (a caller-provided -inf sentinel) stands in for row 0's missing predecessors.
        head_hops: float64[H, H], shortest path length between heads (inf if unreachable).
        start_hops: float64[n+1], shortest path length from row 0 to each row.
        head_nodes: int64[H-1], nodes (0-based) whose rows head a segment (row 0 excluded).
        head_node_preds: int64[H-1, d], their predecessor rows, padded by repetition.
    """

    segment: FloatArray
    head_of: IntArray
    hops_from_head: FloatArray
    head_preds: IntArray
    head_hops: FloatArray
    start_hops: FloatArray
    head_nodes: IntArray
    head_node_preds: IntArray


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
    """A graph in array form; build with `prepare`, reuse freely (read-only).

    Attributes:
        nodes: node ids in DFS-flavoured topological order (node k = DP row/column k+1).
        ops: op kind per node.
        op_codes: int64[n] stable hashes of `ops` (comparable across processes).
        dims: float64[n, R] weight dims, right-padded with 1 (R = max weight rank, >= 1).
        ranks: int64[n] weight ranks (0 = weightless).
        sizes: float64[n] number of weight elements (1 if weightless).
        preds: per node, int64 array of predecessor rows (0 = virtual start).
        pred_rows: int64[n, d] `preds` padded by repeating an entry (max is idempotent).
        stages: int64[n] resolution stage per node (see `_stages`), -1 where unknown.
        fan_in: bool[n], weight dim 1 counts input units (Conv and Linear layers).
        cache: derived values computed on demand (segments; match's self-score).
    """

    nodes: tuple[str, ...]
    ops: tuple[str, ...]
    op_codes: IntArray
    dims: FloatArray
    ranks: IntArray
    sizes: FloatArray
    preds: tuple[IntArray, ...]
    pred_rows: IntArray
    stages: IntArray
    fan_in: npt.NDArray[np.bool_]
    cache: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    def segments(self) -> Segments:
        """Chain segments and hop distances (computed on first use, O(n * H))."""
        if "segments" not in self.cache:
            self.cache["segments"] = _segments(self)
        value: Segments = self.cache["segments"]
        return value


_prepared_cache: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, int, Prepared]] = (
    weakref.WeakKeyDictionary())


def prepare(g: nx.DiGraph | Prepared) -> Prepared:
    """Array form of an architecture graph, cached per graph object.

    The cache is keyed by the graph object (checked against its node and edge counts); after
    mutating a graph in place, prepare a copy instead.

    Args:
        g: a graph from `graph.extract`/`graph.from_json` (node attrs `op`, `weight_shape`), or
            an already prepared graph (returned as is).

    Returns:
        The `Prepared` form.

    Raises:
        graph.GraphError: the graph is empty, has more than MAX_NODES nodes, has a cycle, or a
            node lacks `op`/`weight_shape`.
    """
    if isinstance(g, Prepared):
        return g
    key = (g.number_of_nodes(), g.number_of_edges())
    hit = _prepared_cache.get(g)
    if hit is not None and hit[:2] == key:
        return hit[2]
    prepared = _prepare(g)
    _prepared_cache[g] = (*key, prepared)
    return prepared


def _prepare(g: nx.DiGraph) -> Prepared:
    n = g.number_of_nodes()
    if n == 0 or n > MAX_NODES:
        raise GraphError(f"{_label(g)}: cannot match a graph of {n} nodes "
                                   f"(allowed 1..{MAX_NODES})")
    order = _dfs_topological_order(g)
    position = {v: k for k, v in enumerate(order)}
    try:
        ops = tuple(str(g.nodes[v]["op"]) for v in order)
        shapes = [[max(int(d), 1) for d in g.nodes[v]["weight_shape"]] for v in order]
    except KeyError as exc:
        raise GraphError(f"{_label(g)}: a node lacks attribute {exc}") from exc
    dims = np.ones((n, max(1, max(len(s) for s in shapes))))
    for k, shape in enumerate(shapes):
        dims[k, :len(shape)] = shape
    preds = tuple(np.array([position[u] + 1 for u in g.predecessors(v)] or [0], dtype=np.int64)
                  for v in order)
    return Prepared(
        nodes=tuple(str(v) for v in order), ops=ops,
        op_codes=_frozen(np.array([_op_code(op) for op in ops], dtype=np.int64)),
        dims=_frozen(dims), ranks=_frozen(np.array([len(s) for s in shapes], dtype=np.int64)),
        sizes=_frozen(dims.prod(axis=1)), preds=tuple(_frozen(a) for a in preds),
        pred_rows=_frozen(_padded(list(preds))), stages=_frozen(_stages(g, order, preds)),
        fan_in=_frozen(np.array([bool(_FAN_IN_OPS.match(op)) for op in ops], dtype=bool)))


def _stages(g: nx.DiGraph, order: Sequence[Any], preds: Sequence[IntArray]) -> IntArray:
    """Resolution stage of each node: how many weighted layers shrank the map before it.

    Counted along the graph (a weighted node shrinking its inputs' smallest map adds one to
    their largest stage), so a stride-2 conv and its block's projection shortcut open the same
    stage whatever the input size. The first weighted layer (the stem) and weightless pooling
    do not count: an ImageNet stem (stride-2 conv, max pool) and a CIFAR stem (one conv) both
    lead into stage 0. Known only for image-like inputs ([C, H, W], [C, L]) and nodes whose
    output keeps those dims over more than one position; -1 elsewhere (token models, heads
    after global pooling, hand-built graphs without shapes).
    """
    n = len(order)
    stages = np.full(n, -1, dtype=np.int64)
    input_shape = [int(d) for d in g.graph.get("input_shape") or []]
    if len(input_shape) < 2:
        return stages
    rank = len(input_shape) + 1  # with the batch dim
    level = [0] * (n + 1)  # per row; row 0 is the input
    area = [math.prod(input_shape[1:])] * (n + 1)
    after_stem = [False] * (n + 1)  # a weighted layer lies between the input and the row
    for k, v in enumerate(order):
        rows = preds[k].tolist()
        before = min(area[r] for r in rows)
        shape = list(g.nodes[v].get("out_shape") or [])
        spatial = len(shape) == rank
        weighted = bool(g.nodes[v]["weight_shape"])
        area[k + 1] = math.prod(shape[2:]) if spatial else before
        stem_done = any(after_stem[r] for r in rows)
        shrinks = weighted and stem_done and area[k + 1] < before
        level[k + 1] = max(level[r] for r in rows) + int(shrinks)
        after_stem[k + 1] = stem_done or weighted
        if spatial and area[k + 1] > 1:
            stages[k] = level[k + 1]
    return stages


def _segments(p: Prepared) -> Segments:
    n = p.n
    continues = np.zeros(n + 1, dtype=bool)
    for r in range(1, n + 1):
        continues[r] = len(p.preds[r - 1]) == 1 and p.preds[r - 1][0] == r - 1
    heads = np.flatnonzero(~continues)  # row 0 always heads a segment
    segment = np.cumsum(~continues) - 1
    # hops[a, r]: shortest path length from head a to row r, by one pass in topological order.
    hops = np.full((len(heads), n + 1), np.inf)
    hops[np.arange(len(heads)), heads] = 0.0
    for r in range(1, n + 1):
        via = hops[:, r - 1] if continues[r] else hops[:, p.preds[r - 1]].min(axis=1)
        np.minimum(hops[:, r], via + 1.0, out=hops[:, r])
    return Segments(
        segment=segment.astype(np.float64), head_of=segment.astype(np.int64),
        hops_from_head=np.arange(n + 1) - heads[segment].astype(np.float64),
        head_preds=_padded([p.preds[h - 1] if h > 0 else np.array([n + 1]) for h in heads]),
        head_hops=hops[:, heads], start_hops=hops[0], head_nodes=heads[1:] - 1,
        head_node_preds=p.pred_rows[heads[1:] - 1])


def _dfs_topological_order(g: nx.DiGraph) -> list[Any]:
    """ModelKeeper's order (matcher.py `topological_sorting`): sources in node order, explicit
    stack, a successor pushed once its last incoming edge is consumed (chains stay contiguous).

    Raises:
        graph.GraphError: the graph has a cycle.
    """
    indegree = {v: d for v, d in g.in_degree()}
    order: list[Any] = []
    for source in [v for v in g.nodes if indegree[v] == 0]:
        stack = [source]
        while stack:
            v = stack.pop()
            order.append(v)
            for w in reversed(list(g.successors(v))):
                indegree[w] -= 1
                if indegree[w] == 0:
                    stack.append(w)
    if len(order) != g.number_of_nodes():
        raise GraphError(f"{_label(g)}: the graph has a cycle; cannot order it")
    return order


def _frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Mark an array read-only: prepared graphs are shared by every query."""
    a.flags.writeable = False
    return a


def _padded(rows: list[IntArray]) -> IntArray:
    """Stack ragged index lists into [len, d] by repeating entries (harmless under max/min)."""
    depth = max(len(a) for a in rows)
    return np.array([np.resize(a, depth) for a in rows], dtype=np.int64)


def _op_code(op: str) -> int:
    """Stable 63-bit code of an op kind (same in every process, unlike a counter)."""
    return int.from_bytes(hashlib.blake2b(op.encode(), digest_size=8).digest(), "little") >> 1


def _label(g: nx.DiGraph) -> str:
    return str(g.graph.get("name") or "graph")
