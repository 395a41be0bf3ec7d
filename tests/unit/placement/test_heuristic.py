"""Tests for kiln.placement.heuristic: timelines, k policies, list scheduling, lower bound."""

from __future__ import annotations

import pytest
from unit.placement import cases

from kiln.placement import heuristic, timeline, types

SETTINGS = types.Settings(use_milp=False)


def _two_identical_jobs() -> types.Snapshot:
    configs = (types.Config("ddp", 8, 10.0), types.Config("ddp", 4, 16.0))
    return types.Snapshot(0.0, (types.Node("n0", 8),),
                          tuple(types.JobRequest(f"j{i}", configs) for i in range(2)))


def test_two_identical_jobs_share_the_node_at_four_gpus_each() -> None:
    """d(8)=10, d(4)=16 -> both at k=4 concurrently, makespan 16."""
    plan = heuristic.schedule(heuristic.problem_of(_two_identical_jobs()), SETTINGS)
    assert [(a.gpus, a.start) for a in plan.assignments] == [(4, 0.0), (4, 0.0)]
    assert plan.makespan == 16.0
    assert plan.lower_bound == 16.0


def test_timeline_finds_the_earliest_window_with_enough_free_gpus() -> None:
    line = timeline.Timeline(8)
    line.add(0.0, 10.0, 6)
    line.add(5.0, 20.0, 2)
    # held: 6 over [0, 5), 8 over [5, 10), 2 over [10, 20)
    assert line.earliest(2, 5.0, 0.0) == 0.0
    assert line.earliest(2, 6.0, 0.0) == 10.0
    assert line.earliest(6, 1.0, 0.0) == 10.0
    assert line.earliest(8, 1.0, 0.0) == 20.0
    assert line.earliest(2, 3.0, 1.0) == 1.0
    assert line.earliest(1, 1.0, 7.0) == 10.0
    assert line.peak() == 8


def test_running_jobs_pin_their_gpus_until_their_remaining_time_ends() -> None:
    snapshot = types.Snapshot(
        100.0, (types.Node("n0", 8),),
        (types.JobRequest("new", (types.Config("ddp", 8, 10.0),)),),
        (types.Running("old", "n0", 2, "ddp", 30.0),))
    plan = heuristic.schedule(heuristic.problem_of(snapshot), SETTINGS)
    assert plan.assignments[0].start == 130.0
    assert plan.makespan == 140.0
    cases.check_plan(snapshot, plan)


def test_jobs_never_start_before_they_arrive() -> None:
    snapshot = types.Snapshot(0.0, (types.Node("n0", 8),), (
        types.JobRequest("late", (types.Config("single", 1, 5.0),), arrival=50.0),))
    plan = heuristic.schedule(heuristic.problem_of(snapshot), SETTINGS)
    assert plan.assignments[0].start == 50.0
    assert plan.lower_bound == 55.0


@pytest.mark.parametrize(("policy", "gpus"), [
    pytest.param("area", 1, id="min-area"),
    pytest.param("knee", 4, id="knee"),
    pytest.param("fastest", 8, id="fastest"),
    pytest.param("k=2", 2, id="fixed-2"),
    pytest.param("k=3", 2, id="fixed-below"),
])
def test_k_policies_pick_the_expected_gpu_count(policy: str, gpus: int) -> None:
    # speed-ups 1.9, 3.6, 5.0: efficiency 0.95, 0.9, 0.625 per doubling step
    options = (types.Config("single", 1, 100.0), types.Config("ddp", 2, 100 / 1.9),
               types.Config("ddp", 4, 100 / 3.6), types.Config("ddp", 8, 100 / 5.0))
    assert heuristic.choose_k(options, policy, knee_efficiency=0.75).gpus == gpus


def test_unknown_k_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown"):
        heuristic.choose_k((types.Config("single", 1, 1.0),), "random")


def test_lower_bound_is_max_of_area_and_longest_job() -> None:
    configs = (types.Config("single", 1, 80.0), types.Config("ddp", 8, 20.0))
    one = types.Snapshot(0.0, (types.Node("n", 8),), (types.JobRequest("a", configs),))
    assert heuristic.lower_bound(heuristic.problem_of(one)) == 20.0  # longest (fastest k)
    many = types.Snapshot(0.0, (types.Node("n", 8),),
                          tuple(types.JobRequest(f"j{i}", configs) for i in range(16)))
    assert heuristic.lower_bound(heuristic.problem_of(many)) == 160.0  # 16 * 80 / 8


def test_unplaceable_job_is_named() -> None:
    snapshot = types.Snapshot(0.0, (types.Node("n", 4),), (
        types.JobRequest("wide", (types.Config("ddp", 8, 1.0),)),))
    with pytest.raises(types.Unplaceable, match="job wide"):
        heuristic.problem_of(snapshot)


def test_duplicate_job_names_are_rejected() -> None:
    job = types.JobRequest("same", (types.Config("single", 1, 1.0),))
    with pytest.raises(ValueError, match="unique"):
        heuristic.problem_of(types.Snapshot(0.0, (types.Node("n", 1),), (job, job)))


@pytest.mark.parametrize("seed", range(12))
def test_heuristic_plans_are_valid_on_random_instances(seed: int) -> None:
    nodes = [(8,), (8, 8), (4, 8), (8, 8, 8, 8)][seed % 4]
    snapshot = cases.random_snapshot(seed, jobs=3 + 3 * seed, nodes=nodes,
                                     running=seed % 3, arrivals=seed % 2 == 1)
    plan = heuristic.schedule(heuristic.problem_of(snapshot), SETTINGS)
    cases.check_plan(snapshot, plan)
    assert plan.solver == "heuristic"


@pytest.mark.parametrize("policy", ["area", "knee"])
def test_single_policy_heuristics_are_valid(policy: str) -> None:
    snapshot = cases.random_snapshot(3, jobs=10, nodes=(8, 8))
    settings = types.Settings(use_milp=False, k_policy=policy)
    cases.check_plan(snapshot, heuristic.schedule(heuristic.problem_of(snapshot), settings))


@pytest.mark.parametrize("seed", [16, 31])  # one-job changes stall above the optimum here
def test_kicks_reach_the_optimum_where_one_job_changes_stall(seed: int) -> None:
    nodes = [(8,), (4, 4), (8,), (4, 8)][seed % 4]
    snapshot = cases.random_snapshot(seed, jobs=5, nodes=nodes, integer=True, scale=30.0)
    problem = heuristic.problem_of(snapshot, objective="makespan")
    optimum = cases.brute_force_makespan(snapshot)
    stalled = heuristic.schedule(problem, SETTINGS, kicks=False)
    kicked = heuristic.schedule(problem, SETTINGS)
    assert stalled.makespan > optimum
    assert kicked.makespan == pytest.approx(optimum)
    assert "0 kick(s) kept" not in kicked.reason
    cases.check_plan(snapshot, kicked)


@pytest.mark.parametrize("seed", range(4))
def test_kicks_never_lose_and_draw_the_same_plan_every_time(seed: int) -> None:
    snapshot = cases.random_snapshot(200 + seed, jobs=12, nodes=[(8,), (8, 8)][seed % 2],
                                     running=seed % 2, arrivals=seed >= 2)
    problem = heuristic.problem_of(snapshot, objective="makespan")
    kicked = heuristic.schedule(problem, SETTINGS)
    assert kicked.makespan <= heuristic.schedule(problem, SETTINGS, kicks=False).makespan
    assert heuristic.schedule(problem, SETTINGS).assignments == kicked.assignments
    cases.check_plan(snapshot, kicked)
