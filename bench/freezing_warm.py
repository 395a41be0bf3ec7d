"""Freezing of warm-started children: what the warm start's unchanged copies are worth.

Writes --out (default bench/results/freezing_warm.json; method below the imports). The freezing
docs' table: `--children deeper --schedules cosine` with `--parent-data fashion` and `digits`
(freezing_warm_fashion.json, _digits.json), and `--children same --schedules constant
--epochs 200 --eval-every 50` (freezing_warm_long.json).

    OMP_NUM_THREADS=1 python bench/freezing_warm.py [--parent-data fashion|digits] [--seeds 0,1,2]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one steady thread per process

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH)]
from kiln import api, contract
from kiln_trainer import loop

# A parent is pretrained (small ResNet [1-1-1]x16, 8x8 inputs) either on Fashion-MNIST (4,000
# images, 6 epochs: another task, fine-tuning) or on digits with the children's split (10
# epochs: Kiln's own pipeline, a child of an accepted parent on the same data). Children train
# on digits (898 training and 899 validation images, `CHILD_EPOCHS` epochs): the parent's own
# shape (every module but the head copied unchanged) or a deeper one (a fourth stage added
# behind the copied three). Per child, schedule and seed, four arms with the same seed, recipe
# and budget (Adam 3e-3, one warm-up epoch, then cosine or constant), evaluated every
# `EVAL_EVERY_STEPS` steps:
#   off      freezing disabled;
#   ignore   the freezing policy as it was, blind to the warm start (transferred: ignore);
#   judge    the copied front modules may freeze at the first decision (transferred: judge);
#   freeze   the copied front modules start frozen at step 0 (transferred: freeze).
# Target per (child, schedule, seed): the off arm's final accuracy (mean of its last 3
# evaluations) less 0.1 point. Measures per arm, at the first evaluation at the target (the
# last one when never met): steps, wall seconds (the training clock) and CPU seconds (this
# process's since the trainer call began, setup included, plus the reference process's
# prorated by steps); the final accuracy (mean of the last 3 evaluations) minus the off arm's;
# the mean share of backward FLOPs skipped over the whole run. Steps are the primary figure: this
# 2-core machine is shared, and wall seconds there move with its load.
NAME = "freezing_warm"
TARGET_MARGIN = 0.001
LAST_EVALS = 3
EVAL_EVERY_STEPS = 5
CHILD_EPOCHS = 30
ARMS = ("off", "ignore", "judge", "freeze")
PARENT = {"architecture": "small_resnet", "args": {"blocks": [1, 1, 1], "width": 16}}
CHILDREN = {
    "same": {"architecture": "small_resnet", "args": {"blocks": [1, 1, 1], "width": 16}},
    "deeper": {"architecture": "small_resnet", "args": {"blocks": [1, 1, 1, 1], "width": 16}},
}


def job(name: str, model: dict[str, Any], dataset: dict[str, Any], *, epochs: int, seed: int,
        schedule: str, freezing: dict[str, Any] | None,
        eval_every: int = EVAL_EVERY_STEPS,
        peft: dict[str, Any] | None = None, pixels: int = 8, batch_size: int = 64,
        device: str = "cpu") -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "model": {**model, "inputShape": [1, pixels, pixels]},
            "dataset": {**dataset, "splitSeed": 0},
            "training": {"epochs": epochs, "batchSize": batch_size, "seed": seed,
                         "device": device,
                         "optimizer": {"name": "adam", "lr": 3e-3, "weightDecay": 0.0},
                         "lrSchedule": {"name": schedule, "warmupEpochs": 1},
                         "evalEverySteps": eval_every, **({"peft": peft} if peft else {})},
            "target": {"metric": "validation_accuracy", "stopAtTarget": False, "value": 1.0},
            "warmStart": {"enabled": name != "parent"},
            "zoo": {"register": name == "parent"},
            "freezing": freezing or {"enabled": False},
        }})


class _Clocked(io.StringIO):
    """The trainer's event stream, each line with this process's CPU seconds when written."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines.extend((time.process_time(), line) for line in text.splitlines())
        return len(text)


def train(spec: api.TrainingJob, *, zoo: Path, workdir: Path) -> dict[str, Any]:
    """Run the trainer in process; the result plus its evaluation curve: (step, training
    clock, CPU seconds since the call began, accuracy) per evaluation."""
    out, cpu = _Clocked(), time.process_time()
    result = loop.main(spec, zoo_uri=str(zoo), register=spec.spec.zoo.register_model,
                       checkpoint_dir=workdir / "ckpt", resume=False, out=out,
                       termination_log=None)
    curve, last = [], None
    for at, line in out.lines:
        event = contract.from_line(line)
        if isinstance(event, contract.Progress) and event.validation_accuracy is not None:
            point = (event.validation_accuracy, event.validation_loss)
            if point != last:
                curve.append((event.step, event.elapsed_seconds, at - cpu,
                              event.validation_accuracy))
                last = point
    return {"result": result, "curve": curve}


def measure(run: dict[str, Any], target: float) -> dict[str, Any]:
    curve, result = run["curve"], run["result"]
    hit = next((i for i, point in enumerate(curve) if point[3] >= target - 1e-9), None)
    step, wall, cpu, _ = curve[hit if hit is not None else -1]
    freezing = result.get("freezing") or {}
    # the reference process's CPU seconds are known for the whole run only: prorated
    cpu += float(freezing.get("reference_cpu_seconds") or 0.0) * step / max(1, result["steps"])
    return {"reached": hit is not None, "steps": step, "wall": round(wall, 3),
            "cpu": round(cpu, 3),
            "final": statistics.mean(p[3] for p in curve[-LAST_EVALS:]),
            "backward_flops_skipped": freezing.get("backward_flops_skipped", 0.0),
            "events": [(e["kind"], e["step"], e["boundary"]) for e in freezing.get("events", [])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--schedules", default="cosine,constant")
    parser.add_argument("--children", default="same,deeper")
    parser.add_argument("--parent-data", choices=("fashion", "digits"), default="fashion")
    parser.add_argument("--epochs", type=int, default=CHILD_EPOCHS, help="the children's")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY_STEPS)
    parser.add_argument("--arms", default=",".join(ARMS), help="off first")
    parser.add_argument("--out", default=str(BENCH / "results" / f"{NAME}.json"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = args.arms.split(",")
    fashion = {"name": "torchvision", "torchvisionClass": "FashionMNIST",
               "path": str(BENCH / "data"), "maxSamples": 4000, "validationFraction": 0.25}
    digits = {"name": "digits", "validationFraction": 0.5}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work, zoo = Path(tmp), Path(tmp) / "zoo"
        parent_job = (job("parent", PARENT, fashion, epochs=6, seed=0, schedule="cosine",
                          freezing=None) if args.parent_data == "fashion" else
                      job("parent", PARENT, digits, epochs=10, seed=0, schedule="cosine",
                          freezing=None))
        parent = train(parent_job, zoo=zoo, workdir=work)
        print(f"parent: accuracy {parent['result']['validation_accuracy']:.3f}", flush=True)
        for child in args.children.split(","):
            for schedule in args.schedules.split(","):
                for seed in seeds:
                    runs = {}
                    for arm in arms:
                        knobs = None if arm == "off" else {"transferred": arm}
                        spec = job(f"child-{arm}", CHILDREN[child], digits, epochs=args.epochs,
                                   seed=seed, schedule=schedule, freezing=knobs,
                                   eval_every=args.eval_every)
                        runs[arm] = train(spec, zoo=zoo, workdir=work)
                    off_final = statistics.mean(
                        p[3] for p in runs["off"]["curve"][-LAST_EVALS:])
                    target = off_final - TARGET_MARGIN
                    row = {"child": child, "schedule": schedule, "seed": seed,
                           "target": round(target, 4),
                           "parent": runs["off"]["result"].get("parent")}
                    for arm, run in runs.items():
                        m = measure(run, target)
                        m["final_delta_points"] = round(100 * (m["final"] - off_final), 2)
                        row[arm] = m
                    rows.append(row)
                    print(json.dumps({k: (v if not isinstance(v, dict) else
                                          {x: v[x] for x in ("steps", "cpu", "wall",
                                                             "final_delta_points",
                                                             "backward_flops_skipped", "events")})
                                      for k, v in row.items()}), flush=True)
    summary = {}
    for child in args.children.split(","):
        for schedule in args.schedules.split(","):
            sel = [r for r in rows if r["child"] == child and r["schedule"] == schedule]
            summary[f"{child}/{schedule}"] = {
                arm: {"median_steps_ratio": statistics.median(
                          r["off"]["steps"] / max(1, r[arm]["steps"]) for r in sel),
                      "median_cpu_ratio": statistics.median(
                          r["off"]["cpu"] / max(1e-9, r[arm]["cpu"]) for r in sel),
                      "median_wall_ratio": statistics.median(
                          r["off"]["wall"] / max(1e-9, r[arm]["wall"]) for r in sel),
                      "worst_final_delta_points": min(r[arm]["final_delta_points"] for r in sel),
                      "median_backward_flops_skipped": statistics.median(
                          r[arm]["backward_flops_skipped"] for r in sel),
                      "reached": sum(r[arm]["reached"] for r in sel)}
                for arm in arms[1:]}
    doc = {"parent_data": args.parent_data, "child_epochs": args.epochs, "summary": summary,
           "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n",
                              encoding="utf-8")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
