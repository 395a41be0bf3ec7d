"""Process set-up for a training run: the job, seeds, device, CPU threads, output check,
metrics port, and the stop when `kiln run` dies."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kiln import api, contract
from kiln.api import jobfile
from kiln_trainer import data, metrics

_log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


class ConfigError(ValueError):
    """The run cannot start as configured (device, metrics port); the message says the fix."""


def load_job(job_file: str | None, job_json: str | None) -> api.TrainingJob:
    """The job from a file, else from JSON text (`contract.Env.JOB`).

    Raises:
        api.InvalidSpec: no job given, a bad file, several jobs in one file, or an invalid job.
    """
    if job_file:
        jobs = jobfile.load_jobs(job_file)
        if len(jobs) != 1:
            problem = f"the file holds {len(jobs)} jobs; the trainer runs exactly one (split it)"
            raise api.InvalidSpec([problem], source=job_file)
        return jobs[0]
    if job_json:
        try:
            doc = json.loads(job_json)
        except json.JSONDecodeError as exc:
            raise api.InvalidSpec([f"not valid JSON: {exc}"], source=contract.Env.JOB) from None
        except RecursionError:
            raise api.InvalidSpec(["JSON nested too deeply to read"],
                                  source=contract.Env.JOB) from None
        return api.parse_job(doc, source=contract.Env.JOB)
    raise api.InvalidSpec([(f"no job given: pass {contract.Flag.JOB} FILE, or set "
                            f"{contract.Env.JOB_FILE} or {contract.Env.JOB}")])


def stop_with_parent() -> None:
    """Under `kiln run` (`contract.Env.STOP_WITH_PARENT`: its pid, our parent's), have Linux
    send us SIGTERM when it dies, however it dies: we checkpoint and stop as at its Ctrl-C, and
    its rerun resumes us, instead of our training on unwatched (twice, after a rerun). Call it
    with the SIGTERM handler installed. Elsewhere, or without the variable, nothing changes.

    The variable is removed: the processes we start are not kiln's children.
    """
    parent = os.environ.pop(contract.Env.STOP_WITH_PARENT, "")
    if sys.platform != "linux" or not parent.isdigit():
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM)) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() == int(parent):
        return
    try:
        os.kill(int(parent), 0)
    except ProcessLookupError:  # it died before the signal was armed: as if it had come
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except PermissionError:
        pass
    # a program between kiln and us is our parent: its end is not kiln's, so nothing changes
    libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(0))


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) global RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pick_device(spec: api.TrainingJobSpec) -> torch.device:
    """CUDA when available and allowed (device auto/cuda, gpus not 0), else the CPU.

    Under torchrun the GPU is LOCAL_RANK's.

    Raises:
        ConfigError: spec.training.device is cuda but no CUDA device is visible.
    """
    wanted, available = spec.training.device, torch.cuda.is_available()
    if wanted == "cuda" and not available:
        raise ConfigError("spec.training.device: cuda, but no CUDA device is visible to torch; "
                          "use auto or cpu, or run where a GPU is")
    if wanted == "cpu" or not available or (wanted == "auto" and spec.resources.gpus == 0):
        limit_cpu_threads()
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def limit_cpu_threads(cgroup_cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> None:
    """Use no more intra-op threads than the container's CPU quota allows.

    torch sizes its thread pool by the host's cores and ignores a pod's CPU limit; more threads
    than CPUs make each step many times slower (spinning OpenMP workers). The k processes
    torchrun starts in one pod (LOCAL_WORLD_SIZE) share the quota. OMP_NUM_THREADS, when set,
    wins.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    try:
        quota, period = cgroup_cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return  # no cgroup v2 quota to honour
    if quota != "max":
        local_processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
        threads = max(1, int(int(quota) / int(period)) // local_processes)
        if threads < torch.get_num_threads():
            _log.info("CPU quota %s/%s: using %d threads", quota, period, threads)
            torch.set_num_threads(threads)


def check_outputs(raw_model: nn.Module, splits: data.Splits, device: torch.device) -> None:
    """Run one validation sample through the model and check its output size fits the data.

    Raises:
        api.InvalidSpec: fewer logits than the dataset's classes, or than 256 bytes for text;
            a tokenizer whose ids the model cannot embed.
        data.DatasetError: an entrypoint dataset's target the model cannot predict.
    """
    sample, _ = splits.validation[0]
    raw_model.eval()
    try:
        with torch.inference_mode():
            outputs = int(raw_model(sample.unsqueeze(0).to(device)).shape[-1])
    except (IndexError, RuntimeError) as exc:
        if splits.vocab_size is None:
            raise
        # a token id past the embedding's rows: the tokenizer is not the model's
        raise api.InvalidSpec([(
            f"spec.model.pretrained.uri: the model cannot read the ids of the tokenizer.json "
            f"beside its weights ({type(exc).__name__}: {exc}), whose vocabulary has "
            f"{splits.vocab_size} tokens; ship the tokenizer the weights were trained with, or "
            f"weights of a model with spec.model.args.vocab_size at least "
            f"{splits.vocab_size}")]) from None
    finally:
        raw_model.train()
    data.check_targets(splits, outputs)
    if splits.num_classes is not None and outputs < splits.num_classes:
        raise api.InvalidSpec([(
            f"spec.model.args.num_classes: the model has {outputs} outputs but "
            f"{splits.description} has {splits.num_classes} classes; set num_classes: "
            f"{splits.num_classes}")])
    if splits.vocab_size is not None and outputs < splits.vocab_size:
        raise api.InvalidSpec([(
            f"spec.model.args.vocab_size: the model predicts {outputs} tokens but the "
            f"tokenizer.json beside spec.model.pretrained.uri has {splits.vocab_size}; set "
            f"vocab_size: {splits.vocab_size}")])
    if (splits.modality == "text" and splits.max_target is None and splits.vocab_size is None
            and outputs < 256):  # bytes
        raise api.InvalidSpec([(
            f"spec.model.args.vocab_size: the model predicts {outputs} tokens but byte-level "
            "text has 256; set vocab_size: 256")])
    if splits.num_classes is not None and outputs > splits.num_classes:
        _log.warning("the model has %d outputs for %d classes; the extra ones stay unused",
                     outputs, splits.num_classes)



def serve_metrics(gauges: metrics.MetricsReporter, port: int) -> None:
    """Serve /metrics on `port` (0: no endpoint).

    Raises:
        ConfigError: the port cannot be bound.
    """
    if not port:
        return
    try:
        _log.info("metrics on port %d", gauges.serve(port))
    except OSError as exc:
        raise ConfigError(f"{contract.Flag.METRICS_PORT} {port}: cannot serve ({exc}); pick a free port, "
                          "or 0 to turn the endpoint off") from exc
