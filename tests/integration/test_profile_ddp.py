"""`kiln profile` with two gloo DDP processes under torchrun on the CPU: the step of a real
small_cnn is timed on both ranks and cached next to the single-process profile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln import api
from kiln.placement import profile, profilecache


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="ddp k=2 needs two cores")
def test_ddp_on_two_cpu_processes_times_a_real_step_and_caches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    job = api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "p"},
        "spec": {"model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                           "inputShape": [1, 8, 8]},
                 "training": {"epochs": 1, "batchSize": 32}},
    })
    cache = tmp_path / "profiles.json"
    found = profile.profile_job(job, configs=[("single", 1), ("ddp", 2)], cache_path=cache,
                                device="cpu")
    assert [(m.parallelism, m.gpus, m.status) for m in found] == [
        ("single", 1, "ok"), ("ddp", 2, "ok")], found
    assert all(m.step_seconds and m.step_seconds > 0 for m in found)
    assert len(profilecache.read_cache(cache)) == 2
