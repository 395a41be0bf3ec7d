"""Tests for placement under completion time: each job's config chosen by when it would
finish (start now on what is free vs wait for more GPUs), backfilling that never delays a job
ahead, no pinning of queued jobs to the plan in force, and no flapping."""

from __future__ import annotations

import dataclasses
import random

import pytest
from unit.placement import cases

from kiln.placement import heuristic, planner, queues, simulate, types

CT = types.Settings(objective="completion-time")
NODE = (types.Node("n0", 8),)


def _wide() -> types.JobRequest:
    """A job that needs 4 GPUs (memory) and arrived first."""
    return types.JobRequest("wide", (types.Config("ddp", 4, 600.0), types.Config("ddp", 8, 400.0)),
                            arrival=0.0)


def _short() -> types.JobRequest:
    """A job that scales well: 300 s on 1 GPU, 90 s on 4."""
    return types.JobRequest("short", cases.amdahl_configs(300.0, 0.05, (1, 2, 4, 8)),
                            arrival=10.0)


def _busy_snapshot(*queued: types.JobRequest) -> types.Snapshot:
    """At 20 s, 6 of the node's 8 GPUs are held for 1000 s more: 2 are free now."""
    return types.Snapshot(20.0, NODE, queued,
                          (types.Running("holder", "n0", 6, "ddp", 1000.0),))


def test_a_short_job_starts_now_on_a_free_gpu_while_a_4_gpu_reservation_waits() -> None:
    alone = planner.replan(None, _busy_snapshot(_wide()), CT)
    line = queues.NodeQueues()
    plan = line.replan(_busy_snapshot(_wide(), _short()), CT)
    cases.check_plan(_busy_snapshot(_wide(), _short()), plan)
    by_job = {a.job: a for a in plan.assignments}
    # waiting 1000 s for 4 GPUs would end it at 1110 s; on the 2 free GPUs it ends by ~200 s
    assert by_job["short"].start == 20.0 and by_job["short"].gpus <= 2
    assert by_job["short"].end < 1020.0
    # ... and the 4-GPU job's reserved start is the one it had without the short job
    assert by_job["wide"].start == {a.job: a for a in alone.assignments}["wide"].start == 1020.0
    assert [a.job for a in line.start_heads({"n0": 2})] == ["short"]
    assert "wide" in line


def test_no_job_waits_for_more_gpus_when_fewer_now_finish_it_sooner() -> None:
    for seed in range(20):
        snapshot = cases.random_snapshot(seed, jobs=8, nodes=(8, 4), running=3, arrivals=True)
        snapshot = dataclasses.replace(snapshot, now=30.0)
        problem = heuristic.problem_of(snapshot, objective="completion-time", settings=CT)
        order = heuristic.priority_order(problem, "weighted-area")
        placed = heuristic.earliest_finish_schedule(problem, order)
        lines = heuristic.timelines(problem)
        for a in placed:  # replay in priority order: each job's pick against those before it
            for config in problem.options[a.job]:
                for node in snapshot.nodes:
                    if types.fits(config, node) and config.devices < a.devices:
                        start = lines[node.name].earliest(config.gpus, config.seconds,
                                                          problem.release[a.job])
                        assert start + config.seconds >= a.end - 1e-6, (seed, a, config)
            if a.devices > min(c.devices for c in problem.options[a.job]):
                assert a.start == problem.release[a.job]  # never waits to gather more GPUs
            lines[a.node].add(a.start, a.end, a.gpus)


@pytest.mark.parametrize("seed", range(10))
def test_backfill_never_delays_the_reserved_start_of_a_job_ahead(seed: int) -> None:
    snapshot = cases.random_snapshot(seed, jobs=10, nodes=(8, 8), running=2, arrivals=True)
    problem = heuristic.problem_of(snapshot, objective="completion-time", settings=CT)
    order = heuristic.priority_order(problem, "weighted-duration")
    full = {a.job: a for a in heuristic.earliest_finish_schedule(problem, order)}
    cases.check_plan(snapshot, types.Plan(tuple(full.values()), heuristic.makespan_of(
        problem, list(full.values())), "heuristic"))
    for i, name in enumerate(order):  # the jobs behind `name` never move it
        ahead = {a.job: a for a in heuristic.earliest_finish_schedule(problem, order[:i + 1])}
        assert full[name] == ahead[name]


def test_a_plan_is_kept_when_nothing_changes_and_no_job_flaps() -> None:
    rng = random.Random(4)
    queued = [types.JobRequest(f"j{i}", cases.amdahl_configs(rng.uniform(100, 900),
                                                            rng.uniform(0.02, 0.6)),
                               arrival=float(i), namespace=f"ns{i % 3}") for i in range(9)]
    nodes = (types.Node("a", 8), types.Node("b", 4))
    running = [types.Running("r", "a", 4, "ddp", 300.0)]
    line = queues.NodeQueues()
    line.replan(types.Snapshot(20.0, nodes, tuple(queued), tuple(running)), CT)
    started = line.start_heads({"a": 4, "b": 4})
    assert started
    running += [types.Running(a.job, a.node, a.gpus, a.parallelism, a.seconds)
                for a in started]
    left = tuple(j for j in queued if j.name in line)
    seen = []
    for now in (20.0, 25.0, 30.0, 35.0):  # nothing arrives, ends or starts: the plan stands
        snapshot = types.Snapshot(now, nodes, left, tuple(
            dataclasses.replace(r, remaining_seconds=r.remaining_seconds - (now - 20.0))
            for r in running))
        plan = line.replan(snapshot, CT)
        cases.check_plan(snapshot, plan)
        seen.append({a.job: (a.node, a.gpus, a.parallelism) for a in plan.assignments})
        assert line.start_heads({"a": 0, "b": 0}) == []
    assert all(s == seen[0] for s in seen)


def test_a_replay_never_moves_a_job_back_and_forth() -> None:
    jobs = [simulate.SimJob(f"j{i}", cases.amdahl_configs(300.0 * (1 + i % 4), 0.05 * (i % 5)),
                            arrival=60.0 * i, owner=f"u{i % 3}") for i in range(14)]
    nodes = (types.Node("a", 8), types.Node("b", 4))
    result = simulate.run(jobs, nodes, simulate.kiln_policy(CT, replanning=True))
    assert sorted(r.name for r in result.jobs) == sorted(j.name for j in jobs)
    assert result.restarts == 0  # re-planning alone never touches a running job
    # every start happened when the plan in force said "now" or its node's queue head was free
    for d in result.decisions:
        cases.check_plan(d.snapshot, d.plan)
