"""Profiling runs (`kiln profile`): time one training step of a job's model per config.

Results go to the profile cache (`profilecache`), which `estimate.configs` reads. No estimates
for configs that were not measured, no planning.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln import api, contract, models
from kiln.placement import profilecache

GPU_COUNTS = (1, 2, 4, 8)
# A multi-process profile builds the model once per rank and meets in two all-reduces.
WORKER_TIMEOUT_SECONDS = 300.0
# Mini-batches timed after the first (which pays for allocation and warm-up); their median is
# the step time, so one step slowed by another process on a loaded machine does not count.
# A fixed count, never a time budget: under DDP every rank must take the same steps.
TIMED_STEPS = 3


def device_type(device: str = "auto") -> str:
    """"cpu", or "cuda:<GPU name>" (the first GPU's) when `device` is cuda/auto and CUDA works."""
    if device != "cpu" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    return "cpu"


def available_devices(kind: str) -> int:
    """Devices a config may use here: visible GPUs for cuda types, CPU cores for "cpu"."""
    if kind.startswith("cuda"):
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def default_configs(kind: str, max_devices: int) -> list[tuple[str, int]]:
    """(parallelism, k) pairs worth profiling: single at k = 1; ddp (and fsdp on GPUs) at
    k in {2, 4, 8} up to `max_devices`."""
    pairs = [("single", 1)]
    for k in GPU_COUNTS[1:]:
        if k <= max_devices:
            pairs.append(("ddp", k))
            if kind.startswith("cuda"):
                pairs.append(("fsdp", k))
    return pairs


def profile_job(
    job: api.TrainingJob,
    *,
    configs: Sequence[tuple[str, int]] | None = None,
    cache_path: Path | None = profilecache.DEFAULT_CACHE,
    device: str = "auto",
    refresh: bool = False,
) -> list[profilecache.Measurement]:
    """Profile `job` per config, reusing and updating the cache.

    Saturn's empirical profiler (VLDB'24): each config builds the job's model at the job's
    global batch size on synthetic inputs of the job's shape and dtype (images
    Tensor[B, C, H, W] float32 with int64 class labels; text LongTensor[B, T] with next-token
    targets), runs two mini-batches (forward, backward, optimizer step) and times the *second*
    (the first pays for allocation and lazy initialisation). Memory feasibility is empirical:
    an out-of-memory error (`torch.OutOfMemoryError`, or a RuntimeError saying the allocator
    has no memory) marks the config infeasible.

    `single` (k = 1) runs in this process. `ddp` and `fsdp` (k >= 2) run k processes of this
    module's worker (`python -m kiln.placement.profile --worker SPEC OUT`) under torchrun
    (`kiln.contract.torchrun_command`, as the trainer is launched), gloo on CPU and NCCL on
    GPUs; each rank takes B / k samples and the slowest rank's step counts. FSDP is FSDP1
    (`FullyShardedDataParallel`, whole model as one unit), so it needs GPUs. Device types are
    ``cpu`` or ``cuda:<GPU name>`` (`device_type`).

    Args:
        job: a valid job (its model, input shape and global batch size are used).
        configs: (parallelism, k) pairs; default `default_configs` for the devices here.
        cache_path: the JSON cache (None: no cache).
        device: "auto" (CUDA when present), "cpu" or "cuda".
        refresh: measure again even when cached.

    Returns:
        One measurement per config, in order. Unsupported configs are returned, not cached.

    Raises:
        profilecache.ProfileCacheError: the cache file is unusable.
        ValueError: a config names an unknown parallelism or k < 1.
    """
    kind = device_type(device)
    wanted = list(configs) if configs is not None else \
        default_configs(kind, available_devices(kind))
    for parallelism, k in wanted:
        if parallelism not in ("single", "ddp", "fsdp") or k < 1:
            raise ValueError(f"config {parallelism}:{k}: parallelism must be single, ddp or "
                             "fsdp and k >= 1")
    entries = profilecache.read_cache(cache_path) if cache_path is not None else {}
    batch = job.spec.training.batch_size
    results = []
    for parallelism, k in wanted:
        key = profilecache.cache_key(job.spec.model, batch_size=batch, parallelism=parallelism,
                                     gpus=k, kind=kind)
        cached = None if refresh else profilecache.lookup(entries, key)
        if cached is not None:
            results.append(cached)
            continue
        found = _measure_config(job, parallelism, k, kind)
        results.append(found)
        if found.status in (profilecache.STATUS_OK, profilecache.STATUS_OOM):
            entries[key] = {**dataclasses.asdict(found),
                            "architecture": job.spec.model.label, "device_type": kind,
                            "batch_size": batch, "measured_time": _now()}
            if cache_path is not None:
                profilecache.write_cache(cache_path, entries)
    return results


def _measure_config(job: api.TrainingJob, parallelism: str, k: int,
                    kind: str) -> profilecache.Measurement:
    why = _unsupported(parallelism, k, kind)
    if why:
        return profilecache.Measurement(parallelism, k, None, profilecache.STATUS_UNSUPPORTED, why)
    if parallelism == "single":
        dev = torch.device("cuda", 0) if kind.startswith("cuda") else torch.device("cpu")
        try:
            seconds = step_seconds(job.spec.model, job.spec.training, device=dev)
        except RuntimeError as exc:  # torch.OutOfMemoryError is a RuntimeError too
            return _failure(parallelism, k, exc)
        return profilecache.Measurement(parallelism, k, seconds, profilecache.STATUS_OK)
    return _measure_distributed(job, parallelism, k, kind)


def _unsupported(parallelism: str, k: int, kind: str) -> str:
    if parallelism == "single" and k != 1:
        return "single runs on exactly one device"
    if parallelism != "single" and k < 2:
        return f"{parallelism} needs k >= 2"
    if parallelism == "fsdp" and not kind.startswith("cuda"):
        return "fsdp needs GPUs"
    if k > available_devices(kind):
        return f"needs {k} devices, {available_devices(kind)} here"
    return ""


def _failure(parallelism: str, k: int, exc: BaseException) -> profilecache.Measurement:
    if models.out_of_memory(exc):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return profilecache.Measurement(parallelism, k, None, profilecache.STATUS_OOM,
                                        _first_line(exc))
    return profilecache.Measurement(parallelism, k, None, profilecache.STATUS_FAILED,
                                    _first_line(exc))


def step_seconds(model_spec: api.ModelSpec, training: api.TrainingSpec, *,
                 device: torch.device, batch_size: int | None = None,
                 wrap: Callable[[nn.Module], nn.Module] | None = None) -> float:
    """Wall seconds of a training mini-batch on synthetic data: the median of `TIMED_STEPS`
    after a first, untimed one.

    Args:
        model_spec: the job's model (built freshly, seeded).
        training: its optimizer settings and global batch size.
        device: where to run.
        batch_size: samples in this process's mini-batch (default the global batch size).
        wrap: wraps the model after it is moved to `device` (DDP/FSDP workers).

    Returns:
        Seconds of forward, backward and optimizer step of one mini-batch.

    Raises:
        RuntimeError: out of memory (see `models.out_of_memory`) or another failure.
    """
    torch.manual_seed(0)
    raw = models.build(model_spec).to(device)
    model = wrap(raw) if wrap is not None else raw
    model.train()
    optimizer = _optimizer(model, training.optimizer)
    batch = batch_size or training.batch_size
    text = models.modality_of(model_spec) == models.Modality.TEXT
    vocab = int(model_spec.args.get("vocab_size", 256))
    seconds: list[float] = []
    for _ in range(1 + TIMED_STEPS):
        inputs, targets = _synthetic(model_spec, batch, text=text, vocab=vocab, device=device)
        _synchronize(device)
        started = time.perf_counter()
        logits = model(inputs)
        if targets is None:  # classes known only from the logits: Tensor[B, K]
            targets = torch.randint(0, logits.shape[-1], (batch,), device=device)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        _synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def _synthetic(model_spec: api.ModelSpec, batch: int, *, text: bool, vocab: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = (batch, *model_spec.input_shape)
    if text:
        tokens = torch.randint(0, vocab, shape, device=device)
        return tokens, torch.randint(0, vocab, shape, device=device)
    return torch.randn(shape, device=device), None


def _optimizer(model: nn.Module, spec: api.OptimizerSpec) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.name == api.OptimizerName.SGD:
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay, nesterov=spec.nesterov)
    if spec.name == api.OptimizerName.ADAM:
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# k processes under torchrun


def _measure_distributed(job: api.TrainingJob, parallelism: str, k: int,
                         kind: str) -> profilecache.Measurement:
    with tempfile.TemporaryDirectory(prefix="kiln-profile-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps({"job": api.to_wire(job), "parallelism": parallelism,
                                         "device": "cuda" if kind.startswith("cuda") else "cpu"}),
                             encoding="utf-8")
        command = contract.torchrun_command(k, "kiln.placement.profile",
                                            ["--worker", str(spec_path), tmp])
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=WORKER_TIMEOUT_SECONDS, check=False,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            return profilecache.Measurement(
                parallelism, k, None, profilecache.STATUS_FAILED,
                f"workers did not finish in {WORKER_TIMEOUT_SECONDS:.0f} s")
        outs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(Path(tmp).glob("rank-*"))]
    if any(o["status"] == profilecache.STATUS_OOM for o in outs):
        return profilecache.Measurement(
            parallelism, k, None, profilecache.STATUS_OOM,
            next(o["detail"] for o in outs if o["status"] == profilecache.STATUS_OOM))
    if len(outs) != k or any(o["status"] != profilecache.STATUS_OK for o in outs):
        failed = [o["detail"] for o in outs if o["status"] != profilecache.STATUS_OK]
        lines = [line.strip() for line in (done.stderr or "").splitlines() if line.strip()]
        why = failed[0] if failed else next((line for line in reversed(lines)
                                             if "Error" in line), lines[-1] if lines else "")
        return profilecache.Measurement(parallelism, k, None, profilecache.STATUS_FAILED,
                                        f"torchrun exited with {done.returncode}: {why[:300]}")
    return profilecache.Measurement(parallelism, k, max(o["step_seconds"] for o in outs),
                                    profilecache.STATUS_OK)


def _worker(spec_path: Path, out_dir: Path) -> int:
    """One rank of a ddp/fsdp profile (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE)."""
    import torch.distributed as dist

    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    job = api.parse_job(spec["job"])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    result: dict[str, Any]
    try:
        seconds = step_seconds(job.spec.model, job.spec.training, device=device,
                               batch_size=max(1, job.spec.training.batch_size // world),
                               wrap=_wrapper(spec["parallelism"], device))
        result = {"status": profilecache.STATUS_OK, "step_seconds": seconds, "detail": ""}
    except RuntimeError as exc:
        status = profilecache.STATUS_OOM if models.out_of_memory(exc) else profilecache.STATUS_FAILED
        result = {"status": status, "step_seconds": None, "detail": _first_line(exc)}
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    dist.destroy_process_group()
    return 0


def _wrapper(parallelism: str, device: torch.device) -> Callable[[nn.Module], nn.Module]:
    def wrap(model: nn.Module) -> nn.Module:
        if parallelism == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(model, device_id=device)
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda"
                                       else None)
    return wrap


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


if __name__ == "__main__":  # one rank of a multi-process profile
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(_worker(Path(sys.argv[2]), Path(sys.argv[3])))
    sys.exit("usage: python -m kiln.placement.profile --worker SPEC_JSON OUT_DIR")
