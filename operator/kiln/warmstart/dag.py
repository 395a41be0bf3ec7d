"""Architecture graph -> the array form that alignment works on (`Prepared`), cached per graph.

Role: linearise a graph from `kiln.warmstart.graph` the way ModelKeeper does (Lai et al.,
NSDI '23, model matching; shared/research/modelkeeper.md §1.1: a DFS-flavoured topological
order that keeps chains contiguous, predecessor position lists with the virtual start as
position 0) and precompute what `kiln.warmstart.match`'s vectorised dynamic program needs: op
codes, weight dims, padded predecessor arrays and, for graphs used as parents, their chain
segments with hop distances. Built once per zoo model and reused for every query.

Terms: a graph has n nodes; "row" r in 0..n is the DP position of node r-1, row 0 the virtual
start (an edge to every source). H is the number of segment heads (see `Segments`).

Callers: `kiln.warmstart.match` (every public function prepares its arguments), the zoo index
(prepares each stored graph once). Non-goals: no scoring, no I/O, no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from typing import Any

import networkx as nx
import numpy as np
import numpy.typing as npt

from kiln.warmstart import graph as graph_mod

MAX_NODES = 5000
"""Largest graph accepted (ModelKeeper's MAX_MATCH_NODES); DP tables are O(n * m)."""

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


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
        raise graph_mod.GraphError(f"{_label(g)}: cannot match a graph of {n} nodes "
                                   f"(allowed 1..{MAX_NODES})")
    order = _dfs_topological_order(g)
    position = {v: k for k, v in enumerate(order)}
    try:
        ops = tuple(str(g.nodes[v]["op"]) for v in order)
        shapes = [[max(int(d), 1) for d in g.nodes[v]["weight_shape"]] for v in order]
    except KeyError as exc:
        raise graph_mod.GraphError(f"{_label(g)}: a node lacks attribute {exc}") from exc
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
        pred_rows=_frozen(_padded(list(preds))))


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
        raise graph_mod.GraphError(f"{_label(g)}: the graph has a cycle; cannot order it")
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
