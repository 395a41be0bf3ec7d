"""Jobs that bring their own data and command, under the real operator: data on a mounted
volume, a job's own command run with Kiln's environment, and a template the operator refuses.

The test kubelet (kubesim) maps a hostPath volume's mountPath to the host folder, a stand-in
for a kubelet's mounts, and runs the container's command as a local process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kubesim import emulator, operator_process, scenario

from kiln import api
from kiln.zoo import records

SHAPES = Path(__file__).resolve().parents[1] / "data" / "shapes"

OWN_LOOP = '''\
"""Stands in for a user's training loop: finds its job in Kiln's environment and its data on
the mounted volume, and reports a result the way kiln_trainer does."""
import json
import os
import pathlib

from kiln import contract

job = json.loads(os.environ[contract.Env.JOB])
images = sorted(pathlib.Path(os.environ["DATA_DIR"], "train").rglob("*.png"))
result = contract.Result(
    metric_name="validation_accuracy", metric=len(images) / 100, validation_accuracy=0.5,
    validation_loss=1.0, wall_seconds=1.0, time_to_target_seconds=None, target_reached=False,
    epochs_run=1, steps=len(images), samples_per_second=10.0, zoo_model=None,
    resumed_from_epoch=0, warm_start=f"own loop of {job['metadata']['name']}")
print(contract.to_line(result), flush=True)
pathlib.Path(os.environ[contract.Env.TERMINATION_LOG]).write_bytes(
    contract.termination_message(result))
'''


def _mounted(mount: str, host: Path) -> dict[str, object]:
    return {"volumes": [{"name": "shapes", "hostPath": {"path": str(host)}}],
            "volumeMounts": [{"name": "shapes", "mountPath": mount, "readOnly": True}],
            "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]}


def test_kilns_trainer_reads_its_data_from_a_mounted_volume(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str, tmp_path: Path,
) -> None:
    mount = str(tmp_path / "mnt" / "shapes")  # the test kubelet links it to the volume
    job = scenario.tiny_job("shapes-volume", epochs=1, dataset={
        "name": "imagefolder", "path": f"{mount}/train", "validationPath": f"{mount}/validation"},
        model={"architecture": "small_cnn", "args": {"depth": 2, "width": 8, "num_classes": 3},
               "inputShape": [1, 12, 12]})
    job["spec"]["template"] = _mounted(mount, SHAPES)
    cluster.client.create_job(namespace, job)
    done = scenario.wait_phase(cluster, namespace, "shapes-volume", "Succeeded",
                               details=operator.log_tail)
    api.TrainingJobStatus.model_validate(done["status"])
    record = records.read_record(zoo.store, done["status"]["result"]["zooModel"])
    assert record.job_name == "shapes-volume" and record.dataset == "imagefolder"
    pod = cluster.client.pods(namespace, "shapes-volume")[0]
    container = pod["spec"]["containers"][0]
    assert {"name": "shapes", "mountPath": mount, "readOnly": True} in container["volumeMounts"]
    assert container["command"][-2:] == ["-m", "kiln_trainer"]
    assert not Path(mount).exists()  # unmounted when the container ended


def test_a_jobs_own_command_runs_in_the_trainer_container_with_kilns_environment(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
    tmp_path: Path,
) -> None:
    volume = tmp_path / "volume"
    for cls in ("circle", "square"):
        shutil.copytree(SHAPES / "train" / cls, volume / "train" / cls)
    (volume / "my_loop.py").write_text(OWN_LOOP, encoding="utf-8")
    mount = str(tmp_path / "mnt" / "work")  # the test kubelet links it to the volume
    job = scenario.tiny_job("own-command")
    template = _mounted(mount, volume)
    template["image"] = "registry.example/my-loop:1"
    template["command"] = ["python", f"{mount}/my_loop.py"]
    template["env"] = [{"name": "DATA_DIR", "value": mount}]
    job["spec"]["template"] = template
    cluster.client.create_job(namespace, job)
    done = scenario.wait_phase(cluster, namespace, "own-command", "Succeeded",
                               details=operator.log_tail)
    assert done["status"]["result"]["metric"] == 0.11  # 5 circles and 6 squares it found
    pod = cluster.client.pods(namespace, "own-command")[0]
    container = pod["spec"]["containers"][0]
    assert container["name"] == "trainer" and container["image"] == "registry.example/my-loop:1"
    assert container["command"] == ["python", f"{mount}/my_loop.py"]
    assert {"KILN_JOB", "KILN_ZOO", "KILN_WARM_START", "DATA_DIR"} <= {
        e["name"] for e in container["env"]}


def test_a_mount_of_no_volume_and_a_reserved_variable_are_refused_before_any_pod(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    job = scenario.tiny_job("bad-template")
    job["spec"]["template"] = {
        "volumes": [{"name": "data", "emptyDir": {}}],
        "volumeMounts": [{"name": "dataset", "mountPath": "/data"}],
        "env": [{"name": "KILN_ZOO", "value": "/tmp/elsewhere"}]}
    cluster.client.create_job(namespace, job)
    failed = scenario.wait_phase(cluster, namespace, "bad-template", "Failed",
                                 details=operator.log_tail)
    message = scenario.condition(failed, "Failed")["message"]
    assert scenario.condition(failed, "Failed")["reason"] == "InvalidSpec"
    assert "spec.template.volumeMounts[0].name: 'dataset' names no volume" in message
    assert "spec.template.env[0].name: KILN_ZOO is reserved" in message
    assert scenario.pod_creations(cluster, namespace, "bad-template") == []


BAD_DATA = '''\
def from_disk(root):
    with open(root + "/index.json") as index:  # the user's bug: the file is not there
        return index
'''


def test_a_dataset_entrypoint_that_raises_fails_the_job_with_the_users_file_and_line(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
    tmp_path: Path,
) -> None:
    (tmp_path / "bad_data.py").write_text(BAD_DATA, encoding="utf-8")
    mount = str(tmp_path / "mnt" / "code")  # the test kubelet links it to the volume
    job = scenario.tiny_job("bad-data", dataset={"entrypoint": "bad_data:from_disk",
                                                 "args": {"root": "/nowhere"}})
    job["spec"]["template"] = _mounted(mount, tmp_path)
    job["spec"]["template"]["env"] = [{"name": "PYTHONPATH", "value": mount}]
    job["spec"]["runPolicy"] = {"backoffLimit": 3}
    cluster.client.create_job(namespace, job)
    failed = scenario.wait_phase(cluster, namespace, "bad-data", "Failed",
                                 details=operator.log_tail)
    reason = scenario.condition(failed, "Failed")
    assert reason["reason"] == "PermanentError" and "exit code 2" in reason["message"]
    assert "spec.dataset.entrypoint: bad_data:from_disk(root='/nowhere') raised " \
           "FileNotFoundError" in reason["message"]
    assert "bad_data.py, line 2, in from_disk" in reason["message"], reason["message"]
    assert failed["status"].get("restarts", 0) == 0
    assert scenario.pod_creations(cluster, namespace, "bad-data") == ["bad-data-trainer-0"]
