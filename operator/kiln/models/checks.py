"""Registry checks of a TrainingJob: does its model exist, suit its dataset and build?

`check_job` adds to `api.validate` what only the registry can tell, building the model on the
`meta` device (no memory, no initialisation, global RNG untouched); `build` builds the real one.
No I/O, no checks of the data itself.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln import api
from kiln.models import registry

_DATASET_MODALITY = {
    api.DatasetName.DIGITS: registry.Modality.IMAGE,
    api.DatasetName.IMAGEFOLDER: registry.Modality.IMAGE,
    api.DatasetName.TORCHVISION: registry.Modality.IMAGE,
    api.DatasetName.TEXT: registry.Modality.TEXT,
}
# Classes of datasets whose class count is known without reading them.
_DATASET_CLASSES = {api.DatasetName.DIGITS: 10}
# Text datasets are byte-level: every token is one of 256 byte values.
_TEXT_VOCABULARY = 256
# Above this many parameters a model does not fit one accelerator's memory for training (8 GB
# of fp32 weights alone, 4x that with gradients and Adam state); reject before allocating.
MAX_PARAMETERS = 2_000_000_000


def build(spec: api.ModelSpec) -> nn.Module:
    """Build the model a job's `spec.model` describes, freshly initialised (seed torch first).

    Args:
        spec: architecture, builder args and input shape.

    Returns:
        The model on the current default device.

    Raises:
        UnknownArchitecture: the architecture is not registered.
        TypeError: an argument is unknown or has the wrong type.
        ValueError: an argument is out of range.
        IncompatibleInputShape: the architecture cannot take `spec.input_shape`.
    """
    return registry.get_model(spec.architecture, input_shape=tuple(spec.input_shape), **spec.args)


def check_job(job: api.TrainingJob) -> list[str]:
    """Every problem of a job: `api.validate`'s plus the registry's; [] when the job can run.

    Checks, in order (a failed check skips the checks that depend on it):
      * `api.validate(job)`;
      * spec.model.architecture is registered (else the closest names);
      * the model's modality matches the dataset's (image datasets need image models, text
        needs text models);
      * every spec.model.args key is a builder argument (else a did-you-mean);
      * num_classes covers the dataset's classes (digits: 10), vocab_size covers bytes (256);
      * the builder accepts the args and the input shape (errors of any kind while building
        name spec.model), the model has at most MAX_PARAMETERS parameters, and one forward
        pass of a Tensor[2, *inputShape] works (all on the `meta` device).

    Args:
        job: a parsed TrainingJob.

    Returns:
        Problems, one line each, as ``spec.model.<field>: what is wrong (got X); fix``.
    """
    problems = api.validate(job)
    spec, dataset = job.spec.model, job.spec.dataset.name
    try:
        info = registry.get_info(spec.architecture)
    except registry.UnknownArchitecture as exc:
        return [*problems, f"spec.model.architecture: {exc}"]
    wanted = _DATASET_MODALITY[dataset]
    if info.modality != wanted:
        fitting = [n for n in registry.list_models() if registry.get_info(n).modality == wanted]
        problems.append(
            f"spec.model.architecture: {info.name} is {_a(info.modality)} model but dataset "
            f"{dataset} gives {wanted} data; use {_a(wanted)} model ({', '.join(fitting)})"
        )
        return problems
    arg_problems = [
        f"spec.model.args.{key}: {why}" for key, why in registry.unknown_args(info.name, spec.args)
    ]
    problems += arg_problems + _dataset_fit(info, spec, dataset)
    if arg_problems or any(p.startswith("spec.model.inputShape") for p in problems):
        return problems  # building would only repeat these problems in murkier words
    return problems + _build_problems(info, spec)


def _dataset_fit(
    info: registry.ArchitectureInfo, spec: api.ModelSpec, dataset: api.DatasetName
) -> list[str]:
    """Output size vs the dataset: enough classes, or a vocabulary covering every byte."""
    args = {**info.default_args, **spec.args}
    classes = _DATASET_CLASSES.get(dataset)
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
        num_params = sum(p.numel() for p in model.parameters())
        if num_params > MAX_PARAMETERS:
            message = (f"spec.model.args: {info.name} with these args has {num_params:,} "
                       f"parameters, over the {MAX_PARAMETERS:,} one trainer can hold; reduce "
                       "its width or depth")
            return [message]
        sample = registry.example_input(info.name, shape, batch_size=2, device="meta")
        try:
            with torch.no_grad():
                model.eval()(sample)
        except (RuntimeError, ValueError, IndexError, OverflowError) as exc:
            reason = _first_line(exc)
            message = (
                f"spec.model.inputShape: {info.name} cannot take input {shape} ({reason}); "
                "use a larger input or another architecture"
            )
            return [message]
    return []


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (builders' errors can span many), or its type."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _a(modality: registry.Modality) -> str:
    """The modality with its indefinite article: "an image", "a text"."""
    return f"{'an' if modality[0] in 'aeiou' else 'a'} {modality}"
