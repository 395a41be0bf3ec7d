"""A Hugging Face `Trainer` script with Kiln: a BERT classifier built from a config (no
download, `models.bert_classifier`) on scikit-learn's digits read as 64 pixel tokens, plus the
Kiln lines marked below, which give it warm start, layer freezing, progress, checkpoints and the
zoo. `bert-digits-trainer.yaml` runs it (spec.template.command); needs
``pip install 'kiln-operator[hf]'``.
"""

from __future__ import annotations

from typing import Any

import models
import numpy as np
import torch
import transformers
from sklearn import datasets
from torch.nn import functional as F

from kiln_trainer.integrations import hf


class Classifier(models.SequenceClassifier):
    """`models.SequenceClassifier` as the Trainer calls a model: labels in, loss out.

    Its forward calls the BERT layers one by one, so torch.fx traces it and layer freezing can
    split it at any layer; Hugging Face's own classes train with the callback as they are.
    """

    def forward(self, input_ids: torch.Tensor,  # type: ignore[override]
                labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """LongTensor[B, T] (and LongTensor[B]) -> {"logits": Tensor[B, K], "loss": mean CE}."""
        logits = super().forward(input_ids)
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def classifier(**args: Any) -> Classifier:
    """`models.bert_classifier(**args)` for the Trainer; pixel intensity v is token v + 1."""
    return Classifier(models.bert_classifier(**args).model)


def digit_tokens(seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, validation) examples {"input_ids": LongTensor[64], "labels": int}, split 80/20:
    the Trainer's batches (and ``spec.dataset.entrypoint``)."""
    x, y = datasets.load_digits(return_X_y=True)
    examples = [{"input_ids": torch.tensor(row, dtype=torch.long) + 1, "labels": int(label)}
                for row, label in zip(x, y, strict=True)]
    order = np.random.default_rng(seed).permutation(len(examples))
    cut = len(examples) * 4 // 5
    return [examples[i] for i in order[:cut]], [examples[i] for i in order[cut:]]


def accuracy(prediction: transformers.EvalPrediction) -> dict[str, float]:
    logits, labels = prediction.predictions, prediction.label_ids
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def main() -> None:
    kiln = hf.KilnCallback()  # Kiln: the job, zoo, checkpoints, metrics port
    spec = kiln.ctx.job.spec
    train, validation = digit_tokens(spec.training.seed)
    trainer = transformers.Trainer(
        model=classifier(**spec.model.args),
        args=kiln.training_arguments("hf-output"),  # Kiln: spec.training's settings
        train_dataset=train, eval_dataset=validation, compute_metrics=accuracy,
        callbacks=[kiln])  # Kiln: warm start, resume, freezing, progress, zoo registration
    trainer.train()


if __name__ == "__main__":
    main()
