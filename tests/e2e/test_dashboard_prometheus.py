"""The Grafana dashboard (helm/kiln/dashboards/kiln.json): well-formed, and every query has data.

Static checks first:

* it is valid for Grafana's typed dashboard model of the release whose ``schemaVersion`` it
  declares (`grafana_model`: ``grafana-foundation-sdk`` 11.6, generated from Grafana 11.6's
  schema, schemaVersion 41): no key is lost on a round trip (an unknown or misspelt field
  would be), every value has the declared type or enum value, every non-optional field is
  present, and every panel type is one Grafana ships;
* the rules a reviewer checks by eye: unique panel ids, panels inside the 24-column grid and
  not overlapping, each target with a refId and an expr, every panel, target and query
  variable on the ``${datasource}`` variable, a unit on every panel, every ``$variable`` an
  expression uses defined, every metric it names exported by the operator, the trainer or
  dcgm-exporter.

Then the end-to-end check, on the session's simulated cluster and real operator: a real
Prometheus (Debian's binary, `kubesim.prometheus`) scrapes the operator's /metrics, the
trainer pod (at the host port the test kubelet mapped, with the ``pod`` and ``namespace``
target labels a PodMonitor adds, and ``honor_labels`` as the chart's PodMonitor sets) and a
DCGM exporter. Real jobs fill every fleet series: a parent that succeeds and registers in the
zoo, a child that warm-starts from it and keeps training, and a job whose trainer is
OOM-killed twice (one restart, then BackoffLimitExceeded). Every PromQL expression in the
dashboard (panel targets, and the selector inside each variable's ``label_values``), with
$namespace, $job, $__rate_interval and $__range filled in, must parse and return data; a few
also must show the right thing (hit rate and similarity in (0, 1], the failure and restart
counted, the GPU rows joined to the trainer pod only).

No GPU runs here: `FakeDcgmExporter` serves dcgm-exporter's DCGM_FI_* gauges with the labels
it attaches through the kubelet's pod-resources API (gpu, UUID, device, modelName, Hostname,
container, namespace, pod) for two GPUs of the real trainer pod, one GPU of another pod, and
one idle GPU; the GPU row's ``on(namespace, pod) group_left(job)`` join must keep the
trainer's two only.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import re
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grafana_model  # tests/ is on sys.path (pytest pythonpath)
import pytest
from kubesim import client, emulator, kubelet, operator_process, prometheus, scenario

from kiln.controller import metrics as operator_metrics
from kiln.zoo import records
from kiln_trainer import metrics as trainer_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "kiln" / "dashboards" / "kiln.json"
GRID_COLUMNS = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_BUILTINS = {"__rate_interval", "__range", "__interval"}
# What Grafana would put in: a rate window holding several 1 s scrapes, and a time range
# reaching back before the test's first job.
FILLED_IN = {"__rate_interval": "30s", "__range": "10m"}
QUERIES_SECONDS = 120.0
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
METRIC = re.compile(r"\b(kiln_\w+|DCGM_FI_\w+)\b")
PARENT, FLAKY, CHILD = "dash-parent", "dash-flaky", "dash-child"
# What the fake dcgm-exporter reports for every GPU (percent, ratio, MiB, watts, Celsius).
DCGM_VALUES = {"DCGM_FI_DEV_GPU_UTIL": 87.0, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.83,
               "DCGM_FI_DEV_FB_USED": 30512.0, "DCGM_FI_DEV_POWER_USAGE": 412.5,
               "DCGM_FI_DEV_GPU_TEMP": 61.0}


def _load() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


# -- the dashboard's parts ---------------------------------------------------------------------


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows included, with a collapsed row's own panels after it."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels") or [])
    return found


@dataclasses.dataclass(frozen=True)
class Query:
    """One PromQL expression of the dashboard and where it is.

    Attributes:
        where: ``panel "<title>" target <refId>`` or ``variable <name>``.
        expr: the expression as written (variables not filled in).
        label: for a ``label_values(selector, label)`` variable, the label (expr is the
            selector).
    """

    where: str
    expr: str
    label: str | None = None


def _queries(dashboard: dict[str, Any]) -> list[Query]:
    found = []
    for panel in _panels(dashboard):
        for target in panel.get("targets") or []:
            found.append(Query(f'panel "{panel["title"]}" target {target.get("refId")}',
                               target.get("expr", "")))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = LABEL_VALUES.match(text)
        assert match, f"variable {variable['name']}: only label_values(selector, label) is used"
        found.append(Query(f"variable {variable['name']}", match["selector"], match["label"]))
    return found


def _panel_types(dashboard: dict[str, Any]) -> set[str]:
    return {str(panel["type"]) for panel in _panels(dashboard)}


def _fill_in(expr: str, values: dict[str, str]) -> str:
    return VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], expr)


def _exported_metrics() -> set[str]:
    """Sample names the operator's and a trainer's registries expose."""
    names = set()
    registries = [operator_metrics.OperatorMetrics().registry,
                  trainer_metrics.MetricsReporter(job="j").registry]
    for registry in registries:
        for family in registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(
                family.type, [""])
            names |= {family.name + suffix for suffix in suffixes}
    return names


def test_the_dashboard_is_valid_for_the_grafana_schema_version_it_declares() -> None:
    raw = _load()
    assert raw["schemaVersion"] == grafana_model.SCHEMA_VERSION, (
        "the dashboard declares another schemaVersion than grafana-foundation-sdk's release "
        "models; pin the SDK release matching it in pyproject.toml")
    assert grafana_model.problems(raw) == []
    assert grafana_model.unknown_panel_types(_panel_types(raw)) == set()


def test_the_model_check_catches_misspelt_fields_wrong_types_and_unknown_panels() -> None:
    raw = _load()
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
    assert grafana_model.unknown_panel_types(_panel_types(raw)) == {"timeseriess"}


def test_the_dashboard_layout_datasources_variables_and_metrics_are_consistent() -> None:
    raw = _load()
    panels = _panels(raw)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        where, grid = f'panel "{panel["title"]}"', panel["gridPos"]
        assert 0 <= grid["x"] and 1 <= grid["w"] and grid["x"] + grid["w"] <= GRID_COLUMNS, where
        assert grid["y"] >= 0 and grid["h"] >= 1, where
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{where} overlaps {cells[x, y]}"
                cells[x, y] = where
        assert panel.get("datasource") == DATASOURCE, where
        if panel["type"] == "row":
            continue
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{where} has no unit"
        refs = [target.get("refId") for target in panel.get("targets") or []]
        assert refs and all(refs) and len(refs) == len(set(refs)), f"{where}: refIds {refs}"
        for target in panel["targets"]:
            assert target.get("expr"), f"{where} target {target['refId']} has no expr"
            assert target.get("datasource") == DATASOURCE, f"{where} target {target['refId']}"
    variables = {v["name"]: v for v in raw["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, variable["name"]
    exported, dcgm = _exported_metrics(), set(DCGM_VALUES)
    for query in _queries(raw):
        used = {a or b for a, b in VARIABLE.findall(query.expr)}
        assert used <= set(variables) | GRAFANA_BUILTINS, f"{query.where}: {used}"
        for name in METRIC.findall(query.expr):
            assert name in exported | dcgm, f"{query.where}: no exporter has {name}"
    titles = " ".join(str(panel["title"]) for panel in panels)
    for name in VARIABLE.findall(titles):
        assert (name[0] or name[1]) in variables, name


# -- the end-to-end check ---------------------------------------------------------------------


class FakeDcgmExporter:
    """dcgm-exporter's /metrics without a GPU (module docstring): `pods` get two GPUs each."""

    def __init__(self) -> None:
        self.pods: list[tuple[str, str]] = []  # (namespace, pod) with GPUs allocated
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                body = exporter.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FakeDcgmExporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def exposition(self) -> str:
        gpus: list[dict[str, str]] = []
        for namespace, pod in self.pods:
            gpus += [{"namespace": namespace, "pod": pod, "container": "trainer"}] * 2
        gpus.append({})  # an idle GPU: dcgm-exporter leaves the pod labels out
        lines = []
        for name, value in DCGM_VALUES.items():
            lines.append(f"# TYPE {name} gauge")
            for index, owner in enumerate(gpus):
                labels = {"gpu": str(index), "UUID": f"GPU-0000000{index}-kiln-test",
                          "device": f"nvidia{index}", "modelName": "NVIDIA H100 80GB HBM3",
                          "Hostname": "cpu-node-1", **owner}
                text = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"{name}{{{text}}} {value}")
        return "\n".join(lines) + "\n"


Check = Callable[[list[dict[str, Any]]], str | None]


def _scalar(check: Callable[[float], bool], wanted: str) -> Check:
    def run(result: list[dict[str, Any]]) -> str | None:
        value = float(result[0]["value"][1])
        return None if check(value) else f"{value} is not {wanted}"
    return run


def _content_checks(namespace: str, pod: str) -> dict[str, Check]:
    """What some queries must show, beyond returning data (keyed by `Query.where`)."""

    def joined_to_trainer(result: list[dict[str, Any]]) -> str | None:
        owners = sorted((s["metric"].get("pod"), s["metric"].get("job")) for s in result)
        return None if owners == [(pod, CHILD)] * 2 else f"series of {owners}"

    def includes(value: str, label: str) -> Check:
        def run(result: list[dict[str, Any]]) -> str | None:
            values = {s["metric"].get(label) for s in result}
            return None if value in values else f"{label} values {sorted(map(str, values))}"
        return run

    ratio = _scalar(lambda v: 0.0 < v <= 1.0, "in (0, 1]")
    checks = {
        'panel "Warm-start hit rate" target A': ratio,
        'panel "Mean parent similarity" target A': ratio,
        'panel "Warm-start decisions in range" target A': includes("warm", "outcome"),
        'panel "Failures in range" target A': _scalar(lambda v: v > 0, "> 0 (one failed)"),
        'panel "Failures in range" target B': _scalar(lambda v: v > 0, "> 0 (one restart)"),
        "variable namespace": includes(namespace, "namespace"),
        "variable job": includes(CHILD, "job"),
    }
    for title in ("GPU busy", "GPU memory used", "GPU power", "GPU temperature"):
        for ref in ("A", "B"):
            checks[f'panel "{title}" target {ref}'] = joined_to_trainer
    return checks


def _problems(server: prometheus.Prometheus, queries: list[Query], values: dict[str, str],
              checks: dict[str, Check]) -> list[str]:
    """Queries without the data they should show; a query Prometheus rejects fails at once."""
    problems = []
    for query in queries:
        expr = _fill_in(query.expr, values)
        answer = server.query(expr)
        if answer.get("status") != "success":
            pytest.fail(f"{query.where}: Prometheus rejects {expr!r}: {answer.get('error')}")
        result = answer["data"]["result"]
        check = checks.get(query.where)
        problem = "no data" if not result else check(result) if check else None
        if problem:
            problems.append(f"{query.where}: {expr}: {problem}")
    return problems


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[prometheus.Prometheus]:
    server = prometheus.Prometheus(tmp_path / "prometheus", jobs=[
        prometheus.ScrapeJob("kiln-operator"),
        prometheus.ScrapeJob("kiln-trainers", honor_labels=True),
        prometheus.ScrapeJob("dcgm-exporter", honor_labels=True)])
    try:
        server.start()
    except prometheus.PrometheusMissing as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.fixture
def dcgm() -> Iterator[FakeDcgmExporter]:
    exporter = FakeDcgmExporter().start()
    yield exporter
    exporter.stop()


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, zoo: scenario.Zoo, namespace: str,
    prometheus_server: prometheus.Prometheus, dcgm: FakeDcgmExporter,
) -> None:
    server = prometheus_server
    server.set_targets("kiln-operator", [prometheus.Target(f"127.0.0.1:{operator.metrics_port}")])
    # A real dcgm-exporter's ServiceMonitor adds the exporter's own pod and namespace:
    # honor_labels keeps the ones naming the GPU's workload.
    server.set_targets("dcgm-exporter", [prometheus.Target(dcgm.address, {
        "pod": "dcgm-exporter-x7k2p", "namespace": "gpu-operator"})])

    cluster.client.create_job(namespace, scenario.tiny_job(PARENT))
    # The namespace's failure and restart counters exist at 0 from its first job on; once
    # Prometheus has seen them, increase() counts the failure to come.
    client.wait_until(lambda: server.query(
        f'kiln_job_restarts_total{{namespace="{namespace}"}} == 0')["data"]["result"],
        timeout_seconds=60, what="Prometheus to scrape the namespace's restart counter",
        poll_seconds=0.5, details=server.log_tail)
    node_kubelet.inject(kubelet.Fault(job=FLAKY, signal=signal.SIGKILL,
                                      container_reason="OOMKilled", check_every_seconds=0.0))
    cluster.client.create_job(namespace, scenario.tiny_job(FLAKY, run_policy={"backoffLimit": 1}))
    scenario.wait_phase(cluster, namespace, PARENT, "Succeeded", details=operator.log_tail)
    # Enough epochs to outlast the checks: the job is deleted at the end.
    cluster.client.create_job(namespace, scenario.tiny_job(CHILD, width=12, epochs=400,
                                                           max_samples=None))
    try:
        failed = scenario.wait_phase(cluster, namespace, FLAKY, "Failed",
                                     details=operator.log_tail)
        assert scenario.condition(failed, "Failed")["reason"] == "BackoffLimitExceeded"
        child = scenario.wait_phase(cluster, namespace, CHILD, "Running",
                                    details=operator.log_tail)
        assert child["status"]["warmStart"].get("parent"), child["status"]["warmStart"]
        pod = client.wait_until(lambda: _running_pod(cluster, namespace, CHILD),
                                timeout_seconds=60, what=f"{CHILD}'s pod to run")
        port = pod["metadata"]["annotations"]["prometheus.io/port"]
        pod_name = pod["metadata"]["name"]
        server.set_targets("kiln-trainers", [prometheus.Target(
            f"127.0.0.1:{port}", {"pod": pod_name, "namespace": namespace})])
        dcgm.pods = [(namespace, pod_name), (namespace, "other-job-trainer-0")]

        queries = _queries(_load())
        values = {**FILLED_IN, "namespace": namespace, "job": CHILD}
        checks = _content_checks(namespace, pod_name)
        last: list[str] = []

        def all_answered() -> bool:
            last[:] = _problems(server, queries, values, checks)
            return not last

        client.wait_until(all_answered, timeout_seconds=QUERIES_SECONDS, poll_seconds=1.0,
                          what="every dashboard query to return data",
                          details=lambda: "\n".join(last) + "\n" + server.log_tail())
    finally:
        cluster.client.delete(cluster.client.jobs_path(namespace, CHILD))
        client.wait_until(lambda: cluster.client.job(namespace, CHILD) is None,
                          timeout_seconds=60, what=f"{CHILD} to be deleted",
                          details=operator.log_tail)
        # Later tests of the session expect their first job to find no parent.
        for record in records.list_records(zoo.store):
            if record.job_name in (PARENT, CHILD):
                records.delete_record(zoo.store, record.id)


def _running_pod(cluster: emulator.Emulator, namespace: str, job: str) -> dict[str, Any] | None:
    for pod in cluster.client.pods(namespace, job):
        annotations = pod["metadata"].get("annotations") or {}
        if (pod.get("status") or {}).get("phase") == "Running" and (
                annotations.get("prometheus.io/port")):
            return pod
    return None


def test_queries_fill_in_variables_and_read_label_values_selectors() -> None:
    queries = {q.where: q for q in _queries(_load())}
    job = queries["variable job"]
    assert (job.expr, job.label) == ('kiln_trainer_progress_ratio{namespace=~"$namespace"}',
                                     "job")
    assert _fill_in(job.expr, {"namespace": "team-a"}) == (
        'kiln_trainer_progress_ratio{namespace=~"team-a"}')
    assert _fill_in("rate(x[${__rate_interval}])", FILLED_IN) == "rate(x[30s])"
