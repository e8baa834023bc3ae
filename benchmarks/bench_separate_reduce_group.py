"""Step time with reduce-scatters on the all-gather's process group vs on a second one.

    python benchmarks/bench_separate_reduce_group.py     # ws 2, the bench_step GPT, 1 thread/rank

A gloo process group runs one collective at a time, so in backward a group's reduce-scatter
and the next group's prefetched all-gather queue behind each other.
``set_separate_reduce_scatter_group()`` gives reduce-scatters a process group of their own so
both move at once. Both variants are built from the same seed and timed in interleaved
rounds; their losses must agree exactly (the same sums, just on another group).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, lm_loss, synthetic_batch  # noqa: E402

from benchmarks.bench_step import CONFIG  # noqa: E402
from benchmarks.common import add_step_args, spawn_ranks  # noqa: E402


def make_step(base: GPT, separate: bool):
    from fsdp_compose import fully_shard

    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if separate:
        model.set_separate_reduce_scatter_group()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    counter = {"step": 0}

    def step(batch_size: int) -> float:
        batch = synthetic_batch(CONFIG, batch_size, counter["step"], dist.get_rank())
        counter["step"] += 1
        loss = lm_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def rank_main(rank: int, world_size: int, port: int, args) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    base = GPT(CONFIG)
    steps = {"shared": make_step(base, False), "separate": make_step(base, True)}
    times = {k: [] for k in steps}
    losses = {k: [s(args.batch_size) for _ in range(args.warmup)] for k, s in steps.items()}
    for _ in range(args.rounds):
        for kind, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps_per_round):
                losses[kind].append(step(args.batch_size))
            times[kind].append((time.perf_counter() - start) / args.steps_per_round)
    if rank == 0:
        t = {k: statistics.median(v) for k, v in times.items()}
        print(f"ws {world_size}, batch {args.batch_size}x{CONFIG.seq_len}, {args.rounds} rounds x "
              f"{args.steps_per_round} steps, medians")
        print(f"one process group {t['shared']:.3f}s/step   separate reduce-scatter group {t['separate']:.3f}s/step   "
              f"separate/shared = {t['separate'] / t['shared']:.3f}")
        diff = max(abs(a - b) for a, b in zip(losses["shared"], losses["separate"]))
        print(f"losses agree: max |diff| {diff:.2e}")
    dist.destroy_process_group()


def main() -> None:
    parser = add_step_args(argparse.ArgumentParser())
    args = parser.parse_args()
    spawn_ranks(rank_main, args)


if __name__ == "__main__":
    main()
