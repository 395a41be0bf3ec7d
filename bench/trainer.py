"""Trainer throughput: training samples per second per model on this machine.

For each model, times full optimizer steps (forward, backward, SGD step) of the default
trainer's shapes on synthetic batches, after warm-up steps, and reports the median of
several repeats. Writes bench/results/trainer.json (`summary.samples_per_second` per
model) and bench/results/trainer.png.

    python bench/trainer.py [--quick] [--batch-size 64] [--device auto]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from kiln import models

# (label, architecture, args, input shape): the examples' models plus common torchvision ones.
CASES = [
    ("small_cnn", "small_cnn", {"num_classes": 10}, (1, 16, 16)),
    ("small_resnet[1,1,1]x16", "small_resnet", {"blocks": [1, 1, 1], "width": 16}, (1, 16, 16)),
    ("small_resnet[2,2,2]x24", "small_resnet", {"blocks": [2, 2, 2], "width": 24}, (1, 16, 16)),
    ("vit", "vit", {"num_classes": 10}, (1, 16, 16)),
    ("char_transformer", "char_transformer", {}, (64,)),
    ("resnet18@32", "resnet18", {"num_classes": 10}, (3, 32, 32)),
    ("mobilenet_v2@32", "mobilenet_v2", {"num_classes": 10}, (3, 32, 32)),
]
QUICK = {"small_cnn", "small_resnet[1,1,1]x16", "char_transformer"}


def samples_per_second(
    model: nn.Module, input_shape: tuple[int, ...], *, batch_size: int, steps: int,
    repeats: int, device: torch.device,
) -> list[float]:
    """Samples/s of `repeats` timed runs of `steps` optimizer steps each (after 2 warm-up)."""
    model = model.to(device).train()
    text = len(input_shape) == 1
    if text:
        x = torch.randint(0, 256, (batch_size, *input_shape), device=device)
        y = torch.randint(0, 256, (batch_size, *input_shape), device=device)
    else:
        x = torch.randn(batch_size, *input_shape, device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()

    for _ in range(2):
        step()
    rates = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(steps * batch_size / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = common.arguments(__doc__, "few models, few steps (CI smoke)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args()
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    steps, repeats = (3, 2) if args.quick else (10, 5)
    cases = [c for c in CASES if not args.quick or c[0] in QUICK]
    rows = {}
    for label, arch, model_args, shape in cases:
        torch.manual_seed(0)
        model = models.get_model(arch, input_shape=shape, **model_args)
        rates = samples_per_second(model, shape, batch_size=args.batch_size, steps=steps,
                                   repeats=repeats, device=device)
        rows[label] = {
            "architecture": arch, "args": model_args, "input_shape": list(shape),
            "median_samples_per_second": statistics.median(rates), "runs": rates,
            "num_params": sum(p.numel() for p in model.parameters()),
        }
        print(f"{label:28s} {statistics.median(rates):10.1f} samples/s "
              f"(min {min(rates):.1f}, max {max(rates):.1f}, {rows[label]['num_params']:,} params)")
    summary = {
        "samples_per_second": {k: v["median_samples_per_second"] for k, v in rows.items()},
        "batch_size": args.batch_size, "device": device.type, "quick": args.quick,
    }
    name = "trainer_quick" if args.quick else "trainer"  # smoke runs keep the full results
    path = common.write_results(name, summary, rows)
    _plot(summary["samples_per_second"], device.type, name)
    print(f"wrote {path}")


def _plot(rates: dict[str, float], device: str, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(list(rates), list(rates.values()), color="tab:orange")
    ax.set_xlabel(f"training samples / second ({device})")
    ax.set_title("Kiln trainer throughput")
    common.save_figure(fig, common.plot_path(name))


if __name__ == "__main__":
    main()
