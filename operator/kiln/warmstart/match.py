"""Parent/child architecture alignment: ModelKeeper's DAG-to-DAG dynamic program, done right.

Scores how much of a zoo model (the parent P) can seed a new model (the child C), and says
which layers align (Lai et al., NSDI '23, model matching). No selection policy, no weights, no
I/O, no process pools.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TypeAlias

import networkx as nx
import numpy as np

from kiln.warmstart import graph

# ModelKeeper's matcher is a partial-order (Smith-Waterman-style) alignment of two DAGs over
# their DFS-flavoured topological orders. Three deliberate fixes of its published code, then two
# rules of Kiln's own:
#
# 1. Node scores use float division (the C++ divides `long long`s, so any partial shape match
#    scored -1): a 64->128 channel conv scores 0.5, 64->48 scores 0.625.
# 2. The branches of a multi-input child node are merged by their MEAN, not their sum. Summing
#    re-counts a shared prefix at every residual join, so self-scores grow like 2^joins
#    (ResNet-34 self-score 7.95e5). The mean keeps every cell on the scale of one path.
# 3. similarity = raw(P, C) / raw(C, C), clipped to [0, 1] (the code divides by the child's node
#    count, which is meaningless once scores blow up).
# 4. Stages keep their order. Nodes of image models carry a resolution stage (`graph.Prepared`:
#    how many weighted layers after the stem shrank the map before them); nodes of two different
#    known stages never match.
#    Without this a 2x wider child matched its stage-s layers to the parent's equal-shape
#    stage-(s+1) layers (each stage doubles the width): its first stage then read features it
#    was never trained on and the warm model started worse than a random one.
# 5. A conv or linear layer widened k-fold in both its output and input units (a Net2Net
#    widening) scores 1/k, not 1/k^2: its extra inputs are its producer's extra outputs, already
#    counted there, and the transform fills them without loss. A uniformly 2x wider child thus
#    aligns layer for layer at 0.5 per weighted node instead of mismatching every conv.
#
# The recurrence. P has n nodes, C has m, both in topological order; pp(i), cp(j) are predecessor
# positions, -1 the virtual start; S is (n+1) x (m+1) with S[0][0] = 0.
#     s(p, c) = -1 if op kinds, weight ranks or known stages differ; else with N = prod(dims)
#               ([] counts 1), N_c taking dc_1 = dp_1 for a k-fold widened conv/linear (rule 5),
#               and inherited = prod(min(dp_k, dc_k)): inherited / N_p / 1.2 if N_p > N_c
#               (truncating the parent costs extra) else inherited / N_c; -1 if that is below
#               0.3 (the code keeps only > 0.3; 0.3 itself is moot). Same-op weightless nodes
#               score 1.
#     S[i+1][0] = max_{p in pp(i)} S[p+1][0] + DEL    S[0][j+1] = max_{q in cp(j)} S[0][q+1] + INS
#     branch(q) = max( S[i+1][q+1] + INS,                           child node j is extra
#                      max_{p in pp(i)} S[p+1][q+1] + s(i, j),      align P_i with C_j
#                      max_{p in pp(i)} S[p+1][j+1] + DEL  [only if |cp(j)| = 1])  drop P_i
#     S[i+1][j+1] = mean_{q in cp(j)} branch(q);   raw(P, C) = S[n][m].
# ModelKeeper resolves conflicts between branches that pick the same parent row with a greedy
# heap ("approximate bipartite assignment"); we take each branch's best candidate independently
# (simpler to vectorise): a branch may reuse a parent row another branch
# used, which the mean keeps bounded. Backtracking still uses every node at most once.
#
# Vectorisation. Cells are computed one CHILD column at a time, for all parent rows at once. The
# parent side of the recurrence only ever takes maxima, so within a column the DEL chain
# S[r][j+1] = max(X_r, max_{p in pp(r)} S[p+1][j+1] + DEL) has the closed form
# max_k (X_k + DEL * hops_P(k, r)): a running max along each chain segment of the parent plus a
# max-plus product among the H segment heads (`graph.Segments`; H = 59 for densenet121's 430
# nodes). The child side (mean over branches, INS chains) is handled by the column order. The
# node-score matrix is one numpy broadcast; per-graph arrays (`graph.Prepared`) are cached. Cost per
# pair: ~20 numpy calls per child node, O(m * (n + H^2)) flops: resnet50 -> resnet101 takes
# ~13 ms on one core against the published C++ matcher's 650 ms (bench/zoo_query.py).

INS = -0.25
"""Score of a child node with no parent counterpart (it can be identity-initialised)."""
DEL = -1.0
"""Score of a parent node dropped from the alignment (its information is lost)."""
MISMATCH = -1.0
"""Node score of two nodes that cannot share weights."""
MIN_NODE_SCORE = 0.3
"""Node scores below this fraction of shared weights count as a mismatch."""
TRUNCATION_PENALTY = 1.2
"""Divisor applied when the parent tensor is larger than the child's (it must be cut)."""

FloatArray: TypeAlias = graph.FloatArray
IntArray: TypeAlias = graph.IntArray


class BranchMerge(enum.StrEnum):
    """How branch values combine at a multi-input child node."""

    MEAN = "mean"  # Kiln: bounded, comparable across depths
    SUM = "sum"  # the published code's merge (without its greedy de-duplication); ablation only


@dataclasses.dataclass(frozen=True)
class Alignment:
    """Result of aligning a parent graph to a child graph.

    Attributes:
        similarity: raw_score / child self-score, clipped to [0, 1].
        raw_score: S[n][m] of the DP table.
        pairs: aligned (parent node id, child node id) pairs with equal op kinds, reached by
            diagonal moves; each node appears at most once; in child topological order.
    """

    similarity: float
    raw_score: float
    pairs: tuple[tuple[str, str], ...]


GraphLike: TypeAlias = nx.DiGraph | graph.Prepared
"""A graph from `kiln.warmstart.graph`, or its prepared form (`graph.prepare`, cached)."""


def node_scores(parent: GraphLike, child: GraphLike) -> FloatArray:
    """Node-score matrix s(P_i, C_j) (see the comment at the top), in one numpy broadcast.

    Args:
        parent: parent graph (or its `graph.Prepared` form).
        child: child graph (or its `graph.Prepared` form).

    Returns:
        float64[n, m], rows/columns in the prepared topological orders.
    """
    p, c = graph.prepare(parent), graph.prepare(child)
    width = max(p.dims.shape[1], c.dims.shape[1], 2)
    pd, cd = _pad(p.dims, width), _pad(c.dims, width)
    inherited = np.minimum(pd[:, None, :], cd[None, :, :]).prod(axis=2)
    # A conv or linear layer widened k-fold in and out (Net2Net) counts its widening once, at
    # its outputs (1/k, not 1/k^2): its wider inputs mirror its producer's wider outputs.
    aspect_p = pd[:, 0] / pd[:, 1]
    aspect_c = np.where(c.fan_in, cd[:, 0] / cd[:, 1], np.nan)  # NaN never equals
    in_p, in_c = pd[:, None, 1], cd[None, :, 1]
    widened = (aspect_p[:, None] == aspect_c[None, :]) & (in_p < in_c)
    size_p, size_c = p.sizes[:, None], c.sizes[None, :] * np.where(widened, in_p / in_c, 1.0)
    score = np.where(size_p > size_c, inherited / size_p / TRUNCATION_PENALTY, inherited / size_c)
    ok = ((p.op_codes[:, None] == c.op_codes[None, :]) & (p.ranks[:, None] == c.ranks[None, :])
          & (score >= MIN_NODE_SCORE))
    if (p.stages >= 0).any() and (c.stages >= 0).any():  # nodes of two stages never match
        ok &= ((p.stages[:, None] == c.stages[None, :]) | (p.stages < 0)[:, None]
               | (c.stages < 0)[None, :])
    return np.where(ok, score, MISMATCH)


def raw_score(parent: GraphLike, child: GraphLike, *,
              branch_merge: BranchMerge = BranchMerge.MEAN) -> float:
    """Unnormalised alignment score S[n][m].

    Args:
        parent: parent graph (or its `graph.Prepared` form).
        child: child graph (or its `graph.Prepared` form).
        branch_merge: MEAN (Kiln) or SUM (the published merge, for ablations and tests).

    Returns:
        S[n][m]: positive when much aligns, negative when deletions and mismatches dominate.
    """
    p, c = graph.prepare(parent), graph.prepare(child)
    table = _table(p, c, node_scores(p, c), branch_merge)
    return float(table[c.n, p.n])


def self_score(child: GraphLike) -> float:
    """raw_score(child, child), cached on the prepared graph."""
    c = graph.prepare(child)
    if "self_score" not in c.cache:
        c.cache["self_score"] = raw_score(c, c)
    value: float = c.cache["self_score"]
    return value


def similarity(parent: GraphLike, child: GraphLike) -> float:
    """raw_score(parent, child) / self_score(child), clipped to [0, 1]; no backtracking.

    Args:
        parent: zoo model's graph (or `graph.Prepared`).
        child: the new model's graph (or `graph.Prepared`).

    Returns:
        Similarity in [0, 1]; 1.0 for identical architectures.
    """
    return _normalise(raw_score(parent, child), self_score(child))


def merges(g: nx.DiGraph) -> int:
    """How many nodes merge paths that split earlier (residual adds, with or without a
    projection shortcut; dense concatenations; attention): a node with two inputs that share an
    ancestor, or one of which is the other's ancestor. A plain layer stack has none."""
    count = 0
    for node in g:
        inputs = list(g.predecessors(node))
        if len(inputs) < 2:
            continue
        upstream = [nx.ancestors(g, u) | {u} for u in inputs]
        count += any(upstream[a] & upstream[b] for a in range(len(inputs))
                     for b in range(a + 1, len(inputs)))
    return count


def family_mismatch(parent: nx.DiGraph, child: nx.DiGraph) -> str | None:
    """Why weights of `parent` cannot carry its function into `child`, or None when they can.

    A residual network's convolutions learned the branch f of x + f(x); copied into a plain
    stack they compute f(x) alone, which is nothing the parent ever computed (measured: a plain
    CNN from a ResNet started at chance and ended below a cold start). The converse holds too.
    """
    p, c = merges(parent), merges(child)
    if (p == 0) == (c == 0):
        return None
    branched, plain, count = ("parent", "child", p) if c == 0 else ("child", "parent", c)
    return (f"another family: the {branched} merges branches ({count} skip or parallel "
            f"join{'s' if count != 1 else ''}) and the {plain} is a plain stack, so its layers "
            f"would not compute what they learned")


def align(parent: GraphLike, child: GraphLike) -> Alignment:
    """Score the pair and backtrack the aligned (parent node, child node) pairs.

    A pair is aligned when its cell was reached by a diagonal move on every child branch and
    the op kinds are equal (a same-op pair with a mismatching shape still counts: the weight
    transformer widens or truncates it). Candidate pairs found on several paths are
    de-duplicated greedily by node score, so each node is used at most once.

    Args:
        parent: zoo model's graph (or `graph.Prepared`).
        child: the new model's graph (or `graph.Prepared`).

    Returns:
        The `Alignment`.
    """
    p, c = graph.prepare(parent), graph.prepare(child)
    scores = node_scores(p, c)
    table = _table(p, c, scores, BranchMerge.MEAN)
    raw = float(table[c.n, p.n])
    pairs = _backtrack(p, c, scores, table)
    return Alignment(similarity=_normalise(raw, self_score(c)), raw_score=raw, pairs=pairs)


def _table(p: graph.Prepared, c: graph.Prepared, scores: FloatArray,
           merge: BranchMerge) -> FloatArray:
    """The DP table, transposed: T[j, r] = S[r][j] (child column j, parent row r)."""
    n, m = p.n, c.n
    segments = p.segments()
    table = np.empty((m + 1, n + 1))
    best_pred = np.empty((m + 1, n))  # best_pred[j, i] = max_{p in pp(i)} S[p+1][j]
    table[0] = DEL * segments.start_hops  # S[r][0]: the parent prefix deleted, shortest path
    work = _Workspace(segments, n, m, fixed_bound=merge is BranchMerge.MEAN)
    work.best_pred(table[0], out=best_pred[0])
    x = work.x
    for j in range(m):
        preds = c.preds[j]
        s_col = scores[:, j]
        col = table[j + 1]
        if len(preds) == 1:
            q = preds[0]
            x[0] = table[q, 0] + INS
            np.add(table[q, 1:], INS, out=work.t1)
            np.add(best_pred[q], s_col, out=work.t2)
            np.maximum(work.t1, work.t2, out=x[1:])
            work.close_deletions(out=col)
        else:
            acc = work.acc
            acc.fill(0.0)
            for q in preds:
                np.add(table[q, 1:], INS, out=work.t1)
                np.add(best_pred[q], s_col, out=work.t2)
                np.maximum(work.t1, work.t2, out=work.t1)
                acc += work.t1
            np.multiply(acc, 1.0 / len(preds) if merge is BranchMerge.MEAN else 1.0, out=col[1:])
            col[0] = table[preds, 0].max() + INS
        work.best_pred(col, out=best_pred[j + 1])
    return table


class _Workspace:
    """Buffers and per-call constants of `_table` (numpy call overhead dominates small graphs).

    Closing a column over DEL moves: out[r] = max_k (x[k] + DEL * hops_P(k, r)) over ancestors
    k of r (k = r included), the closed form of S[r] = max(x[r], max_{p in pp(r)} S[p] + DEL).
    Inside a chain segment that is a running max of x[k] - DEL * k (one cummax over all rows,
    restarted per segment by adding `big * segment`); across segments it is a max-plus product
    over the H segment heads only, so a column costs O(n + H^2), not O(n^2).
    """

    def __init__(self, segments: graph.Segments, n: int, m: int, *, fixed_bound: bool) -> None:
        self.seg = segments
        self.x = np.empty(n + 1)  # a column before DEL moves
        self.t1, self.t2, self.acc = np.empty(n), np.empty(n), np.empty(n)
        self.run = np.empty(n + 1)
        self.within = np.empty(n + 2)  # within[n+1] = -inf: the sentinel row of head_preds
        self.within[n + 1] = -np.inf
        self.many_heads = len(segments.head_hops) > 1
        self.slope = -DEL * np.arange(n + 1, dtype=np.float64)
        self.steps = DEL * segments.hops_from_head
        self.head_closure = np.where(np.isinf(segments.head_hops), -np.inf,
                                     DEL * segments.head_hops)
        # Under MEAN every cell lies in [-(n + m/4), m] (a pure INS/DEL path always exists and a
        # child node adds at most 1), so x + slope spans less than 2n + 1.25m + 3.
        self.fixed_bound = fixed_bound
        self.offset = self.slope + (2.0 * n + 1.25 * m + 8.0) * segments.segment

    def close_deletions(self, *, out: FloatArray) -> None:
        """out[r] = max_k (x[k] + DEL * hops_P(k, r)) over ancestors k of r (class docstring)."""
        seg, x, run, within = self.seg, self.x, self.run, self.within
        offset = self.offset
        if not self.fixed_bound:  # SUM merge: values are unbounded, size the offset per column
            big = float(x.max() - x.min()) + self.slope[-1] + 1.0
            offset = self.slope + big * seg.segment
        np.add(x, offset, out=run)
        np.maximum.accumulate(run, out=run)
        if not self.many_heads:  # the parent is one chain: the running max is the answer
            np.subtract(run, offset, out=out)
            return
        np.subtract(run, offset, out=within[:-1])  # best start inside the row's own segment
        entering = _gather_max(within, seg.head_preds) + DEL  # best value entering each head
        reach = (entering[:, None] + self.head_closure).max(axis=0)  # best over head ancestors
        np.add(reach[seg.head_of], self.steps, out=run)
        np.maximum(within[:-1], run, out=out)

    def best_pred(self, col: FloatArray, *, out: FloatArray) -> None:
        """out[i] = max_{p in pp(i)} col[p+1]; a row continuing a chain just reads col[i]."""
        out[:] = col[:-1]
        if len(self.seg.head_nodes):
            out[self.seg.head_nodes] = _gather_max(col, self.seg.head_node_preds)


def _gather_max(values: FloatArray, index: IntArray) -> FloatArray:
    """values[index].max(axis=1), faster for the common one or two predecessors."""
    if index.shape[1] == 1:
        return values[index[:, 0]]
    if index.shape[1] == 2:
        return np.maximum(values[index[:, 0]], values[index[:, 1]])
    result: FloatArray = values[index].max(axis=1)
    return result


_MATCH, _INS, _DIAG, _DEL = 3, 2, 1, 0  # tie-break ranks of moves (higher wins)
_TIE = 1e-9


def _backtrack(p: graph.Prepared, c: graph.Prepared, scores: FloatArray,
               table: FloatArray) -> tuple[tuple[str, str], ...]:
    """Follow the best move of every branch from (n, m); collect diagonal same-op cells.

    Ties between moves go MATCH (diagonal, s > 0) > INS > mismatching diagonal > DEL, as in
    ModelKeeper. Plain Python lists: this visits a few thousand cells one at a time.
    """
    t = table.tolist()  # t[column][row]
    s = scores.tolist()
    parent_rows = [sorted(set(a.tolist())) for a in p.preds]
    child_cols = [a.tolist() for a in c.preds]
    found: list[tuple[float, int, int]] = []
    stack, seen = [(p.n, c.n)], set()
    while stack:
        r, col = stack.pop()
        if r == 0 or col == 0 or (r, col) in seen:
            continue
        seen.add((r, col))
        i, j = r - 1, col - 1
        s_ij = s[i][j]
        diag_rank = _MATCH if s_ij > 0 else _DIAG
        single = len(child_cols[j]) == 1
        all_diagonal = True
        taken: set[int] = set()  # parent rows the node's earlier branches went to
        for q in child_cols[j]:
            best = (t[q][r] + INS, _INS, (r, q))
            for pr in parent_rows[i]:
                for move in ((t[q][pr] + s_ij, diag_rank, (pr, q)),
                             (t[col][pr] + DEL, _DEL, (pr, col))):
                    if move[1] == _DEL and not single:
                        continue
                    tied = move[0] >= best[0] - _TIE
                    if move[0] > best[0] + _TIE or (tied and move[1] > best[1]) or (
                            # equal branches (two same-shape embeddings) go to distinct rows
                            tied and move[1] == best[1] and best[2][0] in taken
                            and move[2][0] not in taken):
                        best = move
            all_diagonal &= best[1] in (_MATCH, _DIAG)
            taken.add(best[2][0])
            stack.append(best[2])
        if all_diagonal and p.ops[i] == c.ops[j]:
            found.append((s_ij, i, j))
    used_p: set[int] = set()
    used_c: set[int] = set()
    kept: list[tuple[int, int]] = []
    for _, i, j in sorted(found, key=lambda f: (-f[0], f[2], f[1])):
        if i not in used_p and j not in used_c:
            used_p.add(i)
            used_c.add(j)
            kept.append((i, j))
    return tuple((p.nodes[i], c.nodes[j]) for i, j in sorted(kept, key=lambda k: k[1]))


def _pad(dims: FloatArray, width: int) -> FloatArray:
    if dims.shape[1] == width:
        return dims
    return np.pad(dims, ((0, 0), (0, width - dims.shape[1])), constant_values=1.0)


def _normalise(raw: float, self_raw: float) -> float:
    return 0.0 if self_raw <= 0 else float(min(1.0, max(0.0, raw / self_raw)))
