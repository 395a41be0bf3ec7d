"""Hugging Face transformers models as user models (examples/hf): they trace (torch.fx cannot:
the graph comes from the fallbacks), a deeper and wider GPT-2 warm-starts from a narrower one
and starts better than a fresh init, their natural blocks are embeddings, layers, head, and
weights saved with `save_pretrained` import into the zoo for `kiln run` to warm-start from.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import clirun
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln import models
from kiln.warmstart import graph, match, transform
from kiln.zoo import records, store
from kiln_trainer import data
from kiln_trainer.freezing import partition

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hf"
TEXT = REPO / "operator" / "kiln" / "cli.py"  # a few hundred windows: a short run
LENGTH = 32
SMALL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}
BIGGER = {"n_layer": 3, "n_embd": 48, "n_head": 2, "n_positions": 64}


@pytest.fixture(scope="module")
def hf() -> Iterator[Any]:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import models as example  # examples/hf/models.py, as `kiln run` imports it

        yield example
    finally:
        sys.path.remove(str(EXAMPLE))


def _windows() -> torch.Tensor:
    raw = data.read_text_bytes(TEXT)
    count = len(raw) // (LENGTH + 1)
    tokens = torch.frombuffer(bytearray(raw[: count * (LENGTH + 1)]), dtype=torch.uint8)
    return tokens.view(count, LENGTH + 1).long()


def _loss(model: nn.Module, batch: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def test_torch_fx_cannot_trace_them_and_the_fallback_graph_names_every_parameter(
        hf: Any) -> None:
    for model in (hf.gpt2_lm(**SMALL), hf.bert_classifier(num_hidden_layers=2)):
        with pytest.raises(Exception):  # noqa: B017  # why the fallbacks exist
            torch.fx.symbolic_trace(model)
        g = graph.extract(model, [LENGTH])
        named = {k for _, a in g.nodes(data=True) for k in a["params"]}
        assert named == {k for k, _ in model.named_parameters()}
        ops = {a["op"] for _, a in g.nodes(data=True)}
        assert {"Embedding", "LayerNorm"} <= ops
        assert graph.from_json(graph.to_json(g)).number_of_nodes() == g.number_of_nodes()


def test_a_model_nothing_can_trace_says_why_for_each_tracer() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum().item() > 0:  # data-dependent control flow: neither tracer follows it
                return self.fc(x)
            return x

    with pytest.raises(graph.GraphError) as caught:
        graph.extract(Branchy(), [4])
    text = str(caught.value)
    assert "torch.fx cannot trace" in text and "torch.export failed" in text
    assert text.endswith("it cannot be warm-started")


def test_a_deeper_wider_gpt2_aligns_with_a_narrower_parent_and_starts_better_than_fresh(
        hf: Any) -> None:
    windows = _windows()
    generator = torch.Generator().manual_seed(0)
    validation, train = windows[:64], windows[64:]
    torch.manual_seed(0)
    parent = hf.gpt2_lm(**SMALL)
    optimizer = torch.optim.AdamW(parent.parameters(), lr=3e-3)
    for _ in range(40):
        batch = train[torch.randint(len(train), (32,), generator=generator)]
        logits = parent(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    parent_graph = graph.extract(parent, [LENGTH])

    torch.manual_seed(1)
    child = hf.gpt2_lm(**BIGGER)
    fresh = _loss(child, validation)
    result = transform.warm_start_state(parent.state_dict(), parent_graph, child, [LENGTH],
                                        generator=torch.Generator().manual_seed(0))
    alignment = match.align(parent_graph, graph.extract(child, [LENGTH]))
    aligned_ops = [parent_graph.nodes[p]["op"] for p, _ in alignment.pairs]
    assert aligned_ops.count("LayerNorm") == 2 * SMALL["n_layer"] + 1  # every parent norm
    assert aligned_ops.count("Embedding") == 2  # tokens and positions, each to its own
    assert len(result.transferred_params) == len(dict(parent.named_parameters()))
    assert 0.3 < result.similarity < 1.0
    child.load_state_dict(result.state_dict)
    warm = _loss(child, validation)
    assert warm < fresh - 0.5, (warm, fresh)
    assert _loss(parent, validation) < fresh


def test_the_examples_compute_what_the_hugging_face_forward_computes(hf: Any) -> None:
    tokens = torch.randint(256, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    gpt2 = hf.gpt2_lm(**SMALL).eval()
    expected = gpt2.model(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(gpt2(tokens), expected)
    later = tokens.clone()
    later[:, -1] = (later[:, -1] + 1) % 256  # causal: earlier positions cannot see it
    torch.testing.assert_close(gpt2(later)[:, :-1], expected[:, :-1])
    bert = hf.bert_classifier(num_hidden_layers=2).eval()
    torch.testing.assert_close(bert(tokens), bert.model(input_ids=tokens).logits)


def test_natural_blocks_are_embeddings_then_layers_then_head(hf: Any) -> None:
    gpt2 = hf.gpt2_lm(**SMALL)
    assert models.natural_blocks(gpt2) == [
        "model.transformer.wte", "model.transformer.wpe", "model.transformer.h.0",
        "model.transformer.h.1", "model.transformer.ln_f", "model.lm_head"]
    bert = hf.bert_classifier(num_hidden_layers=2)
    assert models.natural_blocks(bert) == [
        "model.bert.embeddings", "model.bert.encoder.layer.0", "model.bert.encoder.layer.1",
        "model.bert.pooler", "model.classifier"]
    for model in (gpt2, bert):  # the blocks own every parameter once
        owned = [f"{b}.{k}" for b in models.natural_blocks(model)
                 for k, _ in model.get_submodule(b).named_parameters()]
        assert len(owned) == len(set(owned)) == len(list(model.parameters()))
        example = torch.zeros(2, LENGTH, dtype=torch.long)
        blocks = partition.Partition.of(model, example).blocks  # freezing can cut them
        assert blocks == tuple(models.natural_blocks(model))


JOB = """\
apiVersion: kiln.dev/v1alpha1
kind: TrainingJob
metadata: {{name: {name}}}
spec:
  model:
    entrypoint: models:gpt2_lm
    args: {args}
    task: language_model
    inputShape: [{length}]
  dataset: {{name: text, path: {text}, validationFraction: 0.2}}
  training: {{epochs: {epochs}, batchSize: 32, seed: 0, optimizer: {{name: adamw, lr: 0.003}}}}
  target: {{metric: validation_loss, value: 0.5}}
  freezing: {{checkEverySteps: 4, window: 3, patience: 1, peakFraction: 1.0}}
"""


def test_save_pretrained_weights_import_and_a_deeper_gpt2_warm_starts_from_them_and_freezes(
        tmp_path: Path, hf: Any) -> None:
    torch.manual_seed(3)
    pretrained = hf.gpt2_lm(**SMALL)
    # Trained a little elsewhere (a plain loop on the same text): the warm-start guard refuses
    # weights no better than a fresh model.
    windows, optimizer = _windows(), torch.optim.AdamW(pretrained.parameters(), lr=3e-3)
    for step in range(40):
        batch = windows[(32 * step) % (len(windows) - 32):][:32]
        optimizer.zero_grad()
        logits = pretrained(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
    pretrained.model.save_pretrained(tmp_path / "gpt2-pretrained")  # HF keys, no wrapper prefix
    assert (tmp_path / "gpt2-pretrained" / "config.json").is_file()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(EXAMPLE)}
    env.pop("KILN_ZOO", None)
    done = clirun.kiln(
        "zoo", "import", str(tmp_path / "gpt2-pretrained"), "--entrypoint", "models:gpt2_lm",
        "--args", json.dumps(SMALL), "--input-shape", str(LENGTH), "--task", "language_model",
        "--metric", "validation_loss=2.5", "--license", "Apache-2.0", "--zoo", "zoo",
        cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    zoo = store.DirStore(tmp_path / "zoo")
    (imported,) = records.list_records(zoo)
    assert imported.entrypoint == "models:gpt2_lm" and imported.task == "language_modeling"
    assert imported.args == SMALL and imported.license == "Apache-2.0"
    stored = records.load_weights(zoo, imported)
    assert torch.equal(stored["model.transformer.h.1.mlp.c_fc.weight"],
                       pretrained.model.transformer.h[1].mlp.c_fc.weight)

    job = tmp_path / "gpt2-bigger.yaml"
    big = "{" + ", ".join(f"{k}: {v}" for k, v in BIGGER.items()) + "}"
    job.write_text(JOB.format(name="gpt2-bigger", args=big, length=LENGTH, text=TEXT,
                              epochs=3), encoding="utf-8")
    (tmp_path / "models.py").write_text((EXAMPLE / "models.py").read_text())  # beside the job
    env.pop("PYTHONPATH")
    done = clirun.kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    tuned = next(r for r in records.list_records(zoo) if r.job_name == "gpt2-bigger")
    assert tuned.parent == imported.id and tuned.entrypoint == "models:gpt2_lm"
    out = " ".join(done.stdout.split())
    assert f"Warm start from {imported.id} (similarity" in out, out
    # the results table's "frozen" column: the most modules frozen at once (else off/none)
    assert re.search(r"\b[1-9]\d* modules \(", out), out


def test_hugging_face_fx_tracer_is_tried_before_torch_export(
        hf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[str] = []

    class Tracer:  # transformers 4's tracer, which transformers 5 no longer ships
        def trace(self, root: nn.Module) -> torch.fx.Graph:
            tried.append(type(root).__name__)
            raise RuntimeError("this wrapper is no PreTrainedModel")

    fake = type(sys)("transformers.utils.fx")
    fake.HFTracer = Tracer  # type: ignore[attr-defined]
    monkeypatch.setattr(graph, "_hf_fx_module", lambda: fake)
    g = graph.extract(hf.gpt2_lm(**SMALL), [LENGTH])  # then torch.export
    assert tried == ["CausalLM"] and g.number_of_nodes() > 0


UNTRACEABLE = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 1e9:  # control flow on a value: no tracer follows it
            return self.fc(x.flatten(1)) * 2
        return self.fc(x.flatten(1))


def branchy() -> nn.Module:
    return Branchy()
'''


def test_a_user_model_nothing_traces_starts_cold_with_the_reason_and_trains(
        tmp_path: Path) -> None:
    (tmp_path / "branchy.py").write_text(UNTRACEABLE, encoding="utf-8")
    (tmp_path / "job.yaml").write_text(
        "apiVersion: kiln.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: branchy}\n"
        "spec:\n  model: {entrypoint: 'branchy:branchy', inputShape: [1, 8, 8]}\n"
        "  training: {epochs: 1, batchSize: 64}\n", encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("KILN_ZOO", None)
    done = clirun.kiln("run", "job.yaml", "--zoo", "zoo", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    assert "torch.fx cannot trace" in out and "torch.export failed" in out, out
    assert "cannot be warm-started" in out, out
    (rec,) = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert rec.parent is None and rec.entrypoint == "branchy:branchy"


BERT_JOB = """\
apiVersion: kiln.dev/v1alpha1
kind: TrainingJob
metadata: {{name: {name}}}
spec:
  model:
    entrypoint: models:bert_classifier
    args: {{num_labels: 2, num_hidden_layers: {layers}, hidden_size: {width},
            num_attention_heads: 2, intermediate_size: {hidden}}}
    task: classification
    inputShape: [{length}]
  dataset:
    entrypoint: corpus:code_or_prose
    args: {{code: {code}, prose: {prose}, length: {length}, per_class: 150}}
  training: {{epochs: {epochs}, batchSize: 32, seed: 0, optimizer: {{name: adamw, lr: 0.003}}}}
  freezing: {{enabled: false}}  # no reference process (transformers imported again) per job
"""


def test_a_bert_classifier_on_a_dataset_callable_trains_and_a_bigger_one_warm_starts(
        tmp_path: Path) -> None:
    jobs = []
    # The parent trains long enough to beat chance, or the warm-start guard rightly refuses it.
    for name, layers, width, epochs in (("bert-small", 1, 32, 6), ("bert-bigger", 2, 48, 1)):
        job = tmp_path / f"{name}.yaml"
        job.write_text(BERT_JOB.format(name=name, layers=layers, width=width, hidden=2 * width,
                                       epochs=epochs,
                                       length=LENGTH, code=REPO / "operator" / "kiln",
                                       prose=REPO / "docs"), encoding="utf-8")
        jobs.append(str(job))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(EXAMPLE)}
    env.pop("KILN_ZOO", None)
    done = clirun.kiln("run", *jobs, "--zoo", "zoo", "--slots", "1", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    found = {r.job_name: r for r in records.list_records(store.DirStore(tmp_path / "zoo"))}
    small, bigger = found["bert-small"], found["bert-bigger"]
    assert small.entrypoint == "models:bert_classifier" and small.task == "classification"
    assert small.validation_accuracy is not None and small.metric_name == "validation_accuracy"
    assert bigger.parent == small.id and bigger.similarity is not None
    assert 0.3 < bigger.similarity < 1.0
