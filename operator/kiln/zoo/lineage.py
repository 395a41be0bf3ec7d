"""A record's family tree: its chain of parents and every descendant, from the records'
``parent`` and ``similarity`` fields, with the training each warm start inherited.

Pure: works on records already read (`records.list_records`); reads no store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import networkx as nx

from kiln.zoo import records


@dataclasses.dataclass(frozen=True)
class Node:
    """One record in a lineage.

    Attributes:
        record: the record, or None for a parent no longer in the zoo (deleted or evicted).
        record_id: its id.
        similarity: architectural similarity to its parent in [0, 1], or None (cold start).
        own_epochs: epochs its job trained (``job_spec.training.epochs``; for a provisional
            record the epochs it had trained when written, where the caller read them), or
            None if unknown.
        inherited_epochs: the training its warm start saved, in epochs of its parent's line:
            similarity × the parent's accumulated epochs (its own plus what it inherited).
            An estimate in ModelKeeper's spirit: a parent of similarity s hands over about s
            of what it learnt. None for a cold start or an unknown parent.
        children: its descendants, oldest first.
    """

    record: records.ZooRecord | None
    record_id: str
    similarity: float | None
    own_epochs: int | None
    inherited_epochs: float | None
    children: tuple[Node, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The subtree as plain JSON values."""
        rec = self.record
        return {
            "id": self.record_id, "in_zoo": rec is not None,
            "architecture": rec.builder if rec else None,
            "metric_name": rec.metric_name if rec else None,
            "metric_value": rec.metric_value if rec else None,
            "provisional": rec.provisional if rec else None,
            "similarity": self.similarity, "own_epochs": self.own_epochs,
            "inherited_epochs": self.inherited_epochs,
            "children": [child.to_json() for child in self.children],
        }


@dataclasses.dataclass(frozen=True)
class Lineage:
    """The ancestors of a record (root first, the record's parent last) and its subtree.

    Attributes:
        ancestors: the chain of parents, oldest first; a parent missing from the zoo ends it,
            and so does one already shown (a parent cycle).
        tree: the record with all its descendants; a cycle is cut where it would come back.
        cycles: the parent cycles among the record's relatives (hand-edited ``parent``
            fields), each as record ids, child first: a -> b means b is a's parent. A record
            whose parent is itself is a cycle of one.
    """

    ancestors: tuple[Node, ...]
    tree: Node
    cycles: tuple[tuple[str, ...], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"ancestors": [dict(n.to_json(), children=[]) for n in self.ancestors],
                "tree": self.tree.to_json(), "cycles": [list(c) for c in self.cycles]}


def lineage(found: Iterable[records.ZooRecord], record_id: str, *,
            trained: Mapping[str, int] | None = None) -> Lineage:
    """The lineage of `record_id` among `found`.

    `trained`: per record id, the epochs it actually trained, where that is known and not its
    job's planned epochs (a provisional record of a pruned or stopped trial: its history's last
    evaluation, `trained_epochs`).

    Raises:
        KeyError: `record_id` is not among `found`.
    """
    by_id: dict[str, records.ZooRecord] = {r.id: r for r in found}
    epochs = {rec_id: _epochs(rec) for rec_id, rec in by_id.items()}
    epochs.update((rec_id, n) for rec_id, n in (trained or {}).items() if rec_id in by_id)
    if record_id not in by_id:
        raise KeyError(record_id)
    children: dict[str, list[records.ZooRecord]] = {}
    for rec in by_id.values():
        if rec.parent is not None:
            children.setdefault(rec.parent, []).append(rec)
    accumulated: dict[str, float | None] = {}

    def node(rec_id: str, *, subtree: bool, seen: frozenset[str] = frozenset()) -> Node:
        rec = by_id.get(rec_id)
        kids: tuple[Node, ...] = ()
        if subtree:  # a child already on the path closes a parent cycle: it is not repeated
            kids = tuple(node(c.id, subtree=True, seen=seen | {rec_id})
                         for c in sorted(children.get(rec_id, []), key=lambda r: r.created_time)
                         if c.id not in seen | {rec_id})
        return Node(record=rec, record_id=rec_id,
                    similarity=rec.similarity if rec else None,
                    own_epochs=epochs[rec_id] if rec else None,
                    inherited_epochs=_inherited(rec, by_id, epochs, accumulated) if rec else None,
                    children=kids)

    # every record has at most one parent, so each family holds at most one cycle, and a
    # cycle's records appear once: in the subtree or among the ancestors
    graph = _parent_graph(by_id.values(), record_id)
    family = nx.node_connected_component(graph.to_undirected(as_view=True), record_id)
    cycles = tuple(_canonical(cycle) for cycle in nx.simple_cycles(graph.subgraph(family)))
    chain: list[Node] = []
    parent = by_id[record_id].parent
    visited = {record_id} | nx.ancestors(graph, record_id)  # its descendants: in the subtree
    while parent is not None and parent not in visited:
        visited.add(parent)
        chain.append(node(parent, subtree=False))
        parent = by_id[parent].parent if parent in by_id else None
    return Lineage(ancestors=tuple(reversed(chain)), tree=node(record_id, subtree=True),
                   cycles=cycles)


def _canonical(cycle: list[str]) -> tuple[str, ...]:
    """A cycle starting at its smallest id, so the same cycle always reads the same."""
    start = cycle.index(min(cycle))
    return tuple(cycle[start:] + cycle[:start])


def _epochs(rec: records.ZooRecord) -> int | None:
    """Epochs the record's job trained, from its job spec (None for imports)."""
    training = rec.job_spec.get("training")
    epochs = training.get("epochs") if isinstance(training, Mapping) else None
    return epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else None


def family(found: Iterable[records.ZooRecord], record_id: str) -> set[str]:
    """The ids of every relative of `record_id` among `found` (itself included): all a
    lineage of it may show or count."""
    graph = _parent_graph(found, record_id)
    return set(nx.node_connected_component(graph.to_undirected(as_view=True), record_id))


def _parent_graph(found: Iterable[records.ZooRecord], record_id: str) -> nx.DiGraph:
    """Child -> parent edges of `found`, with `record_id` as a node even if it has none."""
    graph = nx.DiGraph((rec.id, rec.parent) for rec in found if rec.parent is not None)
    graph.add_node(record_id)
    return graph


def trained_epochs(history: Iterable[Mapping[str, Any]]) -> int | None:
    """The epochs a run had trained by its last evaluation (None: no evaluation says)."""
    epochs = [e for e in (row.get("epoch") for row in history)
              if isinstance(e, int) and not isinstance(e, bool)]
    return max(epochs) if epochs else None


def _inherited(rec: records.ZooRecord, by_id: Mapping[str, records.ZooRecord],
               epochs: Mapping[str, int | None], memo: dict[str, float | None]) -> float | None:
    """similarity × the parent's accumulated epochs, or None (cold, or parent unknown)."""
    if rec.parent is None or rec.similarity is None or rec.parent not in by_id:
        return None
    total = _accumulated(rec.parent, by_id, epochs, memo, frozenset({rec.id}))
    return None if total is None else rec.similarity * total


def _accumulated(rec_id: str, by_id: Mapping[str, records.ZooRecord],
                 epochs: Mapping[str, int | None], memo: dict[str, float | None],
                 seen: frozenset[str]) -> float | None:
    """Epochs a record's weights embody: its own plus what its warm start inherited."""
    if rec_id in memo:
        return memo[rec_id]
    rec = by_id[rec_id]
    own = epochs[rec_id]
    inherited = 0.0
    if (rec.parent is not None and rec.similarity is not None and rec.parent in by_id
            and rec.parent not in seen):
        above = _accumulated(rec.parent, by_id, epochs, memo, seen | {rec_id})
        inherited = rec.similarity * above if above is not None else 0.0
    memo[rec_id] = None if own is None and not inherited else (own or 0) + inherited
    return memo[rec_id]
