"""A stand-in for Kubernetes' garbage collector: delete pods whose owners are gone.

The API emulator has no garbage collector. `collect` does, once, what kube-controller-manager's
does continuously for a TrainingJob's pods (background propagation): a pod whose every
ownerReference names a TrainingJob that no longer exists (by name and uid) is deleted. Owners of
other kinds are not looked up (their pods are kept).
"""

from __future__ import annotations

from kiln import api
from kubesim import client


def collect(api_client: client.Client, namespace: str) -> list[str]:
    """Delete the pods of `namespace` orphaned by a deleted TrainingJob; their names, sorted."""
    collected = []
    for pod in api_client.list(api_client.pods_path(namespace)):
        owners = pod["metadata"].get("ownerReferences") or []
        jobs = [o for o in owners if o.get("kind") == api.KIND
                and o.get("apiVersion") == api.API_VERSION]
        if not owners or len(jobs) != len(owners):
            continue
        if all(_gone(api_client, namespace, owner["name"], owner["uid"]) for owner in jobs):
            api_client.delete(api_client.pods_path(namespace, pod["metadata"]["name"]))
            collected.append(str(pod["metadata"]["name"]))
    return sorted(collected)


def _gone(api_client: client.Client, namespace: str, name: str, uid: str) -> bool:
    found = api_client.job(namespace, name)
    return found is None or found["metadata"].get("uid") != uid
