"""The TrainingJob and TrainingSweep field references of the docs site, from the CRD schemas.

Each page's table and its CRD both come from `kiln.api` through `kiln.crd.openapi_schema()`, so
they cannot drift. `kiln crd` rewrites the table between a page's markers; the only I/O is
`update`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln import crd

# From the repository root, as `kiln crd --write` runs.
PAGES = {crd.JOB: Path("docs/reference/trainingjob.md"),
         crd.SWEEP: Path("docs/reference/trainingsweep.md"),
         crd.RUNTIME: Path("docs/reference/trainingruntime.md"),
         crd.CLUSTER_RUNTIME: Path("docs/reference/trainingruntime.md")}
START, END = "<!-- reference:start -->", "<!-- reference:end -->"
# A sweep's template is a whole TrainingJob spec: one row, its fields are on the job's page.
_NOT_EXPANDED = ("spec.template",)


def markdown(resource: crd.Resource | None = None) -> str:
    """One table row per spec field of `resource` (default `crd.JOB`): path, type, default,
    bounds/values and description."""
    spec = crd.openapi_schema(resource)["properties"]["spec"]
    rows = ["| field | type | default | allowed | description |", "|---|---|---|---|---|"]
    for path, node in _walk(spec, "spec"):
        description = node.get("description", "")
        description = description.split(": ", 1)[1] if ": " in description else description
        rows.append(
            f"| `{path}` | {_type(node)} | {_default(node)} | {_allowed(node)} | "
            f"{description.replace('|', '/')} |"
        )
    return "\n".join(rows) + "\n"


def update(path: str | Path, resource: crd.Resource | None = None) -> bool:
    """Replace the text between the markers in `path` with `markdown(resource)`.

    Args:
        path: the Markdown page holding the markers.
        resource: whose fields (default `crd.JOB`).

    Returns:
        True when the file changed.

    Raises:
        ValueError: the file lacks the markers.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise ValueError(f"{path}: add the lines {START} and {END} where the reference goes")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{markdown(resource)}{END}{tail}"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def _walk(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    required = set(node.get("required", ()))
    for name, child in node.get("properties", {}).items():
        child_path = f"{path}.{name}"
        marked = dict(child, _required=name in required)
        out.append((child_path, marked))
        if child_path in _NOT_EXPANDED:
            continue
        if child.get("type") == "object" and "properties" in child:
            out.extend(_walk(child, child_path))
        elif child.get("type") == "array" and "properties" in child.get("items", {}):
            out.extend(_walk(child["items"], child_path + "[]"))
    return out


def _type(node: dict[str, Any]) -> str:
    kind = str(node.get("type", "any"))
    if kind == "array":
        kind = f"list of {node.get('items', {}).get('type', 'any')}"
    if node.get(crd.PRESERVE_UNKNOWN):
        kind += " (free-form)"
    if node.get("_required"):
        kind += ", **required**"
    return kind


def _default(node: dict[str, Any]) -> str:
    if "default" not in node or node["default"] == {}:
        return ""
    return f"`{json.dumps(node['default'])}`"


def _allowed(node: dict[str, Any]) -> str:
    if "enum" in node:
        return ", ".join(f"`{v}`" for v in node["enum"] if v is not None)
    parts = []
    if "minimum" in node:
        parts.append(("> " if node.get("exclusiveMinimum") else "≥ ") + _number(node["minimum"]))
    if "maximum" in node:
        parts.append(("< " if node.get("exclusiveMaximum") else "≤ ") + _number(node["maximum"]))
    if "minItems" in node or "maxItems" in node:
        parts.append(f"{node.get('minItems', 0)}–{node.get('maxItems', '∞')} items")
    if "pattern" in node:
        parts.append(f"pattern `{node['pattern']}`")
    return ", ".join(parts)


def _number(value: float) -> str:
    """A bound as written: integers in full (2147483647, not 2.14748e+09)."""
    return str(value) if isinstance(value, int) else f"{value:g}"
