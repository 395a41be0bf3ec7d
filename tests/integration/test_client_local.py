"""`kiln.Client(local=True)`: job files trained by `kiln run`'s runner, reported in the shapes
the cluster backend returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kiln import Client
from kiln.cluster import errors


def _job(job: str, **dataset: object) -> dict[str, object]:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": job},
            "spec": {"model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                               "inputShape": list(dataset.pop("shape", [1, 8, 8]))},
                     "dataset": {"name": "digits", "maxSamples": 400, **dataset},
                     "training": {"epochs": 1, "batchSize": 64},
                     "freezing": {"enabled": False}}}


def test_a_local_client_trains_reports_and_forgets_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("KILN_ZOO", raising=False)
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([
        _job("digits-local"),
        _job("images-missing", name="imagefolder", path=str(tmp_path / "no-images"),
             shape=[3, 8, 8])]), encoding="utf-8")
    client = Client(local=True, zoo=str(tmp_path / "zoo"), work_dir=tmp_path / "runs")

    assert client.submit(path) == [
        {"kind": "TrainingJob", "name": "digits-local", "namespace": "local",
         "action": "succeeded"},
        {"kind": "TrainingJob", "name": "images-missing", "namespace": "local",
         "action": "failed"}]

    done = client.wait("digits-local")
    assert done["phase"] == "Succeeded" and done["epoch"] == 1
    assert done["result"]["zooModel"] and 0 < done["accuracy"] <= 1
    assert done["story"][0].startswith("Started cold")
    assert done["story"][-1].endswith(f"registered as zoo model {done['result']['zooModel']}.")
    assert [(r["name"], r["phase"]) for r in client.list()] == [
        ("digits-local", "Succeeded"), ("images-missing", "Failed")]
    assert any(line for line in client.logs("digits-local"))

    with pytest.raises(errors.WaitFailed, match="images-missing ended Failed: TrainerFailed"):
        client.wait("images-missing")
    assert client.delete("images-missing")["action"] == "deleted"
    with pytest.raises(errors.ClusterError, match="no local job images-missing"):
        client.get("images-missing")
