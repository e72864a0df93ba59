"""The optimizer fix on its own: no process group, parameters replaced the way fully_shard does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from utils import point_optimizer_at_sharded_params, release_params


def model_and_replacement():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    old_names = {id(p): n for n, p in model.named_parameters()}
    return model, old_names


def replace_parameters(model: nn.Module) -> None:
    """What fully_shard does: every parameter becomes a new object (here: a copy)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(p.detach().clone()))


def test_param_groups_point_at_the_new_parameters_and_keep_their_options():
    model, old_names = model_and_replacement()
    optimizer = torch.optim.AdamW([
        {"params": model[0].parameters(), "lr": 0.1, "weight_decay": 0.0},
        {"params": model[1].parameters(), "lr": 0.01},
    ], lr=0.5)
    replace_parameters(model)
    point_optimizer_at_sharded_params(optimizer, old_names, model)
    g0, g1 = optimizer.param_groups
    assert [id(p) for p in g0["params"]] == [id(model[0].weight), id(model[0].bias)]
    assert [id(p) for p in g1["params"]] == [id(model[1].weight), id(model[1].bias)]
    assert (g0["lr"], g0["weight_decay"], g1["lr"], g1["weight_decay"]) == (0.1, 0.0, 0.01, 0.01)


def test_after_the_fix_the_optimizer_trains_the_model():
    model, old_names = model_and_replacement()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replace_parameters(model)
    point_optimizer_at_sharded_params(optimizer, old_names, model)
    before = model[1].weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    assert not torch.equal(before, model[1].weight)


def test_without_the_fix_the_optimizer_steps_stale_parameters():
    model, _ = model_and_replacement()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replace_parameters(model)
    before = model[1].weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    assert torch.equal(before, model[1].weight)


def test_refuses_an_optimizer_with_state_and_an_unknown_parameter():
    model, old_names = model_and_replacement()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="state"):
        point_optimizer_at_sharded_params(optimizer, old_names, model)
    stranger = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(KeyError, match="no counterpart"):
        point_optimizer_at_sharded_params(stranger, old_names, model)


def test_released_parameters_leave_the_optimizer_holding_nothing_until_the_fix():
    model, _ = model_and_replacement()
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                                 {"params": model[1].parameters(), "lr": 0.01}])
    names = release_params(optimizer, model)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert all(p.device.type == "meta" for p in held)  # no storage: the originals can be freed
    assert sorted(names.values()) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    replace_parameters(model)
    point_optimizer_at_sharded_params(optimizer, names, model)
    assert [id(p) for p in optimizer.param_groups[1]["params"]] == [id(model[1].weight), id(model[1].bias)]
    assert optimizer.param_groups[1]["lr"] == 0.01
