"""Your own training loop with Kiln: plain PyTorch (its own MLP, its own data: scikit-learn's
digits) plus the Kiln lines marked below, which give it warm start, layer freezing, mixed
precision, progress, checkpoints and the zoo. `own-loop.yaml` runs it (spec.template.command);
standalone: ``KILN_JOB_FILE=own-loop.yaml KILN_ZOO=.kiln/zoo python train_loop.py``.
"""

from __future__ import annotations

import collections

import torch
from sklearn import datasets
from torch import nn
from torch.nn import functional as F

import kiln_trainer


def mlp(hidden: int = 64, depth: int = 2, num_classes: int = 10) -> nn.Module:
    """An MLP on Tensor[B, 1, 8, 8] images; each layer a direct child, so each can freeze."""
    layers: dict[str, nn.Module] = {"stem": nn.Sequential(nn.Flatten(), nn.Linear(64, hidden),
                                                          nn.ReLU())}
    for i in range(depth):
        layers[f"block{i}"] = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())
    layers["head"] = nn.Linear(hidden, num_classes)
    return nn.Sequential(collections.OrderedDict(layers))


def digits(seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train, validation) as (Tensor[N, 1, 8, 8] in [0, 1], LongTensor[N]), split 80/20."""
    x, y = datasets.load_digits(return_X_y=True)
    images, labels = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0, torch.tensor(y)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = len(labels) * 4 // 5
    return ((images[order[:cut]], labels[order[:cut]]),
            (images[order[cut:]], labels[order[cut:]]))


@torch.inference_mode()
def evaluate(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
             amp: kiln_trainer.MixedPrecision) -> tuple[float, float]:
    """Validation accuracy and mean cross-entropy."""
    model.eval()
    with amp.autocast():
        logits = model(inputs).float()
    model.train()
    return (float((logits.argmax(-1) == labels).float().mean()),
            float(F.cross_entropy(logits, labels)))


def main() -> None:
    ctx = kiln_trainer.job_context()  # Kiln: the job, zoo, checkpoints, metrics port
    spec = ctx.job.spec
    (x, y), (x_val, y_val) = digits(spec.training.seed)
    x, y, x_val, y_val = (t.to(ctx.device) for t in (x, y, x_val, y_val))
    model = mlp(**spec.model.args).to(ctx.device)
    ctx.warm_start(model)  # Kiln: the most similar zoo model's weights, transformed
    net = ctx.wrap(model)  # Kiln: DDP under torchrun with several processes, else `model`
    optimizer = torch.optim.Adam(model.parameters(), lr=spec.training.optimizer.lr)
    batch_size = spec.training.batch_size
    steps_per_epoch = -(-len(y) // batch_size)
    start = ctx.resume(model, optimizer, steps_per_epoch=steps_per_epoch)  # Kiln: checkpoint
    ctx.freezer(model, x_val[:32])  # Kiln: freezes converged front layers (spec.freezing)
    for epoch in range(start, spec.training.epochs):
        shuffle = torch.Generator().manual_seed(spec.training.seed + epoch)
        for batch in torch.randperm(len(y), generator=shuffle).split(batch_size):
            mine = batch[ctx.parallel.rank::ctx.parallel.world_size]  # this rank's share
            with ctx.amp.autocast():  # Kiln: spec.training.precision
                loss = F.cross_entropy(net(x[mine]), y[mine])
            optimizer.zero_grad(set_to_none=True)
            ctx.amp.backward(loss)
            ctx.amp.step(optimizer)
            ctx.trained(loss, samples=len(batch))  # Kiln: progress, freezing, stop signals
        accuracy, val_loss = evaluate(model, x_val, y_val, ctx.amp)
        done = ctx.evaluated(accuracy=accuracy, loss=val_loss)  # Kiln: target, time-to-target
        ctx.checkpoint()  # Kiln
        if done:
            break
    ctx.finish(model)  # Kiln: registers the model in the zoo and reports the result


if __name__ == "__main__":
    main()
