"""Plain Hugging Face transformers models (built from a config, no wrapper, nothing downloaded)
freeze: torch.fx cannot trace their forward, so the partition follows their layer stack
(embeddings, each layer, head), a frozen prefix gets no gradients, and a short run freezes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F

from kiln import models
from kiln_trainer.freezing import controller, partition

transformers = pytest.importorskip("transformers")

LENGTH, VOCAB = 16, 64


def _gpt2() -> Any:  # the token embedding and the head are tied, as GPT-2's default
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=LENGTH, vocab_size=VOCAB,
        bos_token_id=0, eos_token_id=0))


def _bert() -> Any:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=LENGTH, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("build", "expected"), [
    pytest.param(_gpt2, ["transformer.wte", "transformer.wpe", "transformer.h.0",
                         "transformer.h.1", "transformer.ln_f", "lm_head"], id="gpt2"),
    pytest.param(_bert, ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1",
                         "bert.encoder.layer.2", "bert.pooler", "classifier"], id="bert"),
])
def test_the_partition_names_embeddings_each_layer_and_the_head(build: Any,
                                                                expected: list[str]) -> None:
    model = build()
    with pytest.raises(Exception):  # noqa: B017  # what the layer-stack partition is for
        torch.fx.symbolic_trace(model)
    part = partition.Partition.of(model, _tokens(1))
    assert list(part.blocks) == expected == models.natural_blocks(model)
    # every parameter counted once; a tied one with the last block holding it (the head)
    assert sum(part.param_counts) == sum(p.numel() for p in model.parameters())
    layers = [i for i, b in enumerate(part.blocks) if ".h." in b or ".layer." in b]
    assert all(part.flops[i] > 0 for i in layers)
    assert part.split(1) is None and "torch.fx cannot trace" in part.split_reason(1)
    outputs = part.probe_extractor(_tokens(3))
    assert list(outputs) == expected[:-1]
    assert all(outputs[b].shape == (3, LENGTH, 32) for b in expected[2:-2])


def test_a_tied_embedding_keeps_training_with_the_head() -> None:
    model = _gpt2()
    part = partition.Partition.of(model, _tokens(1))
    tied = model.transformer.wte.weight
    assert tied is model.lm_head.weight
    assert not any(p is tied for p in part.params(len(part.blocks) - 1))


@pytest.mark.parametrize("build", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_a_frozen_prefix_gets_no_gradients_and_the_rest_does(build: Any) -> None:
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = controller.Settings(check_every_steps=10_000, reference="fp32")
    tokens = _tokens(4)
    with controller.Freezer(model, None, tokens, settings, optimizer=optimizer,
                            main=False) as freezer:
        event = freezer.apply(3, step=1)
        assert event is not None and event.modules == freezer.partition.blocks[:3]
        frozen = freezer.partition.params(3)
        before = [p.detach().clone() for p in frozen]
        model.train()
        freezer.train_mode()
        assert not any(m.training for m in freezer.partition.modules(3))
        output = freezer.trainable_module()(freezer.prefix(tokens))
        optimizer.zero_grad(set_to_none=True)
        output.logits.float().pow(2).mean().backward()
        optimizer.step()
    assert frozen and all(p.grad is None and not p.requires_grad for p in frozen)
    assert all(torch.equal(a, p) for a, p in zip(before, frozen, strict=True))
    frozen_ids = {id(p) for p in frozen}
    trainable = [p for p in model.parameters() if id(p) not in frozen_ids]
    assert trainable and all(p.grad is not None for p in trainable)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_short_run_told_to_decide_early_freezes_a_prefix() -> None:
    model = _bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = controller.Settings(check_every_steps=1, window=2, tolerance=100.0,
                                   peak_fraction=1.0, patience=1, probe_batch_size=8,
                                   reference="fp32")
    tokens = _tokens(256, seed=1)
    labels = (tokens[:, 0] < VOCAB // 2).long()  # learnable from the first token
    events: list[controller.Event] = []
    step = 0
    with controller.Freezer(model, None, _tokens(8, seed=2), settings,
                            optimizer=optimizer) as freezer:
        while freezer.boundary == 0:  # how many steps depends on the reference's start-up
            rows = torch.arange(16 * step, 16 * step + 16) % len(tokens)
            model.train()
            freezer.train_mode()
            logits = freezer.trainable_module()(freezer.prefix(tokens[rows])).logits
            loss: torch.Tensor = F.cross_entropy(logits, labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            event = freezer.after_step(step, lr=optimizer.param_groups[0]["lr"])
            events += [event] if event is not None else []
    assert events[0].kind == "froze" and events[0].modules[0] == "bert.embeddings"
    assert set(freezer.frozen_modules) <= set(freezer.partition.blocks[:-1])
    assert not any(p.requires_grad for p in freezer.partition.params(freezer.boundary))
