"""Per-job allowed nodes (`types.Config.nodes`, from scheduling constraints): the heuristic and
the MILP place a job only there, even when another node would finish it sooner."""

from __future__ import annotations

import pytest

from kiln.placement import planner, types

NODES = (types.Node("n1", 2), types.Node("n2", 2), types.Node("n3", 2))
HEURISTIC = types.Settings(use_milp=False, objective="makespan")
# A MILP run that is not skipped: the heuristic cannot meet the lower bound here.
MILP = types.Settings(objective="makespan", time_limit_seconds=20.0, milp_max_jobs=10)


def _job(name: str, seconds: float, nodes: frozenset[str] | None = None) -> types.JobRequest:
    return types.JobRequest(name, (types.Config("single", 1, seconds, nodes=nodes),
                                   types.Config("ddp", 2, seconds * 0.6, nodes=nodes)))


def test_a_config_fits_only_its_allowed_nodes() -> None:
    config = types.Config("single", 1, 10.0, nodes=frozenset({"n2"}))
    assert [n.name for n in NODES if types.fits(config, n)] == ["n2"]
    assert all(types.fits(types.Config("single", 1, 10.0), n) for n in NODES)


@pytest.mark.parametrize("settings", [
    pytest.param(HEURISTIC, id="heuristic"),
    pytest.param(MILP, id="milp", marks=pytest.mark.process)])  # the MILP solves in a worker
def test_constrained_jobs_share_their_one_node_while_the_others_stay_free(
        settings: types.Settings) -> None:
    only_n3 = frozenset({"n3"})
    jobs = (_job("a", 100.0, only_n3), _job("b", 100.0, only_n3), _job("c", 50.0, only_n3),
            _job("free", 100.0))
    plan = planner.plan(types.Snapshot(0.0, NODES, jobs), settings)
    nodes = {a.job: a.node for a in plan.assignments}
    assert nodes["a"] == nodes["b"] == nodes["c"] == "n3", plan
    # They queue on n3 rather than spill onto the idle nodes: never more than its 2 GPUs.
    on_n3 = [a for a in plan.assignments if a.node == "n3"]
    for t in {a.start for a in on_n3}:
        assert sum(a.gpus for a in on_n3 if a.start <= t < a.end - 1e-6) <= 2, plan


def test_a_job_whose_allowed_nodes_are_too_small_is_told_so() -> None:
    job = types.JobRequest("big", (types.Config("ddp", 4, 10.0, nodes=frozenset({"n1"})),))
    nodes = (types.Node("n1", 2), types.Node("n9", 8))
    reasons = types.unplaceable_reasons(types.Snapshot(0.0, nodes, (job,)))
    assert reasons == {"big": "its smallest config needs 4 devices but the nodes its scheduling "
                              "constraints allow (n1) have at most 2; allow more nodes, or "
                              "fewer GPUs"}
