"""Shared pytest fixtures.

S3 server (owner: zoo): `s3_server` starts moto's S3-compatible server as a subprocess on
127.0.0.1 (the `minio` SDK talks to a real server over HTTP), once per session (per xdist
worker); `s3_bucket` gives each test a fresh bucket name on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
from kubesim import client

S3_SERVER_START_SECONDS = 60.0  # moto imports a lot; a loaded 2-core machine needs a while

# The operator's API calls over the whole run, checked against its RBAC rules at the end;
# pytester runs that check in an inner pytest (tests/integration/test_kubesim_usage.py).
pytest_plugins = ["kubesim.usage", "pytester"]


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread per xdist worker, and in the processes it starts.

    Several workers share the cores: torch's default of one thread per core in each would
    oversubscribe them (a single process, run without xdist, keeps torch's default).
    """
    if hasattr(config, "workerinput"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch  # after the variable, so torch's thread pool starts with one thread

        torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--dist loadgroup` on an xdist worker: end a grouped test's id with ``@group``.

    xdist's scheduler sends the tests whose ids share that suffix to one worker, so a module's
    fixtures are built once. xdist 3.8 sets the suffix on ``item._nodeid``, which pytest 9 no
    longer reads: every group was split over the workers and each built the fixtures again.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId  # pytest 9's id type; earlier ones read _nodeid

            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


@dataclasses.dataclass(frozen=True)
class S3Server:
    """A running S3-compatible server.

    Attributes:
        endpoint: ``host:port`` (plain HTTP).
        access_key: an access key it accepts (moto accepts any).
        secret_key: the matching secret key.
    """

    endpoint: str
    access_key: str = "kiln-test-access"
    secret_key: str = "kiln-test-secret"



def _answers(port: int) -> bool:
    """Whether an HTTP server answers on 127.0.0.1:port (any status counts)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        connection.request("GET", "/")
        connection.getresponse().read()
        return True
    except OSError:
        return False
    finally:
        connection.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """Start ``python -m moto.server`` on a free port, wait until it answers, stop it after."""
    with _moto_server(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="session")
def second_s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """Another S3 server, beside `s3_server`: data on an endpoint that is not the zoo's."""
    with _moto_server(tmp_path_factory) as server:
        yield S3Server(server.endpoint, access_key="second-access", secret_key="second-secret")


@contextlib.contextmanager
def _moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    port = client.free_port()
    log_path = tmp_path_factory.mktemp("moto") / "moto-server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + S3_SERVER_START_SECONDS
        while not _answers(port):
            if process.poll() is not None:
                pytest.fail(
                    f"moto S3 server exited with code {process.returncode} before answering "
                    f"on port {port}; its log:\n{log_path.read_text(errors='replace')[-3000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"moto S3 server did not answer on port {port} within "
                    f"{S3_SERVER_START_SECONDS:.0f} s; its log is {log_path}"
                )
            time.sleep(0.1)  # integration fixture: polling a starting server
        yield S3Server(endpoint=f"127.0.0.1:{port}")
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A bucket name no other test uses (the store under test creates it)."""
    return f"kiln-test-{uuid.uuid4().hex[:16]}"
