"""Sharded models in every configuration the suite exercises, for explain() and its checks."""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests.models import DIM, VOCAB, Block, TinyLM, global_batch, lm_loss, local_slice, shard_blocks_then_root

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "examples")


class TiedLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight


def shard_tied(model: nn.Module, **kwargs) -> None:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard([model.embed, model.head], **kwargs)
    fully_shard(model, **kwargs)


def tiny_batch(step: int) -> torch.Tensor:
    return local_slice(global_batch(step, dist.get_world_size()), dist.get_rank(), dist.get_world_size())


def build(config: str) -> tuple[nn.Module, callable]:
    """(sharded model, batch(step) -> loss) for a configuration name."""
    torch.manual_seed(0)
    ws = dist.get_world_size()
    if config.startswith("gpt"):
        return build_gpt(config)
    if config == "tied_mixed_precision":
        model = TiedLM()
        shard_tied(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    elif config == "offload":
        model = TinyLM()
        shard_blocks_then_root(model, offload_policy=CPUOffloadPolicy())
    elif config == "one_d":
        model = TinyLM()
        shard_blocks_then_root(model)
    elif config == "blocks_only":  # no root call: every block is its own root
        model = TinyLM()
        for block in model.blocks:
            fully_shard(block)
    elif config == "reshard_to_2":
        model = TinyLM()
        shard_blocks_then_root(model, reshard_after_forward=2)
    elif config == "hsdp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        model = TinyLM()
        shard_blocks_then_root(model, mesh=mesh)
    elif config == "tensor_parallel":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        warnings.simplefilter("ignore")
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
        model = TinyLM(n_blocks=2)
        model.blocks = nn.ModuleList(Block(hidden=30) for _ in range(2))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp = mesh["dp"]
        return model, lambda step: lm_loss(
            model, local_slice(global_batch(step, dp.size()), dp.get_local_rank(), dp.size())
        )
    else:
        raise ValueError(config)
    return model, lambda step: lm_loss(model, tiny_batch(step))


def build_gpt(config: str) -> tuple[nn.Module, callable]:
    """The example GPT (short sequences, so parameters dominate memory): plain, tied + bf16, offloaded."""
    sys.path.insert(0, EXAMPLES)
    from gpt import GPT, GPTConfig, synthetic_batch
    from gpt import lm_loss as gpt_loss

    cfg = GPTConfig(seq_len=8)
    model = GPT(cfg)
    kwargs = {}
    if config == "gpt_tied_mixed_precision":
        model.head.weight = model.tok_emb.weight
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif config == "gpt_offload":  # on a CPU-only build shards already live on the CPU
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif config == "gpt_quantized":  # int8 weight all-gather, dequantized into bf16
        from fsdp_compose import quantize_all_gather

        quantize_all_gather(model, torch.int8)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif config == "gpt_hsdp":
        ws = dist.get_world_size()
        kwargs["mesh"] = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, **kwargs)
    if config == "gpt_tied_mixed_precision":
        fully_shard([model.tok_emb, model.head], **kwargs)
    fully_shard(model, **kwargs)
    return model, lambda step: gpt_loss(model, synthetic_batch(cfg, 1, step, dist.get_rank()))


def counted_bytes(model: nn.Module) -> int:
    from fsdp_compose._runtime.state import states_in

    return sum(
        s.group.stats.all_gather_bytes + s.group.stats.reduce_scatter_bytes + s.group.stats.all_reduce_bytes
        for _, s in states_in(model)
    )
