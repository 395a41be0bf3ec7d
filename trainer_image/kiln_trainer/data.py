"""Datasets for the trainer: `api.DatasetSpec` + input shape -> seeded train and validation splits.

Shapes: images Tensor[C, H, W] float32 with an int class label; text LongTensor[T] input and
LongTensor[T] target, where [C, H, W] or [T] is `spec.model.inputShape`. Never downloads unless
``spec.dataset.download`` asks; batching is `distributed.batching`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import PIL
import torch
import torchvision
from torch.nn import functional as F
from torch.utils import data as torch_data

from kiln import api

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
    """

    train: torch_data.Dataset[Sample]
    validation: torch_data.Dataset[Sample]
    modality: str
    num_classes: int | None
    description: str
    in_memory: bool = True


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
    return f"{spec.name} at {spec.path}" if spec.path else str(spec.name)


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


def load(spec: api.DatasetSpec, *, input_shape: Sequence[int], seed: int) -> Splits:
    """Load the dataset `spec` describes and split it by `seed` (`split_indices`).

    Four sources (`spec.dataset.name`):
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

    Images from files are resized to [H, W] (bilinear), converted to grayscale or RGB to match
    C, and scaled to [-1, 1]. ``flip-crop`` augmentation (`flip_crop`) touches the train split
    only, drawing from torch's global RNG, which checkpoints carry.

    Args:
        spec: the job's `spec.dataset`.
        input_shape: `spec.model.inputShape`: [C, H, W] for images, [T] for text.
        seed: split seed (`spec.training.seed`).

    Returns:
        The train and validation splits.

    Raises:
        DatasetError: the path is missing or empty, a text file is not UTF-8 text or too short
            for two windows, the torchvision class is unsupported or its data is absent, fewer
            than two samples, or a validationFraction leaving a split too small (see
            `split_indices`). An image file that cannot be decoded raises it later, when read.
    """
    shape = tuple(int(d) for d in input_shape)
    if spec.name == api.DatasetName.DIGITS:
        return _digits(spec, shape, seed)
    if spec.name == api.DatasetName.TEXT:
        return _text(spec, shape, seed)
    base, num_classes, description = _file_images(spec)
    train_idx, val_idx = split_indices(len(base), spec=spec, seed=seed)  # type: ignore[arg-type]
    train_tf = _file_image_transform(shape, augment=spec.augmentation == api.Augmentation.FLIP_CROP)
    val_tf = _file_image_transform(shape, augment=False)
    return Splits(
        _Subset(base, train_idx, train_tf), _Subset(base, val_idx, val_tf), "image", num_classes,
        description, in_memory=False,
    )



# ----------------------------------------------------------------------------------------------
# digits


def _digits(spec: api.DatasetSpec, shape: tuple[int, ...], seed: int) -> Splits:
    from sklearn import datasets as sk_datasets  # scikit-learn is slow to import; only here

    bunch = sk_datasets.load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32) / 16.0  # [N, 8, 8] in [0, 1]
    labels = torch.tensor(bunch.target, dtype=torch.long)
    channels, height, width = shape
    images = resize_images(images.unsqueeze(1), (height, width)).expand(-1, channels, -1, -1)
    train_idx, val_idx = split_indices(len(images), spec=spec, seed=seed)
    train_images = images[train_idx]
    mean, std = train_images.mean(), train_images.std().clamp_min(1e-6)
    augment = spec.augmentation == api.Augmentation.FLIP_CROP
    train = _TensorImages((train_images - mean) / std, labels[train_idx], augment=augment)
    validation = _TensorImages((images[val_idx] - mean) / std, labels[val_idx], augment=False)
    return Splits(train, validation, "image", 10, "digits")


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
# imagefolder and torchvision classes


def _file_images(spec: api.DatasetSpec) -> tuple[torch_data.Dataset[Any], int | None, str]:
    """The raw dataset (PIL images or tensors, int labels), its class count and description."""
    path = Path(spec.path or "")
    if spec.name == api.DatasetName.IMAGEFOLDER:
        if not path.is_dir():
            raise DatasetError(
                f"spec.dataset.path: {path} is not a directory; an imagefolder needs one "
                "sub-folder per class holding its images (e.g. cats/1.png, dogs/2.png)"
            )
        try:
            folder = torchvision.datasets.ImageFolder(str(path))
        except FileNotFoundError as exc:
            raise DatasetError(
                f"spec.dataset.path: {path} holds no class folders with images ({exc}); put "
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
            image = image.convert("L" if channels == 1 else "RGB")
            pixels = torchvision.transforms.functional.pil_to_tensor(image).float() / 255.0
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


def _text(spec: api.DatasetSpec, shape: tuple[int, ...], seed: int) -> Splits:
    path = Path(spec.path or "")
    raw = read_text_bytes(path)
    (length,) = shape
    windows = len(raw) // (length + 1)
    if windows < 2:
        raise DatasetError(
            f"spec.dataset.path: {path} has {len(raw)} bytes of text, too short for two windows "
            f"of inputShape [{length}] + 1 bytes (needs >= {2 * (length + 1)}); use more text "
            "or a shorter spec.model.inputShape"
        )
    tokens = torch.frombuffer(bytearray(raw[: windows * (length + 1)]), dtype=torch.uint8)
    tokens = tokens.view(windows, length + 1).long()
    train_idx, val_idx = split_indices(windows, spec=spec, seed=seed)
    return Splits(
        _Windows(tokens[train_idx]), _Windows(tokens[val_idx]), "text", None, f"text:{path}"
    )


def read_text_bytes(path: Path) -> bytes:
    """The bytes of a text file, or of every UTF-8 text file under a directory.

    A directory's files are taken recursively in sorted path order, joined by newlines;
    hidden entries, ``__pycache__`` and files that are not UTF-8 (binaries) are skipped.

    Raises:
        DatasetError: the path does not exist, or a directory holds no UTF-8 text file.
    """
    if path.is_file():
        content = path.read_bytes()
        if not _is_text(content):
            raise DatasetError(
                f"spec.dataset.path: {path} is not UTF-8 text (a binary file?); point it at a "
                "text file or a folder of them"
            )
        return content
    if not path.is_dir():
        raise DatasetError(
            f"spec.dataset.path: {path} does not exist; text needs a UTF-8 text file or a "
            "directory of them (e.g. a source tree)"
        )
    parts = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path).parts
        if any(part.startswith(".") or part == "__pycache__" for part in relative):
            continue
        content = file.read_bytes()
        if _is_text(content):
            parts.append(content)
    if not parts:
        raise DatasetError(
            f"spec.dataset.path: directory {path} holds no UTF-8 text files; point it at a "
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

