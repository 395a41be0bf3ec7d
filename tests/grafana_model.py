"""Grafana's typed dashboard model as a validator (grafana-foundation-sdk).

grafana-foundation-sdk publishes one release per Grafana release, its models generated from
that release's schema (the pinned 11.6 models dashboards of schemaVersion 41,
`SCHEMA_VERSION`). Its ``from_json`` only picks known keys, so decoding alone proves little;
`problems` makes it a validator:

* round trip: decode, encode again, and every non-null key and value must come back; an
  unknown or misspelt field at any level the model knows (dashboard, panel, fieldConfig and
  options per panel type, Prometheus targets, variables) is dropped, and reported;
* types: walking the decoded objects beside the JSON, every value must have the type the
  model's annotations declare (int, float, bool, str, list, object, enum member, literal),
  and every field it declares non-optional must be present (Grafana's own exports write
  them all; its schema gives some of them defaults).

`panels`, `queries` and `fill_in` read a dashboard's panels and PromQL expressions (with the
selector inside each ``label_values`` variable) and fill in its variables.

Callers: tests/unit/test_dashboard.py, tests/e2e/test_dashboard_prometheus.py. Non-goals: no
rendering, no semantic checks (queries, layout: the caller's).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import types
import typing
from collections.abc import Iterator
from typing import Any

from grafana_foundation_sdk.cog import encoder, plugins, runtime
from grafana_foundation_sdk.models import dashboard

SCHEMA_VERSION: int = dashboard.Dashboard().schema_version
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def problems(raw: dict[str, Any]) -> list[str]:
    """What the model finds wrong with dashboard JSON `raw` ([] when nothing; module docstring).

    Args:
        raw: the dashboard JSON model, decoded.

    Returns:
        One line per problem: ``dashboard.<path>: <what is wrong>``.
    """
    plugins.register_default_plugins()
    decoded = dashboard.Dashboard.from_json(raw)
    again = json.loads(json.dumps(decoded, cls=encoder.JSONEncoder))
    return [*_lost(raw, again, "dashboard"), *_typed(decoded, raw, "dashboard")]


def _lost(original: Any, again: Any, path: str) -> Iterator[str]:
    """Keys and values of `original` that the round trip through the model dropped."""
    if isinstance(original, dict):
        for key, value in original.items():
            if value is None:
                continue
            if not isinstance(again, dict) or key not in again:
                yield f"{path}.{key}: not a field of Grafana's model"
            else:
                yield from _lost(value, again[key], f"{path}.{key}")
    elif isinstance(original, list):
        if not isinstance(again, list) or len(again) != len(original):
            yield f"{path}: the list came back as {again!r}"
            return
        for i, (item, back) in enumerate(zip(original, again, strict=True)):
            yield from _lost(item, back, f"{path}[{i}]")
    elif original != again:
        yield f"{path}: {original!r} came back as {again!r}"


def _json_key(attribute: str) -> str:
    """The model's attribute name as its JSON key (``grid_pos`` -> ``gridPos``)."""
    head, *rest = attribute.removesuffix("_val").split("_")
    return head + "".join(part.capitalize() for part in rest)


def _typed(decoded: Any, raw: dict[str, Any], path: str) -> Iterator[str]:
    """Required fields present and every value of its declared type, recursively."""
    for attribute, hint in typing.get_type_hints(type(decoded)).items():
        key = _json_key(attribute)
        if key not in raw:
            if not _accepts(hint, None):
                yield f"{path}.{key}: required"
            continue
        yield from _check(getattr(decoded, attribute), raw[key], hint, f"{path}.{key}")


def _accepts(hint: Any, raw: Any) -> bool:
    return not list(_check(None, raw, hint, ""))


def _check(decoded: Any, raw: Any, hint: Any, path: str) -> Iterator[str]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return
        options = [arg for arg in args if arg is not type(None)]
        decoded_as = [arg for arg in options if isinstance(arg, type) and _is_model(decoded)
                      and isinstance(decoded, arg)]
        if decoded_as:  # a panel or a row: check it as what the model decoded it to
            yield from _check(decoded, raw, decoded_as[0], path)
            return
        fits = [list(_check(decoded, raw, arg, path)) for arg in options]
        if len(fits) == 1:
            yield from fits[0]
        elif all(fits):
            yield f"{path}: {raw!r} is none of {hint}"
    elif origin is typing.Literal:
        if raw not in args:
            yield f"{path}: {raw!r} is not one of {args}"
    elif origin is list:
        if not isinstance(raw, list):
            yield f"{path}: {raw!r} is not a list"
            return
        items = decoded if isinstance(decoded, list) else [None] * len(raw)
        for i, (item, raw_item) in enumerate(zip(items, raw, strict=True)):
            yield from _check(item, raw_item, args[0], f"{path}[{i}]")
    elif origin is dict:
        if not isinstance(raw, dict):
            yield f"{path}: {raw!r} is not an object"
    elif hint is typing.Any or hint is object:
        if _is_model(decoded) and isinstance(raw, dict):  # per-panel-type options
            yield from _typed(decoded, raw, path)
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        if raw not in {member.value for member in hint}:
            yield f"{path}: {raw!r} is not one of {sorted(m.value for m in hint)}"
    elif hint in (bool, str):
        if not isinstance(raw, hint):
            yield f"{path}: {raw!r} is not a {hint.__name__}"
    elif hint in (int, float):
        numbers = (int,) if hint is int else (int, float)
        if isinstance(raw, bool) or not isinstance(raw, numbers):
            yield f"{path}: {raw!r} is not a {hint.__name__}"
    elif isinstance(hint, type):
        if not isinstance(raw, dict):
            yield f"{path}: {raw!r} is not an object ({hint.__name__})"
        elif _is_model(decoded):
            yield from _typed(decoded, raw, path)


def _is_model(value: Any) -> bool:
    return type(value).__module__.startswith("grafana_foundation_sdk.")




def unknown_panel_types(panel_types: set[str]) -> set[str]:
    """The panel types the model has no plugin for (not ones Grafana ships; rows are fine)."""
    plugins.register_default_plugins()
    types_used = panel_types - {"row"}
    return {t for t in types_used if runtime.panelcfg_config(t) is None}


def panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel of dashboard JSON `model`, rows included, a collapsed row's own after it."""
    found = []
    for panel in model["panels"]:
        found.append(panel)
        found.extend(panel.get("panels") or [])
    return found


@dataclasses.dataclass(frozen=True)
class Query:
    """One PromQL expression of the dashboard and where it is.

    Attributes:
        where: ``panel "<title>" target <refId>`` or ``variable <name>``.
        expr: the expression as written (variables not filled in).
        label: for a ``label_values(selector, label)`` variable, the label (expr is the
            selector).
    """

    where: str
    expr: str
    label: str | None = None


def queries(model: dict[str, Any]) -> list[Query]:
    """Every PromQL expression: panel targets, and the selector of each query variable."""
    found = []
    for panel in panels(model):
        for target in panel.get("targets") or []:
            found.append(Query(f'panel "{panel["title"]}" target {target.get("refId")}',
                               target.get("expr", "")))
    for variable in model["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = LABEL_VALUES.match(text)
        assert match, f"variable {variable['name']}: only label_values(selector, label) is used"
        found.append(Query(f"variable {variable['name']}", match["selector"], match["label"]))
    return found


def panel_types(model: dict[str, Any]) -> set[str]:
    """The panel types a dashboard uses (rows included)."""
    return {str(panel["type"]) for panel in panels(model)}


def fill_in(expr: str, values: dict[str, str]) -> str:
    """`expr` with each ``$name`` / ``${name}`` replaced by ``values[name]``."""
    return VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], expr)
