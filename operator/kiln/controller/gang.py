"""A job spanning nodes as data: its trainer pods, one per node, and their headless Service.

Rank r's pod runs torchrun's agent for node r, pinned to the plan's r-th node; all join one
c10d rendezvous served by rank 0's pod, which they reach by its DNS name. No API calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from typing import Any, cast

import kopf

from kiln import api, contract
from kiln.controller import pods

RENDEZVOUS_PORT_NAME = "rendezvous"
SERVICE_SUFFIX = "-trainers"
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_LABEL_MAX_LENGTH = 63


def service_name(job_name: str) -> str:
    """The job's headless Service, ``<job>-trainers``, when that is a DNS label (a Service
    name must be one); else a name derived from a hash of the job's."""
    name = f"{job_name}{SERVICE_SUFFIX}"
    if len(name) <= _DNS_LABEL_MAX_LENGTH and _DNS_LABEL.fullmatch(name):
        return name
    return f"kiln-{hashlib.sha256(job_name.encode()).hexdigest()[:16]}{SERVICE_SUFFIX}"


def hostname(rank: int) -> str:
    """Rank `rank`'s pod hostname; zero-padded so that the names sort in rank order, as
    torchrun's group ranks follow the sorted agent addresses (`contract.Rendezvous`)."""
    return f"trainer-{rank:03d}"


def address(job: api.TrainingJob, rank: int) -> str:
    """Rank `rank`'s pod DNS name: ``<hostname>.<service>.<namespace>.svc``."""
    return f"{hostname(rank)}.{service_name(job.name)}.{job.metadata.namespace}.svc"


def pod_name(job_name: str, attempt: int, rank: int) -> str:
    """Rank `rank`'s pod of `attempt`: rank 0 keeps `pods.pod_name` (it reports the result,
    as a one-node job's pod does), rank r adds ``-<r>``."""
    leader = pods.pod_name(job_name, attempt)
    return leader if rank == 0 else f"{leader}-{rank}"


def build_service(owner: Mapping[str, Any], job: api.TrainingJob) -> dict[str, Any]:
    """The headless Service that gives the job's trainer pods their DNS names.

    Not-ready addresses are published: the pods resolve each other while torchrun starts,
    before any readiness. Owned by the job, so it goes with it.
    """
    service: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(job.name),
                     "labels": {api.JOB_NAME_LABEL: job.name,
                                "app.kubernetes.io/managed-by": "kiln-operator"}},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {api.JOB_NAME_LABEL: job.name, "app.kubernetes.io/name": "kiln-trainer"},
            "ports": [{"name": RENDEZVOUS_PORT_NAME, "port": contract.RENDEZVOUS_PORT,
                       "protocol": "TCP"}],
        },
    }
    kopf.adopt(service, owner=cast(kopf.Body, dict(owner)))
    return service


def build_pods(owner: Mapping[str, Any], job: api.TrainingJob, *, attempt: int,
               launch: pods.Launch, settings: pods.PodSettings) -> list[dict[str, Any]]:
    """The pods of one attempt, rank order: `pods.build_pod`'s pod pinned to each node of
    the launch, with the gang's hostname, Service subdomain, rank label and torchrun command.

    The rendezvous id is the job's uid and the attempt, so a restarted gang never meets a
    stale agent. torchrun also reads its settings from ``PET_*`` variables, which every pod
    gets, so a spec.template command that runs torchrun itself joins the same rendezvous.

    Args:
        owner: the TrainingJob object as the API returned it (needs metadata.uid).
        job: the parsed job.
        attempt: 0-based attempt number.
        launch: the plan; `launch.devices` are per node, `launch.peer_nodes` the other nodes.
        settings: operator-wide pod settings.

    Returns:
        One v1 Pod manifest per node, owned by `owner`; a one-node launch gives one pod, the
        same as `pods.build_pod`'s.
    """
    nodes = (launch.node, *launch.peer_nodes)
    if len(nodes) == 1:
        return [pods.build_pod(owner, job, attempt=attempt, launch=launch, settings=settings)]
    uid = str((owner.get("metadata") or {}).get("uid") or job.name)
    built = []
    for rank, node in enumerate(nodes):
        rendezvous = contract.Rendezvous(
            nodes=len(nodes), node=rank,
            endpoint=f"{address(job, 0)}:{contract.RENDEZVOUS_PORT}",
            run_id=f"{uid}-{attempt}", local_addr=address(job, rank))
        pod = pods.build_pod(owner, job, attempt=attempt, settings=settings,
                             launch=dataclasses.replace(launch, node=node, peer_nodes=()))
        pod["metadata"]["name"] = pod_name(job.name, attempt, rank)
        pod["metadata"]["labels"][api.RANK_LABEL] = str(rank)
        pod["spec"]["hostname"] = hostname(rank)
        pod["spec"]["subdomain"] = service_name(job.name)
        container = pod["spec"]["containers"][0]
        if not job.spec.template.get("command"):  # Kiln's trainer, under torchrun
            argv = [contract.Flag.PARALLELISM.value, launch.parallelism]
            container["command"] = contract.trainer_command(
                max(1, launch.devices), argv, python="python", rendezvous=rendezvous)
        container["env"] = [*_torchrun_env(rendezvous, launch.devices), *container["env"]]
        container["ports"].append({"name": RENDEZVOUS_PORT_NAME,
                                   "containerPort": contract.RENDEZVOUS_PORT, "protocol": "TCP"})
        built.append(pod)
    return built


def _torchrun_env(rendezvous: contract.Rendezvous, processes: int) -> list[dict[str, str]]:
    """torchrun's ``PET_<FLAG>`` defaults for a command that starts torchrun itself."""
    values = {"NNODES": str(rendezvous.nodes), "NPROC_PER_NODE": str(max(1, processes)),
              "RDZV_BACKEND": "c10d", "RDZV_ENDPOINT": rendezvous.endpoint,
              "RDZV_ID": rendezvous.run_id, "RDZV_CONF": f"is_host={int(rendezvous.node == 0)}",
              "LOCAL_ADDR": rendezvous.local_addr}
    return [{"name": f"PET_{key}", "value": value} for key, value in values.items()]
