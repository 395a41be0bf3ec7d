"""Zoo records in matchable form: one `Entry` per record, its graph prepared once.

Role: the memory side of `kiln.warmstart.index`. An `Entry` keeps a record's graph only as arrays
(`dag.Prepared`, its parent-side segments built once; never networkx: 10,000 models take tens
of MiB) with the `fingerprint` that keys scores and de-duplicates identical graphs.

Callers: `kiln.warmstart.index` (which re-exports `fingerprint`), `kiln.warmstart.scorecache`.
Non-goals: no scoring, no search, no I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import networkx as nx

from kiln.warmstart import dag, graph, scoring
from kiln.zoo import records

GraphInput: TypeAlias = nx.DiGraph | Mapping[str, Any]
"""A graph from `graph.extract`/`graph.from_json`, or its JSON dict (`graph.to_json`)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One indexed record: its metadata, prepared graph and graph fingerprint."""

    record: records.ZooRecord
    prepared: dag.Prepared
    fingerprint: str

    @property
    def group(self) -> tuple[str, str]:
        """(modality, task): a query compares only records of one group."""
        return (self.record.modality, self.record.task)


def fingerprint(g: GraphInput) -> str:
    """Stable SHA-256 (hex) of a graph's JSON form, without its `name` (which never affects
    scoring): equal architectures share cache entries whatever the job called them.

    Args:
        g: a graph, or its JSON dict as written by `graph.to_json` (hashed as given).
    """
    doc = graph.to_json(g) if isinstance(g, nx.DiGraph) else dict(g)
    doc.pop("name", None)
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def make_entry(record: records.ZooRecord, graph_input: GraphInput) -> Entry:
    """Prepare a record's graph; the networkx graph is dropped, only arrays stay.

    Raises:
        graph.GraphError: the graph JSON is malformed or cannot be prepared.
    """
    g = graph_input if isinstance(graph_input, nx.DiGraph) else graph.from_json(dict(graph_input))
    prepared = dag.prepare(g)
    prepared.segments()  # the parent-side arrays, built once here instead of in every worker
    return Entry(record, prepared, fingerprint(g))


def distinct_graphs(entries: Sequence[Entry]) -> tuple[list[int], list[scoring.Keyed]]:
    """Positions into the distinct graphs of `entries`, and those (fingerprint, graph)."""
    position: dict[str, int] = {}
    distinct: list[scoring.Keyed] = []
    positions = []
    for entry in entries:
        if entry.fingerprint not in position:
            position[entry.fingerprint] = len(distinct)
            distinct.append((entry.fingerprint, entry.prepared))
        positions.append(position[entry.fingerprint])
    return positions, distinct


def array_bytes(p: dag.Prepared) -> int:
    """Bytes held in the numpy arrays of a prepared graph (segments included)."""
    arrays: list[Any] = [p.op_codes, p.dims, p.ranks, p.sizes, p.pred_rows, *p.preds]
    segments = p.cache.get("segments")
    if segments is not None:
        arrays += [getattr(segments, f.name) for f in dataclasses.fields(segments)]
    return sum(int(a.nbytes) for a in arrays)
