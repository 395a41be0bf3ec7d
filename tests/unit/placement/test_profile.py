"""`kiln.placement.profile` and `kiln profile`: a real timed step of small_cnn on the CPU, a real
out-of-memory (an input batch larger than any address space), the cache (hits, key, refresh,
corrupt file) and the command's exit codes. Multi-process (ddp) profiling runs in
tests/integration/test_profile_ddp.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api, cli, models
from kiln.placement import profile, profilecache


def _job(*, shape: list[int] | None = None, batch: int = 16,
         architecture: str = "small_cnn") -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "p"},
        "spec": {"model": {"architecture": architecture, "args": {"depth": 2, "width": 8},
                           "inputShape": shape or [1, 8, 8]},
                 "training": {"epochs": 1, "batchSize": batch}},
    })


def test_a_step_time_is_the_median_of_the_timed_steps_after_the_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A clock that makes the untimed first step take 10 s and one timed step 5 s (another
    # process took the CPU): the step time is the median of the timed ones.
    # Each step reads the clock as it starts and as it ends.
    readings = iter([0.0, 10.0, 10.0, 10.2, 10.2, 15.2, 15.2, 15.3])
    monkeypatch.setattr(profile.time, "perf_counter", lambda: next(readings))
    job = _job()
    assert profile.TIMED_STEPS == 3
    assert profile.step_seconds(job.spec.model, job.spec.training,
                                device=torch.device("cpu")) == pytest.approx(0.2)


def test_single_on_cpu_times_a_real_step_and_caches_it(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "profiles.json"
    job = _job()
    (first,) = profile.profile_job(job, configs=[("single", 1)], cache_path=cache, device="cpu")
    assert first.status == profilecache.STATUS_OK and not first.cached
    assert first.step_seconds is not None and first.step_seconds > 0
    key = profilecache.cache_key(job.spec.model, batch_size=16, parallelism="single", gpus=1,
                            kind="cpu")
    assert profilecache.read_cache(cache)[key]["step_seconds"] == first.step_seconds

    def no_measuring(*_: Any, **__: Any) -> float:
        raise AssertionError("a cached config must not be measured again")

    monkeypatch.setattr(profile, "step_seconds", no_measuring)
    (again,) = profile.profile_job(job, configs=[("single", 1)], cache_path=cache, device="cpu")
    assert again.cached and again.step_seconds == first.step_seconds


def test_the_cache_key_covers_args_shape_batch_parallelism_k_and_device() -> None:
    def key(model: api.ModelSpec | None = None, *, batch_size: int = 16,
            parallelism: str = "single", gpus: int = 1, kind: str = "cpu") -> str:
        return profilecache.cache_key(model or _job().spec.model, batch_size=batch_size,
                                 parallelism=parallelism, gpus=gpus, kind=kind)

    keys = {key(), key(_job(shape=[1, 16, 16]).spec.model), key(batch_size=32),
            key(parallelism="ddp"), key(gpus=2), key(kind="cuda:NVIDIA H200")}
    assert len(keys) == 6


def test_a_batch_that_cannot_be_allocated_is_infeasible_and_cached(tmp_path: Path) -> None:
    # A real allocation failure: 65536 x 3 x 16384 x 16384 float32 inputs are ~211 TB, more
    # than any machine's memory and than x86-64's 128 TiB user address space.
    job = _job(shape=[3, 16384, 16384], batch=65536)
    cache = tmp_path / "profiles.json"
    (found,) = profile.profile_job(job, configs=[("single", 1)], cache_path=cache, device="cpu")
    assert found.status == profilecache.STATUS_OOM and not found.feasible
    assert "allocate" in found.detail
    (cached,) = profile.profile_job(job, configs=[("single", 1)], cache_path=cache, device="cpu")
    assert cached.cached and cached.status == profilecache.STATUS_OOM


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        pytest.param(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), True,
                     id="torch-oom"),
        pytest.param(RuntimeError("CUDA error: out of memory"), True, id="cuda-runtime"),
        pytest.param(RuntimeError("DefaultCPUAllocator: can't allocate memory"), True, id="cpu"),
        pytest.param(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False,
                     id="shape-error"),
        pytest.param(ValueError("out of memory"), False, id="not-a-runtime-error"),
    ],
)
def test_out_of_memory_is_recognised_by_type_or_allocator_message(exc: BaseException,
                                                                   expected: bool) -> None:
    assert models.out_of_memory(exc) is expected


def test_a_failure_that_is_not_out_of_memory_is_reported_and_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any, **__: Any) -> float:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(profile, "step_seconds", broken)
    cache = tmp_path / "profiles.json"
    (found,) = profile.profile_job(_job(), configs=[("single", 1)], cache_path=cache,
                                   device="cpu")
    assert found.status == profilecache.STATUS_FAILED and found.feasible
    assert not cache.exists()


def test_configs_that_cannot_run_here_are_unsupported_not_infeasible(tmp_path: Path) -> None:
    found = profile.profile_job(_job(), configs=[("fsdp", 2), ("ddp", 4096), ("single", 2)],
                                cache_path=tmp_path / "p.json", device="cpu")
    assert [m.status for m in found] == [profilecache.STATUS_UNSUPPORTED] * 3
    assert all(m.feasible for m in found)
    assert "fsdp needs GPUs" in found[0].detail and "4096 devices" in found[1].detail


def test_default_configs_grow_k_up_to_the_devices_and_offer_fsdp_on_gpus_only() -> None:
    assert profile.default_configs("cpu", 3) == [("single", 1), ("ddp", 2)]
    assert profile.default_configs("cuda:X", 4) == [("single", 1), ("ddp", 2), ("fsdp", 2),
                                                    ("ddp", 4), ("fsdp", 4)]


def test_a_corrupt_cache_is_refused_with_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "profiles.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(profilecache.ProfileCacheError, match="profiles.json"):
        profilecache.read_cache(bad)
    bad.write_text(json.dumps({"version": 99, "entries": {}}), encoding="utf-8")
    with pytest.raises(profilecache.ProfileCacheError, match="not a version-1"):
        profilecache.read_cache(bad)


JOB = """\
apiVersion: kiln.dev/v1alpha1
kind: TrainingJob
metadata: {name: tiny}
spec:
  model: {architecture: small_cnn, args: {depth: 2, width: 8}, inputShape: [1, 8, 8]}
  training: {epochs: 1, batchSize: 16}
"""


def test_kiln_profile_prints_a_table_and_fills_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB, encoding="utf-8")
    cache = tmp_path / "profiles.json"
    args = ["profile", str(path), "--configs", "single:1", "--cache", str(cache), "--device",
            "cpu"]
    assert cli.main(args) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "Profile of tiny" in out and "single×1" in out and " ok" in out
    assert cli.main(args) == cli.EXIT_OK
    assert "cached ok" in capsys.readouterr().out


def test_kiln_profile_refuses_a_corrupt_cache_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, cache = tmp_path / "job.yaml", tmp_path / "bad.json"
    path.write_text(JOB, encoding="utf-8")
    cache.write_text("{broken", encoding="utf-8")
    assert cli.main(["profile", str(path), "--cache", str(cache)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"profile cache {cache}" in " ".join(err.split()) and "Traceback" not in err


def test_kiln_profile_takes_one_job_at_a_time(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(JOB + "---\n" + JOB.replace("tiny", "other"), encoding="utf-8")
    assert cli.main(["profile", str(path)]) == cli.EXIT_USAGE
    assert "holds 2 jobs" in capsys.readouterr().err


def test_kiln_profile_rejects_a_malformed_config_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["profile", "job.yaml", "--configs", "ring:2"])
    assert exc.value.code == cli.EXIT_USAGE
    assert "expected PARALLELISM:K" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_kiln_profile_device_cuda_without_cuda_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB, encoding="utf-8")
    args = ["profile", str(path), "--device", "cuda", "--cache", str(tmp_path / "p.json")]
    assert cli.main(args) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "--device cuda: CUDA is not available here" in err
    assert not (tmp_path / "p.json").exists()
