"""What freezing costs when set by hand: one case and seed of bench/freezing.py, full training vs
the same job with its frozen prefix moved at given steps (0 thaws every block).

Writes bench/results/freezing_boundaries.json (`--quick`: freezing_boundaries_quick.*), one
schedule per run; the diagnostics quoted in docs/benchmarks.md came from it.
    OMP_NUM_THREADS=1 python bench/freezing_boundaries.py --case resnet20 --seed 1 \
        --boundaries 800:4,1120:0,1240:4
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one steady thread per process

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import fashion_mnist
import freezing


def parse_boundaries(text: str) -> list[tuple[int, int]]:
    """"STEP:K,STEP:K" -> [(step, k)]: after optimizer step STEP, freeze exactly K blocks."""
    try:
        pairs = [tuple(int(v) for v in item.split(":")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or p[0] < 1 or p[1] < 0 for p in pairs):
        raise SystemExit(f"--boundaries: {text!r} is not STEP:K[,STEP:K...] with STEP >= 1 "
                         "and K >= 0 (for example 800:4,1120:0)")
    return [(p[0], p[1]) for p in pairs]


def run(case: freezing.Case, seed: int, boundaries: list[tuple[int, int]]) -> dict[str, Any]:
    """Full training, then the hand-set arm (a thaw clears the re-activated parameters'
    optimizer state, as the policy's does); both arms' records and the deltas."""
    job, splits, spe = freezing.load(case, seed)
    total = case.epochs * spe
    hand = freezing.Arm("fixed", job, splits, spe, boundaries)  # every arm seeds its own weights
    assert hand.freezer is not None
    most = len(hand.freezer.partition.blocks) - 1  # never the head
    if max(k for _, k in boundaries) > most:
        raise SystemExit(f"--boundaries: at most {most} blocks of {case.label} can freeze")
    hand.freezer.optimizer = hand.optimizer
    records = {}
    for name, arm in (("full", freezing.Arm("full", job, splits, spe)), ("fixed", hand)):
        for until in freezing.eval_steps(total, case.eval_points):
            arm.train(until)
            arm.evaluate()
        records[name] = arm.close()
    final = {name: freezing.final_accuracy(r["curve"], total) for name, r in records.items()}
    full, fixed = records["full"], records["fixed"]
    return {
        "case": case.label, "seed": seed, "boundaries": boundaries, "total_steps": total,
        "final_delta_points": round(100 * (final["fixed"] - final["full"]), 3),
        "last_eval_delta_points": round(
            100 * (fixed["curve"][-1]["accuracy"] - full["curve"][-1]["accuracy"]), 3),
        "whole_run_cpu_ratio": round(full["train_cpu_seconds"]
                                     / max(fixed["train_cpu_seconds"], 1e-9), 4),
        "backward_flops_skipped": fixed["freezing"]["backward_flops_skipped"],
        "full_final_accuracy": final["full"], "arms": records}


def main() -> None:
    parser = common.arguments(__doc__, "the CI smoke case")
    parser.add_argument("--case", default=None, help="resnet20 or lm (bench/freezing.py's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--boundaries", default=None, help="STEP:K[,STEP:K...]; K=0 thaws")
    parser.add_argument("--fashion-root", type=Path, default=fashion_mnist.DEFAULT_ROOT)
    args = parser.parse_args()
    common.one_thread()
    label = args.case or ("resnet-quick" if args.quick else "resnet20")
    boundaries = parse_boundaries(args.boundaries or ("10:2,20:0,25:2" if args.quick
                                                      else "800:4"))
    fashion_mnist.prepare(args.fashion_root)
    known = freezing.cases(quick=args.quick, fashion_root=args.fashion_root)
    case = next((c for c in known if c.label == label), None)
    if case is None:
        raise SystemExit(f"--case: {label!r} is not one of {[c.label for c in known]}")
    result = run(case, args.seed, boundaries)
    summary = {k: v for k, v in result.items() if k != "arms"}
    print(summary)
    name = "freezing_boundaries" + ("_quick" if args.quick else "")
    print(f"wrote {common.write_results(name, summary, {'arms': result['arms']})}")


if __name__ == "__main__":
    main()
