"""Fixtures of the benchmark scripts' unit tests: a script loaded as a module, nothing run."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


@pytest.fixture(scope="module")
def load_bench() -> Iterator[Callable[[str], ModuleType]]:
    """Load bench/<name>.py as the module `<name>_bench`; unloaded after the test module."""
    loaded: list[str] = []

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
        # A script puts bench/ first on sys.path (its bench/operator.py would then shadow the
        # standard library's operator in every subprocess started later with this path) and
        # sets OMP_NUM_THREADS: a script's set-up, undone here for the tests that follow.
        path, threads = list(sys.path), os.environ.get("OMP_NUM_THREADS")
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path[:] = path
            if threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
        loaded.append(spec.name)
        return module

    yield load
    for name in loaded:
        del sys.modules[name]
