"""Adapter records (LoRA): their lineage fields, the meta.json version that keeps older Kiln from
reading them as whole models, and export refusing to hand one out unmerged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from zoofactory import add

from kiln.zoo import export, records, store

ADAPTER: dict[str, object] = {"method": "lora", "rank": 2, "alpha": 4.0, "dropout": 0.0, "targetModules": ["fc"]}


def test_an_adapter_names_its_base_and_round_trips_as_version_4(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    base = add(zoo, "small_cnn-00000001", floats=100)
    adapter = add(zoo, "small_cnn-00000002", floats=4, parent=base.id, base=base.id,
                  adapter=ADAPTER)
    meta = json.loads(zoo.get_bytes("models/small_cnn-00000002/meta.json"))
    assert meta["schema_version"] == 4 == records.SCHEMA_VERSION
    assert meta["base"] == base.id and meta["adapter"] == ADAPTER
    read = records.read_record(zoo, adapter.id)
    assert read.base == base.id and read.adapter == ADAPTER
    assert records.read_record(zoo, base.id).base is None  # whole models keep older versions
    assert json.loads(zoo.get_bytes("models/small_cnn-00000001/meta.json"))[
        "schema_version"] < 4


@pytest.mark.parametrize(("changes", "message"), [
    ({"base": "small_cnn-00000001"}, "'base' and 'adapter' go together"),
    ({"adapter": ADAPTER}, "'base' and 'adapter' go together"),
    ({"base": "small_cnn-00000009", "adapter": ADAPTER}, "an adapter cannot be its own base"),
])
def test_lineage_fields_that_cannot_hold_are_refused(tmp_path: Path, changes: dict[str, object],
                                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        add(store.DirStore(tmp_path), "small_cnn-00000009", floats=4, **changes)


def test_a_bad_base_id_in_meta_json_is_a_corrupt_record_naming_the_field(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    rec = add(zoo, "small_cnn-00000003", floats=4, base="small_cnn-00000001", adapter=ADAPTER)
    doc = json.loads(rec.to_json())
    doc["base"] = "../escape"
    with pytest.raises(records.CorruptRecord, match="field 'base': expected a zoo model id"):
        records.ZooRecord.from_json(json.dumps(doc))


def test_export_merges_an_adapter_or_refuses_without_a_merge(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    base = add(zoo, "small_cnn-00000001", floats=6, seed=1)
    adapter = add(zoo, "small_cnn-00000002", floats=2, parent=base.id, base=base.id,
                  adapter=ADAPTER)
    with pytest.raises(ValueError, match="is a LoRA adapter on small_cnn-00000001"):
        export.export_record(zoo, adapter.id, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written

    def merge(rec: records.ZooRecord, weights: dict[str, torch.Tensor],
              base_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert rec.id == adapter.id and weights["w"].numel() == 2
        return {"w": base_weights["w"] + 1}

    out = tmp_path / "merged"
    written = export.export_record(zoo, adapter.id, out, merge=merge)
    assert written.base is None and written.adapter is None
    assert written.num_params == base.num_params
    assert written.source == f"LoRA adapter {adapter.id} merged into its base {base.id}"
    target = store.DirStore(tmp_path / "other")
    imported, added = export.import_record(target, out)
    assert added and imported.base is None
    torch.testing.assert_close(records.load_weights(target, imported)["w"],
                               records.load_weights(zoo, base)["w"] + 1)


def test_export_of_an_adapter_whose_base_is_gone_says_so(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    base = add(zoo, "small_cnn-00000001", floats=6)
    adapter = add(zoo, "small_cnn-00000002", floats=2, base=base.id, adapter=ADAPTER)
    records.delete_record(zoo, base.id)
    with pytest.raises(ValueError, match="on small_cnn-00000001, which is no longer in"):
        export.export_record(zoo, adapter.id, tmp_path / "out", merge=lambda *_: {})
