"""A LoRA job on spec.model.pretrained.uri: its base is the zoo record holding exactly those
weights (imported once, measured), visible to its namespace; it continues the best adapter on
that base with its settings, and never one on other weights or of another namespace."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api, models
from kiln.models import lora
from kiln.zoo import records, store
from kiln_trainer import warm

MODEL = {"architecture": "small_cnn", "args": {"depth": 2, "width": 8}, "inputShape": [1, 8, 8]}
PEFT = {"method": "lora", "rank": 2, "alpha": 4.0, "targetModules": ["head.2"]}


def _job(name: str = "ft", namespace: str = "team-a", **warm_start: Any) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {**MODEL, "pretrained": {"uri": "s3://weights/base"}},
                 "training": {"peft": PEFT}, "warmStart": warm_start}})


def _pretrained(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return models.build(api.ModelSpec.model_validate(MODEL))


def _adapter(zoo: store.ObjectStore, record_id: str, base: records.ZooRecord, *,
             metric: float, namespace: str = "team-a", **changes: Any) -> records.ZooRecord:
    """An adapter record on `base`: random LoRA tensors of PEFT's shapes."""
    model = _pretrained(0)
    lora.attach(model, api.PeftSpec.model_validate(PEFT))
    weights = {k: torch.randn_like(v) if "lora_" in k else v
               for k, v in lora.adapter_state(model).items()}
    fields: dict[str, Any] = {
        "id": records.ZooModelId(record_id), "weights_sha256": "", "base": base.id,
        "adapter": {**PEFT, "dropout": 0.0}, "parent": base.id, "metric_value": metric,
        "validation_accuracy": metric, "namespace": namespace, "job_name": record_id,
        "source": None, "created_time": "2026-12-01T00:00:00Z", **changes}
    return records.write_record(zoo, dataclasses.replace(base, **fields), weights,
                                records.load_graph(zoo, base))


def test_the_first_job_imports_its_base_and_later_ones_reuse_it_by_content(
        tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    measured: list[int] = []

    def measure(model: torch.nn.Module) -> tuple[float, float]:
        measured.append(1)
        return 0.25, 2.0

    parent, base, imported = warm.pretrained_lora_parent(_job(), _pretrained(0), zoo,
                                                         measure=measure)
    assert imported and parent == base and measured == [1]
    assert (base.dataset, base.source, base.metric_value, base.validation_loss) == (
        "imported", "s3://weights/base", 0.25, 2.0)
    assert base.adapter is None and base.namespace == "team-a"
    # the same weights again (any job, any uri): found, not imported, not measured
    again, found, imported = warm.pretrained_lora_parent(_job("other"), _pretrained(0), zoo,
                                                         measure=measure)
    assert (again.id, found.id, imported, measured) == (base.id, base.id, False, [1])
    # other weights are another base
    _, other, imported = warm.pretrained_lora_parent(_job("third"), _pretrained(1), zoo,
                                                     measure=measure)
    assert imported and other.id != base.id and other.weights_sha256 != base.weights_sha256
    # another namespace sees neither private import
    with pytest.raises(api.InvalidSpec, match="imports these weights"):
        warm.pretrained_lora_parent(_job(namespace="team-b"), _pretrained(0), zoo, measure=None)


def test_a_job_continues_the_best_adapter_on_its_base_with_its_settings(
        tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    _, base, _ = warm.pretrained_lora_parent(_job(), _pretrained(0), zoo,
                                             measure=lambda m: (0.1, 2.0))
    _, other, _ = warm.pretrained_lora_parent(_job(), _pretrained(1), zoo,
                                              measure=lambda m: (0.1, 2.0))
    _adapter(zoo, "small_cnn-0000000a", base, metric=0.6)
    best = _adapter(zoo, "small_cnn-0000000b", base, metric=0.7)
    _adapter(zoo, "small_cnn-0000000c", other, metric=0.99)  # another base
    _adapter(zoo, "small_cnn-0000000d", base, metric=0.98, namespace="team-b")  # private
    _adapter(zoo, "small_cnn-0000000e", base, metric=0.97, provisional=True)  # unfinished
    _adapter(zoo, "small_cnn-0000000f", base, metric=0.96,
             adapter={**PEFT, "rank": 4, "dropout": 0.0})  # other settings
    parent, found, imported = warm.pretrained_lora_parent(_job(), _pretrained(0), zoo,
                                                          measure=None)
    assert (parent.id, found.id, imported) == (best.id, base.id, False)
    # a job with warm start off trains a new adapter on the same base
    parent, found, _ = warm.pretrained_lora_parent(_job(enabled=False), _pretrained(0), zoo,
                                                   measure=None)
    assert (parent.id, found.id) == (base.id, base.id)
    # through lora_start: the base's weights stay, the chosen adapter's are loaded
    model = _pretrained(0)
    decided, base_id = warm.lora_start(_job(), model, zoo, load=True)
    assert (decided.parent, base_id, decided.outcome) == (best.id, base.id, "warm")
    assert f"continuing adapter {best.id}" in decided.reason
    stored = records.load_weights(zoo, best)
    own = model.state_dict()
    assert len([k for k in stored if "lora_" in k]) == 2  # head.2's A and B
    assert all(torch.equal(own[k.replace("lora_A.", "lora_A.default.").replace(
        "lora_B.", "lora_B.default.")], v) for k, v in stored.items() if "lora_" in k)


def _pinned_start(tmp_path: Path, model: dict[str, Any]) -> tuple[str, str]:
    """lora_start of a job of `model` pinning a base imported from MODEL's weights: (the
    base's id, the InvalidSpec message, or "" when it started)."""
    zoo = store.DirStore(tmp_path)
    _, base, _ = warm.pretrained_lora_parent(_job(), _pretrained(0), zoo,
                                             measure=lambda m: (0.1, 2.0))
    job = api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "pinned", "namespace": "team-a"},
        "spec": {"model": model, "training": {"peft": PEFT},
                 "warmStart": {"parent": base.id}}})
    try:
        decided, base_id = warm.lora_start(
            job, models.build(api.ModelSpec.model_validate(model)), zoo, load=True)
    except api.InvalidSpec as exc:
        return base.id, str(exc)
    assert base_id == base.id and decided.parent == base.id
    return base.id, ""


def test_a_pinned_base_of_other_args_is_refused_naming_the_bases_args(tmp_path: Path) -> None:
    """A LoRA job pinning a base whose args differ from spec.model's: the error lists the keys
    that do not fit and gives the base's own architecture, args and input shape to copy."""
    base, message = _pinned_start(tmp_path, {**MODEL, "args": {"depth": 3, "width": 8}})
    assert f"spec.warmStart.parent: base {base}" in message
    assert "the weights do not fit the model: keys" in message and "missing (blocks." in message
    assert '{"depth": 2, "width": 8}' in message and "inputShape [1, 8, 8]" in message


def test_a_pinned_base_of_another_input_shape_is_refused_naming_its_shape(
        tmp_path: Path) -> None:
    """A small CNN's weights load at any image size: the input shape is checked on its own."""
    base, message = _pinned_start(tmp_path / "larger", {**MODEL, "inputShape": [1, 16, 16]})
    assert f"spec.model.inputShape: [1, 16, 16] is not the LoRA base {base}'s [1, 8, 8]" \
        in message
    assert "set inputShape to [1, 8, 8]" in message
    assert _pinned_start(tmp_path / "same", MODEL)[1] == ""  # the base's own shape starts
