"""`kiln.placement.estimate`: the sources in order (zoo, profile, FLOPs), the speed-up curve,
dominated configs dropped, resources respected, `refine` and `remaining_seconds`. Models are
built on the meta device only: no GPU, no training."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api
from kiln.placement import estimate, profilecache, types
from kiln.zoo import records, store


def _job(name: str = "job", *, architecture: str = "small_cnn", args: dict[str, Any] | None = None,
         shape: list[int] | None = None, batch: int = 64, epochs: int = 2,
         **spec: Any) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {"model": {"architecture": architecture, "args": args or {},
                           "inputShape": shape or [1, 8, 8]},
                 "training": {"epochs": epochs, "batchSize": batch}, **spec},
    })


def _record(architecture: str, *, samples_per_second: float, num_params: int,
            args: dict[str, Any] | None = None, shape: tuple[int, ...] = (1, 8, 8),
            batch: int = 64, created: str = "2024-01-01T00:00:00Z",
            task: str = "classification") -> records.ZooRecord:
    return records.ZooRecord(
        id=records.new_id(architecture), architecture=architecture, args=args or {},
        input_shape=shape, modality="image", task=task, dataset="digits",
        metric_name="validation_accuracy", metric_value=0.9, samples_per_second=samples_per_second,
        num_params=num_params, created_time=created, job_name="old",
        job_spec={"spec": {"training": {"batchSize": batch}}})


def _cache(path: Path, job: api.TrainingJob, steps: dict[tuple[str, int], float | None],
           kind: str = "cpu") -> Path:
    """A profile cache holding `steps` (None = out of memory) for `job`."""
    entries = {}
    for (parallelism, k), step in steps.items():
        key = profilecache.cache_key(job.spec.model, batch_size=job.spec.training.batch_size,
                                parallelism=parallelism, gpus=k, kind=kind)
        entries[key] = {"parallelism": parallelism, "gpus": k, "step_seconds": step,
                        "status": "ok" if step is not None else "oom", "detail": ""}
    path.write_text(json.dumps({"version": 1, "entries": entries}), encoding="utf-8")
    return path


CPU = estimate.DEVICE_MODELS["cpu"]


def test_without_zoo_or_profile_every_config_comes_from_the_flops_model() -> None:
    job = _job()
    found = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=8, device_type="cpu")
    assert found and {c.source for c in found} == {"flops"}
    assert found[0] == dataclasses.replace(found[0], parallelism="single", gpus=1)
    flops, _ = estimate.model_cost(job.spec.model)
    step = estimate.FORWARD_BACKWARD_FACTOR * flops * 64 / CPU.flops_per_second + \
        CPU.step_overhead_seconds
    assert found[0].seconds == pytest.approx(estimate.job_seconds(estimate.workload(job), step,
                                                                  CPU))


def test_configs_keep_increasing_k_with_strictly_decreasing_seconds() -> None:
    found = estimate.configs(_job(architecture="resnet18", shape=[3, 32, 32], batch=256),
                             zoo=None, profile_cache=None, max_gpus=8, device_type="cuda:X")
    assert [c.gpus for c in found] == sorted({c.gpus for c in found})
    assert all(a.seconds > b.seconds for a, b in itertools.pairwise(found))
    assert len(found) > 1  # a big model gains from more GPUs


def test_a_profiled_config_replaces_the_flops_estimate_for_that_config(tmp_path: Path) -> None:
    job = _job()
    cache = _cache(tmp_path / "p.json", job, {("single", 1): 0.5})
    found = estimate.configs(job, zoo=None, profile_cache=cache, max_gpus=1, device_type="cpu")
    work = estimate.workload(job)
    assert found == (types.Config("single", 1, estimate.job_seconds(work, 0.5, CPU), "profile"),)


def test_a_zoo_record_of_the_same_architecture_wins_over_the_profile(tmp_path: Path) -> None:
    job = _job()
    _, params = estimate.model_cost(job.spec.model)
    cache = _cache(tmp_path / "p.json", job, {("single", 1): 0.5})
    rec = _record("small_cnn", samples_per_second=640.0, num_params=params)
    found = estimate.configs(job, zoo=None, zoo_records=[rec], profile_cache=cache, max_gpus=1,
                             device_type="cpu")
    assert [c.source for c in found] == ["zoo"]
    assert found[0].seconds == pytest.approx(
        estimate.job_seconds(estimate.workload(job), 64 / 640.0, CPU))


def test_the_zoo_source_reads_records_from_a_store(tmp_path: Path) -> None:
    job = _job()
    zoo = store.DirStore(tmp_path / "zoo")
    _, params = estimate.model_cost(job.spec.model)
    records.write_record(zoo, _record("small_cnn", samples_per_second=640.0, num_params=params),
                         {"w": torch.zeros(1)}, {})
    found = estimate.configs(job, zoo=zoo, profile_cache=None, max_gpus=1, device_type="cpu")
    assert [c.source for c in found] == ["zoo"]


def test_zoo_throughput_is_scaled_by_the_flops_ratio() -> None:
    small, big = _job(args={"width": 8}), _job(args={"width": 32})
    rec = _record("small_cnn", args={"width": 8}, samples_per_second=640.0,
                  num_params=estimate.model_cost(small.spec.model)[1])
    seconds = [estimate.configs(j, zoo=None, zoo_records=[rec], profile_cache=None,
                                max_gpus=1, device_type="cpu")[0].seconds for j in (small, big)]
    ratio = estimate.model_cost(big.spec.model)[0] / estimate.model_cost(small.spec.model)[0]
    work = estimate.workload(small)
    compute = [estimate.step_of(work, s, CPU) - CPU.step_overhead_seconds for s in seconds]
    assert compute[1] / compute[0] == pytest.approx(ratio, rel=1e-6)


def test_the_zoo_prefers_the_same_architecture_over_the_same_family() -> None:
    job = _job(architecture="resnet18", shape=[3, 32, 32])
    _, params = estimate.model_cost(job.spec.model)
    same = _record("resnet18", shape=(3, 32, 32), samples_per_second=100.0, num_params=params)
    family = _record("resnet34", shape=(3, 32, 32), samples_per_second=1.0, num_params=params)
    found = {estimate.configs(job, zoo=None, zoo_records=records_, profile_cache=None,
                              max_gpus=1, device_type="cpu")[0].seconds
             for records_ in ([same, family], [family, same])}
    assert len(found) == 1
    only_same = estimate.configs(job, zoo=None, zoo_records=[same], profile_cache=None,
                                 max_gpus=1, device_type="cpu")[0].seconds
    assert found == {only_same}


def test_records_of_another_family_or_task_or_without_throughput_are_not_used() -> None:
    job = _job()
    unrelated = [_record("resnet18", samples_per_second=1.0, num_params=10),
                 _record("small_cnn", samples_per_second=1.0, num_params=10,
                         task="language_modeling"),
                 dataclasses.replace(_record("small_cnn", samples_per_second=1.0, num_params=10),
                                     samples_per_second=None)]
    found = estimate.configs(job, zoo=None, zoo_records=unrelated, profile_cache=None,
                             max_gpus=1, device_type="cpu")
    assert [c.source for c in found] == ["flops"]


def test_a_profiled_out_of_memory_makes_the_config_infeasible_whatever_the_source(
    tmp_path: Path,
) -> None:
    job = _job()
    cache = _cache(tmp_path / "p.json", job, {("single", 1): None})
    rec = _record("small_cnn", samples_per_second=640.0, num_params=1000)
    for zoo_records in ([], [rec]):
        found = estimate.configs(job, zoo=None, zoo_records=zoo_records, profile_cache=cache,
                                 max_gpus=2, device_type="cpu")
        assert [(c.parallelism, c.gpus) for c in found] == [("ddp", 2)]


def test_a_larger_k_that_is_no_faster_is_dropped(tmp_path: Path) -> None:
    job = _job()
    # 0.05 + 0.35 / k + 0.05 (k - 1): the added devices' latency outgrows the compute saved
    cache = _cache(tmp_path / "p.json", job,
                   {("single", 1): 0.4, ("ddp", 2): 0.275, ("ddp", 4): 0.2875,
                    ("ddp", 8): 0.44375})
    found = estimate.configs(job, zoo=None, profile_cache=cache, max_gpus=8, device_type="cpu")
    assert [(c.parallelism, c.gpus) for c in found] == [("single", 1), ("ddp", 2)]


def test_only_the_fastest_parallelism_per_k_is_kept(tmp_path: Path) -> None:
    job = _job(architecture="resnet18", shape=[3, 32, 32], batch=256)
    flops_only = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=2,
                                  device_type="cuda:X")
    assert [c.parallelism for c in flops_only] == ["single", "ddp"]  # fsdp moves 1.5x bytes
    cache = _cache(tmp_path / "p.json", job, {("ddp", 2): 0.02, ("fsdp", 2): 0.01},
                   kind="cuda:X")
    profiled = estimate.configs(job, zoo=None, profile_cache=cache, max_gpus=2,
                                device_type="cuda:X")
    assert [(c.parallelism, c.source) for c in profiled if c.gpus == 2] == [("fsdp", "profile")]


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        pytest.param({"gpus": 2}, [("ddp", 2)], id="fixed-gpus"),
        pytest.param({"gpus": 0}, [("single", 1)], id="cpu-only"),
        pytest.param({"gpusPerNode": 2}, [("single", 1), ("ddp", 2)], id="per-node-cap"),
        pytest.param({"parallelism": "fsdp"}, [("fsdp", 2), ("fsdp", 4)], id="fixed-fsdp"),
    ],
)
def test_spec_resources_narrow_the_configs(resources: dict[str, Any],
                                           expected: list[tuple[str, int]]) -> None:
    job = _job(architecture="resnet18", shape=[3, 32, 32], batch=256, resources=resources)
    found = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=4, device_type="cuda:X")
    assert [(c.parallelism, c.gpus) for c in found] == expected


def test_k_must_divide_the_global_batch() -> None:
    job = _job(architecture="resnet18", shape=[3, 32, 32], batch=250)
    found = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=8, device_type="cuda:X")
    assert [c.gpus for c in found] == [1, 2]


def test_cpu_runs_offer_no_fsdp_and_respect_the_allowed_parallelisms() -> None:
    job = _job(architecture="resnet18", shape=[3, 32, 32], batch=256)
    cpu = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=4, device_type="cpu")
    assert "fsdp" not in {c.parallelism for c in cpu}
    single = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=4, device_type="cpu",
                              parallelisms=("single",))
    assert [(c.parallelism, c.gpus) for c in single] == [("single", 1)]


def test_the_flops_model_rejects_configs_whose_state_exceeds_device_memory() -> None:
    job = _job(architecture="resnet18", shape=[3, 32, 32], batch=256,
               training={"optimizer": {"name": "adam"}})
    _, params = estimate.model_cost(job.spec.model)
    tiny = dataclasses.replace(estimate.DEVICE_MODELS["cuda"],
                               memory_bytes=params * 16 / 3)  # Adam: 16 bytes per parameter
    found = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=4, device_type="cuda:X",
                             device=tiny)
    assert [(c.parallelism, c.gpus) for c in found] == [("fsdp", 4)]


def test_refine_rescales_every_config_by_the_measured_throughput() -> None:
    job = _job()
    work = estimate.workload(job)
    configs = (types.Config("single", 1, estimate.job_seconds(work, 0.2, CPU), "flops"),
               types.Config("ddp", 2, estimate.job_seconds(work, 0.1, CPU), "flops"),
               types.Config("ddp", 4, math.inf, "profile"))
    refined = estimate.refine(configs, work=work, running=configs[1],
                              measured_samples_per_second=64 / 0.05, device=CPU)
    assert [c.source for c in refined] == ["measured", "measured", "profile"]
    assert estimate.step_of(work, refined[1].seconds, CPU) == pytest.approx(0.05)
    assert estimate.step_of(work, refined[0].seconds, CPU) == pytest.approx(0.1)
    assert math.isinf(refined[2].seconds)
    with pytest.raises(ValueError, match="measured_samples_per_second"):
        estimate.refine(configs, work=work, running=configs[0], measured_samples_per_second=0,
                        device=CPU)


def test_remaining_seconds_counts_the_samples_left_at_the_measured_rate() -> None:
    work = estimate.Workload(train_samples=1000, validation_samples=0, epochs=2, batch_size=100)
    assert estimate.remaining_seconds(work, samples_done=500, measured_samples_per_second=100.0) \
        == pytest.approx(15.0)
    assert estimate.remaining_seconds(work, samples_done=5000,
                                      measured_samples_per_second=100.0) == 0.0


def test_the_workload_sizes_digits_text_and_image_folders(tmp_path: Path) -> None:
    assert estimate.workload(_job(dataset={"maxSamples": 300})) == \
        estimate.Workload(240, 60, 2, 64)
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"x" * 65 * 100)
    lm = _job(architecture="char_transformer", shape=[64],
              dataset={"name": "text", "path": str(text)})
    assert estimate.workload(lm).train_samples + estimate.workload(lm).validation_samples == 100
    for i in range(10):
        (tmp_path / "images" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "images" / f"c{i % 2}" / f"{i}.png").write_bytes(b"")
    folder = _job(dataset={"name": "imagefolder", "path": str(tmp_path / "images")})
    assert estimate.workload(folder).train_samples == 8
    missing = _job(dataset={"name": "imagefolder", "path": str(tmp_path / "nowhere")})
    assert estimate.workload(missing).train_samples + estimate.workload(missing) \
        .validation_samples == estimate.UNKNOWN_SAMPLES


def test_the_workload_counts_each_real_file_once_through_links_and_loops(tmp_path: Path) -> None:
    for i in range(10):
        (tmp_path / "images" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "images" / f"c{i % 2}" / f"{i}.png").write_bytes(b"")
    (tmp_path / "images" / "c0" / "loop").symlink_to(tmp_path / "images")
    (tmp_path / "images" / "c1" / "again.png").symlink_to(tmp_path / "images" / "c1" / "1.png")
    folder = _job(dataset={"name": "imagefolder", "path": str(tmp_path / "images")})
    assert estimate.workload(folder).train_samples == 8
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_bytes(b"x" * 65 * 100)
    (tmp_path / "text" / "b.txt").symlink_to(tmp_path / "text" / "a.txt")
    (tmp_path / "text" / "up").symlink_to(tmp_path / "text")
    lm = _job(architecture="char_transformer", shape=[64],
              dataset={"name": "text", "path": str(tmp_path / "text")})
    assert estimate.workload(lm).train_samples + estimate.workload(lm).validation_samples == 100


def test_max_gpus_below_one_and_unknown_device_types_are_refused() -> None:
    with pytest.raises(ValueError, match="max_gpus"):
        estimate.configs(_job(), zoo=None, profile_cache=None, max_gpus=0, device_type="cpu")
    with pytest.raises(ValueError, match="device type 'tpu'"):
        estimate.configs(_job(), zoo=None, profile_cache=None, max_gpus=1, device_type="tpu")


def _entrypoint_job(entrypoint: str = "mynets.mixer:mixer", *, batch: int = 64) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "own"},
        "spec": {"model": {"entrypoint": entrypoint, "args": {"dim": 32},
                           "inputShape": [1, 8, 8]},
                 "training": {"epochs": 2, "batchSize": batch}},
    })


def test_an_entrypoint_model_is_costed_without_importing_it_then_from_its_measured_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("placement imported user code")

    monkeypatch.setattr("importlib.import_module", refuse)
    job = _entrypoint_job("not_importable_here:build")
    assert estimate.model_cost(job.spec.model) == (2.0 * estimate.UNKNOWN_MODEL_PARAMETERS,
                                                   estimate.UNKNOWN_MODEL_PARAMETERS)
    cold = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=1, device_type="cpu")
    assert {c.source for c in cold} == {"flops"}

    measured = dataclasses.replace(
        _record("small_cnn", samples_per_second=640.0, num_params=10_000),
        architecture=None, entrypoint="not_importable_here:build", args={"dim": 32})
    other = dataclasses.replace(measured, entrypoint="someone.else:build",
                                samples_per_second=1.0)
    warm = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=1, device_type="cpu",
                            zoo_records=[other, measured])
    assert [c.source for c in warm] == ["zoo"]
    # 64 samples at 640 per second: 0.1 s a step, whatever the overhead share.
    step = estimate.step_of(estimate.workload(job), warm[0].seconds, CPU)
    assert step == pytest.approx(0.1, rel=1e-6)


def test_profiled_configs_are_chosen_by_the_curve_fitted_through_all_of_them(
        tmp_path: Path) -> None:
    # One timed step per config: 0.1 + 1 / k s, plus DDP's and FSDP's traffic and a latency
    # per added device, each a few percent off, ddp at 8 drawn 20% low (faster than at 4).
    traffic = {"ddp": 0.04, "fsdp": 0.16}
    noise = {("single", 1): 1.03, ("ddp", 2): 0.97, ("fsdp", 2): 1.02, ("ddp", 4): 1.04,
             ("fsdp", 4): 0.98, ("ddp", 8): 0.80, ("fsdp", 8): 1.03}

    def step(parallelism: str, k: int) -> float:
        comm = traffic[parallelism] * (k - 1) / k + 0.06 * (k - 1) if k > 1 else 0.0
        return 0.1 + 1.0 / k + comm

    job = _job(architecture="resnet18", shape=[3, 32, 32], batch=256)
    cache = _cache(tmp_path / "p.json", job,
                   {(p, k): step(p, k) * f for (p, k), f in noise.items()}, kind="cuda:X")
    found = estimate.configs(job, zoo=None, profile_cache=cache, max_gpus=8,
                             device_type="cuda:X")
    assert [(c.parallelism, c.gpus, c.source) for c in found] == [
        ("single", 1, "profile"), ("ddp", 2, "profile"), ("ddp", 4, "profile")]
    assert min(noise, key=lambda s: step(*s) * noise[s]) == ("ddp", 8)  # the raw pick
    assert min(noise, key=lambda s: step(*s)) == ("ddp", 4)  # the true one
