"""A sharded module's call skips ``nn.Module``'s hook loop only when fully_shard's hooks are its
only hooks (runtime/hooks/forward.py); with any other hook the usual loop runs, in the usual order.
Every parity test trains through the fast path.
"""

import torch
from torch import nn

import fsdp_compose.module as module_py
import fsdp_compose.runtime.hooks.forward as call
from fsdp_compose import fully_shard
from tests.harness import run_on_ranks


def _fast_path_taken_and_left():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    taken = []
    original = call.call_sharded
    call.call_sharded = lambda module, *rest: (taken.append(type(module).__name__), original(module, *rest))[1]
    module_py.call_sharded = call.call_sharded
    try:
        model(torch.randn(2, 4)).sum().backward()
        plain = list(taken)
        taken.clear()
        seen = []
        # a user's pre-hook registered after fully_shard's: the usual loop, ours first, theirs
        # second, seeing the gathered (plain tensor) weight
        handle = model[0].register_forward_pre_hook(lambda m, args: seen.append(type(m.weight).__name__))
        model(torch.randn(2, 4)).sum().backward()
        with_hook = list(taken)
        handle.remove()
        taken.clear()
        global_handle = nn.modules.module.register_module_forward_pre_hook(lambda m, args: None)
        model(torch.randn(2, 4)).sum().backward()
        global_handle.remove()
        with_global = list(taken)
    finally:
        call.call_sharded = original
        module_py.call_sharded = original
    return plain, with_hook, seen, with_global


def test_fast_path_only_without_other_hooks():
    for plain, with_hook, seen, with_global in run_on_ranks(2, _fast_path_taken_and_left):
        assert plain == ["FSDPSequential", "FSDPLinear"]
        assert with_hook == ["FSDPSequential"]  # the hooked Linear took nn.Module's loop
        assert seen == ["Parameter"]  # unsharded by our hook, which ran first
        assert with_global == []
