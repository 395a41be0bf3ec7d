"""bench/sweep.py --merge and --baseline-from: an earlier result's seeds join a run, or its
baseline stands in for running one; a result of other settings is refused naming the setting;
a run of other arms writes a file of its own. Written results stand in for sweeps; nothing
trains here."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

CONFIG = {"quick": False, "slots": 2, "arms": ["baseline", "kiln"], "epochs": 6,
          "trials": {"fashion": 32}}


@pytest.fixture(scope="module")
def sweep(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("sweep")


def _result(path: Path, **changes: Any) -> Path:
    summary = {**CONFIG, "trials": {"fashion": 32, "text": 32}, **changes}
    details = {f"{label}/{seed}": {"row": {"bar": seed / 10}, "histories": {}}
               for label in ("fashion", "text") for seed in (0, 1)}
    path.write_text(json.dumps({"summary": summary, "details": details}), encoding="utf-8")
    return path


def test_the_seeds_a_run_does_not_repeat_join_it(sweep: ModuleType, tmp_path: Path) -> None:
    rows, details, trials = sweep.load_earlier(_result(tmp_path / "r.json"), CONFIG,
                                               {("fashion", 1)})
    assert rows == {"fashion": {0: {"bar": 0.0}}, "text": {0: {"bar": 0.0}, 1: {"bar": 0.1}}}
    assert sorted(details) == ["fashion/0", "text/0", "text/1"]
    assert trials == {"fashion": 32, "text": 32}
    assert sweep.load_earlier(None, CONFIG, set()) == ({}, {}, {})


@pytest.mark.parametrize(("change", "named"), [
    ({"slots": 4}, "its slots is 4, this run's 2"),
    ({"arms": ["baseline", "kiln", "kiln-independent"]}, "its arms is"),
    ({"epochs": 4}, "its epochs is 4"),
    ({"quick": True}, "its quick is True"),
    ({"trials": {"fashion": 12}}, "its fashion search ran 12 trials, this run 32"),
])
def test_a_result_of_other_settings_is_refused_naming_the_setting(
        sweep: ModuleType, tmp_path: Path, change: dict[str, Any], named: str) -> None:
    with pytest.raises(SystemExit, match=named):
        sweep.load_earlier(_result(tmp_path / "r.json", **change), CONFIG, set())


def test_a_file_that_is_no_result_is_refused(sweep: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(SystemExit, match="not a result of this benchmark"):
        sweep.load_earlier(tmp_path / "r.json", CONFIG, set())
    with pytest.raises(SystemExit, match="not a result of this benchmark"):
        sweep.load_earlier(tmp_path / "absent.json", CONFIG, set())


def _baseline_result(path: Path, **changes: Any) -> Path:
    summary = {**CONFIG, "trials": {"fashion": 32}, **changes}
    row = {"baseline_best": 0.85, "bar": 0.849, "baseline": {
        "seconds_to_bar": 500.0, "cpu_seconds_to_bar": 900.0, "epochs_to_bar": 60,
        "wall_seconds": 1000.0}}
    history = [{"index": 0, "evaluations": [[1, 0.85, 500.0]]}]
    details = {"fashion/0": {"row": row, "histories": {"baseline": history, "kiln": []}}}
    path.write_text(json.dumps({"created": "2026-12-06T14:24:31Z", "summary": summary,
                                "details": details}), encoding="utf-8")
    return path


def test_an_earlier_baseline_stands_in_and_kilns_arm_is_measured_against_it(
        sweep: ModuleType, tmp_path: Path) -> None:
    kept = sweep.load_baselines(_baseline_result(tmp_path / "r.json"), CONFIG)["fashion/0"]
    assert kept["created"] == "2026-12-06T14:24:31Z" and kept["history"][0]["index"] == 0
    # Kiln's arm met the bar (0.849) at 250 s, having used 400 CPU seconds and 20 epochs.
    start = 1_700_000_000.0
    history = [{"index": i, "state": "Succeeded",
                "evaluations": [[e, 0.76 + 0.02 * e, 50.0 * e + i] for e in range(1, 6)]}
               for i in range(4)]
    doc = {"status": {"startTime": "2023-11-14T22:13:20+00:00", "history": history}}
    run = {"doc": doc, "wall_seconds": 300.0, "cpu_seconds": 500.0,
           "cpu_timeline": [[start, 0.0], [start + 250.0, 400.0], [start + 300.0, 500.0]]}
    search = sweep.Search("fashion", {}, [], "validation_accuracy", 32)
    row = sweep.measure(search, {"kiln": run}, kept["row"])
    assert row["baseline"]["time_ratio"] == 1.0 and row["bar"] == 0.849
    assert (row["kiln"]["seconds_to_bar"], row["kiln"]["cpu_seconds_to_bar"]) == (250.0, 400.0)
    assert row["kiln"]["epochs_to_bar"] == 17  # epochs 1-4 of every trial, and one epoch 5
    assert (row["kiln"]["time_ratio"], row["kiln"]["cpu_ratio"]) == (2.0, 2.25)


@pytest.mark.parametrize(("change", "named"), [
    ({"slots": 4}, "its slots is 4, this run's 2"),
    ({"epochs": 4}, "its epochs is 4"),
    ({"trials": {"fashion": 12}}, "its fashion search ran 12 trials, this run 32"),
])
def test_a_baseline_of_other_settings_is_refused_naming_the_setting(
        sweep: ModuleType, tmp_path: Path, change: dict[str, Any], named: str) -> None:
    with pytest.raises(SystemExit, match=named):
        sweep.load_baselines(_baseline_result(tmp_path / "r.json", **change), CONFIG)
    (tmp_path / "bad.json").write_text("{}", encoding="utf-8")
    with pytest.raises(SystemExit, match="not a result of this benchmark"):
        sweep.load_baselines(tmp_path / "bad.json", CONFIG)


@pytest.mark.parametrize(("arms", "quick", "partial", "name"), [
    (("baseline", "kiln", "kiln-independent"), False, False, "sweep"),
    (("baseline", "kiln"), False, True, "sweep_partial"),
    (("baseline", "kiln"), True, True, "sweep_quick_partial"),
    (("baseline", "kiln", "kiln-unfrozen"), False, True, "sweep_unfrozen_partial"),
    (("baseline", "kiln-independent"), False, True, "sweep_independent_partial"),
    (("baseline", "kiln-independent", "kiln-unfrozen"), False, True,
     "sweep_independent_unfrozen_partial"),
])
def test_a_run_without_kilns_arm_or_with_an_opt_in_one_has_a_file_of_its_own(
        sweep: ModuleType, arms: tuple[str, ...], quick: bool, partial: bool,
        name: str) -> None:
    assert sweep.result_name(arms, quick=quick, partial=partial) == name


def test_an_arm_that_never_met_the_bar_gets_no_speed_up(sweep: ModuleType,
                                                          tmp_path: Path) -> None:
    # Kiln's arm ended at 300 s, before the baseline's 500 s to the bar, and never met it:
    # 500 / 300 would read as 1.67x.
    kept = sweep.load_baselines(_baseline_result(tmp_path / "r.json"), CONFIG)["fashion/0"]
    start = 1_700_000_000.0
    history = [{"index": 0, "state": "Succeeded",
                "evaluations": [[e, 0.80 + 0.01 * e, 50.0 * e] for e in range(1, 5)]}]
    doc = {"status": {"startTime": "2023-11-14T22:13:20+00:00", "history": history}}
    run = {"doc": doc, "wall_seconds": 300.0, "cpu_seconds": 500.0,
           "cpu_timeline": [[start, 0.0], [start + 300.0, 500.0]]}
    row = sweep.measure(sweep.Search("fashion", {}, [], "validation_accuracy", 32),
                        {"kiln": run}, kept["row"])
    assert row["kiln"]["reached"] is False and row["kiln"]["best_delta"] == -1.0
    assert (row["kiln"]["time_ratio"], row["kiln"]["cpu_ratio"],
            row["kiln"]["epochs_ratio"]) == (0.0, 0.0, 0.0)
    assert row["baseline"]["time_ratio"] == 1.0
