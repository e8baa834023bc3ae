"""Issue 22: on a backend other than gloo a training step reads no tensor value on the host, and
models in one process share nothing.

Each configuration the suite trains runs two AdamW steps on fake tensors (``FakeTensorMode``, where
any host read raises) with torch's fake process group, all in one process
(tests/runtime/fake_backend_configs.py, run in a subprocess: the test process may hold a gloo
group). Ranks that diverge on such a backend are still named, once the step's backward ends
(_checks/order.py), shown on torch's threaded process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compose import fully_shard
from fsdp_compose._checks.order import ExecutionOrderError
from tests.harness import hang_timeout
from tests.runtime.test_threaded_ranks import _ThreadedRanks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALL = (
    "fp32,bf16,no_reshard,reshard_to_4,hsdp,hsdp_reshard_to_2,shard_dim_1,no_sync,offload,checkpointed,"
    "tp_2d,dp_mesh_dims,tied,unused,protocol,quantized,side_by_side,fake_built"
)


def _run(world: int, configs: str, rank: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "tests.runtime.fake_backend_configs", str(world), configs, str(rank)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=hang_timeout(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _rows(total: int, parts: int, index: int) -> int:
    """Rows ``Shard(0)`` gives piece ``index`` of ``parts`` (``torch.chunk``'s split: the last may hold none)."""
    size = -(-total // parts)
    return max(0, min(size, total - index * size))


def _check(results: dict, configs: str, world: int, rank: int) -> None:
    half = world // 2  # the shard dim of the 2-D meshes: (2, half), or (half, 2) for tp_2d
    for config in configs.split(","):
        got = results[config]
        assert "error" not in got, (config, got)
        if config == "side_by_side":
            assert got["adam_steps"][0] == got["adam_steps"][1] > 0, got
            assert got["embed_local_rows"] == [_rows(64, world, rank), _rows(64, half, rank % half)], got
            continue
        assert got["loss_shape"] == [] and got["all_dtensors"], (config, got)
        assert got["grads_like_shards"] and got["adam_state_like_shards"], (config, got)
        assert got["gathered_with_protocol"] == (config == "protocol"), (config, got)
        assert got["quantized_bytes"] == (config == "quantized"), (config, got)
        if config == "shard_dim_1":
            expected_rows = 64
        elif config == "tp_2d":
            expected_rows = _rows(64, half, rank // 2)
        elif config in ("hsdp", "hsdp_reshard_to_2", "dp_mesh_dims"):
            expected_rows = _rows(64, half, rank % half)
        else:
            expected_rows = _rows(64, world, rank)
        assert got["embed_local_rows"] == expected_rows, (config, got)


# rank 0 at 8 ranks; the last rank at 1024, which holds no row of the 64-row embedding (empty shards,
# padding rows only in its reduce-scatter tables)
@pytest.mark.parametrize(("world", "rank"), [(8, 0), pytest.param(1024, 1023, marks=pytest.mark.slow)])
def test_every_configuration_trains_two_steps_on_fake_tensors(world, rank):
    _check(_run(world, ALL, rank), ALL, world, rank)


# ----- divergence on a backend other than gloo: named when backward ends --------------------------
class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x: torch.Tensor, reverse: bool) -> torch.Tensor:
        return self.a(self.b(x)) if reverse else self.b(self.a(x))


class TestDivergenceOnThreadedRanks(_ThreadedRanks):
    """Rank 1 runs two equally sized modules in the other order: the collectives pair up (no hang,
    mixed-up data), and every rank raises when the step's order checks are judged."""

    @property
    def world_size(self) -> int:
        return 2

    def _diverge(self) -> str:
        model = TwoLinears()
        fully_shard(model.a)
        fully_shard(model.b)
        fully_shard(model)
        try:
            model(torch.ones(2, 4), reverse=dist.get_rank() == 1).sum().backward()
        except ExecutionOrderError as error:
            return str(error)
        return "no error"

    def test_ranks_are_named_when_backward_ends(self) -> None:
        assert_expected_inline(
            self._diverge(),
            """\
Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped a sharded module, ran a different number of forward calls, or ran modules in another order; check data-dependent control flow):
  rank 0: all-gather of 'a' (Linear), 40 bytes
  rank 1: all-gather of 'b' (Linear), 40 bytes
(on this backend the order checks are compared on the device and judged when a step's backward ends, so the collectives after the first difference already ran)""",
        )


class TestReplicaDivergenceOnThreadedRanks(_ThreadedRanks):
    """HSDP on 2 replicas x 2 shards, off gloo: the second replica runs two equally sized modules in the
    other order. Each shard group agrees with itself, so only the all-reduces across replicas pair up
    different modules' gradients (same sizes: the sums would be silently mixed up); their order checks,
    logged on the replicate groups, name the replicas when backward ends."""

    @property
    def world_size(self) -> int:
        return 4

    def test_replicas_running_modules_in_another_order_are_named(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = TwoLinears()
        fully_shard(model.a, mesh=mesh)
        fully_shard(model.b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_reduce_scatter_max_input_buffers(1)  # each reduction finishes (all-reduces) as the next starts
        try:
            model(torch.ones(2, 4), reverse=dist.get_rank() >= 2).sum().backward()
            message = "no error"
        except ExecutionOrderError as error:
            message = str(error)
        if dist.get_rank() == 0:
            assert_expected_inline(message, """\
Ranks diverged: they were about to run different collectives of sharded modules (a rank skipped a sharded module, ran a different number of forward calls, or ran modules in another order; check data-dependent control flow):
  rank 0: all-reduce of 'b' (Linear), 48 bytes
  rank 2: all-reduce of 'a' (Linear), 48 bytes
(reduce-scatters, and HSDP's all-reduces across replicas, run when a module's backward is done: ranks reach different ones when a rank skipped or repeated backward(), ran a different number of micro-batches without gradient sync, or computed no gradient this step for some parameters of a module it ran, e.g. skipped computation or an unused branch or expert; such a rank reduces that module only when backward ends)
(on this backend the order checks are compared on the device and judged when a step's backward ends, so the collectives after the first difference already ran)""")
        else:
            self.assertIn("Ranks diverged", message)
