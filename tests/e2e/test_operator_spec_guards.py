"""What the operator refuses of a job's spec, and what it keeps: a job nested as deep as the
API server stores, or posing as Kiln's own pods, fails alone while the operator serves everyone
else; an edit after admission is named and never reaches a restart."""

from __future__ import annotations

import json

import pytest
from kubesim import client, emulator, operator_process, scenario

from kiln import api


def _nested_args(levels: int) -> dict[str, object]:
    """Builder args holding a chain of mappings: the job document is `levels` levels deep."""
    chain: dict[str, object] = {}
    for _ in range(levels - 5):  # the document, spec, model, args and the chain's last {}
        chain = {"a": chain}
    return {"depth": 2, "width": 8, "nested": chain}


def test_a_job_nested_as_deep_as_the_api_server_stores_fails_alone_and_the_operator_lives_on(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
    zoo_secret: tuple[str, dict[str, str]],
) -> None:
    model = {"architecture": "small_cnn", "inputShape": [1, 8, 8]}
    deep = scenario.tiny_job("digits-abyss", model={
        **model, "args": _nested_args(api.API_SERVER_MAX_DEPTH)})
    assert api.nesting_depth(deep) == api.API_SERVER_MAX_DEPTH
    deeper = scenario.tiny_job("digits-deeper", model={
        **model, "args": _nested_args(api.API_SERVER_MAX_DEPTH + 1)})
    with pytest.raises(client.ApiError, match="HTTP 400"):  # as the API server refuses it
        cluster.client.create_job(namespace, deeper)
    other = f"{namespace}-other"
    cluster.client.create_secret(other, *zoo_secret)

    cluster.client.create_job(namespace, deep)
    cluster.client.create_job(other, scenario.tiny_job("digits-ordinary"))

    failed = scenario.wait_phase(cluster, namespace, "digits-abyss", "Failed",
                                 details=operator.log_tail)
    reason = scenario.condition(failed, "Failed")
    assert reason is not None and reason["reason"] == "InvalidSpec"
    assert (f"spec.model.args: nested more than {api.MAX_DEPTH} levels deep"
            in reason["message"])
    scenario.wait_event(cluster, namespace, "digits-abyss", "InvalidSpec")
    scenario.wait_phase(cluster, other, "digits-ordinary", "Succeeded", details=operator.log_tail)
    assert operator.process is not None and operator.process.poll() is None
    assert "UnexpectedError" not in scenario.event_reasons(cluster, namespace, "digits-abyss")
    cluster.client.delete(cluster.client.jobs_path(namespace, "digits-abyss"))


def test_a_job_labelled_as_a_profiling_pod_is_refused_naming_the_label(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    job = scenario.tiny_job("digits-posing")
    job["spec"]["template"]["labels"] = {"kiln.dev/role": "profile"}
    job["spec"]["template"]["resources"] = {"limits": {"nvidia.com/mig-1g.10gb": 1}}
    cluster.client.create_job(namespace, job)

    failed = scenario.wait_phase(cluster, namespace, "digits-posing", "Failed",
                                 details=operator.log_tail)
    reason = scenario.condition(failed, "Failed")
    assert reason is not None and reason["reason"] == "InvalidSpec"
    assert "spec.template.labels.kiln.dev/role: kiln.dev/* labels are Kiln's" in reason["message"]
    assert ("spec.template.resources.limits: nvidia.com/mig-1g.10gb is an accelerator"
            in reason["message"])
    assert scenario.pod_creations(cluster, namespace, "digits-posing") == []


def test_an_edit_of_a_jobs_model_args_after_admission_is_named_and_never_reaches_a_restart(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    name = "digits-edited"
    path = cluster.client.jobs_path(namespace, name)
    cluster.client.create_job(namespace, scenario.tiny_job(name, run_policy={"suspend": True}))
    held = scenario.wait_phase(cluster, namespace, name, "Suspended", details=operator.log_tail)
    assert held["status"]["admittedSpec"]["model"]["args"] == {"depth": 2, "width": 8}

    # The builder takes no `bogus`: run with it, the trainer would fail the job for good.
    cluster.client.patch(path, {"spec": {"model": {"args": {"bogus": 1}}}})
    event = scenario.wait_event(cluster, namespace, name, "SpecEditIgnored")
    assert event["type"] == "Warning"
    assert "The edit of spec.model.args.bogus does not take effect" in event["message"]
    cluster.client.patch(path, {"spec": {"runPolicy": {"suspend": False}}})  # a new attempt

    scenario.wait_phase(cluster, namespace, name, "Succeeded", details=operator.log_tail)
    (created,) = [r.body for r in cluster.requests
                  if r.resource == "pods" and r.action == "CREATE" and r.namespace == namespace
                  and r.body["metadata"]["labels"].get("kiln.dev/job-name") == name]
    env = {e["name"]: e.get("value") for e in created["spec"]["containers"][0]["env"]}
    assert json.loads(env["KILN_JOB"])["spec"]["model"]["args"] == {"depth": 2, "width": 8}
    assert scenario.event_reasons(cluster, namespace, name).count("SpecEditIgnored") == 1
