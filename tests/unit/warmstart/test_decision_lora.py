"""The warm-start decision around LoRA adapters: never a parent by similarity, refused when a
whole-model job pins one, and passed through as pinned for a LoRA job (its trainer loads it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api, models
from kiln.warmstart import decision, graph
from kiln.zoo import records, store

MODEL: dict[str, Any] = {"architecture": "small_cnn", "args": {"depth": 2, "width": 8}, "inputShape": [1, 8, 8]}


def _job(warm: dict[str, Any], peft: dict[str, Any] | None = None) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "child"},
        "spec": {"model": MODEL, "warmStart": warm,
                 "training": {"peft": peft} if peft else {}}})


def _adapter_zoo(tmp_path: Path) -> tuple[store.DirStore, records.ZooRecord]:
    """A zoo holding only a LoRA adapter record (its base has since been evicted)."""
    zoo = store.DirStore(tmp_path)
    spec = api.ModelSpec.model_validate(MODEL)
    record = records.ZooRecord(
        id=records.ZooModelId("small_cnn-0000000a"), architecture="small_cnn",
        args=MODEL["args"], input_shape=(1, 8, 8), modality="image", task="classification",
        dataset="digits", metric_name="validation_accuracy", metric_value=0.9, num_params=8,
        created_time="2026-11-30T00:00:00Z", job_name="lora", job_spec={},
        base=records.ZooModelId("small_cnn-0000000b"),
        adapter={"method": "lora", "rank": 2, "targetModules": ["head.2"]})
    return zoo, records.write_record(zoo, record, {"head.2.lora_A.weight": torch.zeros(2, 16)},
                                     graph.to_json(decision.model_graph(spec)))


def test_an_adapter_is_never_chosen_as_a_parent_by_similarity(tmp_path: Path) -> None:
    zoo, _ = _adapter_zoo(tmp_path)
    decided = decision.decide(_job({}), zoo)
    assert decided.parent is None, decided.reason


def test_a_whole_model_job_pinning_an_adapter_is_told_to_pin_its_base(tmp_path: Path) -> None:
    zoo, adapter = _adapter_zoo(tmp_path)
    with pytest.raises(api.InvalidSpec, match=r"spec.warmStart.parent: zoo model "
                       r"small_cnn-0000000a is a LoRA adapter on small_cnn-0000000b; pin "):
        decision.decide(_job({"parent": adapter.id}), zoo)


def test_a_lora_job_gets_its_pinned_adapter_as_decided(tmp_path: Path) -> None:
    zoo, adapter = _adapter_zoo(tmp_path)
    decided = decision.decide(_job({"parent": adapter.id}, {"targetModules": ["head.2"]}), zoo)
    assert decided.parent == adapter.id and decided.outcome is api.WarmStartOutcome.PINNED
    assert models.check_job(_job({"parent": adapter.id}, {"targetModules": ["head.2"]})) == []


def test_a_lora_job_of_another_input_shape_is_refused_at_admission(tmp_path: Path) -> None:
    zoo, adapter = _adapter_zoo(tmp_path)
    job = api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "child"},
        "spec": {"model": {**MODEL, "inputShape": [1, 16, 16]},
                 "warmStart": {"parent": adapter.id},
                 "training": {"peft": {"targetModules": ["head.2"]}}}})
    with pytest.raises(api.InvalidSpec, match=r"spec.model.inputShape: \[1, 16, 16\] is not the "
                       r"LoRA base small_cnn-0000000a's \[1, 8, 8\]; .* set inputShape to "
                       r"\[1, 8, 8\]"):
        decision.decide(job, zoo)
