"""Deleting a TrainingJob needs no operator: no finalizer, pods go through ownerReferences;
and the operator reads pods by selector only.

The emulator has no garbage collector, so `kubesim.garbage.collect` plays Kubernetes' part
after the job is deleted (what it deletes is decided by the pods' ownerReferences alone, which
the operator wrote); everything else is the real operator process and the test kubelet.
"""

from __future__ import annotations

from kubesim import client, emulator, garbage, operator_process, scenario, usage


def test_a_job_deleted_while_the_operator_is_down_goes_at_once_and_takes_its_pods(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    name = "digits-orphaned"
    # Still training when it is deleted: it never ends.
    cluster.client.create_job(namespace, scenario.tiny_job(
        name, epochs=scenario.ENDLESS_EPOCHS, max_samples=None))
    job = scenario.wait_phase(cluster, namespace, name, "Running", details=operator.log_tail)
    assert not job["metadata"].get("finalizers")  # the default: --no-finalizer
    (pod,) = cluster.client.pods(namespace, name)
    (owner,) = pod["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "TrainingJob", name, job["metadata"]["uid"], True)

    operator.stop()
    try:
        cluster.client.delete(cluster.client.jobs_path(namespace, name))  # kubectl delete
        assert cluster.client.job(namespace, name) is None  # gone at once: nothing to wait for
        assert garbage.collect(cluster.client, namespace) == [pod["metadata"]["name"]]
    finally:
        operator.start()

    # The collected pod goes once its trainer has checkpointed and exited (a graceful
    # deletion), however slowly that trainer runs; the restarted operator (watching again)
    # finds no job to resume, so makes no pod for it meanwhile.
    client.wait_until(lambda: not cluster.client.pods(namespace, name),
                      timeout_seconds=scenario.JOB_SECONDS, what=f"{name}'s pod to go",
                      details=operator.log_tail)
    assert scenario.pod_creations(cluster, namespace, name) == [f"{name}-trainer-0"]
    # Neither operator run listed or watched every pod of the cluster: each read of pods
    # carried a label selector (the emulator applies it, as the API server does).
    reads = [r for r in cluster.requests
             if r.resource == "pods" and r.action in ("LIST", "WATCH")
             and r.user_agent.startswith(usage.OPERATOR_USER_AGENTS)]
    assert reads and all(r.params.get("labelSelector") for r in reads), {
        (r.action, r.path, tuple(sorted(r.params.items()))) for r in reads}

