"""Every sharding configuration the suite trains, run for two AdamW steps on fake tensors with
torch's fake process group (run as a script by tests/runtime/test_fake_backend.py).

Under ``FakeTensorMode`` any host read of a tensor's value raises, so a configuration that
completes proves its step reads nothing on the host on a backend other than gloo. All
configurations run in one process, each model under its own fake mode, so nothing one model
leaves behind may reach the next. Prints one JSON line: per configuration what was checked.
"""

from __future__ import annotations

import json
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import checkpoint

from fsdp_compose import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, fully_shard, quantize_all_gather

VOCAB, DIM, HIDDEN, SEQ, BATCH = 64, 32, 64, 8, 2


class Block(nn.Module):
    """Attention and an MLP, as in a transformer layer; ``side`` is a branch only some steps take."""

    def __init__(self, side: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.side = nn.Linear(DIM, DIM) if side else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).view(x.shape[0], SEQ, 3, 2, DIM // 2).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        x = x + self.proj(attn)
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x + self.side(x) if self.side is not None and x.shape[0] > BATCH else x  # never taken here


class LM(nn.Module):
    def __init__(self, tied: bool = False, side: bool = False, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(side) for _ in range(4))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.checkpointed = checkpointed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x))


def _attach_bf16_gather(model: nn.Module, calls: dict) -> None:
    """The all-gather extension protocol on plain local shards: weights travel as bf16."""

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls["pre"] += 1
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        if out is not None:
            with torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.shape[0]])
            return None
        full = gathered.to(param_dtype)
        return full, (gathered, full)

    for name, param in model.named_parameters():
        if "weight" in name and param.ndim == 2:
            local = param._local_tensor
            local.fsdp_pre_all_gather = pre.__get__(local)
            local.fsdp_post_all_gather = post.__get__(local)


def build(config: str, world: int, mode: FakeTensorMode | None = None) -> tuple[nn.Module, dict]:
    """The model of ``config``, built on meta (``fake_built``: under ``mode``, as torchtitan's memory
    estimator builds, so its parameters are FakeTensors) and sharded outside any fake mode."""
    kwargs: dict = {}
    mesh = None
    tp = None
    if config == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif config == "no_reshard":
        kwargs["reshard_after_forward"] = False
    elif config == "reshard_to_4":
        kwargs["reshard_after_forward"] = 4
    elif config in ("hsdp", "hsdp_reshard_to_2"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        if config == "hsdp_reshard_to_2":
            kwargs["reshard_after_forward"] = 2
    elif config == "shard_dim_1":
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else None
    elif config == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif config == "tp_2d":
        full = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        mesh, tp = full["dp"], full["tp"]
    elif config == "dp_mesh_dims":  # parameters replicated DTensors on a full SPMD mesh
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        kwargs["dp_mesh_dims"] = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    with mode if config == "fake_built" else torch.device("meta"):
        model = LM(tied=config == "tied", side=config == "unused", checkpointed=config == "checkpointed")
    if config == "quantized":
        quantize_all_gather(model, block_size=32, min_numel=0)
    if config == "dp_mesh_dims":
        _replicate_on(model, mesh)
    for block in model.blocks:
        if tp is not None:
            parallelize_module(block, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(block, mesh=mesh, **kwargs)
    if config == "tied":
        fully_shard([model.embed, model.head], mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model, kwargs


def _replicate_on(model: nn.Module, mesh) -> None:
    """Every leaf's parameters as replicated DTensors on ``mesh``, taking and giving plain tensors."""

    def partition(_name, module, device_mesh):
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.detach(), device_mesh, [Replicate()] * device_mesh.ndim)
            module.register_parameter(name, nn.Parameter(replicated))

    def to_dtensor(_module, inputs, device_mesh):
        return tuple(
            DTensor.from_local(x, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)
            if isinstance(x, torch.Tensor)
            else x
            for x in inputs
        )

    for module in model.modules():
        if list(module.parameters(recurse=False)) and not list(module.children()):
            distribute_module(
                module, mesh, partition, input_fn=to_dtensor, output_fn=lambda _m, out, _mesh: out.to_local()
            )


def train(config: str, world: int) -> dict:
    """Two AdamW steps under a fresh fake mode; what each step left, for the test to check."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the meta tensors to_empty replaces are real
    model, _ = build(config, world, mode)
    calls = {"pre": 0}
    with mode:
        if config != "fake_built":
            model.to_empty(device="cpu")
        if config == "protocol":
            _attach_bf16_gather(model, calls)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            micro_batches = 2 if config == "no_sync" else 1
            for micro in range(micro_batches):
                if config == "no_sync":
                    model.set_requires_gradient_sync(micro == micro_batches - 1)
                ids = torch.randint(0, VOCAB, (BATCH, SEQ))
                logits = model(ids)
                loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
                loss.backward()
            grads = {name: p.grad for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
    sharded = {name: p for name, p in model.named_parameters()}
    return {
        "loss_shape": list(loss.shape),
        "all_dtensors": all(isinstance(p, DTensor) for p in sharded.values()),
        "grads_like_shards": all(
            grads[name] is not None and grads[name].to_local().shape == p.to_local().shape
            for name, p in sharded.items()
        ),
        "adam_state_like_shards": all(
            optimizer.state[p]["exp_avg"].to_local().shape == p.to_local().shape for p in sharded.values()
        ),
        "embed_local_rows": sharded["embed.weight"].to_local().shape[0],
        "gathered_with_protocol": calls["pre"] > 0,
        # qkv.weight (after norm1's weight and bias) travels as int8 and one fp32 scale per 32 values
        "quantized_bytes": fully_shard.state(model.blocks[0]).group.layout.sizes[2:4]
        == [-(-3 * DIM // world) * DIM, -(-3 * DIM // world) * DIM // 32 * 4],
    }


def side_by_side(world: int) -> dict:
    """Two differently configured models (fp32 FSDP, bf16 HSDP) trained step by step in turn, in one fake mode."""
    first, _ = build("fp32", world)
    second, _ = build("hsdp", world)
    with FakeTensorMode(allow_non_fake_inputs=True):
        first.to_empty(device="cpu")
        second.to_empty(device="cpu")
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (first, second)]
        for _ in range(2):
            for model, optimizer in zip((first, second), optimizers):
                ids = torch.randint(0, VOCAB, (BATCH, SEQ))
                F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
                optimizer.step()
                optimizer.zero_grad()
    return {
        "adam_steps": [len(o.state) for o in optimizers],
        "embed_local_rows": [m.embed.weight.to_local().shape[0] for m in (first, second)],
    }


def main(world: int, configs: list[str], rank: int = 0) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    results = {}
    for config in configs:
        started = time.perf_counter()
        try:
            results[config] = side_by_side(world) if config == "side_by_side" else train(config, world)
        except Exception as error:  # reported by name, so one run shows every configuration's outcome
            results[config] = {"error": f"{type(error).__name__}: {str(error)[:600]}"}
        results[config]["seconds"] = round(time.perf_counter() - started, 2)
    dist.destroy_process_group()
    print(json.dumps(results))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","), *map(int, sys.argv[3:4]))
