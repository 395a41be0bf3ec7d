"""Kiln's models: the architecture registry, and models from user code (entrypoints).

Image classifiers map Tensor[B, C, H, W] to logits Tensor[B, K]; the character LM maps
LongTensor[B, T] to Tensor[B, T, V]. Input shapes exclude the batch. Never downloads weights.
"""

# Importing the families registers their builders.
from kiln.models import small_cnn, small_resnet, torchvision_models, transformers  # noqa: F401

# The package's public face, torchvision style: `models.get_model(name, ...)`,
# `models.list_models()`, `models.build(spec)`, `models.check_job(job)`,
# `models.check_sweep(sweep)`.
from kiln.models.checks import (
    build,
    check_job,
    check_sweep,
    example_batch,
    modality_of,
    task_name,
    task_of,
    wire_task,
)
from kiln.models.entrypoints import EntrypointError, out_of_memory
from kiln.models.registry import (
    ArchitectureInfo,
    IncompatibleInputShape,
    Modality,
    Task,
    UnknownArchitecture,
    declare_blocks,
    example_input,
    get_info,
    get_model,
    layer_stack,
    list_models,
    natural_blocks,
    register_model,
)

__all__ = [
    "ArchitectureInfo",
    "EntrypointError",
    "IncompatibleInputShape",
    "Modality",
    "Task",
    "UnknownArchitecture",
    "build",
    "check_job",
    "check_sweep",
    "declare_blocks",
    "example_batch",
    "example_input",
    "get_info",
    "get_model",
    "layer_stack",
    "list_models",
    "modality_of",
    "natural_blocks",
    "out_of_memory",
    "register_model",
    "task_name",
    "task_of",
    "wire_task",
]
