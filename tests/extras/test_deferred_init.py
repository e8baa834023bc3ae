"""Deferred (meta-device) initialization and rank-0 state sync."""

import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp_compose import CPUOffloadPolicy, fully_shard, init_sharded_parameters, sync_module_states
from fsdp_compose._runtime.state import states_in
from tests.harness import run_on_ranks
from tests.models import TinyLM, assert_parity, shard_blocks_then_root, train_against_reference


def _meta_init_parity():
    """Same seed rule, same values: eager init vs meta + shard + to_empty + init_sharded_parameters."""

    def build_meta_sharded():
        with torch.device("meta"):
            model = TinyLM()
        shard_blocks_then_root(model)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        init_sharded_parameters(model)
        return model

    torch.manual_seed(0)
    eager = TinyLM()
    model = build_meta_sharded()
    init_diff = max((p.full_tensor() - e).abs().max().item() for p, e in zip(model.parameters(), eager.parameters()))
    # and it trains like the eagerly initialized reference
    result = train_against_reference(TinyLM, shard_blocks_then_root, sharded=build_meta_sharded)
    result["init_diff"] = init_diff
    return result


def test_meta_init_matches_eager_init():
    results = run_on_ranks(3, _meta_init_parity)
    assert all(r["init_diff"] == 0.0 for r in results)
    assert_parity(results)


def _rss():
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith("Vm")}


def _init_peak_memory():
    layers, width = 8, 1024
    module_bytes = width * (width + 1) * 4
    full_bytes = layers * module_bytes
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    before = _rss()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM)
    model.to_empty(device="cpu")
    init_sharded_parameters(model)
    peak = _rss()["VmHWM"] - before
    x = torch.randn(2, width)
    return {"peak": peak, "full": full_bytes, "module": module_bytes, "out": model(x).sum().item()}


def test_meta_init_peak_memory_is_about_one_shard():
    reports = run_on_ranks(2, _init_peak_memory)
    for r in reports:
        shard = r["full"] / 2
        # the shards, plus one Linear at full size while it initializes, plus allocator slack
        assert r["peak"] <= shard + r["module"] + 4 * 2**20, r
        assert r["peak"] < 0.75 * r["full"], r  # never the whole model
        print(f"init peak {r['peak'] / 2**20:.1f} MiB; full model {r['full'] / 2**20:.1f} MiB")
    assert len({round(r["out"], 4) for r in reports}) == 1


def _sync_states():
    torch.manual_seed(dist.get_rank())  # every rank initializes differently
    model = TinyLM()
    sync_module_states(model)
    shard_blocks_then_root(model)
    full = [p.full_tensor() for p in model.parameters()]
    torch.manual_seed(0)
    reference = TinyLM()  # what rank 0 built
    return max((a - b).abs().max().item() for a, b in zip(full, reference.parameters()))


def test_sync_module_states_makes_ranks_identical():
    assert run_on_ranks(3, _sync_states) == [0.0, 0.0, 0.0]


def _meta_init_with_offload():
    """torchtitan's CPU-offload flow: built on meta, sharded with CPUOffloadPolicy, ``to_empty(device="cpu")``.

    The group computes on the mesh's device from ``fully_shard`` on (a meta model used to compute where
    ``to_empty`` put it: on a GPU that was the CPU), and the shards' storage waits for ``to_empty``.
    Materializing offloaded shards anywhere but the CPU is refused, naming the parameter (fake CUDA
    tensors stand in for a GPU)."""

    def build_meta_sharded(materialize: bool = True):
        with torch.device("meta"):
            model = TinyLM()
        shard_blocks_then_root(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
        if materialize:
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            init_sharded_parameters(model)
        return model

    unmaterialized = build_meta_sharded(materialize=False)
    layouts = {(str(p.layout.compute_device), str(p.layout.storage_device)) for p in _sharded_params(unmaterialized)}
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            unmaterialized.to_empty(device="cuda")
        refused = "nothing"
    except ValueError as error:
        refused = str(error)
    result = train_against_reference(TinyLM, shard_blocks_then_root, sharded=build_meta_sharded)
    result["layouts_before"] = sorted(layouts)
    after = _sharded_params(build_meta_sharded())
    result["layouts_after"] = sorted({(str(p.layout.compute_device), str(p.layout.storage_device)) for p in after})
    result["refused"] = refused
    return result


def _sharded_params(model: nn.Module) -> list:
    return [p for _, s in states_in(model) for p in s.group.params]


def test_meta_init_with_cpu_offload_computes_on_the_mesh_device_and_trains():
    results = run_on_ranks(2, _meta_init_with_offload)
    assert_parity(results)
    for r in results:
        assert r["layouts_before"] == [("cpu", "meta")], r["layouts_before"]
        assert r["layouts_after"] == [("cpu", "cpu")], r["layouts_after"]
    assert_expected_inline(
        results[0]["refused"],
        """parameter 'norm.weight' was materialized on cuda:0, but offload_policy=CPUOffloadPolicy() keeps shards on the CPU: call model.to_empty(device='cpu'); the group still computes on cpu""",
    )
