"""`kiln.local.tables`: planned runs add config and planned-vs-actual columns to the results; the plan
table shows each job's devices, config, start, estimate and source; cells are plain text."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from kiln.local import machine, runner, tables
from kiln.placement import types
from kiln.warmstart import select

RESULT = {"metric_name": "validation_accuracy", "metric": 0.9, "wall_seconds": 3.0,
          "samples_per_second": 100.0, "target_reached": False, "zoo_model": "m-1"}


def _text(table: Table) -> str:
    out = io.StringIO()
    Console(file=out, width=250).print(table)
    return out.getvalue()


def test_results_of_a_sequential_run_have_no_placement_columns() -> None:
    text = _text(tables.results([runner.JobOutcome("a", "small_cnn", RESULT)]))
    assert "planned" not in text and "m-1" in text


def test_a_job_without_a_target_says_so_instead_of_not_reached() -> None:
    without = _text(tables.results([runner.JobOutcome("a", "small_cnn", RESULT,
                                                     has_target=False)]))
    assert "no target" in without and "not reached" not in without
    assert "not reached" in _text(tables.results([runner.JobOutcome("a", "small_cnn", RESULT)]))


def test_a_cold_run_says_whether_the_guard_refused_a_candidate_or_none_matched() -> None:
    def cell(outcome: str | None) -> str:
        result = {**RESULT, "warm_start_decision": {"outcome": outcome} if outcome else None}
        return _text(tables.results([runner.JobOutcome("a", "small_cnn", result)]))
    assert "cold (guard)" in cell("cold_guard")
    assert "cold (no match)" in cell("cold_below_min_similarity")
    assert "cold (no match)" in cell("cold_empty") and "cold (disabled)" in cell("disabled")
    assert "cold start" not in cell("cold_guard") + cell("cold_empty")
    pretrained = {**RESULT, "warm_start_decision": {"outcome": "disabled",
                                                    "reason": select.PRETRAINED_REASON}}
    text = _text(tables.results([runner.JobOutcome("a", "small_cnn", pretrained)]))
    assert "pretrained weights" in text and "cold" not in text
    warm = {**RESULT, "parent": "p-1", "similarity": 0.7}
    assert "p-1 (0.70)" in _text(tables.results([runner.JobOutcome("a", "small_cnn", warm)]))


def test_results_of_a_planned_run_show_config_and_planned_vs_actual() -> None:
    placed = runner.Placement("ddp", 2, (0, 1), "zoo", 0.0, 30.4, 1.2, 41.0)
    text = _text(tables.results([runner.JobOutcome("a", "small_cnn", RESULT, placed)]))
    assert "planned s" in text and "actual s" in text
    assert "ddp×2 (zoo)" in text and "0+30" in text and "1+41" in text


def test_the_plan_table_lists_devices_config_start_estimate_and_source() -> None:
    the_plan = types.Plan((types.Assignment("[b]x[/b]", "local", 2, "ddp", 0.0, 20.0),
                           types.Assignment("y", "local", 1, "single", 20.0, 5.0)), 25.0, "milp")
    configs = {"[b]x[/b]": (types.Config("ddp", 2, 20.0, "profile"),)}
    text = _text(tables.plan(the_plan, configs, machine.Devices("cpu", 2, 1, None)))
    assert "Plan: 2 jobs on 2 CPU slots (milp; makespan 25 s)" in text
    assert "[b]x[/b]" in text  # job names are never markup
    assert "0,1" in text and "profile" in text and "?" in text  # y has no known config
