"""Layer freezing under FSDP2 on two gloo processes: the frozen prefix stays inside the sharded
model (no split: FSDP's hooks run in its forward), without gradients, and the policy decides
with every rank in its probes and reference refreshes.

The ranks run `fsdp_freezing_harness.freeze_under_fsdp` (a boundary set by hand), then
`policy_under_fsdp` (rank 0's reference process decides); weight decay and momentum are on, so
a frozen parameter that still reached the optimizer (a zero gradient, stale momentum) would
move. The last test runs the default trainer under torchrun with ``--parallelism fsdp``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import fsdp_freezing_harness
import parallel_harness as harness
import pytest
import torch
import yaml

from kiln import contract

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds its module fixtures


@pytest.fixture(scope="module")
def both_ranks() -> list[dict[str, Any]]:
    return harness.run_ranks(fsdp_freezing_harness.both_under_fsdp, 2, "fsdp",
                             timeout_seconds=480.0)


@pytest.fixture(scope="module")
def ranks(both_ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rank["by_hand"] for rank in both_ranks]


def test_frozen_parameters_stay_bit_identical_over_later_fsdp_steps(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        first, *later = rank["stem_shards"]
        assert later, "training went on after the freeze"
        for shards in later:
            for name, shard in shards.items():
                assert torch.equal(shard, first[name]), f"stem.{name} moved after the freeze"
        assert rank["stem_grads_none"]
    assert any(shard.numel() for shard in ranks[1]["stem_shards"][0].values()), "sharded"


def test_the_sharded_model_is_not_split_and_the_loss_keeps_falling(
    ranks: list[dict[str, Any]],
) -> None:
    rank0, rank1 = ranks
    assert rank0["trainable_is_wrapped"] and rank1["trainable_is_wrapped"]
    assert "FSDP" in rank0["split_reason"]
    losses = rank0["losses"]
    assert losses == rank1["losses"]
    frozen_from = fsdp_freezing_harness.FREEZE_AFTER_EPOCH
    assert losses[-1] < losses[frozen_from], f"the loss fell after the freeze: {losses}"


@pytest.fixture(scope="module")
def policy_ranks(both_ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rank["policy"] for rank in both_ranks]


def test_the_policy_freezes_a_prefix_under_fsdp_at_the_same_step_on_every_rank(
    policy_ranks: list[dict[str, Any]],
) -> None:
    rank0, rank1 = policy_ranks
    assert rank0["events"], f"no decision in {rank0['steps']} steps"
    assert rank0["events"][0][0] == "froze"
    assert rank0["events"] == rank1["events"]
    kind, _, _, boundary = rank0["events"][-1]
    assert kind == "froze" and boundary >= 1, f"the last change unfroze: {rank0['events']}"
    assert rank0["frozen_from"] is not None


def test_parameters_the_policy_froze_stay_bit_identical_and_the_loss_keeps_falling(
    policy_ranks: list[dict[str, Any]],
) -> None:
    for rank in policy_ranks:
        first, *later = rank["frozen_shards"]
        assert len(later) >= fsdp_freezing_harness.POLICY_EPOCHS_AFTER - 1
        for shards in later:
            for name, shard in shards.items():
                assert torch.equal(shard, first[name]), f"{name} moved after the freeze"
        assert rank["frozen_grads_none"]
    losses, since = policy_ranks[0]["losses"], policy_ranks[0]["frozen_from"]
    assert losses == policy_ranks[1]["losses"]
    early, late = losses[since: since + 3], losses[-3:]
    assert sum(late) < sum(early), f"the loss did not fall after the freeze: {losses[since:]}"


def test_the_default_trainer_freezes_under_fsdp_and_completes(tmp_path: Path) -> None:
    job = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "digits-fsdp-freeze"},
        "spec": {
            "model": {"architecture": "small_cnn", "inputShape": [1, 8, 8],
                      "args": {"depth": 3, "width": 8}},
            "dataset": {"name": "digits", "maxSamples": 400},  # 10 steps per epoch
            "training": {"epochs": 20, "batchSize": 32, "seed": 5,
                         "optimizer": {"name": "adam", "lr": 0.005}},
            "freezing": {"checkEverySteps": 1, "window": 3, "patience": 1, "tolerance": 10,
                         "peakFraction": 1, "reference": "fp32"},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    argv = ["--job", str(path), "--checkpoint-dir", str(tmp_path / "checkpoints"),
            "--parallelism", "fsdp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("KILN_ZOO", None)
    done = subprocess.run(contract.trainer_command(2, argv), capture_output=True, text=True,
                          env=env, timeout=480, check=False)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[-1]["event"] == "result", done.stderr[-3000:]
    infos = [e["message"] for e in lines if e["event"] == "info"]
    assert any(m.startswith("freezing: ") for m in infos), infos
    moves = [m for m in infos if m.startswith(("froze ", "unfroze "))]
    assert moves and moves[0].startswith("froze "), f"nothing froze in {lines[-1]['steps']} " \
        f"steps: {infos}"
    assert lines[-1]["freezing"]["frozen"], lines[-1]["freezing"]
    by_rank = [re.findall(rf"INFO rank {rank} kiln_trainer\.freezing\.controller: "
                          r"((?:un)?froze .+ at step \d+):", done.stderr) for rank in (0, 1)]
    assert by_rank[0] == by_rank[1] and len(by_rank[0]) == len(moves), by_rank
    # each rank wrote its own shards at every checkpoint; the finished job left none behind
    for rank in (0, 1):
        assert re.search(rf"INFO rank {rank} kiln_trainer\.jobcontext: checkpoint shard: \d+ "
                         "bytes", done.stderr), done.stderr[-3000:]
    assert not [p for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()]
