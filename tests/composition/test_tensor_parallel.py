"""2-D: tensor-parallel DTensor parameters sharded again over the data-parallel dim."""

import copy
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_compose import fully_shard
from tests.harness import run_on_ranks
from tests.models import Block, TinyLM, max_grad_diff, max_param_diff, train_data_parallel_steps


class TPLM(TinyLM):
    """Hidden width 30: even over tp=2 (torch's ColwiseParallel assumes even output shards),
    uneven over dp=2 (15 TP-local rows become 8 and 7)."""

    def __init__(self):
        super().__init__(n_blocks=2)
        self.blocks = torch.nn.ModuleList(Block(hidden=30) for _ in range(2))


def _tp_then_fully_shard(tp, dp) -> tuple:
    """A reference and its copy with TP on ``tp`` then ``fully_shard`` on ``dp``; the copy's first block's layout."""
    torch.manual_seed(0)
    reference = TPLM()
    model = copy.deepcopy(reference)
    for block in model.blocks:
        parallelize_module(block, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    fc1, fc2 = model.blocks[0].fc1.weight, model.blocks[0].fc2.weight
    layout = {
        "fc1": [str(p) for p in fc1.placements],
        "fc2": [str(p) for p in fc2.placements],
        "mesh_dims": fc1.device_mesh.mesh_dim_names,
    }
    return reference, model, layout


def _tp_fsdp(grad_scale: float = 1.0):
    """``grad_scale`` != 1 multiplies the sharded gradients after each backward: the fault the gradient
    check must see (AdamW alone is nearly blind to a scale)."""
    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    reference, model, layout = _tp_then_fully_shard(tp, dp)
    layout["full_equal_at_start"] = torch.equal(
        model.blocks[0].fc1.weight.full_tensor(), reference.blocks[0].fc1.weight
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    dp_rank, dp_size = dp.get_local_rank(), dp.size()
    grad_diffs = []

    def check_gradients():
        for p in model.parameters():
            p.grad.mul_(grad_scale)
        grad_diffs.append(max_grad_diff(model, reference))

    losses = train_data_parallel_steps(model, reference, (opt, ref_opt), 4, dp_rank, dp_size, check_gradients)
    return layout, losses, max_param_diff(model, reference), max(grad_diffs)


def test_tp_plus_fsdp_matches_single_process():
    for layout, losses, diff, grad_diff in run_on_ranks(4, _tp_fsdp):
        assert layout == {
            "fc1": ["_S(0, 2)", "S(0)"],  # dp splits the rows tp already split
            "fc2": ["S(0)", "S(1)"],
            "mesh_dims": ("dp", "tp"),
            "full_equal_at_start": True,
        }, layout
        assert all(abs(a - b) <= 1e-5 for a, b in losses), losses
        assert diff <= 1e-5, diff
        assert grad_diff <= 1e-5, grad_diff


@pytest.mark.slow  # 4 ranks
def test_tp_plus_fsdp_gradient_check_sees_a_wrong_scale():
    """The check above can fail: gradients x2 or x0.5 (a sum instead of a mean, a double division)
    are far outside 1e-5, where the loss and AdamW's parameters alone miss x2 or come within 7x."""
    for scale in (2.0, 0.5):
        for *_, grad_diff in run_on_ranks(4, _tp_fsdp, scale):
            assert grad_diff > 1e-3, (scale, grad_diff)


# ----- HSDP + TP on a 3-D mesh (dp_replicate, dp_shard, tp), as torchtitan builds it -----------------
def _hsdp_tp_3d(shape: tuple[int, int], tmp: str) -> dict:
    """TP on ``mesh["tp"]``, then ``fully_shard`` on ``mesh["dp_replicate", "dp_shard"]``: trains at
    parity, saves a checkpoint, and loads it into plain FSDP over every rank (a reshard)."""
    from fsdp_compose import full_state_dict, load_checkpoint, save_checkpoint

    warnings.simplefilter("ignore")
    replicate, shard = shape
    mesh = init_device_mesh("cpu", (replicate, shard, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dp, tp = mesh["dp_replicate", "dp_shard"], mesh["tp"]
    reference, model, layout = _tp_then_fully_shard(tp, dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    dp_rank = dp.get_local_rank(0) * shard + dp.get_local_rank(1)  # this rank's slice of the batch
    grad_diffs = []
    losses = train_data_parallel_steps(
        model, reference, (opt, ref_opt), 3, dp_rank, replicate * shard,
        lambda: grad_diffs.append(max_grad_diff(model, reference)),
    )
    save_checkpoint(tmp, model, opt, step=3)
    torch.manual_seed(1)
    plain = TPLM()  # other weights, sharded over all 4 ranks without TP
    for block in plain.blocks:
        fully_shard(block)
    fully_shard(plain)
    load_checkpoint(tmp, plain)
    reloaded = full_state_dict(plain, rank0_only=False)
    return {
        "layout": layout,
        "losses": losses,
        "param_diff": max_param_diff(model, reference),
        "grad_diff": max(grad_diffs),
        "reload_diff": max((reloaded[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
    }


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
def test_hsdp_plus_tp_on_a_3d_mesh(shape, tmp_path):
    results = run_on_ranks(4, _hsdp_tp_3d, shape, str(tmp_path / "ckpt"))
    for r in results:  # every rank
        assert r["layout"] == {
            "fc1": ["R", "_S(0, 2)", "S(0)"],  # as torch's FSDP2 lays it out
            "fc2": ["R", "S(0)", "S(1)"],
            "mesh_dims": ("dp_replicate", "dp_shard", "tp"),
        }, r["layout"]
        assert all(abs(a - b) <= 1e-5 for a, b in r["losses"]), r["losses"]
        assert max(r["param_diff"], r["grad_diff"], r["reload_diff"]) <= 1e-5, r

