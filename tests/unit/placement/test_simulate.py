"""Tests for kiln.placement.simulate: faithful execution, metrics, and online replay checks
(no flapping, frozen slots kept, no job lost)."""

from __future__ import annotations

import dataclasses

import pytest
from unit.placement import cases

from kiln.placement import baselines, planner, simulate, types

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
    # True remaining times: the operator's 5 s floor would push frozen starts on these
    # 100 s jobs, and these tests check the planner's freeze rule alone.
    return simulate.run(jobs, NODES, simulate.kiln_policy(settings, replanning=True),
                        replan_on_completion=True, period_seconds=40.0, true_remaining=True)


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_online_replay_swaps_plans_only_when_better_by_the_threshold(noise: float) -> None:
    settings = dataclasses.replace(HEURISTIC, replan_threshold=0.05, objective="makespan")
    result = _replay(noise, settings)
    swaps = result.swaps
    assert 0 < swaps < len(result.decisions) - 1  # both branches are exercised
    for d in result.decisions[1:]:
        kept = planner.extend(d.previous, d.snapshot, settings)
        now = d.snapshot.now
        if d.plan.kept_current:
            assert d.plan.assignments == kept.assignments
        else:  # a swap: the new plan beats the kept one by more than the threshold
            ends = [sum(a.end - now for a in p.assignments) for p in (d.plan, kept)]
            assert (d.plan.makespan - now < 0.95 * (kept.makespan - now)
                    or (d.plan.makespan <= kept.makespan + 1e-6 and ends[0] < 0.95 * ends[1]))


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_online_replay_keeps_frozen_slots_and_loses_no_job(noise: float) -> None:
    # Under makespan (completion time freezes nothing: queued jobs are re-planned freely).
    settings = dataclasses.replace(HEURISTIC, freeze_window_seconds=30.0, objective="makespan",
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


def _pair(estimate_seconds: float) -> list[simulate.SimJob]:
    """`long` runs 100 s (estimated `estimate_seconds`); `late` arrives at 80 s."""
    return [simulate.SimJob("long", (types.Config("single", 1, 100.0),),
                            estimated_configs=(types.Config("single", 1, estimate_seconds),)),
            simulate.SimJob("late", (types.Config("single", 1, 10.0),), arrival=80.0)]


@pytest.mark.parametrize(("estimate", "seen"), [pytest.param(150.0, 70.0, id="overestimate"),
                                                pytest.param(50.0, 5.0, id="overran-floor")])
def test_the_policy_sees_running_jobs_as_the_operator_does(estimate: float,
                                                           seen: float) -> None:
    node = (types.Node("n0", 1),)
    result = simulate.run(_pair(estimate), node, simulate.fixed_k_fifo(1))
    at_arrival = next(d for d in result.decisions if d.trigger == "arrival"
                      and d.snapshot.now == 80.0)
    assert [r.remaining_seconds for r in at_arrival.snapshot.running] == [pytest.approx(seen)]
    assert {r.name: r.end for r in result.jobs} == {"long": 100.0, "late": 110.0}
    kinder = simulate.run(_pair(estimate), node, simulate.fixed_k_fifo(1), true_remaining=True)
    at_arrival = next(d for d in kinder.decisions if d.snapshot.now == 80.0)
    assert [r.remaining_seconds for r in at_arrival.snapshot.running] == [pytest.approx(20.0)]


def test_every_start_wakes_the_policy_again_as_in_the_operator() -> None:
    jobs = _workload(6, 24, arrivals=False)
    result = simulate.run(jobs, NODES, simulate.fixed_k_fifo(2))
    triggers = [d.trigger for d in result.decisions]
    assert triggers[0] == "arrival" and "start" in triggers and "completion" in triggers
    lazy = simulate.run(jobs, NODES, simulate.fixed_k_fifo(2), replan_after_start=False)
    assert "start" not in [d.trigger for d in lazy.decisions]


def _grow_at(when: float, gpus: int, node: str = "n0") -> simulate.Policy:
    """Fixed-k FIFO (k=1) that, at `when`, moves running job `a` to `gpus` x ddp on `node`."""
    def policy(snapshot: types.Snapshot, _current: types.Plan | None) -> simulate.Step:
        plan = baselines.fixed_k_fifo(snapshot, 1)
        moves = ((simulate.Move("a", node, gpus, "ddp"),) if snapshot.now == when
                 and any(r.job == "a" for r in snapshot.running) else ())
        return simulate.Step(plan, moves)
    return policy


def test_a_move_keeps_progress_and_pays_the_restart() -> None:
    a = simulate.SimJob("a", (types.Config("single", 1, 100.0), types.Config("ddp", 2, 50.0)))
    b = simulate.SimJob("b", (types.Config("single", 1, 10.0),), arrival=40.0)
    result = simulate.run([a, b], (types.Node("n0", 4),), _grow_at(40.0, 2),
                          restart_seconds=10.0)
    record = {r.name: r for r in result.jobs}["a"]
    # 40 % done in 40 s on 1 GPU; then 10 s restart and the other 60 % of 50 s on 2 GPUs
    assert record.end == pytest.approx(40.0 + 10.0 + 0.6 * 50.0)
    assert (record.gpus, record.parallelism, record.restarts) == (2, "ddp", 1)
    assert record.gpu_seconds == pytest.approx(1 * 40.0 + 2 * 40.0)
    assert result.restarts == 1
    assert [d.snapshot.now for d in result.decisions if d.moves] == [40.0]


def test_a_policy_that_moves_jobs_is_called_with_nothing_queued_as_the_operator_is() -> None:
    # b ends at 10 s with nothing queued: only a policy called then can grow a into its GPU.
    a = simulate.SimJob("a", (types.Config("single", 1, 100.0), types.Config("ddp", 2, 50.0)))
    b = simulate.SimJob("b", (types.Config("single", 1, 10.0),))
    nodes = (types.Node("n0", 2),)
    still = simulate.run([a, b], nodes, _grow_at(10.0, 2))
    assert still.restarts == 0 and {r.name: r.end for r in still.jobs}["a"] == 100.0
    moved = simulate.run([a, b], nodes, _grow_at(10.0, 2), moves=True)
    assert [(d.trigger, len(d.snapshot.queued), len(d.moves)) for d in moved.decisions
            if d.moves] == [("completion", 0, 1)]
    # 10 % done on 1 GPU; the other 90 % of 50 s on 2
    assert {r.name: r.end for r in moved.jobs}["a"] == pytest.approx(10.0 + 0.9 * 50.0)


def test_a_move_that_does_not_fit_is_reported() -> None:
    a = simulate.SimJob("a", (types.Config("single", 1, 100.0), types.Config("ddp", 8, 20.0)))
    b = simulate.SimJob("b", (types.Config("single", 1, 10.0),), arrival=40.0)
    with pytest.raises(simulate.SimulationError, match="moves a to 8 GPUs on n0, which has 4"):
        simulate.run([a, b], (types.Node("n0", 4),), _grow_at(40.0, 8))


def test_metrics_slowdown_percentile_and_jain() -> None:
    assert simulate.percentile([4.0, 1.0, 3.0, 2.0], 95) == 4.0
    assert simulate.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0
    assert simulate.jain_index([2.0, 2.0]) == 1.0
    assert simulate.jain_index([1.0, 0.0]) == 0.5
    jobs = [simulate.SimJob("x", (types.Config("single", 1, 10.0), types.Config("ddp", 2, 6.0)),
                            owner="u", asked_gpus=2),
            simulate.SimJob("y", (types.Config("single", 1, 10.0),), arrival=0.0, owner="v")]
    result = simulate.run(jobs, (types.Node("n0", 2),), simulate.fixed_k_fifo(2))
    slow = simulate.slowdowns(result, jobs)
    assert slow["x"] == pytest.approx(1.0)  # ran alone on what it asked for
    assert slow["y"] == pytest.approx(16.0 / 10.0)  # waited 6 s behind x
    assert simulate.owner_fairness(result, jobs) == pytest.approx(
        simulate.jain_index([1.0, 1.6]))


def test_slowdown_divides_by_the_fastest_feasible_config_not_the_asked_one() -> None:
    job = simulate.SimJob("z", (types.Config("single", 1, 10.0), types.Config("ddp", 2, 5.0),
                                types.Config("ddp", 8, 2.0)), asked_gpus=1)
    nodes = (types.Node("n0", 2),)
    result = simulate.run([job], nodes, simulate.fixed_k_fifo(1))
    # ran 10 s on the 1 GPU it asked for; alone on 2 GPUs (the most that fit) it takes 5 s
    assert simulate.slowdowns(result, [job], nodes) == {"z": pytest.approx(2.0)}
    assert simulate.slowdowns(result, [job]) == {"z": pytest.approx(5.0)}  # any node size
