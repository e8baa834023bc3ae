"""Whole-model operations refuse to run during backward, naming the group (whole_model/model_groups.py)."""

import pytest
import torch

from fsdp_compose import full_state_dict, summon_full_params
from tests.messages import message
from tests.models import TinyLM, shard_blocks_then_root


@pytest.mark.parametrize("action", ["full_state_dict", "summon_full_params"])
def test_whole_model_operation_during_backward_names_the_group(single_rank_group, action):
    model = TinyLM(n_blocks=1)
    shard_blocks_then_root(model)
    seen = []

    def during_backward(grad):
        if action == "full_state_dict":
            seen.append(message(lambda: full_state_dict(model)))
        else:
            seen.append(message(lambda: summon_full_params(model).__enter__()))
        return grad

    # reached once backward is under way: the embedding's output gradient
    model.embed.register_forward_hook(lambda _module, _args, out: out.register_hook(during_backward) and None)
    model(torch.randint(0, 37, (2, 5))).sum().backward()
    assert seen == [
        f"RuntimeError: {action} cannot run during backward (group '<root>' (TinyLM))",
    ]
