"""Every benchmark runs end to end in its `--quick` form and writes a summary (CI smoke).

Speed is not asserted here (benchmarks report it); only that each runs, prints its table and
writes `bench/results/<name>_quick.json` with a top-level `summary`. Each script runs as
``__main__`` in a process forked from a server that imported torch once (`benchrun`).
"""

from __future__ import annotations

import json
from pathlib import Path

import benchrun
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize(
    ("script", "result", "summary_key"),
    [
        pytest.param("trainer.py", "trainer_quick", "samples_per_second", id="trainer"),
        pytest.param("zoo_query.py", "zoo_query_quick", "pair_seconds", id="zoo-query"),
        pytest.param("warmstart.py", "warmstart_quick", "median_tta_ratio", id="warmstart"),
        pytest.param("freezing.py", "freezing_quick", "idle_overhead_ratio", id="freezing"),
        pytest.param("freezing_boundaries.py", "freezing_boundaries_quick", "final_delta_points",
                     id="freezing-boundaries"),
        pytest.param("placement.py", "placement_quick",
                     "arrivals_mean_jct_ratio_vs_best_baseline", id="placement"),
        pytest.param("operator.py", "operator_quick", "reconcile_p99_seconds", id="operator"),
        pytest.param("admission.py", "admission_quick", "with_poison_p99_ratio", id="admission"),
        pytest.param("hf_lm.py", "hf_lm_quick", "median_steps_ratio", id="hf-lm"),
        pytest.param("finetune.py", "finetune_quick", "median_tta_ratio", id="finetune"),
        # Two `kiln sweep run` arms, the baseline and Kiln: the text search alone, two trials
        # each, keeps it cheap (the third arm differs from Kiln's only in its sweep file).
        pytest.param("sweep.py --searches text --trials 2 --arms kiln", "sweep_quick_partial",
                     "kiln", id="sweep"),
    ],
)
def test_benchmark_quick_run_writes_its_summary(script: str, result: str, summary_key: str,
                                                tmp_path: Path) -> None:
    name, *extra = script.split()
    output = tmp_path / "output.txt"
    process = benchrun.start(BENCH / name, ["--quick", *extra], output)
    process.join(timeout=600)
    if process.exitcode is None:
        process.kill()
        process.join()
    text = output.read_text(encoding="utf-8", errors="replace")
    assert process.exitcode == 0, f"exit code {process.exitcode}:\n{text[-5000:]}"
    payload = json.loads((BENCH / "results" / f"{result}.json").read_text(encoding="utf-8"))
    assert summary_key in payload["summary"], sorted(payload["summary"])

