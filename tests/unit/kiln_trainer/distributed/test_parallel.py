"""kiln_trainer.distributed.parallel in one process: setup from torchrun's environment, errors.

The collectives across real processes (DDP, FSDP, torchrun) are in
tests/integration/test_trainer_parallel.py.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from kiln_trainer import runtime
from kiln_trainer.distributed import parallel

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No torchrun variables unless the test sets them."""
    for name in _TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_single_process_has_no_process_group_and_collectives_are_the_identity(
    torchrun_env: pytest.MonkeyPatch,
) -> None:
    ctx = parallel.setup("single", "cpu")
    model = torch.nn.Linear(2, 2)
    assert (ctx.parallelism, ctx.rank, ctx.world_size, ctx.backend) == ("single", 0, 1, None)
    assert ctx.is_main and not ctx.distributed and not torch.distributed.is_initialized()
    assert ctx.wrap(model) is model and ctx.rewrap(model, model) is model
    assert ctx.prepare_eval(model, model) is model
    assert ctx.broadcast_int(5) == 5 and ctx.broadcast_object({"a": 1}) == {"a": 1}
    assert ctx.all_reduce_mean(2.5) == 2.5 and ctx.all_reduce_sum([1, 2]) == [1.0, 2.0]
    assert ctx.any_rank(True) and not ctx.any_rank(False)
    assert ctx.agree(stop=False, decision=3) == (False, 3)
    with pytest.raises(ValueError, match="decision -1: must be >= 0"):
        ctx.agree(stop=False, decision=-1)
    assert ctx.gather_objects("x") == ["x"] and ctx.sum_eval_shards([3, 4]) == [3.0, 4.0]
    assert ctx.full_state_dict(model, model).keys() == model.state_dict().keys()
    ctx.barrier()
    ctx.shutdown()


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp", "auto"])
def test_any_parallelism_with_one_process_trains_as_a_single_process(
    torchrun_env: pytest.MonkeyPatch, parallelism: str
) -> None:
    torchrun_env.setenv("WORLD_SIZE", "1")
    ctx = parallel.setup(parallelism, "cpu")
    assert ctx.parallelism == "single" and ctx.shard == (0, 1) and ctx.eval_shard == (0, 1)


def test_single_under_torchrun_with_two_processes_is_refused(
    torchrun_env: pytest.MonkeyPatch,
) -> None:
    torchrun_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(runtime.ConfigError, match="parallelism single.*2 processes.*ddp or fsdp"):
        parallel.setup("single", "cpu")


@pytest.mark.parametrize(("parallelism", "device", "match"), [
    pytest.param("pipeline", "cpu", "'pipeline' is not one of single, ddp, fsdp", id="mode"),
    pytest.param("ddp", "tpu", "'tpu' is not one of cpu, cuda", id="device"),
])
def test_unknown_parallelism_or_device_is_refused(
    torchrun_env: pytest.MonkeyPatch, parallelism: str, device: str, match: str
) -> None:
    with pytest.raises(runtime.ConfigError, match=match):
        parallel.setup(parallelism, device)


def test_torchrun_environment_without_master_address_names_the_missing_variables(
    torchrun_env: pytest.MonkeyPatch,
) -> None:
    torchrun_env.setenv("WORLD_SIZE", "2")
    torchrun_env.setenv("RANK", "1")
    with pytest.raises(runtime.ConfigError, match="MASTER_ADDR, MASTER_PORT unset"):
        parallel.setup("ddp", "cpu")


@pytest.mark.parametrize(("variables", "match"), [
    pytest.param({"RANK": "one"}, "RANK='one' is not an integer", id="not-a-number"),
    pytest.param({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2, WORLD_SIZE=2", id="out-of-range"),
])
def test_malformed_torchrun_environment_is_a_config_error(
    torchrun_env: pytest.MonkeyPatch, variables: dict[str, str], match: str
) -> None:
    for name, value in variables.items():
        torchrun_env.setenv(name, value)
    with pytest.raises(runtime.ConfigError, match=match):
        parallel.setup("ddp", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_visible_gpu_is_a_config_error(torchrun_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(runtime.ConfigError, match="LOCAL_RANK 0 needs GPU 0 but 0 are visible"):
        parallel.setup("ddp", "cuda")


def test_a_global_batch_the_ranks_cannot_share_names_the_field_and_nearby_sizes() -> None:
    ctx = parallel.Context("ddp", rank=0, world_size=3)
    assert ctx.local_batch_size(129) == 43
    with pytest.raises(runtime.ConfigError,
                       match=r"spec.training.batchSize: 128 .* 3 ddp .* \(e.g. 126, 129\)"):
        ctx.local_batch_size(128)


def test_ddp_ranks_evaluate_their_range_while_fsdp_ranks_evaluate_everything() -> None:
    assert parallel.Context("ddp", rank=1, world_size=4).eval_shard == (1, 4)
    assert parallel.Context("fsdp", rank=1, world_size=4).eval_shard == (0, 1)
    assert parallel.Context("fsdp", rank=1, world_size=4).shard == (1, 4)


def test_fsdp_refuses_to_rewrap_a_module_split_off_the_sharded_model() -> None:
    ctx = parallel.Context("fsdp", rank=0, world_size=2)
    model, suffix = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert ctx.rewrap(model, model) is model
    with pytest.raises(ValueError, match="freeze its prefix by requires_grad"):
        ctx.rewrap(model, suffix)


def test_the_exit_handler_leaves_the_group_and_frees_a_ddp_wrapper_while_python_is_alive(
        tmp_path: Path) -> None:
    gc.disable()  # as at exit: nothing collected the wrapper's reference cycle yet
    try:
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1), rank=0,
            world_size=1)
        net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 3))
        net(torch.randn(2, 3)).sum().backward()
        wrapper = weakref.ref(net)
        del net  # a reference cycle: only a collection frees it, and the group it holds
        parallel._release_at_exit()
        released = wrapper() is None and not torch.distributed.is_initialized()
    finally:
        gc.enable()
        if torch.distributed.is_initialized():  # failed: leave no group to this worker's tests
            torch.distributed.destroy_process_group()
    assert released
