"""Zoo records: how trained models lie in an `ObjectStore`, and their meta.json format.

A record exists once its ``meta.json`` does: `write_record` writes it last and `delete_record`
removes it first, so readers never see half a record. No choosing between records, no graph
format, no index or cache; torch is imported only to (de)serialize weights.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import re
import secrets
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, NewType

import pydantic
import pydantic.dataclasses
from pydantic import AfterValidator, Field

from kiln import api
from kiln.zoo import store

ZooModelId = NewType("ZooModelId", str)

SCHEMA_VERSION = 4
"""Version of the meta.json format; readers reject records from a newer version.

Version 2 added ``entrypoint`` (a record may have no ``architecture``), ``source`` and
``license``; version 3 ``namespace``, ``share`` and the provenance fields; version 4 ``base``
and ``adapter`` (a LoRA adapter, whose weights are not a whole model). A record is written
as the oldest version that reads it safely (`ZooRecord.to_json`).
"""

META_NAME = "meta.json"
"""The file holding a record's `ZooRecord` (in its folder ``models/<id>/``)."""

# Ids become one key component: keep them to letters, digits, '_', '.', '-' (no '/', no '..').
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
# "package.module:callable": dotted identifiers, a colon, a dotted attribute path.
_ENTRYPOINT_PATTERN = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

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


def _rfc3339(value: str) -> str:
    try:
        datetime.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError("expected an RFC 3339 time such as 2024-05-01T12:00:00Z") from None
    return value


# Field types of meta.json. Strict: a JSON string is never coerced into a number, nor 1.0 into a
# count; only `input_shape` is lax, so a JSON array becomes the tuple (its items stay strict).
_Id = Annotated[ZooModelId, Field(pattern=f"^{_ID_PATTERN.pattern}$")]
_Number = Annotated[float, Field(allow_inf_nan=False)]  # json.loads accepts NaN; no metric may
_Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
_Shape = Annotated[tuple[Annotated[int, Field(strict=True, ge=1)], ...],
                   Field(strict=False, min_length=1)]
_Entrypoint = Annotated[str, Field(pattern=f"^{_ENTRYPOINT_PATTERN.pattern}$")]
_Time = Annotated[str, AfterValidator(_rfc3339)]
_Sha256 = Annotated[str, Field(pattern=f"^(|{_SHA256_PATTERN.pattern})$")]  # "": not yet known
_Namespace = Annotated[str, Field(pattern=api.NAME_PATTERN, max_length=api.NAME_MAX_LENGTH)]
# What the trainer loaded, with its kind (`ZooRecord.content_fingerprint`).
_ContentFingerprint = Annotated[
    str, Field(pattern=r"^((content|sample):sha256:[0-9a-f]{64}|user:[\s\S]{1,128})$")]

LEGACY_NAMESPACE = "default"
"""The namespace of records written before records had one (they read as shared)."""


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True,
                                config=pydantic.ConfigDict(strict=True, extra="ignore"))
class ZooRecord:
    """Everything the zoo knows about one trained model (stored as meta.json).

    Validated by pydantic on construction and on reading; `json_schema` exports the format.

    Attributes:
        id: the record id, e.g. ``small_resnet-7f3c2a1b`` (see `new_id`).
        architecture: model registry name (`kiln.models`), or None for an entrypoint model.
        entrypoint: the user's builder, ``package.module:callable``, or None for a registry
            model. Exactly one of `architecture` and `entrypoint` is set.
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
        job_spec: that job as its wire dict (`kiln.api.to_wire`); for imported weights only
            ``{"spec": {"model": ...}}``.
        source: where imported weights came from (a file path or URL), or None for a model
            trained by Kiln.
        license: the imported weights' license (free text), or None.
        namespace: the Kubernetes namespace of the job that produced it (`kiln run`: its
            ``--namespace``, default ``default``); older records read as `LEGACY_NAMESPACE`.
        share: who may see it: ``private`` (its namespace only) or ``shared`` (every
            namespace); older records read as shared, as they always were.
        dataset_fingerprint: what the job said it trains on (`dataset_fingerprint`): its
            ``spec.dataset.fingerprint``, else ``spec-`` and a hash of its dataset spec; None
            if unknown. Admission compares it, before any data is read.
        content_fingerprint: what the trainer actually loaded, with its kind:
            ``content:sha256:<hex>`` (files, or a built-in loader's arrays),
            ``sample:sha256:<hex>`` (a dataset entrypoint's first samples and length) or
            ``user:<value>`` (the job's ``spec.dataset.fingerprint``, trusted); None for
            older records and imports. See `data_fingerprint`.
        trainer_image: the container image that trained it, or None (local runs, imports).
        kiln_version: the Kiln version that wrote the record, or None (older records).
        train_seconds: the seconds its own training took (across restarts, its parent's not
            included), or None (imports, older records).
        provisional: True while its job still trains: its best weights so far, which the
            final record replaces under the same id (`kiln_trainer.registration`).
        base: for a LoRA adapter, the full-weight record it adapts (its lineage: the weights
            hold only the adapter's tensors and buffers, applied on that record's weights);
            None for a whole model.
        adapter: for a LoRA adapter, its settings (``spec.training.peft`` as written:
            method, rank, alpha, dropout, targetModules); None for a whole model.
    """

    id: _Id
    architecture: str | None = None
    entrypoint: _Entrypoint | None = None
    args: dict[str, Any]
    input_shape: _Shape
    modality: str
    task: str
    dataset: str
    metric_name: str
    metric_value: _Number
    validation_accuracy: _Number | None = None
    validation_loss: _Number | None = None
    samples_per_second: _Number | None = None
    num_params: _Count
    parent: _Id | None = None
    similarity: _Number | None = None
    created_time: _Time
    weights_sha256: _Sha256 = ""
    job_name: str
    job_spec: dict[str, Any]
    source: str | None = None
    license: str | None = None
    namespace: _Namespace = LEGACY_NAMESPACE
    share: api.ZooShare = api.ZooShare.PRIVATE
    dataset_fingerprint: str | None = None
    content_fingerprint: _ContentFingerprint | None = None
    trainer_image: str | None = None
    kiln_version: str | None = None
    train_seconds: _Number | None = None
    provisional: bool = False
    base: _Id | None = None
    adapter: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        problem = _builder_problem(self.architecture, self.entrypoint)
        if problem:
            raise ValueError(f"zoo record {self.id}: {problem}")
        if (self.base is None) != (self.adapter is None):
            raise ValueError(f"zoo record {self.id}: 'base' and 'adapter' go together (an "
                             "adapter names its base record); set both or neither")
        if self.base == self.id:
            raise ValueError(f"zoo record {self.id}: an adapter cannot be its own base")

    @property
    def builder(self) -> str:
        """What builds the model: the registry name, or the entrypoint."""
        return self.architecture or self.entrypoint or ""

    @property
    def data_fingerprint(self) -> str | None:
        """The best fingerprint of what the model was trained on, with its kind:
        `content_fingerprint`, else (older records) `dataset_fingerprint` as ``spec:<hash>`` or
        ``user:<value>``; None if unknown."""
        if self.content_fingerprint is not None:
            return self.content_fingerprint
        if self.dataset_fingerprint is None:
            return None
        if self.dataset_fingerprint.startswith(SPEC_FINGERPRINT_PREFIX):
            return "spec:" + self.dataset_fingerprint.removeprefix(SPEC_FINGERPRINT_PREFIX)
        return "user:" + self.dataset_fingerprint

    def visible_to(self, namespace: str) -> bool:
        """Whether a job in `namespace` may see this record: its own, or a shared one."""
        return self.share is api.ZooShare.SHARED or self.namespace == namespace

    def to_json(self) -> str:
        """meta.json text: the fields plus ``schema_version``, with a trailing newline.

        The version is the oldest that can read the record safely: 4 for an adapter (older
        Kiln would take its weights for a whole model), 3 for a private record (older Kiln
        knows no privacy, so it must refuse it), else 2 with an entrypoint, else 1.
        """
        version = (4 if self.base is not None else
                   3 if self.share is api.ZooShare.PRIVATE else
                   2 if self.entrypoint is not None else 1)
        doc: dict[str, Any] = {"schema_version": version}
        doc.update(_ADAPTER.dump_python(self, mode="json"))
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
        if "weights_sha256" not in doc:  # optional only while `write_record` fills it in
            raise CorruptRecord(record_id, f"{META_NAME} field 'weights_sha256' is missing",
                                field="weights_sha256")
        # Records from before tenancy were visible to every job: they stay so.
        doc = {"namespace": LEGACY_NAMESPACE, "share": api.ZooShare.SHARED.value, **doc}
        try:  # JSON mode: strict, yet an object may become the record and an array its shape
            return _ADAPTER.validate_json(json.dumps(doc))
        except pydantic.ValidationError as exc:
            raise _corrupt(record_id, doc, exc) from None


_ADAPTER = pydantic.TypeAdapter(ZooRecord)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of meta.json (``docs/reference/zoo-record.schema.json``)."""
    schema = _ADAPTER.json_schema(mode="serialization")
    schema["title"] = "Kiln zoo record (meta.json)"
    schema["properties"] = {"schema_version": {
        "type": "integer", "minimum": 1, "maximum": SCHEMA_VERSION,
        "description": "Oldest meta.json version that reads the record."},
        **schema["properties"]}
    schema["required"] = ["schema_version", *schema.get("required", []), "weights_sha256"]
    return schema


# What a field whose format is a pattern should look like, for errors.
_FORMATS = {
    "id": "a zoo model id such as small_resnet-7f3c2a1b",
    "parent": "a zoo model id such as small_resnet-7f3c2a1b",
    "base": "a zoo model id such as small_resnet-7f3c2a1b",
    "entrypoint": "an entrypoint such as mypackage.models:build_net",
    "weights_sha256": "64 lowercase hex digits (SHA-256)",
    "namespace": "a Kubernetes namespace name such as team-a",
    "content_fingerprint": "content:sha256:, sample:sha256: and 64 hex digits, or user: and "
                           "at most 128 characters",
}


def _corrupt(record_id: str, doc: Mapping[str, Any],
             exc: pydantic.ValidationError) -> CorruptRecord:
    """The first of pydantic's errors as a `CorruptRecord` naming the field and the value."""
    error = exc.errors(include_url=False)[0]
    name = str(error["loc"][0]) if error["loc"] else None
    if name is None:  # a check of the whole record: which builder it names
        message = str(error["msg"]).removeprefix("Value error, ")
        return CorruptRecord(record_id, f"{META_NAME}: {message.split(': ', 1)[-1]}",
                             field="entrypoint")
    if error["type"] == "missing":
        return CorruptRecord(record_id, f"{META_NAME} field {name!r} is missing", field=name)
    value = doc.get(name)
    where = "".join(f"[{part}]" for part in error["loc"][1:])
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "string_pattern_mismatch":  # a regex says little to a reader
        message = f"expected {_FORMATS.get(name, 'another format')}"
    return CorruptRecord(
        record_id, f"{META_NAME} field {name!r}{where}: {message}; got "
        f"{type(value).__name__} {_short(value)}", field=name,
    )


def new_id(architecture: str) -> ZooModelId:
    """A fresh record id: the architecture name, a dash, 8 random hex digits.

    Example: ``new_id("small_resnet")`` gives e.g. ``small_resnet-7f3c2a1b``; an entrypoint
    gives its callable's name: ``new_id("mynets.mixer:build_mixer")``, ``build_mixer-0c1d2e3f``.
    """
    return ZooModelId(f"{_slug(architecture)}-{secrets.token_hex(4)}")


def job_record_id(architecture: str, uid: str) -> ZooModelId:
    """The id the operator reserves for one job's model: `new_id`'s form with the first 8 hex
    digits of the job's uid, the same on every attempt, so a result naming any other id is not
    the job's (a job created again under the same name has a new uid, hence a new id).

    Raises:
        ValueError: an empty uid, or one that cannot be part of an id.
    """
    digits = uid.replace("-", "").lower()[:8]
    if not digits:
        raise ValueError("a job's record id needs the job's uid (metadata.uid)")
    return check_id(f"{_slug(architecture)}-{digits}")


def base_record_id(reserved: str) -> ZooModelId:
    """The id under which a LoRA job on spec.model.pretrained.uri imports those weights as its
    base when no visible record holds them yet: its model's id (`job_record_id`) and ``-base``,
    so the operator can grant it to the job's pods before anyone knows the weights.

    Raises:
        ValueError: `reserved` is no id.
    """
    return check_id(f"{check_id(reserved)}-base")


def _slug(architecture: str) -> str:
    name = architecture.rpartition(":")[2]
    return re.sub(r"[^a-z0-9_]+", "_", name.lower()).strip("_")[:100] or "model"


SPEC_FINGERPRINT_PREFIX = "spec-"
"""Starts a `dataset_fingerprint` that hashes the dataset spec (not the user's own)."""


def dataset_fingerprint(spec: api.DatasetSpec) -> str:
    """What a job says it trains on: ``spec.fingerprint`` when the user gave one, else
    ``spec-`` and the first 16 hex digits of a SHA-256 of the fields that name the data
    (loader or entrypoint, its args, paths or uri, torchvision class).

    The spec, not the content: the operator chooses a parent at admission, before any data is
    read, so this is what it can compare; a path whose content changes keeps its hash. The
    trainer records what it loaded in `ZooRecord.content_fingerprint`.
    """
    if spec.fingerprint:
        return spec.fingerprint
    names = {"name": spec.loader, "entrypoint": spec.entrypoint, "args": spec.args,
             "path": spec.path, "validationPath": spec.validation_path,
             "torchvisionClass": spec.torchvision_class}
    if spec.uri is not None:  # only when set: older specs keep their fingerprints
        names["uri"] = spec.uri
    text = json.dumps(names, sort_keys=True, default=str)
    return SPEC_FINGERPRINT_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:16]


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


def _builder_problem(architecture: str | None, entrypoint: str | None) -> str:
    """Why this pair cannot build a model (exactly one must be set), or ``""``."""
    if architecture is None and entrypoint is None:
        return "neither 'architecture' nor 'entrypoint' is set; a record needs exactly one"
    if architecture is not None and entrypoint is not None:
        return (f"both 'architecture' ({architecture!r}) and 'entrypoint' ({entrypoint!r}) are "
                "set; a record needs exactly one")
    return ""


def _short(value: Any) -> str:
    text = repr(value)
    return f"({text[:60]}...)" if len(text) > 60 else f"({text})"


if TYPE_CHECKING:
    import torch

# Layout, one folder per model (ids look like ``small_resnet-7f3c2a1b``):
#     models/<id>/weights.safetensors   the state dict, safetensors format (never pickle)
#     models/<id>/graph.json            the model's architecture graph, as JSON
#     models/<id>/history.jsonl         its evaluations, one JSON object a line (optional)
#     models/<id>/meta.json             the `ZooRecord` as JSON, written LAST
#     checkpoints/<namespace>/<job>/<uid>/checkpoint.pt   trainer checkpoints share the store
#         (a job on the cluster, by its uid: a job created again under its name is a new job;
#         `kiln run` jobs have no uid: checkpoints/<namespace>/<job>/checkpoint.pt)
#     <checkpoint key>.shards/<slot>/rank-<r>.safetensors, .../metadata.json   an FSDP job's
#         per-rank shards (`checkpoint_shard_key`), in slot a or b, which alternate between saves
#     profiles/<namespace>/<job>.json   what the trainer's profiling step measured, graph included
#     claims/<id>/<namespace>/<job>     empty: the operator reserved <id> for that job (`write_claim`)
# The weights' SHA-256 is in meta.json, checked by `load_weights` (lazily: it means reading the
# whole file) and by `verify_record`.
MODELS_PREFIX = "models/"
WEIGHTS_NAME = "weights.safetensors"
GRAPH_NAME = "graph.json"
RECORD_FILES = (META_NAME, WEIGHTS_NAME, GRAPH_NAME)  # what a usable record holds
HISTORY_NAME = "history.jsonl"  # the trainer's evaluations: the curves `kiln plot` draws
CHECKPOINTS_PREFIX = "checkpoints/"
CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_SLOTS = ("a", "b")  # a sharded checkpoint's shard folders, alternating between saves
SHARDS_METADATA_NAME = "metadata.json"
PROFILES_PREFIX = "profiles/"
CLAIMS_PREFIX = "claims/"

_log = logging.getLogger(__name__)


class IdTaken(ValueError):
    """A record id the operator would reserve for a job is claimed for another job already."""


class SkippedRecordWarning(UserWarning):
    """`list_records` left out a record it could not use; the message names it and says why."""


def record_prefix(record_id: str) -> str:
    """``models/<id>/``: the key prefix of every object of a record."""
    return f"{MODELS_PREFIX}{check_id(record_id)}/"


def checkpoint_key(namespace: str, job_name: str, uid: str | None) -> str:
    """``checkpoints/<namespace>/<job-name>/<uid>/checkpoint.pt``: where a job's checkpoint
    lives; without a uid (a job of `kiln run`, which is no API object)
    ``checkpoints/<namespace>/<job-name>/checkpoint.pt``.

    The uid is what makes a job created again under a deleted job's name a new job: it never
    finds the old one's checkpoint.

    Raises:
        ValueError: a namespace, name or uid that is not a single safe key component.
    """
    folder = f"{CHECKPOINTS_PREFIX}{namespace}/{job_name}/" + (f"{uid}/" if uid else "")
    if uid is not None and "/" in uid:
        raise ValueError(f"checkpoint key {folder!r}: a job's uid may not contain '/'")
    return _job_key("checkpoint", folder + CHECKPOINT_NAME, namespace, job_name)


def checkpoint_shard_key(checkpoint: str, slot: str, rank: int | None) -> str:
    """``<checkpoint>.shards/<slot>/rank-<rank>.safetensors``: one rank's shard of a sharded
    checkpoint whose main object is `checkpoint`; rank None: the slot's ``metadata.json``.

    Raises:
        ValueError: a slot other than `CHECKPOINT_SLOTS`, a negative rank, or a bad key.
    """
    if slot not in CHECKPOINT_SLOTS or (rank is not None and rank < 0):
        raise ValueError(f"checkpoint shard {slot!r}/{rank!r}: slot must be one of "
                         f"{CHECKPOINT_SLOTS} and rank >= 0")
    name = SHARDS_METADATA_NAME if rank is None else f"rank-{rank}.safetensors"
    return store.check_key(f"{checkpoint}.shards/{slot}/{name}")


def checkpoint_shard_keys(checkpoint: str, ranks: int) -> list[str]:
    """Every shard object of both slots for ranks 0..ranks-1, metadata included (none for 0)."""
    if ranks <= 0:
        return []
    return [checkpoint_shard_key(checkpoint, slot, rank) for slot in CHECKPOINT_SLOTS
            for rank in (None, *range(ranks))]


def delete_checkpoint(zoo: store.ObjectStore, key: str) -> None:
    """Delete the checkpoint at `key`: its main object first (no reader then meets one whose
    shards are going), then every shard object of both slots, found by listing.

    Raises:
        store.StoreUnavailable: the store failed.
    """
    zoo.delete(key)
    for shard in zoo.list_keys(f"{key}.shards/"):
        zoo.delete(shard)


def profile_key(namespace: str, job_name: str) -> str:
    """``profiles/<namespace>/<job-name>.json``: where the profiling step leaves a job's profile.

    Raises:
        ValueError: a name that is not a single safe key component.
    """
    return _job_key("profile", f"{PROFILES_PREFIX}{namespace}/{job_name}.json", namespace,
                    job_name)


def _job_key(what: str, key: str, namespace: str, job_name: str) -> str:
    """`key`, checked: a job's namespace and name are each one key component."""
    if "/" in namespace or "/" in job_name:
        raise ValueError(f"{what} key {key!r}: namespace and job name may not contain '/'")
    return store.check_key(key)


def write_record(
    zoo: store.ObjectStore,
    record: ZooRecord,
    weights: Mapping[str, torch.Tensor],
    graph: Mapping[str, Any],
    *,
    history: Sequence[Mapping[str, Any]] | None = None,
) -> ZooRecord:
    """Add a model to the zoo: weights, then graph (and history), then meta.json last.

    Args:
        zoo: the store.
        record: the metadata; `weights_sha256` may be empty (filled in here).
        weights: the state dict, name -> tensor (any device; copied to CPU).
        graph: the warm-start graph as a JSON-serializable dict.
        history: the training run's evaluations (step, losses, accuracy, training seconds...),
            kept as `HISTORY_NAME` for `read_history`; None: the record has none.

    Returns:
        The record as stored, with `weights_sha256` set.

    Raises:
        ValueError: invalid id or fields, a record with this id already exists, weights that
            safetensors cannot hold, a graph that is not JSON, or a `weights_sha256` that does
            not match the weights.
        StoreUnavailable: the store failed; what was written is deleted again where the store
            allows, else the record is half-written (no meta.json), which readers skip.
    """
    prefix = record_prefix(record.id)
    data = serialize_weights(record.id, weights)
    digest = hashlib.sha256(data).hexdigest()
    if record.weights_sha256 and record.weights_sha256 != digest:
        raise ValueError(
            f"zoo record {record.id}: weights_sha256 {record.weights_sha256} does not match the "
            f"weights given (sha256 {digest}); leave it empty to have it computed"
        )
    record = dataclasses.replace(record, weights_sha256=digest)
    meta = record.to_json()
    try:
        ZooRecord.from_json(meta, record_id=record.id)  # never write what we could not read
        graph_text = json.dumps(graph, indent=1)
    except CorruptRecord as exc:
        raise ValueError(f"refusing to write zoo record {record.id}: {exc.problem}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"zoo record {record.id}: graph is not JSON-serializable: {exc}") from exc
    try:
        history_text = ("".join(json.dumps(dict(line)) + "\n" for line in history)
                        if history is not None else None)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"zoo record {record.id}: history is not JSON-serializable: "
                         f"{exc}") from exc
    if zoo.exists(prefix + META_NAME):
        raise ValueError(f"zoo record {record.id} already exists in {zoo.describe()}")
    written: list[str] = []
    try:
        for name, body in ((WEIGHTS_NAME, data), (GRAPH_NAME, graph_text.encode()),
                           (HISTORY_NAME, None if history_text is None else history_text.encode()),
                           (META_NAME, meta.encode())):
            if body is not None:
                zoo.put_bytes(prefix + name, body)
                written.append(name)
    except (store.StoreUnavailable, store.StoreMisconfigured):
        # No meta.json, so no reader sees the record; remove what was written too (a full
        # disk, an outage), or it stays behind as a skipped, unreadable record in every
        # listing. Best effort: the store that just failed may refuse this as well.
        for name in written:
            try:
                zoo.delete(prefix + name)
            except (store.StoreUnavailable, store.StoreMisconfigured):
                _log.warning("zoo record %s: could not remove the half-written %s from %s",
                             record.id, name, zoo.describe())
        raise
    return record


def read_record(zoo: store.ObjectStore, record_id: str) -> ZooRecord:
    """Read and check one record's meta.json (the weights are not read).

    Raises:
        ValueError: an invalid id.
        ObjectNotFound: no such record (no meta.json).
        CorruptRecord: meta.json is unreadable, names another id, or names another namespace
            or job than the one the operator reserved the id for (`write_claim`).
        StoreUnavailable: the store failed.
    """
    return _read_record(zoo, record_id, claims_of(zoo, record_id))


def write_claim(zoo: store.ObjectStore, record_id: str, namespace: str, job_name: str) -> None:
    """Say, under a key no trainer pod is granted, that the operator reserved `record_id` for
    `namespace`/`job_name`: a pod writes its record's meta.json itself, so one claiming another
    namespace or job there is refused wherever records are read (`read_record`,
    `list_records`), and can never pass as another team's model.

    Raises:
        IdTaken: the id is claimed for another job already (two job uids alike in the digits
            the id takes): the two must never share one record.
    """
    others = claims_of(zoo, record_id) - {(namespace, job_name)}
    if others:
        raise IdTaken(f"zoo record id {record_id} is reserved for "
                      f"{', '.join(f'{ns}/{job}' for ns, job in sorted(others))} already; "
                      f"delete job {namespace}/{job_name} and create it again (a new uid "
                      "gives a new id)")
    zoo.put_bytes(f"{CLAIMS_PREFIX}{check_id(record_id)}/{namespace}/{job_name}", b"")


def claims_of(zoo: store.ObjectStore, record_id: str) -> set[tuple[str, str]]:
    """The (namespace, job) pairs the operator reserved `record_id` for (`write_claim`)."""
    return _claims(zoo.list_keys(f"{CLAIMS_PREFIX}{check_id(record_id)}/")).get(record_id, set())


def claims(zoo: store.ObjectStore) -> dict[str, set[tuple[str, str]]]:
    """Every reserved record id -> the (namespace, job) pairs it was reserved for."""
    return _claims(zoo.list_keys(CLAIMS_PREFIX))


def _claims(keys: Iterable[str]) -> dict[str, set[tuple[str, str]]]:
    """Record id -> the (namespace, job) it was reserved for, from claims/ keys."""
    found: dict[str, set[tuple[str, str]]] = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) == 4 and parts[0] + "/" == CLAIMS_PREFIX:
            found.setdefault(parts[1], set()).add((parts[2], parts[3]))
    return found


def _read_record(zoo: store.ObjectStore, record_id: str,
                 claimed: set[tuple[str, str]]) -> ZooRecord:
    text = zoo.get_bytes(record_prefix(record_id) + META_NAME)
    record = ZooRecord.from_json(text, record_id=record_id)
    if record.id != record_id:
        raise CorruptRecord(
            record_id, f"{META_NAME} says id {record.id!r}, but it lies in models/{record_id}/",
            field="id",
        )
    if claimed and (record.namespace, record.job_name) not in claimed:
        owner = ", ".join(f"{ns}/{job}" for ns, job in sorted(claimed))
        raise CorruptRecord(
            record_id, f"{META_NAME} says namespace {record.namespace!r}, job "
            f"{record.job_name!r}, but the operator reserved this id for {owner}: that job's "
            f"pod wrote another's name; remove it with: kiln zoo rm {record_id}",
            field="namespace",
        )
    return record


def load_weights(zoo: store.ObjectStore, record: ZooRecord) -> dict[str, torch.Tensor]:
    """The record's state dict on the CPU, after checking its SHA-256.

    Raises:
        CorruptRecord: the weights file is missing, fails its checksum, or is not safetensors.
        StoreUnavailable: the store failed.
    """
    import safetensors
    import safetensors.torch

    try:
        data = zoo.get_bytes(record_prefix(record.id) + WEIGHTS_NAME)
    except store.ObjectNotFound:
        raise CorruptRecord(record.id, f"{WEIGHTS_NAME} is missing; delete the record") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.weights_sha256:
        raise CorruptRecord(
            record.id, f"{WEIGHTS_NAME} ({len(data)} bytes) has sha256 {digest}, but "
            f"{META_NAME} expects {record.weights_sha256}: the file is damaged or was replaced; "
            "delete the record", field="weights_sha256",
        )
    try:
        return safetensors.torch.load(data)
    except (safetensors.SafetensorError, ValueError, RuntimeError) as exc:
        raise CorruptRecord(record.id, f"{WEIGHTS_NAME} is not valid safetensors: {exc}") from exc


def read_history(zoo: store.ObjectStore, record: ZooRecord) -> list[dict[str, Any]]:
    """The evaluations of the run that trained the record (`HISTORY_NAME`), in step order.

    Lines that are not JSON objects with an integer step are skipped.

    Raises:
        ObjectNotFound: the record keeps no history (registered by an older trainer, or
            imported).
        StoreUnavailable: the store failed.
    """
    text = zoo.get_bytes(record_prefix(record.id) + HISTORY_NAME).decode("utf-8", "replace")
    lines = []
    for row in text.splitlines():
        try:
            line = json.loads(row)
        except (json.JSONDecodeError, RecursionError):  # user code wrote it: nested too deep
            continue
        if isinstance(line, dict) and isinstance(line.get("step"), int):
            lines.append(line)
    return sorted(lines, key=lambda line: int(line["step"]))


def load_graph(zoo: store.ObjectStore, record: ZooRecord) -> dict[str, Any]:
    """The record's warm-start graph (graph.json) as a dict.

    Raises:
        CorruptRecord: graph.json is missing, not JSON (or nested too deeply to read), or not
            an object.
        StoreUnavailable: the store failed.
    """
    try:
        text = zoo.get_bytes(record_prefix(record.id) + GRAPH_NAME)
    except store.ObjectNotFound:
        raise CorruptRecord(record.id, f"{GRAPH_NAME} is missing; delete the record") from None
    graph = parse_json(text, record.id, GRAPH_NAME)
    if not isinstance(graph, dict):
        raise CorruptRecord(record.id, f"{GRAPH_NAME} holds {type(graph).__name__}, not an object")
    return graph


def verify_record(zoo: store.ObjectStore, record_id: str) -> ZooRecord:
    """Check a whole record: meta.json, the weights' checksum and format, graph.json.

    Returns:
        The record, when everything checks out.

    Raises:
        ValueError: an invalid id.
        ObjectNotFound: no such record.
        CorruptRecord: anything damaged (the message says what).
        StoreUnavailable: the store failed.
    """
    record = read_record(zoo, record_id)
    load_weights(zoo, record)
    load_graph(zoo, record)
    return record


def visible_ids(zoo: store.ObjectStore, ids: Iterable[str], namespace: str) -> list[str]:
    """The records of `ids` that exist, are readable and that `namespace` may see, in order.

    Raises:
        StoreUnavailable: the store failed.
    """
    kept = []
    for record_id in ids:
        try:
            if read_record(zoo, record_id).visible_to(namespace):
                kept.append(record_id)
        except (store.ObjectNotFound, ValueError):  # missing, or damaged (CorruptRecord)
            _log.info("zoo record %s is missing or unreadable; %s may not use it", record_id,
                      namespace)
    return kept


def list_records(zoo: store.ObjectStore) -> list[ZooRecord]:
    """Every usable record, sorted by id; unusable ones are skipped with a warning.

    A record is skipped, with a `SkippedRecordWarning` naming it and saying why, when it has no
    meta.json (half-written or being deleted), an unreadable meta.json, or no weights or graph
    file. Checksums are not verified here (see `load_weights`, `verify_record`).

    Raises:
        StoreUnavailable: the store failed.
    """
    names_by_id: dict[str, set[str]] = {}
    for key in zoo.list_keys(MODELS_PREFIX):
        parts = key.split("/")
        if len(parts) == 3:  # models/<id>/<file>; anything deeper is not ours
            names_by_id.setdefault(parts[1], set()).add(parts[2])
    reserved = claims(zoo)
    records = []
    for record_id, names in sorted(names_by_id.items()):
        try:
            check_id(record_id)
        except ValueError as exc:  # `kiln zoo rm` takes ids only: say how to remove it
            _skip(record_id, f"its folder name is no record id ({exc}), so it is no Kiln "
                  f"record; delete {MODELS_PREFIX}{record_id}/ from the store itself", zoo)
            continue
        missing = [n for n in RECORD_FILES if n not in names]
        if META_NAME in missing:
            _skip(record_id, f"has no {META_NAME} (half-written, or being deleted)", zoo)
            continue
        if missing:
            _skip(record_id, f"{' and '.join(missing)} missing", zoo)
            continue
        try:
            records.append(_read_record(zoo, record_id, reserved.get(record_id, set())))
        except ValueError as exc:  # CorruptRecord, or a folder name that is no id
            _skip(record_id, f"unreadable: {exc}", zoo)
        except store.ObjectNotFound:
            _log.debug("zoo record %s was deleted while listing %s", record_id, zoo.describe())
    return records


def unusable(zoo: store.ObjectStore, record_id: str) -> bool:
    """Whether a record folder still exists and `list_records` would skip it: a file of
    `RECORD_FILES` missing, or a meta.json it refuses.

    Raises:
        StoreUnavailable: the store failed.
    """
    names = {key.rsplit("/", 1)[-1] for key in zoo.list_keys(record_prefix(record_id))}
    if not names:
        return False  # gone already
    if not set(RECORD_FILES) <= names:
        return True
    try:
        read_record(zoo, record_id)
    except (ValueError, store.ObjectNotFound):  # CorruptRecord; or meta.json deleted meanwhile
        return True
    return False


def delete_record(zoo: store.ObjectStore, record_id: str) -> None:
    """Remove a record: meta.json first (so it vanishes at once), then its other files.

    Deleting a missing record is not an error.

    Raises:
        ValueError: an invalid id.
        StoreUnavailable: the store failed; the record may be half-deleted, which readers skip.
    """
    prefix = record_prefix(record_id)
    zoo.delete(prefix + META_NAME)
    for key in zoo.list_keys(prefix):
        zoo.delete(key)


# ----------------------------------------------------------------------------------------------
# helpers


def _skip(record_id: str, why: str, zoo: store.ObjectStore) -> None:
    warnings.warn(
        f"zoo record {record_id} in {zoo.describe()} skipped: {why}",
        SkippedRecordWarning,
        stacklevel=3,
    )


def serialize_weights(record_id: str, weights: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of a state dict, copied to CPU; tied tensors are stored twice."""
    import safetensors.torch

    tensors = {}
    storages: set[int] = set()
    for name, tensor in weights.items():
        cpu = tensor.detach().to("cpu").contiguous()
        pointer = cpu.untyped_storage().data_ptr()
        if pointer in storages:  # tied weights share storage, which safetensors refuses
            cpu = cpu.clone()
        elif pointer:
            storages.add(pointer)
        tensors[name] = cpu
    try:
        return safetensors.torch.save(tensors)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise ValueError(f"zoo record {record_id}: cannot serialize the weights: {exc}") from exc
