"""The benchmarks' O(1) "null" backend: both libraries' collectives go through it, and it
leaves every output as it was (it measures host work only)."""

import json
import os
import subprocess
import sys

import pytest

from tests.harness import hang_timeout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from benchmarks import null_backend
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from fsdp_compose import fully_shard

dist.init_process_group("null", store=FakeStore(), rank=0, world_size=1024)
mesh = init_device_mesh("cpu", (1024,))
out = torch.full((1024 * 2,), 7.0)
(getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, torch.zeros(2))  # torch 2.11: the old name
calls = {"untouched": bool((out == 7.0).all())}
for name, shard in (("torch", torch_fully_shard), ("ours", fully_shard)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for layer in model:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    null_backend.CALLS.clear()
    model(torch.ones(2, 4)).sum().backward()
    calls[name] = dict(null_backend.CALLS)
print(json.dumps(calls))
"""


def _calls(check_order: str) -> dict:
    env = dict(os.environ, FSDP_COMPOSE_CHECK_ORDER=check_order, PYTHONPATH=ROOT)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_timeout()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    calls = json.loads(result.stdout.strip().splitlines()[-1])
    assert calls.pop("untouched") is True
    return calls


@pytest.mark.slow  # a fresh interpreter
def test_null_backend_counts_both_libraries_collectives_and_touches_no_output():
    # 3 groups: the two layers and the root (which owns no parameters here); each layer is
    # gathered in forward and again in backward, and its gradient reduce-scattered once.
    assert _calls("0") == {name: {"all_gather_single": 4, "reduce_scatter_single": 2} for name in ("torch", "ours")}


def test_divergence_check_adds_one_collective_per_step_on_other_backends():
    """Off gloo, order checks are logged on the host and one all-reduce agrees on the step's log
    when backward ends: no collective per all-gather (_checks/order.py)."""
    assert _calls("1")["ours"] == {"all_gather_single": 4, "reduce_scatter_single": 2, "allreduce": 1}
