"""FSDP2 for the trainer: shard a model by its natural blocks; full state in and out.

Full state is keyed like a single process's ``state_dict()``, so zoo weights do not depend on W
or on the parallelism (sharded checkpoints: `kiln_trainer.distributed.shardstore`). Never
here: mixed precision, CPU offload of parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed import device_mesh
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.checkpoint import state_dict as dcp

from kiln import models

# Gather full tensors, on the CPU, on rank 0 only: a W-times copy on every rank would not fit
# where FSDP is needed.
_GATHER = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
# Every rank passes the full tensors and keeps its shard.
_SCATTER = dcp.StateDictOptions(full_state_dict=True)


def shard(model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    """Shard `model` in place over `world_size` ranks on `device`'s kind; returns `model`.

    ``fully_shard`` (FSDP2, per-parameter DTensor sharding over a 1-D mesh) goes on each
    natural block (`models.natural_blocks`), deepest first, then on the root, which takes the
    parameters no block owns. The parameters become DTensor shards, so build the optimizer
    afterwards. FSDP2 runs on the CPU with gloo; FSDP1 refuses the CPU. Every rank must hold
    the same weights first (FSDP2 shards what each rank has).
    """
    mesh = device_mesh.init_device_mesh(device.type, (world_size,))
    blocks = sorted(models.natural_blocks(model), key=lambda name: -name.count("."))
    for name in blocks:
        block = model.get_submodule(name)
        if block is not model and next(block.parameters(), None) is not None:
            torch_fsdp.fully_shard(block, mesh=mesh)
    torch_fsdp.fully_shard(model, mesh=mesh)
    return model


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """The sharded model's full state dict on rank 0 ({} elsewhere); collective."""
    return dcp.get_model_state_dict(model, options=_GATHER)


def load_full_model_state(model: nn.Module, state: Mapping[str, Any]) -> None:
    """Load a full state dict, passed on every rank, into the model: into each rank's shards
    when it is sharded (collective), else plainly (before `shard`).

    Raises:
        RuntimeError: missing or unexpected keys, or shapes that differ.
    """
    if not isinstance(model, torch_fsdp.FSDPModule):
        model.load_state_dict(state)
        return
    dcp.set_model_state_dict(model, dict(state), options=_SCATTER)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state (integer ids) on rank 0 ({} elsewhere); collective."""
    named = dcp.get_optimizer_state_dict(model, optimizer, options=_GATHER)
    return ids_from_names(named) if named else {}


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> None:
    """Load a full optimizer state (integer ids), passed on every rank; collective.

    torch's ``set_optimizer_state_dict`` first initialises the optimizer by a zero-learning-rate
    step, so parameters absent from `state` (never stepped, e.g. frozen since the start) begin
    with a step count of 1.

    Raises:
        ValueError: the state's parameter groups do not fit the optimizer's.
    """
    named = names_from_ids(state, optimizer, model)
    dcp.set_optimizer_state_dict(model, optimizer, named, options=_SCATTER)


def ids_from_names(named: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (torch's distributed form) -> keyed by
    integer ids numbered across the param groups in order (``Optimizer.state_dict()``)."""
    ids: dict[str, int] = {}
    groups = []
    for group in named["param_groups"]:
        for name in group["params"]:
            ids[name] = len(ids)
        groups.append({**group, "params": [ids[name] for name in group["params"]]})
    return {"state": {ids[name]: value for name, value in named["state"].items()},
            "param_groups": groups}


def names_from_ids(
    state: Mapping[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, Any]:
    """The inverse of `ids_from_names` for `optimizer`, whose parameters belong to `model`.

    Raises:
        ValueError: the state's groups hold other parameter counts than the optimizer's.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    own = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    sizes = [len(group["params"]) for group in state["param_groups"]]
    if sizes != [len(group) for group in own]:
        raise ValueError(f"the optimizer state has parameter groups of sizes {sizes}, the "
                         f"optimizer {[len(group) for group in own]}")
    ordered = [name for group in own for name in group]
    return {"state": {ordered[int(i)]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [ordered[int(i)] for i in group["params"]]}
                             for group in state["param_groups"]]}
