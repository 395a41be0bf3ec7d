"""A PyTorch Lightning script with Kiln: an MLP `LightningModule` on scikit-learn's digits, plus
the Kiln lines marked below, which give it warm start, layer freezing, progress, checkpoints
and the zoo. `digits-lightning.yaml` runs it (spec.template.command); needs
``pip install 'kiln-operator[lightning]'``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from sklearn import datasets
from torch import nn
from torch.nn import functional as F
from torch.utils import data

from kiln_trainer.integrations import lightning


class Digits(pl.LightningModule):
    """An MLP on Tensor[B, 1, 8, 8] images; each layer a direct child, so each can freeze."""

    def __init__(self, hidden: int = 64, depth: int = 2, num_classes: int = 10,
                 lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())
                                    for _ in range(depth))
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(x)
        return logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels))
        self.log("val_accuracy", (logits.argmax(-1) == labels).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def digits(seed: int = 0) -> tuple[data.TensorDataset, data.TensorDataset]:
    """(train, validation) of (Tensor[1, 8, 8] in [0, 1], class), split 80/20."""
    x, y = datasets.load_digits(return_X_y=True)
    images = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(y)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = len(labels) * 4 // 5
    return (data.TensorDataset(images[order[:cut]], labels[order[:cut]]),
            data.TensorDataset(images[order[cut:]], labels[order[cut:]]))


def main() -> None:
    kiln = lightning.KilnCallback()  # Kiln: the job, zoo, checkpoints, metrics port
    spec = kiln.ctx.job.spec
    train, validation = digits(spec.training.seed)
    batch_size = spec.training.batch_size
    trainer = pl.Trainer(**kiln.trainer_arguments(),  # Kiln: spec.training's settings
                         callbacks=[kiln])  # Kiln: warm start, resume, freezing, the zoo
    trainer.fit(Digits(**spec.model.args, lr=spec.training.optimizer.lr),
                data.DataLoader(train, batch_size=batch_size, shuffle=True),
                data.DataLoader(validation, batch_size=256))


if __name__ == "__main__":
    main()
