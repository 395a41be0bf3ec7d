"""`kiln validate` on jobs that name a runtime: from --runtime FILE or the same file."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from kiln import cli

pytestmark = pytest.mark.process  # checking a job against the registry imports torch (ldconfig)

RUNTIME = """\
apiVersion: kiln.dev/v1alpha1
kind: ClusterTrainingRuntime
metadata: {name: team}
spec:
  template:
    env: [{name: TEAM, value: vision}]
    volumes: [{name: cache, emptyDir: {}}]
    podSecurityContext: {runAsNonRoot: true}
  locked: [podSecurityContext]
"""
JOB = """\
apiVersion: kiln.dev/v1alpha1
kind: TrainingJob
metadata: {name: on-team}
spec:
  runtimeRef: {name: team}
  model: {architecture: small_resnet, inputShape: [1, 8, 8]}
  template:
    volumeMounts: [{name: cache, mountPath: /cache}]
"""
LOCKED = JOB + "    podSecurityContext: {runAsUser: 0}\n"
LOCKED_MESSAGE = ("spec.template.podSecurityContext: locked by ClusterTrainingRuntime team; "
                  "remove it from the job (the runtime sets it)")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_a_job_on_a_runtime_file_is_checked_on_it(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    runtime = _write(tmp_path, "runtime.yaml", RUNTIME)
    job = _write(tmp_path, "job.yaml", JOB)
    assert cli.main(["validate", str(job), "--runtime", str(runtime)]) == cli.EXIT_OK
    assert "on ClusterTrainingRuntime team" in capsys.readouterr().out


def test_a_job_overriding_a_locked_field_is_refused_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runtime = _write(tmp_path, "runtime.yaml", RUNTIME)
    job = _write(tmp_path, "job.yaml", LOCKED)
    assert cli.main(["validate", str(job), "--runtime", str(runtime)]) == cli.EXIT_USAGE
    assert LOCKED_MESSAGE in capsys.readouterr().err


def test_a_runtime_in_the_same_file_is_used_and_said_valid(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    both = _write(tmp_path, "both.yaml", RUNTIME + "---\n" + LOCKED)
    assert cli.main(["validate", str(both)]) == cli.EXIT_USAGE
    assert LOCKED_MESSAGE in capsys.readouterr().err
    both = _write(tmp_path, "both.yaml", RUNTIME + "---\n" + JOB)
    assert cli.main(["validate", str(both), "-o", "json"]) == cli.EXIT_OK
    rows = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["name"], r["valid"]) for r in rows] == [
        ("ClusterTrainingRuntime", "team", True), ("TrainingJob", "on-team", True)]
    assert rows[1]["runtime"] == {"kind": "ClusterTrainingRuntime", "name": "team",
                                  "checked": True}


def test_without_its_runtime_a_job_is_checked_as_written_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _write(tmp_path, "job.yaml", JOB.replace(
        "  template:\n    volumeMounts: [{name: cache, mountPath: /cache}]\n", ""))
    assert cli.main(["validate", str(job)]) == cli.EXIT_OK
    assert "not given, so its settings were not checked" in capsys.readouterr().out


def test_an_invalid_runtime_file_is_refused_naming_its_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runtime = _write(tmp_path, "runtime.yaml", RUNTIME.replace("emptyDir", "emptyDri"))
    job = _write(tmp_path, "job.yaml", JOB)
    assert cli.main(["validate", str(job), "--runtime", str(runtime)]) == cli.EXIT_USAGE
    assert "spec.template.volumes[0].emptyDri" in capsys.readouterr().err
    not_runtime = _write(tmp_path, "other.yaml", JOB)
    assert cli.main(["validate", str(job), "--runtime", str(not_runtime)]) == cli.EXIT_USAGE
    assert "kind: expected TrainingRuntime or ClusterTrainingRuntime" in capsys.readouterr().err


def test_an_invalid_runtime_is_named_as_a_runtime_not_a_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runtime = _write(tmp_path, "runtime.yaml", RUNTIME.replace("emptyDir", "emptyDri"))
    assert cli.main(["validate", str(runtime)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{runtime}: invalid ClusterTrainingRuntime:" in err
    assert "invalid TrainingJob" not in err


def test_submit_of_a_runtime_alone_says_it_creates_nothing_before_touching_a_cluster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runtime = _write(tmp_path, "runtime.yaml", RUNTIME)
    code = cli.main(["submit", str(runtime), "--kubeconfig", str(tmp_path / "no-kubeconfig")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == cli.EXIT_USAGE, err
    assert "ClusterTrainingRuntime team is not created: runtimes are the platform's" in err
    assert "holds no TrainingJob or TrainingSweep to submit" in err
    assert "kubeconfig" not in err  # refused before any cluster is read
