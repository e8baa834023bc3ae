"""Train a small GPT sharded with fsdp_compose.

    python examples/train.py                       # spawns 2 gloo ranks on CPU
    torchrun --nproc-per-node 4 examples/train.py  # or any launcher that sets RANK/WORLD_SIZE
    python examples/train.py --checkpoint-dir ckpt # save every --save-every steps; resume if present
    python examples/train.py --profile trace       # also write a one-step trace (open in ui.perfetto.dev)

Sharding is the ``fully_shard`` calls; code written for ``torch.distributed.fsdp.fully_shard``
runs with the import changed. ``--checkpoint-dir`` adds fsdp_compose's atomic checkpoints.
Rank 0 prints what the run is (the model, its groups, the traffic and memory ``fsdp_compose.explain``
predicts) and, per step, the loss (mean over ranks), step time and peak memory (max over ranks: RSS
on CPU, allocated on GPU), tokens/s, and the bytes each rank sent to the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
# this example's gpt.py, and this checkout's fsdp_compose even where an install points elsewhere (an editable
# install of another checkout: the example then failed at its first import)
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from gpt import GPT, GPTConfig, lm_loss, synthetic_batch  # noqa: E402

from fsdp_compose import (  # noqa: E402
    checkpoint_exists,
    collective_bytes,
    explain,
    fully_shard,
    load_checkpoint,
    save_checkpoint,
)

# the whole process's peak on CPU (torch itself is most of it); tensors alone on an accelerator
if torch.cuda.is_available():
    MEMORY_LABEL, MEMORY_MEANING = "peak alloc", "every tensor on the GPU, activations included"
else:
    MEMORY_LABEL, MEMORY_MEANING = "peak RSS", "the whole process's memory, torch itself included"



def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    elif os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM, the peak resident set
            f.write("5")


def peak_memory() -> float:
    """This step's peak: allocated accelerator memory, or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("nan")


def figures(loss: torch.Tensor, seconds: float, memory: float) -> tuple[float, float, float]:
    """(mean loss, max step time, max peak memory) over ranks, in one small all-gather."""
    mine = torch.tensor([loss.item(), seconds, memory], dtype=torch.float64)
    every = mine.new_empty(dist.get_world_size() * 3)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(every, mine)
    every = every.view(-1, 3)
    return every[:, 0].mean().item(), every[:, 1].max().item(), every[:, 2].max().item()


def print_start(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int) -> None:
    """What the run is, in plain words, with the figures ``explain`` predicts (local: no communication)."""
    plan = explain(model, optimizer).totals
    print(
        f"{world_size} ranks train a GPT of {plan.params:,} parameters ({mib(plan.param_bytes)}), sharded in "
        f"{plan.groups} groups (one per block, and the root); each rank keeps 1/{world_size} of every parameter",
        flush=True,
    )
    print(
        f"each step, each rank sends {mib(plan.sent_per_step)} to the others: each block's parameters gathered "
        "for forward and again for backward (the root's once), every gradient reduce-scattered once",
        flush=True,
    )
    print(
        f"predicted memory per rank: {mib(plan.predicted_peak_bytes)} (parameters, optimizer state, gathered "
        f'groups; no activations); "{MEMORY_LABEL}" below: {MEMORY_MEANING}',
        flush=True,
    )


def train(args: argparse.Namespace) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights on every rank
    cfg = GPTConfig()
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print_start(model, optimizer, world_size)
    start = 0
    if args.checkpoint_dir and checkpoint_exists(args.checkpoint_dir):  # the previous one counts too
        start, _ = load_checkpoint(args.checkpoint_dir, model, optimizer)  # any world size
        if rank == 0:
            print(f"resumed from {args.checkpoint_dir} at step {start}", flush=True)
    profile_step = start + 1 if args.steps - start > 1 else start  # after the first: a steady-state step
    tokens = args.batch_size * cfg.seq_len * world_size
    for step in range(start, args.steps):
        profiler = None
        if args.profile and step == profile_step:
            # acc_events=True: torch 2.11 warns without it, even for one cycle
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True)
            profiler.__enter__()
        reset_peak_memory()
        moved = collective_bytes(model)
        began = time.perf_counter()
        loss = lm_loss(model, synthetic_batch(cfg, args.batch_size, step, rank))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - began
        sent = (collective_bytes(model) - moved) * (world_size - 1) / world_size  # a ring sends (N-1)/N of each
        if profiler is not None:
            profiler.__exit__(None, None, None)
            os.makedirs(args.profile, exist_ok=True)
            trace = os.path.join(args.profile, f"trace_rank{rank}.json")
            profiler.export_chrome_trace(trace)
        mean_loss, step_time, memory = figures(loss.detach(), seconds, peak_memory())
        if rank == 0:
            print(
                f"step {step:3d}  loss {mean_loss:.4f}  {step_time * 1e3:6.1f} ms  {tokens / step_time:7,.0f} tok/s  "
                f"{MEMORY_LABEL} {mib(memory)}  sent {mib(sent)}",
                flush=True,
            )
            if profiler is not None:
                print(f"wrote a one-step trace of step {step} to {args.profile}/trace_rank*.json "
                      "(open in ui.perfetto.dev or chrome://tracing)", flush=True)
        done = step + 1
        if args.checkpoint_dir and (done % args.save_every == 0 or done == args.steps):
            save_checkpoint(args.checkpoint_dir, model, optimizer, step=done)
            if rank == 0:
                print(f"saved checkpoint of step {done} to {args.checkpoint_dir}", flush=True)


def train_and_exit(args: argparse.Namespace) -> None:
    """Train, then tear the process group down; the process exits normally (status 0)."""
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    train_and_exit(args)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (not global)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--nprocs", type=int, default=2, help="ranks to spawn when not under torchrun")
    parser.add_argument("--checkpoint-dir", default=None, help="save here every --save-every steps; resume from it")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--profile", default=None, metavar="DIR", help="write a torch.profiler trace of one step here")
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun or another launcher
        dist.init_process_group("gloo")
        train_and_exit(args)
    else:
        mp.start_processes(run_rank, args=(args.nprocs, free_port(), args), nprocs=args.nprocs, start_method="spawn")


if __name__ == "__main__":
    main()
