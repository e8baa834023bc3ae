"""The all-gather extension protocol (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), as torch's FSDP2 has it.

The cases follow the semantics of torch's own extension tests, written here for CPU and gloo: a
``TwoTensor`` parameter (both signatures, reshard after forward or not, even and uneven shards),
a subclass that pads its own inputs, a plain tensor with the two methods attached after meta init,
bf16 mixed precision, HSDP, CPU offload, and a float8 all-gather that torch's FSDP2 cannot run on
gloo. Each trains against the same model unsharded on the global batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

from fsdp_compose import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests.harness import run_on_ranks
from tests.models import max_abs_diff

DIM = 7  # rows 7 and 28: uneven at 2 (for 7) and 3 ranks


class MLP(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, 4 * dim, bias=False)
        self.out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.inp(x)))


def _pre_v1(self, mesh):
    return (self.a, self.b), None


def _pre_v2(self, mesh, outer_size, outer_stride, module, mp_policy):
    assert mesh.ndim == 1 and outer_size == module.weight.shape, (mesh, outer_size)
    assert isinstance(mp_policy, MixedPrecisionPolicy)
    return (self.a, self.b), None


def _post(self, outputs, metadata, param_dtype, *, out=None):
    a, b = outputs
    if out is not None:  # later unshards: the gathered bytes already are ``out``'s (same dtype)
        if a.dtype == param_dtype:
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
        else:
            out.a.copy_(a[: out.shape[0]])  # uneven: the gathered rows carry padding
            out.b.copy_(b[: out.shape[0]])
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


def _patch_two_tensor(version: int) -> None:
    """TwoTensor with the protocol, in the signature ``version`` (workers are reused: patch each time)."""
    TwoTensor.fsdp_pre_all_gather = _pre_v1 if version == 1 else _pre_v2
    TwoTensor.fsdp_post_all_gather = _post


def _two_tensor_model(blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[MLP() for _ in range(blocks)])
    for mlp in model:
        for lin in (mlp.inp, mlp.out):
            lin.weight = nn.Parameter(TwoTensor(lin.weight.detach(), lin.weight.detach().clone()))
    return model


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    return [t.a, t.b] if isinstance(t, TwoTensor) else [t]


def _local_rows(ref: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``ref``, as ``like`` (a sharded DTensor, HSDP included) holds them."""
    mesh = like.device_mesh
    rank, world = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    chunks = torch.chunk(ref, world)
    return chunks[rank] if rank < len(chunks) else ref[:0]


def _train(model, ref, steps, batch_of, loss_of=lambda y: y.sum(), tol=1e-5, compare_grads=True):
    """``steps`` steps of Adam on both models; the reference on the global batch (mean over ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    worst = {"loss": 0.0, "param": 0.0, "grad": 0.0}
    for step in range(steps):
        batch = batch_of(step, world)
        local = batch.chunk(world)[rank]
        loss = loss_of(model(local)) / local.shape[0]
        loss.backward()
        ref_loss = loss_of(ref(batch)) / batch.shape[0]
        ref_loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        worst["loss"] = max(worst["loss"], max_abs_diff(global_loss / world, _parts(ref_loss)[0]))
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            if compare_grads:
                assert p.grad is not None, name
                want = _local_rows(_parts(r.grad)[0], p)
                worst["grad"] = max(worst["grad"], max_abs_diff(p.grad.to_local(), want))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref_opt.zero_grad(set_to_none=step % 2 == 0)
        for p, r in zip(model.parameters(), ref.parameters()):
            for mine, theirs in zip(_parts(p.to_local()), _parts(r.detach())):
                worst["param"] = max(worst["param"], max_abs_diff(mine, _local_rows(theirs, p)))
    assert all(v <= tol for v in worst.values()), worst
    return worst


def _batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(2 * world, DIM, generator=torch.Generator().manual_seed(step))


def _two_tensor_parity(version: int, reshard_after_forward: bool, mp: bool = False, offload: bool = False):
    _patch_two_tensor(version)
    model = _two_tensor_model()
    ref = copy.deepcopy(model)
    calls = {"pre": 0}
    pre = TwoTensor.fsdp_pre_all_gather

    def counting_pre(self, *args):
        calls["pre"] += 1
        return pre(self, *args)

    TwoTensor.fsdp_pre_all_gather = counting_pre if version == 1 else _counting_v2(counting_pre)
    try:
        kwargs = {"reshard_after_forward": reshard_after_forward}
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for mlp in model:
            fully_shard(mlp, **kwargs)
        fully_shard(model, **kwargs)
        assert isinstance(model[0].inp.weight.to_local(), TwoTensor)
        _train(model, ref, 4, _batch)
    finally:
        TwoTensor.fsdp_pre_all_gather = pre
    # every full unshard asked the subclass what to send (a post-forward slice re-gathers without it)
    assert calls["pre"] >= 4 * 3, calls
    return calls["pre"]


def _counting_v2(counting):
    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        return counting(self, mesh, outer_size, outer_stride, module, mp_policy)

    return pre


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_two_tensor_parity(version, reshard_after_forward):
    run_on_ranks(2, _two_tensor_parity, version, reshard_after_forward)


def test_two_tensor_uneven_at_3_ranks_with_offload():
    run_on_ranks(3, _two_tensor_parity, 2, True, offload=True)


@pytest.mark.slow  # 4 ranks
def test_two_tensor_reshard_to_2_of_4_ranks():
    """reshard_after_forward=2 (torch's FSDP2 refuses it for extensions): forward keeps a 2-way slice of
    what the protocol gathered, backward re-gathers it within 2 ranks and calls post-all-gather again."""
    # pre-all-gather ran in forward only: 4 steps x 3 blocks x 2 weights (resharding to all ranks: twice that)
    assert run_on_ranks(4, _two_tensor_parity, 1, 2) == [4 * 3 * 2] * 4
    assert run_on_ranks(2, _two_tensor_parity, 1, True) == [4 * 3 * 2 * 2] * 2


def _protocol_attached_after_fully_shard(hsdp: bool) -> int:
    """The protocol attached to the shard's class after ``fully_shard``, as torch allows: sharded as a
    plain subclass, gathered through the protocol from the first forward on."""
    for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
        if name in TwoTensor.__dict__:
            delattr(TwoTensor, name)
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _two_tensor_model()
    ref = copy.deepcopy(model)
    for mlp in model:
        fully_shard(mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = {"pre": 0}

    def counting_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls["pre"] += 1
        return _pre_v2(self, mesh, outer_size, outer_stride, module, mp_policy)

    TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather = counting_pre, _post
    _train(model, ref, 3, _batch)
    return calls["pre"]


@pytest.mark.parametrize("world, hsdp", [(2, False), pytest.param(4, True, marks=pytest.mark.slow)])
def test_protocol_attached_after_fully_shard(world, hsdp):
    # 3 steps x 3 blocks x 2 weights, gathered in forward and again in backward
    assert run_on_ranks(world, _protocol_attached_after_fully_shard, hsdp) == [3 * 3 * 2 * 2] * world


# ----- a subclass that pads its own inputs (five-argument form), uneven at 3 ranks ---------------
class PaddedBF16Gather(torch.Tensor):
    """Sends bf16, padding its inputs to the padded shard size itself when the rows don't divide."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = -(-outer_size[0] // mesh.size())
        padded = torch.zeros((rows, *outer_size[1:]), dtype=torch.bfloat16, device=self.device)
        padded[: self._data.shape[0]].copy_(self._data)
        return (padded,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        if out is not None:  # ``out`` has the parameter's rows; ``gathered`` every rank's padded rows
            with torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.shape[0]])
            return None
        full = gathered.to(param_dtype)
        return full, (gathered, full)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        from torch.utils import _pytree as pytree

        unwrapped = func(
            *pytree.tree_map_only(cls, lambda x: x._data, args),
            **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}),
        )
        return pytree.tree_map_only(torch.Tensor, cls, unwrapped)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return PaddedBF16Gather(inner["_data"])


def _bf16_round(w: torch.Tensor) -> torch.Tensor:
    """Straight-through bf16 rounding: what the reference computes with."""
    return w + (w.to(torch.bfloat16).to(w.dtype) - w).detach()


class RoundedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(nn.functional.linear(x, _bf16_round(self.inp.weight)))
        return x + nn.functional.linear(h, _bf16_round(self.out.weight))


def _self_padding_parity():
    torch.manual_seed(0)
    ref = nn.Sequential(*[RoundedMLP() for _ in range(2)])
    model = nn.Sequential(*[MLP() for _ in range(2)])
    model.load_state_dict(ref.state_dict())
    for mlp in model:
        for lin in (mlp.inp, mlp.out):
            lin.weight = nn.Parameter(PaddedBF16Gather(lin.weight.detach().clone()))
    for mlp in model:
        fully_shard(mlp, reshard_after_forward=True)
    fully_shard(model)
    _train(model, ref, 3, _batch, loss_of=lambda y: _plain(y).sum())


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t._data if isinstance(t, PaddedBF16Gather) else t


def test_self_padding_subclass_uneven_at_3_ranks():
    run_on_ranks(3, _self_padding_parity)


# ----- a plain tensor with the two methods attached after meta init (bf16 over the wire) ---------
def _attach_bf16_gather(model: nn.Module, calls: dict) -> None:
    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls["pre"] += 1
        calls["mesh"] = (mesh.ndim, mesh.size())
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        if out is not None:
            with torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.shape[0]])  # uneven: the gathered rows carry padding
            return None
        full = gathered.to(param_dtype)
        return full, (gathered, full)

    for name, param in model.named_parameters():
        if "weight" in name:
            local = param._local_tensor
            local.fsdp_pre_all_gather = pre.__get__(local)
            local.fsdp_post_all_gather = post.__get__(local)


def _meta_init_monkey_patch(hsdp: bool):
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    ref = nn.Sequential(*[RoundedMLP() for _ in range(2)])
    with torch.device("meta"):
        model = nn.Sequential(*[MLP() for _ in range(2)])
    for mlp in model:
        fully_shard(mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())  # full tensors: each rank keeps its rows
    calls = {"pre": 0}
    _attach_bf16_gather(model, calls)
    _train(model, ref, 3, _batch)
    assert calls["pre"] > 0
    return calls["mesh"]


def test_attached_methods_after_meta_init():
    assert run_on_ranks(2, _meta_init_monkey_patch, False) == [(1, 2)] * 2


@pytest.mark.slow  # 4 ranks
def test_hsdp_passes_the_shard_mesh():
    assert run_on_ranks(4, _meta_init_monkey_patch, True) == [(1, 2)] * 4


# ----- float8 bytes plus a scale per rank: a group torch's FSDP2 cannot gather on gloo -----------
F8 = torch.float8_e4m3fn


def _quantize(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (block.abs().amax().clamp(min=1e-12) / torch.finfo(F8).max).reshape(1).float()
    return (block / scale).to(F8), scale


def _float8_round(w: torch.Tensor, world: int) -> torch.Tensor:
    """Each rank's rows quantized with that rank's own scale, straight-through (the reference)."""
    blocks = [_quantize(b.detach()) for b in torch.chunk(w, world)]
    rounded = torch.cat([data.float() * scale for data, scale in blocks])
    return w + (rounded - w).detach()


class Float8RefMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        h = torch.relu(nn.functional.linear(x, _float8_round(self.inp.weight, world)))
        return x + nn.functional.linear(h, _float8_round(self.out.weight, world))


def _attach_float8_gather(model: nn.Module, sent: list) -> None:
    def pre(self, mesh):
        data, scale = _quantize(self)
        sent.append((data.dtype, scale.dtype))
        return (data, scale), None

    @torch.no_grad()
    def post(self, outputs, metadata, param_dtype, *, out=None):
        data, scales = outputs  # (world * rows, cols) float8, (world,) fp32
        world = scales.numel()
        full = (data.view(world, -1, data.shape[-1]).to(param_dtype) * scales.view(world, 1, 1)).flatten(0, 1)
        if out is not None:
            with torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
                out.copy_(full[: out.shape[0]])
            return None
        return full, (full,)

    for param in model.parameters():
        local = param._local_tensor
        local.fsdp_pre_all_gather = pre.__get__(local)
        local.fsdp_post_all_gather = post.__get__(local)


def _float8_models(sent: list) -> tuple[nn.Module, nn.Module]:
    """The reference and a sharded copy whose weight shards send float8 and a scale."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[Float8RefMLP() for _ in range(2)])
    model = nn.Sequential(*[MLP() for _ in range(2)])
    model.load_state_dict(ref.state_dict())
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    _attach_float8_gather(model, sent)
    return ref, model


def _float8_only_group():
    sent: list = []
    ref, model = _float8_models(sent)
    _train(model, ref, 3, _batch)
    stats = fully_shard.state(model[0]).group.stats
    assert set(sent) == {(F8, torch.float32)}
    return stats.all_gathers, stats.all_gather_bytes


def test_float8_weights_and_scales_in_one_byte_all_gather():
    results = run_on_ranks(2, _float8_only_group)
    world, rows_inp, rows_out = 2, 4 * DIM, DIM
    # each gather: both weights in float8 (1 byte per element, rows padded) and an fp32 scale each
    per_step = world * ((-(-rows_inp // world)) * DIM + (-(-rows_out // world)) * 4 * DIM + 2 * 4)
    for gathers, nbytes in results:  # every rank
        assert nbytes == gathers * per_step, (gathers, nbytes, per_step)


# ----- bf16 mixed precision: a TwoTensor model trains exactly like the same plain model ----------
def _mixed_precision_two_tensor_equals_plain():
    _patch_two_tensor(1)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plain = nn.Sequential(*[MLP() for _ in range(2)])
    two = _two_tensor_model(2)
    plain.load_state_dict({k: v.a for k, v in two.state_dict().items()})
    losses = []
    for model in (plain, two):
        for mlp in model:
            fully_shard(mlp, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        curve = []
        for step in range(3):
            x = _batch(step, dist.get_world_size()).chunk(dist.get_world_size())[dist.get_rank()]
            loss = model(x).float().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(_parts(loss)[0].item())
        losses.append(curve)
    for p, q in zip(plain.parameters(), two.parameters()):
        assert torch.equal(p.to_local(), q.to_local().a) and torch.equal(p.to_local(), q.to_local().b)
    assert losses[0] == losses[1], losses


def test_mixed_precision_two_tensor_equals_plain():
    run_on_ranks(2, _mixed_precision_two_tensor_equals_plain)


# ----- bad input: named at fully_shard ---------------------------------------------------------
def _half_protocol_message():
    lin = nn.Linear(4, 4, bias=False)
    lin.weight = nn.Parameter(TwoTensor(lin.weight.detach(), lin.weight.detach().clone()))
    TwoTensor.fsdp_pre_all_gather = _pre_v1
    had_post = TwoTensor.__dict__.get("fsdp_post_all_gather")
    if had_post is not None:
        del TwoTensor.fsdp_post_all_gather
    try:
        fully_shard(lin)
    except ValueError as error:
        return str(error)
    finally:
        del TwoTensor.fsdp_pre_all_gather
        if had_post is not None:
            TwoTensor.fsdp_post_all_gather = had_post
    return "no error"


def test_errors_name_the_parameter(single_rank_group):
    from expecttest import assert_expected_inline

    assert_expected_inline(
        _half_protocol_message(),
        """parameter 'weight' is a TwoTensor that defines fsdp_pre_all_gather but not fsdp_post_all_gather; the all-gather extension protocol needs both""",
    )
    lin = nn.Linear(4, 4, bias=False)
    lin.weight = nn.Parameter(TwoTensor(lin.weight.detach(), lin.weight.detach().clone()))
    for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
        if name in TwoTensor.__dict__:
            delattr(TwoTensor, name)
    fully_shard(lin)  # the protocol may still be attached; the first all-gather needs it
    with pytest.raises(ValueError) as info:
        lin(torch.ones(1, 4))
    assert_expected_inline(
        str(info.value),
        """parameter 'weight' is a tensor subclass (TwoTensor) without fsdp_pre_all_gather and fsdp_post_all_gather; fully_shard gathers parameters as bytes, which would not be its values. Implement the all-gather extension protocol on it, or pass it in ignored_params""",
    )


# ----- whole-model operations on protocol shards ---------------------------------------------
def _whole_model_operations(tmp: str):
    import torch.distributed.checkpoint as dcp

    from fsdp_compose import clip_grad_norm_, explain, full_state_dict, summon_full_params

    ref, model = _float8_models([])
    _train(model, ref, 2, _batch)
    plan = explain(model)  # counts what the protocol sent (before a step it would not ask: explain stays local)
    result = {"plan": [(g.name, g.all_gathers, g.all_gather_bytes) for g in plan.groups]}
    # full state dict and summon give the fp32 masters, not the float8 copies the protocol gathers
    full = full_state_dict(model, rank0_only=False)
    result["full_sd"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    before = [p.to_local().clone() for p in model.parameters()]
    with summon_full_params(model, writeback=True):
        result["summon"] = (model[0].inp.weight - ref[0].inp.weight).abs().max().item()
    result["writeback_kept"] = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
    # gradient clipping over plain gradient shards: the reference's norm
    x = _batch(5, dist.get_world_size())
    model(x.chunk(dist.get_world_size())[dist.get_rank()]).sum().div(x.shape[0] // dist.get_world_size()).backward()
    ref(x).sum().div(x.shape[0]).backward()
    norm = clip_grad_norm_(model.parameters(), 1e9)
    result["norm"] = (norm - torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)).abs().item()
    # DCP: save, load into a fresh model, same shards
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp)
    fresh = nn.Sequential(*[MLP() for _ in range(2)])
    for mlp in fresh:
        fully_shard(mlp)
    fully_shard(fresh)
    _attach_float8_gather(fresh, [])
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=tmp)
    fresh.load_state_dict(state["model"])
    result["dcp"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(fresh.parameters(), model.parameters()))
    return result


def test_whole_model_operations_see_the_masters(tmp_path):
    for r in run_on_ranks(2, _whole_model_operations, str(tmp_path)):
        world, rows_inp, rows_out = 2, 4 * DIM, DIM
        # each block gathers both weights in float8, rows padded, plus a 4-byte scale each
        per_rank = (-(-rows_inp // world)) * DIM + (-(-rows_out // world)) * 4 * DIM + 8
        blocks = [(gathers, nbytes) for name, gathers, nbytes in r["plan"] if name != "<root>"]
        assert len(blocks) == 2 and all(nbytes == gathers * world * per_rank for gathers, nbytes in blocks), r["plan"]
        assert r["full_sd"] <= 1e-5 and r["summon"] <= 1e-5 and r["norm"] <= 1e-5, r
        assert r["writeback_kept"] and r["dcp"], r
