"""`kiln run` of a deeper child warm-started from a parent trained on digits: the stem and the
three stages the warm start copied unchanged start frozen at step 0 (``spec.freezing.transferred:
freeze``), said in the trainer's info events and recorded in the result's freezing summary.
Nothing asserted waits on the reference process: the step-0 freeze needs none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import clirun
import yaml


def _job(path: Path, name: str, blocks: list[int], freezing: dict[str, Any],
         epochs: int) -> Path:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
           "spec": {
               "model": {"architecture": "small_resnet",
                         "args": {"blocks": blocks, "width": 8}, "inputShape": [1, 8, 8]},
               "dataset": {"name": "digits", "maxSamples": 400},
               "training": {"epochs": epochs, "batchSize": 64,
                            "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
               "freezing": freezing}}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_the_copied_stages_of_a_warm_started_child_start_frozen(tmp_path: Path) -> None:
    clirun.kiln_ok("run", str(_job(tmp_path / "p.yaml", "parent", [1, 1, 1], {"enabled": False}, 6)),
          "--zoo", "zoo", cwd=tmp_path)
    # 5 steps an epoch: 8 epochs leave room for the policy's first decision (freezing stays on)
    child = _job(tmp_path / "c.yaml", "child", [1, 1, 1, 1],
                 {"transferred": "freeze", "checkEverySteps": 5}, 8)
    done = clirun.kiln_ok("run", str(child), "--zoo", "zoo", "-o", "json", cwd=tmp_path)
    [result] = json.loads(done.stdout)  # -o json: the results on stdout, the events on stderr
    said = " ".join(done.stderr.split())
    assert f"Warm start from {result['parent']} " in said, said
    assert ("freezing: the warm start copied stem, stages.0.0, stages.1.0, stages.2.0 "
            "unchanged: they start frozen, and thaw if stages.3.0 moves 3x faster" in said), said
    summary = result["freezing"]
    assert summary["transferred"] == {
        "mode": "freeze", "modules": ["stem", "stages.0.0", "stages.1.0", "stages.2.0"]}
    first = summary["events"][0]
    assert (first["kind"], first["step"], first["boundary"]) == ("froze", 0, 4)
    assert first["reason"] == "copied unchanged from the warm start's parent"
    assert summary["backward_flops_skipped"] > 0
