"""Pod settings against Kubernetes' own schema, as the kubernetes client's OpenAPI models
(`kubernetes.client.models`) define it: every key known at its depth (an unknown one named with
a did-you-mean), mappings, lists and scalars where the schema has them.
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Any

# Kiln's spec.template sets the trainer container's settings and the pod's side by side: each
# key, the model type it has in a pod (the client's names: V1Container's `image` is "str").
CONTAINER_KEYS = ("image", "imagePullPolicy", "command", "args", "env", "envFrom", "resources",
                  "volumeMounts", "securityContext")
POD_KEYS = ("volumes", "initContainers", "nodeSelector", "tolerations", "affinity",
            "serviceAccountName", "priorityClassName", "schedulerName", "imagePullSecrets")
_LIST = re.compile(r"list\[(.+)\]")
_MAP = re.compile(r"dict[(\[]str, (.+)[)\]]")
_SCALARS: dict[str, type | tuple[type, ...]] = {"str": str, "int": int,
                                                 "float": (int, float), "bool": bool}
# The pod's quantities, a str in the client: the API server takes a number there too (as
# `sizeLimit: 1` or `cpu: 4`), and only there (`name: 7` is refused).
_QUANTITIES = {("V1ResourceRequirements", "limits"), ("V1ResourceRequirements", "requests"),
               ("V1VolumeResourceRequirements", "limits"),
               ("V1VolumeResourceRequirements", "requests"),
               ("V1EmptyDirVolumeSource", "sizeLimit"), ("V1ResourceFieldSelector", "divisor")}


def template_pod_types() -> dict[str, str]:
    """spec.template key -> its type in a pod: the container's and the pod spec's keys of
    CONTAINER_KEYS and POD_KEYS, podSecurityContext (the pod's securityContext), and labels and
    annotations (the pod's metadata)."""
    models = _models()
    types = {"podSecurityContext": "V1PodSecurityContext", "labels": "dict(str, str)",
             "annotations": "dict(str, str)"}
    for model, keys in ((models.V1Container, CONTAINER_KEYS), (models.V1PodSpec, POD_KEYS)):
        by_wire = {wire: attr for attr, wire in model.attribute_map.items()}
        types.update({key: model.openapi_types[by_wire[key]] for key in keys})
    return types


def pod_schema_problems(value: Any, type_name: str, where: str) -> list[str]:
    """What Kubernetes would reject in `value` as a `type_name` (a model's name such as
    "V1Toleration", or the client's "list[...]", "dict(str, ...)", "str", "int", "bool",
    "object"), each ``where.path: what is wrong; fix``.

    Unknown keys (with the closest known one), a mapping or list where the schema has another
    shape, a scalar of another kind. Values the schema leaves open ("object": int-or-string
    ports, raw extensions) and enum values are not judged here.
    """
    found: list[str] = []
    _check(value, type_name, where, found)
    return found


def _check(value: Any, type_name: str, where: str, found: list[str],
           quantity: bool = False) -> None:
    listed, mapped = _LIST.fullmatch(type_name), _MAP.fullmatch(type_name)
    if listed:
        if not isinstance(value, list):
            found.append(f"{where}: must be a list (got {_kind(value)})")
            return
        for i, item in enumerate(value):
            _check(item, listed[1], f"{where}[{i}]", found)
    elif mapped:
        if not isinstance(value, dict):
            found.append(f"{where}: must be a mapping (got {_kind(value)})")
            return
        for key, item in value.items():
            _check(item, mapped[1], f"{where}.{key}", found, quantity)
    elif type_name in _SCALARS:
        _check_scalar(value, type_name, where, found, quantity)
    else:  # a model; "object" (int-or-string, raw JSON) and dates are none: anything goes
        _check_model(value, type_name, where, found)


def _check_scalar(value: Any, type_name: str, where: str, found: list[str],
                  quantity: bool) -> None:
    if value is None:
        return
    if type_name == "str":
        fits = isinstance(value, str) or (
            quantity and isinstance(value, int | float) and not isinstance(value, bool))
    else:
        fits = isinstance(value, _SCALARS[type_name]) and (
            type_name == "bool" or not isinstance(value, bool))
    if not fits:
        wanted = {"str": "a string", "int": "an integer", "float": "a number",
                  "bool": "true or false"}[type_name]
        found.append(f"{where}: must be {wanted} (got {value!r})"
                     + ("; quote it" if type_name == "str" and isinstance(value, int | float)
                        else ""))


def _check_model(value: Any, type_name: str, where: str, found: list[str]) -> None:
    model: Any = getattr(_models(), type_name, None)
    if not hasattr(model, "openapi_types"):
        return
    if not isinstance(value, dict):
        found.append(f"{where}: must be a mapping of {type_name.removeprefix('V1')} fields "
                      f"(got {_kind(value)})")
        return
    by_wire = {wire: attr for attr, wire in model.attribute_map.items()}
    for key, item in value.items():
        at = f"{where}.{key}"
        if key not in by_wire:
            close = difflib.get_close_matches(str(key), list(by_wire), n=1, cutoff=0.6)
            hint = (f"did you mean {close[0]!r}?" if close
                    else f"known: {', '.join(sorted(by_wire))}")
            found.append(f"{at}: unknown field of a Kubernetes {type_name.removeprefix('V1')}; "
                         f"{hint}")
            continue
        _check(item, model.openapi_types[by_wire[key]], at, found,
               (type_name, key) in _QUANTITIES)


def _kind(value: Any) -> str:
    return ("a mapping" if isinstance(value, dict) else "a list" if isinstance(value, list)
            else repr(value))


@functools.cache
def _models() -> Any:
    # Imported on first use: loading every model takes a few tenths of a second, which only a
    # job with a template pays.
    from kubernetes.client import models
    return models
