"""bench/sweep.py --merge: an earlier result's seeds join a run, and a run of other settings is
refused naming the setting. Written results stand in for sweeps; nothing trains here."""

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
