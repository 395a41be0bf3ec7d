"""kiln_trainer.loop on models from user code: a language model trains on text with next-token
cross-entropy and registers its entrypoint; a classifier whose logits have the wrong shape for
its task is refused before training, naming the task."""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api, models
from kiln.zoo import records, store
from kiln_trainer import loop

USER_MODULE = '''
import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, *, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.embed(tokens))))


def tiny_lm(*, vocab_size: int = 256, dim: int = 16) -> TinyLM:
    return TinyLM(vocab_size=vocab_size, dim=dim)


def per_token_classifier() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10), nn.Unflatten(1, (2, 5)))
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "own_lm.py").write_text(USER_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models are fastest so, and steady on a shared 2-core box
    yield "own_lm"
    torch.set_num_threads(threads)
    sys.modules.pop("own_lm", None)


def _job(model: dict[str, Any], dataset: dict[str, Any]) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "own"},
        "spec": {"model": model, "dataset": dataset,
                 "training": {"epochs": 1, "batchSize": 16,
                              "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
                 "freezing": {"enabled": False}}})


def test_an_entrypoint_language_model_trains_on_text_and_registers_its_entrypoint(
        user_module: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 60, encoding="utf-8")
    job = _job({"entrypoint": f"{user_module}:tiny_lm", "args": {"dim": 16},
                "task": "language_model", "inputShape": [16]},
               {"name": "text", "path": str(corpus)})
    assert models.check_job(job) == []
    out = io.StringIO()
    result = loop.main(job, out=out, termination_log=None, zoo_uri=str(tmp_path / "zoo"),
                       checkpoint_dir=tmp_path / "checkpoints")
    assert result["validation_loss"] is not None and math.isfinite(result["validation_loss"])
    assert result["validation_loss"] < math.log(256)  # learned something about the bytes
    (record,) = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert (record.entrypoint, record.architecture) == (f"{user_module}:tiny_lm", None)
    assert (record.task, record.modality) == ("language_modeling", "text")
    assert result["warm_start_decision"]["outcome"] == "cold_empty"
    assert json.loads(out.getvalue().splitlines()[-1])["event"] == "result"


def test_logits_of_the_wrong_shape_for_the_task_are_refused_before_training(
        user_module: str, tmp_path: Path) -> None:
    job = _job({"entrypoint": f"{user_module}:per_token_classifier", "inputShape": [1, 8, 8]},
               {"name": "digits", "maxSamples": 200})
    with pytest.raises(models.EntrypointError, match=r"spec.model.task: a classification "
                                                     r"model returns logits Tensor\[B, K\] "
                                                     r"\(got shape \[1, 2, 5\]"):
        loop.main(job, out=io.StringIO(), termination_log=None,
                  checkpoint_dir=tmp_path / "checkpoints")
