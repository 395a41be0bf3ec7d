"""`kiln submit/ls/get/logs/wait/delete` and `kiln.Client` against the real operator.

The commands run as a user's would, on a kubeconfig pointing at the emulator; the test
kubelet's container logs are served as the pods' log subresource.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubesim import client, emulator, kubelet, operator_process, scenario

from kiln import Client, cli

KILN = [sys.executable, "-c", "import sys; from kiln.cli import main; sys.exit(main())"]


@pytest.fixture(scope="module")
def kubeconfig(cluster: emulator.Emulator, node_kubelet: kubelet.Kubelet,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cluster.serve_pod_logs(node_kubelet.pod_log_path)
    yield cluster.write_kubeconfig(tmp_path_factory.mktemp("user") / "kubeconfig")


def kiln(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`kiln ARGS` in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def job_file(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_submit_follow_wait_get_ls_and_delete_a_job(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, kubeconfig: Path, namespace: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = "digits-cli"
    where = ["-n", namespace, "--kubeconfig", str(kubeconfig)]
    # Held once it has written a line, so that `logs -f` is seen streaming a live pod.
    hold = node_kubelet.hold(kubelet.Hold(namespace, f"{name}-trainer-0",
                                          when=lambda pod: bool(pod.log().strip())))
    code, out, err = kiln(capsys, "submit", str(job_file(tmp_path, scenario.tiny_job(name))),
                          *where)
    assert (code, out.strip()) == (0, f"created TrainingJob {namespace}/{name}"), err

    code, out, err = kiln(capsys, "ls", *where, "-o", "json")
    assert code == 0, err
    assert [(row["kind"], row["name"], row["epochs"]) for row in json.loads(out)] == [
        ("TrainingJob", name, 2)]

    client.wait_until(hold.held.is_set, timeout_seconds=scenario.JOB_SECONDS,
                      what="the trainer to write its first line", details=operator.log_tail)
    errors = tmp_path / "logs.stderr"
    with errors.open("w") as stderr:
        follow = subprocess.Popen([*KILN, "logs", name, "-f", *where], stdout=subprocess.PIPE,
                                  stderr=stderr, text=True)
    try:
        assert follow.stdout is not None
        first = follow.stdout.readline()
        assert first.strip(), errors.read_text()
        assert follow.poll() is None  # the pod is held: the stream is still open
        hold.release()
        rest = follow.stdout.read()  # through the same buffer as readline: to the end
        follow.wait(timeout=scenario.JOB_SECONDS)
    finally:
        follow.kill()
    assert follow.returncode == 0, errors.read_text()
    streamed = first + rest
    assert streamed == node_kubelet.pod_log(namespace, f"{name}-trainer-0")

    code, out, err = kiln(capsys, "wait", name, *where, "--timeout", str(scenario.JOB_SECONDS))
    assert (code, out.strip()) == (0, f"{name}: Succeeded"), err + operator.log_tail()

    code, out, err = kiln(capsys, "logs", name, *where)
    assert code == 0 and out == streamed, err
    code, out, err = kiln(capsys, "logs", name, *where, "--rank", "3")
    assert code == 2 and "has no trainer pod of rank 3" in err
    assert "its pods have rank 0: check --rank" in err

    code, out, err = kiln(capsys, "get", name, *where, "-o", "json")
    assert code == 0, err
    view = json.loads(out)
    assert view["phase"] == "Succeeded"
    assert {c["type"]: c["status"] for c in view["conditions"]}["Succeeded"] == "True"
    assert view["result"]["validationAccuracy"] == view["accuracy"] > 0
    assert view["story"][-1].startswith("Succeeded with validation accuracy")
    assert "Layer freezing is off (spec.freezing.enabled: false)." in view["story"]
    assert view["events"], "the operator posts events about the job"

    code, out, err = kiln(capsys, "get", name, *where)  # people's view, plain when piped
    assert code == 0 and out.startswith(f"TrainingJob {namespace}/{name}: Succeeded"), err
    assert "Conditions:" in out and "Events:" in out

    code, out, err = kiln(capsys, "delete", name, *where, "-o", "json")
    assert code == 0 and json.loads(out)[0]["action"] == "deleted", err
    client.wait_until(lambda: cluster.client.job(namespace, name) is None,
                      timeout_seconds=30, what="the job to be deleted")
    code, out, err = kiln(capsys, "get", name, *where)
    assert code == 2
    assert f"no TrainingJob or TrainingSweep {name} in namespace {namespace}" in err
    assert f"kiln ls -n {namespace}" in err


def test_wait_exits_1_with_the_reason_when_the_job_fails(
    operator: operator_process.OperatorProcess, kubeconfig: Path, namespace: str,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    job = scenario.tiny_job("images-missing", dataset={
        "name": "imagefolder", "path": "/nonexistent/kiln-e2e-images"},
        model={"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
               "inputShape": [3, 8, 8]})
    where = ["-n", namespace, "--kubeconfig", str(kubeconfig)]
    assert kiln(capsys, "submit", str(job_file(tmp_path, job)), *where)[0] == 0
    code, out, err = kiln(capsys, "wait", "images-missing", *where, "-o", "json")
    assert code == 1
    assert "images-missing ended Failed: PermanentError" in err
    assert json.loads(out)["phase"] == "Failed"


def test_submit_refuses_an_invalid_file_before_touching_the_cluster(
    cluster: emulator.Emulator, kubeconfig: Path, namespace: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = scenario.tiny_job("digits-typo")
    doc["spec"]["trainingg"] = doc["spec"].pop("training")
    code, _out, err = kiln(capsys, "submit", str(job_file(tmp_path, doc)), "-n", namespace,
                           "--kubeconfig", str(kubeconfig))
    assert code == 2 and "spec.trainingg" in err
    missing = tmp_path / "nowhere.yaml"
    code, _out, err = kiln(capsys, "submit", str(missing), "-n", namespace,
                           "--kubeconfig", str(kubeconfig))
    assert code == 2 and f"{missing}: " in err and "cannot read the file" in err
    assert cluster.client.job(namespace, "digits-typo") is None
    elsewhere = scenario.tiny_job("digits-elsewhere")
    elsewhere["metadata"]["namespace"] = f"{namespace}-b"
    code, _out, err = kiln(capsys, "submit", str(job_file(tmp_path, elsewhere)), "-n", namespace,
                           "--kubeconfig", str(kubeconfig))
    assert code == 2 and f"names namespace {namespace}-b, not {namespace}" in err
    assert cluster.client.job(f"{namespace}-b", "digits-elsewhere") is None


def test_the_python_client_submits_waits_reads_logs_lists_and_deletes(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, kubeconfig: Path,
    namespace: str,
) -> None:
    kiln_client = Client(kubeconfig=kubeconfig, namespace=namespace)
    assert kiln_client.submit(scenario.tiny_job("digits-py", epochs=1)) == [
        {"kind": "TrainingJob", "name": "digits-py", "namespace": namespace,
         "action": "created"}]
    done = kiln_client.wait("digits-py", timeout=scenario.JOB_SECONDS)
    assert done["phase"] == "Succeeded" and done["epoch"] == 1
    assert list(kiln_client.logs("digits-py")), "the trainer wrote its log"
    assert [row["name"] for row in kiln_client.list()] == ["digits-py"]
    kiln_client.delete("digits-py")
    client.wait_until(lambda: cluster.client.job(namespace, "digits-py") is None,
                      timeout_seconds=30, what="the job to be deleted")
