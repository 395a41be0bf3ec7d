"""Tenancy in the `kiln` command and the trainer: who sees a record, and who it is written for.

`kiln zoo ls/show --namespace` and `kiln run`'s pinned-parent check run through `cli.main` on a
directory zoo; the trainer's share setting through `registration.share_of`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln import api, cli, contract
from kiln.zoo import records, store
from kiln_trainer import registration

PRIVATE = "small_cnn-0000000a"
SHARED = "small_cnn-0000000b"


def _write(zoo: store.ObjectStore, record_id: str, namespace: str, share: api.ZooShare) -> None:
    record = records.ZooRecord(
        id=records.ZooModelId(record_id), architecture="small_cnn", args={},
        input_shape=(1, 8, 8), modality="image", task="classification", dataset="digits",
        metric_name="validation_accuracy", metric_value=0.9, num_params=1,
        created_time="2026-12-01T00:00:00Z", job_name="parent", job_spec={},
        namespace=namespace, share=share)
    records.write_record(zoo, record, {"w": torch.zeros(1)}, {"nodes": []})


@pytest.fixture
def zoo_dir(tmp_path: Path) -> Path:
    zoo = store.DirStore(tmp_path / "zoo")
    _write(zoo, PRIVATE, "team-a", api.ZooShare.PRIVATE)
    _write(zoo, SHARED, "team-a", api.ZooShare.SHARED)
    return tmp_path / "zoo"


def _ls(zoo_dir: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> list[str]:
    assert cli.main(["zoo", "ls", "--zoo", str(zoo_dir), "-o", "json", *extra]) == 0
    return [r["id"] for r in json.loads(capsys.readouterr().out)]


def test_zoo_ls_for_a_namespace_lists_its_own_and_shared_models(
        zoo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _ls(zoo_dir, capsys, "--namespace", "team-a") == [PRIVATE, SHARED]
    assert _ls(zoo_dir, capsys, "--namespace", "team-b") == [SHARED]
    assert _ls(zoo_dir, capsys) == [PRIVATE, SHARED]  # no namespace: the whole zoo


def test_zoo_show_refuses_another_namespaces_private_model(
        zoo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    show = ["zoo", "show", PRIVATE, "--zoo", str(zoo_dir), "-o", "json"]
    assert cli.main([*show, "--namespace", "team-b"]) == cli.EXIT_USAGE
    assert f"{PRIVATE} is private to namespace team-a" in capsys.readouterr().err
    assert cli.main([*show, "--namespace", "team-a"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["namespace"], shown["share"]) == ("team-a", "private")


def test_kiln_run_refuses_to_pin_another_namespaces_private_model_before_training(
        zoo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "pinned", "namespace": "team-b"},
        "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                 "warmStart": {"parent": PRIVATE}}}), encoding="utf-8")
    assert cli.main(["run", str(job), "--zoo", str(zoo_dir)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"spec.warmStart.parent: zoo model '{PRIVATE}' is private to namespace team-a" in err


@pytest.mark.parametrize(("spec_share", "operator_default", "expected"), [
    pytest.param(None, None, api.ZooShare.PRIVATE, id="private-by-default"),
    pytest.param(None, "shared", api.ZooShare.SHARED, id="operator-default"),
    pytest.param("private", "shared", api.ZooShare.PRIVATE, id="spec-wins"),
    pytest.param(None, "everyone", api.ZooShare.PRIVATE, id="bad-default-is-private"),
])
def test_a_records_share_comes_from_the_spec_then_the_operator(
        spec_share: str | None, operator_default: str | None, expected: api.ZooShare) -> None:
    spec = api.TrainingJobSpec.model_validate({
        "model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
        "zoo": {"share": spec_share} if spec_share else {}})
    environ = {contract.Env.ZOO_SHARE: operator_default} if operator_default else {}
    assert registration.share_of(spec, environ) is expected


def test_a_namespace_that_cannot_be_one_is_refused_with_an_example(
        zoo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:  # argparse's usage error
        cli.main(["zoo", "ls", "--zoo", str(zoo_dir), "--namespace", "Team_A"])
    assert caught.value.code == cli.EXIT_USAGE
    assert "'Team_A' is not a namespace name" in capsys.readouterr().err
