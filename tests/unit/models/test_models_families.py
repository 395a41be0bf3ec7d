"""Every registered architecture builds, has the right output shape, initialises
deterministically, trains on small images, and traces with torch.fx (parametrized over the
registry itself, torchvision style)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import models
from kiln.models import registry

NUM_CLASSES = 7  # not the default 10, so the tests see that num_classes is honoured
SEQUENCE_LENGTH = 16
IMAGE_MODELS = [n for n in models.list_models() if models.get_info(n).modality == "image"]
# Deeper siblings of resnet18 / vgg11_bn with the same stems; their 8x8 forward pass runs in
# the natural-blocks test, so the shape test takes them at [3, 32, 32] only (seconds on CPU).
DEEP_TORCHVISION = {"resnet34", "resnet50", "resnet101", "vgg16_bn"}
IMAGE_CASES = [
    pytest.param(name, shape, id=f"{name}-{'x'.join(map(str, shape))}")
    for name in IMAGE_MODELS
    for shape in [(1, 8, 8), (3, 32, 32)]
    if not (name in DEEP_TORCHVISION and shape == (1, 8, 8))
]
TEXT_MODELS = [n for n in models.list_models() if models.get_info(n).modality == "text"]
SMALL_FAMILIES = ["small_cnn", "small_resnet", "vit", "char_transformer"]
TORCHVISION_FAMILIES = {"resnet", "vgg", "mobilenet_v2", "mobilenet_v3", "densenet"}
# Training steps of the big torchvision models cost seconds each on 2 cores; these cover every
# kind of adapted stem (resnet conv1 + no maxpool, vgg pools, mobilenet stride) cheaply.
TRAINED_IMAGE_MODELS = [
    "small_cnn",
    "small_resnet",
    "vit",
    "resnet18",
    "vgg11_bn",
    "mobilenet_v3_small",
]


def _args(name: str) -> dict[str, int]:
    info = models.get_info(name)
    return {"num_classes": NUM_CLASSES} if "num_classes" in info.default_args else {}


def _shape(name: str) -> tuple[int, ...]:
    return (SEQUENCE_LENGTH,) if name in TEXT_MODELS else (1, 8, 8)


def _random_input(name: str, shape: tuple[int, ...], batch_size: int) -> torch.Tensor:
    if name in TEXT_MODELS:
        return torch.randint(0, 256, (batch_size, *shape))
    return torch.randn(batch_size, *shape)


def test_registry_holds_the_required_architectures() -> None:
    required = {
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "vgg11_bn",
        "vgg16_bn",
        "mobilenet_v2",
        "mobilenet_v3_small",
        "densenet121",
        "small_cnn",
        "small_resnet",
        "vit",
        "char_transformer",
    }
    assert required <= set(models.list_models())


@pytest.mark.parametrize(("name", "shape"), IMAGE_CASES)
def test_image_model_maps_a_batch_to_class_logits(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = models.get_model(name, input_shape=shape, **_args(name))
    logits = model(torch.randn(2, *shape))
    assert logits.shape == (2, NUM_CLASSES)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_language_model_maps_tokens_to_next_token_logits(name: str) -> None:
    torch.manual_seed(0)
    model = models.get_model(name, input_shape=(SEQUENCE_LENGTH,))
    tokens = torch.randint(0, 256, (2, SEQUENCE_LENGTH))
    assert model(tokens).shape == (2, SEQUENCE_LENGTH, 256)
    assert model(tokens[:, :5]).shape == (2, 5, 256)  # shorter prompts work too


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_language_model_never_looks_ahead(name: str) -> None:
    torch.manual_seed(0)
    model = models.get_model(name, input_shape=(SEQUENCE_LENGTH,)).eval()
    tokens = torch.randint(0, 256, (1, SEQUENCE_LENGTH))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize("name", models.list_models())
def test_same_seed_gives_identical_weights_and_another_seed_different(name: str) -> None:
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return models.get_model(name, input_shape=_shape(name), **_args(name)).state_dict()

    first, second, other = weights(0), weights(0), weights(1)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert any(not torch.equal(first[key], other[key]) for key in first)


@pytest.mark.parametrize("name", TRAINED_IMAGE_MODELS)
def test_image_model_learns_a_fixed_batch_of_8x8_grey_images(name: str) -> None:
    torch.manual_seed(0)
    model = models.get_model(name, input_shape=(1, 8, 8), **_args(name))
    images, labels = torch.randn(8, 1, 8, 8), torch.arange(8) % NUM_CLASSES
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses: list[float] = []
    for _ in range(5):
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        if not losses:  # the first backward reaches every parameter
            assert all(p.grad is not None for p in model.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_language_model_learns_a_fixed_batch(name: str) -> None:
    torch.manual_seed(0)
    model = models.get_model(name, input_shape=(SEQUENCE_LENGTH,))
    tokens = torch.randint(0, 256, (4, SEQUENCE_LENGTH + 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses: list[float] = []
    for _ in range(5):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", models.list_models())
def test_natural_blocks_own_every_parameter_once_in_forward_order_head_last(name: str) -> None:
    torch.manual_seed(0)
    model = models.get_model(name, input_shape=_shape(name), **_args(name))
    blocks = models.natural_blocks(model)
    assert len(blocks) >= 3  # stem, at least one block, head

    owned = [id(p) for block in blocks for p in model.get_submodule(block).parameters()]
    assert len(owned) == len(set(owned)) == len(list(model.parameters()))

    called: list[str] = []
    for block in blocks:
        model.get_submodule(block).register_forward_pre_hook(
            lambda _module, _args, block=block: (
                called.append(block) if block not in called else None
            )
        )
    model.eval()(_random_input(name, _shape(name), batch_size=2))
    assert called == blocks

    head = model.get_submodule(blocks[-1])
    outputs = NUM_CLASSES if name in IMAGE_MODELS else 256
    assert any(isinstance(m, nn.Linear) and m.out_features == outputs for m in head.modules())


@pytest.mark.parametrize("name", [n for n in models.list_models()
                                  if models.get_info(n).family in TORCHVISION_FAMILIES])
def test_a_torchvision_model_has_its_family_s_blocks_not_the_fallback(name: str) -> None:
    # The families declare torchvision's classes by name; a wrong name would fall back silently.
    with torch.device("meta"):
        model = models.get_model(name, input_shape=(3, 32, 32))
    assert models.natural_blocks(model) != registry.layer_stack_blocks(model)


def test_natural_blocks_of_an_unregistered_model_are_its_children_with_parameters() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert models.natural_blocks(model) == ["0", "2"]


def test_natural_blocks_of_an_unregistered_model_split_its_layer_stack() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
            self.norm = nn.LayerNorm(4)

    class Net(nn.Module):  # a wrapper, like a Hugging Face model inside a user's module
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(4, 4)
            self.encoder = Encoder()
            self.head = nn.Linear(4, 2)

    assert models.natural_blocks(Net()) == [
        "stem", "encoder.embed", "encoder.layers.0", "encoder.layers.1", "encoder.layers.2",
        "encoder.norm", "head"]


@pytest.mark.parametrize("name", models.list_models())
def test_model_built_on_meta_traces_with_torch_fx(name: str) -> None:
    # kiln.warmstart builds candidates on `meta` and traces them with torch.fx; all registered
    # models, torchvision's included, must trace.
    shape = _shape(name) if name in TEXT_MODELS else (3, 32, 32)
    with torch.device("meta"):
        model = models.get_model(name, input_shape=shape, **_args(name))
    graph = torch.fx.symbolic_trace(model)
    output = graph(models.example_input(name, shape, batch_size=2, device="meta"))
    assert output.shape[0] == 2
    assert output.device.type == "meta"


@pytest.mark.parametrize("name", SMALL_FAMILIES)
def test_small_family_traced_graph_computes_what_the_model_computes(name: str) -> None:
    torch.manual_seed(0)
    model = models.get_model(name, input_shape=_shape(name), **_args(name)).eval()
    sample = _random_input(name, _shape(name), batch_size=2)
    with torch.no_grad():
        torch.testing.assert_close(torch.fx.symbolic_trace(model)(sample), model(sample))


@pytest.mark.parametrize(
    ("name", "stem"),
    [
        pytest.param("resnet18", "conv1", id="resnet18"),
        pytest.param("vgg11_bn", "features.0", id="vgg11_bn"),
        pytest.param("mobilenet_v2", "features.0.0", id="mobilenet_v2"),
        pytest.param("densenet121", "features.conv0", id="densenet121"),
    ],
)
def test_torchvision_stem_adapts_to_channels_and_keeps_imagenet_stride_for_large_images(
    name: str, stem: str
) -> None:
    with torch.device("meta"):
        small = models.get_model(name, input_shape=(1, 32, 32))
        large = models.get_model(name, input_shape=(1, 64, 64))
        imagenet = models.get_model(name, input_shape=(3, 224, 224))
    small_conv, large_conv = small.get_submodule(stem), large.get_submodule(stem)
    imagenet_conv = imagenet.get_submodule(stem)
    assert isinstance(small_conv, nn.Conv2d) and isinstance(large_conv, nn.Conv2d)
    assert isinstance(imagenet_conv, nn.Conv2d)
    assert small_conv.in_channels == large_conv.in_channels == 1
    assert imagenet_conv.in_channels == 3
    assert small_conv.stride == (1, 1)
    assert large_conv.stride == imagenet_conv.stride
    assert large_conv.kernel_size == imagenet_conv.kernel_size


def test_resnet_on_small_images_uses_the_cifar_stem_without_maxpool() -> None:
    with torch.device("meta"):
        model = models.get_model("resnet18", input_shape=(3, 32, 32))
    assert isinstance(model.get_submodule("maxpool"), nn.Identity)
    conv1 = model.get_submodule("conv1")
    assert isinstance(conv1, nn.Conv2d) and conv1.kernel_size == (3, 3)


def test_vgg_on_8x8_images_keeps_three_pools_and_a_small_classifier() -> None:
    with torch.device("meta"):
        model = models.get_model("vgg16_bn", input_shape=(1, 8, 8))
    features = model.get_submodule("features")
    assert sum(isinstance(m, nn.MaxPool2d) for m in features.modules()) == 3
    assert sum(p.numel() for p in model.get_submodule("classifier").parameters()) < 600_000


@pytest.mark.training
def test_mobilenet_v3_on_8x8_images_tells_inputs_apart_in_eval_mode_after_100_steps() -> None:
    # On 8x8 images the depthwise convs see 1x1 maps, and their outputs start with variance
    # near 1e-5. BatchNorm's running variance, starting at 1, must come down within a short
    # run's steps, or evaluation normalises by it and gives every input the same logits.
    torch.manual_seed(0)
    model = models.get_model("mobilenet_v3_small", input_shape=(1, 8, 8), num_classes=10)
    model.train()
    images = torch.randn(16, 1, 8, 8)
    with torch.no_grad():
        for _ in range(100):
            training_logits = model(images)  # a training-mode forward updates the statistics
        eval_logits = model.eval()(images)

    def spread(logits: torch.Tensor) -> float:
        return float((logits - logits.mean(0)).norm())

    assert spread(eval_logits) > 0.25 * spread(training_logits)


def test_small_resnet_takes_an_int_as_blocks_per_stage() -> None:
    model = models.get_model("small_resnet", input_shape=(1, 8, 8), blocks=2, width=8)
    assert models.natural_blocks(model) == [
        "stem",
        "stages.0.0",
        "stages.0.1",
        "stages.1.0",
        "stages.1.1",
        "stages.2.0",
        "stages.2.1",
        "head",
    ]


def test_small_resnet_block_starts_as_the_identity() -> None:
    # Zero-initialised last BN (Goyal et al. 2017): a fresh identity-shortcut block is ReLU(x).
    model = models.get_model("small_resnet", input_shape=(1, 8, 8), blocks=[2], width=4).eval()
    block = model.get_submodule("stages.0.1")
    features = torch.randn(2, 4, 8, 8)
    torch.testing.assert_close(block(features), F.relu(features))
