"""kiln_trainer.freezing.reference: int8 quantization of extractors, and the worker process.

The worker tests start real spawned processes (a few seconds of imports each on a loaded
machine): one fp32 worker is shared by the tests that leave it healthy; the tests that close,
crash or kill a worker start their own. pytest-timeout guards every test that could block.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from kiln import api, models
from kiln_trainer.freezing import partition, plasticity, reference

SPEC = api.ModelSpec(architecture="small_resnet", input_shape=[1, 8, 8])
BLOCKS = models.natural_blocks(models.build(SPEC))  # stem, stages.0.0, ..., head
STARTUP_SECONDS = 180.0  # guard only: spawn + imports on a busy 2-core machine
_ids = itertools.count(1)  # probe ids and versions, unique across the shared worker's tests


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


# -- quantize --------------------------------------------------------------------------------


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
    quantized, got_kind = reference.quantize(extractor, inputs)
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
    quantized, _ = reference.quantize(extractor, inputs)
    assert extractor.training and not quantized.training
    assert all(p.requires_grad for p in extractor.parameters())
    after = extractor.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_quantize_in_fp32_mode_returns_an_exact_float_copy() -> None:
    extractor, inputs = _extractor("small_cnn", (1, 8, 8))
    copy, kind = reference.quantize(extractor, inputs, mode="fp32")
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
    caplog.set_level(logging.INFO, logger=reference.__name__)
    _, got = reference.quantize(CircularConv(linear=linear), torch.randn(4, 1, 8, 8))
    assert got == kind
    assert "int8-static quantization failed" in caplog.text and "circular" in caplog.text


def test_quantize_keeps_fp32_for_a_model_without_quantizable_layers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=reference.__name__)
    model = nn.Sequential(nn.BatchNorm1d(3), nn.ReLU())
    assert reference.quantize(model, torch.randn(4, 3))[1] == "fp32"
    assert "no conv, linear or RNN layer" in caplog.text


def test_quantize_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        reference.quantize(nn.Linear(2, 2), torch.randn(2, 2), mode="int4")


# -- ReferenceWorker ---------------------------------------------------------------------------


Tensors = dict[str, torch.Tensor]


def _training(seed: int = 0) -> tuple[Tensors, torch.Tensor, Tensors]:
    """A training model's state dict, a probe batch and its (unflattened) block activations."""
    torch.manual_seed(seed)
    model = models.build(SPEC)
    model(torch.randn(32, 1, 8, 8))  # train mode: BatchNorm statistics move away from 0/1
    model.eval()
    extractor = partition.extractor(model, BLOCKS)
    inputs = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        activations = extractor(inputs)
    return model.state_dict(), inputs, activations


def _results(worker: reference.ReferenceWorker, count: int = 1) -> list[reference.ProbeResult]:
    """Wait (without spinning) until `count` results came, the worker died, or the guard ran out."""
    deadline = time.monotonic() + STARTUP_SECONDS
    results: list[reference.ProbeResult] = []
    while len(results) < count and worker.alive and time.monotonic() < deadline:
        worker.wait(max(0.0, deadline - time.monotonic()))
        results += worker.poll()
    return results


@pytest.fixture(scope="module")
def fp32_worker() -> Iterator[reference.ReferenceWorker]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        worker = reference.ReferenceWorker(SPEC, BLOCKS, threads=1, mode="fp32")
    with worker:
        yield worker


@pytest.mark.timeout(300)
def test_refresh_then_submit_answers_one_plasticity_per_block_near_zero_for_the_same_weights(
    fp32_worker: reference.ReferenceWorker,
) -> None:
    weights, inputs, activations = _training()
    version, probe_id = next(_ids), next(_ids)
    fp32_worker.refresh(version, weights, inputs)
    assert fp32_worker.submit(probe_id, version, inputs, activations)
    [result] = _results(fp32_worker)
    assert (result.probe_id, result.version) == (probe_id, version)
    assert list(result.plasticity) == BLOCKS[:-1]
    assert all(value < 1e-9 for value in result.plasticity.values()), result.plasticity
    assert result.seconds > 0.0 and fp32_worker.cpu_seconds >= result.seconds
    assert fp32_worker.kind == "fp32"


@pytest.mark.timeout(300)
def test_results_of_an_older_version_are_discarded_after_a_new_refresh(
    fp32_worker: reference.ReferenceWorker,
) -> None:
    weights, inputs, activations = _training()
    old = next(_ids)
    fp32_worker.refresh(old, weights, inputs)
    assert fp32_worker.submit(next(_ids), old, inputs, activations)
    assert len(_results(fp32_worker)) == 1  # the worker holds version `old`
    stale_before = fp32_worker.stale_results
    assert fp32_worker.submit(next(_ids), old, inputs, activations)
    assert fp32_worker.wait(STARTUP_SECONDS)  # its answer (for `old`) waits unread
    new = next(_ids)
    fp32_worker.refresh(new, _training(seed=1)[0], inputs)
    assert fp32_worker.poll() == []
    assert fp32_worker.stale_results == stale_before + 1
    assert not fp32_worker.submit(next(_ids), old, inputs, activations)  # not the latest
    assert fp32_worker.submit(probe_id := next(_ids), new, inputs, activations)
    [result] = _results(fp32_worker)
    assert (result.probe_id, result.version) == (probe_id, new)
    assert all(value > 1e-6 for value in result.plasticity.values())  # other weights now


@pytest.mark.timeout(300)
def test_a_stopped_worker_never_blocks_submit_or_refresh_and_recovers(
    fp32_worker: reference.ReferenceWorker,
) -> None:
    weights, inputs, activations = _training()
    version = next(_ids)
    fp32_worker.refresh(version, weights, inputs)
    assert fp32_worker.submit(next(_ids), version, inputs, activations)
    assert len(_results(fp32_worker)) == 1
    pid = fp32_worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        assert fp32_worker.submit(next(_ids), version, inputs, activations)  # the one free slot
        answers = []
        for _ in range(10):  # the timeout guard fails this test if any call blocks
            version = next(_ids)
            fp32_worker.refresh(version, weights, inputs)
            answers.append(fp32_worker.submit(next(_ids), version, inputs, activations))
            answers.append(fp32_worker.submit(next(_ids), version, inputs, activations))
        assert answers == [False] * 20
        assert fp32_worker.poll() == [] and fp32_worker.alive
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + STARTUP_SECONDS
    results: list[reference.ProbeResult] = []
    while not results and time.monotonic() < deadline:
        if fp32_worker.submit(next(_ids), version, inputs, activations):
            results = _results(fp32_worker)
        else:
            fp32_worker.wait(1.0)  # the worker is still skipping the stale probe
    assert [r.version for r in results] == [version]
    assert all(value < 1e-9 for value in results[0].plasticity.values())


@pytest.mark.timeout(300)
def test_auto_worker_quantizes_and_close_is_idempotent_and_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    weights, inputs, activations = _training()
    with reference.ReferenceWorker(SPEC, BLOCKS, mode="auto") as worker:
        pid = worker.pid
        worker.refresh(1, weights, inputs)
        assert worker.submit(1, 1, inputs, activations)
        [result] = _results(worker)
        assert worker.kind == "int8-static"
        assert list(worker.noise_floor) == BLOCKS[:-1]
        assert all(value < 1e-3 for value in result.plasticity.values()), result.plasticity
    worker.close()
    assert not worker.alive and worker.pid is None
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not worker.submit(2, 1, inputs, activations)
    assert worker.poll() == [] and not worker.wait(0.0)
    worker.refresh(2, weights, inputs)  # a no-op once closed


@pytest.mark.timeout(300)
def test_a_worker_exception_is_logged_and_marks_the_worker_dead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    caplog.set_level(logging.ERROR, logger=reference.__name__)
    _, inputs, activations = _training()
    with reference.ReferenceWorker(SPEC, BLOCKS, mode="fp32") as worker:
        worker.refresh(1, {"bogus": torch.zeros(1)}, inputs)  # load_state_dict raises
        assert _results(worker) == []
        assert not worker.alive
        assert "reference worker failed" in caplog.text and "bogus" in caplog.text
        assert not worker.submit(1, 1, inputs, activations)


@pytest.mark.timeout(300)
def test_a_killed_worker_is_reported_dead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    caplog.set_level(logging.ERROR, logger=reference.__name__)
    weights, inputs, activations = _training()
    with reference.ReferenceWorker(SPEC, BLOCKS, mode="fp32") as worker:
        worker.refresh(1, weights, inputs)
        assert worker.submit(1, 1, inputs, activations) and len(_results(worker)) == 1
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        assert worker.wait(STARTUP_SECONDS)  # end of file on the results pipe
        assert worker.poll() == [] and not worker.alive
        assert "reference worker failed" in caplog.text
