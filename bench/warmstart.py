"""Warm start: steps to target of warm vs cold children on digits and Fashion-MNIST.

Writes bench/results/warmstart.json and .png, warmstart_quick.* with ``--quick``, or
warmstart_partial.* for some ``--datasets`` or ``--children`` (method below the imports).

    OMP_NUM_THREADS=1 python bench/warmstart.py [--quick] [--seeds 0,1,2] [--children a,b]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one steady thread per process

import dataclasses
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils import flop_counter

BENCH = Path(__file__).resolve().parent
OWN_MODEL = BENCH.parent / "examples" / "own-model"  # `mynets`, the user-package models
sys.path[:0] = [str(BENCH), str(OWN_MODEL)]
import common
import fashion_mnist

from kiln import api, contract, models
from kiln_trainer import loop

# 1. Zoo. Per dataset, a few parents (ResNets, a ViT, the user's MLP-Mixer) train cold with the
#    children's recipe and budget and register into a DirStore in a temporary directory. Every
#    job splits train and validation with splitSeed 0, so no parent has seen a child's
#    validation images; one zoo serves every seed.
# 2. Children. Each child differs from every zoo model (stages, blocks per stage, width,
#    depth, attention heads, or the family: the small_cnn has only ResNet parents). The list was
#    written for coverage of those changes before any run, not tuned to what the matcher
#    favours; `change` says what differs from the nearest zoo model of its family. Per child and
#    seed two arms run back to back (the order alternates), same seed, recipe and budget, no
#    registration: cold (warmStart disabled) and chosen (the product's default: the trainer
#    searches the zoo, transforms the parent, and its guard may still start cold).
# 3. Measures. Every arm runs the whole budget (stopAtTarget false), evaluating every few steps
#    (`Dataset.eval_every_steps`), so one run gives the steps to target (first evaluation at or
#    above the target: the primary figure, immune to this shared machine's load), FLOPs to target
#    (`torch.utils.flop_counter` matmul/conv FLOPs: 3x forward per training sample plus the
#    evaluations), the trainer's seconds to target, and the final accuracy. A warm arm that meets
#    the target at its first evaluation has a ratio capped by that evaluation (counted in
#    `warm_at_first_evaluation`). An arm that never meets it counts at its whole budget; a child
#    the guard sent cold counts with the steps it really took. The guard's probe steps (warm
#    and cold copies trained side by side when step 0 is inconclusive, `guard_steps`) count
#    in the warm arm's steps and FLOPs to target; the forward passes that re-estimate a warm
#    start's batch-norm statistics (`calibration_samples`, no optimizer step) in its FLOPs. Its
#    step-0 probe losses (warm and cold) come from the result's warm-start decision when the
#    trainer reports them.
#
# Ratios are cold / warm per seed (paired), median over seeds per child, then median (or minimum)
# over children. The final-metric delta is warm minus cold in accuracy points, median over seeds,
# worst child. Targets are per dataset and family (`Dataset.targets`), set from one cold pass
# (seed 0) before any warm run, so that cold meets them around the middle of its budget. One
# torch thread; the full run takes about 30 minutes on a loaded 2-core machine (the estimate is
# printed at the start). `--quick` (CI smoke: small digits and Fashion-MNIST subsamples, 2 zoo
# models and 2 children each, one seed) writes warmstart_quick.* instead.

NAME = "warmstart"
ARMS = ("cold", "chosen")
BATCH_SIZE = 64
SPLIT_SEED = 0
GOAL = {"median_steps_ratio": 3.0, "min_steps_ratio": 0.95, "worst_final_metric_delta": -0.3}
# One recipe per family, the same for every arm and dataset.
RECIPES: dict[str, dict[str, Any]] = {
    "conv": {"name": "adam", "lr": 3e-3, "weightDecay": 0.0},
    "vit": {"name": "adamw", "lr": 2e-3, "weightDecay": 0.05},
    "mixer": {"name": "adamw", "lr": 3e-3, "weightDecay": 0.01},
}
# Measured full-run seconds per GFLOP planned (training and evaluation), one loaded thread;
# only for the estimate printed at the start.
SECONDS_PER_GFLOP = {"digits": 0.065, "fashion": 0.055}
SETUP_SECONDS_PER_RUN = 2.0  # data, model, and a warm arm's search, transform and probe


@dataclasses.dataclass(frozen=True)
class Arch:
    """One model of the benchmark.

    Attributes:
        label: short name in tables.
        model: `spec.model` without inputShape (architecture and args, or entrypoint, task and
            args); an entrypoint's ``image_size`` is filled in from the dataset.
        recipe: key of RECIPES, also the family of the target.
        change: for a child, what differs from the nearest zoo model of its family.
    """

    label: str
    model: dict[str, Any]
    recipe: str = "conv"
    change: str = ""


def resnet(blocks: list[int], width: int, change: str = "") -> Arch:
    label = f"resnet[{'-'.join(map(str, blocks))}]x{width}"  # no commas: --children splits
    return Arch(label, {"architecture": "small_resnet", "args": {"blocks": blocks,
                                                                  "width": width}},
                change=change)


def vit(depth: int, width: int, heads: int, change: str = "") -> Arch:
    return Arch(f"vit-d{depth}w{width}h{heads}",
                {"architecture": "vit", "args": {"depth": depth, "width": width, "heads": heads,
                                                 "patch_size": 2}}, "vit", change)


def mixer(depth: int, dim: int, change: str = "") -> Arch:
    return Arch(f"mixer-d{depth}w{dim}",
                {"entrypoint": "mynets.mixer:mixer", "task": "classification",
                 "args": {"depth": depth, "dim": dim, "patch_size": 2}}, "mixer", change)


ZOO = [
    resnet([1, 2, 2], 12),
    resnet([1, 1, 1], 16),
    resnet([2, 2], 16),
    vit(2, 32, 2),
    mixer(2, 32),
]
CHILDREN = [
    resnet([2, 2, 1], 16, "blocks moved to earlier stages, wider (vs [1-2-2]x12)"),
    resnet([1, 1, 1, 1], 16, "a fourth stage (vs [1-1-1]x16)"),
    resnet([1, 1, 1], 24, "width only (vs [1-1-1]x16)"),
    resnet([3, 3, 3], 8, "a third stage, more blocks, half the width (vs [2-2]x16)"),
    resnet([1, 3], 16, "other block counts (vs [2-2]x16)"),
    vit(3, 32, 2, "one more layer (vs d2w32h2)"),
    vit(2, 48, 4, "wider, more heads (vs d2w32h2)"),
    Arch("cnn-d4w16", {"architecture": "small_cnn", "args": {"depth": 4, "width": 16}},
         change="other family: a plain CNN, only ResNet parents"),
    mixer(2, 48, "user package, wider (vs d2w32)"),
    mixer(4, 32, "user package, deeper (vs d2w32)"),
]
QUICK_ZOO = [resnet([1, 1, 1], 8), mixer(1, 16)]
QUICK_CHILDREN = [resnet([1, 2], 8, "other stages and blocks (vs [1-1-1]x8)"),
                  mixer(2, 16, "user package, deeper (vs d1w16)")]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One dataset of the benchmark and its budget.

    Attributes:
        label: key in results.
        spec: `spec.dataset` (splitSeed is added).
        side: images are [1, side, side].
        epochs: the budget of every run.
        eval_every_steps: steps between evaluations: the steps-to-target resolution.
        targets: validation accuracy to reach, per recipe.
        seeds: the seeds of every child (more where one validation image weighs more).
    """

    label: str
    spec: dict[str, Any]
    side: int
    epochs: int
    eval_every_steps: int
    targets: dict[str, float]
    seeds: tuple[int, ...] = (0, 1, 2)


def datasets(*, quick: bool, fashion_root: Path) -> list[Dataset]:
    """Digits at their native 8x8 with half held out (898 validation images, 0.11 points
    each); a Fashion-MNIST subsample at 14x14 (4,500 train, 1,500 validation: 0.07 points).

    Digits runs six seeds, Fashion-MNIST three: one seed's final accuracy on digits moves by up
    to a point either way (measured: the same child's warm-minus-cold delta ranged from -0.9 to
    +1.8 points over eight seeds), so three seeds cannot resolve a 0.3-point goal there."""
    fashion = {"name": "torchvision", "torchvisionClass": "FashionMNIST",
               "path": str(fashion_root)}
    if quick:
        return [
            Dataset("digits", {"name": "digits", "maxSamples": 600, "validationFraction": 0.5},
                    8, 3, 4, {"conv": 0.7, "vit": 0.5, "mixer": 0.6}, (0,)),
            Dataset("fashion", {**fashion, "maxSamples": 400, "validationFraction": 0.5}, 14,
                    1, 4, {"conv": 0.4, "vit": 0.3, "mixer": 0.4}, (0,)),
        ]
    return [
        Dataset("digits", {"name": "digits", "validationFraction": 0.5}, 8, 10, 4,
                {"conv": 0.95, "vit": 0.5, "mixer": 0.88}, (0, 1, 2, 3, 4, 5)),
        Dataset("fashion", {**fashion, "maxSamples": 6000, "validationFraction": 0.25}, 14, 2,
                8, {"conv": 0.7, "vit": 0.42, "mixer": 0.7}),
    ]


def model_spec(arch: Arch, ds: Dataset) -> dict[str, Any]:
    """`spec.model` of `arch` on `ds`: input shape, 10 classes, the mixer's image size."""
    args = {**arch.model["args"], "num_classes": 10}
    if "entrypoint" in arch.model:
        args["image_size"] = ds.side
    return {**arch.model, "args": args, "inputShape": [1, ds.side, ds.side]}


def make_job(arch: Arch, ds: Dataset, *, name: str, seed: int, warm: bool,
             register: bool = False) -> api.TrainingJob:
    """The TrainingJob of one run: the family's recipe, stopAtTarget false (whole budget)."""
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "model": model_spec(arch, ds),
            "dataset": {**ds.spec, "splitSeed": SPLIT_SEED},
            "training": {"epochs": ds.epochs, "batchSize": BATCH_SIZE,
                         "optimizer": RECIPES[arch.recipe], "lrSchedule": {"name": "cosine"},
                         "seed": seed, "evalEverySteps": ds.eval_every_steps, "device": "cpu"},
            "target": {"metric": "validation_accuracy", "stopAtTarget": False,
                       "value": ds.targets[arch.recipe]},
            "warmStart": {"enabled": warm}, "zoo": {"register": register},
            # Off in both arms, so they differ by warm start alone (bench/freezing.py measures
            # freezing); its reference process would also share these two cores.
            "freezing": {"enabled": False},
        }})


def train(job: api.TrainingJob, *, zoo_uri: str | None, workdir: Path,
          register: bool = False) -> dict[str, Any]:
    """Run the trainer in process; the result plus the evaluation curve and step to target."""
    out, began = io.StringIO(), time.perf_counter()
    result = loop.main(job, zoo_uri=zoo_uri, register=register, checkpoint_dir=workdir / "ckpt",
                       resume=False, out=out, termination_log=None)
    call_seconds = time.perf_counter() - began
    curve, last = [], None
    for line in out.getvalue().splitlines():
        event = contract.from_line(line)
        if not isinstance(event, contract.Progress):
            continue
        point = (event.validation_accuracy, event.validation_loss)
        if point[0] is not None and point != last:
            curve.append([event.step, round(point[0], 4)])  # an evaluation's own event
            last = point
    target = job.spec.target.value  # type: ignore[union-attr]
    hit = next((step for step, acc in curve if acc >= target), None)
    return {**result, "call_seconds": round(call_seconds, 3), "curve": curve,
            # Setup before the trainer's clock: data, model, and for a warm arm the zoo search,
            # the transform and the guard's probe.
            "setup_seconds": round(call_seconds - result["wall_seconds"], 3),
            "steps_to_target": hit,
            "evals_to_target": None if hit is None else sum(s <= hit for s, _ in curve)}


def to_target(run: dict[str, Any], *, steps_per_epoch: int, n_train: int, n_val: int,
              forward_flops: int) -> dict[str, Any]:
    """Steps, seconds and FLOPs to target, the guard's probe steps included; unreached: the
    whole budget, flagged."""
    reached = run["steps_to_target"] is not None
    steps = run["steps_to_target"] if reached else run["steps"]
    evals = run["evals_to_target"] if reached else len(run["curve"])
    decided = run.get("warm_start_decision") or {}
    guard = decided.get("guard_steps") or 0
    calibration = decided.get("calibration_samples") or 0
    samples = ((steps // steps_per_epoch) * n_train
               + min((steps % steps_per_epoch) * BATCH_SIZE, n_train) + guard * BATCH_SIZE)
    return {"reached": reached, "steps": steps + guard, "guard_steps": guard,
            "calibration_samples": calibration,
            "seconds": run["time_to_target_seconds"] if reached else run["wall_seconds"],
            "flops": (3 * forward_flops * samples
                      + (evals * n_val + calibration) * forward_flops)}


def forward_flops(arch: Arch, ds: Dataset) -> int:
    """Matmul/conv FLOPs of one sample's forward pass (eval mode)."""
    spec = api.ModelSpec.model_validate(model_spec(arch, ds))
    model = models.build(spec).eval()
    with flop_counter.FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 1, ds.side, ds.side))
    return int(counter.get_total_flops())


def split_sizes(ds: Dataset) -> dict[str, int]:
    """Training and validation samples and steps per epoch of `ds` (as the trainer splits)."""
    total = ds.spec.get("maxSamples") or 1797  # all of digits: 1,797 images
    n_val = min(total - 1, max(1, round(total * ds.spec["validationFraction"])))
    n_train = total - n_val
    return {"n_train": n_train, "n_val": n_val, "steps_per_epoch": -(-n_train // BATCH_SIZE)}


def planned_gflop(archs: list[Arch], ds: Dataset, runs_each: int) -> float:
    """FLOPs of `runs_each` whole-budget runs of every arch in `archs` on `ds`, in GFLOP."""
    sizes = split_sizes(ds)
    evals = ds.epochs * sizes["steps_per_epoch"] // ds.eval_every_steps + ds.epochs
    total = sum(forward_flops(a, ds) * (3 * ds.epochs * sizes["n_train"] + evals * sizes["n_val"])
                for a in archs)
    return runs_each * total / 1e9


def build_zoo(zoo: list[Arch], ds: Dataset, *, root: Path) -> dict[str, Any]:
    """Train and register every zoo model on `ds`; zoo id -> label, accuracy and seconds."""
    entries = {}
    for k, arch in enumerate(zoo):
        job = make_job(arch, ds, name=f"zoo-{ds.label}-{k}", seed=0, warm=False, register=True)
        result = train(job, zoo_uri=str(root), workdir=root.parent, register=True)
        entries[result["zoo_model"]] = {"label": arch.label,
                                        "final_accuracy": result["validation_accuracy"],
                                        "steps": result["steps"],
                                        "wall_seconds": result["wall_seconds"]}
        print(f"  zoo {ds.label} {arch.label:18s} acc {result['validation_accuracy']:.3f} "
              f"({result['wall_seconds']:.1f} s)", flush=True)
    return entries


def run_child(arch: Arch, ds: Dataset, *, seed: int, order: int, zoo_dir: Path,
              zoo_labels: dict[str, str], fwd: int) -> dict[str, Any]:
    """Both arms of one (child, seed), in alternating order; each with its `tta`."""
    arms: dict[str, Any] = {}
    sizes = split_sizes(ds)
    for arm in ARMS[order % 2:] + ARMS[:order % 2]:
        job = make_job(arch, ds, name=f"{ds.label}-child-s{seed}", seed=seed,
                       warm=arm == "chosen")
        run = train(job, zoo_uri=str(zoo_dir) if arm == "chosen" else None, workdir=zoo_dir.parent)
        run["tta"] = to_target(run, steps_per_epoch=sizes["steps_per_epoch"],
                               n_train=sizes["n_train"], n_val=sizes["n_val"], forward_flops=fwd)
        run["parent_label"] = zoo_labels.get(run.get("parent") or "")
        arms[arm] = run
        print(f"  {ds.label} s{seed} {arch.label:18s} {arm:6s} step to target "
              f"{run['steps_to_target']} final {run['validation_accuracy']:.3f} parent "
              f"{run['parent_label']} ({run['wall_seconds']:.1f} s)", flush=True)
    return arms


def child_row(by_seed: dict[int, dict[str, Any]], ds: Dataset) -> dict[str, Any]:
    """One child's medians over seeds of paired ratios and deltas, and what warm start did."""
    runs = list(by_seed.values())
    decisions = [r["chosen"].get("warm_start_decision") or {} for r in runs]

    def ratio(key: str) -> float:
        return _median([r["cold"]["tta"][key] / max(r["chosen"]["tta"][key], 1e-9)
                        for r in runs])

    def probe(key: str) -> float | None:
        values = [d[key] for d in decisions if d.get(key) is not None]
        return _median(values) if values else None

    return {
        "steps_ratio": ratio("steps"), "flops_ratio": ratio("flops"),
        "seconds_ratio": ratio("seconds"),
        "final_delta_points": _median([100 * (r["chosen"]["validation_accuracy"]
                                              - r["cold"]["validation_accuracy"]) for r in runs]),
        **{f"{arm}_{key}": _median([r[arm]["tta"][key] for r in runs])
           for arm in ARMS for key in ("steps", "seconds")},
        **{f"{arm}_final_accuracy": _median([r[arm]["validation_accuracy"] for r in runs])
           for arm in ARMS},
        **{f"{arm}_unreached": sum(not r[arm]["tta"]["reached"] for r in runs) for arm in ARMS},
        "warm_setup_seconds": _median([r["chosen"]["setup_seconds"] - r["cold"]["setup_seconds"]
                                       for r in runs]),
        # The warm arm met the target at its first evaluation: its ratio is a lower bound.
        "warm_at_first_evaluation": sum(r["chosen"]["tta"]["reached"]
                                        and r["chosen"]["tta"]["steps"] <= ds.eval_every_steps
                                        for r in runs),
        "parents": sorted({r["chosen"]["parent_label"] or "cold" for r in runs}),
        "similarity": _median([r["chosen"].get("similarity") or 0.0 for r in runs]),
        "outcomes": sorted({str(d.get("outcome") or r["chosen"].get("warm_start") or "?")
                            for d, r in zip(decisions, runs, strict=True)}),
        "probe_loss": probe("probe_loss"), "cold_probe_loss": probe("cold_probe_loss"),
    }


def summarize(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Medians and worst cases over the children of `rows` (label -> `child_row`)."""
    values = list(rows.values())
    return {
        "median_steps_ratio": _median([r["steps_ratio"] for r in values]),
        "min_steps_ratio": min(r["steps_ratio"] for r in values),
        "worst_final_metric_delta": min(r["final_delta_points"] for r in values),
        "median_final_metric_delta": _median([r["final_delta_points"] for r in values]),
        "median_flops_ratio": _median([r["flops_ratio"] for r in values]),
        "median_tta_ratio": _median([r["seconds_ratio"] for r in values]),
        "median_warm_setup_seconds": _median([r["warm_setup_seconds"] for r in values]),
        "warm_at_first_evaluation": sum(r["warm_at_first_evaluation"] for r in values),
        "guard_cold": sum("cold_guard" in r["outcomes"] for r in values),
        "unreached": {arm: sum(r[f"{arm}_unreached"] for r in values) for arm in ARMS},
        "losses": [label for label, r in rows.items() if r["steps_ratio"] < 1.0],
        "children": len(values),
    }


def goal(summary: dict[str, Any]) -> dict[str, Any]:
    """The targets and whether every one is met."""
    met = all(summary[key] >= bound for key, bound in GOAL.items())
    return {**{f"{key}_at_least": bound for key, bound in GOAL.items()}, "goal_met": met}


def _median(values: list[float]) -> float:
    return round(float(statistics.median(values)), 4)


def print_table(ds: Dataset, rows: dict[str, dict[str, Any]], children: list[Arch]) -> None:
    changes = {a.label: a.change for a in children}
    print(f"\n{ds.label}: targets {ds.targets}, evaluation every {ds.eval_every_steps} steps")
    head = (f"{'child':18s} {'change':58s} {'parent':18s} {'sim':>4s} {'probe w/c':>11s} "
            f"{'decision':18s} {'steps c/w':>9s} {'ratio':>6s} {'acc cold':>8s} {'warm':>6s}")
    print(head)
    print("-" * len(head))
    for label, row in rows.items():
        probe = (f"{row['probe_loss']:.2f}/{row['cold_probe_loss']:.2f}"
                 if row["probe_loss"] is not None and row["cold_probe_loss"] is not None else "-")
        bound = ">" if row["warm_at_first_evaluation"] else " "
        print(f"{label:18s} {changes[label][:58]:58s} {','.join(row['parents'])[:18]:18s} "
              f"{row['similarity']:4.2f} {probe:>11s} {','.join(row['outcomes'])[:18]:18s} "
              f"{row['cold_steps']:4.0f}/{row['chosen_steps']:<4.0f} {bound}{row['steps_ratio']:5.2f} "
              f"{row['cold_final_accuracy']:8.3f} {row['chosen_final_accuracy']:6.3f}")
    print("Medians over seeds. probe w/c: the guard's step-0 probe loss, warm / cold. ratio: "
          "cold / warm steps to target;\n'>': warm met the target at its first evaluation (a "
          "lower bound).")


def plot(per_dataset: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, axes = plt.subplots(1, len(per_dataset), figsize=(6 * len(per_dataset), 4.5),
                             squeeze=False)
    for ax, (label, rows) in zip(axes[0], per_dataset.items(), strict=True):
        names = list(rows)
        ax.bar(range(len(names)), [rows[n]["steps_ratio"] for n in names], color="tab:green")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(GOAL["median_steps_ratio"], color="tab:red", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("steps to target, cold / warm")
        ax.set_title(f"{label} (median over seeds)", fontsize=10)
    common.save_figure(fig, path, title=title)


def main() -> None:
    parser = common.arguments(__doc__, "tiny smoke run (CI)")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds for every dataset (default: digits 0-5, "
                             "Fashion-MNIST 0-2)")
    parser.add_argument("--datasets", default=None, help="comma-separated: digits,fashion")
    parser.add_argument("--children", default=None, help="comma-separated child labels")
    parser.add_argument("--fashion-root", type=Path, default=fashion_mnist.DEFAULT_ROOT,
                        help="Fashion-MNIST root (prepared with npm when absent)")
    args = parser.parse_args()
    common.one_thread()
    quick = args.quick
    # A run of some datasets or children never overwrites the full run's results.
    name = NAME + ("_quick" if quick else "") + ("_partial" if args.datasets or args.children
                                                 else "")
    zoo_archs, children = (QUICK_ZOO, QUICK_CHILDREN) if quick else (ZOO, CHILDREN)
    if args.children:
        wanted = args.children.split(",")
        unknown = sorted(set(wanted) - {a.label for a in children})
        if unknown:
            parser.error(f"--children: unknown {unknown}; choose from "
                         f"{[a.label for a in children]}")
        children = [a for a in children if a.label in wanted]
    sets = datasets(quick=quick, fashion_root=args.fashion_root)
    if args.datasets:
        sets = [d for d in sets if d.label in args.datasets.split(",")]
    if args.seeds:
        sets = [dataclasses.replace(d, seeds=tuple(int(x) for x in args.seeds.split(",")))
                for d in sets]
    if any(d.label == "fashion" for d in sets):
        fashion_mnist.prepare(args.fashion_root)
    load_before, began = os.getloadavg(), time.perf_counter()
    run_count = sum(len(zoo_archs) + len(children) * len(d.seeds) * len(ARMS) for d in sets)
    estimate = SETUP_SECONDS_PER_RUN * run_count + sum(
        SECONDS_PER_GFLOP[d.label] * (planned_gflop(children, d, len(d.seeds) * len(ARMS))
                                      + planned_gflop(zoo_archs, d, 1)) for d in sets)
    print(f"{len(children)} children x {len(ARMS)} arms on "
          f"{', '.join(f'{d.label} ({len(d.seeds)} seeds)' for d in sets)}, zoo of {len(zoo_archs)}: about "
          f"{estimate / 60:.0f} min (estimated from planned FLOPs)", flush=True)
    per_dataset: dict[str, dict[str, Any]] = {}
    details: dict[str, Any] = {"datasets": {}}
    with tempfile.TemporaryDirectory(prefix="kiln-warmstart-") as tmp:
        for ds in sets:
            zoo_dir = Path(tmp) / ds.label / "zoo"
            print(f"{ds.label}: training the zoo ({len(zoo_archs)} models)", flush=True)
            zoo_entries = build_zoo(zoo_archs, ds, root=zoo_dir)
            labels = {i: e["label"] for i, e in zoo_entries.items()}
            runs: dict[str, dict[int, Any]] = {}
            for ci, arch in enumerate(children):
                fwd = forward_flops(arch, ds)
                for seed in ds.seeds:
                    runs.setdefault(arch.label, {})[seed] = run_child(
                        arch, ds, seed=seed, order=ci + seed, zoo_dir=zoo_dir,
                        zoo_labels=labels, fwd=fwd)
            rows = {label: child_row(by_seed, ds) for label, by_seed in runs.items()}
            per_dataset[ds.label] = rows
            details["datasets"][ds.label] = {
                "spec": ds.spec, "side": ds.side, "epochs": ds.epochs, "targets": ds.targets,
                "eval_every_steps": ds.eval_every_steps, "sizes": split_sizes(ds),
                "zoo": zoo_entries, "rows": rows,
                "children": {a.label: {"model": model_spec(a, ds), "change": a.change,
                                       "recipe": RECIPES[a.recipe],
                                       "by_seed": {str(s): runs[a.label][s] for s in ds.seeds}}
                             for a in children}}
            print_table(ds, rows, children)
    everything = {f"{d}/{label}": row for d, rows in per_dataset.items()
                  for label, row in rows.items()}
    summary = summarize(everything)
    summary["per_dataset"] = {d: summarize(rows) for d, rows in per_dataset.items()}
    summary["goal"] = goal(summary)
    summary["goal_met"] = summary["goal"]["goal_met"]
    summary.update({
        "seeds": {d.label: list(d.seeds) for d in sets}, "arms": list(ARMS), "zoo": [a.label for a in zoo_archs],
        "children_labels": [a.label for a in children], "torch_threads": 1, "quick": quick,
        "estimated_seconds": round(estimate, 1),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "bench_seconds": round(time.perf_counter() - began, 1),
    })
    print(f"\nmedian steps ratio {summary['median_steps_ratio']:.2f} (worst child "
          f"{summary['min_steps_ratio']:.2f}; FLOPs {summary['median_flops_ratio']:.2f}, "
          f"seconds {summary['median_tta_ratio']:.2f}); worst final delta "
          f"{summary['worst_final_metric_delta']:+.2f} points; warm at its first evaluation "
          f"{summary['warm_at_first_evaluation']}; losses {summary['losses']}; goal met "
          f"{summary['goal_met']} ({json.dumps(GOAL)}); {summary['bench_seconds']:.0f} s")
    print(f"wrote {common.write_results(name, summary, details)}")
    plot(per_dataset, common.plot_path(name),
         f"Kiln warm start vs cold: {len(children)} children, "
         f"{', '.join(f'{d.label} {len(d.seeds)} seeds' for d in sets)}, "
         f"1 thread")


if __name__ == "__main__":
    main()
