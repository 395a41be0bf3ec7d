"""small_cnn: a plain stack of 3x3 conv-BN-ReLU layers for small images, fast on CPU.

The simplest image family, for quick jobs and as an easy warm-start pair (depth and width vary,
the layer kinds do not). Shapes: B batch, C channels, H height, W width, K classes.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.models import registry

PAPER = (
    "LeCun et al., Gradient-Based Learning Applied to Document Recognition, Proc. IEEE 1998; "
    "3x3 stacks: Simonyan & Zisserman, ICLR 2015 (1409.1556); batch norm: Ioffe & Szegedy, "
    "ICML 2015 (1502.03167)"
)


class SmallCNN(nn.Module):
    """Plain conv net: stem, `depth - 1` conv blocks, pooled linear head.

    LeCun et al.'s conv-net recipe with VGG's 3x3 stacks and batch norm; no dropout, no
    residuals (that is `small_resnet`). For input Tensor[B, C, H, W]:

        stem      conv3x3(C -> width) + BN + ReLU, stride 1
        blocks.i  conv3x3 + BN + ReLU for i = 0 .. depth-2; every odd layer (blocks.0,
                  blocks.2, ...) halves the map (stride 2) while it is at least 2x2, and
                  doubles the channels (capped at 8 * width)
        head      global average pool + linear -> Tensor[B, K]

    Args:
        in_channels: C.
        image_size: min(H, W) in pixels; decides how often the map can be halved.
        depth: number of conv layers (>= 1), stem included.
        width: channels of the stem.
        num_classes: K.
    """

    def __init__(
        self, *, in_channels: int, image_size: int, depth: int, width: int, num_classes: int
    ) -> None:
        super().__init__()
        self.stem = conv_bn_relu(in_channels, width, stride=1)
        layers: list[nn.Module] = []
        channels, size = width, image_size
        for index in range(1, depth):
            stride = 2 if index % 2 == 1 and size >= 2 else 1
            out_channels = min(channels * stride, 8 * width)
            layers.append(conv_bn_relu(channels, out_channels, stride=stride))
            channels, size = out_channels, -(-size // stride)  # ceil: 3x3, padding 1
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(channels, num_classes)
        )
        init_conv_bn(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Tensor[B, C, H, W] float -> logits Tensor[B, K]."""
        result: torch.Tensor = self.head(self.blocks(self.stem(images)))
        return result


@registry.register_model(
    "small_cnn",
    family="small_cnn",
    modality=registry.Modality.IMAGE,
    task=registry.Task.CLASSIFICATION,
    paper=PAPER,
)
def small_cnn(
    *, input_shape: tuple[int, ...], depth: int = 3, width: int = 32, num_classes: int = 10
) -> nn.Module:
    """Small plain CNN: `depth` 3x3 conv-BN-ReLU layers; Tensor[B, C, H, W] -> Tensor[B, K].

    Args:
        input_shape: (C, H, W).
        depth: conv layers, >= 1.
        width: channels of the first layer, >= 1 (doubles at each halving, up to 8x).
        num_classes: K, >= 1.

    Raises:
        TypeError: an argument is not an integer.
        ValueError: an argument is below 1.
        IncompatibleInputShape: `input_shape` is not (C, H, W).
    """
    channels, height, image_width = registry.image_shape(input_shape)
    return SmallCNN(
        in_channels=channels,
        image_size=min(height, image_width),
        depth=registry.require_int("depth", depth, minimum=1),
        width=registry.require_int("width", width, minimum=1),
        num_classes=registry.require_int("num_classes", num_classes, minimum=1),
    )


@registry.declare_blocks(SmallCNN)
def _blocks(model: SmallCNN) -> list[str]:
    return ["stem", *(f"blocks.{i}" for i in range(len(model.blocks))), "head"]


def conv_bn_relu(in_channels: int, out_channels: int, *, stride: int) -> nn.Sequential:
    """conv3x3 (no bias) + BatchNorm + ReLU: Tensor[B, Cin, H, W] -> Tensor[B, Cout, H/s, W/s]."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


def init_conv_bn(model: nn.Module) -> None:
    """He (Kaiming) normal init for convs, unit/zero batch norm, as torchvision's ResNet does."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
