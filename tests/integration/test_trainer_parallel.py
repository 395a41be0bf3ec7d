"""kiln_trainer.distributed.parallel across real processes: DDP and FSDP on two gloo ranks, torchrun.

Issue 5's trainer tests: DDP on CPU (two gloo processes) matches single-process training on the
same global batch; a checkpoint written by two processes resumes in one at the same global
position; DDP built after freezing keeps frozen parameters out of its reducer; FSDP2 (which
runs on CPU with gloo) matches too and its gathered checkpoints load anywhere. The ranks are
spawned by `parallel_harness.run_ranks` (torchrun's environment, OMP_NUM_THREADS=1); the
reference runs happen in this process with a one-process context. Tolerances: float32
reductions in another order (gradient averaging over ranks) differ by ~1e-7 per step; Adam
and 10 steps keep parameters within 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import parallel_harness as harness
import pytest
import torch

from kiln import contract
from kiln_trainer.distributed import parallel

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds its module fixtures

SAVE_STEP, UNTIL_STEP = 7, 12  # steps per epoch: 5, so the checkpoint is at epoch 1, batch 2
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The one-process reference: the same training, in this process."""
    torch.set_num_threads(1)
    directory = str(tmp_path_factory.mktemp("single"))
    return harness.train_with_checkpoint(parallel.Context(), directory, SAVE_STEP, UNTIL_STEP)


@pytest.fixture(scope="module")
def ddp_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def ddp_ranks(ddp_dir: str) -> list[dict[str, Any]]:
    return harness.run_ranks(harness.train_with_checkpoint, 2, "ddp", ddp_dir, SAVE_STEP,
                             UNTIL_STEP)


@pytest.fixture(scope="module")
def fsdp_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def fsdp_ranks(fsdp_dir: str) -> list[dict[str, Any]]:
    return harness.run_ranks(harness.train_with_checkpoint, 2, "fsdp", fsdp_dir, SAVE_STEP,
                             UNTIL_STEP, True)


def test_ddp_on_two_gloo_processes_matches_single_process_training(
    ddp_ranks: list[dict[str, Any]], single_run: dict[str, Any]
) -> None:
    rank0, rank1 = ddp_ranks
    assert rank0["samples"] == rank1["samples"] == single_run["samples"] // 2  # sharded
    assert harness.max_difference(rank0["params"], single_run["params"]) < TOLERANCE
    assert harness.max_difference(rank0["params"], rank1["params"]) == 0.0  # replicas agree
    assert rank0["losses"] == pytest.approx(single_run["losses"], abs=TOLERANCE)


def test_ddp_validation_shards_sum_to_the_single_process_evaluation(
    ddp_ranks: list[dict[str, Any]], single_run: dict[str, Any]
) -> None:
    loss_sum, correct, count = ddp_ranks[0]["eval"]
    assert ddp_ranks[1]["eval"] == ddp_ranks[0]["eval"]
    assert count == harness.SAMPLES and correct == single_run["eval"][1]
    assert loss_sum == pytest.approx(single_run["eval"][0], rel=1e-5)


def test_checkpoint_from_two_ddp_processes_resumes_in_one_at_the_same_global_position(
    ddp_ranks: list[dict[str, Any]], ddp_dir: str, single_run: dict[str, Any]
) -> None:
    torch.set_num_threads(1)
    resumed = harness.resume(parallel.Context(), ddp_dir, UNTIL_STEP)
    assert harness.max_difference(resumed, ddp_ranks[0]["params"]) < TOLERANCE
    assert harness.max_difference(resumed, single_run["params"]) < TOLERANCE


def test_ddp_built_after_freezing_leaves_frozen_parameters_out_of_its_reducer() -> None:
    rank0, rank1 = harness.run_ranks(harness.freeze_and_rewrap, 2, "ddp")
    assert rank0["wrapper"] == "DistributedDataParallel"
    # The reducer holds exactly the trainable tensors: stem frozen, then stem and blocks.
    assert [tensors for tensors, _ in rank0["reducer"]] == rank0["trainable"]
    start, after_two, end = rank0["snapshots"]
    trainable_bytes = [sum(v.numel() * v.element_size() for k, v in start.items()
                           if "running_" not in k and not k.startswith(frozen))
                       for frozen in (("stem.",), ("stem.", "blocks."))]
    assert [size for _, size in rank0["reducer"]] == trainable_bytes
    assert rank0["stem_grads_none"]
    for name in start:
        if name.startswith("stem.") and not name.endswith(("running_mean", "running_var")):
            assert torch.equal(start[name], end[name]), name  # frozen from the start
        if name.startswith("blocks.") and "running" not in name:
            assert torch.equal(after_two[name], end[name]), name  # frozen after the re-wrap
    assert not torch.equal(after_two["head.2.weight"], end["head.2.weight"])  # still trains
    assert harness.max_difference(end, rank1["snapshots"][-1]) == 0.0


def test_fsdp_on_two_gloo_processes_matches_single_process_training(
    fsdp_ranks: list[dict[str, Any]], single_run: dict[str, Any]
) -> None:
    rank0, rank1 = fsdp_ranks
    assert harness.max_difference(rank0["params"], single_run["params"]) < TOLERANCE
    assert rank1["params"] == {}  # full state is gathered on rank 0 only
    assert rank0["losses"] == pytest.approx(single_run["losses"], abs=TOLERANCE)
    assert rank0["eval"][2] == harness.SAMPLES  # every rank evaluated the whole split
    assert rank0["eval"][1] == single_run["eval"][1]


def test_fsdp_checkpoint_resumes_under_fsdp_and_in_one_process(
    fsdp_ranks: list[dict[str, Any]], fsdp_dir: str, single_run: dict[str, Any]
) -> None:
    torch.set_num_threads(1)
    assert harness.max_difference(fsdp_ranks[0]["resumed"], single_run["params"]) < TOLERANCE
    resumed = harness.resume(parallel.Context(), fsdp_dir, UNTIL_STEP)
    assert harness.max_difference(resumed, single_run["params"]) < TOLERANCE


def test_sharded_fsdp_checkpoint_resumes_under_fsdp_and_in_one_process(
    fsdp_ranks: list[dict[str, Any]], fsdp_dir: str, single_run: dict[str, Any]
) -> None:
    """Each rank wrote only its shards; W=2 and W=1 (DCP reshards) resume at the same position
    with the same weights as the uninterrupted run."""
    torch.set_num_threads(1)
    rank0 = fsdp_ranks[0]
    assert harness.max_difference(rank0["resumed_sharded"], single_run["params"]) < TOLERANCE
    resumed = harness.resume(parallel.Context(), fsdp_dir, UNTIL_STEP, sharded=True)
    assert harness.max_difference(resumed, single_run["params"]) < TOLERANCE
    shard_bytes, full_bytes = rank0["shard_bytes"], rank0["full_bytes"]
    assert len(shard_bytes) == 2 and all(0 < b < full_bytes for b in shard_bytes)
    folder = Path(fsdp_dir) / "parallel-test" / "sharded.pt.shards" / "a"
    assert sorted(p.name for p in folder.iterdir()) == [
        "metadata.json", "rank-0.safetensors", "rank-1.safetensors"]
    assert (folder.parent.parent / "sharded.pt").stat().st_size < full_bytes
    metadata = json.loads((folder / "metadata.json").read_text())
    head = metadata["tensors"]["model.head.2.weight"]  # [10, 8]: rows 0-4 and 5-9
    assert head["size"] == [10, 8] and head["chunks"] == [[[0, 0], [5, 8]], [[5, 0], [5, 8]]]
    writers = {entry[3] for entry in metadata["storage"] if entry[0] == "model.head.2.weight"}
    assert writers == {0, 1}  # each rank wrote its own half


def test_trainer_command_runs_ranks_under_torchrun_and_only_rank_0_prints(tmp_path: Path) -> None:
    command = contract.trainer_command(2, ["--rank-report"])
    assert command[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            "2", "-m"]
    command[command.index("kiln_trainer")] = "parallel_probe"  # a stand-in trainer (below)
    (tmp_path / "parallel_probe.py").write_text(_PROBE)
    # Only the stand-in's folder: kiln and torch come from the venv, and an inherited sys.path
    # may hold folders (bench/) whose modules shadow the standard library's.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines == [{"rank": 0, "world_size": 2, "parallelism": "ddp", "backend": "gloo",
                      "argv": ["--rank-report"], "from_rank_0": 7, "any": True, "mean": 0.5,
                      "agreed": [True, 5]}]


_PROBE = '''
import json, sys
from kiln_trainer.distributed import parallel

ctx = parallel.setup("auto", "cpu")
from_rank_0 = ctx.broadcast_int(7 if ctx.is_main else -1)
any_flag, mean = ctx.any_rank(ctx.rank == 1), ctx.all_reduce_mean(float(ctx.rank))
agreed = ctx.agree(stop=ctx.rank == 1, decision=5 if ctx.is_main else 0)
if ctx.is_main:
    print(json.dumps({"rank": ctx.rank, "world_size": ctx.world_size,
                      "parallelism": ctx.parallelism, "backend": ctx.backend,
                      "argv": sys.argv[1:], "from_rank_0": from_rank_0, "any": any_flag,
                      "mean": mean, "agreed": agreed}), flush=True)
ctx.barrier()
ctx.shutdown()
'''
