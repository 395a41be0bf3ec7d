"""bench/finetune.py: its GPU sizing builds valid jobs, and bad flags are refused by name.

Nothing trains here; the CPU run is the quick benchmark's smoke test.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from kiln import models


@pytest.fixture(scope="module")
def bench(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("finetune")


def test_gpu_cases_build_32_pixel_resnet20_jobs_on_cuda(bench: ModuleType) -> None:
    for name, case in bench.GPU_CASES.items():
        source, target = case[0], case[3]
        assert source["torchvisionClass"] != target["torchvisionClass"], name  # another task
        for arm in bench.ARMS:
            job = bench.child_job(case, arm, seed=0, epochs=30, parent_id="m-1",
                                  sizing=bench.GPU)
            training = job.spec.training
            assert (training.device, training.batch_size) == ("cuda", 128)
            assert job.spec.model.input_shape == [1, 32, 32]
            assert job.spec.dataset.max_samples == target["maxSamples"]
        model = models.build(bench.child_job(case, "full", seed=0, epochs=30, parent_id=None,
                                             sizing=bench.GPU).spec.model)
        assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 10)
    # the CPU sizing stays the reported one: 8 px, batch 64, on the CPU
    cpu = bench.child_job(bench.CASES["fashion>mnist"], "kiln", seed=0, epochs=30,
                          parent_id=None)
    assert cpu.spec.model.input_shape == [1, 8, 8]
    assert (cpu.spec.training.device, cpu.spec.training.batch_size) == ("cpu", 64)


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "cuda"], "--device cuda: torch sees no CUDA device here"),
    (["--cases", "fashion>nowhere"], "--cases fashion>nowhere: unknown on cpu; choose from"),
])
def test_bad_flags_are_refused_by_name(bench: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str], argv: list[str],
                                       message: str) -> None:
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a GPU is here: --device cuda would run")
    monkeypatch.setattr("sys.argv", ["finetune.py", *argv])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
