"""Tests for the placement objectives: which one `planner.objective_of` picks, weighted
completion time with aging, priorities, GPU-second price, namespace quotas, keep-or-replace on
the same objective, and the MILP's part."""

from __future__ import annotations

import dataclasses
import re

import pytest
from unit.placement import cases

from kiln.placement import heuristic, planner, simulate, types

CT = types.Settings(use_milp=False, objective="completion-time")
NODE1 = (types.Node("n0", 1),)


def _job(name: str, seconds: float, *, arrival: float = 0.0, **kw: object) -> types.JobRequest:
    return types.JobRequest(name, (types.Config("single", 1, seconds),), arrival,
                            **kw)  # type: ignore[arg-type]


def _order(plan: types.Plan) -> list[str]:
    return [a.job for a in sorted(plan.assignments, key=lambda a: (a.start, a.job))]


@pytest.mark.parametrize(("queued", "running", "current", "want"), [
    pytest.param([("a", 0.0, "s"), ("b", 300.0, "s")], 0, None, "makespan", id="one-group"),
    pytest.param([("a", 0.0, "s"), ("b", 0.0, "t")], 0, None, "completion-time",
                 id="two-groups"),
    pytest.param([("a", 0.0, ""), ("b", 30.0, "")], 0, None, "makespan", id="one-batch"),
    pytest.param([("a", 0.0, ""), ("b", 300.0, "")], 0, None, "completion-time",
                 id="spread-arrivals"),
    pytest.param([("a", 0.0, "")], 0, None, "completion-time", id="one-job"),
    pytest.param([("a", 0.0, ""), ("b", 30.0, "")], 1, None, "completion-time",
                 id="batch-while-others-run"),
    pytest.param([("a", 0.0, ""), ("b", 30.0, "")], 1, "makespan", "makespan",
                 id="sweep-under-way"),
])
def test_auto_objective_is_makespan_for_a_sweep_and_completion_time_for_arrivals(
        queued: list[tuple[str, float, str]], running: int, current: str | None,
        want: str) -> None:
    snapshot = types.Snapshot(
        400.0, (types.Node("n0", 8),),
        tuple(_job(n, 10.0, arrival=t, group=g) for n, t, g in queued),
        tuple(types.Running(f"r{i}", "n0", 1, "single", 50.0) for i in range(running)))
    plan = None if current is None else types.Plan((), 0.0, "heuristic", objective=current)
    assert planner.objective_of(snapshot, types.Settings(), plan) == want
    for explicit in ("makespan", "completion-time"):
        assert planner.objective_of(snapshot, types.Settings(objective=explicit),
                                    plan) == explicit


def test_completion_time_runs_short_jobs_first_and_makespan_does_not() -> None:
    snapshot = types.Snapshot(0.0, NODE1, (_job("long", 100.0), _job("mid", 50.0),
                                          _job("short", 10.0)))
    plan = planner.plan(snapshot, dataclasses.replace(CT, use_milp=True, gpu_cost=0.0))
    cases.check_plan(snapshot, plan)
    assert _order(plan) == ["short", "mid", "long"]
    assert plan.objective == "completion-time" and plan.milp == "skipped"
    assert "MILP skipped: it minimises makespan" in plan.reason
    # without a GPU-second price the cost is the sum of completion times: 10 + 60 + 160
    assert plan.cost == pytest.approx(230.0)
    longest_first = planner.plan(snapshot, dataclasses.replace(CT, objective="makespan"))
    assert _order(longest_first)[0] == "long"


def test_a_job_that_scales_poorly_gets_one_gpu_and_one_that_scales_well_more() -> None:
    poor = types.JobRequest("poor", tuple(types.Config("ddp" if k > 1 else "single", k,
                                                       100.0 * (0.9 + 0.1 / k))
                                          for k in (1, 2, 4, 8)))
    good = types.JobRequest("good", tuple(types.Config("ddp" if k > 1 else "single", k,
                                                       100.0 * (0.02 + 0.98 / k))
                                          for k in (1, 2, 4, 8)))
    others = tuple(_job(f"o{i}", 100.0) for i in range(2))
    snapshot = types.Snapshot(0.0, (types.Node("n0", 8),), (poor, good, *others))
    plan = planner.plan(snapshot, CT)
    cases.check_plan(snapshot, plan)
    by_job = {a.job: a.gpus for a in plan.assignments}
    assert by_job["poor"] == 1
    assert by_job["good"] > 1
    # alone in the queue, with no allowance for later arrivals, the fastest config is the
    # cheapest; the default allowance keeps it on one GPU
    alone = types.Snapshot(0.0, (types.Node("n0", 8),), (poor,))
    assert planner.plan(alone, dataclasses.replace(CT, unseen_weight=0.0)
                        ).assignments[0].gpus == 8
    assert planner.plan(alone, CT).assignments[0].gpus == 1


def test_higher_priority_goes_first_and_outweighs_a_shorter_job() -> None:
    snapshot = types.Snapshot(0.0, NODE1, (_job("a-normal", 10.0),
                                          _job("z-high", 10.0, weight=4.0),
                                          _job("b-short-normal", 8.0)))
    plan = planner.plan(snapshot, CT)
    assert _order(plan) == ["z-high", "b-short-normal", "a-normal"]
    with pytest.raises(ValueError, match="JobRequest.weight: job x must have a finite weight > 0"):
        _job("x", 1.0, weight=0.0)


def _stream(long_seconds: float, shorts: int) -> list[simulate.SimJob]:
    """A long job and a short one at 0, then a 10 s job 1 s before each one ends: one GPU
    never idles and the long job is never the only one queued."""
    one = (types.Config("single", 1, 10.0),)
    return [simulate.SimJob("long", (types.Config("single", 1, long_seconds),), 0.0),
            *(simulate.SimJob(f"s{i:03d}", one, max(0.0, 10.0 * i - 1.0))
              for i in range(shorts))]


@pytest.mark.parametrize(("aging_seconds", "starts_before_stream_ends"), [
    (20.0, True), (1e12, False)])
def test_aging_starts_a_long_job_under_a_steady_stream_of_short_ones(
        aging_seconds: float, starts_before_stream_ends: bool) -> None:
    settings = dataclasses.replace(CT, aging_seconds=aging_seconds, freeze_window_seconds=0.0)
    jobs = _stream(200.0, 80)
    result = simulate.run(jobs, NODE1, simulate.kiln_policy(settings, replanning=True))
    started = {r.name: r.start for r in result.jobs}
    assert len(started) == len(jobs)  # everyone ran
    last_short_arrival = max(j.arrival for j in jobs)
    assert (started["long"] < last_short_arrival) == starts_before_stream_ends
    if starts_before_stream_ends:
        # weight (1 + wait / 20) / 200 s overtakes a fresh short job's 1 / 10 s after ~380 s
        assert 300.0 <= started["long"] <= 500.0


def test_namespace_quota_caps_concurrent_gpus_counting_running_jobs() -> None:
    configs = tuple(types.Config("ddp" if k > 1 else "single", k, 100.0 / k) for k in (1, 2, 4))
    queued = tuple(types.JobRequest(f"a{i}", configs, namespace="team-a") for i in range(4))
    queued += (types.JobRequest("b0", configs, namespace="team-b"),)
    running = (types.Running("a-run", "n0", 1, "single", 30.0, namespace="team-a"),)
    snapshot = types.Snapshot(0.0, (types.Node("n0", 8),), queued, running)
    settings = dataclasses.replace(CT, namespace_gpu_quota=(("team-a", 2),))
    plan = planner.plan(snapshot, settings)
    cases.check_plan(snapshot, plan)
    spans = [(0.0, 30.0, 1)] + [(a.start, a.end, a.gpus) for a in plan.assignments
                                if a.job.startswith("a")]
    for t in sorted({s for s, _, _ in spans}):
        assert sum(g for s, e, g in spans if s <= t < e) <= 2, t
    assert plan.for_job("b0") is not None and plan.for_job("b0").start == 0.0  # type: ignore
    with_milp = planner.plan(snapshot, dataclasses.replace(settings, use_milp=True,
                                                           objective="makespan"))
    assert "MILP skipped: namespace GPU quotas apply" in with_milp.reason


def test_a_job_wider_than_its_namespace_quota_is_unplaceable_with_the_fix() -> None:
    wide = types.JobRequest("w", (types.Config("ddp", 4, 10.0),), namespace="team-a")
    snapshot = types.Snapshot(0.0, (types.Node("n0", 8),), (wide,))
    settings = dataclasses.replace(CT, namespace_gpu_quota=(("team-a", 2),))
    with pytest.raises(types.Unplaceable, match="namespace team-a has a quota of 2; raise "
                                                "--namespace-gpu-quota"):
        planner.plan(snapshot, settings)
    with pytest.raises(ValueError, match="Settings.namespace_gpu_quota: namespace 'x'"):
        types.Settings(namespace_gpu_quota=(("x", 0),))
    with pytest.raises(ValueError, match="Settings.objective: unknown 'fast'"):
        types.Settings(objective="fast")


def _long_then_short(start: float) -> types.Plan:
    """A current plan running the long job first, from `start`."""
    return types.Plan((types.Assignment("long", "n0", 1, "single", start, 100.0),
                       types.Assignment("short", "n0", 1, "single", start + 100.0, 10.0)),
                      start + 110.0, "heuristic", objective="completion-time")


def test_replan_judges_the_fresh_plan_on_the_objective_it_was_planned_for() -> None:
    snapshot = types.Snapshot(0.0, NODE1, (_job("long", 100.0), _job("short", 10.0)))
    # the same makespan either way: only completion time can justify a swap
    replaced = planner.replan(_long_then_short(200.0), snapshot, CT)
    assert not replaced.kept_current and _order(replaced) == ["short", "long"]
    assert replaced.objective == "completion-time"
    assert re.match(r"queued jobs placed afresh \(under completion time none is pinned; the "
                    r"plan in force would cost [0-9.]+ weighted job-seconds\): ",
                    replaced.reason), replaced.reason
    # queued jobs are not pinned under completion time: the threshold is for makespan only
    strict = planner.replan(_long_then_short(200.0), snapshot,
                            dataclasses.replace(CT, replan_threshold=0.9))
    assert not strict.kept_current and _order(strict) == ["short", "long"]
    assert strict.reason.startswith(
        "queued jobs placed afresh (under completion time none is pinned")
    again = planner.replan(strict, snapshot, CT)  # nothing changed: the same plan
    assert again.assignments == strict.assignments
    problem = heuristic.problem_of(snapshot, objective="completion-time", settings=CT)
    assert again.cost == pytest.approx(heuristic.cost(problem, again.assignments))
    makespan = planner.replan(_long_then_short(200.0), snapshot,
                              dataclasses.replace(CT, objective="makespan"))
    assert makespan.kept_current and makespan.objective == "makespan"
    assert makespan.reason == ("kept current plan: new remaining makespan 110.0 s vs 110.0 s "
                               "(threshold 5%)")


def test_milp_win_fraction_counts_only_calls_that_ran_it() -> None:
    def plan(milp: str) -> types.Plan:
        return types.Plan((), 0.0, "heuristic", milp=milp)
    assert planner.milp_win_fraction([plan("skipped")]) is None
    assert planner.milp_win_fraction([plan(m) for m in ("won", "lost", "failed", "skipped",
                                                         "won")]) == pytest.approx(0.5)


@pytest.mark.process
def test_a_small_makespan_sweep_opted_in_runs_the_milp_and_reports_how_it_fared() -> None:
    snapshot = cases.random_snapshot(8, jobs=4, nodes=(4, 4), integer=True, scale=30.0)
    assert planner.plan(snapshot, types.Settings(time_limit_seconds=5.0)).milp == "skipped"
    plan = planner.plan(snapshot, types.Settings(time_limit_seconds=5.0, slots=24,
                                                 use_milp=True))
    assert plan.objective == "makespan"
    assert plan.milp in ("won", "lost") or "meets the lower bound" in plan.reason


def test_nonsense_inputs_are_refused_naming_the_field_and_an_empty_cluster_plans_nothing(
) -> None:
    import math

    for make, field in [
        (lambda: types.Node("n1", -4), "Node.gpus"),
        (lambda: types.Snapshot(now=math.nan, nodes=(), queued=()), "Snapshot.now"),
        (lambda: types.JobRequest(name="j", configs=(), weight=math.inf), "JobRequest.weight"),
        (lambda: types.JobRequest(name="j", configs=(), arrival=-math.inf),
         "JobRequest.arrival"),
    ]:
        with pytest.raises(ValueError, match=field):
            make()
    empty = planner.plan(types.Snapshot(now=0.0, nodes=(), queued=()))
    assert empty.assignments == () and empty.makespan == 0
