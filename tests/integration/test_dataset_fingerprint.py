"""`kiln run` records what each job trained on by content: a copy of the data under another
path is recognised as the same data (admission, which sees only the spec, could not tell), and
`kiln zoo show -o json` shows the fingerprint with its kind.

Subprocesses get OMP_NUM_THREADS=1: tiny models train fastest on one thread on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import clirun
import yaml

from kiln import api
from kiln.zoo import records, store
from kiln_trainer import data

SHAPES = Path(__file__).resolve().parents[1] / "data" / "shapes"


def _kiln(*args: str, cwd: Path) -> clirun.Done:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    environ.pop("KILN_ZOO", None)
    return clirun.kiln(*args, cwd=cwd, env=environ)


def _job(path: Path, name: str, folder: Path) -> dict[str, Any]:
    spec = {"model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8,
                                                            "num_classes": 3},
                      "inputShape": [1, 12, 12]},
            "dataset": {"name": "imagefolder", "path": str(folder / "train"),
                        "validationPath": str(folder / "validation")},
            "training": {"epochs": 6, "batchSize": 5, "optimizer": {"name": "adam",
                                                                    "lr": 0.02}},
            "freezing": {"enabled": False}}
    path.write_text(yaml.safe_dump({"apiVersion": api.API_VERSION, "kind": api.KIND,
                                    "metadata": {"name": name}, "spec": spec}), encoding="utf-8")
    return spec


def test_a_copy_of_the_data_elsewhere_is_recorded_and_reported_as_the_same_data(
        tmp_path: Path) -> None:
    first = _job(tmp_path / "a.yaml", "shapes-a", shutil.copytree(SHAPES, tmp_path / "a"))
    _job(tmp_path / "b.yaml", "shapes-b", shutil.copytree(SHAPES, tmp_path / "b"))
    # --slots 1: b runs after a, so a is b's parent (same architecture: similarity 1).
    done = _kiln("run", "a.yaml", "b.yaml", "--zoo", "zoo", "--slots", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    saved = {r.job_name: r for r in records.list_records(store.DirStore(tmp_path / "zoo"))}
    assert saved["shapes-b"].parent == saved["shapes-a"].id
    # The specs name different paths, so admission saw two datasets; the trainer saw one.
    assert saved["shapes-a"].dataset_fingerprint != saved["shapes-b"].dataset_fingerprint
    assert "same data as the parent (content:sha256:" in done.stdout, done.stdout

    shown = _kiln("zoo", "show", saved["shapes-b"].id, "--zoo", "zoo", "-o", "json",
                  cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    loaded = data.load(api.DatasetSpec.model_validate(first["dataset"]),
                       input_shape=[1, 12, 12], seed=0)
    assert record["content_fingerprint"] == loaded.fingerprint
    assert record["content_fingerprint"].startswith("content:sha256:")
    assert record["content_fingerprint"] == saved["shapes-a"].content_fingerprint
