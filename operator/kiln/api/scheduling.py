"""A job's pod scheduling constraints, read from spec.template in Kubernetes' own shapes.

nodeSelector, required node affinity, tolerations and CPU/memory requests: `scheduling_problems`
checks them (field-named messages), `scheduling_of` reads them into `Scheduling`, whose methods
apply Kubernetes' matching rules to one node's labels and taints.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from decimal import Decimal, DecimalException
from typing import Any

NODE_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
TOLERATION_OPERATORS = ("Equal", "Exists")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# Taints that keep a pod off a node; PreferNoSchedule only steers the scheduler.
HARD_EFFECTS = ("NoSchedule", "NoExecute")
# matchFields supports one field, as in Kubernetes.
NODE_NAME_FIELD = "metadata.name"
REQUESTED_RESOURCES = ("cpu", "memory")

_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|"
                       r"n|u|m|k|M|G|T|P|E))?")
_SUFFIX = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal(10**3),
           "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
           "P": Decimal(10**15), "E": Decimal(10**18), "Ki": Decimal(2**10),
           "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
           "Pi": Decimal(2**50), "Ei": Decimal(2**60)}


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes resource quantity ("500m", "4Gi", "1.5", "2e3", 8) as a number.

    Raises:
        ValueError: not a quantity (a bool, an empty string, an unknown suffix such as "4GB").
    """
    text = "" if isinstance(value, bool) else str(value).strip()  # YAML's true is no number
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"not a quantity: {value!r}")
    number, exponent, suffix = match.groups()
    try:  # an exponent too large for Decimal's context: InvalidOperation or Overflow
        amount = Decimal(number) * (Decimal(f"1{exponent}") if exponent else Decimal(1))
        return amount * _SUFFIX[suffix] if suffix else amount
    except DecimalException as exc:
        raise ValueError(f"not a quantity: {value!r}") from exc


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One node selector requirement: a label (or, from matchFields, the node's name) and an
    operator with its values."""

    key: str
    operator: str
    values: tuple[str, ...] = ()
    field: bool = False  # from matchFields: `key` is metadata.name

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        """Whether a node called `name` with `labels` meets this requirement."""
        value = name if self.field else labels.get(self.key)
        if self.operator == "In":
            return value is not None and value in self.values
        if self.operator == "NotIn":
            return value is None or value not in self.values
        if self.operator == "Exists":
            return value is not None
        if self.operator == "DoesNotExist":
            return value is None
        try:  # Gt / Lt compare the label as an integer; a label that is none never matches
            have, bound = int(value or ""), int(self.values[0])
        except ValueError:
            return False
        return have > bound if self.operator == "Gt" else have < bound

    def __str__(self) -> str:
        what = NODE_NAME_FIELD if self.field else self.key
        if self.operator in ("Exists", "DoesNotExist"):
            return f"{what} {self.operator}"
        return f"{what} {self.operator} [{', '.join(self.values)}]"


@dataclasses.dataclass(frozen=True)
class Toleration:
    """One toleration: key "" with Exists tolerates every taint; effect "" every effect."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Mapping[str, Any]) -> bool:
        """Whether this toleration tolerates `taint` (a node's spec.taints item)."""
        if self.effect and self.effect != taint.get("effect"):
            return False
        if self.key and self.key != taint.get("key"):
            return False
        return self.operator == "Exists" or self.value == str(taint.get("value") or "")


@dataclasses.dataclass(frozen=True)
class Scheduling:
    """Where a job's pod may run, from its spec.template.

    Attributes:
        node_selector: nodeSelector as (label, value) pairs, all required.
        node_terms: affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution
            nodeSelectorTerms: a node must meet every requirement of at least one term
            (none: any node).
        tolerations: the pod's tolerations.
        requests: resource -> amount the trainer container requests (cpu in cores, memory
            in bytes; a limit without a request counts as the request, as in Kubernetes).
    """

    node_selector: tuple[tuple[str, str], ...] = ()
    node_terms: tuple[tuple[Requirement, ...], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    requests: tuple[tuple[str, Decimal], ...] = ()

    def selector_misses(self, labels: Mapping[str, str]) -> list[str]:
        """The nodeSelector pairs a node with `labels` lacks, as ``key=value``."""
        return [f"{k}={v}" for k, v in self.node_selector if labels.get(k) != v]

    def affinity_matches(self, name: str, labels: Mapping[str, str]) -> bool:
        """Whether the node meets the required node affinity (no terms: every node does)."""
        return not self.node_terms or any(all(r.matches(name, labels) for r in term)
                                          for term in self.node_terms)

    def untolerated(self, taints: Any) -> list[str]:
        """The NoSchedule/NoExecute taints of a node (its spec.taints) that no toleration
        tolerates, as ``key=value:Effect``."""
        found = []
        for taint in taints if isinstance(taints, list) else []:
            if not isinstance(taint, Mapping) or taint.get("effect") not in HARD_EFFECTS:
                continue
            if not any(t.tolerates(taint) for t in self.tolerations):
                value = f"={taint['value']}" if taint.get("value") else ""
                found.append(f"{taint.get('key', '')}{value}:{taint['effect']}")
        return found


def scheduling_of(template: Mapping[str, Any]) -> Scheduling:
    """The scheduling constraints of a spec.template that `scheduling_problems` accepts."""
    terms = []
    required = ((template.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}
    for term in required.get("nodeSelectorTerms") or []:
        terms.append(tuple(
            Requirement(str(r["key"]), str(r["operator"]), tuple(map(str, r.get("values") or ())),
                        field=field)
            for field, part in ((False, "matchExpressions"), (True, "matchFields"))
            for r in term.get(part) or []))
    resources = template.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    amounts = {**{k: v for k, v in limits.items() if k in REQUESTED_RESOURCES},
               **{k: v for k, v in requests.items() if k in REQUESTED_RESOURCES}}
    return Scheduling(
        node_selector=tuple(sorted((str(k), str(v)) for k, v in
                                   (template.get("nodeSelector") or {}).items())),
        node_terms=tuple(terms),
        tolerations=tuple(Toleration(str(t.get("key") or ""), str(t.get("operator") or "Equal"),
                                     str(t.get("value") or ""), str(t.get("effect") or ""))
                          for t in template.get("tolerations") or []),
        requests=tuple(sorted((k, parse_quantity(v)) for k, v in amounts.items())),
    )


def scheduling_problems(template: Mapping[str, Any]) -> list[str]:
    """Problems of spec.template's nodeSelector, affinity.nodeAffinity, tolerations and
    resources, each ``spec.template.<path>: what is wrong (got X); fix``.

    The template's keys are known to have their types (mapping or list) already.
    """
    where = "spec.template"
    problems = [f"{where}.nodeSelector.{k}: must be a string label value, e.g. \"true\" "
                f"(got {v!r}); quote it" for k, v in (template.get("nodeSelector") or {}).items()
                if not isinstance(v, str)]
    problems += _affinity_problems(template.get("affinity") or {})
    for i, toleration in enumerate(template.get("tolerations") or []):
        problems += _toleration_problems(f"{where}.tolerations[{i}]", toleration)
    for part, amounts in (template.get("resources") or {}).items():
        if part not in ("limits", "requests", "claims"):
            problems.append(f"{where}.resources.{part}: unknown; use limits or requests")
            continue
        if part == "claims":
            continue
        if not isinstance(amounts, dict):
            problems.append(f"{where}.resources.{part}: must be a mapping of resource to "
                            f"quantity, e.g. {{cpu: \"4\", memory: 16Gi}} (got {amounts!r})")
            continue
        for resource, value in amounts.items():
            try:
                amount = parse_quantity(value)
            except ValueError:
                problems.append(f"{where}.resources.{part}.{resource}: not a Kubernetes "
                                f"quantity (got {value!r}); use e.g. 500m or 2 for cpu, 512Mi "
                                "or 16Gi for memory")
                continue
            if amount < 0:
                problems.append(f"{where}.resources.{part}.{resource}: must not be negative "
                                f"(got {value!r})")
    requests = (template.get("resources") or {}).get("requests") or {}
    limits = (template.get("resources") or {}).get("limits") or {}
    for resource in REQUESTED_RESOURCES:
        try:
            over = (resource in requests and resource in limits
                    and parse_quantity(requests[resource]) > parse_quantity(limits[resource]))
        except ValueError:
            continue  # reported above
        if over:
            problems.append(f"{where}.resources.requests.{resource}: {requests[resource]} exceeds "
                            f"the limit {limits[resource]}; a request must be at most its limit")
    return problems


def _affinity_problems(affinity: Mapping[str, Any]) -> list[str]:
    where = "spec.template.affinity.nodeAffinity"
    node = affinity.get("nodeAffinity")
    if node is None:
        return []
    if not isinstance(node, dict):
        return [f"{where}: must be a mapping (got {node!r})"]
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return []
    where += ".requiredDuringSchedulingIgnoredDuringExecution"
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    if not isinstance(terms, list) or not terms:
        return [(f"{where}.nodeSelectorTerms: required, a non-empty list of terms, e.g. "
                 "[{matchExpressions: [{key: gpu, operator: In, values: [a100]}]}] "
                 f"(got {terms!r})")]
    problems = []
    for i, term in enumerate(terms):
        at = f"{where}.nodeSelectorTerms[{i}]"
        if not isinstance(term, dict) or not (term.get("matchExpressions")
                                              or term.get("matchFields")):
            problems.append(f"{at}: needs matchExpressions or matchFields (an empty term "
                            f"matches no node) (got {term!r})")
            continue
        for part in ("matchExpressions", "matchFields"):
            items = term.get(part) or []
            if not isinstance(items, list):
                problems.append(f"{at}.{part}: must be a list (got {items!r})")
                continue
            for j, item in enumerate(items):
                problems += _requirement_problems(f"{at}.{part}[{j}]", item,
                                                  field=part == "matchFields")
    return problems


def _requirement_problems(at: str, item: Any, *, field: bool) -> list[str]:
    if not isinstance(item, dict):
        return [f"{at}: must be a mapping with key, operator and values (got {item!r})"]
    key, op, values = item.get("key"), item.get("operator"), item.get("values")
    problems = []
    if not (isinstance(key, str) and key):
        problems.append(f"{at}.key: required, a node label key (got {key!r})")
    elif field and key != NODE_NAME_FIELD:
        problems.append(f"{at}.key: matchFields supports only {NODE_NAME_FIELD} (got {key!r})")
    allowed = ("In", "NotIn") if field else NODE_OPERATORS
    if op not in allowed:
        return problems + [f"{at}.operator: must be one of {', '.join(allowed)} (got {op!r})"]
    if values is not None and not (isinstance(values, list)
                                   and all(isinstance(v, str) for v in values)):
        return problems + [(f"{at}.values: must be a list of strings; quote numbers, e.g. "
                            f"[\"8\"] (got {values!r})")]
    values = values or []
    if op in ("In", "NotIn") and not values:
        problems.append(f"{at}.values: {op} needs at least one value")
    elif op in ("Exists", "DoesNotExist") and values:
        problems.append(f"{at}.values: {op} takes no values; remove them (got {values!r})")
    elif op in ("Gt", "Lt") and (len(values) != 1 or not re.fullmatch(r"-?\d+", values[0])):
        problems.append(f"{at}.values: {op} needs exactly one integer, e.g. [\"4\"] "
                        f"(got {values!r})")
    return problems


def _toleration_problems(at: str, item: Any) -> list[str]:
    if not isinstance(item, dict):
        return [(f"{at}: must be a mapping, e.g. {{key: dedicated, operator: Equal, value: ml, "
                 f"effect: NoSchedule}} (got {item!r})")]
    problems = []
    op = item.get("operator", "Equal")
    if op not in TOLERATION_OPERATORS:
        problems.append(f"{at}.operator: must be Equal or Exists (got {op!r})")
    effect = item.get("effect")
    if effect not in (None, "", *TAINT_EFFECTS):
        problems.append(f"{at}.effect: must be one of {', '.join(TAINT_EFFECTS)}, or empty for "
                        f"all (got {effect!r})")
    key, value = item.get("key"), item.get("value")
    if key is not None and not isinstance(key, str):
        problems.append(f"{at}.key: must be a string (got {key!r})")
    if value is not None and not isinstance(value, str):
        problems.append(f"{at}.value: must be a string; quote it (got {value!r})")
    if op == "Exists" and value:
        problems.append(f"{at}.value: operator Exists takes no value; remove it or use Equal "
                        f"(got {value!r})")
    if not key and op == "Equal":
        problems.append(f"{at}.key: an empty key needs operator Exists (it then tolerates "
                        "every taint); set a key or use Exists")
    seconds = item.get("tolerationSeconds")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int)):
        problems.append(f"{at}.tolerationSeconds: must be an integer (got {seconds!r})")
    return problems
