"""LoRA adapters through the peft library: attach them to a job's model, take out and load
the adapter's own tensors, and merge an adapter into its base.

peft is imported only here and only when a job asks for it (`pip install kiln-operator[peft]`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kiln import api

ADAPTER_NAME = "default"  # peft's name of a model's only adapter
FIELD = "spec.training.peft.targetModules"
_KINDS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)  # what `adaptable` lists


class PeftMissing(ImportError):
    """The peft library is not installed."""


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise PeftMissing("spec.training.peft: LoRA needs the peft library; install it with "
                          "`pip install 'kiln-operator[peft]'`") from None
    return peft


def attach(model: nn.Module, spec: api.PeftSpec) -> nn.Module:
    """Wrap `spec.targetModules` of `model` with LoRA adapters, in place, and freeze the rest.

    The adapters start as the identity (B = 0), so the model computes what it did before.
    Returns `model` itself (its state dict now names ``<module>.base_layer.*`` and the
    adapters' ``lora_A``/``lora_B``).

    Raises:
        ValueError: a target module matches nothing or is no Linear, Conv or Embedding; the
            message names spec.training.peft.targetModules and the modules that would fit.
            Or the rank is above what a wrapped module's weight can use (naming
            spec.training.peft.rank and the module).
        PeftMissing: peft is not installed.
    """
    peft = _peft()
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                             target_modules=list(spec.target_modules))
    try:
        peft.tuners.lora.LoraModel(model, config, ADAPTER_NAME)
    except ValueError as exc:
        why = str(exc).splitlines()[0]
        if "is not supported" in str(exc):  # peft's first line ends inside the module's repr
            named = [f"{name} ({type(module).__name__})" for name, module in model.named_modules()
                     if _matches(name, spec.target_modules)
                     and not isinstance(module, (peft.tuners.lora.LoraLayer, *_KINDS))]
            why = f"LoRA cannot wrap {_some(named)}" if named else why
        raise ValueError(f"{FIELD}: {why} (got {spec.target_modules}); "
                         f"name modules that LoRA can wrap: {_some(adaptable(model))}") from None
    _check_rank(model, spec.rank, peft.tuners.lora.LoraLayer)
    return model


def _matches(name: str, targets: list[str]) -> bool:
    """Whether peft's target list names module `name`: in full, or as its end after a dot."""
    return any(name == t or name.endswith("." + t) for t in targets)


def _check_rank(model: nn.Module, rank: int, layer: type[Any]) -> None:
    """Refuse a rank above what a wrapped module's weight can use: the update B A of a
    d_out x d_in weight has rank at most min(d_out, d_in), so more only adds parameters."""
    limits = {}
    for name, module in model.named_modules():
        weight = getattr(module.get_base_layer(), "weight", None) if isinstance(
            module, layer) else None
        if isinstance(weight, torch.Tensor) and weight.dim() >= 2:
            limits[name] = min(weight.shape[0], math.prod(weight.shape[1:]))
    over = {name: most for name, most in limits.items() if most < rank}
    if over:
        raise ValueError(
            f"spec.training.peft.rank: {rank} is more than "
            f"{_some([f'{name} (at most {most})' for name, most in over.items()])} can use, "
            "since an update of a d_out x d_in weight has rank at most min(d_out, d_in); set "
            f"rank to {min(over.values())} or less, or target larger modules")


def adaptable(model: nn.Module) -> list[str]:
    """Names of the modules of `model` that LoRA can wrap (Linear, Conv, Embedding)."""
    return [name for name, module in model.named_modules() if name and isinstance(module, _KINDS)]


def adapter_state(model: nn.Module,
                  state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """What a LoRA job stores: the adapters' tensors (peft's names, without the adapter name)
    and the model's buffers (e.g. batch-norm statistics, which training moves too).

    Args:
        model: a model `attach` wrapped.
        state: its full state dict (e.g. gathered across ranks); default ``model.state_dict()``.
    """
    peft = _peft()
    state = model.state_dict() if state is None else state
    adapters = peft.get_peft_model_state_dict(model, state_dict=dict(state),
                                              adapter_name=ADAPTER_NAME)
    buffers = {name: state[name] for name, _ in model.named_buffers() if name in state}
    return {**adapters, **buffers}


def load_adapter(model: nn.Module, adapter: Mapping[str, torch.Tensor]) -> None:
    """Load what `adapter_state` took into a model `attach` wrapped the same way.

    Raises:
        ValueError: the adapter does not fit (other target modules or rank): what differs.
    """
    peft = _peft()
    own = adapter_state(model)
    missing, unknown = sorted(set(own) - set(adapter)), sorted(set(adapter) - set(own))
    wrong = [k for k in own if k in adapter and own[k].shape != adapter[k].shape]
    if missing or unknown or wrong:
        raise ValueError(
            "the adapter does not fit this model's LoRA (spec.training.peft: rank, "
            f"targetModules): missing {_some(missing)}, unexpected {_some(unknown)}, other "
            f"shapes {_some(wrong)}")
    buffers = {name for name, _ in model.named_buffers()}
    peft.set_peft_model_state_dict(
        model, {k: v for k, v in adapter.items() if k not in buffers}, adapter_name=ADAPTER_NAME)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in adapter:
                buffer.copy_(adapter[name])


def merged(model: nn.Module, base: Mapping[str, torch.Tensor],
           adapter: Mapping[str, torch.Tensor], spec: api.PeftSpec) -> dict[str, torch.Tensor]:
    """The full state dict of `base` with `adapter` merged in (W + (alpha / r) B A), as the
    plain model's names: what a model without peft loads.

    Args:
        model: a freshly built model of the base's architecture (changed in place).
        base: the base record's weights.
        adapter: the adapter record's weights (`adapter_state`).
        spec: the adapter's settings.

    Raises:
        RuntimeError: `base` does not fit `model`.
        ValueError: `adapter` does not fit (`load_adapter`, `attach`).
    """
    model.load_state_dict(base)
    attach(model, spec)
    load_adapter(model, adapter)
    peft = _peft()
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge(adapter_names=[ADAPTER_NAME])
    plain = _unwrapped(model, peft.tuners.lora.LoraLayer)
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}


def _unwrapped(model: nn.Module, layer: type[Any]) -> nn.Module:
    """`model` with each (merged) LoRA layer replaced by the module it wraps."""
    for name, module in list(model.named_modules()):
        if name and isinstance(module, layer):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    return model


def _some(items: list[str]) -> str:
    if not items:
        return "none"
    return ", ".join(items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8 else "")
