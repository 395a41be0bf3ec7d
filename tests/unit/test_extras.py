"""The base install (no extras) runs `kiln run` and the trainer: in a subprocess whose import
system refuses the extras' packages (kopf, Pyomo, HiGHS, matplotlib, TensorBoard, jsonschema,
MLflow), as an environment without them, the trainer and the CLI import, a job validates, a run
is planned by the heuristic, and `kiln operator` and `kiln plot` say which extra to install.
`make check-extras` does the real thing in clean virtual environments (too slow for CI)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

EXTRAS_ONLY = ("kopf", "pyomo", "highspy", "matplotlib", "tensorboard", "jsonschema", "mlflow")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits-resnet.yaml"


def test_the_base_install_runs_without_any_extra(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Hiding(importlib.abc.MetaPathFinder):  # finds nothing of the extras, as if absent
            def __init__(self, finder):
                self.finder = finder
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {EXTRAS_ONLY!r}:
                    return None
                return self.finder.find_spec(name, path, target)
        sys.meta_path[:] = [Hiding(f) for f in sys.meta_path]

        import kiln_trainer, kiln_trainer.loop, kiln_trainer.cli  # the trainer image's modules
        from kiln import api, cli
        from kiln.local import machine, runplan
        assert cli.main(["validate", {str(EXAMPLE)!r}]) == 0
        assert cli.main(["operator", "--help"]) == 2
        assert cli.main(["plot", "x.metrics.jsonl", "--out", "x.png"]) == 2
        jobs = [api.parse_job({{
            "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {{"name": n}},
            "spec": {{"model": {{"architecture": "small_cnn", "inputShape": [1, 8, 8]}}}}}})
            for n in ("a", "b")]
        plan, _ = runplan.make_plan(jobs, devices=machine.Devices("cpu", 2, 1, None),
                                    zoo=None, profile_cache=None)
        print("solver", plan.solver, "milp", plan.milp)
        print("loaded", sorted(m for m in sys.modules if m.split(".")[0] in {EXTRAS_ONLY!r}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, check=False, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "solver heuristic milp skipped" in done.stdout
    assert "loaded []" in done.stdout
    said = " ".join(done.stderr.split())
    assert "kiln operator: error: No module named 'kopf'; install the operator extra: pip " \
        "install 'kiln-operator[operator]'" in said
    assert "kiln plot needs matplotlib" in said and "'kiln-operator[plot]'" in said
