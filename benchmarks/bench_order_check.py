"""Step-time cost of the cross-rank order checks, A/B interleaved on real gloo ranks.

    python benchmarks/bench_order_check.py [--steps 8]

Builds bench_step.py's GPT three times from the same seed: FSDP_COMPOSE_CHECK_ORDER=0 (no check), the
order check before all-gathers only (gloo's default before issue 24), and the default (on gloo every
all-gather and reduce-scatter agreed on); alternates their steps so machine load hits all alike and
prints the median step time of each and their ratios.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from gpt import GPT, lm_loss, synthetic_batch  # noqa: E402

from benchmarks.bench_step import CONFIG  # noqa: E402
from fsdp_compose import fully_shard  # noqa: E402

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.11: old name


def _states(model):
    from fsdp_compose._runtime.state import state_of

    return {id(s): s for m in model.modules() if (s := state_of(m)) is not None}.values()


def build(mode: str):
    """``mode``: a FSDP_COMPOSE_CHECK_ORDER value, or "all-gathers" (the default before issue 24 on gloo:
    order checks before all-gathers only, so divergence in backward could still reach gloo's abort)."""
    from fsdp_compose._runtime import handshake

    os.environ["FSDP_COMPOSE_CHECK_ORDER"] = "1" if mode == "all-gathers" else mode
    kinds = handshake.checked_kinds
    if mode == "all-gathers":  # read when fully_shard builds each group
        all_gathers = frozenset((handshake.ALL_GATHER,))
        handshake.checked_kinds = lambda: (all_gathers, all_gathers)
    try:
        torch.manual_seed(0)
        model = GPT(CONFIG)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    finally:
        handshake.checked_kinds = kinds
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def rank_main(rank: int, world_size: int, port: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    modes = ("0", "all-gathers", "1")
    runs = {mode: build(mode) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for step in range(args.steps + 1):
        for mode in modes if step % 2 else modes[::-1]:
            model, optimizer = runs[mode]
            batch = synthetic_batch(CONFIG, args.batch_size, step, rank)
            dist.barrier()
            started = time.perf_counter()
            lm_loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step:  # the first step is warm-up
                times[mode].append(time.perf_counter() - started)
    # the order check alone, for a bound that machine noise cannot blur: latency x count per step
    from fsdp_compose._runtime import handshake
    from fsdp_compose._checks.order import ALL_GATHER, OrderCheck

    kinds = handshake.checked_kinds
    handshake.checked_kinds = lambda: (frozenset((ALL_GATHER,)), frozenset((ALL_GATHER,)))
    try:
        order_check = OrderCheck(1, torch.device("cpu"))
    finally:
        handshake.checked_kinds = kinds
    dist.barrier()
    started = time.perf_counter()
    for _ in range(200):
        order_check.check(ALL_GATHER, 1024, dist.group.WORLD)
    latency = (time.perf_counter() - started) / 200
    bare = {}  # what a order check's collective costs alone: a round's all-reduce, beside an all-gather
    entry, rows = torch.zeros(6, dtype=torch.int64), torch.zeros(6 * world_size, dtype=torch.int64)
    for name, run in (("all_reduce", lambda: dist.all_reduce(entry)),
                      ("all_gather", lambda: all_gather_single(rows, entry))):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(200):
            run()
        bare[name] = (time.perf_counter() - started) / 200
    gathers = sum(s.group.stats.all_gathers for s in _states(runs["1"][0])) / (args.steps + 1)
    if rank == 0:
        print(f"one order check: {latency * 1e6:.0f} us; {gathers:.0f} all-gathers per step -> "
              f"{latency * gathers * 1e3:.2f} ms per step added by the default mode")
        print(f"bare 48-byte collectives: all_reduce {bare['all_reduce'] * 1e6:.0f} us, "
              f"all_gather {bare['all_gather'] * 1e6:.0f} us")
        off, gathers, default = (statistics.median(times[m]) for m in modes)
        print(f"median step: checks off {off:.4f}s  all-gathers only {gathers:.4f}s ({gathers / off:.4f}x)  "
              f"default {default:.4f}s ({default / off:.4f}x; {default / gathers:.4f}x all-gathers only), "
              f"{args.steps} interleaved steps each")
        pairs = [d / g for d, g in zip(times["1"], times["all-gathers"])]
        print(f"default / all-gathers only, median of per-step ratios: {statistics.median(pairs):.4f}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    mp.start_processes(rank_main, args=(args.world_size, free_port(), args), nprocs=args.world_size,
                       start_method="spawn")


if __name__ == "__main__":
    main()
