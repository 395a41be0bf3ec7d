"""`kiln run` of a child with an added stage: with its batch-norm statistics re-estimated (the
default) its warm start wins at step 0; with the parent's statistics kept it looks no better
than cold there (the new stage sees one pixel of the parent's last 2x2 map), and the trainer's
guard keeps the parent only after training warm and cold side by side; the results table tells
a guard's cold start from a missing match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import clirun
import yaml

from kiln.zoo import records, store


def _job(path: Path, name: str, blocks: list[int], register: bool = True,
         **warm_start: Any) -> Path:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
           "spec": {
               "model": {"architecture": "small_resnet",
                         "args": {"blocks": blocks, "width": 8}, "inputShape": [1, 8, 8]},
               "dataset": {"name": "digits", "maxSamples": 600},
               "training": {"epochs": 2, "batchSize": 64,
                            "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
               "warmStart": warm_start, "freezing": {"enabled": False},
               "zoo": {"register": register}}}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_an_added_stage_wins_at_step_0_re_estimated_else_after_the_probe_steps(
        tmp_path: Path) -> None:
    first = clirun.kiln_ok("run", str(_job(tmp_path / "p.yaml", "parent", [1, 1, 1])), "--zoo", "zoo",
                  cwd=tmp_path)
    assert "cold (no match)" in first.stdout  # an empty zoo: nothing to start from
    (parent,) = [r.id for r in records.list_records(store.DirStore(tmp_path / "zoo"))]

    child = _job(tmp_path / "c.yaml", "child", [1, 1, 1, 1], calibrateNorms=False)
    query = clirun.kiln_ok("zoo", "query", str(child), "--zoo", "zoo", cwd=tmp_path)
    assert f"Candidate parent {parent}: similarity" in query.stdout, query.stdout
    assert "only if its guard accepts it" in query.stdout

    # the default: statistics re-estimated on the probe, the parent wins at step 0
    calibrated = clirun.kiln_ok("run", str(_job(tmp_path / "c1.yaml", "calibrated", [1, 1, 1, 1],
                                       register=False, probeSteps=0)), "--zoo", "zoo",
                                cwd=tmp_path)
    assert (f"Warm start from {parent} (similarity 0.72): guard: step-0 probe loss "
            in calibrated.stdout), calibrated.stdout
    assert "batch-norm statistics re-estimated on the probe" in calibrated.stdout

    # with the parent's statistics, judged on step-0 loss alone, the parent is refused, and the
    # table says by whom
    alone = clirun.kiln_ok("run", str(_job(tmp_path / "c0.yaml", "step-zero", [1, 1, 1, 1],
                                  register=False, probeSteps=0, calibrateNorms=False)),
                           "--zoo", "zoo", cwd=tmp_path)
    assert (f"Candidate {parent} (similarity 0.72) rejected by the guard: step-0 probe loss"
            in alone.stdout), alone.stdout
    assert "cold (guard)" in alone.stdout and "cold (no match)" not in alone.stdout

    # trained side by side for the default 10 steps, the warm start is ahead and kept (the
    # parent's statistics still)
    done = clirun.kiln_ok("run", str(child), "--zoo", "zoo", cwd=tmp_path)
    assert (f"Warm start from {parent} (similarity 0.72): guard: after 10 steps warm loss "
            in done.stdout), done.stdout
    assert "(mean of the last 2 on the same batches); step-0 probe loss" in done.stdout
    saved = {r.job_name: r for r in records.list_records(store.DirStore(tmp_path / "zoo"))}
    assert saved["child"].parent == parent
