"""A small MLP-Mixer (Tolstikhin et al., 2021) for small images: a family Kiln does not ship.

`mixer(...)` is the entrypoint a TrainingJob names as ``mynets.mixer:mixer``. Images are
Tensor[B, C, H, W]; logits Tensor[B, K].
"""

from __future__ import annotations

import torch
from torch import nn


class MixerBlock(nn.Module):
    """Mixes across patches (tokens), then across features (channels), each residually."""

    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.token_norm = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(),
                                       nn.Linear(token_hidden, tokens))
        self.channel_norm = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(),
                                         nn.Linear(channel_hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, D]
        x = x + self.token_mlp(self.token_norm(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.channel_norm(x))


class Mixer(nn.Module):
    def __init__(self, *, channels: int, image_size: int, patch_size: int, dim: int, depth: int,
                 num_classes: int) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not a multiple of patch_size "
                             f"{patch_size}")
        tokens = (image_size // patch_size) ** 2
        self.stem = nn.Conv2d(channels, dim, patch_size, stride=patch_size)
        self.blocks = nn.ModuleList([MixerBlock(tokens, dim, 2 * tokens, 2 * dim)
                                     for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)  # [B, N, D]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def mixer(*, channels: int = 1, image_size: int = 8, patch_size: int = 2, dim: int = 32,
          depth: int = 2, num_classes: int = 10) -> Mixer:
    """An MLP-Mixer of `depth` blocks of width `dim` over `patch_size` patches."""
    return Mixer(channels=channels, image_size=image_size, patch_size=patch_size, dim=dim,
                 depth=depth, num_classes=num_classes)
