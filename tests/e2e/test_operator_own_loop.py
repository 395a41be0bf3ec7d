"""An own training loop (examples/own-model/train_loop.py, on kiln_trainer's job context) under
the real operator: its own command runs in the trainer pod, shows progress in status, registers
in the zoo, and a second job warm-starts from the first, the decision recorded in status.

The test kubelet runs the pod's command as a local process; the job's own env puts the example
on PYTHONPATH, as an image holding the script would.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from kubesim import emulator, operator_process, scenario

from kiln import api
from kiln.zoo import records

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own-model"


def _own_loop_job(name: str, *, hidden: int, depth: int) -> dict[str, object]:
    doc = yaml.safe_load((EXAMPLE / "own-loop.yaml").read_text(encoding="utf-8"))
    doc["metadata"] = {"name": name, "labels": {"kueue.x-k8s.io/queue-name": "e2e"}}
    doc["spec"]["model"]["args"] = {"hidden": hidden, "depth": depth, "num_classes": 10}
    doc["spec"]["template"]["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"},
                                      {"name": "PYTHONPATH", "value": str(EXAMPLE)}]
    return doc  # type: ignore[no-any-return]


def test_an_own_loop_job_reports_registers_and_a_second_one_warm_starts_from_it(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str,
) -> None:
    cluster.client.create_job(namespace, _own_loop_job("own-loop-a", hidden=64, depth=2))
    first = scenario.wait_phase(cluster, namespace, "own-loop-a", "Succeeded",
                                details=operator.log_tail)
    api.TrainingJobStatus.model_validate(first["status"])
    result = first["status"]["result"]
    assert result["validationAccuracy"] >= 0.9 and result["timeToTargetSeconds"] is not None
    assert first["status"]["progress"]["epoch"] >= 1  # the own loop's progress reached status
    model = result["zooModel"]
    record = records.read_record(zoo.store, model)
    assert (record.entrypoint, record.job_name) == ("train_loop:mlp", "own-loop-a")
    commands = {p["metadata"]["name"]: p["spec"]["containers"][0]["command"]
                for p in cluster.client.pods(namespace, "own-loop-a")}
    assert commands == {  # Kiln profiles the model in the job's image, then runs its own loop
        "own-loop-a-profile": ["python", "-m", "kiln_trainer", "--profile"],
        "own-loop-a-trainer-0": ["python", "-m", "train_loop"]}

    cluster.client.create_job(namespace, _own_loop_job("own-loop-b", hidden=96, depth=3))
    second = scenario.wait_phase(cluster, namespace, "own-loop-b", "Succeeded",
                                 details=operator.log_tail)
    api.TrainingJobStatus.model_validate(second["status"])
    warm = second["status"]["warmStart"]
    assert warm["parent"] == model and warm["outcome"] == "warm"
    assert 0.3 <= warm["similarity"] < 1.0 and 0 < warm["matchedTensors"] <= warm["totalTensors"]
    assert records.read_record(zoo.store, second["status"]["result"]["zooModel"]).parent == model


def test_an_own_loop_that_exits_without_a_result_fails_permanently_saying_so(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    doc = _own_loop_job("own-loop-quiet", hidden=32, depth=1)
    doc["spec"]["template"]["command"] = ["python", "-c", "print('trained, I think')"]  # type: ignore[index]
    doc["spec"]["runPolicy"] = {"backoffLimit": 3}  # type: ignore[index]
    cluster.client.create_job(namespace, doc)
    failed = scenario.wait_phase(cluster, namespace, "own-loop-quiet", "Failed",
                                 details=operator.log_tail)
    condition = scenario.condition(failed, "Failed")
    assert condition is not None and condition["reason"] == "PermanentError"
    assert "exited 0 without reporting a result" in condition["message"]
    assert "ctx.finish(model)" in condition["message"]
    assert failed["status"]["attempts"] == 1 and failed["status"].get("restarts", 0) == 0
