"""Mixed precision, mixed dtypes in one group, and CPU offload, on real gloo ranks."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from fsdp_compose._runtime.state import state_of
from tests.harness import run_on_ranks
from tests.models import (
    DIM,
    HIDDEN,
    TinyLM,
    assert_parity,
    assert_parity_by_dtype,
    full_value,
    global_batch,
    lm_loss,
    local_slice,
    max_abs_diff,
    mean_across_ranks,
    shard_blocks_then_root,
    train_against_reference,
)

BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _expected_bf16_gradients(reference: nn.Module, batch: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """What the policy promises to reduce to: each rank's bf16 gradient on its slice, cast to fp32,
    summed in fp32 and divided by the ranks (computed here for every rank's slice)."""
    total = None
    for rank in range(world_size):
        low = copy.deepcopy(reference).to(torch.bfloat16)
        lm_loss(low, local_slice(batch, rank, world_size)).backward()
        grads = [q.grad.float() for q in low.parameters()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return [t / world_size for t in total]


def _bf16_training(grad_scale: float = 1.0):
    """bf16 compute, fp32 reduction, vs one process running the same bf16 compute on the global batch.
    ``grad_scale`` != 1 multiplies the sharded gradients after each backward: the fault the gradient
    check must see (AdamW, losses and parameters are blind to a scale)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    shard_blocks_then_root(model, mp_policy=BF16_POLICY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    batch = global_batch(0, world_size)  # one batch, repeated: the loss must fall
    seen = {}

    def record(module, args, output):
        seen["block_output"] = output.dtype

    model.blocks[0].register_forward_hook(record)
    model.blocks[0].fc1.register_forward_hook(lambda m, a, o: seen.update(unsharded_dtype=m.weight.dtype))
    losses, ref_losses, grad_diffs = [], [], []
    for _ in range(6):
        expected = _expected_bf16_gradients(reference, batch, world_size)
        with torch.no_grad():  # the global batch's loss, in bf16
            ref_losses.append(lm_loss(copy.deepcopy(reference).to(torch.bfloat16), batch).item())
        for p, e in zip(reference.parameters(), expected):  # fp32 masters stay equal to the sharded ones
            p.grad = e.clone()
        loss = lm_loss(model, local_slice(batch, rank, world_size))
        seen["loss_dtype"] = loss.dtype
        loss.backward()
        for p in model.parameters():
            p.grad.mul_(grad_scale)
        grad_diffs.append(max(max_abs_diff(full_value(p.grad), e) for p, e in zip(model.parameters(), expected)))
        seen["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
        seen["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        losses.append(mean_across_ranks(loss.float()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    stats = state_of(model.blocks[0]).group.stats
    fp32_bytes = sum(sp.row_layout.padded_numel * 4 * world_size for sp in state_of(model.blocks[0]).group.params)
    seen["gather_bytes_vs_fp32"] = stats.all_gather_bytes / stats.all_gathers / fp32_bytes
    # each reduce-scatter table: (world, padded elements + one flag per trainable param)
    group = state_of(model.blocks[0]).group
    elements = world_size * (sum(sp.row_layout.padded_numel for sp in group.trainable) + len(group.trainable))
    itemsize = stats.reduce_scatter_bytes / stats.reduce_scatters / elements
    seen["reduce_bytes_dtype"] = {4: "fp32", 2: "bf16"}.get(itemsize, f"{itemsize} bytes/element")
    return losses, ref_losses, {k: str(v) for k, v in seen.items()}, max(grad_diffs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_params_fp32_reduce(world_size):
    for losses, ref_losses, seen, grad_diff in run_on_ranks(world_size, _bf16_training):
        # the reduced gradients are the fp32 mean of each rank's bf16 gradient, up to fp32 summation order
        assert grad_diff <= 1e-5, grad_diff
        # bf16 has 8 bits of mantissa: per-rank vs global-batch rounding differs by ~1e-2 relative
        for ours, ref in zip(losses, ref_losses):
            assert abs(ours - ref) <= 2e-2 * abs(ref), (losses, ref_losses)
        assert losses[-1] < losses[0] - 0.3
        assert seen == {
            "unsharded_dtype": "torch.bfloat16",
            "block_output": "torch.bfloat16",
            "loss_dtype": "torch.bfloat16",
            "grad_dtypes": "['torch.float32']",
            "param_dtypes": "['torch.float32']",
            "gather_bytes_vs_fp32": "0.5",
            "reduce_bytes_dtype": "fp32",
        }


def test_bf16_gradient_check_sees_a_wrong_scale():
    """The gradient check above can fail: x2 or x0.5 gradients (a sum instead of a mean, a double
    division) gave bit-identical losses under AdamW before it existed."""
    for scale in (2.0, 0.5):
        for *_, grad_diff in run_on_ranks(2, _bf16_training, scale):
            assert grad_diff > 1e-3, (scale, grad_diff)


def _output_dtype_and_input_cast():
    torch.manual_seed(0)
    block = nn.Linear(DIM, 3)
    fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    seen = {}
    block.register_forward_hook(lambda m, args, out: seen.update(input=str(args[0].dtype)))
    out = block(torch.randn(2, DIM))
    out.sum().backward()
    seen["output"] = str(out.dtype)
    seen["grad"] = str(block.weight.grad.dtype)
    return seen


def test_output_dtype_and_input_cast():
    (seen,) = run_on_ranks(1, _output_dtype_and_input_cast)
    assert seen == {"input": "torch.bfloat16", "output": "torch.float32", "grad": "torch.float32"}


class MixedBlock(nn.Module):
    """fp32 norm next to bf16 linears in one group (torch's FSDP2 refuses this)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN).to(torch.bfloat16)
        self.fc2 = nn.Linear(HIDDEN, DIM).to(torch.bfloat16)

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc1(self.norm(x).to(torch.bfloat16))))
        return x + h.float()


class MixedLM(TinyLM):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MixedBlock() for _ in range(2))


def _mixed_dtype_group(reduce_dtype):
    from tests.runtime.test_collectives import count_collectives

    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    result = train_against_reference(MixedLM, lambda m: shard_blocks_then_root(m, mp_policy=policy), lr=1e-3)
    torch.manual_seed(0)
    model = MixedLM()
    shard_blocks_then_root(model, mp_policy=policy)
    ids = torch.randint(0, 37, (2, 6))
    with count_collectives() as counts:
        lm_loss(model, ids).backward()
    result["counts"] = dict(counts)
    result["dtypes"] = sorted({str(p.grad.dtype) for p in model.blocks[0].parameters()})
    return result


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_mixed_dtypes_in_one_group(reduce_dtype):
    results = run_on_ranks(2, _mixed_dtype_group, reduce_dtype)
    # bf16 parameters: per-rank vs global-batch bf16 rounding; the fp32 ones take only what flows
    # through bf16 compute (1.7e-5 seen), 200x tighter than the bf16 bound
    assert_parity(results, tol=1e-2)
    assert_parity_by_dtype(results, {"torch.float32": 5e-5, "torch.bfloat16": 1e-2})
    # 3 groups: one all-gather each forward + 2 blocks again in backward; reductions: one per dtype per group
    rs = 3 + (2 if reduce_dtype is None else 0)
    for r in results:  # every rank
        assert r["dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert r["counts"] == {"all_gather_single": 5, "reduce_scatter_single": rs}, r["counts"]


def _offload(offload):
    def shard(model):
        shard_blocks_then_root(model, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())

    result = train_against_reference(TinyLM, shard)
    torch.manual_seed(0)
    model = TinyLM()
    shard(model)
    lm_loss(model, torch.randint(0, 37, (2, 6))).backward()
    result["devices"] = sorted({str(p.device) for p in model.parameters()} | {str(p.grad.device) for p in model.parameters()})
    # the policy as the runtime recorded it for every parameter: what moves shards off the compute device
    # (on a CPU-only build both are the CPU, so the placement itself cannot show it)
    result["offload"] = sorted({sp.layout.offload for m in [model, *model.blocks] for sp in state_of(m).group.params})
    result["final"] = {name: full_value(p.detach()) for name, p in model.named_parameters()}
    return result


def test_cpu_offload_matches_no_offload():
    offloaded = run_on_ranks(2, _offload, True)
    plain = run_on_ranks(2, _offload, False)
    for a, b in zip(offloaded, plain):
        assert a["devices"] == ["cpu"]
        assert (a["offload"], b["offload"]) == ([True], [False])
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= 1e-6
        assert max(max_abs_diff(a["final"][name], b["final"][name]) for name in a["final"]) <= 1e-6
    assert_parity(offloaded)


@pytest.fixture
def _group(single_rank_group):
    yield


def test_non_floating_policy_dtype(_group):
    with pytest.raises(ValueError) as info:
        fully_shard(nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(param_dtype=torch.int32))
    assert_expected_inline(
        str(info.value), """fully_shard(Linear, mp_policy=...): param_dtype=torch.int32 is not a floating-point dtype"""
    )


def test_offload_with_mesh_on_another_device_type(_group):
    from types import SimpleNamespace

    mesh = SimpleNamespace(ndim=1, device_type="cuda")  # a CUDA mesh cannot be built here; only its type is read
    with pytest.raises(ValueError) as info:
        fully_shard(nn.Linear(2, 2), mesh=mesh, offload_policy=CPUOffloadPolicy())
    assert_expected_inline(
        str(info.value),
        """fully_shard(Linear, offload_policy=CPUOffloadPolicy()): the mesh is on 'cuda' but this process computes on 'cpu'; offloading moves shards between CPU and the mesh's device, so build the mesh on the compute device""",
    )


class Float8Block(nn.Module):
    """A frozen float8 weight (as quantized inference weights are) next to bf16 and fp32 ones."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w8 = nn.Parameter(torch.randn(HIDDEN, DIM).to(torch.float8_e4m3fn), requires_grad=False)
        self.up = nn.Linear(DIM, HIDDEN).to(torch.bfloat16)
        self.out = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        h = self.norm(x).to(torch.bfloat16)
        h = F.linear(h, self.w8.to(torch.bfloat16)) + self.up(h)
        return x + self.out(F.gelu(h).float())


class Float8LM(TinyLM):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Float8Block() for _ in range(2))


def _float8_group():
    from tests.runtime.test_collectives import count_collectives

    result = train_against_reference(Float8LM, shard_blocks_then_root, lr=1e-3)
    torch.manual_seed(0)
    reference = Float8LM()
    model = copy.deepcopy(reference)
    shard_blocks_then_root(model)
    seen = {}
    model.blocks[1].up.register_forward_hook(lambda m, a, o: seen.update(w8=model.blocks[1].w8.detach().clone()))
    with count_collectives() as counts:
        lm_loss(model, torch.randint(0, 37, (2, 6))).backward()
    result["counts"] = dict(counts)
    result["w8_exact"] = torch.equal(seen["w8"].view(torch.uint8), reference.blocks[1].w8.view(torch.uint8))
    result["w8_grad"] = model.blocks[1].w8.grad is None
    return result


def test_float8_bf16_fp32_in_one_group():
    results = run_on_ranks(3, _float8_group)
    assert_parity(results, tol=1e-2)  # bf16 parameters: per-rank vs global-batch rounding
    for r in results:
        assert r["w8_exact"] and r["w8_grad"]
        # 3 groups gathered in forward + 2 blocks again in backward, one all-gather each; reductions:
        # root fp32, and per block one for bf16 (up) and one for fp32 (norm, out)
        assert r["counts"] == {"all_gather_single": 5, "reduce_scatter_single": 5}, r["counts"]
