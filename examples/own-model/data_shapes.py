"""A user's own dataset: grey images of circles, squares and crosses, drawn at random positions
and sizes with pixel noise. Nothing here is part of Kiln.

`shapes(...)` is the entrypoint a TrainingJob names as ``data_shapes:shapes``: it returns
(train, validation), map-style datasets of (Tensor[1, S, S], class) pairs.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset

CLASSES = ("circle", "square", "cross")


def shapes(*, size: int = 16, samples: int = 600, validation: int = 150, noise: float = 0.2,
           seed: int = 0) -> tuple[Dataset[tuple[torch.Tensor, torch.Tensor]],
                                   Dataset[tuple[torch.Tensor, torch.Tensor]]]:
    """`samples` training and `validation` validation images of size x size pixels.

    Raises:
        ValueError: size below 8, or fewer than one sample in a split.
    """
    if size < 8:
        raise ValueError(f"size must be at least 8 pixels (got {size})")
    if samples < 1 or validation < 1:
        raise ValueError(f"samples and validation must be >= 1 (got {samples}, {validation})")
    generator = torch.Generator().manual_seed(seed)
    images, labels = _draw(samples + validation, size, noise, generator)
    return (TensorDataset(images[:samples], labels[:samples]),
            TensorDataset(images[samples:], labels[samples:]))


def _draw(n: int, size: int, noise: float, generator: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, len(CLASSES), (n,), generator=generator)
    radius = size * (0.2 + 0.15 * torch.rand(n, generator=generator))
    centre = size / 2 + (torch.rand(n, 2, generator=generator) - 0.5) * (size - 2 * radius)[:, None]
    ys, xs = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    dy = ys[None].float() + 0.5 - centre[:, 0, None, None]
    dx = xs[None].float() + 0.5 - centre[:, 1, None, None]
    r = radius[:, None, None]
    circle = (dx**2 + dy**2 <= r**2).float()
    square = ((dx.abs() <= r * 0.8) & (dy.abs() <= r * 0.8)).float()
    cross = (((dx.abs() <= r * 0.25) | (dy.abs() <= r * 0.25))
             & (dx.abs() <= r) & (dy.abs() <= r)).float()
    pictures = torch.stack((circle, square, cross), 1)[torch.arange(n), labels]
    pictures = pictures + noise * torch.randn(pictures.shape, generator=generator)
    return pictures.unsqueeze(1), labels
