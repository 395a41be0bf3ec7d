"""The architecture registry: names -> keyword-only builders, with metadata and natural blocks.

Each family module registers its builders here at import time, declaring beside each builder
its input modality, task and natural blocks. No I/O, no weights, no device placement (build
under `with torch.device(...)`), no knowledge of jobs or datasets (that is `checks`).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib.metadata
import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

Builder = Callable[..., nn.Module]
BuilderT = TypeVar("BuilderT", bound=Builder)
ModuleT = TypeVar("ModuleT", bound=nn.Module)
BlocksFn = Callable[[Any], list[str]]


class Modality(enum.StrEnum):
    """What one input sample is."""

    IMAGE = "image"  # Tensor[C, H, W] float
    TEXT = "text"  # LongTensor[T] of byte values


class Task(enum.StrEnum):
    """What the model's output means."""

    CLASSIFICATION = "classification"  # logits Tensor[B, K]
    LANGUAGE_MODELING = "language_modeling"  # next-token logits Tensor[B, T, V]


@dataclasses.dataclass(frozen=True)
class ArchitectureInfo:
    """Metadata of one registered architecture.

    Attributes:
        name: registry name, e.g. "resnet18".
        family: builder family, e.g. "resnet", "small_resnet", "vit".
        modality: input modality (image or text).
        task: classification or language_modeling.
        default_args: the builder's keyword arguments and their defaults (read-only).
        paper: the paper the architecture comes from.
        summary: first line of the builder's docstring.
    """

    name: str
    family: str
    modality: Modality
    task: Task
    default_args: Mapping[str, Any] = dataclasses.field(hash=False, compare=False)
    paper: str = ""
    summary: str = ""


class UnknownArchitecture(ValueError):
    """An architecture name that is not registered; the message lists the closest names."""

    def __init__(self, name: str, *, closest: list[str], known_count: int,
                 why: str = "") -> None:
        self.name = name
        self.closest = closest
        hint = f"closest: {', '.join(closest)}" if closest else "no registered name is close"
        hint = why or hint
        super().__init__(
            f"unknown architecture {name!r}; {hint} (list_models() / `kiln models` lists all "
            f"{known_count})"
        )


class IncompatibleInputShape(ValueError):
    """A builder cannot take the given input shape (wrong rank, channels or divisibility)."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    info: ArchitectureInfo
    builder: Builder


_REGISTRY: dict[str, _Entry] = {}
_BLOCKS: dict[str, BlocksFn] = {}  # by the class's dotted name (`_class_name`)

# Third parties add names through this entry-point group: each entry point is a builder
# (keyword-only, taking input_shape) registered under the entry point's name, unless its module
# registered that name itself with `register_model` (which also declares modality and task).
ENTRY_POINT_GROUP = "kiln.models"
_PLUGINS_LOADED: list[bool] = []
_PLUGIN_ERRORS: dict[str, str] = {}  # entry point name -> why it could not be registered


def load_entry_points(
    found: Sequence[importlib.metadata.EntryPoint] | None = None,
) -> list[str]:
    """Register the builders of the `ENTRY_POINT_GROUP` entry points of installed distributions.

    Runs once by itself (on the first lookup or listing). A builder that cannot be loaded or
    registered is remembered, and looking its name up says why.

    Args:
        found: the entry points to register (default: the installed ones of the group).

    Returns:
        The names registered now.
    """
    _PLUGINS_LOADED.append(True)
    if found is None:
        found = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    added = []
    for point in found:
        if point.name in _REGISTRY:
            continue
        try:
            builder = point.load()
            if point.name not in _REGISTRY:  # its module did not register it itself
                register_model(point.name, family=point.name, modality=Modality.IMAGE,
                               task=Task.CLASSIFICATION)(builder)
        except Exception as exc:  # noqa: BLE001  # any error in a third-party package
            _PLUGIN_ERRORS[point.name] = (f"the {ENTRY_POINT_GROUP} entry point {point.name} = "
                                          f"{point.value} failed to load "
                                          f"({type(exc).__name__}: {exc})")
            continue
        added.append(point.name)
    return added


def register_model(
    name: str, *, family: str, modality: Modality, task: Task, paper: str = ""
) -> Callable[[BuilderT], BuilderT]:
    """Register a keyword-only builder under `name` (decorator; returns the builder unchanged).

    Args:
        name: registry name; unique.
        family: family name shared by related builders (e.g. "resnet").
        modality: input modality of the built model.
        task: what the model's output means.
        paper: citation of the paper the architecture comes from.

    Returns:
        A decorator for `builder(*, input_shape: tuple[int, ...], **args) -> nn.Module`.

    Raises:
        ValueError: `name` is already registered.
        TypeError: the builder has positional parameters or lacks a keyword `input_shape`.
    """

    def decorate(builder: BuilderT) -> BuilderT:
        if name in _REGISTRY:
            raise ValueError(f"architecture {name!r} is already registered")
        params = inspect.signature(builder).parameters
        positional = [p.name for p in params.values() if p.kind != p.KEYWORD_ONLY]
        if positional or "input_shape" not in params:
            raise TypeError(
                f"builder of {name!r} must take keyword-only arguments including input_shape "
                f"(positional: {positional})"
            )
        defaults = {
            p.name: p.default
            for p in params.values()
            if p.name != "input_shape" and p.default is not p.empty
        }
        doc = inspect.getdoc(builder) or ""
        info = ArchitectureInfo(
            name=name,
            family=family,
            modality=modality,
            task=task,
            default_args=types.MappingProxyType(defaults),
            paper=paper,
            summary=doc.splitlines()[0] if doc else "",
        )
        _REGISTRY[name] = _Entry(info=info, builder=builder)
        return builder

    return decorate


def list_models() -> list[str]:
    """Every registered architecture name (built in, and from entry points), sorted."""
    if not _PLUGINS_LOADED:
        load_entry_points()
    return sorted(_REGISTRY)


def get_info(name: str) -> ArchitectureInfo:
    """Metadata of a registered architecture.

    Raises:
        UnknownArchitecture: `name` is not registered (message lists the closest names).
    """
    return _entry(name).info


def get_model(name: str, *, input_shape: tuple[int, ...] | list[int], **args: Any) -> nn.Module:
    """Build a freshly initialised model (no pretrained weights, ever).

    Initialisation draws from torch's global RNG: seed it (`torch.manual_seed`) for a
    deterministic model. The model is built on the current default device; use
    `with torch.device("meta"):` to build without allocating memory.

    Args:
        name: registered architecture name.
        input_shape: one sample's shape without the batch: (C, H, W) for images, (T,) for text.
        **args: the builder's keyword arguments (see `get_info(name).default_args`).

    Returns:
        The model: images Tensor[B, C, H, W] -> logits Tensor[B, K]; text LongTensor[B, T] ->
        logits Tensor[B, T, V].

    Raises:
        UnknownArchitecture: `name` is not registered.
        TypeError: an argument name is unknown (with the closest known names), or a value has
            the wrong type.
        ValueError: an argument value is out of range.
        IncompatibleInputShape: the architecture cannot take `input_shape`.
    """
    entry = _entry(name)
    problems = unknown_args(name, args)
    if problems:
        raise TypeError(f"{name}: " + "; ".join(f"{key}: {why}" for key, why in problems))
    shape = tuple(int(size) for size in input_shape)
    return entry.builder(input_shape=shape, **args)


def unknown_args(name: str, args: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Argument names the builder of `name` does not take, each with a did-you-mean.

    Returns:
        (argument name, explanation) pairs; [] when every name is known.

    Raises:
        UnknownArchitecture: `name` is not registered.
    """
    known = list(get_info(name).default_args)
    problems = []
    for key in args:
        if key in known:
            continue
        if key == "input_shape":
            problems.append((key, "set it as spec.model.inputShape, not as an argument"))
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append((key, f"unknown argument of {name}{hint} (known: {', '.join(known)})"))
    return problems


def example_input(
    name: str,
    input_shape: tuple[int, ...] | list[int],
    *,
    batch_size: int = 1,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A zero input batch of the right dtype for `name`: Tensor[B, C, H, W] or LongTensor[B, T].

    Useful for tracing and shape checks (e.g. on the `meta` device).

    Raises:
        UnknownArchitecture: `name` is not registered.
    """
    shape = (batch_size, *(int(size) for size in input_shape))
    if get_info(name).modality == Modality.TEXT:
        return torch.zeros(shape, dtype=torch.long, device=device)
    return torch.zeros(shape, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------------------------
# natural blocks (Egeria's freezing units)


def declare_blocks(
    model_type: type[ModuleT] | str,
) -> Callable[[Callable[[ModuleT], list[str]]], Callable[[ModuleT], list[str]]]:
    """Declare how to list the natural blocks of every instance of `model_type` (decorator).

    `model_type` is the class or its dotted name ("torchvision.models.resnet.ResNet"): by name,
    a family declares classes of a library it imports only when it builds a model.
    The decorated function gets the model and returns dotted submodule names in forward order:
    stem, blocks or stages or transformer layers, head last. Together the blocks must own every
    parameter of the model exactly once (the tests check this for every registered model).
    """
    name = model_type if isinstance(model_type, str) else _class_name(model_type)

    def decorate(blocks_fn: Callable[[ModuleT], list[str]]) -> Callable[[ModuleT], list[str]]:
        _BLOCKS[name] = blocks_fn
        return blocks_fn

    return decorate


def natural_blocks(model: nn.Module) -> list[str]:
    """The ordered natural blocks of a model, for freezing a front prefix (Egeria).

    Names are dotted submodule names (`model.get_submodule(name)` works): stem first, then
    residual blocks / stages / transformer layers in forward order, the head last. Models of a
    registered family use the family's declaration (looked up along the class hierarchy);
    any other model falls back to `layer_stack_blocks`.

    Args:
        model: the unwrapped model (not a DDP/FSDP wrapper).

    Returns:
        Block names; never empty for a model with parameters.
    """
    for cls in type(model).__mro__:
        blocks_fn = _BLOCKS.get(_class_name(cls))
        if blocks_fn is not None:
            return blocks_fn(model)
    return layer_stack_blocks(model)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def layer_stack_blocks(model: nn.Module) -> list[str]:
    """Natural blocks of an undeclared model: its layer stack, split into layers.

    The stack is `layer_stack`'s (a Hugging Face GPT-2's ``transformer.h``, BERT's
    ``bert.encoder.layer``). What owns parameters beside the path to it comes first when
    defined before it (embeddings) and last when defined after it (final norm, head, innermost
    first). Without a stack: the direct children that own parameters, in definition order.
    """
    path = layer_stack(model)
    if path is None:
        return children_with_parameters(model)
    before: list[str] = []
    after: list[list[str]] = []
    module, prefix = model, ""
    for part in path.split("."):
        owners = children_with_parameters(module, prefix)
        names = [name for name, _ in module.named_children()]
        seen_path = False
        level_after: list[str] = []
        for name in names:
            if name == part:
                seen_path = True
            elif f"{prefix}{name}" in owners:
                (level_after if seen_path else before).append(f"{prefix}{name}")
        after.append(level_after)
        module, prefix = module.get_submodule(part), f"{prefix}{part}."
    layers = children_with_parameters(module, prefix)
    return before + layers + [name for level in reversed(after) for name in level]


def layer_stack(model: nn.Module) -> str | None:
    """The dotted name of `model`'s layer stack, or None: the shallowest `nn.ModuleList` with at
    least two children that own parameters, one whose children all share a class (repeated
    layers: ``model.layers``, ``encoder.layer``, ``transformer.h``, ``decoder.layers``) before
    one that mixes classes; the first in definition order among equals."""
    stacks = []
    for order, (name, module) in enumerate(model.named_modules()):
        owners = children_with_parameters(module) if isinstance(module, nn.ModuleList) else []
        if name and len(owners) >= 2:
            mixed = len({type(module.get_submodule(child)) for child in owners}) > 1
            stacks.append((mixed, name.count("."), order, name))
    return min(stacks)[3] if stacks else None


def children_with_parameters(module: nn.Module, prefix: str = "") -> list[str]:
    """Dotted names of `module`'s direct children that own at least one parameter, in order."""
    return [
        f"{prefix}{name}"
        for name, child in module.named_children()
        if next(child.parameters(), None) is not None
    ]


# ----------------------------------------------------------------------------------------------
# helpers for builders: argument and input-shape checks with messages that name the argument


def require_int(name: str, value: Any, *, minimum: int) -> int:
    """`value` as an int >= `minimum`.

    Raises:
        TypeError: not an int (bools are rejected).
        ValueError: below `minimum`.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer (got {value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} (got {value})")
    return value


def require_float(name: str, value: Any, *, minimum_exclusive: float) -> float:
    """`value` (int or float) as a float > `minimum_exclusive`.

    Raises:
        TypeError: not a number.
        ValueError: not above `minimum_exclusive`.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number (got {value!r})")
    if not value > minimum_exclusive:
        raise ValueError(f"{name} must be > {minimum_exclusive} (got {value})")
    return float(value)


def image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Split an image input shape into (C, H, W).

    Raises:
        IncompatibleInputShape: not three positive sizes.
    """
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise IncompatibleInputShape(
            f"an image model takes input shape [C, H, W], e.g. [3, 32, 32] (got "
            f"{list(input_shape)})"
        )
    channels, height, width = input_shape
    return channels, height, width


def sequence_length(input_shape: tuple[int, ...]) -> int:
    """The T of a text input shape (T,).

    Raises:
        IncompatibleInputShape: not one positive size.
    """
    if len(input_shape) != 1 or input_shape[0] < 1:
        raise IncompatibleInputShape(
            f"a text model takes input shape [sequenceLength], e.g. [64] (got {list(input_shape)})"
        )
    return input_shape[0]


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY and not _PLUGINS_LOADED:
        load_entry_points()
    entry = _REGISTRY.get(name)
    if entry is None and name in _PLUGIN_ERRORS:
        raise UnknownArchitecture(name, closest=[], known_count=len(_REGISTRY),
                                  why=_PLUGIN_ERRORS[name])
    if entry is None:
        names = list(_REGISTRY)
        closest = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        if not closest:  # e.g. "ResNet-18": compare case- and punctuation-insensitively
            folded = {n.replace("_", ""): n for n in names}
            key = name.lower().replace("-", "").replace("_", "")
            closest = [folded[n] for n in difflib.get_close_matches(key, list(folded), n=3)]
        raise UnknownArchitecture(name, closest=closest, known_count=len(names))
    return entry
