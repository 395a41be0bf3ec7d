"""The placement loop plans each job only on the nodes its scheduling constraints allow, says
why when there are none, and knows which GPU resource each node offers."""

from __future__ import annotations

import asyncio
from typing import Any

from kiln import api
from kiln.controller import jobs, kube, main, metrics, placement_loop
from kiln.controller import settings as operator_settings
from kiln.placement import types
from kiln.warmstart import select

TAINT = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
TOLERATION = {"key": "dedicated", "operator": "Exists"}


def _node(name: str, allocatable: dict[str, str], *, labels: dict[str, str] | None = None,
          taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": {"taints": taints or []},
            "status": {"allocatable": {"cpu": "8", **allocatable},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


class _Cluster:
    """A CPU node labelled pool=cpu, an NVIDIA node and a tainted AMD node; records launches
    and unplaceable reports."""

    def __init__(self) -> None:
        self.nodes = [_node("cpu-1", {}, labels={"pool": "cpu"}),
                      _node("nv-1", {"nvidia.com/gpu": "2"}),
                      _node("amd-1", {"amd.com/gpu": "2"}, taints=[TAINT])]
        self.launched: dict[str, str] = {}  # job key -> node
        self.unplaceable: dict[str, str] = {}

    async def list(self, path: str, **_: Any) -> list[dict[str, Any]]:
        return self.nodes if path == kube.Paths.nodes() else []

    async def launch(self, entry: placement_loop.Queued, assignment: types.Assignment,
                     device: str) -> bool:
        self.launched[entry.ref.key] = assignment.node
        return True

    async def report(self, entry: placement_loop.Queued, why: str) -> None:
        self.unplaceable[entry.ref.key] = why


async def _nothing(*_: Any) -> None:
    return None


def _entry(name: str, *, gpus: int | None = None, **template: Any) -> placement_loop.Queued:
    job = api.parse_job({
        "apiVersion": api.API_VERSION, "kind": api.KIND,
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                 "resources": {"gpus": gpus}, "template": template}})
    decision = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "no zoo models")
    return placement_loop.Queued(jobs.JobRef("ns", name), job, decision, since=0.0)


def _run(*entries: placement_loop.Queued) -> tuple[_Cluster, placement_loop.PlacementLoop]:
    state = _Cluster()
    loop = placement_loop.PlacementLoop(
        client=state,  # type: ignore[arg-type]  # lists nodes and pods, as the loop needs
        settings=main.loop_settings(operator_settings.Options(
            placement_interval_seconds=1.0, cpu_slots_per_node=1, max_gpus_per_job=2,
            placement_use_milp=False, resize=False,
            gpu_resources=("nvidia.com/gpu", "amd.com/gpu"))),
        launch=state.launch, publish=_nothing, unplaceable=state.report, zoo_records=list,
        metrics=metrics.OperatorMetrics(), clock=lambda: 1000.0, eta_seconds={})

    async def scenario() -> None:
        for entry in entries:
            loop.add(entry)
        await loop.tick()

    asyncio.run(scenario())
    return state, loop


def test_jobs_start_only_on_nodes_their_constraints_allow() -> None:
    state, loop = _run(_entry("tolerant", gpus=1, nodeSelector={}, tolerations=[TOLERATION],
                              affinity={"nodeAffinity": {
                                  "requiredDuringSchedulingIgnoredDuringExecution": {
                                      "nodeSelectorTerms": [{"matchFields": [{
                                          "key": "metadata.name", "operator": "In",
                                          "values": ["amd-1"]}]}]}}}),
                       _entry("plain", gpus=1))
    assert state.launched == {"ns/tolerant": "amd-1", "ns/plain": "nv-1"}
    assert state.unplaceable == {}
    assert asyncio.run(loop.gpu_resource("amd-1")) == "amd.com/gpu"
    assert asyncio.run(loop.gpu_resource("nv-1")) == "nvidia.com/gpu"


def test_a_gpu_job_whose_constraints_bar_every_gpu_node_is_told_which_rules() -> None:
    state, _ = _run(_entry("cpu-only", gpus=1, nodeSelector={"pool": "cpu"}))
    assert state.launched == {}
    assert state.unplaceable["ns/cpu-only"].startswith(
        "it asks for GPUs, and no GPU node passes its scheduling constraints: 2 nodes do not "
        "match nodeSelector pool=cpu (amd-1, nv-1);")


def test_a_job_no_node_passes_is_held_with_every_nodes_reason() -> None:
    state, _ = _run(_entry("nowhere", nodeSelector={"gpu": "h100"}))
    assert state.launched == {}
    assert state.unplaceable["ns/nowhere"].startswith(
        "3 nodes do not match nodeSelector gpu=h100 (amd-1, cpu-1, nv-1)")
