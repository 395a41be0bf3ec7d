"""Tests for kiln_trainer.freezing.partition: blocks, parameters, FLOPs, extractors, fx splits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln import models
from kiln_trainer.freezing import partition

IMAGE = (1, 8, 8)
TEXT = (8,)
TRACEABLE = [
    pytest.param("small_cnn", IMAGE, id="small_cnn"),
    pytest.param("small_resnet", IMAGE, id="small_resnet"),
    pytest.param("resnet18", IMAGE, id="resnet18"),
    pytest.param("vit", IMAGE, id="vit"),
    pytest.param("char_transformer", TEXT, id="char_transformer"),
]


def build(name: str, shape: tuple[int, ...]) -> tuple[nn.Module, torch.Tensor]:
    """A seeded model and a random input batch of 3 for it."""
    torch.manual_seed(0)
    model = models.get_model(name, input_shape=shape)
    if models.get_info(name).modality == models.Modality.TEXT:
        return model, torch.randint(0, 256, (3, *shape))
    return model, torch.randn(3, *shape)


def block_outputs(model: nn.Module, blocks: list[str], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every block's output, caught with forward hooks."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = [
        model.get_submodule(block).register_forward_hook(
            lambda _module, _args, output, block=block: outputs.__setitem__(block, output)
        )
        for block in blocks
    ]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return outputs


class SkipOverBlocks(nn.Module):
    """stem -> body -> head, plus a root-level skip from the stem to the head's input."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = self.stem(x)
        return self.head(self.body(stem) + stem)


class RootParameters(nn.Module):
    """A root parameter used before the stem, and one between the stem and the body."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.stem, self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.offset = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.relu(self.stem(x * self.scale)) + self.offset))


class Tied(nn.Module):
    """stem and head share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.head.weight = self.stem.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


class DataDependent(nn.Module):
    """Branches on a value: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stem(x)
        if features.sum() > 0:
            features = -features
        return self.head(features)


class CalledTwice(nn.Module):
    """Runs its stem twice (weight sharing across depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(self.stem(x)))


@pytest.mark.parametrize(
    ("name", "shape"), [*TRACEABLE, pytest.param("mobilenet_v2", IMAGE, id="mobilenet_v2")]
)
def test_extractor_returns_the_output_of_every_block_but_the_head(
    name: str, shape: tuple[int, ...]
) -> None:
    model, x = build(name, shape)
    model.eval()
    blocks = models.natural_blocks(model)
    features = partition.extractor(model, blocks)
    with torch.no_grad():
        got = features(x)
    expected = block_outputs(model, blocks[:-1], x)
    assert list(got) == blocks[:-1]
    for block in blocks[:-1]:
        assert torch.equal(got[block], expected[block]), block


def test_extractor_shares_the_model_parameters() -> None:
    model, x = build("small_cnn", IMAGE)
    model.eval()
    features = partition.extractor(model, models.natural_blocks(model))
    with torch.no_grad():
        before = features(x)["stem"].clone()
        model.get_submodule("stem.0").weight.mul_(2.0)
        after = features(x)["stem"]
    assert not torch.equal(before, after)
    assert {id(p) for p in features.parameters()} <= {id(p) for p in model.parameters()}


def test_extractor_keeps_each_layer_mode_of_the_model() -> None:
    model, _ = build("small_cnn", IMAGE)
    model.train()
    model.stem.eval()  # a frozen prefix
    features = partition.extractor(model, models.natural_blocks(model))
    assert features.training
    assert not any(m.training for m in model.stem.modules())
    assert all(m.training for m in model.blocks.modules())


def test_extractor_rejects_a_model_with_one_block() -> None:
    with pytest.raises(partition.Unpartitionable, match="Linear.*trains without freezing"):
        partition.extractor(nn.Linear(2, 2), ["weight_holder"])


def test_flatten_pools_image_maps_to_at_most_4x4_positions() -> None:
    maps = torch.randn(2, 3, 8, 6, dtype=torch.float16)
    flat = partition.flatten(maps)
    assert flat.shape == (2, 3 * 4 * 4) and flat.dtype == torch.float32
    small = torch.randn(2, 3, 2, 9)
    assert partition.flatten(small).shape == (2, 3 * 2 * 4)
    assert torch.allclose(partition.flatten(torch.ones(2, 3, 8, 8)), torch.ones(2, 48))


def test_flatten_pools_token_sequences_to_at_most_8_positions() -> None:
    tokens = torch.arange(2 * 16 * 3, dtype=torch.float32).reshape(2, 16, 3)
    flat = partition.flatten(tokens)
    assert flat.shape == (2, 8 * 3)
    # positions 0 and 1 are averaged into the first pooled position, per feature
    assert torch.allclose(flat[0, :3], tokens[0, :2].mean(0))
    assert partition.flatten(torch.randn(2, 5, 3)).shape == (2, 5 * 3)


def test_flatten_keeps_feature_rows() -> None:
    rows = torch.randn(4, 7)
    assert torch.equal(partition.flatten(rows), rows)
    assert partition.flatten(torch.randn(4)).shape == (4, 1)


def test_partition_lists_the_blocks_their_parameters_and_modules() -> None:
    model, x = build("small_resnet", IMAGE)
    part = partition.Partition.of(model, x[:1])
    assert part.blocks == ("stem", "stages.0.0", "stages.1.0", "stages.2.0", "head")
    assert part.params(0) == []
    assert [id(p) for p in part.params(2)] == [
        id(p) for block in ("stem", "stages.0.0") for p in model.get_submodule(block).parameters()
    ]
    assert part.modules(2) == [model.stem, model.stages[0][0]]
    assert sum(part.param_counts) == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="k must be in"):
        part.params(6)


def test_root_parameters_count_with_the_first_block_that_uses_them() -> None:
    model = RootParameters()
    part = partition.Partition.of(model, torch.randn(2, 4))
    assert part.blocks == ("stem", "body", "head")
    assert any(p is model.scale for p in part.params(1))
    assert not any(p is model.offset for p in part.params(1))
    assert any(p is model.offset for p in part.params(2))
    assert part.param_counts == (4 + 20, 20 + 4, 10)
    split = part.split(1)
    assert split is not None
    x = torch.randn(3, 4)
    assert torch.equal(split.suffix(split.prefix(x)), model(x))
    assert any(p is model.offset for p in split.suffix.parameters())


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        pytest.param(Tied(), "share a parameter", id="tied-weights"),
        pytest.param(DataDependent(), "cannot trace", id="untraceable"),
        pytest.param(CalledTwice(), "called 2 times", id="block-called-twice"),
        pytest.param(nn.Sequential(nn.Linear(4, 4)), "1 natural block", id="one-block"),
    ],
)
def test_unpartitionable_models_name_the_model_and_the_reason(
    model: nn.Module, reason: str
) -> None:
    with pytest.raises(partition.Unpartitionable) as caught:
        partition.Partition.of(model, torch.randn(2, 4))
    message = str(caught.value)
    assert type(model).__name__ in message and reason in message
    assert message.endswith("the job trains without freezing")
    assert isinstance(caught.value, ValueError)


def test_flops_are_forward_flops_per_sample_per_block() -> None:
    model, x = build("small_cnn", IMAGE)
    one, three = partition.Partition.of(model, x[:1]), partition.Partition.of(model, x)
    # stem: 3x3 conv 1 -> 32 channels on 8x8; 2 FLOPs per multiply-add
    assert one.flops[0] == 2 * 32 * 1 * 9 * 8 * 8
    assert one.flops == three.flops
    assert all(f > 0 for f in one.flops)


def test_backward_flops_are_measured_per_block() -> None:
    model, x = build("small_cnn", IMAGE)
    part = partition.Partition.of(model, x[:1])
    assert part.flops_source == "measured"
    # the stem needs no input gradient (the input needs none): weight gradient only, 1x forward;
    # later blocks compute weight and input gradients, 2x forward
    assert part.backward_flops[0] == part.flops[0]
    assert part.backward_flops[1:] == tuple(2 * f for f in part.flops[1:])
    fractions = [part.backward_flops_fraction(k) for k in range(len(part.blocks) + 1)]
    assert fractions[0] == 0.0 and fractions[-1] == pytest.approx(1.0)
    assert fractions == sorted(fractions)
    assert fractions[-2] < 1.0  # the head is never frozen


def test_partition_leaves_the_model_as_it_was() -> None:
    model, x = build("small_resnet", IMAGE)
    model.train()
    model.stem.eval()
    model.stem[0].weight.requires_grad_(False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    partition.Partition.of(model, x[:1])
    assert all(p.grad is None for p in model.parameters())
    assert not model.stem[0].weight.requires_grad and model.stem[1].weight.requires_grad
    assert not model.stem.training and model.stages.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize(("name", "shape"), TRACEABLE)
def test_split_computes_the_model_output_in_eval_and_train_mode(
    name: str, shape: tuple[int, ...]
) -> None:
    model, x = build(name, shape)
    part = partition.Partition.of(model, x[:1])
    for k in range(1, len(part.blocks)):
        split = part.split(k)
        assert split is not None, part.split_reason(k)
        assert part.split_reason(k) == ""
        model.eval()
        with torch.no_grad():
            assert torch.equal(split.suffix(split.prefix(x)), model(x)), k
        model.train()
        split.prefix.eval()  # a frozen prefix
        with torch.no_grad():
            assert torch.equal(split.suffix(split.prefix(x)), model(x)), k


def test_split_shares_the_model_parameters() -> None:
    model, x = build("small_cnn", IMAGE)
    split = partition.Partition.of(model, x[:1]).split(2)
    assert split is not None
    assert {id(p) for p in split.prefix.parameters()} == {
        id(p) for block in ("stem", "blocks.0") for p in model.get_submodule(block).parameters()
    }
    model_ids = {id(p) for p in model.parameters()}
    assert {id(p) for p in split.suffix.parameters()} <= model_ids


def test_split_boundary_takes_the_parameter_free_glue_after_the_block() -> None:
    model, x = build("resnet18", IMAGE)
    part = partition.Partition.of(model, x[:1])
    assert part.blocks[:3] == ("conv1", "bn1", "layer1.0")
    split = part.split(2)  # conv1, bn1 frozen: ReLU and max-pool belong to the prefix
    assert split is not None and split.boundary == "maxpool"
    last = part.split(len(part.blocks) - 1)  # everything but fc: pooled and flattened
    assert last is not None and last.boundary == "flatten"
    with torch.no_grad():
        assert last.prefix(x).shape == (3, 512)


def test_split_is_none_when_a_skip_connection_crosses_the_boundary() -> None:
    model = SkipOverBlocks()
    part = partition.Partition.of(model, torch.randn(2, 4))
    assert part.split(2) is None  # after body: body's output and stem's (the skip) cross
    assert "2 values cross the boundary" in part.split_reason(2)
    assert "'stem'" in part.split_reason(2)
    split = part.split(1)  # after stem: one value, used twice by the suffix
    assert split is not None
    x = torch.randn(3, 4)
    assert torch.equal(split.suffix(split.prefix(x)), model(x))


def test_split_rejects_freezing_the_head() -> None:
    model, x = build("small_cnn", IMAGE)
    part = partition.Partition.of(model, x[:1])
    with pytest.raises(ValueError, match="k must be in"):
        part.split(len(part.blocks))
    with pytest.raises(ValueError, match="k must be in"):
        part.split(0)


class TrainOnlyGlue(nn.Module):
    """Top-level glue that only runs in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stem(x)
        if self.training:
            features = features * 2.0
        return self.head(features)


def test_split_is_none_when_the_top_level_forward_depends_on_the_mode() -> None:
    with pytest.warns(UserWarning, match="eval mode are a subsequence"):  # torchvision's note
        part = partition.Partition.of(TrainOnlyGlue(), torch.randn(2, 4))
    assert part.split(1) is None
    assert "differs between train and eval mode" in part.split_reason(1)
