"""kiln_trainer.freezing.reference: the worker process (quantization: its own test module).

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

from kiln import api, models
from kiln_trainer.freezing import partition, reference

pytestmark = pytest.mark.process

SPEC = api.ModelSpec(architecture="small_resnet", input_shape=[1, 8, 8])
BLOCKS = models.natural_blocks(models.build(SPEC))  # stem, stages.0.0, ..., head
STARTUP_SECONDS = 180.0  # guard only: spawn + imports on a busy 2-core machine
_ids = itertools.count(1)  # probe ids and versions, unique across the shared worker's tests


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
def test_auto_worker_picks_a_kind_by_cost_and_close_is_idempotent_and_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    weights, inputs, activations = _training()
    with reference.ReferenceWorker(SPEC, BLOCKS, mode="auto") as worker:
        pid = worker.pid
        worker.refresh(1, weights, inputs)
        assert worker.submit(1, 1, inputs, activations)
        [result] = _results(worker)
        # on a model this small re-quantizing costs more than the fp32 forward it saves
        assert worker.kind == "fp32" and worker.noise_floor == {}
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
