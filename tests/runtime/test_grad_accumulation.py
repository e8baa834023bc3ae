"""No-sync gradient accumulation sums micro-batches in the reduce dtype, not in bf16.

With ``param_dtype=bf16, reduce_dtype=fp32`` the unsharded gradients are bf16; summing 8 of
them in bf16 loses ~1e-3 relative. Accumulating in fp32 makes 8 no-sync micro-batches then a
sync agree with syncing every micro-batch to fp32 rounding.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from tests.harness import run_on_ranks
from tests.models import TinyLM, global_batch, lm_loss, local_slice, shard_blocks_then_root

MICRO_BATCHES = 8
BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _accumulated_grads(mode: str, offload: bool, hsdp: bool) -> dict:
    """Relative difference between accumulating without sync (``mode``) and syncing every time."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    torch.manual_seed(0)
    base = TinyLM(n_blocks=2)
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    models = {}
    for name in ("accumulate", "sync_every"):
        models[name] = copy.deepcopy(base)
        shard_blocks_then_root(models[name], mp_policy=BF16_FP32, offload_policy=policy, mesh=mesh)
    for i in range(MICRO_BATCHES):
        batch = local_slice(global_batch(i, world_size), rank, world_size)
        last = i == MICRO_BATCHES - 1
        if mode == "no_sync":
            models["accumulate"].set_requires_gradient_sync(last)
        else:
            models["accumulate"].set_requires_all_reduce(last)
        for model in models.values():
            lm_loss(model, batch).backward()
    worst = 0.0
    for (name, a), b in zip(models["accumulate"].named_parameters(), models["sync_every"].parameters()):
        assert a.grad.dtype == torch.float32, name  # reduced shards stay in the parameter's fp32
        ga, gb = a.grad.to_local(), b.grad.to_local()
        if gb.numel():
            worst = max(worst, ((ga - gb).abs().max() / gb.abs().max().clamp_min(1e-12)).item())
    return {"relative": worst}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "cpu_offload"])
def test_no_sync_accumulates_in_reduce_dtype(world_size, offload):
    for result in run_on_ranks(world_size, _accumulated_grads, "no_sync", offload, False):
        assert result["relative"] < 1e-6, result


@pytest.mark.slow  # 4 ranks
@pytest.mark.parametrize("mode", ["no_sync", "no_all_reduce"])
def test_hsdp_accumulation_in_reduce_dtype(mode):
    for result in run_on_ranks(4, _accumulated_grads, mode, False, True):
        assert result["relative"] < 1e-6, result
