"""Datasets for the trainer: `api.DatasetSpec` + input shape -> seeded train and validation splits.

Shapes: images Tensor[C, H, W] float32 with an int class label; text LongTensor[T] input and
LongTensor[T] target, where [C, H, W] or [T] is `spec.model.inputShape`. Sources: the built-in
loaders (s3:// paths fetched once into a local cache), or the user's dataset entrypoint, whose
samples are checked as they are read. Batching is `distributed.batching`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import gzip
import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
from torch.nn import functional as F
from torch.utils import data as torch_data

from kiln import api, models
from kiln.models import entrypoints
from kiln.zoo import sources
from kiln_trainer import fingerprint

Transform = Callable[[Any], torch.Tensor]

Sample = tuple[torch.Tensor, torch.Tensor | int]


class DatasetError(ValueError):
    """The dataset cannot be loaded as specified; the message names the field and the fix."""


# Below this many samples in a split, accuracy and loss are noise; `split_indices` refuses a
# validationFraction that leaves fewer when the dataset has enough for both.
MIN_SPLIT_SAMPLES = 10


@dataclasses.dataclass(frozen=True)
class Splits:
    """A dataset cut into its training and validation parts.

    Attributes:
        train: training samples (augmented when the spec asks).
        validation: held-out samples, never augmented.
        modality: "image" or "text".
        num_classes: classes of an image dataset; None for text.
        description: short human name for logs, e.g. "digits" or "imagefolder:/data/pets".
        in_memory: samples are tensors in memory (no loader workers needed).
        max_target: an entrypoint dataset's largest target among its first samples (a class,
            or a token id), which the model's outputs must exceed; None for built-in loaders.
        fingerprint: what was loaded, with its kind (`kiln_trainer.fingerprint`); `load`
            sets it.
        vocab_size: text tokenized by a tokenizer.json: its vocabulary; None for bytes.
    """

    train: torch_data.Dataset[Sample]
    validation: torch_data.Dataset[Sample]
    modality: str
    num_classes: int | None
    description: str
    in_memory: bool = True
    max_target: int | None = None
    fingerprint: str | None = None
    vocab_size: int | None = None


def split_indices(n: int, *, spec: api.DatasetSpec, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, validation) index lists over `n` samples, after the maxSamples cap.

    A seeded permutation, so the same seed gives the same split on any machine: ``maxSamples``
    keeps its first N samples (a seeded random subset), the first
    ``round(N * validationFraction)`` of those validate, the rest train.

    Raises:
        DatasetError: fewer than two samples remain, so one split would be empty; or, with at
            least 2 * MIN_SPLIT_SAMPLES samples, validationFraction leaves one split fewer than
            MIN_SPLIT_SAMPLES.
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    if spec.max_samples is not None:
        order = order[: spec.max_samples]
    if len(order) < 2:
        raise DatasetError(
            f"spec.dataset: {_where(spec)} gives {len(order)} sample(s); training and "
            "validation need at least 2 (add data or raise spec.dataset.maxSamples)"
        )
    n_val = min(len(order) - 1, max(1, round(len(order) * spec.validation_fraction)))
    n_train = len(order) - n_val
    if len(order) >= 2 * MIN_SPLIT_SAMPLES and min(n_train, n_val) < MIN_SPLIT_SAMPLES:
        raise DatasetError(
            f"spec.dataset.validationFraction: {spec.validation_fraction} leaves {n_train} "
            f"training and {n_val} validation samples of {len(order)}; each split needs at "
            f"least {MIN_SPLIT_SAMPLES}, so use a fraction between "
            f"{MIN_SPLIT_SAMPLES / len(order):.3g} and {1 - MIN_SPLIT_SAMPLES / len(order):.3g}"
        )
    return order[n_val:], order[:n_val]


def _where(spec: api.DatasetSpec) -> str:
    return f"{spec.loader} at {spec.path}" if spec.path else str(spec.loader)


# Fixed scaling for file-backed images: [0, 1] -> [-1, 1]. Computing statistics would cost a
# pass over the data before training starts.
_FILE_IMAGE_MEAN = 0.5
_FILE_IMAGE_STD = 0.5

TORCHVISION_CLASSES: dict[str, tuple[dict[str, Any], int]] = {
    # name: (constructor arguments selecting the labelled training split, number of classes).
    # Exactly `api.TORCHVISION_CLASSES` (a unit test keeps them equal).
    "MNIST": ({"train": True}, 10),
    "FashionMNIST": ({"train": True}, 10),
    "KMNIST": ({"train": True}, 10),
    "QMNIST": ({"train": True}, 10),
    "USPS": ({"train": True}, 10),
    "CIFAR10": ({"train": True}, 10),
    "CIFAR100": ({"train": True}, 100),
    "SVHN": ({"split": "train"}, 10),
    "STL10": ({"split": "train"}, 10),  # the 5,000 labelled images, not "unlabeled"
}


def load(spec: api.DatasetSpec, *, input_shape: Sequence[int], seed: int,
         model: api.ModelSpec | None = None, environ: Mapping[str, str] | None = None
         ) -> Splits:
    """Load the dataset `spec` describes and split it by `seed` (`split_indices`).

    Five sources (`spec.dataset.name`, or `spec.dataset.entrypoint`):
      * ``digits``: scikit-learn's bundled handwritten digits (1,797 8x8 grayscale images, 10
        classes; nothing is downloaded), scaled to [0, 1], resized to [H, W] (bilinear),
        replicated to C channels, standardised with the training split's mean and std.
      * ``imagefolder``: a torchvision `ImageFolder` at ``path`` (one sub-folder per class).
      * ``torchvision``: a torchvision class by name (``torchvisionClass``, one of
        `TORCHVISION_CLASSES`) with root ``path``; its *training* split is held out by
        ``validationFraction`` like every other source (its test split stays untouched).
      * ``text``: a UTF-8 file (or a directory: its UTF-8 files concatenated in path order)
        read as bytes (tokens 0..255), cut into non-overlapping windows of T+1 bytes; a window
        gives input ``w[:T]`` and next-byte target ``w[1:]``.
      * an entrypoint: the user's callable, called with ``args``, returns (train, validation)
        map-style datasets of (input, target) pairs, used as they are (`from_entrypoint`).

    imagefolder and text read ``path`` (and ``validationPath``) from ``s3://bucket/prefix`` too
    (`fetch`). With ``validationPath``, all of ``path`` trains and ``validationPath``
    validates, each capped at ``maxSamples``; a file under both (the same real file) validates
    only, so the splits never share one. Folders are walked by `unique_files`: each real file
    counts once and symlink loops are cut. Images from files are resized to [H, W]
    (bilinear), converted to grayscale or RGB to match C, and scaled to [-1, 1]. ``flip-crop``
    augmentation (`flip_crop`) touches the train split only, drawing from torch's global RNG,
    which checkpoints carry.

    `Splits.fingerprint` says what was loaded (`kiln_trainer.fingerprint`): ``user:<value>``
    when ``spec.dataset.fingerprint`` is set (nothing is hashed); else ``content:sha256:…`` of
    digits' or a torchvision class's arrays, or of the files at ``path`` and ``validationPath``
    (relative path, size and SHA-256 of each; for s3:// the listing's sizes and ETags); for an
    entrypoint ``sample:sha256:…`` of its splits' lengths and first samples.

    Args:
        spec: the job's `spec.dataset`.
        input_shape: `spec.model.inputShape`: [C, H, W] for images, [T] for text.
        seed: split seed (`spec.training.seed`).
        model: the job's `spec.model`: the task and class count an entrypoint's samples are
            checked against (None: classification, classes unknown).
        environ: S3 endpoint and credentials (`kiln.contract.Env`) and the cache directory
            (default: `os.environ`).

    Returns:
        The train and validation splits, with their fingerprint.

    Raises:
        DatasetError: the path is missing or empty, a text file is not UTF-8 text or too short
            for two windows, the torchvision class is unsupported or its data is absent, fewer
            than two samples, nothing left to train on once files shared with validationPath
            are dropped, or a validationFraction leaving a split too small (see
            `split_indices`); an s3:// path that cannot be fetched (`fetch`); an entrypoint
            that fails or returns the wrong things (`from_entrypoint`). An image file that
            cannot be decoded, or an entrypoint sample that does not fit, raises it later, when
            read.
        zoo_store.StoreUnavailable: the S3 server did not answer.
    """
    shape = tuple(int(d) for d in input_shape)
    environ = os.environ if environ is None else environ
    source = None
    if spec.uri is not None:  # the local copy becomes the loader's path or the entrypoint's
        source = fetch(spec.uri, field="spec.dataset.uri", environ=environ,
                       secret=spec.secret_ref.name if spec.secret_ref else "")
        spec = spec.model_copy(update={"path": source.path} if spec.entrypoint is None else
                               {"args": {**spec.args, "path": source.path}})
    if spec.entrypoint is not None:
        splits = from_entrypoint(spec, shape, model=model)
        return dataclasses.replace(splits, fingerprint=fingerprint.user(spec.fingerprint)
                                   if spec.fingerprint else
                                   fingerprint.of_samples(splits.train, splits.validation))
    train = (source or fetch(spec.path, field="spec.dataset.path", environ=environ)
             if spec.path is not None else None)
    held_out = (fetch(spec.validation_path, field="spec.dataset.validationPath", environ=environ)
                if spec.validation_path is not None else None)
    local = spec.model_copy(update={"path": train.path if train else None,
                                    "validation_path": held_out.path if held_out else None})
    if local.loader == api.DatasetName.DIGITS:
        splits = _digits(local, shape, seed)
    elif local.loader == api.DatasetName.TEXT:
        splits = _text(local, shape, seed, tokenizer=tokenizer_file(model, environ))
    else:
        splits = _images(local, shape, seed)
    fetched = [where for where in (train, held_out) if where is not None]
    return dataclasses.replace(splits, fingerprint=_fingerprint(spec, splits, fetched))


def _fingerprint(spec: api.DatasetSpec, splits: Splits, fetched: Sequence[Fetched]) -> str:
    """What a built-in loader loaded: the job's own ``spec.dataset.fingerprint`` when it sets
    one (trusted; no file is hashed), else the arrays the loader hashed (digits, torchvision),
    else the files at ``path`` and ``validationPath`` (an s3:// listing's ETags and sizes)."""
    if spec.fingerprint:
        return fingerprint.user(spec.fingerprint)
    if splits.fingerprint is not None:
        return splits.fingerprint
    parts = []
    for where in fetched:
        root = Path(where.path)
        parts.append(where.fingerprint or fingerprint.of_files(
            root, unique_files(root) if root.is_dir() else [root]))
    return fingerprint.combined(parts)


def _images(spec: api.DatasetSpec, shape: tuple[int, ...], seed: int) -> Splits:
    """An imagefolder or torchvision dataset, split (`load`)."""
    if spec.validation_path is None:
        base, num_classes, description = _file_images(spec)
        val_base = base
        train_idx, val_idx = split_indices(len(base), spec=spec, seed=seed)  # type: ignore[arg-type]
    else:
        # A file in both folders would be graded on what it trained on: validation keeps it.
        val_base, _, _ = _file_images(spec, validation=True)
        shared = real_paths([path for path, _ in getattr(val_base, "samples", [])])
        base, num_classes, description = _file_images(spec, exclude=shared)
        mine, theirs = getattr(base, "classes", []), getattr(val_base, "classes", [])
        if mine != theirs:
            raise DatasetError(
                f"spec.dataset.validationPath: its class folders ({', '.join(theirs)}) differ "
                f"from spec.dataset.path's ({', '.join(mine)}); give both the same class folders"
            )
        if len(base) == 0:  # type: ignore[arg-type]
            raise DatasetError(
                f"spec.dataset.path: every image in {spec.path} is also in "
                f"spec.dataset.validationPath ({spec.validation_path}), and validation keeps "
                "shared files, so nothing is left to train on; point the two fields at "
                "separate folders"
            )
        train_idx = _capped(len(base), spec=spec, seed=seed)  # type: ignore[arg-type]
        val_idx = _capped(len(val_base), spec=spec, seed=seed)  # type: ignore[arg-type]
    train_tf = _file_image_transform(shape, augment=spec.augmentation == api.Augmentation.FLIP_CROP)
    val_tf = _file_image_transform(shape, augment=False)
    return Splits(
        _Subset(base, train_idx, train_tf), _Subset(val_base, val_idx, val_tf), "image",
        num_classes, description, in_memory=False, fingerprint=_arrays_fingerprint(base),
    )


def _arrays_fingerprint(dataset: Any) -> str | None:
    """The content fingerprint of a torchvision dataset that holds its samples as one array
    (MNIST, CIFAR, SVHN, STL10, USPS: ``data`` and ``targets`` or ``labels``); else None."""
    arrays = getattr(dataset, "data", None)
    targets = getattr(dataset, "targets", getattr(dataset, "labels", None))
    if not isinstance(arrays, torch.Tensor | np.ndarray) or targets is None:
        return None
    return fingerprint.of_arrays(arrays, targets)


def _capped(n: int, *, spec: api.DatasetSpec, seed: int) -> list[int]:
    """All `n` indices, or a seeded random `maxSamples` of them (a separate validation set)."""
    if spec.max_samples is None or spec.max_samples >= n:
        return list(range(n))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[: spec.max_samples])


# ----------------------------------------------------------------------------------------------
# s3:// data: fetched once into a local cache, then read like a local path


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A dataset path made local.

    Attributes:
        path: the local file or folder.
        fingerprint: for s3:// data, the content fingerprint of its listing (relative keys,
            sizes, ETags: `fingerprint.listed`), so nothing is read twice; None for a local path.
    """

    path: str
    fingerprint: str | None = None


def fetch(path: str, *, field: str, environ: Mapping[str, str], secret: str = "") -> Fetched:
    """A local path for `path`: itself, or for ``s3://bucket/prefix`` (or hf://) a cached copy.

    Without `secret` the S3 server is the zoo's (``KILN_ZOO_ENDPOINT``, its credentials and
    region); the copy is `kiln.zoo.sources.local_copy`'s: the initializer's (``$KILN_SOURCES``)
    or one downloaded now into ``$KILN_DATA_CACHE``, named by the listing's content and renamed
    into place only once complete and checked, so a crash never leaves half a dataset and
    concurrent trainers never see one. The listing also gives the data's fingerprint
    (`Fetched`), so the copy is never read again to hash it.

    Raises:
        DatasetError: no endpoint set, bad credentials, no such bucket, nothing under the prefix,
            an object key that would leave the cache folder, no Hub for hf://, or a local
            spec.dataset.uri that does not exist.
        zoo_store.StoreUnavailable: the server did not answer.
    """
    if "://" not in path:
        if field == "spec.dataset.uri" and not Path(path).exists():
            # The loaders name spec.dataset.path, which a job with a uri never set.
            raise DatasetError(f"{field}: {path} does not exist on this machine; give an "
                               "existing file or folder, or an s3:// URI")
        return Fetched(path)
    try:
        got = sources.local_copy(path, field=field, secret=secret, environ=environ)
    except sources.SourceError as exc:
        raise DatasetError(str(exc)) from None
    if not got.objects:
        return Fetched(got.path)
    content = []  # as a local copy's fingerprint names files: relative, a lone file ""
    for o in got.objects:
        relative = "" if got.single else o.relative
        if not fingerprint.skipped(relative):
            content.append((relative, o.size, o.etag))
    return Fetched(got.path, fingerprint.listed(content))


# ----------------------------------------------------------------------------------------------
# digits


def _digits(spec: api.DatasetSpec, shape: tuple[int, ...], seed: int) -> Splits:
    pixels, targets = digits_arrays()
    images = torch.tensor(pixels, dtype=torch.float32) / 16.0  # [N, 8, 8] in [0, 1]
    labels = torch.tensor(targets, dtype=torch.long)
    channels, height, width = shape
    images = resize_images(images.unsqueeze(1), (height, width)).expand(-1, channels, -1, -1)
    train_idx, val_idx = split_indices(len(images), spec=spec, seed=seed)
    train_images = images[train_idx]
    mean, std = train_images.mean(), train_images.std().clamp_min(1e-6)
    augment = spec.augmentation == api.Augmentation.FLIP_CROP
    train = _TensorImages((train_images - mean) / std, labels[train_idx], augment=augment)
    validation = _TensorImages((images[val_idx] - mean) / std, labels[val_idx], augment=False)
    return Splits(train, validation, "image", 10, "digits",
                  fingerprint=fingerprint.of_arrays(pixels, targets))


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as `sklearn.datasets.load_digits` gives them: images float64
    [1797, 8, 8] in 0..16 and labels int64 [1797], read from the file it ships. Importing
    scikit-learn (it imports SciPy) costs a trainer about 1 s of CPU, more than training on it.
    """
    found = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError("dataset digits needs scikit-learn; pip install scikit-learn")
    path = Path(found.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        table = np.loadtxt(lines, delimiter=",")  # 64 pixels, then the label
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def resize_images(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of Tensor[N, C, H0, W0] to Tensor[N, C, H, W] (a copy when unchanged)."""
    if tuple(images.shape[-2:]) == size:
        return images.clone()
    return F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=True)


class _TensorImages(torch_data.Dataset[Sample]):
    """In-memory images Tensor[N, C, H, W] with labels LongTensor[N]."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, augment: bool) -> None:
        self.images = images.contiguous()
        self.labels = labels
        self.augment = augment

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> Sample:
        image = self.images[index]
        return (flip_crop(image) if self.augment else image), self.labels[index]


def flip_crop(image: torch.Tensor) -> torch.Tensor:
    """Random horizontal flip, then a random H x W crop of the image zero-padded by H/8.

    Args:
        image: Tensor[C, H, W], standardised (so zero padding is the mean).

    Returns:
        Tensor[C, H, W]; randomness from torch's global RNG.
    """
    if bool(torch.rand(()) < 0.5):
        image = image.flip(-1)
    height, width = image.shape[-2:]
    pad = max(1, round(height / 8))
    padded = F.pad(image, (pad, pad, pad, pad))
    top, left = (int(v) for v in torch.randint(0, 2 * pad + 1, (2,)))
    return padded[:, top : top + height, left : left + width]


# ----------------------------------------------------------------------------------------------
# walking dataset folders


def unique_files(root: Path) -> list[Path]:
    """Every file under `root`, each real file once, in sorted path order.

    Symlinked folders are followed, but a folder whose real path was already walked is skipped
    (a link back to an ancestor would otherwise repeat the tree until the OS gives up), and a
    file reached by a second path (a symlink, or a linked folder) counts only the first time.
    """
    seen_dirs: set[str] = set()
    seen_files: set[str] = set()
    files: list[Path] = []

    def walk(folder: Path) -> None:
        real = os.path.realpath(folder)
        if real in seen_dirs:
            return
        seen_dirs.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError:  # unreadable or vanished folder: nothing to count
            return
        for entry in entries:
            path = Path(entry.path)
            if entry.is_dir():  # follows symlinks; the real-path check above stops loops
                walk(path)
            elif entry.is_file():
                real_file = os.path.realpath(path)
                if real_file not in seen_files:
                    seen_files.add(real_file)
                    files.append(path)

    walk(root)
    return files


def real_paths(files: Sequence[str | Path]) -> frozenset[str]:
    """The real (symlink-free, absolute) paths of `files`."""
    return frozenset(os.path.realpath(file) for file in files)


@functools.cache
def _image_folder() -> type[Any]:
    """torchvision's `ImageFolder` walked by `unique_files`: no symlink loops, no file twice
    (within a class or across classes), and none whose real path is in `exclude`. Hidden
    entries (a name starting with '.') are neither classes nor images, as the text loader and
    the data's fingerprint skip them too (a ``.trash`` folder is no class). Made on first use:
    importing torchvision costs every trainer about half a second of CPU."""
    import torchvision

    class ImageFolder(torchvision.datasets.ImageFolder):  # type: ignore[misc]  # untyped base
        def __init__(self, root: str, *, exclude: frozenset[str]) -> None:
            self._exclude = exclude
            super().__init__(root)

        def find_classes(self, directory: str | Path) -> tuple[list[str], dict[str, int]]:
            classes, _ = super().find_classes(directory)
            visible = [name for name in classes if not name.startswith(".")]
            if not visible:
                raise FileNotFoundError(f"found no class folder in {directory}")
            return visible, {name: i for i, name in enumerate(visible)}

        def make_dataset(  # an instance method: it needs `exclude`, torchvision calls it on self
            self, directory: str | Path, class_to_idx: dict[str, int],
            extensions: tuple[str, ...] | None = None,
            is_valid_file: Callable[[str], bool] | None = None, allow_empty: bool = False,
        ) -> list[tuple[str, int]]:
            seen = set(self._exclude)
            instances = []
            for name in sorted(class_to_idx):
                found = False
                for path in unique_files(Path(directory) / name):
                    if fingerprint.skipped(path.relative_to(Path(directory) / name).as_posix()):
                        continue
                    valid = (is_valid_file(str(path)) if is_valid_file is not None else
                             extensions is not None and path.name.lower().endswith(extensions))
                    if not valid:
                        continue
                    found = True
                    real = os.path.realpath(path)
                    if real not in seen:
                        seen.add(real)
                        instances.append((str(path), class_to_idx[name]))
                if not found and not allow_empty:
                    raise FileNotFoundError(f"found no image file for the class {name}; supported "
                                            f"extensions are {', '.join(extensions or ())}")
            return instances

    return ImageFolder


# ----------------------------------------------------------------------------------------------
# imagefolder and torchvision classes


def _file_images(spec: api.DatasetSpec, *, validation: bool = False,
                 exclude: frozenset[str] = frozenset()
                 ) -> tuple[torch_data.Dataset[Any], int | None, str]:
    """The raw dataset (PIL images or tensors, int labels), its class count and description;
    with `validation`, the imagefolder at validationPath; an imagefolder leaves out the files
    whose real paths are in `exclude`."""
    path = Path((spec.validation_path if validation else spec.path) or "")
    field = "spec.dataset.validationPath" if validation else "spec.dataset.path"
    if spec.loader == api.DatasetName.IMAGEFOLDER:
        if not path.is_dir():
            raise DatasetError(
                f"{field}: {path} is not a directory; an imagefolder needs one "
                "sub-folder per class holding its images (e.g. cats/1.png, dogs/2.png)"
            )
        try:
            folder = _image_folder()(str(path), exclude=exclude)
        except FileNotFoundError as exc:
            raise DatasetError(
                f"{field}: {path} holds no class folders with images ({exc}); put "
                "one sub-folder per class with .png/.jpg files in it"
            ) from None
        return folder, len(folder.classes), f"imagefolder:{path}"
    name = spec.torchvision_class or ""
    if name not in TORCHVISION_CLASSES:  # api.validate refuses these; a job that skipped it
        close = difflib.get_close_matches(name, list(TORCHVISION_CLASSES), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise DatasetError(
            f"spec.dataset.torchvisionClass: {name!r} is not a supported torchvision dataset; "
            f"{hint}use one of {', '.join(TORCHVISION_CLASSES)}"
        )
    if not spec.download and not path.exists():
        raise DatasetError(
            f"spec.dataset.path: {path} does not exist, so torchvision {name} has no data "
            "(download is off); put the dataset there or set spec.dataset.download: true"
        )
    import torchvision  # here: see `_image_folder`

    split_kwargs, num_classes = TORCHVISION_CLASSES[name]
    dataset = _construct(getattr(torchvision.datasets, name), path, download=spec.download,
                         split_kwargs=split_kwargs)
    return dataset, num_classes, f"torchvision:{name}"


def _construct(
    cls: type[Any], path: Path, *, download: bool, split_kwargs: dict[str, Any]
) -> torch_data.Dataset[Any]:
    kwargs: dict[str, Any] = {"root": str(path), "download": download, **split_kwargs}
    try:
        dataset: torch_data.Dataset[Any] = cls(**kwargs)
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        fix = (
            "check the path and your network" if download else
            "put the dataset there in torchvision's layout or set spec.dataset.download: true"
        )
        raise DatasetError(
            f"spec.dataset.path: torchvision {cls.__name__} could not load its data from "
            f"{path} ({exc}); {fix}"
        ) from None
    return dataset


def _file_image_transform(shape: tuple[int, ...], *, augment: bool) -> Transform:
    channels, height, width = shape

    def transform(image: Any) -> torch.Tensor:
        if isinstance(image, torch.Tensor):
            pixels = image.float()
            if image.dtype == torch.uint8:
                pixels = pixels / 255.0
            if pixels.ndim == 2:
                pixels = pixels.unsqueeze(0)
        else:  # PIL image (ImageFolder and most torchvision classes)
            from torchvision.transforms import functional as vision_functional

            image = image.convert("L" if channels == 1 else "RGB")
            pixels = vision_functional.pil_to_tensor(image).float() / 255.0
        pixels = _match_channels(pixels, channels)
        pixels = resize_images(pixels.unsqueeze(0), (height, width))[0]
        pixels = (pixels - _FILE_IMAGE_MEAN) / _FILE_IMAGE_STD
        return flip_crop(pixels) if augment else pixels

    return transform


def _match_channels(pixels: torch.Tensor, channels: int) -> torch.Tensor:
    """Tensor[C0, H, W] -> Tensor[channels, H, W]: grey replicated, RGB averaged (ITU-R 601)."""
    if pixels.shape[0] == channels:
        return pixels
    if channels == 3:
        return pixels[:3] if pixels.shape[0] >= 3 else pixels[:1].expand(3, -1, -1)
    weights = torch.tensor([0.299, 0.587, 0.114])[: pixels.shape[0]]
    return (pixels[:3] * (weights / weights.sum()).view(-1, 1, 1)).sum(0, keepdim=True)


class _Subset(torch_data.Dataset[Sample]):
    """`indices` of a raw dataset with a per-split transform."""

    def __init__(self, base: torch_data.Dataset[Any], indices: list[int], transform: Transform):
        self.base, self.indices, self.transform = base, indices, transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Sample:
        position = self.indices[index]
        try:
            image, label = self.base[position]
        except OSError as exc:  # PIL.UnidentifiedImageError, truncated files, I/O errors
            samples = getattr(self.base, "samples", None)  # ImageFolder: [(path, class), ...]
            where = samples[position][0] if samples else f"sample {position}"
            why = ("not an image format PIL knows" if isinstance(exc, PIL.UnidentifiedImageError)
                   else exc.strerror or str(exc))
            raise DatasetError(
                f"spec.dataset.path: cannot read image {where} ({why}); remove or fix the file"
            ) from None
        return self.transform(image), int(label)


# ----------------------------------------------------------------------------------------------
# text


TOKENIZER_FILE = "tokenizer.json"  # a `tokenizers` tokenizer, as Hugging Face saves it


def tokenizer_file(model: api.ModelSpec | None, environ: Mapping[str, str]) -> Path | None:
    """The tokenizer.json shipped beside the job's pretrained weights (a Hugging Face
    directory at spec.model.pretrained.uri), or None: text stays byte-level.

    Raises:
        DatasetError: the pretrained weights cannot be made local (`fetch`), or a
            tokenizer.json beside them is no file.
    """
    if model is None or model.pretrained is None:
        return None
    ref = model.pretrained.secret_ref
    weights = Path(fetch(model.pretrained.uri, field="spec.model.pretrained.uri",
                         environ=environ, secret=ref.name if ref else "").path)
    found = weights / TOKENIZER_FILE
    if found.exists() and not found.is_file():  # silently byte-level would mislead
        raise DatasetError(f"spec.model.pretrained.uri: {found} is no file; put the tokenizer "
                           "there as tokenizer.save() writes it, or remove it for byte-level "
                           "text")
    return found if found.is_file() else None


def _text(spec: api.DatasetSpec, shape: tuple[int, ...], seed: int, *,
          tokenizer: Path | None = None) -> Splits:
    """Text cut into windows of byte tokens, or of `tokenizer`'s tokens (`load`)."""
    path = Path(spec.path or "")
    (length,) = shape
    encode, vocab = _encoder(tokenizer)
    windows_of = functools.partial(_token_windows, encode=encode,
                                      unit="bytes" if tokenizer is None else "tokens")
    if spec.validation_path is None:
        tokens = windows_of(path, length, field="spec.dataset.path", least=2)
        train_idx, val_idx = split_indices(len(tokens), spec=spec, seed=seed)
        train, validation = tokens[train_idx], tokens[val_idx]
    else:
        val_path = Path(spec.validation_path)
        val_tokens = windows_of(val_path, length, least=1,
                                   field="spec.dataset.validationPath")
        # As for images: a file under both paths validates and is left out of training.
        shared = real_paths([val_path] if val_path.is_file() else unique_files(val_path))
        tokens = windows_of(path, length, field="spec.dataset.path", least=1, exclude=shared)
        train = tokens[_capped(len(tokens), spec=spec, seed=seed)]
        validation = val_tokens[_capped(len(val_tokens), spec=spec, seed=seed)]
    description = f"text:{path}" + (f" ({tokenizer})" if tokenizer is not None else "")
    return Splits(_Windows(train), _Windows(validation), "text", None, description,
                  vocab_size=vocab)


def _encoder(tokenizer: Path | None) -> tuple[Callable[[bytes], torch.Tensor], int | None]:
    """Text bytes -> token ids LongTensor[N]: the bytes themselves, or `tokenizer`'s ids;
    with its vocabulary size (None: bytes).

    Raises:
        DatasetError: the tokenizer.json cannot be read.
    """
    if tokenizer is None:
        return lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.uint8).long(), None
    try:
        import tokenizers
    except ImportError:
        raise DatasetError(f"spec.model.pretrained.uri: {tokenizer} needs the tokenizers "
                           "package (pip install 'kiln-operator[trainer]', as the trainer's "
                           "image has it), or remove it for byte-level text") from None
    try:
        loaded = tokenizers.Tokenizer.from_file(str(tokenizer))
    except Exception as exc:  # noqa: BLE001  # the Rust library raises plain Exceptions
        raise DatasetError(f"spec.model.pretrained.uri: {tokenizer} is not a tokenizers "
                           f"tokenizer.json ({exc}); save it with tokenizer.save() or remove "
                           "it for byte-level text") from None

    def encode(raw: bytes) -> torch.Tensor:
        return torch.tensor(loaded.encode(raw.decode("utf-8"), add_special_tokens=False).ids,
                            dtype=torch.long)

    return encode, int(loaded.get_vocab_size())


def _token_windows(path: Path, length: int, *, field: str, least: int,
                   encode: Callable[[bytes], torch.Tensor], unit: str,
                   exclude: frozenset[str] = frozenset()) -> torch.Tensor:
    """The text at `path` (less the files whose real paths are in `exclude`) as token windows
    LongTensor[N, T+1] (`encode`: bytes or a tokenizer's ids), at least `least` of them."""
    ids = encode(read_text_bytes(path, field=field, exclude=exclude))
    windows = len(ids) // (length + 1)
    if windows < least:
        raise DatasetError(
            f"{field}: {path} has {len(ids)} {unit} of text, too short for {least} window(s) "
            f"of inputShape [{length}] + 1 {unit} (needs >= {least * (length + 1)}); use more "
            "text or a shorter spec.model.inputShape"
        )
    return ids[: windows * (length + 1)].view(windows, length + 1)


def read_text_bytes(path: Path, *, field: str = "spec.dataset.path",
                    exclude: frozenset[str] = frozenset()) -> bytes:
    """The bytes of a text file, or of every UTF-8 text file under a directory.

    A directory's files are taken recursively in sorted path order (`unique_files`: each real
    file once, symlink loops cut), joined by newlines; hidden entries, ``__pycache__``, files
    that are not UTF-8 (binaries) and files whose real paths are in `exclude` are skipped.

    Raises:
        DatasetError: the path does not exist, a directory holds no UTF-8 text file, or every
            text file is excluded (it is also the validation text).
    """
    if path.is_file() and os.path.realpath(path) in exclude:
        raise DatasetError(
            f"{field}: {path} is also spec.dataset.validationPath, and validation keeps shared "
            "files, so nothing is left to train on; point the two fields at different text"
        )
    if path.is_file():
        content = path.read_bytes()
        if not _is_text(content):
            raise DatasetError(
                f"{field}: {path} is not UTF-8 text (a binary file?); point it at a "
                "text file or a folder of them"
            )
        return content
    if not path.is_dir():
        raise DatasetError(
            f"{field}: {path} does not exist; text needs a UTF-8 text file or a "
            "directory of them (e.g. a source tree)"
        )
    parts = []
    dropped = 0
    for file in unique_files(path):
        relative = file.relative_to(path).parts
        if any(part.startswith(".") or part == "__pycache__" for part in relative):
            continue
        if os.path.realpath(file) in exclude:
            dropped += 1
            continue
        content = file.read_bytes()
        if _is_text(content):
            parts.append(content)
    if not parts and dropped:
        raise DatasetError(
            f"{field}: every text file in {path} is also under spec.dataset.validationPath, "
            "and validation keeps shared files, so nothing is left to train on; point the two "
            "fields at separate folders"
        )
    if not parts:
        raise DatasetError(
            f"{field}: directory {path} holds no UTF-8 text files; point it at a "
            "text file or a folder of them"
        )
    return b"\n".join(parts)


def _is_text(content: bytes) -> bool:
    """UTF-8 without NUL bytes: text, not a binary that happens to decode."""
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\0" not in content


class _Windows(torch_data.Dataset[Sample]):
    """Byte windows LongTensor[N, T+1] -> (input LongTensor[T], target LongTensor[T])."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> Sample:
        window = self.windows[index]
        return window[:-1], window[1:]


# ----------------------------------------------------------------------------------------------
# the user's dataset entrypoint

ENTRYPOINT_FIELD = "spec.dataset.entrypoint"
# Samples of each split read and checked before training starts; the rest are checked as read.
CHECKED_SAMPLES = 8
# An epoch's order is torch.randperm(n).tolist(): 8 bytes a sample in the tensor, then a list
# of Python ints (about 40). A dataset claiming more than a billion samples would need tens of
# GB for its order alone (and fail as "out of memory"); no real map-style dataset is that long.
INDEX_BYTES = 48
MAX_SPLIT_SAMPLES = 10**9


def from_entrypoint(spec: api.DatasetSpec, shape: tuple[int, ...], *,
                    model: api.ModelSpec | None = None) -> Splits:
    """The (train, validation) datasets `spec.dataset.entrypoint(**args)` returns, checked.

    Every sample must be an (input, target) pair: the input a tensor (or anything
    `torch.as_tensor` takes; float64 becomes float32) of shape `shape`; for classification the
    target an integer class >= 0 (below ``spec.model.args.num_classes`` when set, and below the
    model's outputs: `check_targets`); for a language model input and target integer token ids
    of shape `shape`. The first CHECKED_SAMPLES of each split are checked here, the rest as
    they are read.

    Raises:
        DatasetError: naming spec.dataset.entrypoint and, when the user's code raised, its file
            and line: the entrypoint cannot be imported or called, it returned something other
            than two non-empty map-style datasets, one says it is longer than MAX_SPLIT_SAMPLES,
            or a first sample does not fit.
    """
    entrypoint = str(spec.entrypoint)
    language = model is not None and models.task_of(model) is models.Task.LANGUAGE_MODELING
    try:
        returned = entrypoints.call(entrypoint, spec.args, field=ENTRYPOINT_FIELD)
    except models.EntrypointError as exc:
        raise DatasetError(str(exc)) from None
    if not (isinstance(returned, tuple | list) and len(returned) == 2):
        raise DatasetError(
            f"{ENTRYPOINT_FIELD}: {entrypoint} returned {_kind(returned)}; return (train, "
            "validation), two map-style torch Datasets of (input, target) pairs"
        )
    declared = model.args.get("num_classes") if model is not None and not language else None
    num_classes = declared if isinstance(declared, int) and not isinstance(declared, bool) else None
    checked = []
    for split, dataset in zip(("train", "validation"), returned, strict=True):
        if isinstance(dataset, str | bytes) or not (
                hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise DatasetError(
                f"{ENTRYPOINT_FIELD}: the {split} split {entrypoint} returned is "
                f"{_kind(dataset)}, not a map-style Dataset (with __len__ and __getitem__); "
                "return e.g. a torch.utils.data.TensorDataset"
            )
        wrapped = _Checked(dataset, split=split, entrypoint=entrypoint, shape=shape,
                           language=language, limit=num_classes)
        size = len(wrapped)
        if size < 1:
            raise DatasetError(f"{ENTRYPOINT_FIELD}: the {split} split of {entrypoint} is "
                               "empty; give it at least one sample")
        if size > MAX_SPLIT_SAMPLES:
            raise DatasetError(
                f"{ENTRYPOINT_FIELD}: the {split} split of {entrypoint} says it holds "
                f"{size:,} samples (its __len__ returned {size}); the trainer shuffles an index "
                f"of every sample each epoch, about {INDEX_BYTES} bytes each, so a split holds at "
                f"most {MAX_SPLIT_SAMPLES:,}: make __len__ return how many samples __getitem__ "
                "serves, or return a part of the data")
        checked.append(wrapped)
    train, validation = checked
    first = [ds[i] for ds in checked for i in range(min(CHECKED_SAMPLES, len(ds)))]
    max_target = max(_max_target(target) for _, target in first)
    return Splits(train, validation, "text" if language else "image",
                  None if language else num_classes, f"entrypoint:{entrypoint}",
                  in_memory=False, max_target=max_target)


def check_targets(splits: Splits, outputs: int) -> None:
    """Refuse targets the model cannot predict: an entrypoint's targets must be < `outputs`
    (the model's output size, for a language model its vocabulary); later samples are checked
    against it as they are read.

    Raises:
        DatasetError: a first sample's target is `outputs` or more.
    """
    if splits.max_target is None:
        return
    if splits.max_target >= outputs:
        raise DatasetError(
            f"{ENTRYPOINT_FIELD}: a target among the first samples is {splits.max_target}, out "
            f"of range for the model's {outputs} outputs (counted from the model's output); "
            f"return targets in 0..{outputs - 1}, or give the model more outputs"
        )
    for dataset in (splits.train, splits.validation):
        if isinstance(dataset, _Checked) and dataset.limit is None:
            dataset.limit, dataset.limit_source = outputs, "the model's outputs"


def _kind(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def _max_target(target: torch.Tensor | int) -> int:
    return int(target.max()) if isinstance(target, torch.Tensor) else int(target)


class _Checked(torch_data.Dataset[Sample]):
    """A user's dataset whose samples are checked (and made tensors) as they are read."""

    def __init__(self, dataset: Any, *, split: str, entrypoint: str, shape: tuple[int, ...],
                 language: bool, limit: int | None) -> None:
        self.dataset, self.split, self.entrypoint = dataset, split, entrypoint
        self.shape, self.language = shape, language
        self.limit = limit  # targets must be below it; None: not known yet
        self.limit_source = "spec.model.args.num_classes"

    def __len__(self) -> int:
        try:
            return len(self.dataset)
        except Exception as exc:  # noqa: BLE001  # any error in the user's code
            raise DatasetError(self._raised("len()", exc)) from None

    def __getitem__(self, index: int) -> Sample:
        try:
            sample = self.dataset[index]
        except Exception as exc:  # noqa: BLE001  # any error in the user's code
            raise DatasetError(self._raised(f"[{index}]", exc)) from None
        where = f"{ENTRYPOINT_FIELD}: {self.split}[{index}] of {self.entrypoint}"
        if not (isinstance(sample, tuple | list) and len(sample) == 2):
            raise DatasetError(f"{where} is {_kind(sample)}, not an (input, target) pair; "
                               "return (input, target) from __getitem__")
        inputs = self._tensor(sample[0], f"{where}: the input")
        if tuple(inputs.shape) != self.shape:
            raise DatasetError(f"{where}: the input has shape {list(inputs.shape)} but "
                               f"spec.model.inputShape is {list(self.shape)}; make them equal")
        if self.language:
            inputs, tokens = self._tokens(inputs, sample[1], where)
            target: torch.Tensor | int = tokens
            low, high = int(min(inputs.min(), tokens.min())), int(max(inputs.max(), tokens.max()))
        else:
            target = low = high = self._label(sample[1], where)
        if low < 0:
            raise DatasetError(f"{where}: a target is {low}; classes and token ids start at 0")
        if self.limit is not None and high >= self.limit:
            raise DatasetError(f"{where}: a target is {high}, out of range for {self.limit} "
                               f"classes ({self.limit_source}); return targets in "
                               f"0..{self.limit - 1}")
        if inputs.dtype == torch.float64:
            inputs = inputs.float()
        return inputs, target

    def _tensor(self, value: Any, what: str) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise DatasetError(f"{what} is {_kind(value)}, not a tensor (or a number, list or "
                               "array torch.as_tensor takes); convert it, e.g. with "
                               "torchvision.transforms.functional.pil_to_tensor") from None

    def _tokens(self, inputs: torch.Tensor, value: Any, where: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A language model's (input, target) as LongTensor[T] token ids."""
        target = self._tensor(value, f"{where}: the target")
        for name, tensor in (("input", inputs), ("target", target)):
            if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
                raise DatasetError(f"{where}: the {name} is {tensor.dtype}, but a language "
                                   "model takes integer token ids; return a LongTensor")
        if tuple(target.shape) != self.shape:
            raise DatasetError(f"{where}: the target has shape {list(target.shape)}; a "
                               "language model needs next-token ids of shape "
                               f"{list(self.shape)}, like the input")
        return inputs.long(), target.long()

    def _label(self, value: Any, where: str) -> int:
        tensor = value if isinstance(value, torch.Tensor) else None
        if tensor is None and not isinstance(value, bool):
            try:
                tensor = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError):
                tensor = None
        integral = tensor is not None and tensor.numel() == 1 and not (
            tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)
        if tensor is None or not integral:
            raise DatasetError(f"{where}: the target is {value!r:.80}, not an integer class "
                               "label; return an int (or a 0-d integer tensor) for "
                               "classification, or set spec.model.task: language_model")
        return int(tensor.item())

    def _raised(self, what: str, exc: BaseException) -> str:
        if exc.__traceback__ is not None:  # the tail starts in the user's code, not this frame
            exc = exc.with_traceback(exc.__traceback__.tb_next)
        text = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
        tail = entrypoints.traceback_tail(exc)
        return (f"{ENTRYPOINT_FIELD}: {self.split}{what} of {self.entrypoint} raised {detail}"
                + (f" (at {tail})" if tail else ""))

