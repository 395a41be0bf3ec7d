"""The reference copy of a block extractor: CPU, eval mode, int8-quantized when close enough.

Egeria (Wang et al., EuroSys'23, section 4) quantizes its reference model. No processes or
messaging (`reference`), no quantization-aware training, no GPU. Shapes: b calibration batch.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import logging
import re
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from kiln_trainer.freezing import partition, plasticity

_log = logging.getLogger(__name__)

#: `quantize` falls back when the int8 copy's SP loss against the fp32 copy on the calibration
#: batch exceeds this share of SP's bound 4/b: such a noise floor would hide real drift.
MAX_NOISE_FLOOR_FRACTION = 0.1

_DYNAMIC_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.LSTM, nn.GRU)
_CONV_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class Kind(enum.StrEnum):
    """How the reference copy was made."""

    INT8_STATIC = "int8-static"  # FX post-training static quantization, calibrated
    INT8_DYNAMIC = "int8-dynamic"  # int8 weights, activations quantized on the fly
    FP32 = "fp32"  # a plain float copy


#: Modes `quantize_with_floor` takes: "auto", "fp32", or a kind `choose` picked before.
MODES = frozenset({"auto", *(kind.value for kind in Kind)})


# torch 2.14 still ships torch.ao.quantization and it works, but warns on every call that it
# moves to torchao; the observers and quantized tensors add "will be deprecated" notes. These
# known notes are logged once per process (the plan to move is in docs/concepts/freezing.md);
# every other warning raised inside `torch_ao_warnings` reaches the caller's filters unchanged.
KNOWN_DEPRECATIONS = (re.compile(r"torch\.ao\.quantization is deprecated"),
                      re.compile(r"reduce_range will be deprecated"),
                      re.compile(r"torch\.quantize_per_tensor.*deprecated", re.DOTALL))
_logged: set[str] = set()
_shown: dict[Any, Any] = {}  # warnings' registry: a "default" filter shows each place once


@contextlib.contextmanager
def torch_ao_warnings() -> Iterator[None]:
    """Run torch.ao quantization code: its known deprecation notes (`KNOWN_DEPRECATIONS`) are
    logged once per process instead of warned at every call; other warnings pass through."""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:  # out of the block: under the caller's filters again, failed attempts included
        _pass_on(caught)


def _pass_on(caught: list[warnings.WarningMessage]) -> None:
    for note in caught:
        text = str(note.message)
        known = next((p.pattern for p in KNOWN_DEPRECATIONS if p.search(text)), None)
        if known is None:
            warnings.warn_explicit(note.message, note.category, note.filename, note.lineno,
                                   registry=_shown, source=note.source)
        elif known not in _logged:
            _logged.add(known)
            _log.info("torch.ao deprecation, seen once per process (Kiln's reference copy "
                      "still uses torch.ao; the move to torchao is planned): %s",
                      text.splitlines()[0])


def outputs(module: nn.Module, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """`module(inputs)` without autograd, as a dict (a lone tensor under "output")."""
    with torch.inference_mode():
        out = module(inputs)
    return dict(out) if isinstance(out, Mapping) else {"output": out}


def quantize(
    model: nn.Module, calibration: torch.Tensor, *, mode: str = "auto"
) -> tuple[nn.Module, str]:
    """A CPU, eval-mode, gradient-free copy of an extractor, int8-quantized when possible.

    With mode "auto": a model with convolutions gets static post-training quantization (torch.ao
    FX graph mode: `prepare_fx` with the default x86/fbgemm qconfig mapping, one calibration
    forward, `convert_fx`); a model without convolutions, or whose static quantization fails,
    gets dynamic quantization of its Linear/LSTM/GRU layers (`quantize_dynamic`, qint8). A kind
    is kept only if it runs, keeps the outputs' blocks and shapes, and stays close to the fp32
    copy (SP loss per block <= `MAX_NOISE_FLOOR_FRACTION` * 4/b on the calibration batch);
    when none is kept, an fp32 copy is returned and the reason logged. `model` itself is not
    changed.

    Args:
        model: a module whose forward maps Tensor[b, ...] to dict[block, Tensor[b, ...]]
            (`partition.extractor`), or to one tensor.
        calibration: Tensor[b, ...] inputs (any device) for calibration and checks.
        mode: "auto" (int8 when possible) or "fp32" (always the float copy).

    Returns:
        (copy, kind) with kind one of `Kind`'s values: "int8-static", "int8-dynamic", "fp32".

    Raises:
        ValueError: `mode` is neither "auto" nor "fp32".
    """
    quantized, kind, _ = quantize_with_floor(model, calibration, mode=mode)
    return quantized, kind


def quantize_with_floor(
    model: nn.Module, calibration: torch.Tensor, *, mode: str
) -> tuple[nn.Module, Kind, dict[str, float]]:
    """`quantize`, also returning the noise floor: SP loss per block of the copy against fp32
    on the calibration batch ({} for an fp32 copy or b < 2).

    `mode` may also name a kind `choose` picked before ("int8-static", "int8-dynamic"): only
    that kind is tried, then fp32."""
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {sorted(MODES)} (got {mode!r})")
    base = _eval_copy(model)
    calibration = calibration.detach().cpu()
    if mode == Kind.FP32:
        return base, Kind.FP32, {}
    has_conv = any(isinstance(m, _CONV_TYPES) for m in base.modules())
    has_linear = any(isinstance(m, _DYNAMIC_TYPES) for m in base.modules())
    if not has_conv and not has_linear:
        _log.info("reference stays fp32: %s has no conv, linear or RNN layer",
                  type(model).__name__)
        return base, Kind.FP32, {}
    expected = outputs(base, calibration)
    attempts = [(Kind.INT8_STATIC, _static)] if has_conv else []
    attempts += [(Kind.INT8_DYNAMIC, _dynamic)] if has_linear else []
    attempts = [(kind, method) for kind, method in attempts if mode in ("auto", kind)]
    for kind, method in attempts:
        try:
            with torch_ao_warnings():
                candidate = method(_eval_copy(base), calibration)
                got = outputs(candidate, calibration)
            floor = _noise_floor(expected, got)
        except Exception as error:  # noqa: BLE001 - any failure means: try the next kind
            _log.info("reference: %s quantization failed (%s: %s); trying the next kind",
                      kind, type(error).__name__, error)
            continue
        worst = max(floor.values(), default=0.0)
        limit = MAX_NOISE_FLOOR_FRACTION * 4.0 / max(2, calibration.shape[0])
        if not worst <= limit:  # also catches NaN
            _log.info("reference: %s quantization too coarse (SP %.3g > %.3g vs fp32)",
                      kind, worst, limit)
            continue
        return candidate, kind, floor
    _log.info("reference stays fp32: no int8 quantization of %s worked", type(model).__name__)
    return base, Kind.FP32, {}


def choose(
    model: nn.Module, calibration: torch.Tensor
) -> tuple[nn.Module, Kind, dict[str, float], dict[str, float]]:
    """The cheaper reference kind for `model`, measured: `quantize_with_floor` in "auto" mode
    (int8 when close enough) against a plain fp32 copy, each timed as one refresh plus one
    forward on the calibration batch (CPU seconds, `time.process_time`).

    The int8 copy wins only when it is close enough (as in `quantize`) and cheaper: its
    re-quantization at every refresh often costs more than the fp32 forward it saves.

    Returns:
        (copy, kind, noise floor, {kind: CPU seconds} for each kind timed).
    """
    seconds: dict[str, float] = {}
    started = time.process_time()
    plain = _eval_copy(model)
    outputs(plain, calibration.detach().cpu())
    seconds[Kind.FP32] = time.process_time() - started
    started = time.process_time()
    candidate, kind, floor = quantize_with_floor(model, calibration, mode="auto")
    if kind != Kind.FP32:
        with torch_ao_warnings():
            outputs(candidate, calibration.detach().cpu())
        seconds[kind] = time.process_time() - started
    if kind != Kind.FP32 and seconds[kind] < seconds[Kind.FP32]:
        return candidate, kind, floor, seconds
    return plain, Kind.FP32, {}, seconds


def _noise_floor(
    expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """SP loss per block between two extractor outputs on the same inputs ({} when b < 2).

    Raises:
        ValueError: a block is missing, its shape changed, or its values are not finite.
    """
    for block, value in expected.items():
        other = got.get(block)
        if other is None or other.shape != value.shape or not torch.isfinite(other).all():
            raise ValueError(f"block {block}: output {tuple(value.shape)} became "
                             f"{None if other is None else tuple(other.shape)} or not finite")
    if any(value.shape[0] < 2 for value in expected.values()):
        return {}
    return {
        block: plasticity.sp_loss(partition.flatten(value), partition.flatten(got[block]))
        for block, value in expected.items()
    }


def _eval_copy(model: nn.Module) -> nn.Module:
    # deepcopy of a torch.fx GraphModule comes back in training mode: set eval after copying.
    # (Static quantization's conv-BN fusion requires eval mode.)
    copied = copy.deepcopy(model).cpu().eval()
    for parameter in copied.parameters():
        parameter.requires_grad_(False)
    return copied


def _backend() -> str:
    """The qconfig backend matching the quantized engine that will run the copy (x86 first)."""
    engines = [torch.backends.quantized.engine, *torch.backends.quantized.supported_engines]
    return next((e for e in engines if e in ("x86", "fbgemm", "qnnpack")), "x86")


def _static(model: nn.Module, calibration: torch.Tensor) -> nn.Module:
    from torch.ao.quantization import get_default_qconfig_mapping, quantize_fx

    mapping = get_default_qconfig_mapping(_backend())
    prepared = quantize_fx.prepare_fx(model, mapping, (calibration,))
    outputs(prepared, calibration)  # calibration: the observers record value ranges
    converted: nn.Module = quantize_fx.convert_fx(prepared)
    return converted.eval()


def _dynamic(model: nn.Module, calibration: torch.Tensor) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    del calibration  # dynamic quantization measures activations on the fly
    quantized: nn.Module = quantize_dynamic(  # type: ignore[no-untyped-call]
        model, set(_DYNAMIC_TYPES), dtype=torch.qint8, inplace=True
    )
    return quantized.eval()
