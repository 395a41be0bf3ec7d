"""Pretrained weights into the zoo: local weights become a record that jobs warm-start from.

`import_weights` builds the model (an entrypoint runs user code: only `kiln zoo import`, on the
user's machine, calls it; never the operator), loads the weights strictly, extracts the graph
and writes the record through `records.write_record` (meta.json last: never half a model).
"""

from __future__ import annotations

import datetime
import math
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
import torch
from torch import Tensor, nn

import kiln
from kiln import api, models
from kiln.warmstart import graph
from kiln.zoo import records, store

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# Keys listed in a key-mismatch message before "and N more".
SHOWN_KEYS = 8


class WeightsError(ValueError):
    """Weights that cannot be registered: the message names the path (or option) and why."""


def parse_metric(text: str) -> tuple[str, float]:
    """``validation_accuracy=0.91`` -> ("validation_accuracy", 0.91).

    Raises:
        WeightsError: no ``=``, an unknown metric, a value that is not a finite number, an
            accuracy outside [0, 1] or a negative loss.
    """
    name, equals, value = text.partition("=")
    known = [str(m) for m in api.TargetMetric]
    if not equals:
        raise WeightsError(f"--metric {text!r}: expected NAME=VALUE, e.g. "
                           "validation_accuracy=0.91 or validation_loss=2.1")
    if name.strip() not in known:
        raise WeightsError(f"--metric {text!r}: unknown metric {name.strip()!r} "
                           f"(allowed: {', '.join(known)})")
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise WeightsError(f"--metric {text!r}: {value.strip()!r} is not a finite number")
    problem = api.metric_problem(name.strip(), number)
    if problem:
        raise WeightsError(f"--metric {text!r}: {problem}")
    return name.strip(), number


def read_weights(path: Path) -> dict[str, Tensor]:
    """A state dict from a safetensors file, a Hugging Face directory or a torch state dict.

    Torch files (.pt, .pth, .bin) are read with ``torch.load(weights_only=True)``: tensors and
    plain containers only, never arbitrary pickled objects.

    Raises:
        WeightsError: the path is missing; a directory without config.json and
            model.safetensors; a file in none of the formats, or damaged; a torch file that
            holds something other than a mapping of names to tensors.
    """
    if not path.exists():
        raise WeightsError(f"{path}: no such file or directory")
    if path.is_dir():
        missing = [n for n in (HF_CONFIG, HF_WEIGHTS) if not (path / n).is_file()]
        if missing:
            raise WeightsError(f"{path}: a Hugging Face-format directory needs {HF_CONFIG} and "
                               f"{HF_WEIGHTS}; {' and '.join(missing)} missing (save with "
                               "save_pretrained(..., safe_serialization=True))")
        return _safetensors(path / HF_WEIGHTS)
    if path.suffix == ".safetensors":
        return _safetensors(path)
    if path.suffix in TORCH_SUFFIXES or zipfile.is_zipfile(path):
        return _torch_state(path)
    raise WeightsError(f"{path}: not a format Kiln imports; give a .safetensors file, a torch "
                       f"state dict ({', '.join(TORCH_SUFFIXES)}) or a Hugging Face directory "
                       f"({HF_CONFIG} + {HF_WEIGHTS})")


def load_strict(model: nn.Module, state: Mapping[str, Tensor], where: str, *,
                advice: str | None = None) -> None:
    """Load `state` into `model`, every key and shape matching (keys may differ by one prefix).

    A wrapper's prefix (the model names ``model.transformer.h.0...``, the file
    ``transformer.h.0...``) is added or removed when that makes every key match. A key the file
    lacks is accepted only when it is tied to one it has (a head sharing the embedding).
    `advice` ends a mismatch's message (default: check the model flags).

    Raises:
        WeightsError: missing or unexpected keys (listed), shapes that differ (listed), or
            tensors holding NaN or infinite values (listed).
    """
    own = model.state_dict()
    state = _aligned_keys(dict(state), set(own))
    tied = _tied_names(model)
    missing = sorted(k for k in own if k not in state and not (tied.get(k, set()) & set(state)))
    unexpected = sorted(k for k in state if k not in own)
    if missing or unexpected:
        parts = [f"{len(missing)} missing ({_some(missing)})" if missing else "",
                 f"{len(unexpected)} unexpected ({_some(unexpected)})" if unexpected else ""]
        raise WeightsError(f"{where}: the weights do not fit the model: keys "
                           f"{'; '.join(p for p in parts if p)}; "
                           + (advice or "check --entrypoint/--architecture and --args against "
                              "the model the weights were saved from"))
    shapes = [f"{k}: file {list(state[k].shape)}, model {list(own[k].shape)}"
              for k in own if k in state and state[k].shape != own[k].shape]
    if shapes:
        raise WeightsError(f"{where}: {len(shapes)} tensors have other shapes than the model's "
                           f"({_some(shapes)}); {advice or 'check --args'}")
    # NaN weights would train to a NaN loss, whose message blames the learning rate
    broken = [k for k, v in state.items()
              if v.is_floating_point() and v.device.type != "meta" and not torch.isfinite(v).all()]
    if broken:
        raise WeightsError(f"{where}: {len(broken)} tensors hold NaN or infinite values "
                           f"({_some(broken)}); the weights are damaged or diverged: give "
                           "weights saved before that")
    for name, tensor in own.items():
        source = state.get(name)
        if source is None:  # tied to a loaded key
            source = next(state[k] for k in tied[name] if k in state)
        with torch.no_grad():
            tensor.copy_(source.to(tensor.dtype))


def import_weights(
    zoo: store.ObjectStore,
    path: Path,
    spec: api.ModelSpec,
    *,
    metric: tuple[str, float],
    source: str | None = None,
    license_text: str | None = None,
    dataset: str = "imported",
    namespace: str = records.LEGACY_NAMESPACE,
    share: api.ZooShare = api.ZooShare.PRIVATE,
    now: datetime.datetime | None = None,
) -> records.ZooRecord:
    """Register the weights at `path` as a zoo record of the model `spec` describes.

    Args:
        zoo: the model zoo.
        path: a .safetensors file, a Hugging Face directory or a torch state dict.
        spec: the model: architecture or entrypoint, args, input shape, task.
        metric: (name, value) the weights were evaluated at (`parse_metric`).
        source: where the weights came from (default: the absolute path).
        license_text: their license, free text.
        dataset: what they were trained on (informational).
        namespace: the namespace the record belongs to.
        share: private (jobs of `namespace` see it) or shared (every namespace).
        now: the registration time (default: now, UTC).

    Returns:
        The record as written.

    Raises:
        WeightsError: unreadable weights, or weights that do not fit the model.
        models.EntrypointError: the entrypoint cannot be imported or called.
        graph.GraphError: no tracer can trace the model (it could never be a parent).
        ValueError: the model cannot be built from `spec` (unknown architecture, bad args).
        store.StoreUnavailable: the zoo could not be written.
    """
    state = read_weights(path)
    torch.manual_seed(0)
    model = models.build(spec)
    load_strict(model, state, str(path))
    g = graph.extract(model, spec.input_shape, name=spec.label)
    name, value = metric
    accuracy = value if name == api.TargetMetric.VALIDATION_ACCURACY else None
    loss = value if name == api.TargetMetric.VALIDATION_LOSS else None
    when = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    record = records.ZooRecord(
        id=records.new_id(spec.label), architecture=spec.architecture,
        entrypoint=spec.entrypoint, args=dict(spec.args), input_shape=tuple(spec.input_shape),
        modality=str(models.modality_of(spec)), task=str(models.task_of(spec)),
        dataset=dataset, metric_name=name, metric_value=value, validation_accuracy=accuracy,
        validation_loss=loss, num_params=sum(p.numel() for p in model.parameters()),
        created_time=when, job_name="",
        job_spec={"spec": {"model": api.to_wire(spec)}},
        source=source or str(path.resolve()), license=license_text, namespace=namespace,
        share=share, kiln_version=kiln.__version__)
    return records.write_record(zoo, record, model.state_dict(), graph.to_json(g))


def check_export(record: records.ZooRecord, state: Mapping[str, Tensor], folder: Path) -> None:
    """Refuse an exported record (`kiln zoo import EXPORT_DIR`) whose weights do not fit the
    model its meta.json describes, as `import_weights` refuses weights that do not fit, or
    whose metrics `api.metric_problem` refuses (as --metric would).

    A built-in architecture is built from the record's architecture, args and input_shape on
    the meta device (no memory for the weights), every key and shape is compared
    (`load_strict`'s rules) and the model is traced at input_shape. An entrypoint record is
    not built: that would run the export's user code (a job that loads it checks it then).

    Raises:
        WeightsError: naming meta.json's field or weights.safetensors and what differs.
    """
    meta, weights = folder / records.META_NAME, folder / records.WEIGHTS_NAME
    for name, value in ((record.metric_name, record.metric_value),
                        (api.TargetMetric.VALIDATION_ACCURACY, record.validation_accuracy),
                        (api.TargetMetric.VALIDATION_LOSS, record.validation_loss)):
        problem = api.metric_problem(name, value) if value is not None else None
        if problem:
            raise WeightsError(f"{meta}: {name}: {problem}; the export was edited or damaged: "
                               "export it again")
    if record.architecture is None:
        return
    where = (f"{meta}: architecture {record.architecture!r}, args {record.args}, input_shape "
             f"{list(record.input_shape)}")
    try:
        spec = api.ModelSpec.model_validate({
            "architecture": record.architecture, "args": record.args,
            "inputShape": list(record.input_shape),
            "task": models.wire_task(record.task)})
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise WeightsError(f"{meta}: {problems.replace('inputShape', 'input_shape')}; the "
                           "export was edited or damaged: export it again") from None
    try:
        with torch.device("meta"):
            model = models.build(spec)
    except (TypeError, ValueError) as exc:
        raise WeightsError(f"{where}: no model can be built ({_first_line(exc)}); the export "
                           "was edited or damaged: export it again") from None
    load_strict(model, state, f"{weights} in the model of {where}",  # meta: nothing copied
                advice="the export was edited or damaged: export it again")
    try:
        graph.extract(model, spec.input_shape, name=spec.label)
    except graph.GraphError as exc:
        raise WeightsError(f"{meta}: input_shape {list(record.input_shape)} does not fit the "
                           f"model ({_first_line(exc)}); export it again") from None


def _safetensors(path: Path) -> dict[str, Tensor]:
    import safetensors
    import safetensors.torch

    try:
        return safetensors.torch.load_file(str(path))
    except (safetensors.SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise WeightsError(f"{path}: not a readable safetensors file ({exc})") from None


def _torch_state(path: Path) -> dict[str, Tensor]:
    try:
        loaded: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001  # UnpicklingError, RuntimeError, EOFError, ...
        raise WeightsError(f"{path}: not a torch state dict that loads with weights_only=True "
                           f"({type(exc).__name__}: {_first_line(exc)})") from None
    if not isinstance(loaded, Mapping) or not loaded:
        raise WeightsError(f"{path}: holds a {type(loaded).__name__}, not a state dict (a "
                           "mapping of names to tensors); save model.state_dict()")
    bad = [str(k) for k, v in loaded.items() if not isinstance(k, str)
           or not isinstance(v, Tensor)]
    if bad:
        raise WeightsError(f"{path}: not a state dict: {len(bad)} entries are not name -> tensor "
                           f"({_some(bad)}); save model.state_dict()")
    return dict(loaded)


def _aligned_keys(state: dict[str, Tensor], own: set[str]) -> dict[str, Tensor]:
    """`state` with one prefix added to or removed from every key, if that matches `own`."""
    if set(state) <= own or not state:
        return state
    sample = next(iter(state))
    for key in own:  # the model wraps the saved module: add its attribute name
        if key.endswith("." + sample):
            prefix = key[: -len(sample)]
            added = {prefix + k: v for k, v in state.items()}
            if set(added) <= own:
                return added
    for key in own:  # the file was saved from a wrapper: drop its attribute name
        if sample.endswith("." + key):
            prefix = sample[: -len(key)]
            if all(k.startswith(prefix) for k in state):
                removed = {k[len(prefix):]: v for k, v in state.items()}
                if set(removed) <= own:
                    return removed
    return state


def _tied_names(model: nn.Module) -> dict[str, set[str]]:
    """Each parameter name -> the other names of the same tensor (tied weights)."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return {n: set(names) - {n} for names in by_tensor.values() for n in names}


def _some(items: list[str]) -> str:
    more = len(items) - SHOWN_KEYS
    return ", ".join(items[:SHOWN_KEYS]) + (f", and {more} more" if more > 0 else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
