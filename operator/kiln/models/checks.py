"""A job's model: `check_job` (the one validation of `kiln validate` and admission) and `build`.

`check_job` adds to `api.validate` what only the registry can tell, building registry models on
the `meta` device; it never imports an entrypoint. `build` builds the real model, either kind.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter

from kiln import api
from kiln.models import entrypoints, lora, registry, tracing

_DATASET_MODALITY = {
    api.DatasetName.DIGITS: registry.Modality.IMAGE,
    api.DatasetName.IMAGEFOLDER: registry.Modality.IMAGE,
    api.DatasetName.TORCHVISION: registry.Modality.IMAGE,
    api.DatasetName.TEXT: registry.Modality.TEXT,
}
_TASKS = {
    api.ModelTask.CLASSIFICATION: registry.Task.CLASSIFICATION,
    api.ModelTask.LANGUAGE_MODEL: registry.Task.LANGUAGE_MODELING,
}
# Classes of datasets whose class count is known without reading them.
_DATASET_CLASSES = {api.DatasetName.DIGITS: 10}
# Text datasets are byte-level: every token is one of 256 byte values.
_TEXT_VOCABULARY = 256
# Above this many parameters a model does not fit one accelerator's memory for training (8 GB
# of fp32 weights alone, 4x that with gradients and Adam state); reject before allocating.
MAX_PARAMETERS = 2_000_000_000
# Size limits that bound admission's own work, so one job cannot stall it: building a model on
# `meta` and tracing its graph take time per module (about 1 s per 3,000 modules), whatever the
# widths. A layer count arg is checked before building (a list counts its sum), modules before
# the forward pass and before any tracing, FLOPs on the forward pass (a FlopCounterMode on meta
# tensors costs little). Every example and registry default is far below each of them.
LAYER_ARGS = ("depth", "blocks", "layers", "num_layers")
MAX_LAYERS = 200
MAX_MODULES = 10_000
MAX_FLOPS_PER_SAMPLE = 1e14


def build(spec: api.ModelSpec) -> nn.Module:
    """Build the model a job's `spec.model` describes, freshly initialised (seed torch first).

    A registry architecture is built by its builder; an entrypoint is imported and called with
    `spec.args` (only trainer processes may do that: it runs user code).

    Args:
        spec: architecture or entrypoint, args and input shape.

    Returns:
        The model on the current default device.

    Raises:
        UnknownArchitecture: the architecture is not registered.
        TypeError: an argument is unknown or has the wrong type.
        ValueError: an argument is out of range.
        IncompatibleInputShape: the architecture cannot take `spec.input_shape`.
        entrypoints.EntrypointError: the entrypoint cannot be imported, is not callable, raises
            or returns something other than an nn.Module (naming spec.model.entrypoint and the
            user's file and line).
    """
    if spec.entrypoint is not None:
        return entrypoints.build_model(spec.entrypoint, spec.args)
    if spec.architecture is None:
        raise ValueError("spec.model: set architecture or entrypoint")
    return registry.get_model(spec.architecture, input_shape=tuple(spec.input_shape), **spec.args)


def task_of(spec: api.ModelSpec) -> registry.Task:
    """What the model's output means: spec.model.task, else the registry's, else
    classification (an entrypoint without a task)."""
    if spec.task is not None:
        return _TASKS[spec.task]
    if spec.architecture is not None:
        return registry.get_info(spec.architecture).task
    return registry.Task.CLASSIFICATION


def modality_of(spec: api.ModelSpec) -> registry.Modality:
    """What one input sample is: the registry's for an architecture; for an entrypoint, token
    ids (text) for a language model or an inputShape of one size [T], else images."""
    if spec.architecture is not None:
        return registry.get_info(spec.architecture).modality
    one_size = len(spec.input_shape) == 1
    language = task_of(spec) is registry.Task.LANGUAGE_MODELING
    return registry.Modality.TEXT if language or one_size else registry.Modality.IMAGE


def example_batch(spec: api.ModelSpec, *, batch_size: int = 1,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """A zero input batch of the right dtype: Tensor[B, C, H, W] or LongTensor[B, T]."""
    shape = (batch_size, *(int(size) for size in spec.input_shape))
    dtype = torch.long if modality_of(spec) is registry.Modality.TEXT else torch.float32
    return torch.zeros(shape, dtype=dtype, device=device)


def check_job(job: api.TrainingJob | api.InvalidSpec) -> list[str]:
    """Every problem of a job; [] when the job can run. `kiln validate` and the operator's
    admission both run exactly this, on what `api.parse_job` gave: the job, or the
    `api.InvalidSpec` it raised. Given the error, its problems (schema and cross-field) come
    first, then the registry's problems of the job as far as it parsed (`InvalidSpec.job`),
    except those reading a field the schema rejected (`api.unaffected`): every problem that
    can be told is named at once.

    Checks, in order (a failed check skips the checks that depend on it):
      * `api.validate(job)` (cross-field rules, the pod template);
      * an entrypoint model: only its format (in the schema) and its task against a built-in
        dataset; it is never imported here (the trainer imports it, and reports its errors);
      * spec.model.architecture is registered (else the closest names), and spec.model.task,
        when given, is the registry's;
      * the model's modality matches the dataset's (image datasets need image models, text
        needs text models);
      * every spec.model.args key is a builder argument (else a did-you-mean);
      * num_classes covers the dataset's classes (digits: 10), vocab_size covers bytes (256);
      * no layer count arg (LAYER_ARGS) is above MAX_LAYERS, checked before building;
      * the builder accepts the args and the input shape (errors of any kind while building
        name spec.model), the model has at most MAX_MODULES modules and MAX_PARAMETERS
        parameters, and one forward pass of a Tensor[2, *inputShape] works and costs at most
        MAX_FLOPS_PER_SAMPLE per sample (all on the `meta` device);
      * a LoRA job (spec.training.peft) pins its base (spec.warmStart.parent) or gives its
        weights (spec.model.pretrained.uri), does not ask for FSDP, and each of its
        targetModules names a Linear, Conv or Embedding of the registry model (on `meta`).

    The registry checks are cached per (model, dataset): a thousand jobs of a few
    architectures build a few models.

    Args:
        job: a parsed TrainingJob, or the `api.InvalidSpec` of a document that did not parse.

    Returns:
        Problems, one line each, as ``spec.model.<field>: what is wrong (got X); fix``.
    """
    if isinstance(job, api.InvalidSpec):
        parsed = job.job
        if not isinstance(parsed, api.TrainingJob):
            return list(job.problems)
        more = api.unaffected(_model_problems(parsed), job.rejected)
        return list(job.problems) + [p for p in more if p not in job.problems]
    return api.validate(job) + _model_problems(job)


def check_sweep(sweep: api.sweep.TrainingSweep | api.InvalidSpec) -> list[str]:
    """`check_job`'s registry checks for every trial a parsed sweep may make; [] when each can
    run. `kiln validate` and the operator's admission of a sweep both run this after
    `api.sweep.parse_sweep` (which checked the rest): the template as a trial's spec, then
    each parameter alone at each of its values (each category, each end of a range), then the
    parameters together (`api.sweep.probe_points`). Given the error `parse_sweep` raised, its
    problems, then (as `check_job` does) these checks of the sweep as far as it parsed when
    only the schema rejected fields, except problems reading those fields.

    Returns:
        Problems, one line each, naming spec.template or spec.parameters[i].
    """
    if isinstance(sweep, api.InvalidSpec):
        partial = sweep.job
        if not isinstance(partial, api.sweep.TrainingSweep) or api.sweep.problems(partial):
            return list(sweep.problems)
        return list(sweep.problems) + api.unaffected(check_sweep(partial), sweep.rejected)
    template = api.to_wire(sweep.spec.template)
    found = [f"spec.template.{p.removeprefix('spec.')}" for p in _trial_problems(sweep, template)]
    if found:  # every parameter's trials would repeat them
        return found
    for i, param in enumerate(sweep.spec.parameters):
        for value in api.sweep.probe_values(param):
            bad = _trial_problems(sweep, api.sweep.apply(template, {param.path: value}))
            if bad:
                found.append(f"spec.parameters[{i}]: {param.path}={json.dumps(value)} makes an "
                             "invalid trial: " + "; ".join(bad))
    if found:  # each alone says it better
        return found
    for point in api.sweep.probe_points(sweep.spec.parameters):
        bad = _trial_problems(sweep, api.sweep.apply(template, point))
        if bad:
            values = ", ".join(f"{path}={json.dumps(v)}" for path, v in point.items())
            return [f"spec.parameters: {values} together make an invalid trial: "
                    + "; ".join(bad) + "; narrow the ranges so that every combination is valid"]
    return found


def _trial_problems(sweep: api.sweep.TrainingSweep, spec: dict[str, Any]) -> list[str]:
    """`check_job`'s problems of a trial TrainingJob of `sweep` with `spec`."""
    name = api.sweep.trial_name(sweep.name[:api.sweep.SWEEP_NAME_MAX_LENGTH], 0)
    doc = {"apiVersion": api.API_VERSION, "kind": api.KIND,
           "metadata": {"name": name, "namespace": sweep.namespace}, "spec": spec}
    try:
        return check_job(api.parse_job(doc))
    except api.InvalidSpec as exc:
        return check_job(exc)


def _model_problems(job: api.TrainingJob) -> list[str]:
    """`check_job`'s checks beyond `api.validate`: the model against the registry."""
    problems = _peft_problems(job)
    spec, dataset = job.spec.model, job.spec.dataset.loader
    if spec.architecture is None or spec.entrypoint is not None:
        return problems + _entrypoint_problems(spec, dataset)
    key = json.dumps([api.to_wire(spec), dataset], sort_keys=True)
    problems += list(_registry_problems(key))
    if job.spec.training.peft is not None and not problems:
        problems += list(_lora_problems(json.dumps(
            [api.to_wire(spec), api.to_wire(job.spec.training.peft)], sort_keys=True)))
    return problems


def _peft_problems(job: api.TrainingJob) -> list[str]:
    """A LoRA job's rules beyond the schema: a base (pinned, or spec.model.pretrained.uri),
    no FSDP."""
    if job.spec.training.peft is None:
        return []
    problems = []
    warm = job.spec.warm_start
    if job.spec.model.pretrained is None and (not warm.enabled or warm.parent == "auto"):
        problems.append("spec.training.peft: LoRA trains an adapter on a base model; set "
                        "spec.warmStart.parent to its zoo id (a full model, or an adapter on "
                        "that base) and keep spec.warmStart.enabled true, or give the base's "
                        "weights as spec.model.pretrained.uri")
    if job.spec.resources.parallelism is api.Parallelism.FSDP:
        problems.append("spec.training.peft: a LoRA adapter is small and trains with one "
                        "process or under ddp; set spec.resources.parallelism to ddp or auto")
    return problems


@functools.lru_cache(maxsize=256)
def _lora_problems(key: str) -> tuple[str, ...]:
    """spec.training.peft.targetModules against the registry model, built on `meta`."""
    wire, peft_wire = json.loads(key)
    with torch.device("meta"):
        model = build(api.ModelSpec.model_validate(wire))
        try:
            lora.attach(model, api.PeftSpec.model_validate(peft_wire))
        except (ValueError, lora.PeftMissing) as exc:
            return (str(exc),)
    return ()


@functools.lru_cache(maxsize=1024)
def _registry_problems(key: str) -> tuple[str, ...]:
    """The registry's problems of a registry model on a dataset, by `check_job`'s cache key."""
    wire, dataset_name = json.loads(key)
    spec = api.ModelSpec.model_validate(wire)
    dataset = api.DatasetName(dataset_name) if dataset_name is not None else None
    assert spec.architecture is not None
    try:
        info = registry.get_info(spec.architecture)
    except registry.UnknownArchitecture as exc:
        look_alike = api.non_ascii(spec.architecture)
        if look_alike is not None:
            return (f"spec.model.architecture: {spec.architecture!r} {look_alike}; {exc}",)
        return (f"spec.model.architecture: {exc}",)
    problems: list[str] = []
    if spec.task is not None and _TASKS[spec.task] is not info.task:
        wire = next(k for k, v in _TASKS.items() if v is info.task).value
        problem = (f"spec.model.task: {info.name} is a {wire} model (got {spec.task.value}); "
                   f"remove task or set it to {wire}")
        return (problem,)
    wanted = _DATASET_MODALITY[dataset] if dataset is not None else None  # None: an entrypoint
    if wanted is not None and info.modality != wanted:
        fitting = [n for n in registry.list_models() if registry.get_info(n).modality == wanted]
        problems.append(
            f"spec.model.architecture: {info.name} is {_a(info.modality)} model but dataset "
            f"{dataset} gives {wanted} data; use {_a(wanted)} model ({', '.join(fitting)})"
        )
        return tuple(problems)
    arg_problems = [
        f"spec.model.args.{key}: {why}" for key, why in registry.unknown_args(info.name, spec.args)
    ]
    problems += arg_problems + _dataset_fit(info, spec, dataset) + _layer_problems(spec)
    if arg_problems or any(p.startswith(("spec.model.inputShape", "spec.model.args."))
                           for p in problems):
        return tuple(problems)  # building would repeat these problems or take too long
    return tuple(problems + _build_problems(info, spec))


def _entrypoint_problems(spec: api.ModelSpec, dataset: api.DatasetName | None) -> list[str]:
    """An entrypoint model's task against a built-in dataset (the format is the schema's)."""
    if spec.entrypoint is None or dataset is None:
        return []
    task = task_of(spec)
    if dataset == api.DatasetName.TEXT and task is not registry.Task.LANGUAGE_MODELING:
        return [(f"spec.model.task: dataset text gives next-token targets, so the model must "
                 f"be a language model (got {task_name(spec)}); set task: language_model")]
    if dataset != api.DatasetName.TEXT and task is registry.Task.LANGUAGE_MODELING:
        return [(f"spec.model.task: dataset {dataset} gives labelled images, not token "
                 "sequences; set task: classification")]
    return []


def task_name(spec: api.ModelSpec) -> str:
    """spec.model.task's wire value, defaults applied: classification or language_model."""
    return wire_task(task_of(spec))


def wire_task(task: str) -> str:
    """A `registry.Task` (as a zoo record stores it, e.g. language_modeling) as
    spec.model.task's wire value (language_model); an unknown one as it is."""
    return next((k.value for k, v in _TASKS.items() if v.value == task), task)


def _dataset_fit(
    info: registry.ArchitectureInfo, spec: api.ModelSpec, dataset: api.DatasetName | None
) -> list[str]:
    """Output size vs the dataset: enough classes, or a vocabulary covering every byte."""
    args = {**info.default_args, **spec.args}
    classes = _DATASET_CLASSES.get(dataset) if dataset is not None else None
    num_classes, vocab_size = args.get("num_classes"), args.get("vocab_size")
    if classes is not None and isinstance(num_classes, int) and num_classes < classes:
        message = (
            f"spec.model.args.num_classes: dataset {dataset} has {classes} classes (got "
            f"{num_classes}); set num_classes: {classes}"
        )
        return [message]
    text = dataset == api.DatasetName.TEXT
    if text and isinstance(vocab_size, int) and vocab_size < _TEXT_VOCABULARY:
        message = (
            f"spec.model.args.vocab_size: text is read as bytes, so it needs "
            f"{_TEXT_VOCABULARY} tokens (got {vocab_size}); set vocab_size: {_TEXT_VOCABULARY}"
        )
        return [message]
    return []


def _layer_problems(spec: api.ModelSpec) -> list[str]:
    """Layer counts over MAX_LAYERS, before building: building time grows with them."""
    problems = []
    for name in LAYER_ARGS:
        value = spec.args.get(name)
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            value = sum(value)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LAYERS:
            problems.append(f"spec.model.args.{name}: the model would have {value:,} layers; "
                            f"Kiln builds at most {MAX_LAYERS:,}; use fewer blocks ({name})")
    return problems


def _build_problems(info: registry.ArchitectureInfo, spec: api.ModelSpec) -> list[str]:
    """Build on `meta` and run one forward pass; the builder's own complaints become problems."""
    shape = list(spec.input_shape)
    with torch.device("meta"):
        try:
            model = build(spec)
        except registry.IncompatibleInputShape as exc:
            return [f"spec.model.inputShape: {exc}"]
        except (TypeError, ValueError) as exc:
            return [f"spec.model.args: {info.name} rejects its args: {exc}"]
        except (RuntimeError, OverflowError) as exc:  # e.g. shape arithmetic overflowing int64
            message = (f"spec.model: {info.name} cannot be built with inputShape {shape} and "
                       f"these args ({_first_line(exc)}); use smaller sizes")
            return [message]
        num_modules = sum(1 for _ in model.modules())
        if num_modules > MAX_MODULES:
            message = (f"spec.model.args: the model has {num_modules:,} modules; Kiln traces at "
                       f"most {MAX_MODULES:,}; use fewer blocks (depth)")
            return [message]
        num_params = sum(p.numel() for p in model.parameters())
        if num_params > MAX_PARAMETERS:
            message = (f"spec.model.args: {info.name} with these args has {num_params:,} "
                       f"parameters, over the {MAX_PARAMETERS:,} one trainer can hold; reduce "
                       "its width or depth")
            return [message]
        sample = registry.example_input(info.name, shape, batch_size=2, device="meta")
        try:
            # FlopCounterMode's module hooks are global, and a trace elsewhere patches calls.
            with tracing.LOCK, torch.no_grad(), flop_counter.FlopCounterMode(
                    display=False) as flops:
                model.eval()(sample)
        except (RuntimeError, ValueError, IndexError, OverflowError) as exc:
            reason = _first_line(exc)
            message = (
                f"spec.model.inputShape: {info.name} cannot take input {shape} ({reason}); "
                "use a larger input or another architecture"
            )
            return [message]
    flops_per_sample = flops.get_total_flops() / 2
    if flops_per_sample > MAX_FLOPS_PER_SAMPLE:
        return [(f"spec.model: one forward pass of {info.name} with inputShape {shape} costs "
                 f"{flops_per_sample:.3g} FLOPs per sample; Kiln accepts at most "
                 f"{MAX_FLOPS_PER_SAMPLE:.3g}; use a smaller input, width or depth")]
    return []


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (builders' errors can span many), or its type."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _a(modality: registry.Modality) -> str:
    """The modality with its indefinite article: "an image", "a text"."""
    return f"{'an' if modality[0] in 'aeiou' else 'a'} {modality}"
