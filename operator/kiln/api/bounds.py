"""How deep and how large a job document may be, checked without recursion.

`problems` runs before anything recursive reads a document (the YAML composer, the JSON
encoder, pydantic), so any document that can be stored or written is refused by name.
"""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel

from kiln.api import status

# Mappings and lists nested in a job, counted from the document's top (the document is level
# 1, spec 2, spec.model 3). A pod template reaches about 15; pydantic's JSON parser stops at
# 200 and the YAML composer recurses, so 100 leaves room both ways.
MAX_DEPTH = 100
# The spec as compact JSON. The trainer pod carries it in one environment variable, which
# Linux caps at 128 KiB (MAX_ARG_STRLEN); this leaves room for the defaults and metadata.
MAX_SPEC_BYTES = 100 * 1024
# The API server refuses JSON nested deeper than this, so no stored object is deeper.
API_SERVER_MAX_DEPTH = 10_000

Path = tuple[str | int, ...]


def nesting_depth(value: Any) -> int:
    """How many mappings and lists nest in `value` at its deepest (a scalar: 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (node.values() if isinstance(node, dict)
                                                   else node))
    return deepest


def problems(doc: Any) -> list[str]:
    """The document's fields nested deeper than MAX_DEPTH, else a spec above MAX_SPEC_BYTES.

    Each problem names the schema field it is in (``spec.model.args``: free-form content is
    named by the field holding it) and the fix. Recurses only into a document known to be at
    most MAX_DEPTH deep, so any depth is safe.
    """
    if _deeper_than(doc, MAX_DEPTH):
        found: dict[str, str] = {}
        stack: list[tuple[Any, Path]] = [(doc, ())]
        while stack:
            node, path = stack.pop()
            if not isinstance(node, dict | list):
                continue
            if len(path) >= MAX_DEPTH:
                found.setdefault(field_of(path), too_deep(path))
                continue
            items = node.items() if isinstance(node, dict) else enumerate(node)
            stack.extend((v, (*path, k)) for k, v in items)
        return [found[field] for field in sorted(found)]
    spec = doc.get("spec") if isinstance(doc, dict) else None
    size = json_size(spec)
    if spec is None or size <= MAX_SPEC_BYTES:
        return []
    field, part = _largest(spec)
    share = f"{field} holds {_kib(part)} of it" if field != "spec" else "most of it"
    return [(f"{field}: the spec is {_kib(size)} as JSON, above the {_kib(MAX_SPEC_BYTES)} a "
             f"trainer pod can carry ({share}); keep large values in a file the code reads "
             "(e.g. from a ConfigMap volume) and pass its path")]


def too_deep(path: Path, where: str = "") -> str:
    """The problem of a mapping or list at `path`, MAX_DEPTH levels down or more; `where`
    (e.g. " (line 7)") follows the field's name."""
    return (f"{field_of(path)}{where}: nested more than {MAX_DEPTH} levels deep (mappings and "
            "lists, counted from the document's top; a pod template needs about 15); flatten "
            "it, or keep large structures in a file the code reads (e.g. from a ConfigMap "
            "volume) and pass its path")


def json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON, as the trainer pod carries it (`str` of what JSON
    cannot carry); `value` must be at most MAX_DEPTH deep (json recurses)."""
    return len(json.dumps(value, separators=(",", ":"), default=str))


def field_of(path: Path) -> str:
    """The schema field a path lies in: its keys while they name TrainingJob fields, up to the
    first free-form or unknown one (``spec.model.args`` for ``spec.model.args.a.b``)."""
    model: type[BaseModel] | None = status.TrainingJob
    shown, listed = "", False
    for key in path:
        if isinstance(key, int):  # an item of a list of objects, e.g. status.conditions[0]
            if not listed:
                break
            shown, listed = f"{shown}[{key}]", False
            continue
        if model is None:
            break
        shown = f"{shown}.{key}" if shown else key
        fields = {(f.alias or n): f for n, f in model.model_fields.items()}
        field = fields.get(key)
        if field is None:
            break
        model = next(iter(model_types(field.annotation)), None)
        listed = _is_list(field.annotation)
        if model is None:
            break
    return shown or "<document>"


def _largest(spec: Any) -> tuple[str, int]:
    """The field holding most of `spec` (more than half of its parent, down to a free-form
    field such as ``spec.model.args``) and its size; ("spec", size) when none does."""
    path: Path = ("spec",)
    node, size = spec, json_size(spec)
    while isinstance(node, dict) and node:
        key, part = max(((k, json_size(v)) for k, v in node.items()), key=lambda kv: kv[1])
        inner: Path = (*path, key)
        if 2 * part < size or field_of(inner) != ".".join(map(str, inner)):
            break
        path, node, size = inner, node[key], part
    return field_of(path), size


def _deeper_than(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            if level > limit:
                return True
            stack.extend((v, level + 1) for v in (node.values() if isinstance(node, dict)
                                                   else node))
    return False


def _kib(size: int) -> str:
    return f"{size / 1024:,.0f} KiB" if size >= 10 * 1024 else f"{size / 1024:.1f} KiB"


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list or any(
        _is_list(arg) for arg in typing.get_args(annotation))


def model_types(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (`X`, `X | None`, `list[X]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [t for arg in typing.get_args(annotation) for t in model_types(arg)]
