"""What the operator lists for placement, against the API emulator over HTTP.

The emulator applies label and field selectors as the API server does (`kubesim.selection`),
so a selector that matches too little or too much changes what the planner sees here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest
from kubesim import emulator, selection

from kiln import api
from kiln.controller import cluster, kube, listing, pods


def _pod(name: str, namespace: str, *, node: str, gpus: int = 0, phase: str = "Running",
         job: str | None = None) -> dict[str, Any]:
    labels = {api.JOB_NAME_LABEL: job, api.ATTEMPT_LABEL: "0"} if job else {"app": "other"}
    annotations = {pods.NODE_ANNOTATION: node, pods.GPUS_ANNOTATION: str(gpus),
                   pods.DEVICE_ANNOTATION: "gpu", pods.PARALLELISM_ANNOTATION: "single",
                   pods.ESTIMATED_SECONDS_ANNOTATION: "60"} if job else {}
    limits = {pods.GPU_RESOURCE: str(gpus)} if gpus else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "annotations": annotations},
            "spec": {"nodeName": node, "containers": [
                {"name": "c", "image": "x", "resources": {"limits": limits}}]},
            "status": {"phase": phase}}


def test_placement_lists_kiln_pods_by_label_and_other_pods_per_gpu_node() -> None:
    with emulator.Emulator() as api_server:
        test = api_server.client
        test.create_node("gpu-1", gpus=4)
        test.create_node("cpu-1")
        for pod in (_pod("train", "team-a", node="gpu-1", gpus=1, job="digits"),
                    _pod("inference", "serving", node="gpu-1", gpus=2),
                    _pod("done", "serving", node="gpu-1", gpus=1, phase="Succeeded"),
                    _pod("web", "serving", node="cpu-1")):
            test.create(test.pods_path(pod["metadata"]["namespace"]), pod)

        async def read() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            client = kube.Client(kopf.ConnectionInfo(server=api_server.url))
            try:
                nodes = await client.list(kube.Paths.nodes())
                return nodes, await listing.placement_pods(client, cluster.gpu_node_names(nodes))
            finally:
                await client.close()

        nodes, listed = asyncio.run(read())
        pod_lists = [r for r in api_server.requests
                     if r.resource == "pods" and r.action == "LIST"]
    assert sorted(p["metadata"]["name"] for p in listed) == ["inference", "train"]
    pools = cluster.pools(nodes, listed, cpu_slots=1, now=0.0)
    assert pools.free_devices(cluster.GPU_POOL, "gpu-1") == 4 - 2 - 1
    assert pod_lists and all(r.params.get("labelSelector") for r in pod_lists)


@pytest.mark.parametrize(("selector", "names"), [
    ("app=web", ["a"]), ("app==web", ["a"]), ("app!=web", ["b", "c"]),
    ("app in (web, db)", ["a", "b"]), ("app notin (web)", ["b", "c"]),
    ("tier", ["a"]), ("!tier", ["b", "c"]), ("app=web,tier=front", ["a"]),
    ("app in (web,db),!tier", ["b"]),
])
def test_the_emulators_label_selectors(selector: str, names: list[str]) -> None:
    objs = [{"metadata": {"name": "a", "labels": {"app": "web", "tier": "front"}}},
            {"metadata": {"name": "b", "labels": {"app": "db"}}},
            {"metadata": {"name": "c"}}]
    found = selection.select(objs, labels=selector)
    assert [o["metadata"]["name"] for o in found] == names


def test_the_emulators_field_selectors_and_refusals() -> None:
    objs = [{"metadata": {"name": "a"}, "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}},
            {"metadata": {"name": "b"}, "spec": {"nodeName": "n1"}, "status": {"phase": "Failed"}},
            {"metadata": {"name": "c"}, "spec": {}, "status": {"phase": "Pending"}}]
    found = selection.select(objs, fields="spec.nodeName=n1,status.phase!=Failed")
    assert [o["metadata"]["name"] for o in found] == ["a"]
    assert [o["metadata"]["name"] for o in selection.select(objs, fields="spec.nodeName=")] == [
        "c"]
    with pytest.raises(ValueError, match="unparsable"):
        selection.select(objs, labels="app in web")
