"""A zoo record as a portable folder: weights.safetensors, graph.json, meta.json and a README
with a Python snippet that loads the model; and back into a zoo, bit for bit.

The weights travel as the stored bytes, never re-serialized, so their SHA-256 is unchanged;
a LoRA adapter travels merged into its base, as a whole model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.zoo import records, store

if TYPE_CHECKING:
    import torch

README_NAME = "README.md"
FILES = (records.WEIGHTS_NAME, records.GRAPH_NAME, records.META_NAME)


Merge = Callable[[records.ZooRecord, dict[str, "torch.Tensor"], dict[str, "torch.Tensor"]],
                 Mapping[str, "torch.Tensor"]]
"""(adapter record, its weights, its base's weights) -> the merged full state dict."""


def export_record(zoo: store.ObjectStore, record_id: str, out_dir: Path, *,
                  merge: Merge | None = None) -> records.ZooRecord:
    """Write a record's files and a README into `out_dir` (created if missing).

    A folder that holds anything else is refused, so no file of the user's is overwritten;
    one holding an earlier export of the same record (and nothing more) is written again.
    A LoRA adapter (a record with a ``base``) is exported merged into its base, as a whole
    model: `merge` computes the weights (the zoo builds no models), the exported record names
    no base and says in ``source`` what was merged.

    Raises:
        ValueError: an invalid id, or `out_dir` is a file, holds other files, or holds an
            export of another record, or cannot be read or written (a file above it, no
            permission, a full disk); an adapter without `merge`, or whose merge fails.
        ObjectNotFound: no such record.
        CorruptRecord: the record is damaged (the weights fail their checksum, ...).
        StoreUnavailable: the store failed.
    """
    record = records.verify_record(zoo, record_id)  # never export what would not import
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file; give a folder")
    try:
        held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    except OSError as exc:
        raise ValueError(f"--out {out_dir}: cannot read it ({exc.strerror or exc}); give a "
                         "folder you can write") from None
    if held and not (set(held) <= {*FILES, README_NAME}
                     and _exported_id(out_dir / records.META_NAME) == record.id):
        raise ValueError(f"--out {out_dir} is not empty (it holds {', '.join(held[:5])}"
                         f"{', ...' if len(held) > 5 else ''}) and no earlier export of "
                         f"{record.id}; give an empty or new folder")
    prefix = records.record_prefix(record.id)
    weights = (zoo.get_bytes(prefix + records.WEIGHTS_NAME) if record.base is None
               else _merged(zoo, record, merge))
    if record.base is not None:
        record = dataclasses.replace(
            record, base=None, adapter=None, weights_sha256=hashlib.sha256(weights).hexdigest(),
            num_params=records.read_record(zoo, record.base).num_params,
            source=f"LoRA adapter {record.id} merged into its base {record.base}")
    graph = zoo.get_bytes(prefix + records.GRAPH_NAME)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / records.WEIGHTS_NAME).write_bytes(weights)  # meta.json last, as in the zoo
        (out_dir / records.GRAPH_NAME).write_bytes(graph)
        (out_dir / records.META_NAME).write_text(record.to_json(), encoding="utf-8")
        (out_dir / README_NAME).write_text(readme(record), encoding="utf-8")
    except OSError as exc:  # a file where a folder should be, no permission, a full disk
        raise ValueError(f"--out {out_dir}: cannot write the export ({exc.strerror or exc}"
                         f"{f': {exc.filename}' if exc.filename else ''}); give a folder "
                         "you can write, on a disk with room") from None
    return record


def _merged(zoo: store.ObjectStore, record: records.ZooRecord, merge: Merge | None) -> bytes:
    """safetensors bytes of an adapter record merged into its (verified) base."""
    assert record.base is not None
    if merge is None:
        raise ValueError(f"zoo record {record.id} is a LoRA adapter on {record.base}: exporting "
                         "it merges it into its base, which needs a merge function")
    try:
        base = records.verify_record(zoo, record.base)
    except store.ObjectNotFound:
        raise ValueError(f"zoo record {record.id} is a LoRA adapter on {record.base}, which is "
                         f"no longer in {zoo.describe()}: it cannot be merged") from None
    try:
        full = merge(record, records.load_weights(zoo, record), records.load_weights(zoo, base))
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"zoo record {record.id}: cannot merge the adapter into its base "
                         f"{base.id}: {str(exc).splitlines()[0]}") from None
    return records.serialize_weights(record.id, full)


def _exported_id(meta: Path) -> str | None:
    """The record id of an export's meta.json, or None (missing or unreadable)."""
    try:
        found = json.loads(meta.read_bytes())
    except (OSError, ValueError):
        return None
    return found.get("id") if isinstance(found, dict) else None


def import_record(zoo: store.ObjectStore, folder: Path, *,
                  check: Callable[[records.ZooRecord, dict[str, Any], Path], None] | None = None,
                  ) -> tuple[records.ZooRecord, bool]:
    """Add an exported record to `zoo` under its own id, with its weights' exact bytes.

    A provisional record comes in as final: no job here will replace it. Importing a record
    the zoo already holds with the same weights changes nothing, so a rerun script succeeds.

    Args:
        zoo: the zoo to add it to.
        folder: the export.
        check: called with the record, its tensors and `folder` before anything is written,
            to refuse weights that do not fit the record's model (the zoo builds no models;
            `kiln zoo import` passes `pretrained.check_export`); raises a ValueError.

    Returns:
        The record, and whether it was added (False: the zoo already held it).

    Raises:
        ValueError: a file is missing, meta.json is invalid, the weights fail the checksum in
            meta.json or are not safetensors, graph.json is not a JSON object, or the zoo
            already holds a record with this id and other weights.
        StoreUnavailable: the store failed; the record may be half-written (no meta.json),
            which readers skip.
    """
    import safetensors
    import safetensors.torch

    missing = [name for name in FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder}: {', '.join(missing)} missing; `kiln zoo export` writes "
                         f"{', '.join(FILES)}")
    meta = (folder / records.META_NAME).read_bytes()
    try:
        record = records.ZooRecord.from_json(meta)
    except records.CorruptRecord as exc:
        raise ValueError(f"{folder / records.META_NAME}: {exc.problem}") from None
    data = (folder / records.WEIGHTS_NAME).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.weights_sha256:
        raise ValueError(f"{folder / records.WEIGHTS_NAME} has sha256 {digest}, but "
                         f"{records.META_NAME} expects {record.weights_sha256}: the file was "
                         "changed or damaged; export it again")
    try:
        tensors = safetensors.torch.load(data)
    except (safetensors.SafetensorError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{folder / records.WEIGHTS_NAME} is not valid safetensors: {exc}"
                         ) from None
    if check is not None:
        check(record, tensors, folder)
    graph_text = (folder / records.GRAPH_NAME).read_bytes()
    try:
        graph = records.parse_json(graph_text, record.id, records.GRAPH_NAME)
        if not isinstance(graph, dict):
            raise records.CorruptRecord(record.id, f"holds {type(graph).__name__}, not an object")
    except records.CorruptRecord as exc:
        raise ValueError(f"{folder / records.GRAPH_NAME}: {exc.problem}") from None
    prefix = records.record_prefix(record.id)
    if zoo.exists(prefix + records.META_NAME):
        held = records.read_record(zoo, record.id)
        if held.weights_sha256 == digest:
            return held, False
        raise ValueError(f"zoo record {record.id} already exists in {zoo.describe()} with "
                         "other weights; `kiln zoo rm` it first to replace it")
    record = dataclasses.replace(record, provisional=False)
    zoo.put_bytes(prefix + records.WEIGHTS_NAME, data)
    zoo.put_bytes(prefix + records.GRAPH_NAME, graph_text)
    zoo.put_bytes(prefix + records.META_NAME, record.to_json().encode())  # last: now visible
    return record, True


def readme(record: records.ZooRecord) -> str:
    """The export's README: what the model is, and how to load it in Python."""
    if record.architecture is not None:
        build = (f"spec = api.ModelSpec.model_validate({{\n"
                 f"    \"architecture\": {json.dumps(record.architecture)},\n"
                 f"    \"args\": {json.dumps(record.args)},\n"
                 f"    \"inputShape\": {list(record.input_shape)},\n}})\n"
                 "model = models.build(spec)")
        imports = "from kiln import api, models\n"
    else:
        module, _, name = (record.entrypoint or "").partition(":")
        build = f"model = {name}(**{json.dumps(record.args)})  # your own builder"
        imports = f"from {module} import {name}\n"
    metric = f"{record.metric_name} {record.metric_value:.4g}"
    lines = [
        f"# {record.id}", "",
        (f"A {record.builder} model ({record.num_params:,} parameters) trained on "
        f"{record.dataset}: {metric}. Exported from a Kiln model zoo."), "",
        (f"- `{records.WEIGHTS_NAME}`: the state dict (safetensors; sha256 "
        f"`{record.weights_sha256}`)"),
        f"- `{records.GRAPH_NAME}`: its architecture graph, for warm starts",
        f"- `{records.META_NAME}`: the zoo record (metrics, parent, the training job)", "",
        "Load it:", "", "```python", "from safetensors.torch import load_file", "",
        imports.rstrip("\n"), "", build,
        f"model.load_state_dict(load_file({records.WEIGHTS_NAME!r}))", "```", "",
        "Add it to another zoo, where jobs warm-start from it:", "",
        "```console", "kiln zoo import path/to/this/folder --zoo ZOO", "```", "",
    ]
    return "\n".join(lines)
