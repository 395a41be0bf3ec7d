"""torchvision classification models, adapted to grey-scale and small images.

ResNet, VGG-BN, MobileNet and DenseNet with `num_classes` (default 10) and any (C, H, W) input;
always `weights=None` (warm starts come from the zoo). Module names stay torchvision's, and
every model traces with `torch.fx`. Shapes: B batch, C channels, H height, W width, K classes.
torchvision is imported by the first build: importing it imports torch's compiler (about 1 s).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from kiln.models import registry

if TYPE_CHECKING:
    from torchvision.models import densenet as tv_densenet
    from torchvision.models import mobilenetv2 as tv_mobilenetv2
    from torchvision.models import mobilenetv3 as tv_mobilenetv3
    from torchvision.models import resnet as tv_resnet
    from torchvision.models import vgg as tv_vgg

# What differs from torchvision, and why:
#   * C != 3 (e.g. grey digits): the first conv takes C input channels; kernel, stride, padding
#     and output channels are unchanged.
#   * Small images (min(H, W) < SMALL_IMAGE_SIZE, e.g. CIFAR's 32x32 or digits' 8x8): an
#     ImageNet stem (stride 4 before the first block) would shrink an 8x8 image to 1x1 before
#     any block runs, so the stem is made small-input friendly, as the CIFAR variants of these
#     papers do:
#       - resnet: conv1 is 3x3, stride 1, padding 1 and maxpool is removed (He et al. 2016,
#         section 4.2 uses a 3x3 stride-1 stem on CIFAR-10); total stride 8 instead of 32;
#       - vgg: only floor(log2(min(H, W))) of the five max-pools are kept (the last ones go),
#         so the map never shrinks below 1x1; avgpool is 1x1 and the classifier is 512-512-K
#         with dropout 0.5 instead of 25088-4096-4096-K (as in the common CIFAR VGG), 15M
#         instead of 119M parameters;
#       - mobilenet_v2 / mobilenet_v3_small: the stem conv has stride 1 (total stride 16);
#       - densenet: conv0 is 3x3, stride 1, padding 1 and pool0 is removed (Huang et al. 2017,
#         section 3, CIFAR configuration); total stride 8.
#     Replaced convs are initialised like torchvision's (Kaiming normal, fan-out).
#   * Larger images keep torchvision's architecture exactly (apart from the C != 3 change).
#   * mobilenet_v3_small, at every input size: BatchNorm momentum is 0.1 (PyTorch's default, as
#     in every other family here), not torchvision's 0.01. Its depthwise convs start with tiny
#     weights (Kaiming fan-out counts every channel, not one per group), so on maps of 1x1
#     (8x8 images) their outputs have variance near 1e-5, below BatchNorm's eps of 1e-3,
#     while the running variance starts at 1.
#     At 1% per step it takes about 1,000 steps to come down, and until then evaluation
#     normalises with it and every input gets the same prediction (on digits, 23 steps an
#     epoch, validation accuracy stayed at chance while training loss fell). At 10% per step
#     it takes about 100.
SMALL_IMAGE_SIZE = 64
MOBILENET_V3_BATCH_NORM_MOMENTUM = 0.1

_IMAGE = registry.Modality.IMAGE
_CLASSIFICATION = registry.Task.CLASSIFICATION

RESNET_PAPER = "He et al., Deep Residual Learning for Image Recognition, CVPR 2016 (1512.03385)"
VGG_PAPER = (
    "Simonyan & Zisserman, Very Deep Convolutional Networks for Large-Scale Image Recognition, "
    "ICLR 2015 (1409.1556); batch norm: Ioffe & Szegedy, ICML 2015 (1502.03167)"
)
MOBILENET_V2_PAPER = (
    "Sandler et al., MobileNetV2: Inverted Residuals and Linear Bottlenecks, CVPR 2018 (1801.04381)"
)
MOBILENET_V3_PAPER = "Howard et al., Searching for MobileNetV3, ICCV 2019 (1905.02244)"
DENSENET_PAPER = "Huang et al., Densely Connected Convolutional Networks, CVPR 2017 (1608.06993)"


def _register(
    name: str, family: str, paper: str
) -> Callable[[registry.BuilderT], registry.BuilderT]:
    return registry.register_model(
        name, family=family, modality=_IMAGE, task=_CLASSIFICATION, paper=paper
    )


# ----------------------------------------------------------------------------------------------
# ResNet


@_register("resnet18", "resnet", RESNET_PAPER)
def resnet18(*, input_shape: tuple[int, ...], num_classes: int = 10) -> nn.Module:
    """ResNet-18: BasicBlocks [2, 2, 2, 2], 11M parameters; Tensor[B, C, H, W] -> Tensor[B, K]."""
    return _resnet("resnet18", input_shape, num_classes)


@_register("resnet34", "resnet", RESNET_PAPER)
def resnet34(*, input_shape: tuple[int, ...], num_classes: int = 10) -> nn.Module:
    """ResNet-34: BasicBlocks [3, 4, 6, 3], 21M parameters; Tensor[B, C, H, W] -> Tensor[B, K]."""
    return _resnet("resnet34", input_shape, num_classes)


@_register("resnet50", "resnet", RESNET_PAPER)
def resnet50(*, input_shape: tuple[int, ...], num_classes: int = 10) -> nn.Module:
    """ResNet-50: Bottlenecks [3, 4, 6, 3], 24M parameters; Tensor[B, C, H, W] -> Tensor[B, K]."""
    return _resnet("resnet50", input_shape, num_classes)


@_register("resnet101", "resnet", RESNET_PAPER)
def resnet101(*, input_shape: tuple[int, ...], num_classes: int = 10) -> nn.Module:
    """ResNet-101: Bottlenecks [3, 4, 23, 3], 43M parameters; Tensor[B, C, H, W] -> Tensor[B, K]."""
    return _resnet("resnet101", input_shape, num_classes)


def _resnet(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels, height, width = registry.image_shape(input_shape)
    model = _torchvision_model(name, num_classes)
    if min(height, width) < SMALL_IMAGE_SIZE:
        model.conv1 = _conv_like(
            model.conv1, in_channels=channels, kernel_size=3, stride=1, padding=1
        )
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = _conv_like(model.conv1, in_channels=channels)
    return cast(nn.Module, model)


@registry.declare_blocks("torchvision.models.resnet.ResNet")
def _resnet_blocks(model: tv_resnet.ResNet) -> list[str]:
    # conv1, bn1, layer1.0, ..., layer4.N, fc
    return _expanded(model, lambda name: re.fullmatch(r"layer\d+", name) is not None)


# ----------------------------------------------------------------------------------------------
# VGG with batch norm


@_register("vgg11_bn", "vgg", VGG_PAPER)
def vgg11_bn(*, input_shape: tuple[int, ...], num_classes: int = 10) -> nn.Module:
    """VGG-11 (configuration A) with batch norm; Tensor[B, C, H, W] -> Tensor[B, K]."""
    return _vgg("A", "vgg11_bn", input_shape, num_classes)


@_register("vgg16_bn", "vgg", VGG_PAPER)
def vgg16_bn(*, input_shape: tuple[int, ...], num_classes: int = 10) -> nn.Module:
    """VGG-16 (configuration D) with batch norm; Tensor[B, C, H, W] -> Tensor[B, K]."""
    return _vgg("D", "vgg16_bn", input_shape, num_classes)


def _vgg(config: str, name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    from torchvision.models import vgg as tv_vgg

    channels, height, width = registry.image_shape(input_shape)
    num_classes = _classes(num_classes)
    if min(height, width) >= SMALL_IMAGE_SIZE:
        model = _torchvision_model(name, num_classes)
    else:
        # Keep as many 2x2 max-pools as halvings the image allows; drop the last ones.
        layers: list[str | int] = list(tv_vgg.cfgs[config])
        excess_pools = layers.count("M") - min(5, int(math.log2(min(height, width))))
        for _ in range(max(0, excess_pools)):
            del layers[len(layers) - 1 - layers[::-1].index("M")]
        features = tv_vgg.make_layers(layers, batch_norm=True)
        # Build the wrapper on `meta` so its 102M-parameter ImageNet classifier, replaced
        # below, is never allocated or initialised; `features` is real and gets torchvision's
        # initialisation.
        with torch.device("meta"):
            model = cast(Any, tv_vgg.VGG(features, num_classes=num_classes))
        model.avgpool = nn.AdaptiveAvgPool2d(1)
        model.classifier = nn.Sequential(
            nn.Linear(512, 512),
            nn.ReLU(True),
            nn.Dropout(p=0.5),
            nn.Linear(512, 512),
            nn.ReLU(True),
            nn.Dropout(p=0.5),
            nn.Linear(512, num_classes),
        )
        for module in model.classifier:
            if isinstance(module, nn.Linear):  # torchvision's VGG initialisation
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.constant_(module.bias, 0)
    if channels != 3:
        model.features[0] = _conv_like(model.features[0], in_channels=channels)
    return cast(nn.Module, model)


@registry.declare_blocks("torchvision.models.vgg.VGG")
def _vgg_blocks(model: tv_vgg.VGG) -> list[str]:
    # features.0 (conv), features.1 (bn), features.3, ..., classifier
    return _expanded(model, lambda name: name == "features")


# ----------------------------------------------------------------------------------------------
# MobileNet


@_register("mobilenet_v2", "mobilenet_v2", MOBILENET_V2_PAPER)
def mobilenet_v2(*, input_shape: tuple[int, ...], num_classes: int = 10) -> nn.Module:
    """MobileNetV2 (width 1.0), 2.2M parameters; Tensor[B, C, H, W] -> Tensor[B, K]."""
    return _mobilenet("mobilenet_v2", input_shape, num_classes)


@_register("mobilenet_v3_small", "mobilenet_v3", MOBILENET_V3_PAPER)
def mobilenet_v3_small(*, input_shape: tuple[int, ...], num_classes: int = 10) -> nn.Module:
    """MobileNetV3-Small, 1.5M parameters; Tensor[B, C, H, W] -> Tensor[B, K]."""
    model = _mobilenet("mobilenet_v3_small", input_shape, num_classes)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = MOBILENET_V3_BATCH_NORM_MOMENTUM
    return model


def _mobilenet(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels, height, width = registry.image_shape(input_shape)
    model = _torchvision_model(name, num_classes)
    small = min(height, width) < SMALL_IMAGE_SIZE
    if small or channels != 3:
        stem = model.features[0]  # Conv2dNormActivation: conv, norm, activation
        stem[0] = _conv_like(stem[0], in_channels=channels, stride=1 if small else None)
    return cast(nn.Module, model)


@registry.declare_blocks("torchvision.models.mobilenetv2.MobileNetV2")
def _mobilenet_v2_blocks(model: tv_mobilenetv2.MobileNetV2) -> list[str]:
    # features.0 (stem), features.1..17 (inverted residuals), features.18 (1x1 conv), classifier
    return _expanded(model, lambda name: name == "features")


@registry.declare_blocks("torchvision.models.mobilenetv3.MobileNetV3")
def _mobilenet_v3_blocks(model: tv_mobilenetv3.MobileNetV3) -> list[str]:
    # features.0 (stem), features.1..11 (inverted residuals), features.12, classifier
    return _expanded(model, lambda name: name == "features")


# ----------------------------------------------------------------------------------------------
# DenseNet


@_register("densenet121", "densenet", DENSENET_PAPER)
def densenet121(*, input_shape: tuple[int, ...], num_classes: int = 10) -> nn.Module:
    """DenseNet-121 (growth 32, blocks [6, 12, 24, 16]); Tensor[B, C, H, W] -> Tensor[B, K]."""
    channels, height, width = registry.image_shape(input_shape)
    model = _torchvision_model("densenet121", num_classes)
    if min(height, width) < SMALL_IMAGE_SIZE:
        model.features.conv0 = _conv_like(
            model.features.conv0, in_channels=channels, kernel_size=3, stride=1, padding=1
        )
        model.features.pool0 = nn.Identity()
    elif channels != 3:
        model.features.conv0 = _conv_like(model.features.conv0, in_channels=channels)
    return cast(nn.Module, model)


@registry.declare_blocks("torchvision.models.densenet.DenseNet")
def _densenet_blocks(model: tv_densenet.DenseNet) -> list[str]:
    # features.conv0, features.norm0, features.denseblock1.denselayer1, ..., features.transition1,
    # ..., features.norm5, classifier
    return _expanded(
        model, lambda name: re.fullmatch(r"features(\.denseblock\d+)?", name) is not None
    )


# ----------------------------------------------------------------------------------------------
# helpers


def _torchvision_model(name: str, num_classes: Any) -> Any:
    """torchvision's builder `name`, without weights."""
    import torchvision.models

    builder = getattr(torchvision.models, name)
    return builder(weights=None, num_classes=_classes(num_classes))


def _classes(num_classes: Any) -> int:
    return registry.require_int("num_classes", num_classes, minimum=1)


def _conv_like(
    conv: nn.Conv2d,
    *,
    in_channels: int,
    kernel_size: int | None = None,
    stride: int | None = None,
    padding: int | None = None,
) -> nn.Conv2d:
    """A fresh conv like `conv` with some settings changed, initialised as torchvision does."""
    new = nn.Conv2d(
        in_channels,
        conv.out_channels,
        kernel_size=kernel_size if kernel_size is not None else cast(Any, conv.kernel_size),
        stride=stride if stride is not None else cast(Any, conv.stride),
        padding=padding if padding is not None else cast(Any, conv.padding),
        bias=conv.bias is not None,
    )
    nn.init.kaiming_normal_(new.weight, mode="fan_out", nonlinearity="relu")
    if new.bias is not None:
        nn.init.zeros_(new.bias)
    return new


def _expanded(module: nn.Module, expand: Callable[[str], bool], prefix: str = "") -> list[str]:
    """Children owning parameters, in order; those named by `expand` replaced by theirs."""
    names: list[str] = []
    for name in registry.children_with_parameters(module, prefix):
        if expand(name):
            child = module.get_submodule(name[len(prefix) :])
            names += _expanded(child, expand, prefix=f"{name}.")
        else:
            names.append(name)
    return names
