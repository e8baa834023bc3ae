"""torch.distributed.pipelining's schedules on sharded stages: pp 2 x dp 2 on 4 gloo ranks.

Each stage is two blocks and a projection, ``fully_shard`` on each block and on the stage (3 groups a
stage), as torchtitan builds it. Every schedule must reduce each group's gradients once per step (not
once per micro-batch), the first step included (torch 2.13 on runs a metadata inference there, a
forward and an input-gradient backward per stage), on every rank, and train at parity with the
unsharded model on the global batch, with our import or with torch's names pointing at ours
(``use_as_torch_fsdp``), and when the program imports torch's pipelining only after ``fully_shard``.
"""

import sys

import pytest
import torch
from torch import nn

from tests.harness import run_on_ranks
from tests.models import max_abs_diff
from tests.runtime.test_collectives import count_collectives

DIM, MICRO, ROWS, STEPS = 6, 4, 3, 3  # ROWS per micro-batch: each dp rank's batch is MICRO * ROWS


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.proj(x)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(MICRO * ROWS, DIM, generator=gen), torch.randn(MICRO * ROWS, DIM, generator=gen)


def _train(schedule: str, compat: bool, reshard: bool = True, late_import: bool = False) -> dict:
    if late_import:  # this process imports torch's pipelining anew, after fully_shard (as a fresh program would)
        return _with_pipelining_unimported(_train, schedule, compat, reshard)
    if compat:
        from fsdp_compose_compat import use_as_torch_fsdp

        handle = use_as_torch_fsdp()
        from torch.distributed.fsdp import fully_shard  # ours now
    else:
        from fsdp_compose import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    if "torch.distributed.pipelining" in sys.modules:
        from torch.distributed.pipelining import PipelineStage, schedules
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    looped = schedule in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
    n_stages = 4 if looped else 2
    mine = [pp_rank, pp_rank + 2] if looped else [pp_rank]
    if schedule == "ZBVZeroBubble":  # V-shaped: the first and the last stage on one rank
        mine = [pp_rank, n_stages - 1 - pp_rank]
    torch.manual_seed(0)
    reference = nn.Sequential(*[Stage() for _ in range(n_stages)])
    modules = {i: Stage() for i in mine}
    for i, module in modules.items():
        module.load_state_dict(reference[i].state_dict())
        for block in module.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(module, mesh=mesh["dp"])
    if "torch.distributed.pipelining" not in sys.modules:  # late_import: only now, after every fully_shard
        from torch.distributed.pipelining import PipelineStage, schedules
    stages = [PipelineStage(modules[i], i, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()) for i in mine]
    run = getattr(schedules, f"Schedule{schedule}")(stages if looped else stages[0], n_microbatches=MICRO, loss_fn=_mse)
    opt = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reduce_scatters, grad_diff = [], 0.0
    for step in range(STEPS):
        x, y = _batch(step, dp_rank)
        if step == 0 and schedule.endswith("ZeroBubble") and reshard:
            try:
                run.step(*((x,) if pp_rank == 0 or looped else ()), target=y if any(s.is_last for s in stages) else None)
            except ValueError as error:  # on every rank, before any communication
                return {"error": str(error)}
        with count_collectives() as counts:
            run.step(*((x,) if pp_rank == 0 or looped else ()), target=y if any(s.is_last for s in stages) else None)
        reduce_scatters.append(counts["reduce_scatter_single"])
        both = [_batch(step, r) for r in range(2)]  # the global batch: both dp ranks' rows
        _mse(reference(torch.cat([b[0] for b in both])), torch.cat([b[1] for b in both])).backward()
        for i, module in modules.items():
            for p, r in zip(module.parameters(), reference[i].parameters()):
                grad_diff = max(grad_diff, max_abs_diff(p.grad.full_tensor(), r.grad))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    param_diff = max(
        max_abs_diff(p.full_tensor(), r) for i, m in modules.items() for p, r in zip(m.parameters(), reference[i].parameters())
    )
    if compat:
        handle.undo()
    return {"groups": 3 * len(mine), "reduce_scatters": reduce_scatters, "grad_diff": grad_diff, "param_diff": param_diff}


def _with_pipelining_unimported(fn, *args):
    """``fn(*args)`` in this worker with ``torch.distributed.pipelining`` not imported (``fn`` imports it
    again, as new module objects); the modules that were there are put back after."""
    import torch.distributed

    # the package and the two modules install() patches; the rest (which registers operators) stays
    names = ["torch.distributed.pipelining", "torch.distributed.pipelining.stage", "torch.distributed.pipelining.schedules"]
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    attribute = torch.distributed.__dict__.pop("pipelining", None)
    try:
        return fn(*args)
    finally:
        sys.modules.update(saved)
        if attribute is not None:
            torch.distributed.pipelining = attribute


@pytest.mark.parametrize(
    "schedule, compat, late_import",
    [
        pytest.param("GPipe", False, False, marks=pytest.mark.slow),
        ("1F1B", False, False),
        ("Interleaved1F1B", False, False),
        pytest.param("LoopedBFS", False, False, marks=pytest.mark.slow),
        pytest.param("1F1B", True, False, marks=pytest.mark.slow),
        pytest.param("1F1B", False, True, marks=pytest.mark.slow),
    ],
)
def test_pipeline_schedule_reduces_once_per_step(schedule, compat, late_import):
    for r in run_on_ranks(4, _train, schedule, compat, True, late_import):  # every rank of every stage
        assert r["reduce_scatters"] == [r["groups"]] * STEPS, r  # step 0 (the metadata inference) included
        assert max(r["grad_diff"], r["param_diff"]) <= 1e-5, r


OLD_ZBV = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
    reason="torch 2.11-2.12's ZBV sends between two stages of one rank over gloo, which gloo refuses",
)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", pytest.param("ZBVZeroBubble", marks=OLD_ZBV)])
def test_zero_bubble_schedules_train_without_resharding_and_refuse_it(schedule):
    """Their weight-gradient pass runs on what the stage holds after the input-gradient pass: with the
    blocks resharded, the shards (torch's FSDP2 then drops those gradients silently). Without
    resharding they train at parity; with it, every rank raises at the first step."""
    for r in run_on_ranks(4, _train, schedule, False, False):
        assert r["reduce_scatters"] == [r["groups"]] * STEPS, r
        assert max(r["grad_diff"], r["param_diff"]) <= 1e-5, r
    for r in run_on_ranks(4, _train, schedule, False, True):
        assert "reshard_after_forward=False" in r["error"], r

