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


def _job(name: str, seconds: float, *, namespace: str = "", asked: int = 1,
         arrival: float = 0.0) -> types.JobRequest:
    configs = (types.Config("single", 1, seconds), types.Config("ddp", 4, seconds / 3))
    return types.JobRequest(name, configs, arrival, asked, namespace=namespace)


def test_sjf_runs_the_shortest_estimate_first_on_the_asked_count() -> None:
    snapshot = types.Snapshot(0.0, (types.Node("n0", 1),), (
        _job("long", 30.0), _job("short", 10.0, arrival=5.0), _job("mid", 20.0)))
    plan = baselines.sjf_fair_share(snapshot)
    assert [(a.job, a.gpus, a.start) for a in sorted(plan.assignments, key=lambda a: a.start)
            ] == [("short", 1, 5.0), ("mid", 1, 15.0), ("long", 1, 35.0)]
    assert plan.solver == "sjf-fair-share"


def test_sjf_keeps_each_namespace_within_its_share_while_another_waits() -> None:
    heavy = [_job(f"a{i}", 30.0, namespace="a", asked=4) for i in range(3)]  # 10 s on 4
    light = _job("b0", 300.0, namespace="b", asked=4)  # 100 s on 4: shortest-first puts it last
    snapshot = types.Snapshot(0.0, (types.Node("n0", 8),), (*heavy, light))
    plan = baselines.sjf_fair_share(snapshot)
    start = {a.job: a.start for a in plan.assignments}
    assert start["b0"] == 0.0  # without the share, a0 and a1 would take all 8 GPUs first
    assert sorted(start[f"a{i}"] for i in range(3)) == [0.0, 10.0, 20.0]
    alone = baselines.sjf_fair_share(types.Snapshot(0.0, (types.Node("n0", 8),), tuple(heavy)))
    assert sorted(a.start for a in alone.assignments) == [0.0, 0.0, 10.0]  # no one else waits


def test_sjf_counts_running_jobs_against_their_namespace() -> None:
    running = (types.Running("r", "n0", 4, "ddp", 50.0, namespace="a"),)
    snapshot = types.Snapshot(0.0, (types.Node("n0", 8),), (
        _job("a1", 30.0, namespace="a", asked=4), _job("b1", 300.0, namespace="b", asked=4)),
        running)
    start = {a.job: a.start for a in baselines.sjf_fair_share(snapshot).assignments}
    assert start == {"b1": 0.0, "a1": 50.0}  # a already holds its share of 4


def test_sjf_lifts_the_share_when_no_other_namespace_waits() -> None:
    running = (types.Running("r", "n0", 1, "single", 50.0, namespace="b"),)
    snapshot = types.Snapshot(0.0, (types.Node("n0", 8),), tuple(
        _job(f"a{i}", 30.0, namespace="a", asked=1) for i in range(7)), running)
    plan = baselines.sjf_fair_share(snapshot)
    assert [a.start for a in plan.assignments] == [0.0] * 7  # b runs but does not wait


def test_plain_sjf_has_no_share_and_says_so() -> None:
    heavy = [_job(f"a{i}", 30.0, namespace="a", asked=4) for i in range(3)]
    light = _job("b0", 300.0, namespace="b", asked=4)
    plan = baselines.sjf_fair_share(types.Snapshot(0.0, (types.Node("n0", 8),),
                                                   (*heavy, light)), cap=False)
    start = {a.job: a.start for a in plan.assignments}
    assert sorted(start[f"a{i}"] for i in range(3)) == [0.0, 0.0, 10.0]
    assert start["b0"] == 10.0 and plan.solver == "sjf"


def test_least_attained_service_serves_the_namespace_that_has_had_least() -> None:
    queued = (_job("a1", 10.0, namespace="a"), _job("a2", 10.0, namespace="a", arrival=1.0),
              _job("b1", 10.0, namespace="b", arrival=2.0))
    snapshot = types.Snapshot(5.0, (types.Node("n0", 1),), queued)
    plan = baselines.least_attained_service(snapshot, {"a": 100.0, "b": 0.0})
    order = [a.job for a in sorted(plan.assignments, key=lambda a: a.start)]
    assert order == ["b1", "a1", "a2"]  # b has had least; then a's oldest first
    fresh = baselines.least_attained_service(snapshot, {})
    # a1 first (oldest); a has then been given 10 GPU-seconds, so b1 comes before a2
    assert [a.job for a in sorted(fresh.assignments, key=lambda a: a.start)] == [
        "a1", "b1", "a2"]
    assert plan.solver == "least-attained-service"
