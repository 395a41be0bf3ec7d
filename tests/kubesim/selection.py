"""Label and field selectors as the API server reads them from a LIST's query string.

Label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k`` and
``!k``, comma-separated (all must hold). Field selectors: ``path=v``, ``path==v``,
``path!=v`` on dotted paths such as ``spec.nodeName`` or ``status.phase``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

Match = Callable[[Mapping[str, Any]], bool]

_SET = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*(?:(in|notin)\s*\(([^)]*)\))?\s*$")
_EQUALITY = re.compile(r"^\s*([^\s!=(),]+)\s*(==|=|!=)\s*([^\s!=(),]*)\s*$")


def _terms(text: str) -> list[str]:
    """Split at commas outside parentheses."""
    terms, depth, current = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    terms.append(current)
    return [t for t in terms if t.strip()]


def label_selector(text: str) -> Match:
    """A predicate on an object: whether its labels match selector `text`.

    Raises:
        ValueError: a term the API server would refuse (it answers 400).
    """
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for term in _terms(text):
        equality = _EQUALITY.match(term)
        if equality:
            key, op, value = equality.groups()
            if op == "!=":
                checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
            continue
        found = _SET.match(term)
        if not found:
            raise ValueError(f"unparsable label selector term {term!r}")
        negated, key, op, values = found.groups()
        if negated and op:
            raise ValueError(f"unparsable label selector term {term!r}")
        allowed = {v.strip() for v in (values or "").split(",") if v.strip()}
        if op == "in":
            checks.append(lambda labels, k=key, a=allowed: labels.get(k) in a)
        elif op == "notin":
            checks.append(lambda labels, k=key, a=allowed: labels.get(k) not in a)
        elif negated:
            checks.append(lambda labels, k=key: k not in labels)
        else:
            checks.append(lambda labels, k=key: k in labels)

    def match(obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)
    return match


def field_selector(text: str) -> Match:
    """A predicate on an object: whether its fields match selector `text`.

    Raises:
        ValueError: a term that is not ``path=value``, ``path==value`` or ``path!=value``.
    """
    checks: list[tuple[list[str], bool, str]] = []
    for term in _terms(text):
        found = _EQUALITY.match(term)
        if not found:
            raise ValueError(f"unparsable field selector term {term!r}")
        path, op, value = found.groups()
        checks.append((path.split("."), op != "!=", value))

    def value_at(obj: Mapping[str, Any], path: list[str]) -> str:
        node: Any = obj
        for part in path:
            node = node.get(part) if isinstance(node, Mapping) else None
        return "" if node is None else str(node)

    def match(obj: Mapping[str, Any]) -> bool:
        return all((value_at(obj, path) == value) == equal for path, equal, value in checks)
    return match


def select(items: Iterable[Mapping[str, Any]], *, labels: str | None = None,
           fields: str | None = None) -> list[Mapping[str, Any]]:
    """The items that match both selectors (None or "": no constraint).

    Raises:
        ValueError: an unparsable selector.
    """
    matches = [parse(text) for parse, text in ((label_selector, labels),
                                               (field_selector, fields)) if text]
    return [item for item in items if all(match(item) for match in matches)]
