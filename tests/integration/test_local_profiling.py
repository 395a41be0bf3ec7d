"""`kiln run` on several jobs profiles each entrypoint model with the real trainer
(``python -m kiln_trainer --profile``) before planning: the profile cache gets its step, the
console its profile line, and a broken entrypoint fails the run before any training.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import clirun
import yaml

from kiln import contract
from kiln.zoo import records, store

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own-model"


def _kiln(*args: str, cwd: Path) -> clirun.Done:
    # The variants live in tmp_path, so the example's package comes from PYTHONPATH.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(EXAMPLE)}
    env.pop("KILN_ZOO", None)
    return clirun.kiln(*args, cwd=cwd, env=env)


def _small(source: str, target: Path, **model: object) -> Path:
    """The example job with few samples, one epoch and no freezing (and `model` fields
    replaced)."""
    doc = yaml.safe_load((EXAMPLE / source).read_text(encoding="utf-8"))
    doc["spec"]["dataset"]["maxSamples"] = 256
    doc["spec"]["training"]["epochs"] = 1
    doc["spec"]["freezing"] = {"enabled": False}  # no reference process beside each trainer
    doc["spec"]["model"].update(model)
    target.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return target


def test_run_profiles_each_entrypoint_job_into_the_cache_before_planning(tmp_path: Path) -> None:
    files = [_small("mixer.yaml", tmp_path / "mixer.yaml"),
             _small("mixer-bigger.yaml", tmp_path / "bigger.yaml")]
    done = _kiln("run", *map(str, files), "--slots", "2", "--zoo", "zoo", cwd=tmp_path)
    out = " ".join(done.stdout.split())  # rich wraps long lines
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("digits-mixer", "digits-mixer-bigger"):
        assert f"{name}: profiled " in out and out.index(f"{name}: profiled") < \
            out.index("Plan: 2 jobs"), out
    assert "ms/step on" in out and "warm start: cold start: the model zoo is empty" in out, out

    cache = json.loads((tmp_path / ".kiln" / "profiles.json").read_text(encoding="utf-8"))
    entries = list(cache["entries"].values())
    assert sorted(e["architecture"] for e in entries) == ["mynets.mixer:mixer"] * 2
    assert all(e["status"] == "ok" and e["step_seconds"] > 0 for e in entries), entries
    saved = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert sorted(r.job_name for r in saved) == ["digits-mixer", "digits-mixer-bigger"]


def test_a_broken_entrypoint_fails_the_run_while_profiling_before_any_training(
        tmp_path: Path) -> None:
    files = [_small("mixer.yaml", tmp_path / "mixer.yaml"),
             _small("mixer-bigger.yaml", tmp_path / "bad.yaml", entrypoint="nosuchpkg.m:build")]
    done = _kiln("run", *map(str, files), "--slots", "2", "--zoo", "zoo", cwd=tmp_path)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0, out
    assert "job digits-mixer-bigger:" in out and "cannot import 'nosuchpkg.m'" in out, out
    assert f"exited with code {contract.EXIT_INVALID}" in out, out
    assert "digits-mixer: training" not in out and "Plan:" not in out, out
