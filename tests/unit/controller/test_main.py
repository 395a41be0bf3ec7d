"""kiln.controller.main: every option has a flag; bad flags are usage errors naming the flag
(exit 2); an unreachable API server is one message (exit 1); what the operator builds from options."""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import socket
import threading
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from kiln.controller import admission, handlers, kube, main, pods, settings
from kiln.placement import introspect


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read it"),
    ("clusters: [\n", "not valid YAML"),
    ("- just a list\n", "not a kubeconfig"),
])
def test_an_unusable_kubeconfig_is_a_usage_error_naming_the_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None,
        message: str) -> None:
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content)
    assert main.main(["--kubeconfig", str(path)]) == 2
    out = capsys.readouterr().out
    assert f"--kubeconfig {path}: {message}" in out


def test_every_option_has_a_flag() -> None:
    args = main.build_parser().parse_args([
        "--kubeconfig", "/tmp/kc", "-n", "a", "-n", "b", "--zoo-uri", "s3://z",
        "--no-placement-use-milp", "--cpu-slots-per-node", "4"])
    options = main.options_from_args(args)
    assert options.namespaces == ("a", "b")
    assert options.zoo_uri == "s3://z" and options.placement_use_milp is False
    assert options.cpu_slots_per_node == 4 and str(options.kubeconfig) == "/tmp/kc"
    assert options.gpu_type is None


def test_resize_flags_make_the_introspection_policy_or_turn_it_off() -> None:
    options = main.options_from_args(main.build_parser().parse_args([
        "--resize-min-gain", "3", "--resize-min-interval-seconds", "120",
        "--resize-restart-seconds", "20", "--resize-grow-price", "0",
        "--resize-grow-load-exponent", "1", "--resize-short-job-weight", "4"]))
    assert settings.resize_policy(options) == introspect.Policy(
        min_gain=3.0, min_interval_seconds=120.0, default_restart_seconds=20.0,
        grow_price=0.0, grow_load_exponent=1.0, short_job_weight=4.0)
    defaults = main.options_from_args(main.build_parser().parse_args([]))
    assert settings.resize_policy(defaults) == introspect.Policy(default_restart_seconds=60.0)
    off = main.options_from_args(main.build_parser().parse_args(["--no-resize"]))
    assert settings.resize_policy(off) is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--placement-interval-seconds", "-1"], "must be greater than 0, got -1"),
    (["--placement-time-limit-seconds", "nan"], "expected a finite number"),
    (["--housekeeping-interval-seconds", "0"], "must be greater than 0"),
    (["--zoo-retry-limit", "-2"], "must be 0 or more"),
    (["--zoo-retry-limit", "1.5"], "expected a whole number"),
    (["--metrics-port", "70000"], "a port is at most 65535"),
    (["--zoo-endpoint", "minio 9000"], "invalid S3 endpoint 'minio 9000'"),
    (["--max-gpus-per-job", "0"], "must be greater than 0"),
    (["--zoo-request-attempts", "1026"], "must be at most 100"),
    (["--termination-grace-seconds", "0"], "must be greater than 0"),
    (["--image-pull-policy", "Sometimes"], "invalid choice: 'Sometimes'"),
    (["--gpu-type", "A100 80GB"], "'A100 80GB' is not a node label value"),
    (["--gpu-type-label", "bad label!"], "'bad label!' is not a label key"),
    (["--progress-address", "{nope}:{port}"], "unknown fields ['nope']"),
    (["--resize-min-gain", "0.5"], "must be at least 1"),
    (["--resize-short-job-weight", "0.5"], "must be at least 1"),
    (["--resize-grow-price", "-1"], "must be 0 or more"),
    (["--resize-grow-load-exponent", "-2"], "must be 0 or more"),
    (["--gpu-resource", "gpu"], "'gpu' is not an extended resource name"),
    (["--pod-security-context", "runAsNonRoot"], "not JSON"),
    (["--container-security-context", "[1]"], "must be a JSON object"),
    (["--pod-security-context", '{"runAsUser": "root"}'], "runAsUser: must be an integer"),
    (["--container-security-context", '{"capabilities": {"drop": "ALL"}}'],
     "capabilities.drop: must be a list"),
    (["--peering", "Kiln Peers"], "'Kiln Peers' is not an object name"),
    # Accepted before, then every trainer pod (or every warm-start search) failed.
    (["--trainer-metrics-port", "0"], "must be greater than 0"),
    (["--warm-start-graph-timeout-seconds", "3000000"], "must be at most 86400"),
    (["--profile-timeout-seconds", "1e300"], "must be at most 86400"),
    (["--default-image", "kiln-trainer:0.1 beta"],
     "'kiln-trainer:0.1 beta' is not an image reference"),
    (["--zoo-secret", "Zoo Creds"], "'Zoo Creds' is not the name of a Secret"),
    (["--trainer-service-account", "ml_trainer"],
     "'ml_trainer' is not the name of a ServiceAccount"),
    (["--zoo-secret-access-key", "access key"], "'access key' is not a Secret key"),
])
def test_numeric_options_out_of_range_are_usage_errors_naming_the_flag(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {argv[0]}: {message}" in error, error


def test_zero_ports_and_retries_are_allowed() -> None:
    options = main.options_from_args(main.build_parser().parse_args([
        "--metrics-port", "0", "--liveness-port", "0", "--zoo-retry-limit", "0",
        "--gpu-type", "NVIDIA-A100-SXM4-80GB"]))
    assert (options.metrics_port, options.liveness_port, options.zoo_retry_limit) == (0, 0, 0)
    assert options.gpu_type == "NVIDIA-A100-SXM4-80GB"


def test_one_port_for_metrics_and_liveness_fails_at_start_naming_both_flags(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--metrics-port", "8080", "--liveness-port", "8080"]
    with pytest.raises(ValueError, match="--metrics-port and --liveness-port are both 8080"):
        main.options_from_args(main.build_parser().parse_args(argv))
    assert main.main(argv) == 2  # before any connection
    assert "different ports" in capsys.readouterr().out


class _Server(http.server.BaseHTTPRequestHandler):
    """/version as an API server answers it, or 404 (not Kubernetes) when `kubernetes` is off."""

    kubernetes = True

    def do_GET(self) -> None:
        found = self.kubernetes and self.path == "/version"
        body = json.dumps({"gitVersion": "v1.30.0"} if found else {"kind": "Status"}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def _info(url: str) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=url, token="t")


@pytest.mark.parametrize("kubernetes", [True, False], ids=["kubernetes", "not-kubernetes"])
def test_the_api_server_check_asks_for_version(kubernetes: bool) -> None:
    handler = type("Handler", (_Server,), {"kubernetes": kubernetes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # polled often: `shutdown` waits for the next poll (half a second by default)
    thread = threading.Thread(target=functools.partial(server.serve_forever, poll_interval=0.01),
                              daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        problem = asyncio.run(kube.unreachable(_info(url), attempts=1))
    finally:
        server.shutdown()
        server.server_close()
    if kubernetes:
        assert problem is None
    else:
        assert problem is not None and "cannot reach the API server" in problem
        assert "404" in problem


@pytest.mark.asyncio
@pytest.mark.looptime  # the loop's clock is fake: the timeouts and the delay take no real time
async def test_a_server_that_never_answers_fails_the_check_within_its_timeout() -> None:
    loop = asyncio.get_running_loop()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts connections, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        began = loop.time()
        problem = await kube.unreachable(_info(url), attempts=2, delay_seconds=3.0,
                                         timeout_seconds=0.5)
    assert problem is not None and f"cannot reach the API server {url}" in problem
    assert "2 attempts" in problem
    assert loop.time() - began == pytest.approx(0.5 + 3.0 + 0.5)  # two timeouts, one delay


def test_kiln_operator_against_a_closed_port_exits_1_with_one_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KUBECONFIG", "")  # connection_info sets it; restore afterwards
    monkeypatch.setattr(kube, "unreachable", functools.partial(kube.unreachable, attempts=1))
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "c", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "c"}}]}))
    assert main.main(["--kubeconfig", str(config)]) == 1
    out = capsys.readouterr().out
    assert f"error: cannot reach the API server http://127.0.0.1:{port}" in out
    assert "Traceback" not in out


def test_a_zoo_endpoint_from_the_environment_reaches_trainer_pods_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator may take its endpoint from $KILN_ZOO_ENDPOINT (the chart's operator.env);
    trainer pods must then be told the same endpoint, not none."""
    monkeypatch.setenv("KILN_ZOO_ENDPOINT", "minio.example:9000")
    monkeypatch.setenv("KILN_ZOO_ACCESS_KEY", "k")
    monkeypatch.setenv("KILN_ZOO_SECRET_KEY", "s")
    options = main.options_from_args(main.build_parser().parse_args(["--zoo-uri", "s3://zoo"]))
    assert options.zoo_endpoint is None
    operator = main.build(options, kopf.ConnectionInfo(server="http://127.0.0.1:9"))
    assert operator.deps.pod_settings.zoo_endpoint == "minio.example:9000"


def test_the_first_job_not_the_operators_start_warms_up_a_graph_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator that admits no job spends no process importing torch; the first job to
    admit starts the graph worker before its admission runs."""
    options = main.options_from_args(main.build_parser().parse_args([
        "--zoo-uri", str(tmp_path)]))
    operator = main.build(options, kopf.ConnectionInfo(server="http://127.0.0.1:9"))
    warmed: list[bool] = []
    monkeypatch.setattr(operator.deps.parents, "warm_up", lambda: warmed.append(True))
    admitted: list[list[bool]] = []

    async def admit(deps: Any, gate: Any, body: Any, *, retry: int) -> None:
        admitted.append(list(warmed))

    monkeypatch.setattr(admission, "admit", admit)

    async def start_admit_and_stop() -> list[bool]:
        await operator.start()
        started = list(warmed)
        await handlers.admit(body={"metadata": {"name": "a", "namespace": "team-a"}},
                             retry=0, memo=kopf.Memo(operator=operator))
        await operator.stop()
        return started

    assert asyncio.run(start_admit_and_stop()) == []
    assert admitted == [[True]]


def test_gpu_resources_repeat_in_order_and_default_to_nvidia() -> None:
    options = main.options_from_args(main.build_parser().parse_args([
        "--gpu-resource", "nvidia.com/mig-1g.10gb", "--gpu-resource", "amd.com/gpu",
        "--gpu-resource", "amd.com/gpu"]))
    assert options.gpu_resources == ("nvidia.com/mig-1g.10gb", "amd.com/gpu")
    default = main.options_from_args(main.build_parser().parse_args([]))
    assert default.gpu_resources == ("nvidia.com/gpu",)


def test_a_cluster_admin_gets_no_finalizer_standalone_and_no_fixed_uid_by_default() -> None:
    options = main.options_from_args(main.build_parser().parse_args([]))
    assert (options.finalizer, options.peering) == (False, None)
    pod_settings = settings.pod_settings(options)
    assert pod_settings.pod_security_context == pods.POD_SECURITY_CONTEXT
    assert "runAsUser" not in pod_settings.pod_security_context


def test_security_context_flags_reach_the_pod_builder() -> None:
    options = main.options_from_args(main.build_parser().parse_args([
        "--finalizer", "--peering", "kiln",
        "--pod-security-context", '{"runAsNonRoot": true, "fsGroup": 2000}',
        "--container-security-context", '{"readOnlyRootFilesystem": true}']))
    assert options.finalizer and options.peering == "kiln"
    pod_settings = settings.pod_settings(options)
    assert pod_settings.pod_security_context == {"runAsNonRoot": True, "fsGroup": 2000}
    assert pod_settings.container_security_context == {"readOnlyRootFilesystem": True}


def test_kiln_operator_with_metrics_on_no_interface_exits_2_naming_the_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KUBECONFIG", "")  # connection_info sets it; restore afterwards
    handler = type("Handler", (_Server,), {"kubernetes": True})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=functools.partial(server.serve_forever, poll_interval=0.01),
                              daemon=True)
    thread.start()
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {
            "server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "c", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "c"}}]}))
    try:
        code = main.main(["--kubeconfig", str(config), "--zoo-uri", str(tmp_path / "zoo"),
                          "--metrics-host", "no-such-host.invalid"])
    finally:
        server.shutdown()
        server.server_close()
    out = capsys.readouterr().out
    assert code == 2, out
    assert "--metrics-host no-such-host.invalid" in out and "cannot serve /metrics" in out, out
    assert "Traceback" not in out
