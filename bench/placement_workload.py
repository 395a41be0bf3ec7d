"""Model-selection workloads for bench/placement.py: real CPU profiles -> GPU-like durations.

1. Profile. Each architecture (registered in `kiln.models`) trains a few steps on this
   machine (forward + backward + SGD step, batch PROFILE_BATCH, one torch thread, the second
   and later steps timed, fastest: this machine is shared) on a small input: 3x32x32 images,
   128-byte text. That gives its CPU seconds per sample c_cpu and its parameter count P.
   The profiles are recorded once in PROFILES_FILE and replayed (`recorded_profiles`), so the
   workloads do not change with this machine's load; `record_profiles` measures them anew.
2. GPU-like speed. Only ratios of the CPU costs are used: the reference architecture
   (resnet18 at 3x32x32) is pinned at REFERENCE_SAMPLES_PER_SECOND on one GPU, so
   c_gpu(a) = c_cpu(a) / c_cpu(resnet18) / REFERENCE_SAMPLES_PER_SECOND.
3. Speed-up curve (Amdahl with a communication term), per step of global batch B on k GPUs:
       t(k) = o + B c_gpu / k + [k > 1] (2 (k - 1) / k * bytes / bandwidth + 2 (k - 1) latency)
   with o = STEP_OVERHEAD_SECONDS (launches, optimizer, loader: does not shrink with k),
   bytes = 4 P (DDP all-reduce of fp32 gradients; FSDP moves 1.5x as much: all-gather +
   reduce-scatter), bandwidth = ALLREDUCE_BYTES_PER_SECOND, latency = ALLREDUCE_LATENCY_SECONDS.
   A job trains EPOCHS epochs over DATASET_SAMPLES samples: d(k) = EPOCHS ceil(N / B) t(k).
   Equivalently d(k) = d(1) [s + (1 - s) / k] + steps * comm(k), serial fraction
   s = o / t(1). Learning rates do not change durations (Saturn copies profiles across
   learning rates), so lr copies are identical jobs.
4. Trace-shaped arrivals (`trace`): heavy-tailed 1-GPU durations (log-normal or Pareto), kinds
   of jobs that scale well, barely, or need >= 2 GPUs for memory (Amdahl serial fraction per
   kind), most users asking for 1 GPU, a few heavy owners, Poisson or bursty arrivals at a
   target load, OWNERS owners (module constants below; shapes after the Philly and Helios
   cluster traces).
Callers: bench/placement.py. Non-goals: no GPU, no planning.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from kiln import models
from kiln.placement import simulate, types

PROFILE_BATCH = 8
REFERENCE = "resnet18"
REFERENCE_SAMPLES_PER_SECOND = 5000.0  # resnet18 on 32x32 images, one A100-class GPU
STEP_OVERHEAD_SECONDS = 0.003
ALLREDUCE_BYTES_PER_SECOND = 100e9  # ring all-reduce bus bandwidth inside an NVLink node
ALLREDUCE_LATENCY_SECONDS = 10e-6
FSDP_TRAFFIC = 1.5
DATASET_SAMPLES = 50_000
EPOCHS = 50
GPU_COUNTS = (1, 2, 4, 8)
PROFILES_FILE = Path(__file__).resolve().parent / "results" / "placement_profiles.json"
FORMULA = ("t(k) = o + B*c/k + [k>1]*(2(k-1)/k * traffic*4P/bw + 2(k-1)*lat); "
           "d(k) = epochs*ceil(N/B)*t(k); c = c_cpu(arch)/c_cpu(resnet18)/5000 s; "
           f"o={STEP_OVERHEAD_SECONDS * 1e3:g} ms, bw={ALLREDUCE_BYTES_PER_SECOND / 1e9:g} GB/s, "
           f"lat={ALLREDUCE_LATENCY_SECONDS * 1e6:g} us, traffic 1 (ddp) / {FSDP_TRAFFIC} (fsdp), "
           f"N={DATASET_SAMPLES}, epochs={EPOCHS}")


@dataclasses.dataclass(frozen=True)
class Arch:
    """An architecture of the grids: label, registry name, input shape, builder args."""

    label: str
    name: str
    shape: tuple[int, ...]
    args: dict[str, Any]


ARCHS = (
    Arch("resnet18", "resnet18", (3, 32, 32), {}),
    Arch("vit-d6w192", "vit", (3, 32, 32), {"depth": 6, "width": 192, "heads": 6,
                                             "patch_size": 4}),
    Arch("resnet50", "resnet50", (3, 32, 32), {}),
    Arch("char-tf-d4w256", "char_transformer", (128,), {"depth": 4, "width": 256,
                                                        "heads": 8}),
    Arch("mobilenet_v2", "mobilenet_v2", (3, 32, 32), {}),
    Arch("small_resnet", "small_resnet", (3, 32, 32), {"blocks": [2, 2, 2], "width": 32}),
)
BATCHES = (64, 256, 32, 128)
LEARNING_RATES = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-4, 3e-1, 1e-4, 3e-5, 1e-5)


@dataclasses.dataclass(frozen=True)
class Profile:
    """One architecture measured here."""

    cpu_seconds_per_sample: float
    params: int


def profile(arch: Arch, *, steps: int = 5) -> Profile:
    """CPU seconds per training sample (fastest of `steps` timed steps after a warm-up)."""
    torch.manual_seed(0)
    model = models.get_model(arch.name, input_shape=arch.shape, **arch.args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if len(arch.shape) == 1:  # char LM: next-byte targets
        x = torch.randint(0, 256, (PROFILE_BATCH, *arch.shape))
        y = torch.randint(0, 256, (PROFILE_BATCH, *arch.shape))
    else:
        x = torch.randn(PROFILE_BATCH, *arch.shape)
        y = torch.randint(0, 10, (PROFILE_BATCH,))
    times = []
    for _ in range(steps + 1):
        began = time.perf_counter()
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - began)
    return Profile(min(times[1:]) / PROFILE_BATCH,  # min: other processes only slow it down
                   sum(p.numel() for p in model.parameters()))


def record_profiles(archs: tuple[Arch, ...], *, steps: int,
                    path: Path = PROFILES_FILE) -> dict[str, Profile]:
    """Profile `archs` (`profile`) and write them to `path` with the load they ran under."""
    load_before = os.getloadavg()[0]
    profiles = {arch.label: profile(arch, steps=steps) for arch in archs}
    path.write_text(json.dumps({
        "steps": steps, "profile_batch": PROFILE_BATCH,
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "profiles": {k: dataclasses.asdict(v) for k, v in profiles.items()}},
        indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return profiles


def recorded_profiles(archs: tuple[Arch, ...], path: Path = PROFILES_FILE
                      ) -> dict[str, Profile]:
    """The profiles of `archs` recorded in `path` (`record_profiles`).

    Raises:
        ValueError: the file lacks one of `archs` (re-record with `record_profiles`).
    """
    recorded = json.loads(path.read_text(encoding="utf-8"))["profiles"]
    missing = [a.label for a in archs if a.label not in recorded]
    if missing:
        raise ValueError(f"{path}: no recorded profile of {', '.join(missing)}; record them "
                         "again (bench/placement.py --profile)")
    return {a.label: Profile(float(recorded[a.label]["cpu_seconds_per_sample"]),
                             int(recorded[a.label]["params"])) for a in archs}


def step_seconds(gpu_seconds_per_sample: float, params: int, batch: int, k: int, *,
                 traffic: float = 1.0) -> float:
    """t(k) of the module docstring (seconds per global step)."""
    comm = 0.0
    if k > 1:
        comm = (2 * (k - 1) / k * traffic * 4 * params / ALLREDUCE_BYTES_PER_SECOND
                + 2 * (k - 1) * ALLREDUCE_LATENCY_SECONDS)
    return STEP_OVERHEAD_SECONDS + batch * gpu_seconds_per_sample / k + comm


def configs(profiles: dict[str, Profile], arch: Arch, batch: int) -> tuple[types.Config, ...]:
    """single (k=1), ddp and fsdp (k=2,4,8) durations of one job."""
    c_gpu = (profiles[arch.label].cpu_seconds_per_sample
             / profiles[REFERENCE].cpu_seconds_per_sample / REFERENCE_SAMPLES_PER_SECOND)
    steps = EPOCHS * math.ceil(DATASET_SAMPLES / batch)
    params = profiles[arch.label].params
    out = [types.Config("single", 1, steps * step_seconds(c_gpu, params, batch, 1),
                        "bench-model")]
    for k in GPU_COUNTS[1:]:
        for parallelism, traffic in (("ddp", 1.0), ("fsdp", FSDP_TRAFFIC)):
            out.append(types.Config(parallelism, k, steps * step_seconds(
                c_gpu, params, batch, k, traffic=traffic), "bench-model"))
    return tuple(out)


GRIDS = {12: (2, 2, 3), 24: (4, 2, 3), 50: (5, 2, 5), 200: (5, 4, 10)}  # archs, batches, lrs


def grid(profiles: dict[str, Profile], jobs: int) -> list[simulate.SimJob]:
    """A model-selection grid: archs x batch sizes x learning rates (GRIDS[jobs])."""
    n_arch, n_batch, n_lr = GRIDS[jobs]
    out = []
    for arch in ARCHS[:n_arch]:
        for batch in BATCHES[:n_batch]:
            durations = configs(profiles, arch, batch)
            for lr in LEARNING_RATES[:n_lr]:
                out.append(simulate.SimJob(f"{arch.label}-b{batch}-lr{lr:g}", durations))
    return out


def speedups(profiles: dict[str, Profile], arch: Arch, batch: int) -> dict[int, float]:
    """d(1) / d(k) of the fastest parallelism per k (for the output's description)."""
    by_k: dict[int, float] = {}
    for c in configs(profiles, arch, batch):
        by_k[c.gpus] = min(by_k.get(c.gpus, math.inf), c.seconds)
    return {k: round(by_k[1] / by_k[k], 2) for k in sorted(by_k)}


# Trace-shaped workloads ------------------------------------------------------------------

LOGNORMAL_MEDIAN_SECONDS = 1800.0  # 1-GPU duration: median 30 min ...
LOGNORMAL_SIGMA = 1.2  # ... mean ~1 h, p99 ~8 h
PARETO_MIN_SECONDS = 600.0  # Pareto: 10 min minimum, tail index 1.5 ...
PARETO_ALPHA = 1.5
MAX_SECONDS = 24 * 3600.0  # ... both cut at one day (trace jobs are killed there)
# kind: (probability, Amdahl serial fraction, smallest GPU count, P(asks 1), asks otherwise)
KINDS = {"scales-well": (0.3, 0.03, 1, 0.5, (2, 4, 8)),
         "scales-barely": (0.55, 0.6, 1, 0.95, (2,)),
         "memory-bound": (0.15, 0.1, 2, 0.0, (2, 4))}
OWNERS = 40  # Zipf-like: owner i submits in proportion to 1 / sqrt(i + 1): heavy users
OWNER_WEIGHTS = tuple(round((i + 1) ** -0.5, 4) for i in range(OWNERS))  # and a long tail
BURST_MEAN_JOBS = 3  # bursty: a user submits a sweep of ~3 jobs at once
LOAD = 0.9  # offered GPU-seconds (at asked counts) / cluster GPU-seconds


@dataclasses.dataclass(frozen=True)
class TraceShape:
    """One trace-shaped workload: durations "lognormal" | "pareto", arrivals "poisson" |
    "bursty", node sizes, job count."""

    durations: str
    arrivals: str
    node_gpus: tuple[int, ...]
    jobs: int

    @property
    def label(self) -> str:
        cluster = "+".join(str(g) for g in self.node_gpus)
        return f"{self.durations}/{self.arrivals} {cluster} {self.jobs} jobs"


def trace(shape: TraceShape, *, seed: int) -> list[simulate.SimJob]:
    """Jobs of `shape` (true durations; add noise with `simulate.with_noise`).

    A job of kind with serial fraction s and 1-GPU duration d1 takes d1 (s + (1 - s) / k) on
    k GPUs (k = 1, 2, 4, 8, up to the largest node; memory-bound jobs need k >= 2). Arrivals
    are spaced so the asked GPU-seconds are LOAD of the cluster's.
    """
    rng = random.Random(seed)
    largest = max(shape.node_gpus)
    kinds = list(KINDS.items())
    drafts: list[tuple[str, tuple[types.Config, ...], str, int]] = []
    for i in range(shape.jobs):
        kind, (_, serial, smallest, p_one, wider) = rng.choices(
            kinds, weights=[v[0] for _, v in kinds])[0]
        if shape.durations == "lognormal":
            d1 = rng.lognormvariate(math.log(LOGNORMAL_MEDIAN_SECONDS), LOGNORMAL_SIGMA)
        else:
            d1 = PARETO_MIN_SECONDS * rng.paretovariate(PARETO_ALPHA)
        d1 = min(d1, MAX_SECONDS)
        configs = tuple(
            types.Config("single" if k == 1 else "ddp", k, d1 * (serial + (1 - serial) / k),
                         "trace-model")
            for k in GPU_COUNTS if smallest <= k <= largest)
        asked = 1 if rng.random() < p_one else rng.choice([k for k in wider if k <= largest])
        asked = max(asked, smallest)
        owner = f"user-{rng.choices(range(len(OWNER_WEIGHTS)), weights=OWNER_WEIGHTS)[0]}"
        drafts.append((f"{kind}-{i:03d}", configs, owner, asked))
    offered = sum(min(c.seconds for c in configs if c.gpus == asked) * asked
                  for _, configs, _, asked in drafts)
    # mean gap between jobs so that offered work / span = LOAD x capacity
    gap = offered / (LOAD * sum(shape.node_gpus)) / shape.jobs
    arrivals: list[tuple[float, int]] = []  # (time, index of the burst's first job)
    t = 0.0
    while len(arrivals) < shape.jobs:
        if shape.arrivals == "poisson":
            arrivals.append((round(t, 1), len(arrivals)))
            t += rng.expovariate(1.0 / gap)
        else:  # one user's sweep of geometric size; bursts Poisson at the same job rate
            size = 1 + int(rng.expovariate(1.0 / (BURST_MEAN_JOBS - 1)))
            first = len(arrivals)
            arrivals += [(round(t + 5.0 * j, 1), first) for j in range(size)]
            t += rng.expovariate(1.0 / (gap * size))
    return [simulate.SimJob(name, configs, arrival, owner=drafts[first][2], asked_gpus=asked)
            for (name, configs, _, asked), (arrival, first) in zip(
                drafts, arrivals[:shape.jobs], strict=True)]
