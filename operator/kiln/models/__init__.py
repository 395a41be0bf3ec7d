"""Kiln's architecture registry: every model a TrainingJob can name, built from scratch.

Role: maps `spec.model.architecture` to a builder, torchvision style (`register_model`,
`get_model`, `list_models`), and says what each model eats (modality), predicts (task) and
where its natural blocks are (for freezing). Registered families:
  * torchvision classification (`torchvision_models`): resnet18/34/50/101, vgg11_bn, vgg16_bn,
    mobilenet_v2, mobilenet_v3_small, densenet121; grey and small images are adapted;
  * `small_cnn`, `small_resnet` (CIFAR-style): small images, fast on CPU;
  * `vit` (images by patches) and `char_transformer` (causal byte-level LM) (`transformers`).

Conventions: image classifiers map Tensor[B, C, H, W] float to logits Tensor[B, K] (argument
`num_classes` = K, default 10); the character LM maps LongTensor[B, T] to logits
Tensor[B, T, V] (argument `vocab_size` = V, default 256 = bytes). Input shapes exclude the
batch: (C, H, W) for images, (T,) for text.

Callers: `kiln.zoo`, `kiln.warmstart`, the trainer, the CLI, the controller. This package sits
at the bottom of Kiln's layers: it imports only `kiln.api`, torch and torchvision.
Non-goals: no pretrained weights (never downloads), no I/O, no training.

Example:
    >>> from kiln import models
    >>> model = models.get_model("small_resnet", input_shape=(1, 16, 16), blocks=[1, 1, 1])
    >>> models.natural_blocks(model)
    ['stem', 'stages.0.0', 'stages.1.0', 'stages.2.0', 'head']
"""

from kiln.models import small_cnn, small_resnet, torchvision_models, transformers
from kiln.models.checks import build, check_job
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
    list_models,
    natural_blocks,
    register_model,
)

__all__ = [
    "ArchitectureInfo",
    "IncompatibleInputShape",
    "Modality",
    "Task",
    "UnknownArchitecture",
    "build",
    "check_job",
    "declare_blocks",
    "example_input",
    "get_info",
    "get_model",
    "list_models",
    "natural_blocks",
    "register_model",
    "small_cnn",
    "small_resnet",
    "torchvision_models",
    "transformers",
]
