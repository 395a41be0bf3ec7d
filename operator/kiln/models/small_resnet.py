"""small_resnet: CIFAR-style residual networks for small images, fast on CPU.

The default image family of the demos and the natural warm-start ladder: `blocks` [1, 1, 1] ->
[2, 2, 2] -> [3, 3, 3] keeps every layer kind and width, so a deeper child inherits most of its
parent. Shapes: B batch, C channels, H height, W width, K classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models import registry, small_cnn

PAPER = (
    "He et al., Deep Residual Learning for Image Recognition, CVPR 2016 (1512.03385), "
    "section 4.2 (CIFAR-10 ResNets)"
)


class BasicBlock(nn.Module):
    """Residual block: Tensor[B, Cin, H, W] -> Tensor[B, Cout, H/stride, W/stride].

    Args:
        in_channels: Cin.
        out_channels: Cout.
        stride: 1 or 2 (the first conv and the projection shortcut stride).
    """

    def __init__(self, in_channels: int, out_channels: int, *, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Tensor[B, Cin, H, W] -> Tensor[B, Cout, H', W']."""
        out = F.relu(self.bn1(self.conv1(features)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(features))


class SmallResNet(nn.Module):
    """CIFAR-style ResNet: stem, stages of BasicBlocks, pooled linear head.

    He et al. 2016, section 4.2 (`blocks` = [n, n, n] and `width` 16 is their
    ResNet-(6n+2)); no bottleneck blocks (use resnet50/101), no pre-activation variant. For
    input Tensor[B, C, H, W]:

        stem        conv3x3(C -> width) + BN + ReLU, stride 1
        stages.s.b  BasicBlock b of stage s: two conv3x3 + BN with an identity shortcut;
                    stage s has width * 2**s channels; its first block halves the map
                    (stride 2, while the map is at least 2x2) with a 1x1 conv + BN projection
                    shortcut ("option B")
        head        global average pool + linear -> Tensor[B, K]

    The last BN of each block starts at zero (Goyal et al. 2017, 1706.02677), so a fresh
    block is the identity: this speeds up early training and makes inserted blocks harmless
    in warm starts.

    Args:
        in_channels: C.
        image_size: min(H, W) in pixels; decides how often the map can be halved.
        blocks: blocks per stage, e.g. [3, 3, 3].
        width: channels of the stem and the first stage; doubles per stage.
        num_classes: K.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        image_size: int,
        blocks: Sequence[int],
        width: int,
        num_classes: int,
    ) -> None:
        super().__init__()
        self.stem = small_cnn.conv_bn_relu(in_channels, width, stride=1)
        stages: list[nn.Module] = []
        channels, size = width, image_size
        for stage, count in enumerate(blocks):
            out_channels = width * 2**stage
            stride = 2 if stage > 0 and size >= 2 else 1
            stage_blocks = []
            for index in range(count):
                stage_blocks.append(
                    BasicBlock(channels, out_channels, stride=stride if index == 0 else 1)
                )
                channels = out_channels
            stages.append(nn.Sequential(*stage_blocks))
            size = -(-size // stride)  # ceil: 3x3 conv, padding 1
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(channels, num_classes)
        )
        small_cnn.init_conv_bn(self)
        for module in self.modules():
            if isinstance(module, BasicBlock):
                nn.init.zeros_(module.bn2.weight)  # each block starts as the identity

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Tensor[B, C, H, W] float -> logits Tensor[B, K]."""
        result: torch.Tensor = self.head(self.stages(self.stem(images)))
        return result


@registry.register_model(
    "small_resnet",
    family="small_resnet",
    modality=registry.Modality.IMAGE,
    task=registry.Task.CLASSIFICATION,
    paper=PAPER,
)
def small_resnet(
    *,
    input_shape: tuple[int, ...],
    blocks: int | Sequence[int] = (1, 1, 1),
    width: int = 16,
    num_classes: int = 10,
) -> nn.Module:
    """Small CIFAR-style ResNet; Tensor[B, C, H, W] -> Tensor[B, K].

    Args:
        input_shape: (C, H, W).
        blocks: BasicBlocks per stage, e.g. [1, 1, 1]; an int n means [n, n, n] (6n+2 layers).
        width: channels of the first stage, >= 1; doubles per stage.
        num_classes: K, >= 1.

    Raises:
        TypeError: `blocks` is not an int or a list of ints, or another argument not an int.
        ValueError: a block count, width or num_classes is below 1, or `blocks` is empty.
        IncompatibleInputShape: `input_shape` is not (C, H, W).
    """
    channels, height, image_width = registry.image_shape(input_shape)
    return SmallResNet(
        in_channels=channels,
        image_size=min(height, image_width),
        blocks=_block_counts(blocks),
        width=registry.require_int("width", width, minimum=1),
        num_classes=registry.require_int("num_classes", num_classes, minimum=1),
    )


@registry.declare_blocks(SmallResNet)
def _blocks(model: SmallResNet) -> list[str]:
    names = [
        f"stages.{s}.{b}"
        for s, stage in enumerate(model.stages)
        for b, _ in enumerate(stage.children())
    ]
    return ["stem", *names, "head"]


def _block_counts(blocks: Any) -> list[int]:
    if isinstance(blocks, int) and not isinstance(blocks, bool):
        blocks = [blocks] * 3
    if isinstance(blocks, str) or not isinstance(blocks, Sequence):
        raise TypeError(f"blocks must be an integer or a list of integers (got {blocks!r})")
    if not blocks:
        raise ValueError("blocks must list at least one stage, e.g. [1, 1, 1] (got [])")
    return [registry.require_int("blocks[]", count, minimum=1) for count in blocks]
