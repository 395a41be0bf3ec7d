"""S3 credentials the server refuses are a permanent misconfiguration, not an outage.

Starts moto's S3 server with authentication on (the shared `s3_server` accepts any key), so
wrong keys get the answers a real S3 gives them.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubesim import client

from kiln import cli, contract
from kiln.zoo import store
from kiln_trainer import cli as trainer_cli

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds its module fixtures

START_SECONDS = 60.0


@pytest.fixture(scope="module")
def checking_server() -> Iterator[str]:
    """``host:port`` of a moto S3 server that checks every request's credentials."""
    port = client.free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},  # moto: authenticate at once
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            try:
                connection.request("GET", "/")
                connection.getresponse().read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto S3 server did not answer on port {port}")
                time.sleep(0.1)  # integration fixture: polling a starting server
            finally:
                connection.close()
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.parametrize("action", ["list", "put", "get"])
def test_wrong_keys_raise_store_misconfigured_at_once_naming_the_settings(
    checking_server: str, action: str
) -> None:
    waits: list[float] = []
    zoo = store.S3Store(checking_server, "zoo", access_key="not-a-key", secret_key="wrong",
                        retry=store.RetryPolicy(attempts=4, first_backoff_seconds=1.0),
                        sleep=waits.append)
    calls = {"list": lambda: zoo.list_keys(""), "put": lambda: zoo.put_bytes("k", b"x"),
             "get": lambda: zoo.get_bytes("k")}
    with pytest.raises(store.StoreMisconfigured) as caught:
        calls[action]()
    assert not isinstance(caught.value, store.StoreUnavailable)
    message = str(caught.value)
    assert "InvalidAccessKeyId" in message
    assert contract.Env.ZOO_ACCESS_KEY in message and contract.Env.ZOO_SECRET_KEY in message
    assert "--zoo-secret" in message
    assert waits == []  # not retried


def test_kiln_zoo_ls_with_wrong_keys_says_so_without_a_traceback(
    checking_server: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(contract.Env.ZOO_ACCESS_KEY, "not-a-key")
    monkeypatch.setenv(contract.Env.ZOO_SECRET_KEY, "wrong")
    argv = ["zoo", "ls", "--zoo", "s3://zoo", "--zoo-endpoint", checking_server]
    assert cli.main(argv) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "InvalidAccessKeyId" in err and contract.Env.ZOO_SECRET_KEY in err


def test_the_trainer_exits_invalid_not_store_unavailable_with_wrong_keys(
    checking_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "keys"},
        "spec": {"model": {"architecture": "small_cnn", "args": {"depth": 1, "width": 4},
                           "inputShape": [1, 8, 8]},
                 "dataset": {"name": "digits", "maxSamples": 64},
                 "training": {"epochs": 1, "batchSize": 32}},
    }), encoding="utf-8")
    monkeypatch.setenv(contract.Env.ZOO_ENDPOINT, checking_server)
    monkeypatch.setenv(contract.Env.ZOO_ACCESS_KEY, "not-a-key")
    monkeypatch.setenv(contract.Env.ZOO_SECRET_KEY, "wrong")
    monkeypatch.setenv("KILN_CHECKPOINTS", str(tmp_path / "ckpt"))
    code = trainer_cli.main(["--job", str(job), "--zoo", "s3://zoo"])
    assert code == contract.EXIT_INVALID != contract.EXIT_STORE_UNAVAILABLE
    assert contract.Env.ZOO_ACCESS_KEY in capsys.readouterr().err
