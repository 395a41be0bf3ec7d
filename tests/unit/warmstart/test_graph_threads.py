"""Tracing is safe from many threads at once: torch.fx patches module calls process-wide, so
concurrent traces and validations (forward passes on meta) must not see each other."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import networkx as nx
import torch

from kiln import api, models
from kiln.models import tracing
from kiln.warmstart import decision, graph

SPECS = [
    ("small_cnn", {"depth": 3, "width": 8}, [1, 8, 8]),
    ("small_cnn", {"depth": 6, "width": 4}, [3, 16, 16]),
    ("small_resnet", {"blocks": [1, 1, 1], "width": 8}, [1, 8, 8]),
    ("small_resnet", {"blocks": [2, 1, 2], "width": 4}, [3, 16, 16]),
    ("vit", {"depth": 2, "width": 16, "heads": 2}, [3, 16, 16]),
    ("resnet18", {}, [3, 32, 32]),
    ("mobilenet_v2", {}, [3, 32, 32]),
]


def _spec(architecture: str, args: dict[str, Any], shape: list[int]) -> api.ModelSpec:
    return api.ModelSpec.model_validate(
        {"architecture": architecture, "args": args, "inputShape": shape})


def _snapshot(g: nx.DiGraph) -> dict[str, Any]:
    return graph.to_json(g)


def _forward_on_meta(spec: api.ModelSpec) -> list[int]:
    """What validation does between traces: build on meta and run a forward pass."""
    with torch.device("meta"):
        model = models.build(spec)
    sample = models.example_batch(spec, batch_size=2, device="meta")
    with tracing.LOCK, torch.no_grad():
        return list(model.eval()(sample).shape)


def test_graphs_traced_in_parallel_equal_the_single_threaded_ones() -> None:
    specs = [_spec(*s) for s in SPECS]
    expected = [_snapshot(decision.model_graph(spec)) for spec in specs]
    work = specs * 4
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        traced = list(pool.map(decision.model_graph, work))
        checked = list(pool.map(_forward_on_meta, work))
    assert [_snapshot(g) for g in traced] == expected * 4
    assert all(shape[0] == 2 for shape in checked)


def test_validation_while_other_threads_trace_reports_no_problems() -> None:
    jobs = [api.TrainingJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": f"j{i}"},
        "spec": {"model": {"architecture": a, "args": {**args, "num_classes": 10 + i},
                           "inputShape": shape}, "dataset": {"name": "digits"}}})
        for i, (a, args, shape) in enumerate(SPECS * 3)]
    specs = [_spec(*s) for s in SPECS] * 3
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        traces = [pool.submit(decision.model_graph, spec) for spec in specs]
        problems = list(pool.map(models.check_job, jobs))
        assert all(t.result().number_of_nodes() > 0 for t in traces)
    assert problems == [[]] * len(jobs)
