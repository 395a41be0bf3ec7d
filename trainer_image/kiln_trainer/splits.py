"""A loaded dataset's two parts, and the seeded split that makes them: `Splits`, `split_indices`.

The split is a seeded permutation: ``maxSamples`` keeps its first N samples (a seeded random
subset), the first ``round(N * validationFraction)`` of those validate, the rest train. So the
same seed always gives the same split, on any machine. A split left with fewer than
`MIN_SPLIT_SAMPLES` samples is refused (when the dataset has enough for both), as is a
dataset of fewer than two samples, with `DatasetError` naming the field and the fix.

Callers: `kiln_trainer.data`, whose sources build `Splits` through `split_indices` and which
re-exports these names (`data.Splits`, `data.DatasetError`). Non-goals: no reading of data, no
transforms, no batching (`kiln_trainer.distributed.batching`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils import data as torch_data

from kiln import api

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
