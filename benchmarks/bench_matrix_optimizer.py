"""optimizer.step() time, collectives and bytes per step of Muon on sharded matrices (issue 36).

    python benchmarks/bench_matrix_optimizer.py            # 2 and 4 gloo ranks, both models
    python benchmarks/bench_matrix_optimizer.py --quick    # fewer steps
    python benchmarks/bench_matrix_optimizer.py --models gpt --gpt-layers 4   # a smaller benchmark GPT

Two models: ``linears``, 8 x Linear(512, 512, bias=False) each ``fully_shard``ed (Muon over every weight),
and ``gpt``, the benchmark GPT of ``bench_model.py`` (8 blocks, dim 512; one group per block and the root),
with Muon over the blocks' 2-D weights (qkv, proj, the MLP's two; embeddings, head, norms and biases go to
AdamW in practice and are not timed here).

Four ways, on every rank at once (1 thread per rank, gradients from one backward, reused each step),
interleaved step by step (their order rotating each step) so drift in machine load hits them alike: unsharded
torch.optim.Muon (each rank holds the whole model, no communication), torch FSDP2 + torch.optim.Muon,
fsdp_compose + torch.optim.Muon (both on DTensors: every rank computes every matrix), and fsdp_compose +
OwnerComputedMuon. A step's time is the slowest rank's; each way's figure is the median over steps. The
targets are judged on paired ratios: owner-computed against the other way in the same round of steps, the
median over rounds, with its quartiles as the spread (on a shared machine the medians alone drift apart).
Collectives are those one step issues as they reach the dispatcher (c10d calls and DTensor's functional
collectives alike); bytes are what the busiest rank sends to other ranks in them (all-gather: its input to each
of N-1 others; all-reduce: 2(N-1)/N of the tensor, as a ring; reduce-scatter: (N-1)/N of its input;
all-to-all: its input less its own split).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, "examples")) if p not in sys.path]

KINDS = ("unsharded Muon", "torch FSDP2 + Muon", "fsdp_compose + Muon", "fsdp_compose + OwnerComputedMuon")
TARGETS = {2: 0.65, 4: 0.4}  # owner-computed step / unsharded step, by world size
TARGET_VS_TORCH = 0.35  # owner-computed step / torch FSDP2 + Muon step, at 2 ranks
MODELS = ("linears", "gpt")
# collective ops (c10d's and the functional ones; not wait_tensor, barrier or _wrap_tensor_autograd)
COLLECTIVE_PREFIXES = ("all_gather", "allgather", "all_reduce", "allreduce", "reduce_scatter", "all_to_all",
                       "alltoall", "broadcast", "reduce_", "gather_", "scatter_", "send", "recv")


def build(model: str, args: argparse.Namespace) -> tuple[nn.Module, list[nn.Module], object]:
    """The model, the modules sharded one group each (the root last), and a function making its loss."""
    torch.manual_seed(0)
    if model == "linears":
        net = nn.Sequential(*(nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.blocks)))
        return net, [*net, net], lambda m: m(torch.randn(8, args.dim)).square().mean()
    from bench_model import CONFIG
    from gpt import GPT, lm_loss, synthetic_batch

    cfg = dataclasses.replace(CONFIG, n_layers=args.gpt_layers, dim=args.gpt_dim)
    net = GPT(cfg)
    batch = synthetic_batch(cfg, 2, 0, 0)
    return net, [*net.blocks, net], lambda m: lm_loss(m, batch)


def muon_params(model: str, net: nn.Module) -> list[nn.Parameter]:
    """Muon's parameters: every weight of ``linears``; the GPT blocks' 2-D weights."""
    if model == "linears":
        return list(net.parameters())
    return [p for p in net.blocks.parameters() if p.ndim == 2]


def prepare(kind: str, model: str, args: argparse.Namespace) -> torch.optim.Optimizer:
    """The model of ``kind`` with gradients, and its Muon."""
    from fsdp_compose.optim import OwnerComputedMuon

    net, groups, loss_of = build(model, args)
    if kind != KINDS[0]:
        if kind == KINDS[1]:
            from torch.distributed.fsdp import fully_shard
        else:
            from fsdp_compose import fully_shard
        for module in groups:
            fully_shard(module)
    loss_of(net).backward()
    cls = OwnerComputedMuon if kind == KINDS[3] else torch.optim.Muon
    return cls(muon_params(model, net), lr=0.02)


class CollectiveBytes(TorchDispatchMode):
    """Calls and bytes sent to other ranks of every collective reaching the dispatcher (1-D world group)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.sent = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives on plain tensors, which come back here
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace in ("c10d", "_c10d_functional") and name.strip("_").startswith(COLLECTIVE_PREFIXES):
            self.calls += 1
            self.sent += _sent_bytes(name, args)
        return func(*args, **kwargs)


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _sent_bytes(name: str, args: tuple) -> float:
    n, rank = dist.get_world_size(), dist.get_rank()
    if name in ("all_to_all_single", "alltoall_base_"):
        tensor, splits = (args[0], args[2]) if name == "all_to_all_single" else (args[1], args[4])
        if not splits:
            return _nbytes(tensor) * (n - 1) / n
        per = tensor.element_size() * (tensor.numel() // max(sum(splits), 1))
        return (sum(splits) - splits[rank]) * per
    if name.startswith("all_gather") or name.startswith("allgather") or name.startswith("_allgather"):
        source = args[0] if name.startswith("all_gather") else args[1]
        return _nbytes(source) * (n - 1)
    if name.startswith("all_reduce") or name.startswith("allreduce"):
        return _nbytes(args[0]) * 2 * (n - 1) / n
    if "reduce_scatter" in name:
        source = args[0] if name.startswith("reduce_scatter") else args[1]
        return _nbytes(source) * (n - 1) / n
    return _nbytes(args[0])  # anything else (broadcast, ...): its tensor, once


def count_collectives(step) -> tuple[int, float]:
    with CollectiveBytes() as mode:
        step()
    return mode.calls, mode.sent


def time_step(opt: torch.optim.Optimizer) -> float:
    """One step's time on this rank; all ranks start it together."""
    dist.barrier()
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def busiest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    for model in args.models:
        optimizers = {kind: prepare(kind, model, args) for kind in KINDS}
        counted = {}
        for kind, opt in optimizers.items():
            opt.step()  # warm-up: state allocated, first-step checks done
            counted[kind] = count_collectives(opt.step)
        times = torch.zeros(len(KINDS), args.steps, dtype=torch.float64)
        for step in range(args.steps):  # interleaved and rotated, so drift in machine load hits every kind alike
            for k in [(step + j) % len(KINDS) for j in range(len(KINDS))]:
                times[k, step] = time_step(optimizers[KINDS[k]])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each step's slowest rank
        results = {
            kind: (statistics.median(times[k].tolist()), counted[kind][0], busiest(counted[kind][1]))
            for k, kind in enumerate(KINDS)
        }
        ratios = {other: (times[3] / times[k]).tolist() for k, other in enumerate(KINDS[:2])}
        if rank == 0:
            matrices = sum(p.numel() for p in muon_params(model, build(model, args)[0]))
            report(world_size, model, args, matrices, results, ratios)
        del optimizers
        dist.barrier()
    dist.destroy_process_group()


def describe(model: str, args: argparse.Namespace) -> str:
    if model == "linears":
        return f"{args.blocks} x Linear({args.dim}, {args.dim}, bias=False)"
    return f"benchmark GPT, {args.gpt_layers} blocks, dim {args.gpt_dim} (Muon on the blocks' 2-D weights)"


def paired(ratios: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of per-round ratios."""
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return median, q1, q3


def report(world_size: int, model: str, args: argparse.Namespace, numel: int,
           results: dict[str, tuple[float, int, float]], ratios: dict[str, list[float]]) -> None:
    unsharded, torch_fsdp = results[KINDS[0]][0], results[KINDS[1]][0]
    print(f"\n{describe(model, args)}, {numel / 1e6:.1f}M matrix elements, {world_size} ranks "
          f"(ratios: to unsharded Muon, to torch FSDP2 + Muon)")
    for kind, (seconds, calls, sent) in results.items():
        print(f"  {kind:34s} {seconds * 1e3:9.1f} ms  {calls:5d} collectives {sent / 2**20:9.2f} MiB sent"
              f"  {seconds / unsharded:6.2f}x  {seconds / torch_fsdp:6.3f}x")
    targets = [(KINDS[0], TARGETS[world_size])] + ([(KINDS[1], TARGET_VS_TORCH)] if world_size == 2 else [])
    for other, target in targets:
        median, q1, q3 = paired(ratios[other])
        verdict = "met" if median <= target else "NOT met"
        print(f"  target owner-computed <= {target}x {other}: {verdict} (paired per round: median {median:.3f}x, "
              f"quartiles {q1:.3f}-{q3:.3f}x)")
    sys.stdout.flush()


def _run_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    rank_main(rank, world_size, port, args)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown while gloo threads may still hold work (docs/troubleshooting.md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--gpt-layers", type=int, default=8)
    parser.add_argument("--gpt-dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.quick else 15)
    import torch.multiprocessing as mp

    print(f"optimizer.step() median of {args.steps} interleaved steps, {os.cpu_count()} CPUs, 1 thread per rank")
    for world_size in args.world_sizes:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_run_rank, args=(world_size, port, args), nprocs=world_size, start_method="spawn")


if __name__ == "__main__":
    main()
