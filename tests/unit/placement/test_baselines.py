"""Tests for kiln.placement.baselines: whole-node FIFO and fixed-k FIFO."""

from __future__ import annotations

import pytest
from unit.placement import cases

from kiln.placement import baselines, types


def _issue_case() -> types.Snapshot:
    configs = (types.Config("ddp", 8, 10.0), types.Config("ddp", 4, 16.0))
    return types.Snapshot(0.0, (types.Node("n0", 8),),
                          tuple(types.JobRequest(f"j{i}", configs) for i in range(2)))


def test_whole_node_fifo_runs_the_two_identical_jobs_one_after_the_other() -> None:
    plan = baselines.whole_node_fifo(_issue_case())
    assert [(a.job, a.gpus, a.start) for a in plan.assignments] == [
        ("j0", 8, 0.0), ("j1", 8, 10.0)]
    assert plan.makespan == 20.0 and plan.solver == "whole-node-fifo"


@pytest.mark.parametrize(("k", "makespan"), [pytest.param(4, 16.0, id="k4"),
                                             pytest.param(8, 20.0, id="k8"),
                                             pytest.param(2, 16.0, id="k2-falls-to-4")])
def test_fixed_k_fifo_uses_k_or_the_nearest_available_count(k: int, makespan: float) -> None:
    assert baselines.fixed_k_fifo(_issue_case(), k).makespan == makespan


@pytest.mark.parametrize("seed", range(6))
def test_fifo_baselines_keep_arrival_order_and_capacity(seed: int) -> None:
    snapshot = cases.random_snapshot(seed, jobs=12, nodes=(8, 8), running=seed % 3,
                                     arrivals=True)
    arrival = {j.name: j.arrival for j in snapshot.queued}
    for plan in (baselines.whole_node_fifo(snapshot), baselines.fixed_k_fifo(snapshot, 2)):
        by_arrival = sorted(plan.assignments, key=lambda a: arrival[a.job])
        starts = [a.start for a in by_arrival]
        assert starts == sorted(starts)  # no job overtakes an earlier arrival
        assert all(a.start >= arrival[a.job] for a in plan.assignments)
        assert max(cases.usage_peaks(snapshot, plan).values()) <= 8
        assert sorted(a.job for a in plan.assignments) == sorted(arrival)


def test_fixed_k_config_prefers_exact_then_below_then_smallest() -> None:
    job = types.JobRequest("j", (types.Config("single", 1, 9.0), types.Config("ddp", 4, 3.0),
                                 types.Config("fsdp", 4, 2.5)))
    assert baselines.fixed_k_config(job, 4, 8) == job.configs[2]
    assert baselines.fixed_k_config(job, 2, 8) == job.configs[0]
    assert baselines.fixed_k_config(job, 4, 2) == job.configs[0]
    only_wide = types.JobRequest("w", (types.Config("ddp", 4, 3.0),))
    assert baselines.fixed_k_config(only_wide, 1, 8) == only_wide.configs[0]
    assert baselines.fixed_k_config(only_wide, 1, 2) is None
