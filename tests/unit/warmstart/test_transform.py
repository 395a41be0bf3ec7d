"""Tests for kiln.warmstart.transform: Net2Net function preservation, centring, BN statistics,
heads, registry models, no mutation, learning-rate damping.

Function-preservation tests run with the noise off and in eval mode, on hand-built models whose
BatchNorm layers carry non-trivial statistics, so a wrong replica or a missed division shows.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from kiln import models
from kiln.warmstart import graph, match, transform

ATOL = 1e-5


def _randomise_norms(model: nn.Module, seed: int) -> nn.Module:
    """Give every BatchNorm a non-trivial affine map and running statistics; eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                assert m.running_mean is not None and m.running_var is not None
                assert m.num_batches_tracked is not None
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
                m.num_batches_tracked.fill_(7)
    return model.eval()


def _warm(parent: nn.Module, child: nn.Module, input_shape: Sequence[int],
          **kwargs: float) -> transform.TransformResult:
    """Transform parent -> child (noise off unless given) and load the result into the child."""
    kwargs.setdefault("noise_std", 0.0)
    result = transform.warm_start_state(parent.state_dict(), graph.extract(parent, input_shape),
                                        child, input_shape, noise_std=kwargs["noise_std"])
    child.load_state_dict(result.state_dict, strict=True)
    return result


def _max_output_gap(parent: nn.Module, child: nn.Module, input_shape: Sequence[int]) -> float:
    x = torch.rand(5, *input_shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((parent.eval()(x) - child.eval()(x)).abs().max())


def _mlp(hidden: int, *, classes: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def _conv_bn_net(width: int, *, flatten_head: bool = False) -> nn.Module:
    """Two conv+BN+ReLU layers, then pool+linear (or flatten+linear over a 4x4 map)."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
    ]
    if flatten_head:
        layers += [nn.Flatten(), nn.Linear(width * 16, 10)]
    else:
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)]
    return _randomise_norms(nn.Sequential(*layers), seed=width)


def _deep_conv_net(width: int, *, inserted: Sequence[nn.Module] = ()) -> nn.Module:
    """conv -> ReLU -> [inserted] -> conv+BN+ReLU -> pool -> linear.

    The first conv has no BatchNorm so the alignment is unambiguous: with conv+BN+ReLU
    everywhere, the matcher may align the parent's first BN with an inserted BN (an equal-score
    alignment) and no weight transform can then preserve the function.
    """
    return _randomise_norms(nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), *inserted,
        nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)), seed=width)


# ---------------------------------------------------------------------------------------------
# (a) wider copies preserve the function
# ---------------------------------------------------------------------------------------------

def test_wider_mlp_computes_the_parents_function() -> None:
    torch.manual_seed(0)
    parent, child = _mlp(32).eval(), _mlp(64).eval()
    result = _warm(parent, child, (8,))
    assert _max_output_gap(parent, child, (8,)) < ATOL
    assert result.matched_tensors == result.total_tensors == 6
    assert result.untransferred_fraction == 0.0


@pytest.mark.parametrize("flatten_head", [
    pytest.param(False, id="pooled-head"),
    pytest.param(True, id="flattened-head-divides-per-channel-block"),
])
def test_wider_conv_bn_net_computes_the_parents_function(flatten_head: bool) -> None:
    torch.manual_seed(0)
    parent = _conv_bn_net(16, flatten_head=flatten_head)
    child = _conv_bn_net(24, flatten_head=flatten_head)
    _warm(parent, child, (3, 4, 4))
    assert _max_output_gap(parent, child, (3, 4, 4)) < ATOL


def test_widened_units_copy_k_mod_old_and_inputs_are_divided_by_replica_count() -> None:
    torch.manual_seed(0)
    parent, child = _mlp(2), _mlp(3)
    _warm(parent, child, (8,))
    p, c = parent.state_dict(), child.state_dict()
    assert torch.equal(c["0.weight"][2], p["0.weight"][0])  # unit 2 copies unit 0 (2 mod 2)
    assert torch.equal(c["0.bias"][2], p["0.bias"][0])  # the bias travels with its unit
    # Unit 0 now has two replicas (0 and 2): both input columns carry half its fan-out.
    assert torch.allclose(c["4.weight"][:, 0], p["4.weight"][:, 0] / 2)
    assert torch.allclose(c["4.weight"][:, 2], p["4.weight"][:, 0] / 2)
    assert torch.equal(c["4.weight"][:, 1], p["4.weight"][:, 1])


def test_widening_noise_is_relative_seeded_and_nearly_preserves_the_function() -> None:
    torch.manual_seed(0)
    parent = _mlp(32).eval()
    graph_p = graph.extract(parent, (8,))
    runs = [transform.warm_start_state(parent.state_dict(), graph_p, _mlp(64), (8,),
                                       noise_std=0.01,
                                       generator=torch.Generator().manual_seed(3))
            for _ in range(2)]
    assert torch.equal(runs[0].state_dict["0.weight"], runs[1].state_dict["0.weight"])
    new_units = runs[0].state_dict["0.weight"][32:]
    sources = parent.state_dict()["0.weight"]
    assert not torch.equal(new_units, sources)
    relative = (new_units - sources).std() / sources.std()
    assert 0.002 < float(relative) < 0.05
    child = _mlp(64).eval()
    child.load_state_dict(runs[0].state_dict)
    assert _max_output_gap(parent, child, (8,)) < 0.05


# ---------------------------------------------------------------------------------------------
# (b) deeper copies: identity-initialised inserted layers
# ---------------------------------------------------------------------------------------------

def test_deeper_mlp_with_inserted_linear_relu_computes_the_parents_function() -> None:
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    child = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4)).eval()
    result = _warm(parent, child, (8,))
    assert _max_output_gap(parent, child, (8,)) < ATOL
    assert len(result.identity_initialised) == 2  # one Linear's weight and bias
    assert result.matched_tensors == 4 and result.total_tensors == 6


@pytest.mark.parametrize("width", [pytest.param(8, id="same-width"),
                                   pytest.param(12, id="deeper-and-wider")])
def test_deeper_conv_net_with_inserted_conv_bn_relu_computes_the_parents_function(
        width: int) -> None:
    torch.manual_seed(0)
    parent = _deep_conv_net(8)
    child = _deep_conv_net(width, inserted=[nn.Conv2d(width, width, 3, padding=1),
                                            nn.BatchNorm2d(width), nn.ReLU()])
    result = _warm(parent, child, (3, 6, 6))
    assert _max_output_gap(parent, child, (3, 6, 6)) < ATOL
    state = child.state_dict()
    dirac = torch.zeros(width, width, 3, 3)
    dirac[range(width), range(width), 1, 1] = 1.0
    assert torch.equal(state["2.weight"], dirac)  # Dirac at the kernel centre
    assert torch.equal(state["3.running_var"], torch.ones(width))
    assert {"2.weight", "2.bias", "3.weight", "3.bias", "3.running_mean",
            "3.running_var"} <= set(result.identity_initialised)


def test_inserted_depthwise_conv_is_identity_per_group() -> None:
    torch.manual_seed(0)
    parent = _deep_conv_net(8)
    child = _deep_conv_net(8, inserted=[nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU()])
    result = _warm(parent, child, (3, 6, 6))
    assert "2.weight" in result.identity_initialised
    assert _max_output_gap(parent, child, (3, 6, 6)) < ATOL


def test_identity_noise_is_scaled_by_fan_in() -> None:
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 4))
    child = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))
    result = transform.warm_start_state(parent.state_dict(), graph.extract(parent, (8,)), child,
                                        (8,), noise_std=0.1,
                                        generator=torch.Generator().manual_seed(0))
    inserted = next(k for k in result.identity_initialised if k.endswith("weight"))
    noise = result.state_dict[inserted] - torch.eye(256)
    assert float(noise.std()) == pytest.approx(0.1 / 256 ** 0.5, rel=0.1)


def test_inserted_layers_that_cannot_be_identity_keep_the_childs_init_with_a_note() -> None:
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    child = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(),
                          nn.Linear(12, 4))
    fresh = {k: v.clone() for k, v in child.state_dict().items()}
    result = _warm(parent, child, (8,))
    assert result.identity_initialised == []
    assert any("narrower (16 -> 12)" in note for note in result.notes)
    assert torch.equal(child.state_dict()["2.weight"], fresh["2.weight"])


def test_a_wider_inserted_layer_copies_its_inputs_and_the_next_layer_shares_them() -> None:
    # 16 -> 40: unit k copies input unit k mod 16; the head divides each input's fan-out
    # among its copies (2 or 3), so the child computes the parent exactly
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    child = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 40), nn.ReLU(),
                          nn.Linear(40, 4))
    result = _warm(parent, child, (8,))
    assert {"2.weight", "2.bias"} <= set(result.identity_initialised)
    assert _max_output_gap(parent, child, (8,)) < ATOL


def test_long_runs_of_inserted_layers_keep_the_childs_init_but_a_residual_branch_ends_at_zero(
        ) -> None:
    # small_resnet [1,1,1] -> [2,2,2] inserts whole blocks (4 weighted layers each): too long
    # for identity init; each block's last BN (the branch's end) is zeroed, so the child still
    # computes the parent, and the rest keeps the child's init.
    torch.manual_seed(0)
    parent = _randomise_norms(models.get_model("small_resnet", input_shape=(3, 16, 16),
                                               blocks=[1, 1, 1]), seed=2)
    child = models.get_model("small_resnet", input_shape=(3, 16, 16), blocks=[2, 2, 2]).eval()
    fresh = {k: v.clone() for k, v in child.state_dict().items()}
    result = _warm(parent, child, (3, 16, 16))
    assert sorted(result.identity_initialised) == sorted(
        f"stages.{s}.1.bn2.{p}" for s in range(3) for p in ("weight", "bias"))
    assert torch.equal(child.state_dict()["stages.0.1.conv1.weight"],
                       fresh["stages.0.1.conv1.weight"])
    assert _max_output_gap(parent, child, (3, 16, 16)) < ATOL


def test_a_new_stage_projects_the_parents_features_and_drops_its_branch() -> None:
    # [1,1,1] -> [1,1,1,1]: the new stage's projection shortcut copies channel k mod 64 (a
    # stride-2 1x1 conv: every other pixel), its BN starts as the identity and the branch at
    # zero, so the child computes the parent on the subsampled last feature map.
    torch.manual_seed(0)
    parent = _randomise_norms(models.get_model("small_resnet", input_shape=(3, 16, 16),
                                               blocks=[1, 1, 1]), seed=2)
    child = models.get_model("small_resnet", input_shape=(3, 16, 16), blocks=[1, 1, 1, 1])
    result = _warm(parent, child, (3, 16, 16))
    assert {"stages.3.0.shortcut.0.weight", "stages.3.0.shortcut.1.weight",
            "stages.3.0.bn2.weight", "stages.3.0.bn2.bias"} <= set(result.identity_initialised)
    x = torch.rand(5, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        features = parent.eval().stages(parent.stem(x))  # [5, 64, 4, 4]
        subsampled = parent.head[2](features[:, :, ::2, ::2].mean((2, 3)))
        assert float((child.eval()(x) - subsampled).abs().max()) < ATOL


class _Residual(nn.Module):
    """x + Linear(ReLU(Linear(x))), or with `tail` (an op that keeps zero at zero) after the
    outer Linear: a residual block whose init is not the identity."""

    def __init__(self, width: int, tail: nn.Module | None = None) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.tail = tail or nn.Sequential()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.tail(self.outer(torch.relu(self.inner(x))))


@pytest.mark.parametrize("depths", [(1, 2), (1, 3), (2, 3)], ids=lambda d: f"{d[0]}-to-{d[1]}")
def test_a_deeper_transformer_computes_the_parents_function(depths: tuple[int, int]) -> None:
    # Whole pre-norm blocks are inserted: each branch's last Linear (attention output, MLP
    # output) starts at zero, the rest of the block at the child's init.
    parent_depth, child_depth = depths
    torch.manual_seed(0)
    parent = models.get_model("char_transformer", input_shape=(12,), depth=parent_depth,
                              width=16).eval()
    child = models.get_model("char_transformer", input_shape=(12,), depth=child_depth,
                             width=16).eval()
    result = _warm(parent, child, (12,))
    tokens = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((parent(tokens) - child(tokens)).abs().max()) < ATOL
    ends = {f"layers.{i}.{layer}.{p}" for i in range(parent_depth, child_depth)
            for layer in ("attention.out", "mlp.2") for p in ("weight", "bias")}
    assert set(result.identity_initialised) == ends
    assert any("starts as the identity" in note for note in result.notes)


@pytest.mark.parametrize(("architecture", "parent_args", "child_args", "input_shape"), [
    pytest.param("vit", {"width": 32, "heads": 2}, {"width": 64, "heads": 2}, (1, 8, 8),
                 id="vit-head-width-doubled"),
    pytest.param("vit", {"width": 32, "heads": 2}, {"width": 64, "heads": 4}, (1, 8, 8),
                 id="vit-heads-doubled"),
    pytest.param("char_transformer", {"width": 32, "heads": 4, "depth": 2},
                 {"width": 64, "heads": 4, "depth": 3}, (12,), id="lm-wider-and-deeper"),
])
def test_a_wider_transformer_keeps_whole_heads_and_computes_the_parents_function(
        architecture: str, parent_args: dict[str, int], child_args: dict[str, int],
        input_shape: tuple[int, ...]) -> None:
    # Every width doubles: the residual stream, positions, class token, layer norms and MLP
    # replicate uniformly (a layer norm's mean and variance stay the parent's), each child
    # head copies one parent head whole, and queries are scaled for the head width.
    extra = {"patch_size": 2, "num_classes": 10} if architecture == "vit" else {}
    torch.manual_seed(0)
    parent = models.get_model(architecture, input_shape=input_shape, **parent_args, **extra)
    child = models.get_model(architecture, input_shape=input_shape, **child_args, **extra)
    _warm(parent, child, input_shape)
    if architecture == "vit":
        assert _max_output_gap(parent, child, input_shape) < ATOL
    else:
        tokens = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert float((parent.eval()(tokens) - child.eval()(tokens)).abs().max()) < ATOL


class _Attention(nn.Module):
    """A user's attention written with matmuls, not scaled_dot_product_attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key = nn.Linear(width, width), nn.Linear(width, width)
        self.value, self.out = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = self.query.out_features // self.heads
        q, k, v = (f(x).unflatten(-1, (self.heads, dim)).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        weights = torch.softmax(q @ k.transpose(-2, -1) / dim ** 0.5, dim=-1)
        return self.out((weights @ v).transpose(1, 2).flatten(2))


def test_a_users_matmul_attention_widens_with_whole_heads() -> None:
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(6, 16), _Attention(16, 2), nn.Linear(16, 3))
    child = nn.Sequential(nn.Linear(6, 32), _Attention(32, 2), nn.Linear(32, 3))
    _warm(parent, child, (5, 6))
    assert _max_output_gap(parent, child, (5, 6)) < ATOL


def test_head_map_keeps_each_child_head_on_one_parent_head() -> None:
    # 2 heads of 16 -> 4 heads of 12: no exact copy exists, but no child head mixes two parent
    # heads (k mod 32 would put units 12-23, from both heads, in the second child head)
    mapped = transform.head_map(32, 2, 48, 4)
    heads = [mapped.index[h * 12:(h + 1) * 12] for h in range(4)]
    assert [{u // 16 for u in head} for head in heads] == [{0}, {0}, {1}, {1}]
    assert heads[1] == (12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)  # continues, wrapping
    assert set(mapped.index) == set(range(32)) and mapped.parent_width == 32
    query = {"op": "Linear_query", "heads": 2, "weight_shape": [32, 32]}
    assert transform.query_scale(query, {**query, "heads": 4, "weight_shape": [48, 48]}) \
        == pytest.approx((16 / 12) ** 0.5)
    assert transform.query_scale({**query, "op": "Linear_key"},
                                 {"op": "Linear_key", "heads": 4, "weight_shape": [48, 48]}) == 1
    assert transform.query_scale({**query, "heads": 0}, query) == 1  # heads unknown


@pytest.mark.parametrize("tail", [None, nn.GELU(), nn.Dropout(0.5)],
                         ids=["linear-then-add", "through-gelu", "through-dropout"])
def test_a_residual_branch_is_zeroed_only_where_the_other_input_carries_the_parent(
        tail: nn.Module | None) -> None:
    # Parent: Linear, one residual block, head. The child adds a residual block whose random
    # init would change the function: its outer Linear is zeroed (found through the tail op),
    # its inner kept.
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(8, 16), _Residual(16, tail), nn.Linear(16, 4)).eval()
    child = nn.Sequential(nn.Linear(8, 16), _Residual(16, tail), _Residual(16, tail),
                          nn.Linear(16, 4)).eval()
    fresh = {k: v.clone() for k, v in child.state_dict().items()}
    result = _warm(parent, child, (8,))
    assert _max_output_gap(parent, child, (8,)) < ATOL
    inserted = "2" if "2.outer.weight" in result.identity_initialised else "1"
    assert torch.equal(child.state_dict()[f"{inserted}.outer.weight"],
                       torch.zeros_like(fresh[f"{inserted}.outer.weight"]))
    assert torch.equal(child.state_dict()[f"{inserted}.inner.weight"],
                       fresh[f"{inserted}.inner.weight"])


# ---------------------------------------------------------------------------------------------
# (c) centred kernels
# ---------------------------------------------------------------------------------------------

def test_smaller_parent_kernel_is_centred_in_the_larger_child_kernel() -> None:
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1))
    child = nn.Sequential(nn.Conv2d(2, 4, 5, padding=2))
    _warm(parent, child, (2, 7, 7))
    w, p = child.state_dict()["0.weight"], parent.state_dict()["0.weight"]
    assert torch.equal(w[:, :, 1:4, 1:4], p)
    border = w.clone()
    border[:, :, 1:4, 1:4] = 0
    assert torch.count_nonzero(border) == 0
    assert _max_output_gap(parent, child, (2, 7, 7)) < ATOL  # 'same' padding: same function


def test_larger_parent_kernel_gives_its_centre_to_the_smaller_child_kernel() -> None:
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Conv2d(2, 4, 5, padding=2))
    child = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1))
    _warm(parent, child, (2, 7, 7))
    assert torch.equal(child.state_dict()["0.weight"],
                       parent.state_dict()["0.weight"][:, :, 1:4, 1:4])


# ---------------------------------------------------------------------------------------------
# (d) BatchNorm statistics travel
# ---------------------------------------------------------------------------------------------

def test_batchnorm_running_statistics_travel_and_are_replicated_when_widened() -> None:
    torch.manual_seed(0)
    parent, child = _conv_bn_net(16), _conv_bn_net(24)
    result = _warm(parent, child, (3, 4, 4))
    p, c = parent.state_dict(), child.state_dict()
    index = [k % 16 for k in range(24)]
    for key in ("1.running_mean", "1.running_var", "4.running_mean", "4.running_var",
                "1.weight", "4.bias"):
        assert torch.equal(c[key], p[key][index]), key
    assert int(c["1.num_batches_tracked"]) == 7
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(
        result.transferred_buffers)


# ---------------------------------------------------------------------------------------------
# (e) heads
# ---------------------------------------------------------------------------------------------

def test_head_with_more_classes_copies_the_overlapping_rows_and_keeps_the_rest() -> None:
    torch.manual_seed(0)
    parent, child = _mlp(16, classes=10), _mlp(16, classes=100)
    fresh = {k: v.clone() for k, v in child.state_dict().items()}
    result = _warm(parent, child, (8,))
    p, c = parent.state_dict(), child.state_dict()
    assert torch.equal(c["4.weight"][:10], p["4.weight"])
    assert torch.equal(c["4.bias"][:10], p["4.bias"])
    assert torch.equal(c["4.weight"][10:], fresh["4.weight"][10:])  # not replicated classes
    assert torch.equal(c["4.bias"][10:], fresh["4.bias"][10:])
    assert any("10 -> 100 outputs" in note and "90 keep the child's init" in note
               for note in result.notes)
    x = torch.rand(3, 8)
    with torch.no_grad():
        assert torch.allclose(parent.eval()(x), child.eval()(x)[:, :10], atol=ATOL)


# ---------------------------------------------------------------------------------------------
# (f) registry models
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("architecture", "parent_args", "child_arch", "child_args", "shape"), [
    pytest.param("resnet18", {}, "resnet34", {}, (3, 32, 32), id="resnet18-to-resnet34"),
    pytest.param("small_resnet", {"blocks": [1, 1, 1]}, "small_resnet", {"blocks": [2, 2, 2]},
                 (3, 16, 16), id="small_resnet-111-to-222"),
])
def test_registry_parent_transfers_most_tensors_into_a_deeper_child(
        architecture: str, parent_args: dict[str, object], child_arch: str,
        child_args: dict[str, object], shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    parent = models.get_model(architecture, input_shape=shape, **parent_args)
    child = models.get_model(child_arch, input_shape=shape, **child_args)
    result = _warm(parent, child, shape, noise_std=0.01)  # loads with strict=True
    assert result.matched_tensors / result.total_tensors > 0.5
    assert result.untransferred_fraction == pytest.approx(
        1 - result.matched_tensors / result.total_tensors)
    assert set(result.state_dict) == set(child.state_dict())


# ---------------------------------------------------------------------------------------------
# (g) inputs are never mutated; errors
# ---------------------------------------------------------------------------------------------

def test_transform_mutates_neither_state_dicts_nor_graphs_and_shares_no_storage() -> None:
    torch.manual_seed(0)
    parent, child = _conv_bn_net(16), _conv_bn_net(24)
    parent_state, child_state = parent.state_dict(), child.state_dict()
    before = [{k: v.clone() for k, v in state.items()} for state in (parent_state, child_state)]
    pg, cg = graph.extract(parent, (3, 4, 4)), graph.extract(child, (3, 4, 4))
    graphs_before = (graph.to_json(pg), graph.to_json(cg))
    result = transform.transform(parent_state, pg, child_state, cg, match.align(pg, cg),
                                 noise_std=0.1, generator=torch.Generator().manual_seed(0))
    for state, copy in zip((parent_state, child_state), before):
        for key, value in state.items():
            assert torch.equal(value, copy[key]), key
    assert (graph.to_json(pg), graph.to_json(cg)) == graphs_before
    inputs = {t.untyped_storage().data_ptr() for t in [*parent_state.values(),
                                                       *child_state.values()]}
    assert not inputs & {t.untyped_storage().data_ptr() for t in result.state_dict.values()}


def test_graph_that_does_not_match_its_weights_is_rejected() -> None:
    parent, child = _mlp(8), _mlp(8)
    pg, cg = graph.extract(parent, (8,)), graph.extract(child, (8,))
    broken = dict(parent.state_dict())
    del broken["2.weight"]
    with pytest.raises(transform.TransformError, match="2.weight"):
        transform.transform(broken, pg, child.state_dict(), cg, match.align(pg, cg))


# ---------------------------------------------------------------------------------------------
# learning-rate damping
# ---------------------------------------------------------------------------------------------

_RUN = {"steps_per_epoch": 10, "total_steps": 300}  # 30 epochs: damped for the first 2


@pytest.mark.parametrize(("untransferred", "step", "expected"), [
    pytest.param(0.0, 0, 0.3, id="full-transfer-hits-the-floor"),
    pytest.param(0.6, 19, 0.6, id="damped-by-what-was-not-transferred"),
    pytest.param(1.0, 0, 1.0, id="cold-start-undamped"),
    pytest.param(0.0, 20, 1.0, id="full-rate-after-warm-epochs"),
])
def test_lr_damping_is_clipped_untransferred_fraction_for_the_first_epochs(
        untransferred: float, step: int, expected: float) -> None:
    assert transform.lr_damping(untransferred, step, **_RUN) == pytest.approx(expected)


def test_more_transfer_means_a_smaller_first_epoch_learning_rate() -> None:
    assert transform.lr_damping(0.2, 0, **_RUN) < transform.lr_damping(0.5, 0, **_RUN) < 1.0


def test_a_short_run_is_damped_for_a_fifth_of_its_steps_at_most() -> None:
    # 2 epochs of 71 steps: damping both would hold the whole run at the floor
    short = {"steps_per_epoch": 71, "total_steps": 142}
    assert transform.lr_damping(0.0, 28, **short) == pytest.approx(0.3)
    assert transform.lr_damping(0.0, 29, **short) == 1.0
    assert transform.lr_damping(0.0, 1, steps_per_epoch=71, total_steps=142,
                                max_fraction=0.0) == 1.0


@pytest.mark.parametrize(("untransferred", "step", "arguments"), [
    pytest.param(1.5, 0, {}, id="fraction"),
    pytest.param(0.5, -1, {}, id="step"),
    pytest.param(0.5, 0, {"floor": 0.0}, id="floor"),
    pytest.param(0.5, 0, {"max_fraction": 1.5}, id="max-fraction"),
    pytest.param(0.5, 0, {"steps_per_epoch": 0}, id="steps-per-epoch"),
    pytest.param(0.5, 0, {"total_steps": 0}, id="total-steps"),
])
def test_lr_damping_rejects_out_of_range_arguments(untransferred: float, step: int,
                                                   arguments: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        transform.lr_damping(untransferred, step, **{**_RUN, **arguments})  # type: ignore[arg-type]
