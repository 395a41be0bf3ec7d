"""`kiln.dashboard`: the committed Grafana dashboard is regenerated from it, laid out on the grid,
and names only metrics that exist.

The Grafana schema check and every query against a real Prometheus are in
tests/e2e/test_dashboard_prometheus.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kiln import cli, dashboard
from kiln.controller import metrics as operator_metrics
from kiln_trainer import metrics as trainer_metrics

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / dashboard.CHART_COPY
REGENERATE = "run `kiln dashboard` in the repository root to regenerate it"
METRIC = re.compile(r"\b(kiln_\w+|DCGM_FI_\w+)\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _panels() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = dashboard.build()["panels"]
    return panels


def _exported_metrics() -> set[str]:
    """Sample names the operator's and a trainer's registries expose."""
    names = set()
    for registry in (operator_metrics.OperatorMetrics().registry,
                     trainer_metrics.MetricsReporter(job="j").registry):
        for family in registry.collect():
            suffixes = {"counter": ("_total",), "histogram": ("", *HISTOGRAM_SUFFIXES)}.get(
                family.type, ("",))
            names |= {family.name + suffix for suffix in suffixes}
    return names


def test_committed_dashboard_is_regenerated_from_kiln_dashboard() -> None:
    assert COMMITTED.exists(), f"{COMMITTED} is missing; {REGENERATE}"
    assert dashboard.render() == COMMITTED.read_text(encoding="utf-8"), (
        f"{COMMITTED} is stale; {REGENERATE}")


def test_render_is_stable_and_is_the_built_model() -> None:
    text = dashboard.render()
    assert text == dashboard.render()
    assert text.endswith("}\n")
    assert json.loads(text) == dashboard.build()
    assert json.loads(text)["schemaVersion"] == dashboard.SCHEMA_VERSION == 41


def test_build_returns_a_fresh_tree_callers_may_edit() -> None:
    edited = dashboard.build()
    edited["panels"][1]["datasource"]["uid"] = "other"
    assert edited["panels"][2]["datasource"]["uid"] == "${datasource}"
    assert dashboard.build()["panels"][1]["datasource"] == dashboard.DATASOURCE


def test_panel_ids_are_unique_and_numbered_in_order() -> None:
    ids = [panel["id"] for panel in _panels()]
    assert ids == list(range(1, len(ids) + 1))
    assert [p["title"] for p in _panels() if p["type"] == "row"] == [
        r.title for r in dashboard.ROWS]


def test_panels_lie_inside_the_24_column_grid_without_overlapping() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in _panels():
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= dashboard.GRID_COLUMNS, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f'{panel["title"]} overlaps {cells[x, y]}'
                cells[x, y] = panel["title"]


def test_layout_wraps_a_panel_that_does_not_fit_and_starts_rows_below_the_last_line() -> None:
    target = dashboard.Target("up", "up")
    rows = [dashboard.row("One", *(dashboard.timeseries(f"p{i}", "", target, width=10, unit="s")
                                   for i in range(3))),
            dashboard.row("Two", dashboard.stat("s", "", target, width=24, unit="s"))]
    grids = [(p["title"], p["gridPos"]) for p in dashboard.layout(rows)]
    assert grids == [
        ("One", {"h": 1, "w": 24, "x": 0, "y": 0}),
        ("p0", {"h": 8, "w": 10, "x": 0, "y": 1}),
        ("p1", {"h": 8, "w": 10, "x": 10, "y": 1}),
        ("p2", {"h": 8, "w": 10, "x": 0, "y": 9}),
        ("Two", {"h": 1, "w": 24, "x": 0, "y": 17}),
        ("s", {"h": 8, "w": 24, "x": 0, "y": 18}),
    ]


@pytest.mark.parametrize("width", [0, 25])
def test_layout_rejects_a_panel_outside_the_grid(width: int) -> None:
    panel = dashboard.stat("Too wide", "", dashboard.Target("up", "up"), width=width, unit="s")
    with pytest.raises(ValueError, match=r'panel "Too wide": width -?\d+ is not in 1\.\.24'):
        dashboard.layout([dashboard.row("R", panel)])


def test_instant_queries_are_exactly_those_over_the_time_range() -> None:
    """A stat without a sparkline or a bar gauge shows one value for the whole range
    (`$__range`, instant query); anything drawn over time is a range query."""
    for panel in _panels():
        for target in panel.get("targets", []):
            where = f'{panel["title"]} {target["refId"]}'
            assert target["instant"] is not target["range"], where
            assert target["instant"] == ("$__range" in target["expr"]), where


def test_every_metric_named_is_a_module_constant_and_exported() -> None:
    """Names come from the constants (no metric typed inline), and the operator or trainer
    exports each `kiln_` one (the DCGM_FI_ ones are dcgm-exporter's)."""
    built = dashboard.build()
    texts = [str(v["query"]["query"]) for v in built["templating"]["list"] if v["type"] == "query"]
    for panel in built["panels"]:
        texts += [panel.get("description", "")]
        texts += [target["expr"] for target in panel.get("targets", [])]
    named = {name for text in texts for name in METRIC.findall(text)}
    constants = {value for key, value in vars(dashboard).items()
                 if key.isupper() and isinstance(value, str) and METRIC.fullmatch(value)}
    for name in named:
        base = re.sub("|".join(f"{s}$" for s in HISTOGRAM_SUFFIXES), "", name)
        assert name in constants or base in constants, f"{name} is not a kiln.dashboard constant"
    unused = {c for c in constants if not any(c in text for text in texts)}
    assert not unused, f"constants no panel uses: {sorted(unused)}"
    missing = {c for c in constants if c.startswith("kiln_")} - _exported_metrics()
    assert not missing, f"no Kiln registry exports {sorted(missing)}"


def test_kiln_dashboard_writes_every_out_path(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    outs = [tmp_path / "a.json", tmp_path / "deeper" / "b.json"]
    assert cli.main(["dashboard", *(f"--out={out}" for out in outs)]) == cli.EXIT_OK
    assert [out.read_text(encoding="utf-8") for out in outs] == [dashboard.render()] * 2
    assert capsys.readouterr().out.splitlines() == [f"wrote {out}" for out in outs]


def test_kiln_dashboard_defaults_to_the_helm_charts_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["dashboard"]) == cli.EXIT_OK
    written = tmp_path / "helm" / "kiln" / "dashboards" / "kiln.json"
    assert written.read_text(encoding="utf-8") == dashboard.render()
