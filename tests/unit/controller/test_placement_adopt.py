"""The placement loop knows running jobs again after an operator restart, and a job whose
freezing cut its compute gains less from more devices."""

from __future__ import annotations

import asyncio
from typing import Any

from kubesim import selection
from unit.controller import resize_cases

from kiln import api
from kiln.controller import jobs, kube, main, metrics, placement_loop, pods
from kiln.controller import settings as operator_settings
from kiln.placement import introspect
from kiln.warmstart import select


def _pod(name: str, *, job: str | None, gpus: int) -> dict[str, Any]:
    labels = {api.JOB_NAME_LABEL: job, api.ATTEMPT_LABEL: "0"} if job else {}
    container = {"name": "c", "resources": {"limits": {pods.GPU_RESOURCE: str(gpus)}}}
    return {"metadata": {"name": name, "namespace": "ns", "labels": labels, "annotations": {
        pods.NODE_ANNOTATION: resize_cases.NODE, pods.GPUS_ANNOTATION: str(gpus),
        pods.DEVICE_ANNOTATION: "gpu", pods.PARALLELISM_ANNOTATION: "single"}},
        "spec": {"nodeName": resize_cases.NODE, "containers": [container]}, "status": {"phase": "Running"}}


class _Cluster:
    """A node with 2 GPUs; job "a" runs on one, started before the loop existed."""

    def __init__(self) -> None:
        self.nodes = [{"metadata": {"name": resize_cases.NODE}, "status": {
            "allocatable": {pods.GPU_RESOURCE: "2"},
            "conditions": [{"type": "Ready", "status": "True"}]}}]
        self.pods = {"a": _pod("a", job="a", gpus=1)}
        self.moves: list[introspect.Move] = []

    async def list(self, path: str, *, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        if path == kube.Paths.nodes():
            return self.nodes
        return [dict(p) for p in selection.select(self.pods.values(), labels=label_selector,
                                                  fields=field_selector)]

    async def launch(self, *_: Any) -> bool:
        raise AssertionError("nothing is queued")

    async def resize(self, ref: jobs.JobRef, move: introspect.Move, device: str) -> bool:
        self.moves.append(move)
        return True


async def _nothing(*_: Any) -> None:
    return None


def _loop(state: _Cluster) -> placement_loop.PlacementLoop:
    settings = main.loop_settings(operator_settings.Options(
        placement_interval_seconds=1.0, cpu_slots_per_node=1, max_gpus_per_job=2,
        placement_use_milp=False, resize_min_gain=2.0, resize_min_interval_seconds=300.0,
        resize_restart_seconds=60.0, resize_grow_price=0.0))  # GPUs taken while idle: free
    return placement_loop.PlacementLoop(
        client=state,  # type: ignore[arg-type]  # lists nodes and pods, as the loop needs
        settings=settings, launch=state.launch, publish=_nothing, unplaceable=_nothing,
        zoo_records=list, metrics=metrics.OperatorMetrics(), clock=lambda: 1000.0,
        eta_seconds={"ns/a": 2000.0}, resize=state.resize)


def _entry() -> placement_loop.Queued:
    decision = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "no zoo models")
    return placement_loop.Queued(jobs.JobRef("ns", "a"), resize_cases.heavy_job("a"), decision, since=0.0)


def _moves(*, adopt: bool, since: float | None = None,
           compute_fraction: float | None = None) -> list[introspect.Move]:
    state = _Cluster()
    loop = _loop(state)

    async def scenario() -> None:
        if adopt:
            await loop.adopt(_entry(), "gpu", since=since)
        if compute_fraction is not None:
            loop.observe_progress("ns/a", samples_per_second=None, step=None, now=1000.0,
                                  compute_fraction=compute_fraction)
        await loop.tick()

    asyncio.run(scenario())
    return state.moves


def test_a_job_running_since_before_a_restart_grows_once_adopted() -> None:
    assert _moves(adopt=False) == []  # unknown to a fresh loop: never moved
    (move,) = _moves(adopt=True)
    assert (move.job, move.kind, move.from_gpus, move.gpus) == ("ns/a", "grow", 1, 2)


def test_an_adopted_job_settles_from_when_its_trainer_started() -> None:
    assert _moves(adopt=True, since=900.0) == []  # 100 s ago, under the 300 s interval
    assert len(_moves(adopt=True, since=600.0)) == 1


def test_a_job_whose_freezing_cut_its_compute_does_not_grow() -> None:
    assert len(_moves(adopt=True, compute_fraction=1.0)) == 1
    assert _moves(adopt=True, compute_fraction=0.05) == []
