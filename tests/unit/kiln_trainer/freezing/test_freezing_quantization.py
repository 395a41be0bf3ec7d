"""kiln_trainer.freezing.quantization: int8 copies of block extractors, and their fallbacks."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from kiln import models
from kiln_trainer.freezing import partition, plasticity, quantization


def _extractor(name: str, shape: tuple[int, ...], **args: object) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = models.get_model(name, input_shape=shape, **args).eval()
    extractor = partition.extractor(model, models.natural_blocks(model)).eval()
    generator = torch.Generator().manual_seed(1)
    if models.get_info(name).modality == models.Modality.TEXT:
        return extractor, torch.randint(0, 256, (16, *shape), generator=generator)
    return extractor, torch.randn(16, *shape, generator=generator)


def _is_quantized(module: nn.Module) -> bool:
    return any(type(m).__module__.startswith("torch.ao.nn.") for m in module.modules())


@pytest.mark.parametrize(
    ("name", "shape", "args", "kind"),
    [
        pytest.param("small_cnn", (1, 8, 8), {}, "int8-static", id="small_cnn"),
        pytest.param("small_resnet", (1, 8, 8), {}, "int8-static", id="small_resnet"),
        pytest.param("vit", (1, 8, 8), {"depth": 2, "width": 32}, "int8-static", id="vit"),
        pytest.param(
            "char_transformer", (8,), {"depth": 2, "width": 32}, "int8-dynamic",
            id="char_transformer",
        ),
    ],
)
def test_quantize_makes_an_int8_copy_whose_activations_stay_close_to_fp32(
    name: str, shape: tuple[int, ...], args: dict[str, object], kind: str
) -> None:
    extractor, inputs = _extractor(name, shape, **args)
    quantized, got_kind = quantization.quantize(extractor, inputs)
    assert got_kind == kind and _is_quantized(quantized)
    with torch.no_grad():
        expected, actual = extractor(inputs), quantized(inputs)
    assert list(actual) == list(expected)
    for block, value in expected.items():
        assert actual[block].shape == value.shape
        # the int8 noise floor; SP's bound at b = 16 is 4/16 = 0.25
        assert plasticity.sp_loss(value, actual[block]) < 1e-3, block


def test_quantize_leaves_the_model_as_it_was() -> None:
    extractor, inputs = _extractor("small_resnet", (1, 8, 8))
    extractor.train()
    before = {k: v.clone() for k, v in extractor.state_dict().items()}
    quantized, _ = quantization.quantize(extractor, inputs)
    assert extractor.training and not quantized.training
    assert all(p.requires_grad for p in extractor.parameters())
    after = extractor.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_quantize_in_fp32_mode_returns_an_exact_float_copy() -> None:
    extractor, inputs = _extractor("small_cnn", (1, 8, 8))
    copy, kind = quantization.quantize(extractor, inputs, mode="fp32")
    assert kind == "fp32" and copy is not extractor and not _is_quantized(copy)
    assert not any(p.requires_grad for p in copy.parameters())
    with torch.no_grad():
        assert all(torch.equal(copy(inputs)[k], v) for k, v in extractor(inputs).items())


class CircularConv(nn.Module):
    """A conv with circular padding, which quantized convolutions do not support."""

    def __init__(self, *, linear: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, padding_mode="circular")
        self.linear = nn.Linear(4 * 8 * 8, 5) if linear else None

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.conv(images)
        if self.linear is None:
            return {"conv": features}
        return {"conv": features, "linear": self.linear(features.flatten(1))}


@pytest.mark.parametrize(
    ("linear", "kind"),
    [pytest.param(True, "int8-dynamic", id="then-dynamic"), pytest.param(False, "fp32", id="fp32")],
)
def test_quantize_falls_back_and_logs_why_when_static_quantization_fails(
    linear: bool, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=quantization.__name__)
    _, got = quantization.quantize(CircularConv(linear=linear), torch.randn(4, 1, 8, 8))
    assert got == kind
    assert "int8-static quantization failed" in caplog.text and "circular" in caplog.text


def test_quantize_keeps_fp32_for_a_model_without_quantizable_layers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=quantization.__name__)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.ReLU())
    assert quantization.quantize(model, torch.randn(4, 3))[1] == "fp32"
    assert "no conv, linear or RNN layer" in caplog.text


def test_quantize_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        quantization.quantize(nn.Linear(2, 2), torch.randn(2, 2), mode="int4")



def test_torch_ao_deprecations_are_logged_once_and_other_warnings_pass_through(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quantization, "_logged", set())
    monkeypatch.setattr(quantization, "_shown", {})
    extractor, inputs = _extractor("small_cnn", (1, 8, 8))
    with caplog.at_level(logging.INFO, logger=quantization.__name__), \
            warnings.catch_warnings(record=True) as passed:
        warnings.simplefilter("always")
        for _ in range(2):  # real torch.ao quantization: it warns on every call
            quantization.quantize(extractor, inputs)
        with quantization.torch_ao_warnings():
            warnings.warn("an unrelated problem", UserWarning, stacklevel=1)
    notes = [r.getMessage() for r in caplog.records if "torch.ao deprecation" in r.getMessage()]
    assert notes and len(notes) == len(set(notes)) <= len(quantization.KNOWN_DEPRECATIONS)
    # a ResourceWarning can come from the garbage collector finishing another test's objects
    assert [str(w.message) for w in passed
            if not issubclass(w.category, ResourceWarning)] == ["an unrelated problem"]
