"""The meta.json format of a zoo record: `ZooRecord`, its checked JSON form, and record ids.

`ZooRecord.to_json` writes meta.json with a ``schema_version``; `ZooRecord.from_json` parses and
type-checks it field by field, raising `CorruptRecord` that names the record and the field at
fault (forward compatible: unknown fields are ignored, a newer ``schema_version`` is refused).
Ids (`new_id`, `check_id`) become one key component, so they are kept to letters, digits, '_',
'.', '-'.

Callers: `records` (which re-exports `ZooRecord`, `ZooModelId`, `CorruptRecord`, `new_id`,
`check_id`, `SCHEMA_VERSION` and `META_NAME`: callers write `records.ZooRecord`). Non-goals:
no I/O and no zoo layout (`records`), never imports torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
import secrets
from typing import Any, NewType

ZooModelId = NewType("ZooModelId", str)

SCHEMA_VERSION = 1
"""Version of the meta.json format; readers reject records from a newer version."""

META_NAME = "meta.json"
"""The file holding a record's `ZooRecord` (in its folder ``models/<id>/``)."""

# Ids become one key component: keep them to letters, digits, '_', '.', '-' (no '/', no '..').
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")

MAX_COUNT = 10**13
"""Largest believable count in meta.json (num_params): ten times today's largest models."""


class CorruptRecord(ValueError):
    """A zoo record is damaged: bad meta.json, weights that fail their checksum, missing files.

    Attributes:
        record_id: the record's id (its folder name).
        problem: what is wrong, one sentence.
        field: the meta.json field at fault, or None.
    """

    def __init__(self, record_id: str, problem: str, *, field: str | None = None) -> None:
        super().__init__(f"zoo record {record_id}: {problem}")
        self.record_id = record_id
        self.problem = problem
        self.field = field


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZooRecord:
    """Everything the zoo knows about one trained model (stored as meta.json).

    Attributes:
        id: the record id, e.g. ``small_resnet-7f3c2a1b`` (see `new_id`).
        architecture: model registry name (`kiln.models`).
        args: the builder's keyword arguments (JSON values).
        input_shape: one sample's shape without the batch: (C, H, W) or (T,).
        modality: ``image`` or ``text`` (`kiln.models.Modality` values).
        task: ``classification`` or ``language_modeling`` (`kiln.models.Task` values).
        dataset: dataset name the model was trained on (`kiln.api.DatasetName` values).
        metric_name: the job's target metric, ``validation_accuracy`` or ``validation_loss``.
        metric_value: its final value.
        validation_accuracy: final validation accuracy in [0, 1], or None.
        validation_loss: final validation loss, or None.
        samples_per_second: training throughput (samples/s), or None.
        num_params: number of parameters.
        parent: the zoo id it was warm-started from, or None (cold start).
        similarity: architectural similarity to the parent in [0, 1], or None.
        created_time: when it was registered, RFC 3339 (``2024-05-01T12:00:00Z``).
        weights_sha256: hex SHA-256 of weights.safetensors; `write_record` fills it in.
        job_name: name of the TrainingJob that produced it.
        job_spec: that job as its wire dict (`kiln.api.to_wire`).
    """

    id: ZooModelId
    architecture: str
    args: dict[str, Any]
    input_shape: tuple[int, ...]
    modality: str
    task: str
    dataset: str
    metric_name: str
    metric_value: float
    validation_accuracy: float | None = None
    validation_loss: float | None = None
    samples_per_second: float | None = None
    num_params: int
    parent: ZooModelId | None = None
    similarity: float | None = None
    created_time: str
    weights_sha256: str = ""
    job_name: str
    job_spec: dict[str, Any]

    def to_json(self) -> str:
        """meta.json text: the fields plus ``schema_version``, with a trailing newline."""
        doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        doc.update(dataclasses.asdict(self))
        doc["input_shape"] = list(self.input_shape)
        return json.dumps(doc, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, record_id: str = "<unknown>") -> ZooRecord:
        """Parse and type-check meta.json; unknown fields are ignored (forward compatibility).

        Args:
            text: the meta.json contents.
            record_id: the id to name in errors (the record's folder).

        Raises:
            CorruptRecord: not JSON, not an object, a newer or missing ``schema_version``, a
                missing field, or a field of the wrong type or format (named in the message).
        """
        doc = parse_json(text, record_id, META_NAME)
        if not isinstance(doc, dict):
            raise CorruptRecord(record_id, f"{META_NAME} holds {type(doc).__name__}, not an object")
        if record_id == "<unknown>" and isinstance(doc.get("id"), str):
            record_id = doc["id"]
        version = doc.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CorruptRecord(
                record_id, f"{META_NAME} field 'schema_version': expected a positive integer, "
                f"got {version!r}", field="schema_version",
            )
        if version > SCHEMA_VERSION:
            raise CorruptRecord(
                record_id, f"{META_NAME} has schema_version {version} > {SCHEMA_VERSION}: written "
                "by a newer Kiln; upgrade Kiln to read it", field="schema_version",
            )
        values: dict[str, Any] = {}
        for name, (kind, nullable) in _FIELD_KINDS.items():
            if name not in doc:
                raise CorruptRecord(
                    record_id, f"{META_NAME} field {name!r} is missing", field=name
                )
            value = doc[name]
            if value is None and nullable:
                values[name] = None
                continue
            try:
                values[name] = _CONVERTERS[kind](value)
            except (TypeError, ValueError) as exc:
                raise CorruptRecord(
                    record_id, f"{META_NAME} field {name!r}: expected {exc}, got "
                    f"{type(value).__name__} {_short(value)}", field=name,
                ) from None
        return cls(**values)


def new_id(architecture: str) -> ZooModelId:
    """A fresh record id: the architecture name, a dash, 8 random hex digits.

    Example: ``new_id("small_resnet")`` gives e.g. ``small_resnet-7f3c2a1b``.
    """
    slug = re.sub(r"[^a-z0-9_]+", "_", architecture.lower()).strip("_")[:100] or "model"
    return ZooModelId(f"{slug}-{secrets.token_hex(4)}")


def check_id(record_id: str) -> ZooModelId:
    """Return `record_id` as a `ZooModelId` if it can name a record folder.

    Raises:
        ValueError: not 1-128 of letters, digits, '_', '.', '-' starting with a letter or digit.
    """
    if not _ID_PATTERN.fullmatch(record_id):
        raise ValueError(
            f"invalid zoo model id {record_id!r}: use letters, digits, '_', '.', '-' (at most "
            "128), starting with a letter or digit, e.g. small_resnet-7f3c2a1b"
        )
    return ZooModelId(record_id)


def parse_json(text: str | bytes, record_id: str, name: str) -> Any:
    """`text` decoded as JSON; anything unreadable is a `CorruptRecord` naming the file.

    Besides syntax errors this covers nesting too deep for the decoder (RecursionError: a
    hostile ``[[[[...]]]]``) and integers longer than Python's 4,300-digit limit (ValueError).
    """
    try:
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRecord(record_id, f"{name} is not valid JSON ({exc})") from None
    except RecursionError:
        raise CorruptRecord(record_id, f"{name} is nested too deeply to read") from None
    except ValueError as exc:  # e.g. an integer over sys.get_int_max_str_digits() digits
        raise CorruptRecord(record_id, f"{name} is not usable JSON ({exc})") from None


def _short(value: Any) -> str:
    text = repr(value)
    return f"({text[:60]}...)" if len(text) > 60 else f"({text})"


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("a string")
    return value


def _as_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError("a number")
    if not math.isfinite(value):  # json.loads accepts NaN and Infinity; no metric may be one
        raise TypeError("a finite number")
    return float(value)


def _as_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError("a non-negative integer")
    if value > MAX_COUNT:
        raise TypeError(f"a count up to {MAX_COUNT:,}")
    return value


def _as_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError("an object")
    return value


def _as_shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
    ):
        raise TypeError("a non-empty list of positive integers")
    return tuple(value)


def _as_id(value: Any) -> ZooModelId:
    if not isinstance(value, str) or not _ID_PATTERN.fullmatch(value):
        raise TypeError("a zoo model id such as small_resnet-7f3c2a1b")
    return ZooModelId(value)


def _as_time(value: Any) -> str:
    try:
        datetime.datetime.fromisoformat(_as_str(value))
    except (TypeError, ValueError):
        raise TypeError("an RFC 3339 time such as 2024-05-01T12:00:00Z") from None
    return str(value)


def _as_sha256(value: Any) -> str:
    if not isinstance(value, str) or not _SHA256_PATTERN.fullmatch(value):
        raise TypeError("64 lowercase hex digits (SHA-256)")
    return value


_CONVERTERS: dict[str, Any] = {
    "str": _as_str, "number": _as_number, "count": _as_count, "object": _as_object,
    "shape": _as_shape, "id": _as_id, "time": _as_time, "sha256": _as_sha256,
}

# meta.json fields: name -> (converter kind, may be null). A unit test keeps this in step with
# ZooRecord's fields.
_FIELD_KINDS: dict[str, tuple[str, bool]] = {
    "id": ("id", False),
    "architecture": ("str", False),
    "args": ("object", False),
    "input_shape": ("shape", False),
    "modality": ("str", False),
    "task": ("str", False),
    "dataset": ("str", False),
    "metric_name": ("str", False),
    "metric_value": ("number", False),
    "validation_accuracy": ("number", True),
    "validation_loss": ("number", True),
    "samples_per_second": ("number", True),
    "num_params": ("count", False),
    "parent": ("id", True),
    "similarity": ("number", True),
    "created_time": ("time", False),
    "weights_sha256": ("sha256", False),
    "job_name": ("str", False),
    "job_spec": ("object", False),
}
