"""The pods and headless Service of a multi-node job, built by kiln.controller.gang."""

from __future__ import annotations

from typing import Any

import pytest

from kiln import api, contract
from kiln.controller import cluster, gang, pods
from kiln.controller import settings as operator_settings
from kiln.placement import planner, types
from kiln.warmstart import select

SETTINGS = operator_settings.pod_settings(operator_settings.Options(
    default_image="kiln/trainer:test", zoo_uri="s3://zoo", zoo_pod_access="credentials"))
COLD = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "cold start: the model zoo is empty")


def _job(name: str = "digits", **spec: Any) -> tuple[dict[str, Any], api.TrainingJob]:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": name, "namespace": "team-a", "uid": "u-1"},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                    "resources": {"gpus": 6, "nodes": 3},
                    "training": {"batchSize": 96}, **spec}}
    return doc, api.parse_job(doc)


def _launch(*peers: str) -> pods.Launch:
    return pods.Launch(node="gpu-1", devices=2, parallelism="ddp", device="gpu",
                       warm_start=COLD, estimated_seconds=60.0, started=1.0,
                       peer_nodes=tuple(peers))


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_each_node_gets_one_pinned_pod_that_joins_rank_0s_rendezvous() -> None:
    owner, job = _job()
    built = gang.build_pods(owner, job, attempt=2, launch=_launch("gpu-2", "gpu-3"),
                            settings=SETTINGS)
    assert [p["metadata"]["name"] for p in built] == [
        "digits-trainer-2", "digits-trainer-2-1", "digits-trainer-2-2"]
    endpoint = "trainer-000.digits-trainers.team-a.svc:29400"
    for rank, (pod, node) in enumerate(zip(built, ("gpu-1", "gpu-2", "gpu-3"), strict=True)):
        spec, container = pod["spec"], pod["spec"]["containers"][0]
        assert pod["metadata"]["labels"][api.RANK_LABEL] == str(rank)
        assert pod["metadata"]["labels"][api.ATTEMPT_LABEL] == "2"
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchExpressions"][-1]["values"] == [node]
        assert (spec["hostname"], spec["subdomain"]) == (f"trainer-{rank:03d}",
                                                         "digits-trainers")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
        command = container["command"]
        assert command[:3] == ["python", "-m", "torch.distributed.run"]
        assert "--standalone" not in command
        assert (_flag(command, "--nnodes"), _flag(command, "--nproc-per-node")) == ("3", "2")
        assert _flag(command, "--rdzv-backend") == "c10d"
        assert _flag(command, "--rdzv-endpoint") == endpoint
        assert _flag(command, "--rdzv-id") == "u-1-2"  # a new rendezvous per attempt
        assert _flag(command, "--rdzv-conf") == f"is_host={int(rank == 0)}"
        assert _flag(command, "--local-addr") == f"trainer-{rank:03d}.digits-trainers.team-a.svc"
        assert command[-4:] == ["-m", "kiln_trainer", "--parallelism", "ddp"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PET_RDZV_ENDPOINT"] == endpoint and env["PET_NNODES"] == "3"
        assert {"name": "rendezvous", "containerPort": 29400, "protocol": "TCP"} in \
            container["ports"]


def test_local_addresses_sort_in_rank_order_as_torchrun_ranks_them() -> None:
    owner, job = _job(resources={"gpus": 24, "nodes": 12})
    peers = [f"gpu-{i}" for i in range(2, 13)]
    built = gang.build_pods(owner, job, attempt=0, launch=_launch(*peers), settings=SETTINGS)
    addresses = [_flag(p["spec"]["containers"][0]["command"], "--local-addr") for p in built]
    assert sorted(addresses) == addresses and len(set(addresses)) == 12


def test_a_one_node_launch_builds_the_ordinary_pod() -> None:
    owner, job = _job(resources={"gpus": 2})
    (pod,) = gang.build_pods(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    assert pod == pods.build_pod(owner, job, attempt=0, launch=_launch(), settings=SETTINGS)
    assert "subdomain" not in pod["spec"] and pods.rank_of(pod) == 0


def test_an_own_command_keeps_running_and_finds_the_rendezvous_in_torchruns_env() -> None:
    owner, job = _job(template={"command": ["torchrun", "train.py"]})
    built = gang.build_pods(owner, job, attempt=0, launch=_launch("gpu-2"), settings=SETTINGS)
    container = built[1]["spec"]["containers"][0]
    assert container["command"] == ["torchrun", "train.py"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PET_RDZV_CONF"] == "is_host=0" and env["PET_NPROC_PER_NODE"] == "2"
    assert env["PET_LOCAL_ADDR"] == "trainer-001.digits-trainers.team-a.svc"


def test_the_service_is_headless_owned_and_selects_the_jobs_trainer_pods() -> None:
    owner, job = _job()
    service = gang.build_service(owner, job)
    assert service["metadata"]["name"] == "digits-trainers"
    assert service["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    spec = service["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
    assert spec["selector"][api.JOB_NAME_LABEL] == "digits"
    built = gang.build_pods(owner, job, attempt=0, launch=_launch("gpu-2", "gpu-3"),
                            settings=SETTINGS)
    for pod in built:
        assert spec["selector"].items() <= pod["metadata"]["labels"].items()
    assert spec["ports"] == [{"name": "rendezvous", "port": contract.RENDEZVOUS_PORT,
                              "protocol": "TCP"}]


def test_a_name_that_is_no_dns_label_gets_a_hashed_service_name() -> None:
    long_name = "a" * 60
    for name in (long_name, "9lives", "team.digits"):
        service = gang.service_name(name)
        assert len(service) <= 63 and service[0].isalpha() and "." not in service
        assert service == gang.service_name(name) != gang.service_name(name + "x")


def test_a_gangs_pods_hold_devices_on_each_node_and_plan_beside_other_jobs() -> None:
    owner, job = _job()
    built = gang.build_pods(owner, job, attempt=0, launch=_launch("gpu-2", "gpu-3"),
                            settings=SETTINGS)
    for pod in built:
        pod["status"] = {"phase": "Running"}
    nodes = [{"metadata": {"name": f"gpu-{i}"}, "status": {"allocatable": {
        "nvidia.com/gpu": "4"}}} for i in (1, 2, 3)]
    found = cluster.pools(nodes, built, cpu_slots=1, now=1.0)
    assert {(r.job, r.node, r.gpus) for r in found.running["gpu"]} == {
        ("team-a/digits", "gpu-1", 2), ("team-a/digits#1", "gpu-2", 2),
        ("team-a/digits#2", "gpu-3", 2)}
    assert [found.free_devices("gpu", f"gpu-{i}") for i in (1, 2, 3)] == [2, 2, 2]
    queued = types.JobRequest("other", (types.Config("ddp", 4, 10.0),))
    plan = planner.plan(types.Snapshot(now=1.0, nodes=found.nodes["gpu"], queued=(queued,),
                                       running=found.running["gpu"]))
    (a,) = plan.assignments
    assert a.start == pytest.approx(61.0)  # once the gang's estimated 60 s end on every node


def test_a_rendezvous_needs_two_nodes_and_a_rank_among_them() -> None:
    for nodes, node in ((1, 0), (2, 2), (3, -1)):
        with pytest.raises(ValueError, match="need 2 or more nodes"):
            contract.Rendezvous(nodes=nodes, node=node, endpoint="h:1", run_id="r",
                                local_addr="h")
