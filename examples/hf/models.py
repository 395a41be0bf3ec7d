"""Hugging Face transformers models as Kiln user models: built from a config, random init.

Entrypoints for ``spec.model.entrypoint``: ``models:gpt2_lm`` (a GPT-2-style causal LM) and
``models:bert_classifier`` (a BERT-style sequence classifier). Nothing is downloaded. Shapes:
B batch, T sequence length, V vocabulary size, K classes; token ids are bytes (V = 256).
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

# The wrappers return logits only (Kiln's loop wants a tensor, not a `ModelOutput`) and call the
# Hugging Face model's parts one by one, as its own forward does without padding, masks or a
# key/value cache: torch.fx can then trace the forward with each layer as one call, so layer
# freezing can also cut the model at a layer and cache the frozen prefix's outputs (a plain
# model freezes along the same layers but runs its frozen prefix every step). The weights keep
# their Hugging Face names under `model.`, so `save_pretrained` / `from_pretrained` files fit.


class CausalLM(nn.Module):
    """A GPT-2 language model, logits only: LongTensor[B, T] -> Tensor[B, T, V]."""

    def __init__(self, model: transformers.GPT2LMHeadModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """LongTensor[B, T] -> logits Tensor[B, T, V] (causal: position t sees 0..t)."""
        gpt2 = self.model.transformer
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        hidden = gpt2.drop(gpt2.wte(input_ids) + gpt2.wpe(positions))
        for block in gpt2.h:  # causal self-attention: no mask means a causal one
            hidden = _tensor(block(hidden))
        logits: torch.Tensor = self.model.lm_head(gpt2.ln_f(hidden))
        return logits


class SequenceClassifier(nn.Module):
    """A BERT sequence classifier, logits only: LongTensor[B, T] -> Tensor[B, K]."""

    def __init__(self, model: transformers.BertForSequenceClassification) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """LongTensor[B, T] -> logits Tensor[B, K] (every token sees every token)."""
        bert = self.model.bert
        hidden = bert.embeddings(input_ids=input_ids)
        for layer in bert.encoder.layer:
            hidden = _tensor(layer(hidden))
        logits: torch.Tensor = self.model.classifier(self.model.dropout(bert.pooler(hidden)))
        return logits


def _tensor(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A layer's hidden states: transformers 5 returns the tensor, 4 a tuple starting with it."""
    return output[0] if isinstance(output, tuple) else output


def gpt2_lm(*, n_layer: int = 4, n_embd: int = 64, n_head: int = 4, vocab_size: int = 256,
            n_positions: int = 256) -> CausalLM:
    """GPT-2 (Radford et al., 2019) from a `GPT2Config`, byte-level by default.

    The output head is not tied to the token embedding, so freezing the embedding leaves the
    head trainable and each weight has one name in the zoo.

    Args:
        n_layer: transformer blocks.
        n_embd: width (divisible by `n_head`).
        n_head: attention heads.
        vocab_size: V.
        n_positions: longest sequence (>= the job's inputShape [T]).
    """
    config = transformers.GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
        n_positions=n_positions, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return CausalLM(transformers.GPT2LMHeadModel(config))


def bert_classifier(
    *, num_labels: int = 2, num_hidden_layers: int = 2, hidden_size: int = 64,
    num_attention_heads: int = 4, intermediate_size: int = 128, vocab_size: int = 256,
    max_position_embeddings: int = 256,
) -> SequenceClassifier:
    """BERT (Devlin et al., NAACL 2019) with a classification head, from a `BertConfig`.

    Args:
        num_labels: K.
        num_hidden_layers: transformer blocks.
        hidden_size: width (divisible by `num_attention_heads`).
        num_attention_heads: attention heads.
        intermediate_size: the MLP's hidden width.
        vocab_size: V.
        max_position_embeddings: longest sequence (>= the job's inputShape [T]).
    """
    config = transformers.BertConfig(
        num_labels=num_labels, num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
        num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, pad_token_id=0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return SequenceClassifier(transformers.BertForSequenceClassification(config))
