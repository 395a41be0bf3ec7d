"""Tests for stage order and Net2Net widening in kiln.warmstart.match, on small_resnet graphs.

A child conv's stage is read from its module path (`stages.<s>.<block>.conv1`); the graph's own
stage index (`graph.Prepared.stages`) is checked against it separately. Inputs are 8x8 digits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
import torchvision.models as tvm
from sklearn.datasets import load_digits
from torch import nn

from kiln.models import small_resnet
from kiln.warmstart import graph, match, transform

SHAPE = (1, 8, 8)


def _model(blocks: Sequence[int], width: int) -> nn.Module:
    return small_resnet.small_resnet(input_shape=SHAPE, blocks=list(blocks), width=width)


@functools.cache
def _graph(blocks: tuple[int, ...], width: int) -> nx.DiGraph:
    with torch.device("meta"):
        model = _model(blocks, width)
    return graph.extract(model, list(SHAPE), name=f"{list(blocks)}x{width}")


def _stage(target: str) -> str:
    """`stem`, `stages.<s>` or `head`: the part of the network a module path belongs to."""
    return ".".join(target.split(".")[:2]) if target.startswith("stages.") else target.split(".")[0]


def _conv_pairs(parent: nx.DiGraph, child: nx.DiGraph) -> dict[str, str]:
    """Aligned convs as child module path -> parent module path."""
    pairs = match.align(parent, child).pairs
    return {str(child.nodes[c]["target"]): str(parent.nodes[p]["target"])
            for p, c in pairs if child.nodes[c]["op"] == "Conv2d"}


def test_stage_index_counts_downsamplings_and_leaves_pooled_heads_unknown() -> None:
    g = _graph((1, 2, 2), 24)
    prepared = graph.prepare(g)
    stages = dict(zip(prepared.nodes, prepared.stages.tolist(), strict=True))
    expected = {"stem": 0, "stages.0": 0, "stages.1": 1, "stages.2": 2}
    for node, stage in stages.items():
        if not g.nodes[node]["weight_shape"]:
            continue  # functional ReLUs and adds are named by their op, not their module
        part = _stage(str(g.nodes[node]["target"]))
        if part in expected:
            assert stage == expected[part], (node, part)
        else:  # global pool and linear head: no spatial map left
            assert part == "head" and stage == -1, (node, part)


def test_stage_index_is_unknown_without_an_image_input() -> None:
    g = nx.DiGraph(input_shape=[16])
    g.add_node("fc", op="Linear", weight_shape=[8, 8], out_shape=[1, 16, 8])
    assert graph.prepare(g).stages.tolist() == [-1]


def test_an_imagenet_stem_leads_into_stage_zero_like_a_single_conv_stem() -> None:
    # torchvision's resnet18 halves the map twice before layer1 (stride-2 conv, max pool); its
    # layer1 to layer3 still align with a CIFAR-style net of the same widths, stage by stage.
    with torch.device("meta"):
        model = tvm.resnet18(num_classes=10)
    parent = graph.extract(model, [3, 32, 32], name="resnet18")
    with torch.device("meta"):
        child_model = small_resnet.small_resnet(input_shape=(3, 32, 32), blocks=[2, 2, 2],
                                                width=64)
    child = graph.extract(child_model, [3, 32, 32])
    pairs = _conv_pairs(parent, child)
    for s in range(3):
        assert pairs[f"stages.{s}.1.conv1"] == f"layer{s + 1}.1.conv1", pairs
    assert match.similarity(parent, child) > 0.5


def test_wider_child_with_other_block_counts_aligns_stage_by_stage() -> None:
    # Each stage of [1, 2, 2]x24 doubles the width, so the 48-channel convs of the child's
    # stage 0 have exact-shape twins in the parent's stage 1; they must widen stage 0 instead.
    parent, child = _graph((1, 2, 2), 24), _graph((2, 2, 1), 48)
    pairs = _conv_pairs(parent, child)
    assert pairs, "no conv was aligned"
    for child_conv, parent_conv in pairs.items():
        assert _stage(child_conv) == _stage(parent_conv), pairs
    # the first block of every child stage inherits its parent twin, widened 2x
    for s in range(3):
        for conv in ("conv1", "conv2"):
            assert pairs[f"stages.{s}.0.{conv}"] == f"stages.{s}.0.{conv}"
    assert pairs["stem.0"] == "stem.0"


def test_an_added_stage_is_inserted_after_the_aligned_ones() -> None:
    parent, child = _graph((1, 1, 1), 24), _graph((1, 1, 1, 1), 24)
    pairs = _conv_pairs(parent, child)
    for s in range(3):
        for conv in ("conv1", "conv2"):
            assert pairs[f"stages.{s}.0.{conv}"] == f"stages.{s}.0.{conv}"
    assert not [c for c in pairs if c.startswith("stages.3.")], pairs


def test_width_only_child_is_at_least_as_similar_as_a_reshuffled_one() -> None:
    parent = _graph((1, 2, 2), 24)
    wider = match.similarity(parent, _graph((1, 2, 2), 48))
    reshuffled = match.similarity(parent, _graph((2, 2, 1), 48))
    assert wider >= reshuffled
    assert reshuffled >= 0.3  # still above the default minSimilarity: it warm-starts


def test_equal_shapes_in_different_stages_do_not_match() -> None:
    parent, child = _graph((1, 2, 2), 24), _graph((2, 2, 1), 48)
    p, c = graph.prepare(parent), graph.prepare(child)
    scores = match.node_scores(p, c)
    row = p.nodes.index(_node(parent, "stages.1.1.conv2"))
    col = c.nodes.index(_node(child, "stages.0.1.conv2"))
    assert parent.nodes[p.nodes[row]]["weight_shape"] == child.nodes[c.nodes[col]]["weight_shape"]
    assert scores[row, col] == match.MISMATCH


def _node(g: nx.DiGraph, target: str) -> str:
    return next(str(v) for v, a in g.nodes(data=True) if a["target"] == target)


def _one(op: str, shape: list[int]) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_node("x", op=op, weight_shape=shape, params=[], buffers=[], out_shape=[], target="x")
    return g


@pytest.mark.parametrize(("op", "parent_shape", "child_shape", "expected"), [
    # 2x in and out: the input growth mirrors the producer's widening, so 1/2, not 1/4
    pytest.param("Conv2d", [24, 24, 3, 3], [48, 48, 3, 3], 0.5, id="conv-widened-2x"),
    pytest.param("Linear", [16, 8], [48, 24], 1 / 3, id="linear-widened-3x"),
    # inputs grown alone (another producer, not a widening): counted as before
    pytest.param("Linear", [16, 8], [16, 16], 0.5, id="linear-inputs-only"),
    pytest.param("Conv2d", [8, 3, 3, 3], [8, 8, 3, 3], 0.375, id="conv-inputs-only"),
    # not a fan-in layer (dim 1 is the embedding width): both dims count
    pytest.param("Embedding", [32, 8], [64, 16], -1.0, id="embedding-both-dims"),
])
def test_widening_scores(op: str, parent_shape: list[int], child_shape: list[int],
                         expected: float) -> None:
    score = match.node_scores(_one(op, parent_shape), _one(op, child_shape))[0, 0]
    assert score == pytest.approx(expected)


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return (images - images.mean()) / images.std(), torch.tensor(digits.target)


@pytest.mark.training
def test_warm_started_wider_reshuffled_child_beats_a_random_init() -> None:
    # The parent trains briefly on digits; its [2, 2, 1] child, 2x wider, must start with a
    # lower loss than the same child freshly initialised (never worse than random).
    images, labels = _digits()
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(images), generator=generator)
    held_out, train = order[:300], order[300:]
    torch.manual_seed(0)
    parent = _model([1, 2, 2], 8)
    optimizer = torch.optim.Adam(parent.parameters(), lr=3e-3)
    for _ in range(60):
        batch = train[torch.randint(len(train), (64,), generator=generator)]
        loss = F.cross_entropy(parent(images[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        optimizer.step()
    parent.eval()
    cold = _model([2, 2, 1], 16)
    result = transform.warm_start_state(parent.state_dict(), graph.extract(parent, list(SHAPE)),
                                        cold, list(SHAPE), generator=generator)
    warm = _model([2, 2, 1], 16)
    warm.load_state_dict(result.state_dict, strict=True)

    def held_out_loss(model: nn.Module) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model.eval()(images[held_out]), labels[held_out]))

    assert held_out_loss(parent) < 1.0  # the parent learned something worth inheriting
    assert held_out_loss(warm) < 0.5 * held_out_loss(cold)
