"""kiln_trainer.distributed.sharding without a process group: the optimizer-state key translation.

FSDP2 itself (sharding, gathering, loading) runs on two gloo processes in
tests/integration/test_trainer_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from kiln_trainer.distributed import sharding


def _stepped() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam([{"params": model[0].parameters()},
                                  {"params": model[2].parameters(), "lr": 0.1}], lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_optimizer_state_by_name_and_by_id_translate_into_each_other() -> None:
    model, optimizer = _stepped()
    by_id = optimizer.state_dict()
    by_name = sharding.names_from_ids(by_id, optimizer, model)
    assert by_name["param_groups"][1]["params"] == ["2.weight", "2.bias"]
    assert torch.equal(by_name["state"]["2.bias"]["exp_avg"], by_id["state"][3]["exp_avg"])
    back = sharding.ids_from_names(by_name)
    assert back["param_groups"] == by_id["param_groups"]
    assert back["state"].keys() == by_id["state"].keys()


def test_an_optimizer_state_of_other_group_sizes_is_refused() -> None:
    model, optimizer = _stepped()
    state = optimizer.state_dict()
    state["param_groups"] = [{**state["param_groups"][0], "params": [0, 1, 2, 3]}]
    with pytest.raises(ValueError, match=r"groups of sizes \[4\], the optimizer \[2, 2\]"):
        sharding.names_from_ids(state, optimizer, model)


def test_a_model_not_yet_sharded_loads_a_full_state_plainly() -> None:
    source, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    sharding.load_full_model_state(target, source.state_dict())
    assert torch.equal(target.weight, source.weight)
