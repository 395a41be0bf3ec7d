"""The unit tier's markers: `make check` leaves out the tests marked `process` or `training`.

A unit test that starts a process without the `process` marker, in its body or in a fixture it
sets up, fails at teardown naming the marker, so the quick tier stays free of processes. Tests
that use the moto S3 server (`s3_server`, a process) are marked here.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: F401 (its import runs `ldconfig -p` once: not a test's process)

UNIT = Path(__file__).parent
_STARTED = pytest.StashKey[list[str]]()
_PATCH = pytest.StashKey[pytest.MonkeyPatch]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(UNIT) and "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.process)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """Before any fixture of an unmarked test: record every process it starts."""
    if item.get_closest_marker("process") is None:
        started: list[str] = []
        patch = pytest.MonkeyPatch()
        popen_init = subprocess.Popen.__init__
        process_start = multiprocessing.process.BaseProcess.start

        def recording_popen_init(self: subprocess.Popen[Any], args: Any, *rest: Any,
                                 **kwargs: Any) -> None:
            started.append(f"subprocess {args!r}"[:200])
            popen_init(self, args, *rest, **kwargs)

        def recording_start(self: multiprocessing.process.BaseProcess) -> None:
            started.append(f"multiprocessing {self.name}")
            process_start(self)

        patch.setattr(subprocess.Popen, "__init__", recording_popen_init)
        patch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
        item.stash[_STARTED], item.stash[_PATCH] = started, patch
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """After the test's teardown: fail it if it started a process unmarked."""
    try:
        return (yield)
    finally:
        if _PATCH in item.stash:
            item.stash[_PATCH].undo()
            started = item.stash[_STARTED]
            if started:
                pytest.fail(f"started {len(started)} process(es) without the `process` marker, "
                            f"first {started[0]}; mark it @pytest.mark.process (`make check` "
                            "leaves such tests out)", pytrace=False)
