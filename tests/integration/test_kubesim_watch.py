"""The test kubelet acts on a watch of the emulator's pods, not on listings: the watch's
initial events end with the API server's bookmark, and later changes follow in order."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from kubesim import client, emulator, informer, kubelet

Pods = client.Client.pods_path


def _pod(name: str, command: list[str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns"},
            "spec": {"containers": [{"name": "trainer", "image": "kiln", "command": command}]}}


def _phase(cluster: emulator.Emulator, name: str) -> str | None:
    pod = cluster.client.get(Pods("ns", name))
    return None if pod is None else (pod.get("status") or {}).get("phase")


def test_an_informer_sees_the_pods_there_before_it_and_each_change_after() -> None:
    with emulator.Emulator() as cluster:
        before = cluster.client.create(Pods("ns"), _pod("before", ["true"]))
        woken = threading.Event()
        errors: list[str] = []
        pods = informer.Informer(cluster.url, Pods(), user_agent="kubesim-test-informer",
                                 changed=woken.set, errors=errors)
        pods.start()
        try:
            client.wait_until(lambda: before["metadata"]["uid"] in pods.objects,
                              timeout_seconds=30, what="the initial events")
            assert pods.take_changed() == {before["metadata"]["uid"]} and woken.is_set()
            after = cluster.client.create(Pods("ns"), _pod("after", ["true"]))
            cluster.client.patch(Pods("ns", "after"), {"status": {"phase": "Running"}})
            cluster.client.delete(Pods("ns", "before"))  # never scheduled: gone at once
            uid = after["metadata"]["uid"]
            client.wait_until(
                lambda: before["metadata"]["uid"] not in pods.objects
                and (pods.objects.get(uid) or {}).get("status", {}).get("phase") == "Running",
                timeout_seconds=30, what="the changes")
            assert pods.take_changed() == {uid, before["metadata"]["uid"]}
            assert pods.take_changed() == set()
        finally:
            pods.stop()
        assert errors == []
        watches = [r for r in cluster.requests if r.user_agent == "kubesim-test-informer"]
        assert [(r.action, r.params.get("sendInitialEvents")) for r in watches] == [
            ("WATCH", "true")]


def test_the_kubelet_runs_pods_and_removes_deleted_ones_without_listing(tmp_path: Path) -> None:
    with emulator.Emulator(max_pod_grace_seconds=15) as cluster:
        cluster.client.create(Pods("ns"), _pod("before", ["true"]))
        node = kubelet.Kubelet(cluster.url, tmp_path, fork_trainers=False)
        node.start()
        try:
            cluster.client.create(Pods("ns"), _pod("sleeper", ["sleep", "600"]))
            client.wait_until(lambda: _phase(cluster, "before") == "Succeeded"
                              and _phase(cluster, "sleeper") == "Running",
                              timeout_seconds=60, what="one pod done, one running")
            # Graceful deletion: SIGTERM ends the sleeper, its status is reported, it goes.
            cluster.client.delete(Pods("ns", "sleeper"))
            client.wait_until(lambda: cluster.client.get(Pods("ns", "sleeper")) is None,
                              timeout_seconds=60, what="the deleted pod to go")
        finally:
            node.stop()
        assert node.errors == []
        ours = {r.action for r in cluster.requests if r.user_agent == kubelet.KUBELET_USER_AGENT}
        assert "WATCH" in ours and "LIST" not in ours
        statuses = [r.body["status"] for r in cluster.requests
                    if r.user_agent == kubelet.KUBELET_USER_AGENT and r.name == "sleeper"
                    and r.subresource == "status" and r.action == "UPDATE"]
        terminated = statuses[-1]["containerStatuses"][0]["state"]["terminated"]
        assert (statuses[-1]["phase"], terminated["exitCode"]) == ("Failed", 128 + 15)
