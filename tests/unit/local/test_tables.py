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


def test_a_compact_sweep_leaderboard_keeps_each_trial_on_one_line_at_80_columns() -> None:
    from kiln import api

    sweep = api.sweep.parse_sweep({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep",
        "metadata": {"name": "digits-search"},
        "spec": {"template": {"model": {"architecture": "small_cnn",
                                        "args": {"depth": 2, "width": 16},
                                        "inputShape": [1, 16, 16]},
                              "dataset": {"name": "digits"}, "training": {"epochs": 4}},
                 "parameters": [
                     {"path": "training.optimizer.lr",
                      "float": {"min": 0.001, "max": 0.1, "log": True}},
                     {"path": "model.args.width", "int": {"min": 8, "max": 64}},
                     {"path": "model.args.depth", "int": {"min": 1, "max": 3}}]}})
    history = [api.sweep.Trial(
        index=i, name=f"digits-search-t{i}",
        params={"training.optimizer.lr": 0.0123456, "model.args.width": 32,
                "model.args.depth": 2},
        state=api.sweep.TrialState.SUCCEEDED, metric=0.9861, evaluations=[[4, 0.9861]],
        parent="small_cnn-0fefc3bb", similarity=0.8, zoo_model=f"small_cnn-{i:08x}")
        for i in range(3)]
    sweep = sweep.model_copy(update={"status": api.sweep.TrainingSweepStatus(history=history)})
    out = io.StringIO()
    Console(file=out, width=80).print(tables.leaderboard(sweep, compact=True))
    lines = out.getvalue().splitlines()
    assert "digits-search" in lines[0]  # the title names the sweep, rows the trial index
    for i in range(3):  # each row's index, values, state, metric and start on one line
        row = next(line for line in lines if f"│ t{i} " in line)
        assert all(cell in row for cell in ("0.01235", "32", "Succeeded", "4/4", "0.9861",
                                            "warm"))
    assert len(lines) == 4 + 3 + 1  # title, header (3 lines), a line per trial, the bottom
    full = _text(tables.leaderboard(sweep))  # wide: the parent, zoo model and why are there
    assert "warm: small_cnn-0fefc3bb" in full and "small_cnn-00000001" in full
