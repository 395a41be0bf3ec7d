"""The pods the operator reads, listed with selectors: never every pod of the cluster.

Kiln's own pods by label. Other workloads' pods matter only where they take GPUs: they are
listed per GPU node by field selector (``spec.nodeName``), the query each kubelet makes, which
the API server answers from its watch cache through an index.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from kiln import api
from kiln.controller import kube

# Pods that may hold devices: not finished.
ACTIVE = "status.phase!=Succeeded,status.phase!=Failed"


async def kiln_pods(client: kube.Client, namespace: str | None = None, *,
                    job: str | None = None) -> list[kube.Object]:
    """Kiln's trainer and profiling pods of `namespace` (None: all), of one `job` if given."""
    selector = f"{api.JOB_NAME_LABEL}={job}" if job else api.JOB_NAME_LABEL
    return await client.list(kube.Paths.pods(namespace), label_selector=selector)


async def placement_pods(client: kube.Client, gpu_nodes: Iterable[str]) -> list[kube.Object]:
    """What `cluster.pools` needs: Kiln's pods in all namespaces, and the active pods of other
    workloads on each of `gpu_nodes` (`cluster.gpu_node_names`; one request per node, sent
    together).

    Raises:
        kube.ApiError: a listing failed.
    """
    foreign = await asyncio.gather(*(
        client.list(kube.Paths.pods(), label_selector=f"!{api.JOB_NAME_LABEL}",
                    field_selector=f"spec.nodeName={name},{ACTIVE}")
        for name in gpu_nodes))
    return [*await kiln_pods(client), *(pod for listed in foreign for pod in listed)]
