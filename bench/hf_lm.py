"""Hugging Face GPT-2 as a user model: a 6-layer child warm-started from a 4-layer, narrower parent.

Writes bench/results/hf_lm.json, or hf_lm_quick.json with ``--quick`` (method below the imports).

    OMP_NUM_THREADS=1 python bench/hf_lm.py [--quick] [--seeds 0,1]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one steady thread per process

import io
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from kiln import api, contract
from kiln_trainer import loop

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "hf"

# Method. Per seed: train the parent (examples/hf/models.py `gpt2_lm`, 4 blocks of width 64) cold
# on a text corpus built here from Python standard library sources (bytes, V = 256) and register
# it in a fresh zoo; then the child (6 blocks of width 96) twice, same seed, recipe and step
# budget, stopAtTarget false: cold (warmStart disabled) and warm (the trainer decides: the parent
# is the only zoo model; its weights are transformed into the child, the learning rate damped).
# Both evaluate every EVAL_EVERY steps. The target is the cold run's final validation loss; each
# arm's steps and training-clock seconds to the first evaluation at or below it are reported side
# by side (the warm arm's seconds include no parent search: the trainer's clock starts after warm
# start, whose cost is `warm_start_seconds`). The entrypoint runs in this process, as the trainer
# runs it: examples/hf is put on sys.path. Ratios are cold / warm per seed, median over seeds.
NAME = "hf_lm"
EVAL_EVERY = 10
FULL = {"corpus": "email", "length": 64, "batch": 32, "parent_epochs": 3, "child_epochs": 2,
        "parent": {"n_layer": 4, "n_embd": 64, "n_head": 4},
        "child": {"n_layer": 6, "n_embd": 96, "n_head": 4}}
# The smoke run: 640 windows, and no freezing (its reference process would outlive so short a
# run's training, and the full run reports what freezing does).
QUICK = {"corpus": "json", "length": 32, "batch": 32, "parent_epochs": 1, "child_epochs": 1,
         "parent": {"n_layer": 1, "n_embd": 32, "n_head": 2},
         "child": {"n_layer": 2, "n_embd": 48, "n_head": 2},
         "max_samples": 640, "freezing": False}


def make_job(name: str, args: dict[str, Any], *, setup: dict[str, Any], seed: int,
             epochs: int, warm: bool, register: bool) -> api.TrainingJob:
    """One run: the example's GPT-2 on the corpus, the whole budget (no stop at the target)."""
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "model": {"entrypoint": "models:gpt2_lm", "args": {**args, "n_positions": 256},
                      "task": "language_model", "inputShape": [setup["length"]]},
            "dataset": {"name": "text", "path": corpus(setup["corpus"]),
                        "validationFraction": 0.1, "splitSeed": seed,
                        "maxSamples": setup.get("max_samples")},
            "training": {"epochs": epochs, "batchSize": setup["batch"], "seed": seed,
                         "optimizer": {"name": "adamw", "lr": 3.0e-3, "weightDecay": 0.01},
                         "lrSchedule": {"name": "cosine"}, "evalEverySteps": EVAL_EVERY,
                         "device": "cpu"},
            "target": {"metric": "validation_loss", "value": 0.01, "stopAtTarget": False},
            "warmStart": {"enabled": warm}, "zoo": {"register": register},
            "freezing": {"enabled": setup.get("freezing", True)},
        }})


def corpus(package: str) -> str:
    """A standard library package's folder: Python sources as text (nothing downloaded)."""
    return str(Path(sysconfig.get_paths()["stdlib"]) / package)


def train(job: api.TrainingJob, *, zoo: Path, work: Path, register: bool) -> dict[str, Any]:
    """Run Kiln's trainer in process; its result plus the evaluation curve."""
    out, began = io.StringIO(), time.perf_counter()
    result = loop.main(job, zoo_uri=str(zoo), register=register, checkpoint_dir=work / "ckpt",
                       resume=False, out=out, termination_log=None)
    curve: list[list[float]] = []
    for line in out.getvalue().splitlines():
        event = contract.from_line(line)
        if isinstance(event, contract.Progress) and event.validation_loss is not None:
            point = [event.step, round(event.validation_loss, 4), round(event.elapsed_seconds, 2)]
            if not curve or curve[-1][1] != point[1]:
                curve.append(point)
    return {**result, "curve": curve, "call_seconds": round(time.perf_counter() - began, 2)}


def to_target(curve: list[list[float]], target: float) -> tuple[int | None, float | None]:
    """(steps, seconds) of the first evaluation at or below `target`, or (None, None)."""
    hit = next((p for p in curve if p[1] <= target), None)
    return (None, None) if hit is None else (int(hit[0]), hit[2])


def frozen_modules(summary: dict[str, Any] | None) -> int | None:
    """The most blocks frozen at once (None: freezing was off)."""
    if not summary:
        return None
    return max((int(e["boundary"]) for e in summary.get("events", [])), default=0)


def run_seed(seed: int, setup: dict[str, Any], root: Path) -> dict[str, Any]:
    zoo, work = root / f"zoo-{seed}", root / f"work-{seed}"
    parent = train(make_job(f"parent-s{seed}", setup["parent"], setup=setup, seed=seed,
                            epochs=setup["parent_epochs"], warm=False, register=True),
                   zoo=zoo, work=work / "parent", register=True)
    arms = {}
    for arm in ("cold", "warm"):
        job = make_job(f"child-{arm}-s{seed}", setup["child"], setup=setup, seed=seed,
                       epochs=setup["child_epochs"], warm=arm == "warm", register=False)
        arms[arm] = train(job, zoo=zoo, work=work / arm, register=False)
    target = arms["cold"]["validation_loss"]
    row: dict[str, Any] = {"seed": seed, "target_loss": target,
                           "parent": {"loss": parent["validation_loss"],
                                      "steps": parent["steps"], "zoo_model": parent["zoo_model"],
                                      "wall_seconds": parent["wall_seconds"]}}
    for arm, result in arms.items():
        steps, seconds = to_target(result["curve"], target)
        row[arm] = {"steps_to_target": steps, "seconds_to_target": seconds,
                    "final_loss": result["validation_loss"], "steps": result["steps"],
                    "wall_seconds": result["wall_seconds"], "curve": result["curve"],
                    "first_loss": result["curve"][0][1] if result["curve"] else None,
                    "parent": result.get("parent"), "similarity": result.get("similarity"),
                    "frozen_modules": frozen_modules(result.get("freezing")),
                    "warm_start_seconds": round(result["call_seconds"]
                                                - result["wall_seconds"], 2)}
    return row


def main() -> None:
    parser = common.arguments(__doc__ or "", "a CI smoke: 1- and 2-block models, one epoch")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds (default 0,1; with --quick 0)")
    options = parser.parse_args()
    common.one_thread()
    setup = QUICK if options.quick else FULL
    seeds = [int(s) for s in (options.seeds or ("0" if options.quick else "0,1")).split(",")]
    sys.path.insert(0, str(EXAMPLE))  # the user's package, as `kiln run` puts it on the path
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-hf-lm-") as tmp:
        for seed in seeds:
            row = run_seed(seed, setup, Path(tmp))
            rows.append(row)
            cold, warm = row["cold"], row["warm"]
            print(f"seed {seed}: target loss {row['target_loss']:.3f} (cold final); steps to "
                  f"target cold {cold['steps_to_target']} warm {warm['steps_to_target']}; "
                  f"seconds cold {cold['seconds_to_target']} warm {warm['seconds_to_target']}; "
                  f"first eval loss cold {cold['first_loss']} warm {warm['first_loss']} "
                  f"(similarity {warm['similarity']})", flush=True)
    steps = [r["cold"]["steps_to_target"] / r["warm"]["steps_to_target"] for r in rows
             if r["warm"]["steps_to_target"] and r["cold"]["steps_to_target"]]
    seconds = [r["cold"]["seconds_to_target"] / r["warm"]["seconds_to_target"] for r in rows
               if r["warm"]["seconds_to_target"] and r["cold"]["seconds_to_target"]]
    summary = {
        "median_steps_ratio": round(statistics.median(steps), 3) if steps else None,
        "median_seconds_ratio": round(statistics.median(seconds), 3) if seconds else None,
        "warm_reached_target": sum(r["warm"]["steps_to_target"] is not None for r in rows),
        "seeds": len(rows),
        "parent": setup["parent"], "child": setup["child"], "corpus": setup["corpus"],
    }
    path = common.write_results(f"{NAME}_quick" if options.quick else NAME, summary,
                                {"rows": rows, "setup": setup, "eval_every": EVAL_EVERY})
    print(f"summary: {summary}\nwrote {path}")


if __name__ == "__main__":
    main()
