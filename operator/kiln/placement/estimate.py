"""Runtime estimates: how long a job's whole training takes in each config (parallelism, k).

Sources, first that has it: the profiling step's measurement, the zoo's recorded throughput,
the `kiln profile` cache, FLOPs.
`refine` rescales them by a running job's measured throughput. Never needs a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils import flop_counter

from kiln import api, models
from kiln.models import tracing
from kiln.placement import profilecache, speedup, types
from kiln.zoo import records, store

GPU_COUNTS = (1, 2, 4, 8)
FORWARD_BACKWARD_FACTOR = 3.0  # backward ~ 2x forward FLOPs (Kaplan et al. 2020)
EVAL_COST_FRACTION = 1.0 / 3.0  # a validation batch is a forward pass only
FSDP_COMMUNICATION_FACTOR = 1.5  # all-gather (fwd + bwd) + reduce-scatter vs one all-reduce
# A job spanning nodes steps this much slower than on one node with as many devices: its
# gradients cross the network (tens of GB/s) rather than NVLink or PCIe. One factor, not a
# network model: it only has to make the planner prefer one node when one has room.
CROSS_NODE_SLOWDOWN = 1.25
BYTES_PER_VALUE = 4  # fp32 weights, gradients and optimizer state
DIGITS_SAMPLES = 1797
TORCHVISION_TRAIN_SAMPLES = {"MNIST": 60000, "FashionMNIST": 60000, "KMNIST": 60000,
                             "QMNIST": 60000, "USPS": 7291, "CIFAR10": 50000, "CIFAR100": 50000,
                             "SVHN": 73257, "STL10": 5000}
UNKNOWN_SAMPLES = 50_000
# An entrypoint model is user code the operator never imports, so it cannot be counted here: the
# profiling step measures it in its own image (`ModelMeasurement`). Without that measurement nor
# a measured zoo run of the same entrypoint, it is costed as a model of this many parameters
# doing 2 FLOPs per parameter per sample (a dense forward pass).
UNKNOWN_MODEL_PARAMETERS = 5_000_000
_IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff",
                             ".ppm", ".pgm"})


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """Speed constants of one device (a GPU, or one CPU worker slot) for the flops model.

    Attributes:
        flops_per_second: FLOP/s achieved in training (well below peak).
        bandwidth_bytes_per_second: all-reduce bandwidth between the devices of one node.
        step_overhead_seconds: fixed cost per optimizer step (Python, launches, data loading).
        startup_seconds: process start, dataset load and model build, once per job.
        memory_bytes: memory per device for weights, gradients and optimizer state.
    """

    flops_per_second: float
    bandwidth_bytes_per_second: float
    step_overhead_seconds: float
    startup_seconds: float
    memory_bytes: float


DEVICE_MODELS = {
    # One CPU slot: one or two cores of fp32 at 10-30% of peak; gloo over loopback.
    "cpu": DeviceModel(flops_per_second=1.5e10, bandwidth_bytes_per_second=2e9,
                       step_overhead_seconds=0.002, startup_seconds=8.0, memory_bytes=8 * 2**30),
    # A data-centre GPU at ~30% of fp32/TF32 peak; PCIe/NVLink all-reduce.
    "cuda": DeviceModel(flops_per_second=1.5e13, bandwidth_bytes_per_second=5e10,
                        step_overhead_seconds=0.004, startup_seconds=20.0,
                        memory_bytes=40 * 2**30),
}
"""Per device type ("cpu"; "cuda" for every "cuda:<name>"); pass `device=` to override."""

# Training speed of GPU products relative to the "cuda" model (an A100 on TF32), matched by
# the first name fragment found in "cuda:<product>"; from the vendors' dense TF32 (FP32 where
# there is none) peaks. A product matching none trains at the "cuda" speed.
GPU_SPEEDS = (("H200", 3.2), ("H100", 3.2), ("B200", 7.0), ("A100", 1.0), ("L40", 1.2),
              ("A10", 0.4), ("L4", 0.4), ("V100", 0.3), ("T4", 0.12))


def gpu_device_type(product: str) -> str:
    """The device type of a GPU product, as a node label (`nvidia.com/gpu.product`:
    "NVIDIA-H100-80GB-HBM3") or as torch names it ("NVIDIA H100 80GB HBM3"): "cuda:<label>"."""
    return "cuda:" + product.strip().replace(" ", "-")


def device_model(device_type: str) -> DeviceModel:
    """The `DEVICE_MODELS` entry of "cpu" or a "cuda..." device type; a known GPU product
    ("cuda:<product>") has its FLOP/s scaled by `GPU_SPEEDS` and the memory its name says.

    Raises:
        ValueError: another device type.
    """
    kind = "cuda" if device_type.startswith("cuda") else device_type
    if kind not in DEVICE_MODELS:
        raise ValueError(f"device type {device_type!r}: expected cpu or cuda[:<name>]")
    base = DEVICE_MODELS[kind]
    product = device_type.partition(":")[2].upper()
    if kind != "cuda" or not product:
        return base
    speed = next((s for name, s in GPU_SPEEDS if name in product), 1.0)
    memory = re.search(r"(\d+)\s*GB", product.replace("-", " "))
    return dataclasses.replace(
        base, flops_per_second=base.flops_per_second * speed,
        memory_bytes=int(memory.group(1)) * 2**30 if memory else base.memory_bytes)


@dataclasses.dataclass(frozen=True)
class ModelMeasurement:
    """A model as the profiling step measured it in its own image (`kiln.contract.Profile`).

    Attributes:
        parameters: parameter count.
        flops_per_sample: forward FLOPs of one sample, or None (not countable).
        device_type: "cpu" or "cuda:<name>": where `step_seconds` was timed.
        batch_size: the global batch the step was timed at.
        step_seconds: one optimizer step at `batch_size` on one device, or None (not timed).
        out_of_memory: the whole batch did not fit one device (the single config is infeasible;
            data-parallel configs take B / k per device and may fit).
    """

    parameters: int
    flops_per_sample: float | None
    device_type: str
    batch_size: int
    step_seconds: float | None
    out_of_memory: bool = False

    def step_on(self, device_type: str, batch_size: int) -> float | None:
        """The measured k = 1 step at `batch_size` when it was timed on this device kind
        ("cpu", or any "cuda"), scaled linearly from the measured batch and, when both name
        a GPU product ("cuda:<product>") and they differ, by the products' relative speeds
        (`device_model`); else None."""
        kind = "cuda" if device_type.startswith("cuda") else "cpu"
        measured_kind = "cuda" if self.device_type.startswith("cuda") else "cpu"
        if self.step_seconds is None or kind != measured_kind or self.batch_size <= 0:
            return None
        speed = 1.0
        if ":" in device_type and ":" in self.device_type:  # bare "cuda": a product unknown
            speed = (device_model(self.device_type).flops_per_second
                     / device_model(device_type).flops_per_second)
        return self.step_seconds * batch_size / self.batch_size * speed

    def measured_on(self, device_type: str) -> bool:
        """Whether the step was timed on exactly this device type (no scaling between GPU
        products needed)."""
        return self.step_seconds is not None and gpu_device_type(
            self.device_type) == gpu_device_type(device_type)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a job trains on: samples per epoch (after maxSamples and the split), epochs, B."""

    train_samples: int
    validation_samples: int
    epochs: int
    batch_size: int

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.train_samples / self.batch_size))

    @property
    def eval_batches(self) -> int:
        return math.ceil(self.validation_samples / self.batch_size)

    @property
    def total_train_samples(self) -> int:
        return self.train_samples * self.epochs


def workload(job: api.TrainingJob) -> Workload:
    """The job's `Workload`, sizing its dataset as `configs` says (reads file sizes)."""
    ds, training = job.spec.dataset, job.spec.training
    n = min(_dataset_samples(ds, job.spec.model.input_shape), ds.max_samples or math.inf)
    n = max(2, int(n))
    validation = min(n - 1, max(1, round(n * ds.validation_fraction)))
    return Workload(n - validation, validation, training.epochs, training.batch_size)


def job_seconds(work: Workload, step_seconds: float, device: DeviceModel) -> float:
    """Whole-job wall seconds from one step's seconds (the formula in `configs`)."""
    steps = work.epochs * (work.steps_per_epoch + work.eval_batches * EVAL_COST_FRACTION)
    return device.startup_seconds + steps * step_seconds


def step_of(work: Workload, seconds: float, device: DeviceModel) -> float:
    """The inverse of `job_seconds`: one step's seconds (>= a microsecond)."""
    steps = work.epochs * (work.steps_per_epoch + work.eval_batches * EVAL_COST_FRACTION)
    return max((seconds - device.startup_seconds) / steps, 1e-6)


def configs(
    job: api.TrainingJob,
    *,
    zoo: store.ObjectStore | None,
    profile_cache: Path | None,
    max_gpus: int,
    device_type: str,
    zoo_records: Sequence[records.ZooRecord] | None = None,
    parallelisms: Sequence[str] = types.PARALLELISMS,
    device: DeviceModel | None = None,
    measured: ModelMeasurement | None = None,
) -> tuple[types.Config, ...]:
    """Candidate configs of `job` with whole-job seconds and their source.

    Every estimate is the wall seconds of the whole job::

        seconds = startup + epochs * (steps_per_epoch + eval_batches / 3) * step

    where `step` is the seconds of one optimizer step at the job's global batch size B on k
    devices, and a validation batch costs a forward pass, about a third of a training step.
    `step` comes from the first source that has it, recorded in `types.Config.source`:

    0. "profile": the profiling step's measurement of an entrypoint model (`measured`), timed
       on this device kind at k = 1 in the job's own image.
    1. "zoo": throughput recorded by earlier runs of similar architectures
       (`ZooRecord.samples_per_second`, training steps only). Similar = the same
       architecture, else the same family (`models.get_info(...).family`); among those, the
       same input shape, then the nearest parameter count, then the newest. Its per-sample
       time is scaled by the ratio of forward FLOPs per sample (parameter counts when FLOPs
       cannot be counted) and its batch to B. Records say neither the device nor k, so they
       are read as k = 1 on this device type.
    2. "profile": the `kiln profile` cache (`profilecache.cache_key`): a measured step per
       config.
    3. "flops": forward FLOPs per sample (`torch.utils.flop_counter` on the `meta` device, no
       memory, no GPU) x 3 for forward + backward, x B, over the device's FLOP/s
       (`DeviceModel`).

    k > 1 follows a speed-up curve from the k = 1 step: the per-step overhead stays serial,
    the compute divides by k, and a communication term is added: DDP all-reduces gradients,
    2 * params * (k - 1) / k * 4 bytes per step over the device's bandwidth (ring all-reduce);
    FSDP moves about 1.5x that (all-gather forward and backward, reduce-scatter). A measured
    profile replaces the curve for the configs it measured, through the curve fitted to all of
    them (`speedup.fit`: each step is timed once, so one config's luck does not pick it); a
    profiled out-of-memory marks the config infeasible whatever the source. The flops source also rejects configs whose
    weights, gradients and optimizer state (FSDP: a 1/k shard) exceed the device memory. Only
    the fastest parallelism per k is kept and dominated k dropped (`types.candidates`).

    Dataset sizes come from `workload`: digits 1,797, torchvision classes by their known
    training-split sizes, image folders and text by their files; `UNKNOWN_SAMPLES` otherwise
    (an s3:// path, a missing folder).

    Args:
        job: a valid job. spec.resources narrows the choice: a fixed parallelism, a fixed
            gpus (0 = CPU only: k = 1, single), gpusPerNode as a cap on k. k must divide
            spec.training.batchSize (each of the k processes takes B / k samples). A fixed
            gpus on GPUs gets multi-node configs with spec.resources.nodes, or when above
            the cap (every even split within it), CROSS_NODE_SLOWDOWN slower than one node.
        zoo: where to look for similar records (None: no zoo source).
        profile_cache: the `kiln profile` cache file (None or missing: no profile source).
        max_gpus: most devices one config may take (a node's GPUs, or local CPU slots), >= 1.
        device_type: "cpu" or "cuda[:<name>]" (profiles are looked up under it).
        zoo_records: the zoo's records, already listed (saves a listing per job).
        parallelisms: parallelisms that can run here (e.g. ("single",) without torchrun).
        device: speed constants (default `device_model(device_type)`).
        measured: the profiling step's measurement (entrypoint models): its FLOPs and
            parameter count replace the nominal ones, and its step time, when timed on this
            device kind, is the k = 1 step.

    Returns:
        `types.candidates` of the configs: fastest parallelism per k, dominated k dropped,
        infeasible dropped; () when nothing fits.

    Raises:
        ValueError: max_gpus < 1 or an unknown device type.
        profilecache.ProfileCacheError: the profile cache file is unusable.
    """
    if max_gpus < 1:
        raise ValueError(f"max_gpus: must be >= 1 (got {max_gpus})")
    device = device or device_model(device_type)
    work = workload(job)
    spec = job.spec.model
    flops, params = model_cost(spec)
    if measured is not None:
        params = measured.parameters
        flops = measured.flops_per_sample or 2.0 * measured.parameters
    if zoo_records is None and zoo is not None:
        zoo_records = _list_records(zoo)
    step1 = measured.step_on(device_type, work.batch_size) if measured is not None else None
    source = "profile"
    if step1 is None:
        step1, source = _zoo_step(job, zoo_records or (), device), "zoo"
    if step1 is None:
        compute = FORWARD_BACKWARD_FACTOR * flops * work.batch_size / device.flops_per_second
        step1, source = compute + device.step_overhead_seconds, "flops"
    entries = profilecache.read_cache(profile_cache) if profile_cache is not None else {}
    kind = "cuda" if device_type.startswith("cuda") else "cpu"
    out = []
    for parallelism, k, nodes in _multi_node_shapes(job, max_gpus, kind, parallelisms):
        total = k * nodes  # profiles and zoo records are of one node: the curve, slowed down
        if source == "flops" and not _fits(parallelism, total, params, job, device):
            out.append(types.Config(parallelism, k, math.inf, "flops", node_count=nodes))
            continue
        step = speedup_step(step1, parallelism, total, params=params, device=device)
        out.append(types.Config(parallelism, k, job_seconds(
            work, step * CROSS_NODE_SLOWDOWN, device), source, node_count=nodes))
    profiled = []  # indices in `out` of the configs the cache measured one by one
    for parallelism, k in _shapes(job, max_gpus, kind, parallelisms):
        key = profilecache.cache_key(spec, batch_size=work.batch_size, parallelism=parallelism,
                                gpus=k, kind=device_type)
        cached = profilecache.lookup(entries, key)
        if cached is not None and not cached.feasible or (
                measured is not None and measured.out_of_memory and parallelism == "single"):
            out.append(types.Config(parallelism, k, math.inf, "profile"))
        elif source == "flops" and cached is not None and cached.step_seconds is not None:
            profiled.append(len(out))
            out.append(types.Config(parallelism, k,
                                    job_seconds(work, cached.step_seconds, device), "profile"))
        elif source == "flops" and not _fits(parallelism, k, params, job, device):
            out.append(types.Config(parallelism, k, math.inf, "flops"))
        else:
            step = speedup_step(step1, parallelism, k, params=params, device=device)
            out.append(types.Config(parallelism, k, job_seconds(work, step, device), source))
    for i, config in zip(profiled, speedup.fit([out[i] for i in profiled]), strict=True):
        out[i] = config
    return types.candidates(types.JobRequest(job.name, tuple(out)))


def speedup_step(step1: float, parallelism: str, k: int, *, params: int,
                 device: DeviceModel) -> float:
    """Step seconds on k devices from the k = 1 step: overhead serial, compute / k, plus
    communication (as `configs` says)."""
    overhead = min(device.step_overhead_seconds, step1 / 2)
    step = (step1 - overhead) / k + overhead
    if parallelism != "single" and k > 1:
        all_reduce = 2 * params * BYTES_PER_VALUE * (k - 1) / k / \
            device.bandwidth_bytes_per_second
        step += all_reduce * (FSDP_COMMUNICATION_FACTOR if parallelism == "fsdp" else 1.0)
    return step


def refine(
    configs: Sequence[types.Config],
    *,
    work: Workload,
    running: types.Config,
    measured_samples_per_second: float,
    device: DeviceModel,
) -> tuple[types.Config, ...]:
    """Rescale a running job's configs by its measured training throughput.

    The running config's step becomes B / measured samples/s; every other config keeps its
    ratio to the running one (the estimate's shape, the measurement's level). Infinite
    configs stay infinite. Pure.

    Args:
        configs: the job's current configs (e.g. from `configs`).
        work: `workload(job)`.
        running: the config it runs in (its seconds are the estimate being corrected).
        measured_samples_per_second: training throughput the trainer reports (> 0).
        device: the device constants the configs were estimated with.

    Returns:
        Configs with rescaled seconds and source "measured".

    Raises:
        ValueError: measured_samples_per_second is not > 0.
    """
    if not measured_samples_per_second > 0:
        raise ValueError(f"measured_samples_per_second: must be > 0 "
                         f"(got {measured_samples_per_second})")
    measured_step = work.batch_size / measured_samples_per_second
    factor = measured_step / step_of(work, running.seconds, device)
    return tuple(c if math.isinf(c.seconds) else dataclasses.replace(
        c, seconds=job_seconds(work, step_of(work, c.seconds, device) * factor, device),
        source="measured") for c in configs)


def remaining_seconds(work: Workload, *, samples_done: int,
                      measured_samples_per_second: float) -> float:
    """Seconds left for a running job: remaining training samples (plus evaluation) at the
    measured throughput. Pure."""
    if not measured_samples_per_second > 0:
        raise ValueError(f"measured_samples_per_second: must be > 0 "
                         f"(got {measured_samples_per_second})")
    left = max(0, work.total_train_samples - samples_done)
    eval_share = work.eval_batches * EVAL_COST_FRACTION / work.steps_per_epoch
    return left / measured_samples_per_second * (1 + eval_share)


def model_cost(spec: api.ModelSpec) -> tuple[float, int]:
    """(forward FLOPs per sample, parameter count), counted on the meta device; cached.

    Raises:
        models.UnknownArchitecture, TypeError, ValueError: the model cannot be built.
    """
    if spec.architecture is None:  # an entrypoint: never imported here (UNKNOWN_MODEL_...)
        return 2.0 * UNKNOWN_MODEL_PARAMETERS, UNKNOWN_MODEL_PARAMETERS
    key = json.dumps([spec.architecture, spec.args, list(spec.input_shape)], sort_keys=True)
    return _model_cost(key)


@functools.lru_cache(maxsize=256)
def _model_cost(key: str) -> tuple[float, int]:
    architecture, args, shape = json.loads(key)
    with torch.device("meta"):
        model = models.get_model(architecture, input_shape=tuple(shape), **args)
        example = models.example_input(architecture, tuple(shape), batch_size=1, device="meta")
    with tracing.LOCK, flop_counter.FlopCounterMode(display=False) as counter:
        model(example)
    return float(counter.get_total_flops()), sum(p.numel() for p in model.parameters())


def _multi_node_shapes(job: api.TrainingJob, max_gpus: int, kind: str,
                       parallelisms: Sequence[str]) -> list[tuple[str, int, int]]:
    """(parallelism, GPUs per node, nodes) of the multi-node configs: GPU jobs with a fixed
    gpus, over spec.resources.nodes nodes; or, when gpus is above gpusPerNode (or
    `max_gpus`), over every node count that splits gpus evenly within that cap."""
    res = job.spec.resources
    if kind != "cuda" or not res.gpus or res.gpus < 2 or res.nodes == 1:
        return []
    cap = min(max_gpus, res.gpus_per_node or max_gpus)
    if res.nodes is None and res.gpus <= cap:
        return []  # one node can take it: spanning nodes is the user's call (nodes)
    counts = [res.nodes] if res.nodes else [n for n in range(2, res.gpus + 1)
                                            if res.gpus % n == 0 and res.gpus // n <= cap]
    allowed = [p for p in parallelisms if p != "single"
               and res.parallelism in (api.Parallelism.AUTO, p)]
    return [(p, res.gpus // n, n) for n in counts for p in allowed]


def _shapes(job: api.TrainingJob, max_gpus: int, kind: str,
            parallelisms: Sequence[str]) -> list[tuple[str, int]]:
    res = job.spec.resources
    if res.nodes is not None and res.nodes > 1:
        return []  # only the multi-node shapes
    cap = min(max_gpus, res.gpus_per_node or max_gpus)
    ks = [1] if res.gpus == 0 else [res.gpus] if res.gpus else [k for k in GPU_COUNTS
                                                                  if k <= cap]
    allowed = [p for p in parallelisms if res.parallelism in (api.Parallelism.AUTO, p)]
    if kind == "cpu":
        allowed = [p for p in allowed if p != "fsdp"]  # FSDP needs GPUs (api.validate)
    batch = job.spec.training.batch_size  # the trainer splits the global batch evenly over k
    return [(p, k) for k in ks if k <= cap and batch % k == 0
            for p in allowed if (p == "single") == (k == 1)]


def _fits(parallelism: str, k: int, params: int, job: api.TrainingJob,
          device: DeviceModel) -> bool:
    opt = job.spec.training.optimizer
    states = 2 if opt.name != api.OptimizerName.SGD else (1 if opt.momentum > 0 else 0)
    needed = params * BYTES_PER_VALUE * (2 + states)
    return needed / (k if parallelism == "fsdp" else 1) <= device.memory_bytes


def _zoo_step(job: api.TrainingJob, candidates: Sequence[records.ZooRecord],
              device: DeviceModel) -> float | None:
    """k = 1 step seconds at the job's batch from the most similar zoo record, or None."""
    spec = job.spec.model
    if spec.entrypoint is not None:
        return _entrypoint_step(job, candidates, device)
    assert spec.architecture is not None
    info = models.get_info(spec.architecture)
    flops, params = model_cost(spec)
    ranked = []
    for rec in candidates:
        if not rec.samples_per_second or rec.samples_per_second <= 0 or rec.num_params <= 0:
            continue
        if rec.architecture is None:  # an entrypoint model: no registry family to compare
            continue
        try:
            family = models.get_info(rec.architecture).family
        except models.UnknownArchitecture:
            continue
        tier = 0 if rec.architecture == spec.architecture else 1 if family == info.family else 2
        if tier == 2 or rec.task != str(info.task):
            continue
        distance = abs(math.log(params / rec.num_params)) if params else math.inf
        ranked.append((tier, tuple(rec.input_shape) != tuple(spec.input_shape), distance,
                       _negated(rec.created_time), rec))
    if not ranked:
        return None
    rec = min(ranked, key=lambda r: r[:4])[4]
    assert rec.architecture is not None  # entrypoint records were skipped above
    try:
        rec_flops, _ = model_cost(api.ModelSpec(architecture=rec.architecture, args=rec.args,
                                                input_shape=list(rec.input_shape)))
        scale = flops / rec_flops if rec_flops > 0 and flops > 0 else params / rec.num_params
    except (TypeError, ValueError):  # the record's model no longer builds: parameter ratio
        scale = params / rec.num_params
    rec_batch = _record_batch(rec) or job.spec.training.batch_size
    rec_step = rec_batch / (rec.samples_per_second or 1.0)  # > 0: filtered above
    compute = max(rec_step - device.step_overhead_seconds, rec_step / 2)
    return compute * scale * job.spec.training.batch_size / rec_batch + \
        device.step_overhead_seconds


def _entrypoint_step(job: api.TrainingJob, candidates: Sequence[records.ZooRecord],
                     device: DeviceModel) -> float | None:
    """k = 1 step seconds of an entrypoint model from a measured run of the same entrypoint
    (same args and input shape first, then the newest), unscaled; None when there is none."""
    spec = job.spec.model
    ranked = [(rec.args != spec.args, tuple(rec.input_shape) != tuple(spec.input_shape),
               _negated(rec.created_time), rec) for rec in candidates
              if rec.entrypoint == spec.entrypoint and (rec.samples_per_second or 0.0) > 0]
    if not ranked:
        return None
    rec = min(ranked, key=lambda r: r[:3])[3]
    rec_batch = _record_batch(rec) or job.spec.training.batch_size
    rec_step = rec_batch / (rec.samples_per_second or 1.0)
    compute = max(rec_step - device.step_overhead_seconds, rec_step / 2)
    return compute * job.spec.training.batch_size / rec_batch + device.step_overhead_seconds


def _record_batch(rec: records.ZooRecord) -> int | None:
    batch = rec.job_spec.get("spec", {}).get("training", {}).get("batchSize")
    return batch if isinstance(batch, int) and batch > 0 else None


def _negated(text: str) -> tuple[int, ...]:
    """Sort key putting later RFC 3339 times first."""
    return tuple(-ord(c) for c in text)


def _list_records(zoo: store.ObjectStore) -> list[records.ZooRecord]:
    try:
        return records.list_records(zoo)
    except store.StoreUnavailable as exc:
        warnings.warn(f"runtime estimates without the zoo ({zoo.describe()} unavailable: "
                      f"{exc}); using profiles and FLOPs", stacklevel=3)
        return []


def _dataset_samples(ds: api.DatasetSpec, input_shape: Sequence[int]) -> int:
    if ds.loader == api.DatasetName.DIGITS:
        return DIGITS_SAMPLES
    if ds.loader == api.DatasetName.TORCHVISION:
        return TORCHVISION_TRAIN_SAMPLES.get(ds.torchvision_class or "", UNKNOWN_SAMPLES)
    if not ds.path or ds.path.startswith("s3://") or not Path(ds.path).exists():
        return UNKNOWN_SAMPLES
    path = Path(ds.path)
    # As the trainer reads folders: linked folders followed once each (a link back to an
    # ancestor would loop), each real file counted once.
    seen_dirs: set[str] = set()
    files: set[str] = set()
    for root, dirs, names in os.walk(path, followlinks=True):
        seen_dirs.add(os.path.realpath(root))
        dirs[:] = [d for d in dirs if os.path.realpath(os.path.join(root, d)) not in seen_dirs]
        files.update(os.path.realpath(os.path.join(root, n)) for n in names)
    if ds.loader == api.DatasetName.TEXT:
        sizes = [path.stat().st_size] if path.is_file() else [os.path.getsize(f) for f in files
                                                              if os.path.isfile(f)]
        return sum(sizes) // (int(input_shape[0]) + 1)
    count = sum(1 for f in files if Path(f).suffix.lower() in _IMAGE_SUFFIXES)
    return count or UNKNOWN_SAMPLES
