"""Tests for kiln.placement.simulate: faithful execution, metrics, and online replay checks
(no flapping, frozen slots kept, no job lost)."""

from __future__ import annotations

import dataclasses

import pytest
from unit.placement import cases

from kiln.placement import planner, simulate, types

NODES = (types.Node("a", 8), types.Node("b", 8))
HEURISTIC = types.Settings(use_milp=False)


def _workload(seed: int, jobs: int, *, arrivals: bool) -> tuple[simulate.SimJob, ...]:
    snapshot = cases.random_snapshot(seed, jobs=jobs, nodes=(8, 8), scale=100.0,
                                     arrivals=arrivals)
    return tuple(simulate.SimJob(j.name, j.configs, j.arrival) for j in snapshot.queued)


def _never_over_capacity(result: simulate.Result, nodes: tuple[types.Node, ...]) -> None:
    for node in nodes:
        spans = [(r.start, r.end, r.gpus) for r in result.jobs if r.node == node.name]
        for t, _, _ in spans:
            assert sum(g for s, e, g in spans if s <= t < e) <= node.gpus


def test_issue_case_whole_node_fifo_takes_20_and_the_planner_16() -> None:
    configs = (types.Config("ddp", 8, 10.0), types.Config("ddp", 4, 16.0))
    jobs = [simulate.SimJob(f"j{i}", configs) for i in range(2)]
    node = (types.Node("n0", 8),)
    fifo = simulate.run(jobs, node, simulate.whole_node_fifo(), name="fifo")
    kiln = simulate.run(jobs, node, simulate.kiln_policy(HEURISTIC, replanning=False))
    assert fifo.makespan_seconds == 20.0 and kiln.makespan_seconds == 16.0
    assert kiln.gpu_utilisation == 1.0 and kiln.mean_completion_seconds == 16.0
    assert fifo.mean_completion_seconds == 15.0


def test_without_noise_execution_matches_the_plan() -> None:
    jobs = _workload(1, 14, arrivals=False)
    result = simulate.run(jobs, NODES, simulate.kiln_policy(HEURISTIC, replanning=False))
    planned = result.decisions[0].plan
    assert result.makespan_seconds == pytest.approx(planned.makespan)
    for record in result.jobs:
        a = planned.for_job(record.name)
        assert a is not None and (record.node, record.gpus) == (a.node, a.gpus)
        assert record.start <= a.start + 1e-9
    _never_over_capacity(result, NODES)


@pytest.mark.parametrize("policy", ["whole-node", "fixed-k", "heuristic"])
def test_every_policy_finishes_every_job_once(policy: str) -> None:
    jobs = simulate.with_noise(_workload(2, 16, arrivals=True), sigma=0.2, seed=2)
    chosen = {"whole-node": simulate.whole_node_fifo(), "fixed-k": simulate.fixed_k_fifo(2),
              "heuristic": simulate.kiln_policy(HEURISTIC, replanning=True)}[policy]
    result = simulate.run(jobs, NODES, chosen, replan_on_completion=True, period_seconds=50.0)
    assert sorted(r.name for r in result.jobs) == sorted(j.name for j in jobs)
    assert all(r.start >= r.arrival for r in result.jobs)
    _never_over_capacity(result, NODES)
    assert 0.0 < result.gpu_utilisation <= 1.0


def _replay(noise: float, settings: types.Settings) -> simulate.Result:
    jobs = _workload(3, 18, arrivals=True)
    if noise:
        jobs = simulate.with_noise(jobs, sigma=noise, seed=3)
    return simulate.run(jobs, NODES, simulate.kiln_policy(settings, replanning=True),
                        replan_on_completion=True, period_seconds=40.0)


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_online_replay_swaps_plans_only_when_better_by_the_threshold(noise: float) -> None:
    settings = dataclasses.replace(HEURISTIC, replan_threshold=0.05)
    result = _replay(noise, settings)
    swaps = result.swaps
    assert 0 < swaps < len(result.decisions) - 1  # both branches are exercised
    for d in result.decisions[1:]:
        kept = planner.extend(d.previous, d.snapshot, settings)
        now = d.snapshot.now
        if d.plan.kept_current:
            assert d.plan.assignments == kept.assignments
        else:  # a swap: the new plan beats the kept one by more than the threshold
            assert d.plan.makespan - now < 0.95 * (kept.makespan - now)


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_online_replay_keeps_frozen_slots_and_loses_no_job(noise: float) -> None:
    settings = dataclasses.replace(HEURISTIC, freeze_window_seconds=30.0,
                                   replan_threshold=0.0)  # swap whenever better
    result = _replay(noise, settings)
    checked = 0
    for d in result.decisions[1:]:
        now, queued = d.snapshot.now, {j.name for j in d.snapshot.queued}
        assert {a.job for a in d.plan.assignments} == queued
        for old in d.previous.assignments:
            if old.job not in queued or old.start > now + 30.0:
                continue
            new = d.plan.for_job(old.job)
            assert new is not None and (new.node, new.gpus, new.parallelism) == (
                old.node, old.gpus, old.parallelism)
            assert new.start >= max(old.start, now) - 1e-9
            if noise == 0.0:  # estimates are exact: nothing can push a frozen start
                assert new.start == pytest.approx(max(old.start, now))
            checked += 1
    assert checked > 0
    assert len({r.name for r in result.jobs}) == len(result.jobs) == 18  # each ran once


def test_a_plan_that_loses_a_job_is_reported() -> None:
    jobs = _workload(4, 3, arrivals=False)

    def lossy(snapshot: types.Snapshot, _current: types.Plan | None) -> types.Plan:
        full = planner.plan(snapshot, HEURISTIC)
        return dataclasses.replace(full, assignments=full.assignments[1:])

    with pytest.raises(simulate.SimulationError, match="plan places"):
        simulate.run(jobs, NODES, lossy)


def test_milp_with_replanning_replays_a_small_online_workload() -> None:
    jobs = simulate.with_noise(_workload(5, 6, arrivals=True), sigma=0.1, seed=5)
    settings = types.Settings(time_limit_seconds=1.0)
    result = simulate.run(jobs, NODES, simulate.kiln_policy(settings, replanning=True))
    assert len(result.jobs) == 6
    _never_over_capacity(result, NODES)
    assert result.solve_seconds > 0.0
