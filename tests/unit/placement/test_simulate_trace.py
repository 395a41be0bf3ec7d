"""Tests for the trace-shaped workloads of bench/placement_workload.py, replayed by the
simulator: shapes as documented, and every policy finishes them."""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kiln.placement import simulate, types


def _load_workload() -> ModuleType:
    # Loaded by file, not through sys.path: bench/ holds an operator.py that would shadow the
    # standard library's `operator` in every later subprocess that inherits sys.path.
    path = Path(__file__).resolve().parents[3] / "bench" / "placement_workload.py"
    spec = importlib.util.spec_from_file_location("placement_workload", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


workload = _load_workload()


@pytest.mark.parametrize("durations", ["lognormal", "pareto"])
@pytest.mark.parametrize("arrivals", ["poisson", "bursty"])
def test_trace_has_the_documented_shape(durations: str, arrivals: str) -> None:
    shape = workload.TraceShape(durations, arrivals, (8, 4), 200)
    jobs = workload.trace(shape, seed=3)
    assert jobs == workload.trace(shape, seed=3)  # seeded
    one_gpu = [min(c.seconds for c in j.true_configs) * (j.asked_gpus or 1) for j in jobs]
    assert max(one_gpu) > 8 * statistics.median(one_gpu)  # heavy tail
    assert sum(j.asked_gpus == 1 for j in jobs) > len(jobs) / 2  # most ask for 1 GPU
    for job in jobs:
        counts = sorted(c.gpus for c in job.true_configs)
        assert counts[-1] <= 8 and (counts[0] >= 2) == job.name.startswith("memory-bound")
        assert job.asked_gpus in counts
    assert len({j.owner for j in jobs}) >= 20  # many owners, as a shared cluster has
    times = [j.arrival for j in jobs]
    assert times == sorted(times) and times[0] == 0.0
    if arrivals == "bursty":  # a burst is one user's sweep, 5 s apart
        pairs = [(a, b) for a, b in itertools.pairwise(jobs)
                 if b.arrival - a.arrival == 5.0]
        assert pairs and all(a.owner == b.owner for a, b in pairs)


def test_a_trace_replays_under_every_baseline_and_kiln() -> None:
    shape = workload.TraceShape("pareto", "bursty", (8, 4), 14)
    jobs = simulate.with_noise(workload.trace(shape, seed=1), sigma=0.25, seed=1)
    nodes = (types.Node("a", 8), types.Node("b", 4))
    for policy in (simulate.whole_node_fifo(), simulate.fixed_k_fifo(1),
                   simulate.sjf_fair_share(), simulate.sjf_fair_share(cap=False),
                   simulate.least_attained_service(),
                   simulate.kiln_policy(types.Settings(), replanning=True)):
        result = simulate.run(jobs, nodes, policy, restart_seconds=60.0)
        assert sorted(r.name for r in result.jobs) == sorted(j.name for j in jobs)
        assert all(r.start >= r.arrival for r in result.jobs)
        slow = simulate.slowdowns(result, jobs, nodes)
        assert min(slow.values()) >= 1.0 - 1e-9  # never faster than alone at its fastest
        assert 0.0 < simulate.owner_fairness(result, jobs, nodes) <= 1.0
        assert 0.0 < simulate.job_fairness(result, jobs, nodes) <= 1.0
