"""The trainer's probe guard refuses a bad parent, and the operator shows it while the job runs.

A deliberately bad parent (random weights scaled by 10), pinned by the job, sits in the zoo;
the job's trainer starts cold instead, and status.warmStart says so with both probe losses
before the job ends.
"""

from __future__ import annotations

import torch
from kubesim import emulator, operator_process, scenario

from kiln import api, models
from kiln.warmstart import decision, graph
from kiln.zoo import records

# An architecture of its own, so that no other test's model is a closer parent.
MODEL = {"architecture": "small_cnn", "args": {"depth": 2, "width": 11}, "inputShape": [1, 8, 8]}


def _register_bad_parent(zoo: scenario.Zoo, doc: dict[str, object]) -> str:
    job = api.parse_job(doc)
    torch.manual_seed(7)
    model = models.build(job.spec.model)
    state = {k: v * 10 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    record = records.ZooRecord(
        id=records.new_id("small_cnn"), architecture="small_cnn",
        args=dict(job.spec.model.args), input_shape=(1, 8, 8), modality="image",
        task="classification", dataset="digits", metric_name="validation_accuracy",
        metric_value=0.99, validation_accuracy=0.99, validation_loss=0.05,
        samples_per_second=100.0, num_params=sum(p.numel() for p in model.parameters()),
        created_time="2026-11-30T00:00:00Z", job_name="bad-parent",
        job_spec=api.to_wire(job.spec), parent=None, similarity=None, weights_sha256="",
        namespace=job.namespace)  # private to the job's namespace, which may pin it
    return records.write_record(zoo.store, record, state,
                                graph.to_json(decision.model_graph(job.spec.model))).id


def test_the_guard_refuses_a_bad_parent_and_status_shows_it_while_the_job_runs(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str,
) -> None:
    # It never ends: it still runs when the operator reads its metrics, however late (it is
    # deleted once checked).
    doc = scenario.tiny_job("digits-guarded", epochs=scenario.ENDLESS_EPOCHS, max_samples=None,
                            model=MODEL)
    doc["metadata"]["namespace"] = namespace
    bad = _register_bad_parent(zoo, doc)
    # Pinned: other tests' digits models share this zoo, and the guard would rightly fall
    # through to one of them; a pinned parent has no alternatives, so its refusal starts cold.
    doc["spec"]["warmStart"] = {"parent": bad}
    cluster.client.create_job(namespace, doc)
    running = scenario.wait_job(
        cluster, namespace, "digits-guarded",
        lambda job: ((job.get("status") or {}).get("warmStart") or {}).get("outcome")
        == "cold_guard", what="the guard's verdict in status.warmStart",
        details=operator.log_tail)
    assert scenario.phase(running) == "Running"
    assert not (running["status"].get("result") or {})
    api.TrainingJobStatus.model_validate(running["status"])
    warm = running["status"]["warmStart"]
    assert "parent" not in warm
    assert warm["probeLoss"] > warm["coldProbeLoss"] > 0
    assert 0 <= warm["probeAccuracy"] <= 1 and 0 <= warm["coldProbeAccuracy"] <= 1
    assert bad in warm["reason"] and "rejected" in warm["reason"]
    started = scenario.condition(running, "WarmStarted")
    assert (started["status"], started["reason"]) == ("False", "ColdStart")
    event = scenario.wait_event(cluster, namespace, "digits-guarded", "WarmStartGuarded")
    assert bad in event["message"] and "started cold" in event["message"]
    assert running["status"]["progress"]["computeFraction"] == 1.0  # nothing frozen

    cluster.client.delete(cluster.client.jobs_path(namespace, "digits-guarded"))
