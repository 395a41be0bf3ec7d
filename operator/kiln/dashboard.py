"""The Grafana dashboard `helm/kiln/dashboards/kiln.json`, generated from a short description.

Role: describe the dashboard as rows of panels (`ROWS`: a title, a width, a unit and PromQL
targets per panel) and expand that into Grafana's JSON model: panel ids are assigned in order,
the grid layout is computed (rows span the 24 columns; panels fill a line left to right and wrap
to the next), and every panel, target and query variable reads from the `${datasource}`
variable. Metric names are the constants below, each exported by `kiln.controller.metrics`,
`kiln_trainer.metrics` or NVIDIA's dcgm-exporter (tests check both). The target is Grafana 11.6,
whose dashboard schemaVersion is 41; `render` writes every field Grafana's own export would.

Callers: `kiln dashboard` (prints it; `--write` regenerates the Helm chart's copy, which the
chart's ConfigMap ships to Grafana's sidecar) and the tests, which regenerate and compare byte for byte
(tests/unit/test_dashboard.py) and run every query against a real Prometheus
(tests/e2e/test_dashboard_prometheus.py).

Non-goals: no I/O (`kiln dashboard` writes the file); no Grafana API calls; not a general
dashboard library (only the three panel kinds Kiln uses: timeseries, stat, bargauge); never
imports `kiln.controller`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CHART_COPY = Path("helm/kiln/dashboards/kiln.json")  # from the repository root; `kiln dashboard`
SCHEMA_VERSION = 41  # Grafana 11.6
GRID_COLUMNS = 24
PANEL_HEIGHT = 8
RATIO = "percentunit"  # a [0, 1] quantity: axes and stats stop at 1
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Operator metrics (kiln.controller.metrics).
JOBS = "kiln_jobs"
JOBS_FINISHED = "kiln_jobs_finished_total"
JOB_RESTARTS = "kiln_job_restarts_total"
RECONCILE_ERRORS = "kiln_reconcile_errors_total"
QUEUE_WAIT = "kiln_queue_wait_seconds"
PLACEMENT_SOLVE = "kiln_placement_solve_seconds"
WARM_STARTS = "kiln_warm_start_total"
WARM_START_SIMILARITY = "kiln_warm_start_similarity_ratio"
SWEEP_TRIALS = "kiln_sweep_trials"
SWEEP_BEST = "kiln_sweep_best_metric"
# Trainer metrics (kiln_trainer.metrics), labelled with job_namespace and training_job.
TRAIN_LOSS = "kiln_trainer_train_loss"
VALIDATION_LOSS = "kiln_trainer_validation_loss"
VALIDATION_ACCURACY = "kiln_trainer_validation_accuracy_ratio"
SAMPLES = "kiln_trainer_samples_total"
SAMPLES_PER_SECOND = "kiln_trainer_samples_per_second"
PROGRESS = "kiln_trainer_progress_ratio"
ETA = "kiln_trainer_eta_seconds"
EPOCH = "kiln_trainer_epoch"
FROZEN_MODULES = "kiln_trainer_frozen_modules"
FROZEN_PARAMETERS = "kiln_trainer_frozen_parameters_ratio"
BACKWARD_FLOPS_SKIPPED = "kiln_trainer_backward_flops_skipped_ratio"
# dcgm-exporter gauges, labelled with the namespace and pod the GPU is allocated to.
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"  # percent; not reported for MIG instances
GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"  # ratio; also for MIG
FB_USED = "DCGM_FI_DEV_FB_USED"  # MiB
POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"  # watts
GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"  # degrees Celsius

# Kiln's series name the TrainingJob's namespace `job_namespace` and the job `training_job`:
# Prometheus sets `namespace` and `job` on every target itself. dcgm-exporter's `namespace` and
# `pod` name the GPU's workload (scraped with honor_labels), as do a trainer target's.
IN_NAMESPACE = '{job_namespace=~"$namespace"}'
OF_JOB = '{job_namespace=~"$namespace", training_job="$job"}'
GPU_IN_NAMESPACE = '{namespace=~"$namespace"}'
WARM_OR_PINNED = '{outcome=~"warm|pinned"}'  # the outcomes that start from a zoo parent
LAST_VALUE = {"calcs": ["lastNotNull"], "fields": "", "values": False}  # stat's reduceOptions


@dataclasses.dataclass(frozen=True)
class Target:
    """One PromQL query of a panel and its legend (`{{label}}` names a series label)."""

    expr: str
    legend: str


@dataclasses.dataclass(frozen=True)
class Panel:
    """A panel before layout: Grafana's JSON minus id and gridPos.

    Attributes:
        kind: Grafana's panel type (timeseries, stat, bargauge).
        width: grid columns, 1 to 24.
        instant: the targets are instant queries (one value over the time range), not series.
    """

    kind: str
    title: str
    description: str
    width: int
    field_defaults: dict[str, Any]
    options: dict[str, Any]
    targets: tuple[Target, ...]
    instant: bool


@dataclasses.dataclass(frozen=True)
class Row:
    """A row header spanning the grid, and the panels laid out under it."""

    title: str
    panels: tuple[Panel, ...]


def row(title: str, *panels: Panel) -> Row:
    """A row of `panels`, in reading order."""
    return Row(title, panels)


def timeseries(title: str, description: str, *targets: Target, width: int, unit: str,
               stacked: bool = False) -> Panel:
    """Lines from 0 (stacked areas when `stacked`), capped at 1 for ratios, legend below."""
    defaults: dict[str, Any] = {
        "unit": unit, "min": 0, "color": {"mode": "palette-classic"},
        "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 25 if stacked else 10,
                   "showPoints": "never", "spanNulls": False,
                   "stacking": {"mode": "normal" if stacked else "none", "group": "A"}},
        "thresholds": _thresholds("green"),
    }
    if unit == RATIO:
        defaults["max"] = 1
    options = {"legend": _legend(show=True), "tooltip": {"mode": "multi", "sort": "none"}}
    return Panel("timeseries", title, description, width, defaults, options, targets,
                 instant=False)


def stat(title: str, description: str, *targets: Target, width: int, unit: str,
         decimals: int | None = None, sparkline: bool = False) -> Panel:
    """The last value of each target; with `sparkline` the targets are series drawn behind it,
    otherwise instant queries over the time range (`$__range`). Ratios show 0 to 1."""
    defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "thresholds"},
                                "thresholds": _thresholds("blue")}
    if decimals is not None:
        defaults["decimals"] = decimals
    if unit == RATIO:
        defaults |= {"min": 0, "max": 1}
    options = {"reduceOptions": LAST_VALUE, "colorMode": "value",
               "graphMode": "area" if sparkline else "none", "justifyMode": "auto",
               "orientation": "auto", "textMode": "auto", "wideLayout": True,
               "showPercentChange": False, "percentChangeColorMode": "standard"}
    return Panel("stat", title, description, width, defaults, options, targets,
                 instant=not sparkline)


def bargauge(title: str, description: str, target: Target, *, width: int) -> Panel:
    """Horizontal bars, one per series of an instant count query (whole numbers from 0)."""
    defaults = {"unit": "short", "decimals": 0, "min": 0, "color": {"mode": "palette-classic"},
                "thresholds": _thresholds("green")}
    options = {
        "reduceOptions": LAST_VALUE, "orientation": "horizontal", "displayMode": "basic",
        "showUnfilled": True, "valueMode": "color", "namePlacement": "auto", "sizing": "auto",
        "minVizWidth": 8, "minVizHeight": 16, "maxVizHeight": 300, "legend": _legend(show=False),
    }
    return Panel("bargauge", title, description, width, defaults, options, (target,),
                 instant=True)


def _thresholds(color: str) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": None}]}


def _legend(*, show: bool) -> dict[str, Any]:
    return {"displayMode": "list", "placement": "bottom", "showLegend": show, "calcs": []}


# -- PromQL -----------------------------------------------------------------------------------


def _quantile(q: float, histogram: str, by: str = "") -> str:
    labels = f"{by}, le" if by else "le"
    return (f"histogram_quantile({q}, sum by ({labels}) "
            f"(rate({histogram}_bucket[$__rate_interval])))")


def _of_job(aggregation: str, metric: str) -> str:
    """`metric` of the selected job, one series per (job_namespace, training_job)."""
    return f"{aggregation} by (job_namespace, training_job) ({metric}{OF_JOB})"


def _in_range(counter: str, selector: str = "") -> str:
    return f"sum(increase({counter}{selector}[$__range]))"


def _on_job_pods(gpu_metric: str, scale: str = "") -> str:
    """A dcgm-exporter gauge, kept for the GPUs of the job's trainer pods only: joined on the
    target labels (namespace, pod) of the trainer's own series, which also brings in its
    `training_job` label."""
    return (f"{gpu_metric}{GPU_IN_NAMESPACE}{scale} * on(namespace, pod) "
            f"group_left(training_job) "
            f"group by (namespace, pod, training_job) ({PROGRESS}{OF_JOB})")


# -- the dashboard ----------------------------------------------------------------------------

ROWS = (
    row(
        "Fleet",
        timeseries("Jobs by phase", f"TrainingJobs in each phase, as the operator last wrote "
                   f"them ({JOBS}).",
                   Target(f"sum by (phase) ({JOBS}{IN_NAMESPACE})", "{{phase}}"),
                   width=8, unit="short", stacked=True),
        timeseries("Queue wait", f"Seconds from Queued to the trainer pod's creation, p50 and "
                   f"p95 ({QUEUE_WAIT}).",
                   Target(_quantile(0.5, QUEUE_WAIT), "p50"),
                   Target(_quantile(0.95, QUEUE_WAIT), "p95"), width=8, unit="s"),
        timeseries("Placement solve time", f"Wall seconds of one (re)plan by solver, p50 and "
                   f"p95 ({PLACEMENT_SOLVE}).",
                   Target(_quantile(0.5, PLACEMENT_SOLVE, by="solver"), "p50 {{solver}}"),
                   Target(_quantile(0.95, PLACEMENT_SOLVE, by="solver"), "p95 {{solver}}"),
                   width=8, unit="s"),
        stat("Warm-start hit rate", f"Share of admitted jobs that warm-started from a zoo "
             f"parent (outcomes warm and pinned) in the time range ({WARM_STARTS}).",
             Target(f"{_in_range(WARM_STARTS, WARM_OR_PINNED)} / "
                    f"({_in_range(WARM_STARTS)} > 0)", "hit rate"),
             width=4, unit=RATIO, decimals=0),
        stat("Mean parent similarity", f"Mean architectural similarity of the parents jobs "
             f"warm-started from in the time range ({WARM_START_SIMILARITY}).",
             Target(f"{_in_range(WARM_START_SIMILARITY + '_sum')} / "
                    f"({_in_range(WARM_START_SIMILARITY + '_count')} > 0)", "similarity"),
             width=4, unit=RATIO, decimals=0),
        bargauge("Warm-start decisions in range", f"Warm-start decisions per outcome in the "
                 f"time range ({WARM_STARTS}): warm and pinned start from a parent; cold_* say "
                 f"why none was used; zoo_unavailable: the zoo stayed unreachable.",
                 Target(f"sum by (outcome) (increase({WARM_STARTS}[$__range])) > 0",
                        "{{outcome}}"), width=8),
        stat("Failures in range", f"Jobs that failed ({JOBS_FINISHED}{{result=\"failed\"}}), "
             f"trainer restarts after retryable exits ({JOB_RESTARTS}) and operator handler "
             f"errors ({RECONCILE_ERRORS}) in the time range.",
             Target(_in_range(JOBS_FINISHED, '{result="failed", job_namespace=~"$namespace"}'),
                    "failed jobs"),
             Target(_in_range(JOB_RESTARTS, IN_NAMESPACE), "restarts"),
             Target(_in_range(RECONCILE_ERRORS), "reconcile errors"),
             width=8, unit="short", decimals=0),
    ),
    row(
        "Sweeps",
        timeseries("Sweep trials by state", f"Each TrainingSweep's trials: Running, Succeeded, "
                   f"Pruned (stopped early, behind the others) and Failed ({SWEEP_TRIALS}).",
                   Target(f"sum by (sweep, state) ({SWEEP_TRIALS}{IN_NAMESPACE})",
                          "{{sweep}} {{state}}"), width=12, unit="short", stacked=True),
        timeseries("Best metric per sweep", f"Each sweep's best trial's objective over time, "
                   f"in its spec.objective.metric ({SWEEP_BEST}).",
                   Target(f"max by (job_namespace, sweep) ({SWEEP_BEST}{IN_NAMESPACE})",
                          "{{sweep}}"), width=12, unit="none"),
    ),
    row(
        "Job $job",
        timeseries("Loss", f"Mean training loss since the trainer's previous report "
                   f"({TRAIN_LOSS}) and validation cross-entropy in nats ({VALIDATION_LOSS}).",
                   Target(_of_job("avg", TRAIN_LOSS), "train"),
                   Target(_of_job("avg", VALIDATION_LOSS), "validation"),
                   width=12, unit="none"),
        timeseries("Validation accuracy", f"Validation accuracy in [0, 1] (token accuracy for "
                   f"language models; {VALIDATION_ACCURACY}).",
                   Target(_of_job("avg", VALIDATION_ACCURACY), "accuracy"),
                   width=12, unit=RATIO),
        timeseries("Training throughput", f"Samples per second: rate of {SAMPLES}, and the "
                   f"trainer's own measure over its last interval ({SAMPLES_PER_SECOND}).",
                   Target(f"sum by (job_namespace, training_job) (rate({SAMPLES}{OF_JOB}"
                          f"[$__rate_interval]))", "samples/s (rate)"),
                   Target(_of_job("sum", SAMPLES_PER_SECOND), "samples/s (reported)"),
                   width=12, unit="short"),
        stat("Progress", f"Share of the epoch budget done ({PROGRESS}).",
             Target(_of_job("max", PROGRESS), "progress"), width=4, unit=RATIO, decimals=0,
             sparkline=True),
        stat("ETA", f"Estimated time left for the remaining epochs ({ETA}).",
             Target(_of_job("min", ETA), "eta"), width=4, unit="s", sparkline=True),
        stat("Epochs done", f"Epochs completed ({EPOCH}).", Target(_of_job("max", EPOCH), "epoch"),
             width=4, unit="none", decimals=0, sparkline=True),
        timeseries("Frozen modules", f"Front modules frozen by Egeria-style layer freezing "
                   f"({FROZEN_MODULES}).", Target(_of_job("max", FROZEN_MODULES), "frozen modules"),
                   width=12, unit="none"),
        timeseries("Freezing savings", f"Share of parameters frozen ({FROZEN_PARAMETERS}) and "
                   f"of backward FLOPs a step skips ({BACKWARD_FLOPS_SKIPPED}).",
                   Target(_of_job("max", FROZEN_PARAMETERS), "parameters frozen"),
                   Target(_of_job("max", BACKWARD_FLOPS_SKIPPED), "backward FLOPs skipped"),
                   width=12, unit=RATIO),
    ),
    row(
        "GPUs of $job",
        timeseries("GPU busy", f"Per GPU of the job's trainer pods (DCGM exporter, joined on "
                   f"namespace and pod): utilization ({GPU_UTIL} / 100; not for MIG) and "
                   f"graphics engine active ({GR_ENGINE_ACTIVE}; also for MIG).",
                   Target(_on_job_pods(GPU_UTIL, " / 100"), "{{pod}} GPU {{gpu}} utilization"),
                   Target(_on_job_pods(GR_ENGINE_ACTIVE), "{{pod}} GPU {{gpu}} engine active"),
                   width=6, unit=RATIO),
        timeseries("GPU memory used", f"Framebuffer used per GPU of the job's trainer pods, "
                   f"MiB ({FB_USED}).",
                   Target(_on_job_pods(FB_USED), "{{pod}} GPU {{gpu}}"),
                   width=6, unit="mbytes"),
        timeseries("GPU power", f"Power draw per GPU of the job's trainer pods, watts "
                   f"({POWER_USAGE}).",
                   Target(_on_job_pods(POWER_USAGE), "{{pod}} GPU {{gpu}}"),
                   width=6, unit="watt"),
        timeseries("GPU temperature", f"Temperature per GPU of the job's trainer pods, degrees "
                   f"Celsius ({GPU_TEMP}).",
                   Target(_on_job_pods(GPU_TEMP), "{{pod}} GPU {{gpu}}"),
                   width=6, unit="celsius"),
    ),
)

def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model, `ROWS` laid out and numbered. A fresh tree (no
    dict shared between two places, as `DATASOURCE` is in the description), so callers may edit
    it."""
    dashboard = {
        "uid": "kiln-training", "title": "Kiln training",
        "description": "Kiln operator fleet, sweeps, one TrainingJob's training curves and "
        "freezing, "
        "and its GPUs (DCGM exporter). Metrics: kiln_* (operator), kiln_trainer_* (trainer pods), "
        "DCGM_FI_* (dcgm-exporter, scraped with honor_labels). Generated from "
        "operator/kiln/dashboard.py by `kiln dashboard`; do not edit.",
        "tags": ["kiln", "training", "gpu"], "timezone": "browser", "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "fiscalYearStartMonth": 0, "liveNow": False, "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION, "version": 1, "time": {"from": "now-6h", "to": "now"},
        "timepicker": {}, "links": [],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "regex": "", "hide": 0, "skipUrlSync": False,
             "includeAll": False, "multi": False, "refresh": 1, "options": []},
            _query_variable("namespace", "Namespace",
                            f"label_values({JOBS}, job_namespace)", multi=True),
            _query_variable("job", "TrainingJob",
                            f"label_values({PROGRESS}{IN_NAMESPACE}, training_job)",
                            multi=False),
        ]},
        "panels": layout(ROWS),
    }
    fresh: dict[str, Any] = json.loads(json.dumps(dashboard))
    return fresh


def _query_variable(name: str, label: str, query: str, *, multi: bool) -> dict[str, Any]:
    """A `label_values` variable, refreshed on time-range change, sorted; `multi` also offers
    All (as the regex `.*`)."""
    variable: dict[str, Any] = {
        "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
        "query": {"qryType": 1, "query": query,
                  "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2, "sort": 1, "regex": "", "hide": 0, "skipUrlSync": False,
        "includeAll": multi, "multi": multi, "options": [],
    }
    if multi:
        variable["allValue"] = ".*"
    return variable


def layout(rows: Iterable[Row]) -> list[dict[str, Any]]:
    """Grafana panels for `rows`: ids 1, 2, ... in order; each row header spans the grid, and
    its panels fill lines of `GRID_COLUMNS` left to right, wrapping when the next does not fit.

    Raises:
        ValueError: a panel is wider than the grid.
    """
    found: list[dict[str, Any]] = []
    y = 0
    for a_row in rows:
        found.append({"id": len(found) + 1, "type": "row", "title": a_row.title,
                      "collapsed": False, "datasource": DATASOURCE,
                      "gridPos": _grid(GRID_COLUMNS, 1, x=0, y=y), "panels": []})
        y, x = y + 1, 0
        for panel in a_row.panels:
            if not 1 <= panel.width <= GRID_COLUMNS:
                raise ValueError(f'panel "{panel.title}": width {panel.width} is not in '
                                 f"1..{GRID_COLUMNS}")
            if x + panel.width > GRID_COLUMNS:
                y, x = y + PANEL_HEIGHT, 0
            grid = _grid(panel.width, PANEL_HEIGHT, x=x, y=y)
            found.append(_panel(panel, len(found) + 1, grid))
            x += panel.width
        if a_row.panels:
            y += PANEL_HEIGHT
    return found


def _grid(w: int, h: int, *, x: int, y: int) -> dict[str, int]:
    return {"h": h, "w": w, "x": x, "y": y}


def _panel(panel: Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    targets = [
        {"datasource": DATASOURCE, "refId": chr(ord("A") + i), "expr": target.expr,
         "legendFormat": target.legend, "editorMode": "code", "instant": panel.instant,
         "range": not panel.instant}
        for i, target in enumerate(panel.targets)
    ]
    return {"id": panel_id, "type": panel.kind, "title": panel.title,
            "description": panel.description, "datasource": DATASOURCE, "gridPos": grid,
            "fieldConfig": {"defaults": panel.field_defaults, "overrides": []},
            "options": panel.options, "targets": targets}


def render() -> str:
    """The dashboard as JSON text (2-space indent, trailing newline); same input, same bytes."""
    return json.dumps(build(), indent=2) + "\n"
