"""`kiln.dashboard`: the committed Grafana dashboard is regenerated from it, valid for Grafana's
typed model of the schemaVersion it declares (`grafana_model`, grafana-foundation-sdk 11.6: no
key lost on a round trip, declared types and enum values, required fields, known panel types),
laid out on the grid, on the ``${datasource}`` variable, and names only metrics that exist.

Every query against a real Prometheus: tests/e2e/test_dashboard_prometheus.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grafana_model  # tests/ is on sys.path (pytest pythonpath)
import pytest

from kiln import cli, dashboard
from kiln.controller import metrics as operator_metrics
from kiln_trainer import metrics as trainer_metrics

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / dashboard.CHART_COPY
REGENERATE = "run `kiln dashboard --write` in the repository root to regenerate it"
METRIC = re.compile(r"\b(kiln_\w+|DCGM_FI_\w+)\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
GRAFANA_BUILTINS = {"__rate_interval", "__range", "__interval"}


def _committed() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(COMMITTED.read_text(encoding="utf-8"))
    return loaded


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


def test_kiln_dashboard_write_regenerates_the_helm_charts_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["dashboard", "--write"]) == cli.EXIT_OK
    written = tmp_path / "helm" / "kiln" / "dashboards" / "kiln.json"
    assert written.read_text(encoding="utf-8") == dashboard.render()


def test_the_dashboard_is_valid_for_the_grafana_schema_version_it_declares() -> None:
    raw = _committed()
    assert raw["schemaVersion"] == grafana_model.SCHEMA_VERSION, (
        "the dashboard declares another schemaVersion than grafana-foundation-sdk's release "
        "models; pin the SDK release matching it in pyproject.toml")
    assert grafana_model.problems(raw) == []
    assert grafana_model.unknown_panel_types(grafana_model.panel_types(raw)) == set()


def test_the_model_check_catches_misspelt_fields_wrong_types_and_unknown_panels() -> None:
    raw = _committed()
    panel = raw["panels"][1]
    panel["fieldConfig"]["defaults"]["unti"] = "s"
    panel["gridPos"]["w"] = "8"
    del panel["options"]["legend"]["showLegend"]
    panel["options"]["tooltip"]["mode"] = "all"
    problems = "\n".join(grafana_model.problems(raw))
    assert "panels[1].fieldConfig.defaults.unti: not a field" in problems
    assert "panels[1].gridPos.w: '8' is not a int" in problems
    assert "panels[1].options.legend.showLegend: required" in problems
    assert "panels[1].options.tooltip.mode: 'all' is not one of" in problems
    panel["type"] = "timeseriess"
    assert grafana_model.unknown_panel_types(grafana_model.panel_types(raw)) == {"timeseriess"}


def test_every_panel_and_query_is_on_the_datasource_variable_with_units_and_known_variables(
) -> None:
    raw = _committed()
    for panel in grafana_model.panels(raw):
        where = f'panel "{panel["title"]}"'
        assert panel.get("datasource") == dashboard.DATASOURCE, where
        if panel["type"] == "row":
            continue
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{where} has no unit"
        refs = [target.get("refId") for target in panel.get("targets") or []]
        assert refs and all(refs) and len(refs) == len(set(refs)), f"{where}: refIds {refs}"
        for target in panel["targets"]:
            assert target.get("expr"), f"{where} target {target['refId']} has no expr"
            assert target.get("datasource") == dashboard.DATASOURCE, where
    variables = {v["name"]: v for v in raw["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource", "prometheus")
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == dashboard.DATASOURCE, variable["name"]
    for query in grafana_model.queries(raw):
        used = {a or b for a, b in grafana_model.VARIABLE.findall(query.expr)}
        assert used <= set(variables) | GRAFANA_BUILTINS, f"{query.where}: {used}"
    titles = " ".join(str(panel["title"]) for panel in grafana_model.panels(raw))
    for name in grafana_model.VARIABLE.findall(titles):
        assert (name[0] or name[1]) in variables, name


def test_queries_fill_in_variables_and_read_label_values_selectors() -> None:
    queries = {q.where: q for q in grafana_model.queries(_committed())}
    job = queries["variable job"]
    assert (job.expr, job.label) == (
        'kiln_trainer_progress_ratio{job_namespace=~"$namespace"}', "training_job")
    assert grafana_model.fill_in(job.expr, {"namespace": "team-a"}) == (
        'kiln_trainer_progress_ratio{job_namespace=~"team-a"}')
    assert grafana_model.fill_in("rate(x[${__rate_interval}])", {"__rate_interval": "30s"}) == (
        "rate(x[30s])")


def test_kiln_series_are_selected_by_kilns_own_labels_not_the_scrapes_target_labels() -> None:
    # A scrape sets `job` and (under the Prometheus Operator) `namespace` on every target: on a
    # kiln_* series they name the scrape job and the operator's or trainer's pod namespace, not
    # the TrainingJob's, so the dashboard must select and group kiln_* by kiln's own labels.
    target_labels = {"job", "namespace"}
    for query in grafana_model.queries(_committed()):
        for metric, matchers in re.findall(r"\b(kiln_\w+)\{([^}]*)\}", query.expr):
            names = set(re.findall(r"(\w+)\s*[=!]~?", matchers))
            assert not names & target_labels, f"{query.where}: {metric}{{{matchers}}}"
        for grouping in re.findall(r"\bby \(([^)]*)\)", query.expr):
            labels = {label.strip() for label in grouping.split(",")}
            assert not labels & target_labels or "DCGM_" in query.expr, (
                f"{query.where}: by ({grouping})")
        if query.where.startswith("variable"):
            assert query.label not in target_labels, query.where
