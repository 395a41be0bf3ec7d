"""What `kiln ls`/`kiln get` print about a job, and the cluster commands' errors without one."""

from __future__ import annotations

import http.server
import io
import json
import runpy
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from kiln import Client, api, cli
from kiln.cluster import client, errors, views
from kiln.local import output

RUNNING: dict[str, Any] = {
    "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
    "metadata": {"name": "resnet-a", "namespace": "team"},
    "spec": {"training": {"epochs": 30}, "freezing": {"enabled": True}},
    "status": {
        "phase": "Running",
        "warmStart": {"outcome": "warm", "parent": "zoo-17", "similarity": 0.93,
                      "matchedTensors": 40, "totalTensors": 42,
                      "reason": "closest compatible model"},
        "placement": {"node": "gpu-1", "gpus": 2, "parallelism": "ddp",
                      "estimatedSeconds": 900.0},
        "progress": {"epoch": 4, "step": 400, "validationAccuracy": 0.8125,
                     "etaSeconds": 600.0, "frozenModules": 3, "computeFraction": 0.6},
        "conditions": [{"type": "Running", "status": "True", "reason": "PodRunning",
                        "message": "trainer running"}],
    },
}


def test_summary_reads_phase_epoch_eta_warm_start_placement_and_accuracy() -> None:
    assert views.summary(RUNNING) == {
        "kind": "TrainingJob", "name": "resnet-a", "namespace": "team", "phase": "Running",
        "epoch": 4, "epochs": 30, "etaSeconds": 600.0, "warmStart": "warm: zoo-17 (0.93)",
        "placement": "gpu-1, 2 GPUs, ddp", "accuracy": 0.8125}


def test_a_job_without_status_shows_unknowns_not_errors() -> None:
    bare = {"kind": "TrainingJob", "metadata": {"name": "new", "namespace": "ns"}, "spec": {}}
    row = views.summary(bare)
    assert row["phase"] is None and row["warmStart"] is None and row["accuracy"] is None
    assert views.story(bare) == ["No warm-start decision yet.",
                                 "Layer freezing is on; no module is frozen yet."]


def test_the_story_tells_warm_start_placement_progress_and_freezing_in_words() -> None:
    assert views.story(RUNNING) == [
        ("Warm-started from zoo-17 (similarity 0.93, 40 of 42 tensors transferred): closest "
        "compatible model."),
        "Placed on gpu-1, 2 GPUs, ddp; estimated 15 min of training.",
        "Epoch 4 of 30, step 400, validation accuracy 0.812, about 10 min left.",
        "3 leading modules frozen; a step costs 60% of a full one.",
    ]


def test_a_cold_start_and_a_failure_are_explained() -> None:
    failed = {"kind": "TrainingJob", "metadata": {"name": "x"},
              "spec": {"freezing": {"enabled": False}},
              "status": {"phase": "Failed",
                         "warmStart": {"outcome": "cold_empty", "reason": "the zoo is empty"},
                         "conditions": [{"type": "Failed", "status": "True",
                                         "reason": "PermanentError",
                                         "message": "exit code 2: no such folder"}]}}
    assert views.story(failed) == [
        "Started cold (cold_empty): the zoo is empty.",
        "Layer freezing is off (spec.freezing.enabled: false).",
        "Failed (PermanentError): exit code 2: no such folder"]
    assert views.summary(failed)["warmStart"] == "cold (cold_empty)"


def test_detail_keeps_conditions_and_events_for_scripts() -> None:
    events = [{"type": "Normal", "reason": "Placed", "message": "on gpu-1", "count": 1,
               "lastTimestamp": "2026-01-01T00:00:00Z"}]
    view = views.detail(RUNNING, events)
    assert view["conditions"][0]["reason"] == "PodRunning"
    assert view["events"] == [{"time": "2026-01-01T00:00:00Z", "type": "Normal",
                               "reason": "Placed", "message": "on gpu-1", "count": 1}]
    assert json.loads(json.dumps(view)) == view  # -o json prints exactly this
    lines = views.detail_lines(view)
    assert lines[0] == "TrainingJob team/resnet-a: Running"
    assert "  Running=True PodRunning: trainer running" in lines
    assert "  2026-01-01T00:00:00Z Normal Placed: on gpu-1" in lines


def test_ls_table_is_one_plain_line_per_job_when_piped() -> None:
    console = Console(file=io.StringIO(), color_system=None,
                      width=output.PLAIN_WIDTH, force_terminal=False)
    output.print_table(console, views.summary_table([views.summary(RUNNING)]))
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert lines[1].split()[:3] == ["namespace", "name", "kind"]
    row = lines[2]
    assert row.startswith("team") and "4/30" in row and "10 min" in row
    assert "warm: zoo-17 (0.93)" in row and "0.8125" in row


def test_a_sweep_row_counts_its_trials() -> None:
    sweep = {"kind": "TrainingSweep", "metadata": {"name": "s", "namespace": "n"},
             "status": {"phase": "Running", "trials": {"total": 5, "running": 2},
                        "best": {"trial": "s-t1", "index": 1, "metric": 0.9}}}
    assert views.summary(sweep)["placement"] == "5 trials"
    assert views.summary(sweep)["accuracy"] == 0.9
    assert views.story(sweep)[0].startswith("5 trials: 2 running")


def test_without_a_kubeconfig_the_commands_say_how_to_give_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli.main(["ls"]) == 2
    err = capsys.readouterr().err
    assert "no kubeconfig" in err and "KUBECONFIG" in err and "--kubeconfig" in err


def test_an_unreachable_cluster_is_named_with_its_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "gone", "context": {"cluster": "c", "user": "u",
                                                  "namespace": "team"}}]}))
    assert cli.main(["get", "some-job", "--kubeconfig", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach http://127.0.0.1:{port} (context gone" in err
    assert "check that the cluster is up" in err
    assert Client(kubeconfig=config).namespace == "team"  # the context's namespace
    assert cli.main(["ls", "--kubeconfig", str(config), "--context", "other"]) == 2
    assert "other" in capsys.readouterr().err


def test_wait_refuses_an_unknown_phase_before_asking(tmp_path: Path) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    with pytest.raises(errors.ClusterError, match="--for Done: not a phase"):
        Client(kubeconfig=config).wait("x", phase="Done")


def _kubeconfig(tmp_path: Path, server: str) -> Path:
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u",
                                               "namespace": "team"}}]}))
    return config


class _ApiServer(http.server.ThreadingHTTPServer):
    """Answers GETs from `answers` (path -> JSON), else 404 as an API server does for a
    resource it does not serve; stops once it has answered `last`."""

    def __init__(self, answers: dict[str, Any], *, last: str | None = None) -> None:
        self.answers, self.last = answers, last
        super().__init__(("127.0.0.1", 0), _ApiHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ApiHandler(http.server.BaseHTTPRequestHandler):
    server: _ApiServer

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        found = path in self.server.answers
        body = (json.dumps(self.server.answers[path]) if found else "404 page not found")
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json" if found else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body.encode())
        if path == self.server.last:
            threading.Thread(target=self.server.shutdown).start()
            self.server.server_close()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.filterwarnings("ignore:'kiln.cli' found in sys.modules")
def test_python_dash_m_kiln_cli_knows_the_cluster_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("sys.argv", ["kiln", "ls", "--kubeconfig", str(tmp_path / "none")])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("kiln.cli", run_name="__main__")
    assert exited.value.code == 2
    assert f"kubeconfig {tmp_path / 'none'} does not exist" in capsys.readouterr().err


def test_a_missing_kubeconfig_file_is_named_as_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    missing = tmp_path / "kubeconfig"
    assert cli.main(["ls", "--kubeconfig", str(missing)]) == 2
    assert f"kubeconfig {missing} does not exist; pass --kubeconfig" in capsys.readouterr().err
    monkeypatch.setenv("KUBECONFIG", str(missing))
    with pytest.raises(errors.ClusterError, match="does not exist"):
        Client()


def test_a_cluster_without_kiln_says_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    server = _ApiServer({})
    try:
        config = _kubeconfig(tmp_path, server.url)
        for command in (["ls"], ["get", "digits"], ["delete", "digits"]):
            assert cli.main([*command, "--kubeconfig", str(config)]) == 2
            err = capsys.readouterr().err
            assert "does not serve trainingjobs.kiln.dev" in err, command
            assert "install Kiln" in err
    finally:
        server.shutdown()
        server.server_close()


def test_wait_reports_a_cluster_that_goes_away_not_a_deleted_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client, "POLL_SECONDS", 0.01)
    job = {**RUNNING, "metadata": {"name": "resnet-a", "namespace": "team"}}
    events = "/api/v1/namespaces/team/events"
    server = _ApiServer({"/apis/kiln.dev/v1alpha1/namespaces/team/trainingjobs/resnet-a": job,
                         events: {"items": []}}, last=events)
    config = _kubeconfig(tmp_path, server.url)
    kiln_client = Client(kubeconfig=config)
    with pytest.raises(errors.ClusterError, match="cannot reach") as raised:
        kiln_client.wait("resnet-a")  # Running once, then a closed port
    assert not isinstance(raised.value, errors.WaitFailed)


@pytest.mark.process  # checking the file imports torch, which runs ldconfig
def test_submit_refuses_a_file_of_another_namespace_than_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "digits", "namespace": "team-b"},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                    "dataset": {"name": "digits"}}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    config = _kubeconfig(tmp_path, "http://127.0.0.1:9")  # never asked
    assert cli.main(["submit", str(job), "-n", "team-a", "--kubeconfig", str(config)]) == 2
    err = capsys.readouterr().err
    assert "names namespace team-b, not team-a" in err and "pass -n team-b" in err


def test_logs_of_a_sweep_or_a_missing_rank_say_where_the_pods_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    apis, pods = "/apis/kiln.dev/v1alpha1/namespaces/team", "/api/v1/namespaces/team/pods"
    server = _ApiServer({
        f"{apis}/trainingsweeps/search": {"kind": "TrainingSweep",
                                          "metadata": {"name": "search", "namespace": "team"}},
        f"{apis}/trainingjobs/resnet-a": RUNNING,
        pods: {"items": [{"metadata": {"name": "resnet-a-trainer-0", "namespace": "team",
                                       "labels": {api.RANK_LABEL: "0"}}}]}})
    try:
        config = _kubeconfig(tmp_path, server.url)
        assert cli.main(["logs", "search", "--kubeconfig", str(config)]) == 2
        err = capsys.readouterr().err
        assert "search is a TrainingSweep" in err and "kiln ls -n team" in err
        assert cli.main(["logs", "resnet-a", "--rank", "5", "--kubeconfig", str(config)]) == 2
        assert "its pods have rank 0: check --rank" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_logs_of_an_unknown_job_raise_when_called_not_when_read(tmp_path: Path) -> None:
    server = _ApiServer({"/apis/kiln.dev/v1alpha1/namespaces/team/trainingjobs": {"items": []}})
    try:
        kiln_client = Client(kubeconfig=_kubeconfig(tmp_path, server.url))
        with pytest.raises(errors.ClusterError, match="no TrainingJob or TrainingSweep nope"):
            kiln_client.logs("nope")
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(errors.ClusterError, match="no local job nope"):
        Client(local=True, work_dir=tmp_path / "runs").logs("nope")


def test_wait_timeout_0_checks_once_as_kubectl_wait(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    job = "/apis/kiln.dev/v1alpha1/namespaces/team/trainingjobs/resnet-a"
    server = _ApiServer({job: RUNNING, "/api/v1/namespaces/team/events": {"items": []}})
    try:
        config = _kubeconfig(tmp_path, server.url)
        assert cli.main(["wait", "resnet-a", "--timeout", "0", "--kubeconfig", str(config)]
                        ) == cli.EXIT_TIMEOUT
        assert "resnet-a: still Running after 0 s" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            cli.main(["wait", "resnet-a", "--timeout", bad, "--kubeconfig", str(config)])
        assert "must be a finite number >= 0" in capsys.readouterr().err
