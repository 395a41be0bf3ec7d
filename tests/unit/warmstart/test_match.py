"""Tests for kiln.warmstart.match: hand-computed alignments, properties on torchvision graphs.

Conventions in the comments: S[i][j] is the DP cell after parent node i and child node j (0 =
virtual start); INS = -0.25 (child-only node), DEL = -1 (dropped parent node); s(p, c) is the node
score. Convs below all have weight [8, 8, 3, 3] unless stated, so two convs score 1.0.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import networkx as nx
import pytest
import torch
import torchvision.models as tvm

from kiln.warmstart import graph, match

CONV = [8, 8, 3, 3]


def _graph(nodes: Sequence[tuple[str, str, list[int]]], edges: Sequence[tuple[str, str]] = (),
           *, chain: bool = False) -> nx.DiGraph:
    """A hand-built architecture graph; `chain=True` links the nodes in the order given."""
    g = nx.DiGraph(name="hand")
    for node_id, op, shape in nodes:
        g.add_node(node_id, op=op, weight_shape=list(shape), params=[], buffers=[],
                   out_shape=[], target=node_id)
    if chain:
        nx.add_path(g, [n[0] for n in nodes])
    g.add_edges_from(edges)
    return g


def _chain(*ops: str) -> nx.DiGraph:
    return _graph([(f"{op.lower()}{k}", op, CONV if op == "Conv2d" else [])
                   for k, op in enumerate(ops)], chain=True)


def _residual_stack(blocks: int) -> nx.DiGraph:
    """stem conv, then `blocks` x [conv -> relu -> conv -> add(conv, block input)]."""
    nodes = [("stem", "Conv2d", CONV)]
    edges = []
    last = "stem"
    for b in range(blocks):
        nodes += [(f"c{b}a", "Conv2d", CONV), (f"r{b}", "ReLU", []), (f"c{b}b", "Conv2d", CONV),
                  (f"add{b}", "add", [])]
        edges += [(last, f"c{b}a"), (f"c{b}a", f"r{b}"), (f"r{b}", f"c{b}b"),
                  (f"c{b}b", f"add{b}"), (last, f"add{b}")]
        last = f"add{b}"
    return _graph(nodes, edges)


# ---------------------------------------------------------------------------------------------
# Hand-computed scores
# ---------------------------------------------------------------------------------------------

def test_identical_layer_scores_one() -> None:
    # S[1][1] = max(diag S[0][0] + s = 0 + 1, INS S[1][0] - 0.25 = -1.25, DEL S[0][1] - 1 = -1.25)
    #         = 1.0; the child's self-score is the same 1.0, so similarity = 1.0.
    g = _graph([("conv", "Conv2d", CONV)])
    assert match.raw_score(g, g) == pytest.approx(1.0)
    assert match.similarity(g, g) == pytest.approx(1.0)


def test_op_mismatch_scores_minus_one_and_similarity_zero() -> None:
    # s(Conv2d, Linear) = -1 (op kinds differ). S[1][1] = max(diag 0 - 1 = -1, INS -1 - 0.25,
    # DEL -0.25 - 1) = -1.0; similarity = -1 / 1 clipped to 0.
    parent = _graph([("conv", "Conv2d", CONV)])
    child = _graph([("fc", "Linear", [8, 8])])
    assert match.node_scores(parent, child)[0, 0] == -1.0
    assert match.raw_score(parent, child) == pytest.approx(-1.0)
    assert match.similarity(parent, child) == 0.0


def test_child_two_layers_deeper_pays_two_insertions() -> None:
    # P = Conv-ReLU-Conv, C = Conv-ReLU-Conv-ReLU-Conv. Best: three diagonal matches (+1 each)
    # and two child-only nodes (INS -0.25 each): 3 - 0.5 = 2.5 (ModelKeeper's golden value).
    # Every child node earns at most 1, and skipping a parent node costs -1, so nothing beats it.
    # Child self-score = 5 (five matches), similarity = 2.5 / 5 = 0.5.
    parent = _chain("Conv2d", "ReLU", "Conv2d")
    child = _chain("Conv2d", "ReLU", "Conv2d", "ReLU", "Conv2d")
    assert match.raw_score(parent, child) == pytest.approx(2.5)
    assert match.similarity(parent, child) == pytest.approx(0.5)
    result = match.align(parent, child)
    assert len(result.pairs) == 3
    assert all(parent.nodes[p]["op"] == child.nodes[c]["op"] for p, c in result.pairs)


def test_parent_two_layers_deeper_pays_two_deletions() -> None:
    # Reverse: three matches and two dropped parent nodes (DEL -1 each): 3 - 2 = 1.0 (golden);
    # child self-score 3, similarity 1/3.
    parent = _chain("Conv2d", "ReLU", "Conv2d", "ReLU", "Conv2d")
    child = _chain("Conv2d", "ReLU", "Conv2d")
    assert match.raw_score(parent, child) == pytest.approx(1.0)
    assert match.similarity(parent, child) == pytest.approx(1 / 3)


def test_residual_block_merges_branches_by_mean() -> None:
    # a = Conv, b = ReLU(a), c = Conv(b), d = add(c, a); matched with itself.
    # Diagonal: S[a][a] = 1, S[b][b] = 2, S[c][c] = 3.
    # Cell (d, d) has two child branches:
    #   via c: diag max(S[c][c], S[a][c]) + s(add, add) = 3 + 1 = 4
    #          (INS: S[d][c] - 0.25 <= 2 - 0.25, as S[d][c] drops d: 3 - 1 = 2)
    #   via a: diag max(S[c][a], S[a][a]) + 1 = max(1 - 2, 1) + 1 = 2
    #          (INS: S[d][a] - 0.25 = (1 - 1) - 0.25; d is one DEL from a over the skip edge)
    # MEAN: (4 + 2) / 2 = 3.0, and similarity = 3 / 3 = 1.0.
    # SUM (the published merge) gives 4 + 2 = 6.0 for a 4-node graph: node a is counted on both
    # branches, which is how summing inflates scores at every residual join.
    block = _graph([("a", "Conv2d", CONV), ("b", "ReLU", []), ("c", "Conv2d", CONV),
                    ("d", "add", [])], [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")])
    assert match.raw_score(block, block) == pytest.approx(3.0)
    assert match.similarity(block, block) == pytest.approx(1.0)
    assert match.raw_score(block, block, branch_merge=match.BranchMerge.SUM) == pytest.approx(6.0)


def test_summing_branches_grows_exponentially_with_residual_joins() -> None:
    # Self-score V_k after k blocks (stem conv V_0 = 1; block = conv, relu, conv, add(conv, in)).
    # The add's branches: conv path V_{k-1} + 3 + 1, skip path V_{k-1} + 1.
    #   MEAN: V_k = V_{k-1} + 2.5          -> 1, 3.5, 6, 8.5, 11   (linear in depth)
    #   SUM:  V_k = 2 V_{k-1} + 5          -> 1, 7, 19, 43, 91     (doubles per join)
    mean = [match.raw_score(g, g) for g in map(_residual_stack, range(5))]
    summed = [match.raw_score(g, g, branch_merge=match.BranchMerge.SUM)
              for g in map(_residual_stack, range(5))]
    assert mean == pytest.approx([1, 3.5, 6, 8.5, 11])
    assert summed == pytest.approx([1, 7, 19, 43, 91])


def test_width_doubling_scores_half_with_float_division() -> None:
    # Conv [64, 16, 3, 3] -> [128, 16, 3, 3]: N_p = 9216 <= N_c = 18432, inherited = 9216,
    # s = 9216 / 18432 = 0.5 (the published long-long division gives 0, hence -1).
    parent = _graph([("conv", "Conv2d", [64, 16, 3, 3])])
    child = _graph([("conv", "Conv2d", [128, 16, 3, 3])])
    assert match.node_scores(parent, child)[0, 0] == pytest.approx(0.5)
    assert match.similarity(parent, child) == pytest.approx(0.5)


def test_width_shrink_scores_truncation_penalty() -> None:
    # Conv [64, 16, 3, 3] -> [48, 16, 3, 3]: N_p = 9216 > N_c = 6912, inherited = 6912,
    # s = 6912 / 9216 / 1.2 = 0.75 / 1.2 = 0.625 (published integer code: -1).
    parent = _graph([("conv", "Conv2d", [64, 16, 3, 3])])
    child = _graph([("conv", "Conv2d", [48, 16, 3, 3])])
    assert match.node_scores(parent, child)[0, 0] == pytest.approx(0.625)
    assert match.similarity(parent, child) == pytest.approx(0.625)


@pytest.mark.parametrize(("parent_shape", "child_shape", "expected"), [
    pytest.param([], [], 1.0, id="weightless-same-op"),
    pytest.param([16, 16], [64, 16], -1.0, id="quarter-width-below-0.3"),  # 256/1024 = 0.25
    pytest.param([8, 8, 3, 3], [8, 8], -1.0, id="rank-differs"),
    pytest.param([10, 20], [20, 10], 0.5, id="transposed-overlap"),  # min dims 10x10 / 200
])
def test_node_score_cases(parent_shape: list[int], child_shape: list[int],
                          expected: float) -> None:
    parent = _graph([("x", "Op", parent_shape)])
    child = _graph([("x", "Op", child_shape)])
    assert match.node_scores(parent, child)[0, 0] == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------
# The vectorised DP equals a direct, cell-by-cell implementation of the recurrence
# ---------------------------------------------------------------------------------------------

def _reference_raw_score(parent: nx.DiGraph, child: nx.DiGraph, *, merge: str = "mean") -> float:
    """The module docstring's recurrence, one cell at a time (slow, obviously right)."""
    def order(g: nx.DiGraph) -> tuple[list[str], list[list[int]]]:
        nodes = list(nx.topological_sort(g))
        pos = {v: k for k, v in enumerate(nodes)}
        return nodes, [[pos[u] for u in g.predecessors(v)] or [-1] for v in nodes]

    def stages(g: nx.DiGraph) -> dict[str, int]:  # checked on their own by the stage tests
        prepared = graph.prepare(g)
        return dict(zip(prepared.nodes, prepared.stages.tolist(), strict=True))

    def score(pv: str, cv: str) -> float:
        a, b = parent.nodes[pv], child.nodes[cv]
        da, db = list(a["weight_shape"]), list(b["weight_shape"])
        if a["op"] != b["op"] or len(da) != len(db):
            return -1.0
        if min(p_stage[pv], c_stage[cv]) >= 0 and p_stage[pv] != c_stage[cv]:
            return -1.0
        n_p, n_c = math.prod(da), math.prod(db)
        if b["op"] in ("Conv2d", "Linear") and db[1] > da[1] and db[0] * da[1] == db[1] * da[0]:
            n_c = n_c // db[1] * da[1]  # widened in and out alike: the input growth is free
        inherited = math.prod(min(x, y) for x, y in zip(da, db, strict=True))
        s = inherited / n_p / 1.2 if n_p > n_c else inherited / n_c
        return s if s >= 0.3 else -1.0

    pn, pp = order(parent)
    cn, cp = order(child)
    p_stage, c_stage = stages(parent), stages(child)
    S = {(0, 0): 0.0}
    for i in range(len(pn)):
        S[i + 1, 0] = max(S[p + 1, 0] for p in pp[i]) - 1.0
    for j in range(len(cn)):
        S[0, j + 1] = max(S[0, q + 1] for q in cp[j]) - 0.25
    for i in range(len(pn)):
        for j in range(len(cn)):
            s = score(pn[i], cn[j])
            branches = []
            for q in cp[j]:
                cands = [S[i + 1, q + 1] - 0.25] + [S[p + 1, q + 1] + s for p in pp[i]]
                if len(cp[j]) == 1:
                    cands += [S[p + 1, j + 1] - 1.0 for p in pp[i]]
                branches.append(max(cands))
            S[i + 1, j + 1] = sum(branches) / (len(branches) if merge == "mean" else 1)
    return S[len(pn), len(cn)]


def _random_dag(rng: random.Random, size: int) -> nx.DiGraph:
    """Random layer DAG with branches and joins, ending in one sink (as traced models do)."""
    kinds = [("Conv2d", lambda: [rng.choice([4, 8, 16]), rng.choice([4, 8]), 3, 3]),
             ("Linear", lambda: [rng.choice([8, 10, 16]), rng.choice([8, 16])]),
             ("BatchNorm2d", lambda: [rng.choice([4, 8, 16])]), ("ReLU", list), ("add", list)]
    nodes, edges = [], []
    for k in range(size):
        op, shape = rng.choice(kinds)
        nodes.append((f"n{k}", op, shape()))
        if k > 0 and rng.random() < 0.9:
            for p in {rng.randrange(max(0, k - 4), k) for _ in range(rng.choice([1, 1, 2, 3]))}:
                edges.append((f"n{p}", f"n{k}"))
    g = _graph(nodes, edges)
    sinks = [v for v in g if g.out_degree(v) == 0]
    if len(sinks) > 1:
        g.add_node("sink", op="add", weight_shape=[], params=[], buffers=[], out_shape=[])
        g.add_edges_from((v, "sink") for v in sinks)
    return g


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("merge", [match.BranchMerge.MEAN, match.BranchMerge.SUM])
def test_vectorised_dp_equals_reference_on_random_dags(seed: int,
                                                       merge: match.BranchMerge) -> None:
    rng = random.Random(seed)
    parent, child = _random_dag(rng, rng.randint(1, 14)), _random_dag(rng, rng.randint(1, 14))
    expected = _reference_raw_score(parent, child, merge=str(merge))
    assert match.raw_score(parent, child, branch_merge=merge) == pytest.approx(expected, abs=1e-9)


# ---------------------------------------------------------------------------------------------
# Properties on real architectures
# ---------------------------------------------------------------------------------------------

_TORCHVISION = ("resnet18", "resnet34", "resnet50", "vgg16_bn", "mobilenet_v2", "densenet121")


@pytest.fixture(scope="module")
def tv_graphs() -> dict[str, nx.DiGraph]:
    graphs = {}
    for name in _TORCHVISION:
        with torch.device("meta"):
            model = getattr(tvm, name)(num_classes=10)
        graphs[name] = graph.extract(model, [3, 32, 32], name=name)
    return graphs


def test_vectorised_dp_equals_reference_on_torchvision_pair(
        tv_graphs: dict[str, nx.DiGraph]) -> None:
    parent, child = tv_graphs["vgg16_bn"], tv_graphs["resnet18"]
    assert match.raw_score(parent, child) == pytest.approx(_reference_raw_score(parent, child))


@pytest.mark.parametrize("name", _TORCHVISION)
def test_self_similarity_is_one(tv_graphs: dict[str, nx.DiGraph], name: str) -> None:
    assert match.similarity(tv_graphs[name], tv_graphs[name]) == pytest.approx(1.0)


def test_similarity_lies_in_unit_interval(tv_graphs: dict[str, nx.DiGraph]) -> None:
    for parent in _TORCHVISION:
        for child in ("resnet34", "vgg16_bn", "mobilenet_v2"):
            assert 0.0 <= match.similarity(tv_graphs[parent], tv_graphs[child]) <= 1.0


def test_resnet18_is_closer_to_resnet34_than_vgg16_bn(tv_graphs: dict[str, nx.DiGraph]) -> None:
    near = match.similarity(tv_graphs["resnet18"], tv_graphs["resnet34"])
    far = match.similarity(tv_graphs["vgg16_bn"], tv_graphs["resnet34"])
    assert near > far
    assert near > match.similarity(tv_graphs["resnet18"], tv_graphs["vgg16_bn"])


@pytest.mark.parametrize(("parent", "child"), [
    ("resnet18", "resnet34"), ("vgg16_bn", "resnet34"), ("densenet121", "resnet50"),
    ("resnet50", "mobilenet_v2"), ("resnet34", "resnet18"),
])
def test_aligned_pairs_use_each_node_once_and_share_op_kinds(
        tv_graphs: dict[str, nx.DiGraph], parent: str, child: str) -> None:
    p, c = tv_graphs[parent], tv_graphs[child]
    result = match.align(p, c)
    parents = [a for a, _ in result.pairs]
    children = [b for _, b in result.pairs]
    assert len(set(parents)) == len(parents) and len(set(children)) == len(children)
    assert all(p.nodes[a]["op"] == c.nodes[b]["op"] for a, b in result.pairs)
    assert result.pairs  # these families share at least their conv/BN/ReLU layers
    assert result.similarity == pytest.approx(match.similarity(p, c))


def test_self_alignment_pairs_every_node_with_itself(tv_graphs: dict[str, nx.DiGraph]) -> None:
    g = tv_graphs["resnet18"]
    result = match.align(g, g)
    assert set(result.pairs) == {(v, v) for v in g}


def test_similarity_is_unchanged_by_a_json_round_trip(tv_graphs: dict[str, nx.DiGraph]) -> None:
    p, c = tv_graphs["resnet18"], tv_graphs["resnet34"]
    p2, c2 = (graph.from_json(graph.to_json(g)) for g in (p, c))
    assert match.similarity(p2, c2) == match.similarity(p, c)


def test_prepare_is_cached_and_accepts_prepared_graphs(tv_graphs: dict[str, nx.DiGraph]) -> None:
    g = tv_graphs["resnet18"]
    prepared = graph.prepare(g)
    assert graph.prepare(g) is prepared
    assert graph.prepare(prepared) is prepared
    assert match.similarity(prepared, prepared) == match.similarity(g, g)
    assert prepared.nodes[0] == "conv1" and prepared.ops[-1] == "Linear"


def test_empty_graph_is_rejected_with_graph_error() -> None:
    with pytest.raises(graph.GraphError, match="0 nodes"):
        graph.prepare(nx.DiGraph())


def test_equal_branches_of_a_join_align_to_distinct_parent_nodes() -> None:
    # Token and position embeddings of one shape, summed: each branch must keep its own parent
    # node (the tie once sent both to the first, and the second lost its weights).
    nodes = [("tokens", "Embedding", [64, 8]), ("positions", "Embedding", [64, 8]),
             ("add", "add", []), ("norm", "LayerNorm", [8])]
    edges = [("tokens", "add"), ("positions", "add"), ("add", "norm")]
    g = _graph(nodes, edges)
    pairs = dict(match.align(g, _graph(nodes, edges)).pairs)
    assert pairs == {"tokens": "tokens", "positions": "positions", "add": "add",
                     "norm": "norm"}
