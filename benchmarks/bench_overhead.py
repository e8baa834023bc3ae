"""Benchmark (b): per-step CPU overhead on a fake process group (no data moves).

    python benchmarks/bench_overhead.py      # ws 8, 48 tiny groups, 1 thread

With the fake backend every collective returns at once, so a step's time is compute on tiny
tensors plus the library's own bookkeeping; the compute-only figure (same model, no sharding)
is subtracted to get the overhead. The last line prices the profiler labels
(``fsdp_compose::all_gather blocks.3``...) when no profiler is active. The fake backend fills no data, so our order check's tags
cannot be compared; ``ours`` runs the full check against a locally built tag instead, which
costs the same work (slightly more: one extra tag build).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import median_time  # noqa: E402


def build(groups: int, dim: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(groups)])


def shard(model, fully_shard, mesh):
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check_against_local_tag(enabled: bool) -> None:
    """Let our order check run its full cost on the fake backend, whose outputs hold no data."""
    import fsdp_compose.runtime.group as group_module
    from fsdp_compose.runtime.order_check import verify_headers

    def verify_local(headers, expected, describe):
        world = headers.shape[0]
        verify_headers(expected.expand(world, -1).clone(), expected, describe)

    group_module.verify_headers = verify_local
    os.environ["FSDP_COMPOSE_CHECK_ORDER"] = "1" if enabled else "0"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    mesh = init_device_mesh("cpu", (args.world_size,))
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compose import fully_shard

    base = build(args.groups, args.dim)
    models = {"compute": copy.deepcopy(base), "torch": shard(copy.deepcopy(base), torch_fully_shard, mesh)}
    check_against_local_tag(enabled=True)
    models["ours"] = shard(copy.deepcopy(base), fully_shard, mesh)
    check_against_local_tag(enabled=False)
    models["ours, order check off"] = shard(copy.deepcopy(base), fully_shard, mesh)
    x = torch.randn(4, args.dim)

    def step(model):
        def run():
            model(x).sum().backward()
            for p in model.parameters():
                p.grad = None

        return run

    for model in models.values():  # warm up: lazy init, recorded order
        for _ in range(3):
            step(model)()
    times = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            times[name].append(median_time(step(model), args.steps))
    t = {name: min(v) for name, v in times.items()}
    overhead = {name: t[name] - t["compute"] for name in models if name != "compute"}
    layer = f"Linear({args.dim},{args.dim})"
    print(f"(b) fake process group, ws {args.world_size}, {args.groups} groups of {layer} + root; "
          f"forward+backward per step, best of {args.rounds} rounds of median-of-{args.steps}")
    print(f"    compute-only {t['compute'] * 1e3:.2f} ms/step")
    for name, value in overhead.items():
        print(f"    {name:24s} {t[name] * 1e3:7.2f} ms/step, overhead {value * 1e3:6.2f} ms "
              f"({value / args.groups * 1e6:5.1f} us/group)")
    print(f"    overhead ours/torch = {overhead['ours'] / overhead['torch']:.3f}  (target <= 0.5); "
          f"order check costs {(overhead['ours'] - overhead['ours, order check off']) * 1e3:.2f} ms/step")
    label_cost(step(models["ours"]), models["ours"])
    dist.destroy_process_group()


def label_cost(run_step, model) -> None:
    """What the profiler labels cost when no profiler runs: calls per step x cost of one call."""
    import time

    import fsdp_compose.runtime.group as group_module
    from fsdp_compose.runtime.state import states_in

    original, calls = group_module.labelled, [0]

    def counting(kind, group):
        calls[0] += 1
        return original(kind, group)

    group_module.labelled = counting
    run_step()
    group_module.labelled = original
    group = states_in(model)[1][1].group
    repeats = 200_000
    start = time.perf_counter()
    for _ in range(repeats):
        with original("all_gather", group):
            pass
    per_call = (time.perf_counter() - start) / repeats
    print(f"    profiler labels, no profiler active: {calls[0]} per step x {per_call * 1e9:.0f} ns "
          f"= {calls[0] * per_call * 1e6:.1f} us/step")


if __name__ == "__main__":
    main()
