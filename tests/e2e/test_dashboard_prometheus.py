"""Every query of the Grafana dashboard (helm/kiln/dashboards/kiln.json) returns data.

A real Prometheus scrapes the operator, a trainer pod and a fake DCGM exporter while real jobs
fill every fleet series; every PromQL expression of the dashboard must parse and return data.
"""

# Its Grafana schema, layout and variables are checked in tests/unit/test_dashboard.py.
#
# On the session's simulated cluster and real operator: a real Prometheus (Debian's binary,
# `kubesim.prometheus`) scrapes the operator's /metrics, the trainer pod (at the host port the
# test kubelet mapped) and a DCGM exporter, each with the target labels the Prometheus Operator
# attaches (namespace, pod, container, endpoint, job, instance, service) and ``honor_labels``
# as the chart's ServiceMonitor and PodMonitor (off) and dcgm-exporter's (on) set it: a Kiln
# label clashing with a target label is renamed ``exported_*`` here as in a cluster, and no
# query finds it. Real jobs fill every
# fleet series: a parent that succeeds and registers in the zoo, a child that warm-starts from it
# and keeps training, and a job whose trainer is OOM-killed twice (one restart, then
# BackoffLimitExceeded). Every PromQL expression in the dashboard (panel targets, and the
# selector inside each variable's ``label_values``), with $namespace, $job, $__rate_interval and
# $__range filled in, must parse and return data; a few also must show the right thing (hit rate
# and similarity in (0, 1], the failure and restart counted, the GPU rows joined to the trainer
# pod only), and no kiln series carries an ``exported_*`` label.
#
# No GPU runs here: `FakeDcgmExporter` serves dcgm-exporter's DCGM_FI_* gauges with the labels
# it attaches through the kubelet's pod-resources API (gpu, UUID, device, modelName, Hostname,
# container, namespace, pod) for two GPUs of the real trainer pod, one GPU of another pod, and
# one idle GPU; the GPU row's ``on(namespace, pod) group_left(job)`` join must keep the
# trainer's two only.
#
# The operator runs outside the simulated cluster; its target labels name the pod a Helm
# install would run (`OPERATOR_POD`).

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grafana_model  # tests/ is on sys.path (pytest pythonpath)
import pytest
from kubesim import client, emulator, kubelet, operator_process, prometheus, scenario

from kiln import api
from kiln.controller import status
from kiln.zoo import records

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "kiln" / "dashboards" / "kiln.json"
# What Grafana would put in: a rate window holding several 1 s scrapes, and a time range
# reaching back before the test's first job.
FILLED_IN = {"__rate_interval": "30s", "__range": "10m"}
QUERIES_SECONDS = 120.0
OPERATOR_NAMESPACE = "kiln-system"
OPERATOR_POD = "kiln-7c9d8f6b5-q2x8m"
PARENT, FLAKY, CHILD = "dash-parent", "dash-flaky", "dash-child"
SWEEP = "dash-sweep"  # one trial: the sweep panels' series
# What the fake dcgm-exporter reports for every GPU (percent, ratio, MiB, watts, Celsius).
DCGM_VALUES = {"DCGM_FI_DEV_GPU_UTIL": 87.0, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.83,
               "DCGM_FI_DEV_FB_USED": 30512.0, "DCGM_FI_DEV_POWER_USAGE": 412.5,
               "DCGM_FI_DEV_GPU_TEMP": 61.0}


def _load() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


class FakeDcgmExporter:
    """dcgm-exporter's /metrics without a GPU (module docstring): `pods` get two GPUs each."""

    def __init__(self) -> None:
        self.pods: list[tuple[str, str]] = []  # (namespace, pod) with GPUs allocated
        self.server = client.serve_text(lambda _path: (200, self.exposition().encode()),
                                        name="fake-dcgm-exporter")
        self.address = f"127.0.0.1:{self.server.server_address[1]}"

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
        owners = sorted((s["metric"].get("pod"), s["metric"].get("training_job"))
                        for s in result)
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
        "variable namespace": includes(namespace, "job_namespace"),
        "variable job": includes(CHILD, "training_job"),
    }
    for title in ("GPU busy", "GPU memory used", "GPU power", "GPU temperature"):
        for ref in ("A", "B"):
            checks[f'panel "{title}" target {ref}'] = joined_to_trainer
    return checks


def _problems(server: prometheus.Prometheus, queries: list[grafana_model.Query],
              values: dict[str, str],
              checks: dict[str, Check]) -> list[str]:
    """Queries without the data they should show; a query Prometheus rejects fails at once."""
    problems = []
    for query in queries:
        expr = grafana_model.fill_in(query.expr, values)
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
        prometheus.ScrapeJob("kiln-trainers"),
        prometheus.ScrapeJob("dcgm-exporter", honor_labels=True)])
    try:
        server.start()
    except prometheus.PrometheusMissing as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.fixture
def dcgm() -> Iterator[FakeDcgmExporter]:
    exporter = FakeDcgmExporter()
    yield exporter
    exporter.stop()


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, zoo: scenario.Zoo, namespace: str,
    prometheus_server: prometheus.Prometheus, dcgm: FakeDcgmExporter,
) -> None:
    server = prometheus_server
    server.set_targets("kiln-operator", [prometheus.service_monitor_target(
        f"127.0.0.1:{operator.metrics_port}", namespace=OPERATOR_NAMESPACE, pod=OPERATOR_POD,
        service="kiln", endpoint="metrics", container="operator")])
    # A real dcgm-exporter's ServiceMonitor adds the exporter's own pod and namespace:
    # honor_labels keeps the ones naming the GPU's workload.
    server.set_targets("dcgm-exporter", [prometheus.service_monitor_target(
        dcgm.address, namespace="gpu-operator", pod="nvidia-dcgm-exporter-x7k2p",
        service="nvidia-dcgm-exporter", endpoint="gpu-metrics",
        container="nvidia-dcgm-exporter")])

    cluster.client.create_job(namespace, scenario.tiny_job(PARENT))
    cluster.client.create(_sweeps_path(namespace), _one_trial_sweep(namespace))
    # The namespace's failure and restart counters exist at 0 from its first job on; once
    # Prometheus has seen them, increase() counts the failure to come.
    client.wait_until(lambda: server.query(
        f'kiln_job_restarts_total{{job_namespace="{namespace}"}} == 0')["data"]["result"],
        timeout_seconds=60, what="Prometheus to scrape the namespace's restart counter",
        poll_seconds=0.5, details=server.log_tail)
    node_kubelet.inject(kubelet.Fault(job=FLAKY, signal=signal.SIGKILL,
                                      container_reason="OOMKilled", check_every_seconds=0.0))
    cluster.client.create_job(namespace, scenario.tiny_job(FLAKY, run_policy={"backoffLimit": 1}))
    scenario.wait_phase(cluster, namespace, PARENT, "Succeeded", details=operator.log_tail)
    # It never ends: it outlasts the checks, and is deleted at the end.
    cluster.client.create_job(namespace, scenario.tiny_job(
        CHILD, width=12, epochs=scenario.ENDLESS_EPOCHS, max_samples=None))
    try:
        failed = scenario.wait_phase(cluster, namespace, FLAKY, "Failed",
                                     details=operator.log_tail)
        assert scenario.condition(failed, "Failed")["reason"] == "BackoffLimitExceeded"
        child = scenario.wait_phase(cluster, namespace, CHILD, "Running",
                                    details=operator.log_tail)
        assert child["status"]["warmStart"].get("parent"), child["status"]["warmStart"]
        # The operator reads the same endpoint into status.progress and stamps the read, which
        # `kubectl get tj -o wide` shows as its age.
        read = scenario.wait_job(cluster, namespace, CHILD, lambda job: bool(
            (job["status"].get("progress") or {}).get("lastUpdatedTime")),
            what=f"{CHILD}'s progress to be read", details=operator.log_tail)
        assert status.parse_rfc3339(read["status"]["progress"]["lastUpdatedTime"]) is not None
        pod = client.wait_until(lambda: _running_pod(cluster, namespace, CHILD),
                                timeout_seconds=60, what=f"{CHILD}'s pod to run")
        port = pod["metadata"]["annotations"]["prometheus.io/port"]
        pod_name = pod["metadata"]["name"]
        server.set_targets("kiln-trainers", [prometheus.pod_monitor_target(
            f"127.0.0.1:{port}", namespace=namespace, pod=pod_name,
            monitor=f"{OPERATOR_NAMESPACE}/kiln-trainers", endpoint="metrics",
            container="trainer")])
        dcgm.pods = [(namespace, pod_name), (namespace, "other-job-trainer-0")]

        queries = grafana_model.queries(_load())
        values = {**FILLED_IN, "namespace": namespace, "job": CHILD}
        checks = _content_checks(namespace, pod_name)
        last: list[str] = []

        def all_answered() -> bool:
            last[:] = _problems(server, queries, values, checks)
            return not last

        client.wait_until(all_answered, timeout_seconds=QUERIES_SECONDS, poll_seconds=1.0,
                          what="every dashboard query to return data",
                          details=lambda: "\n".join(last) + "\n" + server.log_tail())
        renamed = {(s["metric"]["__name__"], label)
                   for s in server.query('{__name__=~"kiln_.+"}')["data"]["result"]
                   for label in s["metric"] if label.startswith("exported_")}
        assert not renamed, f"labels a scrape renamed: {sorted(renamed)}"
    finally:
        cluster.client.delete(f"{_sweeps_path(namespace)}/{SWEEP}")
        cluster.client.delete(cluster.client.jobs_path(namespace, f"{SWEEP}-t0"))  # no GC here
        cluster.client.delete(cluster.client.jobs_path(namespace, CHILD))
        client.wait_until(lambda: cluster.client.job(namespace, CHILD) is None,
                          timeout_seconds=60, what=f"{CHILD} to be deleted",
                          details=operator.log_tail)
        # Later tests of the session expect their first job to find no parent.
        for record in records.list_records(zoo.store):
            if record.job_name in (PARENT, CHILD):
                records.delete_record(zoo.store, record.id)


def _sweeps_path(namespace: str) -> str:
    return f"/apis/{api.API_VERSION}/namespaces/{namespace}/{api.sweep.SWEEP_PLURAL}"


def _one_trial_sweep(namespace: str) -> dict[str, Any]:
    """A sweep of one tiny trial that registers nothing: its trial counts and, once the trial
    has succeeded, its best metric."""
    template = scenario.tiny_job(SWEEP)["spec"]
    template["zoo"] = {"register": False}
    return {"apiVersion": api.API_VERSION, "kind": api.sweep.SWEEP_KIND,
            "metadata": {"name": SWEEP, "namespace": namespace},
            "spec": {"template": template, "maxTrials": 1, "parallelTrials": 1,
                     "warmStart": "independent",
                     "parameters": [{"path": "training.optimizer.lr", "categorical": [0.005]}]}}


def _running_pod(cluster: emulator.Emulator, namespace: str, job: str) -> dict[str, Any] | None:
    for pod in cluster.client.pods(namespace, job):
        annotations = pod["metadata"].get("annotations") or {}
        if (pod.get("status") or {}).get("phase") == "Running" and (
                annotations.get("prometheus.io/port")):
            return pod
    return None
