"""kiln_trainer.freezing.reference from a model object: a module no registry or entrypoint
knows (defined in this test) gets its reference worker from a copy of itself, and a `Freezer`
built without a model spec probes it.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from kiln import models
from kiln_trainer.freezing import controller, partition, reference

GUARD_SECONDS = 120.0  # guard only: a forked worker starts in well under a second


class _LocalNet(nn.Module):
    """Defined here, so only a copy of the object itself can rebuild it in another process."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.second = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)))  # type: ignore[no-any-return]


@pytest.mark.timeout(300)
@pytest.mark.process
def test_a_worker_built_from_the_model_object_answers_probes_of_that_object() -> None:
    torch.manual_seed(0)
    model = _LocalNet()
    blocks = models.natural_blocks(model)
    assert blocks == ["first", "second", "head"]
    inputs = torch.randn(8, 6)
    with torch.no_grad():
        activations = partition.extractor(model.eval(), blocks)(inputs)
    with reference.ReferenceWorker(model, blocks, mode="fp32") as worker:
        worker.refresh(1, model.state_dict(), inputs)
        assert worker.submit(1, 1, inputs, {b: activations[b] for b in blocks[:-1]})
        deadline, results = time.monotonic() + GUARD_SECONDS, list[reference.ProbeResult]()
        while not results and worker.alive and time.monotonic() < deadline:
            worker.wait(1.0)
            results += worker.poll()
        assert worker.alive, "the forked reference worker died"
    [result] = results
    assert sorted(result.plasticity) == ["first", "second"]
    # Same weights on both sides: the fp32 reference reproduces the activations exactly.
    assert all(value < 1e-9 for value in result.plasticity.values()), result.plasticity


@pytest.mark.timeout(300)
@pytest.mark.process
def test_a_freezer_without_a_model_spec_starts_its_reference_from_the_model() -> None:
    model = _LocalNet()
    settings = controller.Settings(check_every_steps=1, window=2, reference="fp32")
    with controller.Freezer(model, None, torch.randn(4, 6), settings) as freezer:
        assert freezer.partition.blocks == ("first", "second", "head")
        assert freezer.worker is not None and freezer.worker.alive
