"""The Helm chart (helm/kiln): lint, render, validate, and what the rendered objects say.

Real parts: ``helm lint`` and ``helm install`` are the Helm library
bundled by helm-sdkpy; install goes over HTTP to the kmock API emulator (`kubesim.helm`), so
the chart's CRD and every template reach an API server; each rendered object is validated
with kubernetes-validate (strict: unknown fields are errors) against Kubernetes' own OpenAPI
schemas. kubernetes-validate has no schemas for the Prometheus Operator's kinds, so the
ServiceMonitor and PodMonitor are checked field by field against what the operator and the
trainer pods really expose. What the emulator cannot check: admission (webhooks, quotas),
pod scheduling, image pulls.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubesim import helm

from kiln import api
from kiln.controller import main, pods

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds its module fixtures

REPO = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.30.0"  # the oldest release the chart's kubeVersion admits is 1.26
EVERYTHING_ON = {
    "minio": {"enabled": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "podMonitor": {"enabled": True},
    "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "Kiln"}},
    "operator": {"watchNamespaces": ["team-a", "team-b"],
                 "nodeSelector": {"kubernetes.io/os": "linux"},
                 "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                  "effect": "NoSchedule"}],
                 "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                     {"weight": 1, "preference": {"matchExpressions": [
                         {"key": "node-role", "operator": "In", "values": ["system"]}]}}]}},
                 "env": [{"name": "TZ", "value": "UTC"}],
                 "envFrom": [{"configMapRef": {"name": "kiln-operator-settings"}}],
                 "extraArgs": ["--zoo-query-timeout-seconds=30"]},
    "trainer": {"gpuType": "NVIDIA-A100-SXM4-80GB", "maxGpusPerJob": 4,
                "gpuResources": ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"]},
    "placement": {"useMilp": False, "timeLimitSeconds": 2.5},
    "image": {"pullSecrets": ["regcred"]},
}
EXISTING_ZOO = {"zoo": {"endpoint": "https://s3.example.com:9000", "bucket": "ml-zoo",
                        "prefix": "kiln/v1", "existingSecret": "zoo-creds",
                        "trainerSecret": "zoo-creds-trainers"}}


@pytest.fixture(scope="module")
def default_release() -> helm.Release:
    return helm.install()


@pytest.fixture(scope="module")
def full_release() -> helm.Release:
    return helm.install(EVERYTHING_ON)


@pytest.fixture(scope="module")
def existing_zoo_release() -> helm.Release:
    return helm.install(EXISTING_ZOO)


def _container(release: helm.Release) -> dict[str, Any]:
    deployment = release.one("Deployment", "kiln")
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


def _operator_options(release: helm.Release) -> Any:
    """The operator's settings as `kiln operator` parses the Deployment's arguments."""
    args = _container(release)["args"]
    assert args[0] == "operator"  # the image's entrypoint is `kiln`
    return main.options_from_args(main.build_parser().parse_args(args[1:]))


def test_helm_lint_finds_no_warning_or_error() -> None:
    """Severity 1 is INFO (Helm's "icon is recommended": the project has no icon yet)."""
    result = helm.lint()
    assert not result.get("Errors"), result
    assert [m for m in result.get("Messages") or [] if m["Severity"] >= 2] == [], result


def test_helm_lint_catches_a_broken_template(tmp_path: Path) -> None:
    broken = tmp_path / "kiln"
    shutil.copytree(helm.CHART, broken)
    (broken / "templates" / "service.yaml").write_text("kind: Service\n  {{ .Values.nope \n")
    result = helm.lint(broken)
    assert result.get("Errors") or any(m["Severity"] >= 3 for m in result["Messages"] or []), (
        result)


@pytest.mark.parametrize("crd_file", ["trainingjob.yaml", "trainingsweep.yaml",
                                      "trainingruntime.yaml", "clustertrainingruntime.yaml"])
def test_chart_crd_is_the_repository_crd(crd_file: str) -> None:
    assert ((helm.CHART / "crds" / crd_file).read_bytes()
            == (REPO / "crds" / crd_file).read_bytes()), (
        f"helm/kiln/crds/{crd_file} differs from crds/{crd_file}: regenerate both "
        "(`kiln crd --write` in the repository root)")


@pytest.mark.parametrize("name", ["default_release", "full_release", "existing_zoo_release"])
def test_every_rendered_object_is_valid_kubernetes_and_reaches_the_api_server(
        name: str, request: pytest.FixtureRequest) -> None:
    release: helm.Release = request.getfixturevalue(name)
    for document in release.crds + release.manifests:
        if document["apiVersion"] == api.API_VERSION:  # Kiln's own kinds, checked by kiln.api
            api.runtime.parse_runtime(document)
        elif document["apiVersion"].startswith("monitoring.coreos.com/"):
            pass  # no schema in kubernetes-validate: see the monitor tests below
        else:
            _kubernetes_valid(document)
        key = (f"{document['apiVersion']}/{document['kind']}",
               document["metadata"].get("namespace", ""), document["metadata"]["name"])
        assert key in release.created, f"Helm did not create {key}"


def _kubernetes_valid(document: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{document['kind']} {document['metadata']['name']}: {exc.message} "
                    f"at {'/'.join(map(str, exc.path))}")


def test_default_runtime_renders_valid_and_carries_the_trainer_image(
        default_release: helm.Release, tmp_path: Path) -> None:
    document = default_release.one("ClusterTrainingRuntime", "default")
    runtime = api.runtime.parse_runtime(document)
    values = yaml.safe_load((helm.CHART / "values.yaml").read_text(encoding="utf-8"))
    assert runtime.spec.template == {"image": values["trainer"]["image"],
                                     "imagePullPolicy": values["trainer"]["imagePullPolicy"]}
    # A job naming it validates on it, as `kiln validate --runtime` checks it.
    job = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "on-default"},
           "spec": {"runtimeRef": {"name": "default"},
                    "model": {"architecture": "small_resnet", "inputShape": [1, 8, 8]}}}
    assert api.runtime.parse_job_on(job, api.runtime.record(runtime)).name == "on-default"


def test_runtime_values_set_the_template_and_what_is_locked() -> None:
    release = helm.install({"runtime": {
        "name": "gpu-team", "locked": ["podSecurityContext"],
        "template": {"podSecurityContext": {"runAsNonRoot": True},
                     "env": [{"name": "HF_HOME", "value": "/cache"}]}}})
    runtime = api.runtime.parse_runtime(release.one("ClusterTrainingRuntime", "gpu-team"))
    assert runtime.spec.locked == ["podSecurityContext"]
    assert runtime.spec.template["env"] == [{"name": "HF_HOME", "value": "/cache"}]
    job = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "mine"},
           "spec": {"runtimeRef": {"name": "gpu-team"},
                    "model": {"architecture": "small_resnet", "inputShape": [1, 8, 8]},
                    "template": {"podSecurityContext": {"runAsUser": 0}}}}
    with pytest.raises(api.InvalidSpec) as caught:
        api.runtime.parse_job_on(job, api.runtime.record(runtime))
    assert caught.value.problems == [
        ("spec.template.podSecurityContext: locked by ClusterTrainingRuntime gpu-team; remove "
        "it from the job (the runtime sets it)")]


def test_defaults_install_the_operator_and_nothing_optional(
        default_release: helm.Release) -> None:
    kinds = sorted(m["kind"] for m in default_release.manifests)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ClusterTrainingRuntime",
                     "Deployment", "Service", "ServiceAccount"]
    # crds/ cannot be conditional: kopf's peering kinds (used with replicaCount above 1) come
    # along, unused; Helm skips CRDs that already exist, e.g. from another kopf operator.
    assert sorted(c["metadata"]["name"] for c in default_release.crds) == [
        "clusterkopfpeerings.kopf.dev", "clustertrainingruntimes.kiln.dev",
        "kopfpeerings.kopf.dev", "trainingjobs.kiln.dev", "trainingruntimes.kiln.dev",
        "trainingsweeps.kiln.dev"]


def test_operator_deployment_is_one_locked_down_replica(full_release: helm.Release) -> None:
    deployment = full_release.one("Deployment", "kiln")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    container = _container(full_release)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert probe == {"path": "/healthz", "port": "healthz"}
    options = _operator_options(full_release)
    assert ports == {"metrics": options.metrics_port, "healthz": options.liveness_port}
    assert pod["nodeSelector"] == EVERYTHING_ON["operator"]["nodeSelector"]
    assert pod["tolerations"] == EVERYTHING_ON["operator"]["tolerations"]
    assert pod["affinity"] == EVERYTHING_ON["operator"]["affinity"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert container["envFrom"] == EVERYTHING_ON["operator"]["envFrom"]  # KILN_OPERATOR_*
    assert pod["serviceAccountName"] == full_release.one("ServiceAccount")["metadata"]["name"]


def test_values_reach_the_operator_as_its_own_flags(full_release: helm.Release) -> None:
    options = _operator_options(full_release)
    assert options.namespaces == ("team-a", "team-b")
    assert options.gpu_type == "NVIDIA-A100-SXM4-80GB"
    assert options.gpu_type_label == "nvidia.com/gpu.product"
    assert options.gpu_resources == ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb")
    assert options.max_gpus_per_job == 4
    assert options.placement_use_milp is False
    assert options.placement_time_limit_seconds == 2.5
    assert options.zoo_query_timeout_seconds == 30.0  # operator.extraArgs
    assert options.zoo_uri == "s3://kiln-zoo"
    minio = full_release.one("Service", "minio")["metadata"]["name"]
    assert options.zoo_endpoint == f"http://{minio}.kiln-system.svc:9000"
    assert options.zoo_secret == minio
    assert options.default_image == "ghcr.io/kiln-dev/kiln-trainer:0.1.0"


def test_an_existing_zoo_is_used_with_its_credentials_secret(
        existing_zoo_release: helm.Release) -> None:
    options = _operator_options(existing_zoo_release)
    assert options.zoo_uri == "s3://ml-zoo/kiln/v1"
    assert options.zoo_endpoint == "https://s3.example.com:9000"
    assert options.zoo_secret == "zoo-creds-trainers"
    env = {e["name"]: e for e in _container(existing_zoo_release)["env"]}
    assert env["KILN_ZOO_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "zoo-creds", "key": "accessKey"}
    assert env["KILN_ZOO_SECRET_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "zoo-creds", "key": "secretKey"}
    assert not existing_zoo_release.of_kind("PersistentVolumeClaim")


def test_bundled_minio_shares_one_secret_with_the_operator(full_release: helm.Release) -> None:
    secret = full_release.one("Secret", "minio")
    assert set(secret["data"]) == {"accessKey", "secretKey"}
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    minio = full_release.one("Deployment", "minio")["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in minio["env"]}
    assert refs == {"MINIO_ROOT_USER": secret["metadata"]["name"],
                    "MINIO_ROOT_PASSWORD": secret["metadata"]["name"]}
    assert minio["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_service_monitor_scrapes_the_operator_metrics_port(full_release: helm.Release) -> None:
    monitor = full_release.one("ServiceMonitor")
    service = full_release.one("Service", "metrics")
    deployment = full_release.one("Deployment", "kiln")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items())
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["kiln-system"]}


def test_pod_monitor_scrapes_trainer_pods_and_lets_no_trainer_override_target_labels(
        full_release: helm.Release) -> None:
    monitor = full_release.one("PodMonitor")
    assert monitor["spec"]["selector"] == {"matchExpressions": [
        {"key": api.JOB_NAME_LABEL, "operator": "Exists"}]}
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == pods.METRICS_PORT_NAME
    assert not endpoint.get("honorLabels")  # trainers run user code: namespace, pod stay true
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_dashboard_configmap_carries_the_dashboard_for_grafanas_sidecar(
        full_release: helm.Release, default_release: helm.Release) -> None:
    configmap = full_release.one("ConfigMap", "dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "Kiln"}
    shipped = json.loads((helm.CHART / "dashboards" / "kiln.json").read_text(encoding="utf-8"))
    assert json.loads(configmap["data"]["kiln.json"]) == shipped
    assert not default_release.of_kind("ConfigMap")


def test_notes_tell_the_user_what_to_do_next(full_release: helm.Release,
                                             default_release: helm.Release) -> None:
    assert "kubectl -n kiln-system rollout status deployment/kiln" in full_release.notes
    # presigned pod access (the default): nothing to copy into job namespaces
    assert "job namespaces need no Secret" in full_release.notes
    assert "create secret generic" not in full_release.notes
    assert "namespaces team-a, team-b" in full_release.notes
    assert "s3://kiln-zoo at minio.example:9000" in default_release.notes
    assert "kubectl -n <job-namespace> apply -f" in default_release.notes
    assert "kubectl -n team-a apply -f" in full_release.notes  # a watched namespace
    credentials = helm.install({"minio": {"enabled": True}, "zoo": {"podAccess": "credentials"}})
    assert "create secret generic kiln-minio" in credentials.notes
    assert "jsonpath='{.data.accessKey}' | base64 -d" in credentials.notes
    assert "crds/trainingjob.yaml" in default_release.notes
    assert "timeLimitSeconds" not in default_release.notes
    slow = helm.install({"placement": {"timeLimitSeconds": 20, "intervalSeconds": 10}})
    assert "WARNING: placement.timeLimitSeconds (20) is more than half" in slow.notes


def test_long_and_dotted_release_names_give_valid_object_names() -> None:
    release = helm.install({"podMonitor": {"enabled": True},
                            "grafanaDashboard": {"enabled": True}}, release="my.team." + "a" * 45)
    for document in release.manifests:
        name = document["metadata"]["name"]
        assert len(name) <= 63 and "." not in name, name
    assert release.one("Service")["metadata"]["name"].endswith("-metrics")


def test_pod_labels_cannot_unselect_the_operators_pods() -> None:
    release = helm.install({"operator": {"podLabels": {
        "app.kubernetes.io/component": "mine", "team": "ml"}}})
    deployment = release.one("Deployment", "kiln")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels["team"] == "ml"


@pytest.mark.parametrize(("values", "message"), [
    ({}, "zoo.endpoint: the operator and trainer pods need the model zoo's S3 endpoint"),
    ({"zoo": {"endpoint": "m:9000"}, "serviceAccount": {"create": False}},
     "serviceAccount.name: with serviceAccount.create=false, name an existing account"),
    ({"zoo": {"endpoint": "m:9000"}, "serviceAccount": {"name": "default"}},
     'serviceAccount.name: "default" already exists'),
    ({"zoo": {"endpoint": "m:9000"}, "metrics": {"port": 8080}},
     "metrics.port and operator.livenessPort are both 8080"),
    ({"zoo": {"endpoint": "m:9000"}, "operator": {"extraArgs": ["--liveness-port=0"]}},
     "operator.extraArgs: --liveness-port is set by the chart"),
    # The operator took the last of two silently, or failed at start on a lone flag.
    ({"zoo": {"endpoint": "m:9000"},
      "operator": {"extraArgs": ["--zoo-capacity=10GiB", "--zoo-capacity=20GiB"]}},
     "operator.extraArgs: --zoo-capacity is given twice"),
    ({"zoo": {"endpoint": "m:9000"}, "operator": {"extraArgs": ["--resize", "--no-resize"]}},
     "operator.extraArgs: --resize is given twice (--resize and --no-resize)"),
    ({"zoo": {"endpoint": "m:9000"}, "operator": {"extraArgs": ["--zoo-capacity", "--no-resize"]}},
     "operator.extraArgs: --zoo-capacity needs a value in the same item"),
    # The flag the chart passes won over it silently.
    ({"zoo": {"endpoint": "m:9000"},
      "operator": {"env": [{"name": "KILN_OPERATOR_ZOO_URI", "value": "s3://other"}]}},
     "operator.env: KILN_OPERATOR_ZOO_URI sets the operator's --zoo-uri"),
    ({"zoo": {"endpoint": "m:9000"},
      "operator": {"env": [{"name": "KILN_OPERATOR_GPU_RESOURCES", "value": "amd.com/gpu"}]}},
     "operator.env: KILN_OPERATOR_GPU_RESOURCES sets the operator's --gpu-resource"),
], ids=["no-zoo-endpoint", "no-account-name", "default-account", "same-ports",
        "extra-arg-the-chart-sets", "extra-arg-twice", "extra-switch-and-its-no-form",
        "extra-arg-without-value", "env-of-a-chart-flag", "env-of-a-chart-list-flag"])
def test_values_no_schema_can_check_fail_install_naming_the_value(
        values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmFailed, match=re.escape(message)):
        helm.install(values, required=False)


def test_chart_values_file_is_documented_in_its_schema() -> None:
    """Every key of values.yaml is declared in values.schema.json (typos fail at install)."""
    schema = json.loads((helm.CHART / "values.schema.json").read_text(encoding="utf-8"))
    values = yaml.safe_load((helm.CHART / "values.yaml").read_text(encoding="utf-8"))

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        if not isinstance(value, dict) or "properties" not in node:
            return
        for key, child in value.items():
            assert key in node["properties"], f"values.yaml {path}{key} is not in the schema"
            walk(child, node["properties"][key], f"{path}{key}.")

    walk(values, schema, "")


def test_the_charts_extra_args_lists_cover_every_operator_flag_once() -> None:
    """The template sorts `kiln operator`'s flags into those its values set and those
    `operator.extraArgs` may add; a flag added to the operator must be sorted too."""
    helpers = (helm.CHART / "templates" / "_helpers.tpl").read_text(encoding="utf-8")

    def listed(name: str) -> list[str]:
        line = re.search(rf"\$({name}) := list (.*) -}}}}", helpers)
        assert line, name
        return re.findall(r'"([^"]+)"', line.group(2))

    managed, open_ = listed("managed"), listed("open")
    parser = main.build_parser()
    flags = {s for action in parser._actions for s in action.option_strings}
    assert sorted(managed + open_) == sorted(flags)  # each once, none missing or stale


def test_an_unknown_extra_arg_fails_install_naming_the_open_flags() -> None:
    with pytest.raises(helm.HelmFailed, match="--bogus-flag is not a kiln operator flag"):
        helm.install({"operator": {"extraArgs": ["--bogus-flag=1"]}})
    release = helm.install({"operator": {
        "extraArgs": ["--housekeeping-interval-seconds=5", "--priority-weight=high=4",
                      "--priority-weight=low=0.5", "--no-resize"],
        "env": [{"name": "KILN_OPERATOR_ZOO_CAPACITY", "value": "10GiB"}]}})
    options = _operator_options(release)
    assert options.housekeeping_interval_seconds == 5.0 and options.resize is False
    assert options.priority_weights == ("high=4", "low=0.5")  # a repeatable flag, repeated
