"""optimizer.step() time and collectives per step of Muon on sharded matrices (issue 36).

    python benchmarks/bench_matrix_optimizer.py            # 2 and 4 gloo ranks, 8 x Linear(512, 512)
    python benchmarks/bench_matrix_optimizer.py --quick    # fewer steps (under 60 s)

Four ways, on every rank at once (1 thread per rank, gradients from one backward, reused each step),
interleaved step by step so drift in machine load hits them alike:
unsharded torch.optim.Muon (each rank holds the whole model, no communication), torch FSDP2 +
torch.optim.Muon, fsdp_compose + torch.optim.Muon (both on DTensors: every rank computes every matrix),
and fsdp_compose + OwnerComputedMuon. A step's time is the slowest rank's median; collectives are those
one step issues, counted by CommDebugMode (c10d calls and functional collectives alike).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KINDS = ("unsharded Muon", "torch FSDP2 + Muon", "fsdp_compose + Muon", "fsdp_compose + OwnerComputedMuon")
TARGETS = {2: 0.65, 4: 0.4}  # owner-computed step / unsharded step, by world size
TARGET_VS_TORCH = 0.35  # owner-computed step / torch FSDP2 + Muon step, at 2 ranks


def build(blocks: int, dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(blocks)))


def prepare(kind: str, base: nn.Sequential) -> torch.optim.Optimizer:
    """The model of ``kind`` with gradients, and its Muon."""
    from fsdp_compose.optim import OwnerComputedMuon

    model = copy.deepcopy(base)
    if kind != KINDS[0]:
        if kind == KINDS[1]:
            from torch.distributed.fsdp import fully_shard
        else:
            from fsdp_compose import fully_shard
        for block in model:
            fully_shard(block)
        fully_shard(model)
    model(torch.randn(8, base[0].in_features)).square().mean().backward()
    cls = OwnerComputedMuon if kind == KINDS[3] else torch.optim.Muon
    return cls(model.parameters(), lr=0.02)


def collectives_in(step) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        step()
    return mode.get_total_counts()


def time_step(opt: torch.optim.Optimizer) -> float:
    """One step's time on this rank; all ranks start it together."""
    dist.barrier()
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    base = build(args.blocks, args.dim)
    optimizers = {kind: prepare(kind, base) for kind in KINDS}
    calls = {}
    for kind, opt in optimizers.items():
        opt.step()  # warm-up: state allocated, first-step checks done
        calls[kind] = collectives_in(opt.step)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(args.steps):  # interleaved, so drift in machine load hits every kind alike
        for kind, opt in optimizers.items():
            times[kind].append(time_step(opt))
    results = {kind: (slowest(statistics.median(times[kind])), calls[kind]) for kind in KINDS}
    if rank == 0:
        report(world_size, results)
    dist.barrier()
    dist.destroy_process_group()


def report(world_size: int, results: dict[str, tuple[float, int]]) -> None:
    unsharded, torch_fsdp = results[KINDS[0]][0], results[KINDS[1]][0]
    print(f"\n{world_size} ranks (ratios: to unsharded Muon, to torch FSDP2 + Muon)")
    for kind, (seconds, calls) in results.items():
        print(f"  {kind:34s} {seconds * 1e3:9.1f} ms  {calls:5d} collectives"
              f"  {seconds / unsharded:6.2f}x  {seconds / torch_fsdp:6.3f}x")
    ours = results[KINDS[3]][0]
    verdict = "met" if ours / unsharded <= TARGETS[world_size] else "NOT met"
    print(f"  target owner-computed <= {TARGETS[world_size]}x unsharded: {verdict} ({ours / unsharded:.2f}x)")
    if world_size == 2:
        verdict = "met" if ours / torch_fsdp <= TARGET_VS_TORCH else "NOT met"
        print(f"  target owner-computed <= {TARGET_VS_TORCH}x torch FSDP2 + Muon: {verdict} ({ours / torch_fsdp:.3f}x)")
    sys.stdout.flush()


def _run_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    rank_main(rank, world_size, port, args)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown while gloo threads may still hold work (docs/troubleshooting.md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, under 60 s")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.quick else 15)
    import torch.multiprocessing as mp

    print(f"{args.blocks} x Linear({args.dim}, {args.dim}, bias=False), median of {args.steps} interleaved steps, "
          f"{os.cpu_count()} CPUs, 1 thread per rank")
    for world_size in args.world_sizes:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_run_rank, args=(world_size, port, args), nprocs=world_size, start_method="spawn")


if __name__ == "__main__":
    main()
