"""Profiling a built-in model on a GPU type it has no measurement of: which jobs, which GPU,
the pod's type annotation, and the cluster cache key."""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln import api, contract
from kiln.controller import cluster, profiling
from kiln.controller import settings as operator_settings

SETTINGS = operator_settings.pod_settings(operator_settings.Options(
    default_image="kiln/trainer:test", zoo_uri="s3://zoo", zoo_endpoint="minio:9000",
    zoo_secret="zoo-creds", zoo_pod_access="credentials"))
A100, T4 = "cuda:NVIDIA-A100-SXM4-40GB", "cuda:Tesla-T4"


def _doc(*, batch: int = 32, gpus: int | None = None, width: int = 8) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"architecture": "small_cnn", "args": {"width": width},
                  "inputShape": [1, 8, 8]},
        "training": {"batchSize": batch, "epochs": 1}}
    if gpus is not None:
        spec["resources"] = {"gpus": gpus}
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "cnn", "namespace": "team-a", "uid": "u-1"}, "spec": spec}


def _node(name: str, gpus: int, product: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"nvidia.com/gpu.product": product}},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}


def test_only_builtin_models_that_may_use_gpus_qualify() -> None:
    assert profiling.builtin_on_gpus(api.parse_job(_doc()))
    assert not profiling.builtin_on_gpus(api.parse_job(_doc(gpus=0)))
    own = _doc()
    own["spec"]["model"] = {"entrypoint": "mynets.mixer:mixer", "task": "classification",
                            "inputShape": [1, 8, 8]}
    assert not profiling.builtin_on_gpus(api.parse_job(own))


def test_the_cache_key_is_the_namespace_the_model_the_batch_and_the_gpu_type() -> None:
    job = api.parse_job(_doc())
    same = api.parse_job({**_doc(), "metadata": {"name": "other", "namespace": "team-a"}})
    elsewhere = api.parse_job({**_doc(), "metadata": {"name": "cnn", "namespace": "team-b"}})
    assert profiling.cache_key(job, A100) == profiling.cache_key(same, A100)
    # Measured in one namespace's image, a profile decides nothing for another.
    assert profiling.cache_key(job, A100) != profiling.cache_key(elsewhere, A100)
    assert profiling.cache_key(job, A100) != profiling.cache_key(job, T4)
    assert profiling.cache_key(job, A100) != profiling.cache_key(
        api.parse_job(_doc(batch=64)), A100)
    assert profiling.cache_key(job, A100) != profiling.cache_key(
        api.parse_job(_doc(width=16)), A100)


def test_the_pod_takes_a_free_gpu_of_the_unmeasured_type_and_says_which() -> None:
    doc = _doc()
    job = api.parse_job(doc)
    pools = cluster.pools([_node("a100", 2, "NVIDIA-A100-SXM4-40GB"), _node("t4", 8, "Tesla-T4")],
                          [], cpu_slots=1, now=0.0)
    device = profiling.choose_device(pools, job, A100)
    assert device == profiling.Device("a100", "gpu", 1)  # not the node with the most free
    pod = profiling.build_pod(doc, job, device, settings=SETTINGS, timeout_seconds=60.0,
                              now=0.0, device_type=A100)
    assert pod["metadata"]["annotations"][profiling.DEVICE_TYPE_ANNOTATION] == A100
    assert profiling.choose_device(pools, job, "cuda:Other").devices == 0  # none of that type
    plain = profiling.build_pod(doc, job, device, settings=SETTINGS, timeout_seconds=60.0,
                                now=0.0)
    assert profiling.DEVICE_TYPE_ANNOTATION not in plain["metadata"]["annotations"]


def test_only_a_timed_step_is_kept_for_later_jobs() -> None:
    measured = contract.Profile(parameters=10, flops_per_sample=None, graph_nodes=3,
                                untraceable=None, device=A100, batch_size=32,
                                step_seconds=0.01, step_status="ok")
    assert profiling.cacheable(measured)
    assert not profiling.cacheable(dataclasses.replace(
        measured, step_seconds=None, step_status="oom", step_detail="CUDA out of memory"))
