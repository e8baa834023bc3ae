"""Parameters converted or replaced after ``fully_shard`` are followed (``_runtime/refresh.py``).

``model.to(torch.float64)`` after ``fully_shard`` must compute in float64 (the gathered
parameters used to stay float32: "mat1 and mat2 must have the same dtype"), and a parameter
replaced on the module (``model.weight_norm = nn.Parameter(...)``, ``load_state_dict(assign=True)``)
must be the one sharded and trained. Both are what torch's FSDP2 does
(``test_to_float64_after_init``, ``test_reset_sharded_param_in_lazy_init``).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_compose import fully_shard
from tests.harness import run_on_ranks
from tests.messages import message
from tests.models import TinyLM, global_batch, lm_loss, local_slice, mean_across_ranks, shard_blocks_then_root


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diffs(model: nn.Module, reference: nn.Module, what: str) -> float:
    theirs = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        ours, ref = (p, theirs[name]) if what == "param" else (p.grad, theirs[name].grad)
        worst = max(worst, (_full(ours.detach()) - ref.detach()).abs().max().item())
    return worst


def _train_both(model, reference, batches, loss_fn, steps_done=0) -> dict:
    """Adam on both, built after the first backward (a replaced plain parameter is sharded at the
    first forward); per step the loss, gradient and (at the end) parameter gaps."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    opt = ref_opt = None
    loss_diff = grad_diff = 0.0
    for step in range(steps_done, steps_done + batches):
        batch = global_batch(step, world_size) if loss_fn is lm_loss else _inputs(step, world_size)
        ref_loss = loss_fn(reference, batch)
        ref_loss.backward()
        loss = loss_fn(model, local_slice(batch, rank, world_size))
        loss.backward()
        loss_diff = max(loss_diff, abs(mean_across_ranks(loss) - ref_loss.item()))
        grad_diff = max(grad_diff, _diffs(model, reference, "grad"))
        grad_dtypes = {(p.grad.dtype, p.grad.to_local().dtype) for p in model.parameters()}
        if opt is None:
            opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return {"loss": loss_diff, "grad": grad_diff, "param": _diffs(model, reference, "param"), "grad_dtypes": grad_dtypes}


# ----- model.to(dtype) after fully_shard ----------------------------------------------------
def _converted(how: str) -> dict:
    torch.manual_seed(0)
    reference = TinyLM(n_blocks=2)
    model = copy.deepcopy(reference)
    shard_blocks_then_root(model)
    dtype = torch.bfloat16 if how == "bf16" else torch.float64
    steps_done = 0
    if how == "after_step":  # converted after training started (lazy init done, root unsharded)
        _train_both(model, reference, 1, lm_loss)
        steps_done = 1
    reference.to(dtype)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(how == "to_swap")
    try:
        model.double() if how == "double" else model.to(dtype)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    dtypes = {(p.dtype, p.to_local().dtype, p._spec.tensor_meta.dtype) for p in model.parameters()}
    return {"dtypes": dtypes, **_train_both(model, reference, 1 if how == "bf16" else 3, lm_loss, steps_done)}


@pytest.mark.parametrize("how", ["to_swap", "to", "double", "after_step"])
def test_float64_after_fully_shard_trains_like_float64_reference(how):
    for r in run_on_ranks(2, _converted, how):
        f64 = torch.float64
        assert r["dtypes"] == {(f64, f64, f64)} and r["grad_dtypes"] == {(f64, f64)}, r
        # after a float32 step the models differ by float32 rounding, which float64 steps keep
        tol = 1e-5 if how == "after_step" else 1e-10
        assert max(r["loss"], r["grad"], r["param"]) <= tol, r


def test_bf16_after_fully_shard_computes_in_bf16():
    for r in run_on_ranks(2, _converted, "bf16"):
        bf16 = torch.bfloat16
        assert r["dtypes"] == {(bf16, bf16, bf16)} and r["grad_dtypes"] == {(bf16, bf16)}, r
        # a loss near 3.6 has a bf16 spacing of 1/64: allow a few of those, and as many in the gradients
        assert r["loss"] <= 4 / 64 and r["grad"] <= 1e-2, r


def _tensor_parallel_converted() -> dict:
    """TP x FSDP on a 2 x 2 mesh, converted to float64 after both: the TP DTensors follow too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, DIM))
    model = copy.deepcopy(reference)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    model.to(torch.float64)
    reference.to(torch.float64)
    seen = set()  # what the module computes with: the unsharded TP DTensor
    model[0].register_forward_pre_hook(lambda m, _: seen.add((m.weight.dtype, m.weight._spec.tensor_meta.dtype)))
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference))
    dp_rank, worst = mesh["dp"].get_local_rank(), 0.0
    for step in range(2):
        batch = _inputs(step, 2).double()
        ref_loss = _square_mean(reference, batch)
        ref_loss.backward()
        loss = _square_mean(model, batch.chunk(2)[dp_rank])
        loss.backward()
        worst = max(worst, abs(mean_across_ranks(loss) - ref_loss.item()), _diffs(model, reference, "grad"))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    dtypes = {p.dtype for p in model.parameters()}
    return {"diff": max(worst, _diffs(model, reference, "param")), "dtypes": dtypes, "seen": seen}


@pytest.mark.slow  # 4 ranks
def test_float64_after_tensor_parallel_and_fully_shard():
    for r in run_on_ranks(4, _tensor_parallel_converted):
        assert r["dtypes"] == {torch.float64} and r["seen"] == {(torch.float64, torch.float64)}, r
        assert r["diff"] <= 1e-10, r


# ----- a parameter replaced after fully_shard ----------------------------------------------
DIM = 5  # uneven over 2 and 3 ranks


class NormScaled(nn.Module):
    """Two linears and a per-feature scale computed from their weights after deferred init."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(DIM, DIM, bias=False)
        self.layer2 = nn.Linear(DIM, DIM, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(DIM))

    def weight_norms(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(self.layer2.weight, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)) * self.weight_norm


def _inputs(step: int, world_size: int) -> torch.Tensor:
    return torch.randn(2 * world_size, DIM, generator=torch.Generator().manual_seed(step))


def _square_mean(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _replaced(kind: str) -> dict:
    torch.manual_seed(0)
    reference = NormScaled()
    reference.weight_norm = nn.Parameter(reference.weight_norms())
    with torch.device("meta"):
        model = NormScaled()
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)
    for name in ("layer1", "layer2"):
        getattr(model, name).to_empty(device="cpu")
        getattr(model, name).load_state_dict(getattr(reference, name).state_dict())
    norms = model.weight_norms()  # a Shard(0) DTensor: computed from the shards
    value = {"dtensor": norms, "replicated": norms.redistribute(norms.device_mesh, [Replicate()])}
    replacement = nn.Parameter(value.get(kind, norms.full_tensor()))
    model.weight_norm = replacement
    seen = {}
    if kind == "plain_unshard":  # an explicit unshard before the first forward follows it too
        model.unshard()
        seen["unsharded"] = (model.weight_norm - reference.weight_norm).abs().max().item()
        model.reshard()
    diffs = _train_both(model, reference, 3, _square_mean)
    param = model.weight_norm
    seen.update(
        kept_object=param is replacement,
        layout=(type(param).__name__, tuple(param.placements), isinstance(param, nn.Parameter)),
    )
    return {**seen, **diffs}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["dtensor", "replicated", "plain", "plain_unshard"])
def test_parameter_replaced_after_fully_shard_is_sharded_and_trained(kind, world_size):
    for r in run_on_ranks(world_size, _replaced, kind):
        assert r["layout"] == ("DTensor", (Shard(0),), True), r
        # a DTensor is used as it is or redistributed in place (an optimizer built before the first
        # forward holds it); a plain tensor's rows go into a new DTensor parameter
        assert r["kept_object"] == (kind in ("dtensor", "replicated")), r
        assert r.get("unsharded", 0.0) <= 1e-6, r
        assert max(r["loss"], r["grad"], r["param"]) <= 1e-5, r


def _assign_after_training() -> dict:
    torch.manual_seed(0)
    reference = TinyLM(n_blocks=2)
    model = copy.deepcopy(reference)
    shard_blocks_then_root(model)
    _train_both(model, reference, 1, lm_loss)  # lazily initialized and trained on the old weights
    torch.manual_seed(1)
    loaded = TinyLM(n_blocks=2).state_dict()
    reference.load_state_dict(loaded)
    model.load_state_dict(loaded, assign=True)
    placements = {tuple(p.placements) for p in model.parameters()}
    return {"placements": placements, **_train_both(model, reference, 2, lm_loss, steps_done=1)}


def test_load_state_dict_assign_after_training_is_followed():
    for r in run_on_ranks(3, _assign_after_training):
        assert r["placements"] == {(Shard(0),)}, r
        assert max(r["loss"], r["grad"], r["param"]) <= 1e-5, r


def _tied_lm() -> TinyLM:
    model = TinyLM(n_blocks=2)
    model.head.weight = model.embed.weight  # (37, 13) both: the output projection tied to the embedding
    return model


def _rank0_broadcast_meta_init() -> dict:
    """torch's ``test_fully_shard_rank0_broadcast_meta_device_init`` flow with tied weights: the model
    sharded on meta, rank 0's full state dict broadcast and sharded, then ``load_state_dict(assign=True)``
    with equal but separate tensors for ``embed.weight`` and ``head.weight``."""
    torch.manual_seed(0)
    reference = _tied_lm()
    with torch.device("meta"):
        model = _tied_lm()
    shard_blocks_then_root(model)
    full = [reference.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(full, src=0)
    sharded = {}
    for name, meta in model.state_dict().items():
        value = full[0][name].clone()  # a separate tensor for each key, tied or not
        sharded[name] = nn.Parameter(distribute_tensor(value, meta.device_mesh, meta.placements))
    model.load_state_dict(sharded, assign=True)
    tied = model.embed.weight is model.head.weight
    return {"tied": tied, **_train_both(model, reference, 3, lm_loss)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_load_state_dict_assign_keeps_tied_weights_tied(world_size):
    for r in run_on_ranks(world_size, _rank0_broadcast_meta_init):
        assert r["tied"], r
        assert max(r["loss"], r["grad"], r["param"]) <= 1e-5, r


# ----- bad replacements name the parameter ------------------------------------------------
@pytest.fixture()
def group(single_rank_group):
    yield


def _sharded_norm_scaled() -> NormScaled:
    model = NormScaled()
    fully_shard(model.layer1)
    fully_shard(model)
    return model


def test_replacement_of_another_shape(group):
    model = _sharded_norm_scaled()
    model.weight_norm = nn.Parameter(torch.ones(DIM + 1))
    assert_expected_inline(
        message(lambda: model(torch.ones(1, DIM))),
        """ValueError: parameter 'weight_norm' of fully_shard(NormScaled) was replaced by a tensor of shape (6,) after fully_shard sharded it with shape (5,); a replacement must keep the shape""",
    )


def test_removed_parameter(group):
    model = _sharded_norm_scaled()
    model.layer2.weight = None
    assert_expected_inline(
        message(lambda: model(torch.ones(1, DIM))),
        """ValueError: parameter 'layer2.weight' of fully_shard(NormScaled) was removed or set to None after fully_shard; keep it, or pass it in ignored_params""",
    )


def test_tied_parameter_replaced_in_one_place(group):
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    fully_shard(model)
    model[1].weight = nn.Parameter(torch.ones(4, 4))
    assert_expected_inline(
        message(lambda: model(torch.ones(1, 4))),
        """ValueError: parameter '0.weight' of fully_shard(Sequential) is shared by '0.weight', '1.weight', and only some of them were given a new parameter after fully_shard; assign a new parameter to all of them""",
    )
